//! `actorllm bench serve`: a load generator of N concurrent streaming clients against the
//! HTTP server. Reports time to first token and inter-token latency percentiles and
//! output tokens/s per concurrency level. Without `--url` it starts the server in-process
//! and also runs the same load straight through the Engine, to show what HTTP adds.

use std::time::Instant;

use serde::Serialize;
use serde_json::json;

use super::{decode_run, prompt};
use crate::engine::Engine;
use crate::web::ServeArgs;

#[derive(Debug, clap::Args)]
pub struct ServeBenchArgs {
    /// A running server; when absent one is started in-process on a free port.
    #[arg(long)]
    pub url: Option<String>,
    /// Concurrent clients per run (comma separated).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub concurrency: Vec<usize>,
    /// Requests each client sends, one after another.
    #[arg(long, default_value_t = 2)]
    pub requests_per_client: usize,
    #[arg(long, default_value_t = 32)]
    pub input_len: usize,
    #[arg(long, default_value_t = 128)]
    pub output_len: usize,
    /// `random`: independent prompts of --input-len. `chat`: --conversations clients, each
    /// sending --turns turns one after another over one --system-len system prompt that
    /// every conversation shares; each turn's prompt is the conversation so far (system,
    /// then every earlier turn's user message and reply) and a new user message of
    /// --turn-len tokens, as chat clients resend it.
    #[arg(long, value_enum, default_value_t = Workload::Random)]
    pub workload: Workload,
    #[arg(long, default_value_t = 64)]
    pub conversations: usize,
    #[arg(long, default_value_t = 8)]
    pub turns: usize,
    #[arg(long, default_value_t = 2000)]
    pub system_len: usize,
    #[arg(long, default_value_t = 64)]
    pub turn_len: usize,
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub server: ServeArgs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    Random,
    Chat,
}

#[derive(Debug, Default, Serialize)]
pub struct Percentiles {
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
}

fn percentiles(mut v: Vec<f64>) -> Percentiles {
    if v.is_empty() {
        return Percentiles::default();
    }
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize] * 1e3;
    Percentiles { p50_ms: at(0.5), p90_ms: at(0.9), p99_ms: at(0.99) }
}

#[derive(Debug, Serialize)]
pub struct ServeFigure {
    pub concurrency: usize,
    pub requests: usize,
    pub output_tokens_per_s: f64,
    pub ttft: Percentiles,
    pub itl: Percentiles,
    /// The same load through the Engine without HTTP (in-process runs only).
    pub offline_tokens_per_s: Option<f64>,
}

/// What one streamed request saw: time to first token (s), the gaps between tokens (s),
/// and the tokens counted.
pub type StreamTiming = (f64, Vec<f64>, usize);

/// One streamed request to `url` (`http://host:port`) at `path`, on a connection of its own
/// with Nagle's algorithm off and the request in one write, its bytes read as they arrive:
/// a client that batched its writes or its reads would add the delayed-ACK wait (about
/// 40 ms) to the first token and report the rest in bursts.
pub async fn stream_request(url: &str, path: &str, body: &serde_json::Value) -> anyhow::Result<StreamTiming> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let host = url.strip_prefix("http://").ok_or_else(|| anyhow::anyhow!("{url}: only http:// URLs"))?;
    let body = serde_json::to_vec(body)?;
    let mut request = format!(
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
         Accept: text/event-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(&body);
    let mut sock = tokio::net::TcpStream::connect(host).await?;
    sock.set_nodelay(true)?;
    let start = Instant::now();
    sock.write_all(&request).await?;
    let (mut first, mut last, mut gaps, mut tokens) = (None, Instant::now(), Vec::new(), 0usize);
    let (mut raw, mut events) = (Vec::new(), Vec::new());
    let mut chunked = None;
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = sock.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
        if chunked.is_none() {
            let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") else { continue };
            let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
            anyhow::ensure!(
                head.starts_with("http/1.1 200"),
                "server answered {}",
                head.lines().next().unwrap_or("")
            );
            chunked = Some(head.contains("transfer-encoding: chunked"));
            raw.drain(..end + 4);
        }
        // The body so far, out of its chunk framing.
        if chunked == Some(true) {
            while let Some(line) = raw.windows(2).position(|w| w == b"\r\n") {
                let size = usize::from_str_radix(std::str::from_utf8(&raw[..line])?.trim(), 16)?;
                if raw.len() < line + 2 + size + 2 {
                    break;
                }
                events.extend_from_slice(&raw[line + 2..line + 2 + size]);
                raw.drain(..line + 2 + size + 2);
            }
        } else {
            events.append(&mut raw);
        }
        while let Some(end) = events.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = events.drain(..end + 2).collect();
            let event = String::from_utf8_lossy(&event);
            let Some(data) = event.trim_end().strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(data)?;
            if v["choices"][0]["text"].as_str().is_some_and(|t| !t.is_empty())
                || v["choices"][0]["logprobs"].is_object()
            {
                let now = Instant::now();
                match first {
                    None => first = Some(now - start),
                    Some(_) => gaps.push((now - last).as_secs_f64()),
                }
                last = now;
                tokens += 1;
            }
            if let Some(u) = v["usage"]["completion_tokens"].as_u64() {
                tokens = u as usize;
            }
        }
    }
    Ok((first.unwrap_or_default().as_secs_f64(), gaps, tokens))
}

/// Where the clients' prompt ids come from.
enum Prompts {
    /// The in-process model's vocabulary size: [`prompt`]'s ids.
    Vocab(usize),
    /// A server elsewhere, whose vocabulary is unknown here: ids it gave for a text
    /// through `/tokenize`, taken in turn.
    Tokenized(Vec<u32>),
}

/// A paragraph that any tokenizer turns into ids of its ordinary vocabulary.
const PROMPT_TEXT: &str = "The history of the river valley begins with farmers who settled along its \
    banks, built canals to water their fields, traded grain and wool with towns downstream, and \
    recorded the floods of each year on stones that still stand beside the old bridge.";

impl Prompts {
    async fn of_server(client: &awc::Client, url: &str) -> anyhow::Result<Self> {
        let mut r = client
            .post(format!("{url}/tokenize"))
            .send_json(&json!({"prompt": PROMPT_TEXT, "add_special_tokens": false}))
            .await
            .map_err(|e| anyhow::anyhow!("{url}/tokenize: {e}"))?;
        anyhow::ensure!(r.status().is_success(), "{url}/tokenize answered {}", r.status());
        let v: serde_json::Value = r.json().await.map_err(|e| anyhow::anyhow!("{url}/tokenize: {e}"))?;
        let ids: Vec<u32> = serde_json::from_value(v["tokens"].clone())?;
        anyhow::ensure!(!ids.is_empty(), "{url}/tokenize gave no tokens");
        Ok(Self::Tokenized(ids))
    }

    fn prompt(&self, len: usize, salt: usize) -> Vec<u32> {
        match self {
            Self::Vocab(vocab) => prompt(len, salt, *vocab),
            Self::Tokenized(ids) => (0..len).map(|i| ids[(i + salt * 7) % ids.len()]).collect(),
        }
    }
}

async fn load(
    url: &str,
    clients: usize,
    per_client: usize,
    input_len: usize,
    output_len: usize,
    prompts: &Prompts,
) -> anyhow::Result<ServeFigure> {
    let start = Instant::now();
    let runs = (0..clients).map(|c| {
        async move {
            let mut out = Vec::new();
            for r in 0..per_client {
                // Token-id prompts and logprobs=0 make every token its own chunk.
                let body = json!({"prompt": prompts.prompt(input_len, c * 131 + r), "max_tokens": output_len,
                    "temperature": 0, "ignore_eos": true, "stream": true, "logprobs": 0,
                    "stream_options": {"include_usage": true}});
                out.push(stream_request(url, "/v1/completions", &body).await?);
            }
            anyhow::Ok(out)
        }
    });
    let results = futures::future::try_join_all(runs).await?;
    let wall = start.elapsed().as_secs_f64();
    let all: Vec<_> = results.into_iter().flatten().collect();
    let tokens: usize = all.iter().map(|r| r.2).sum();
    Ok(ServeFigure {
        concurrency: clients,
        requests: all.len(),
        output_tokens_per_s: tokens as f64 / wall,
        ttft: percentiles(all.iter().map(|r| r.0).collect()),
        itl: percentiles(all.iter().flat_map(|r| r.1.clone()).collect()),
        offline_tokens_per_s: None,
    })
}

/// What the chat workload measured.
#[derive(Debug, Serialize)]
pub struct ChatFigure {
    pub conversations: usize,
    pub turns: usize,
    pub requests: usize,
    pub seconds: f64,
    pub output_tokens_per_s: f64,
    /// Prompt tokens sent per second (the conversation resent every turn).
    pub prompt_tokens_per_s: f64,
    pub ttft_first_turn: Percentiles,
    pub ttft_later_turns: Percentiles,
}

/// The chat workload: every conversation a client of its own, its turns in order.
async fn chat(url: &str, args: &ServeBenchArgs, prompts: &Prompts) -> anyhow::Result<ChatFigure> {
    let system = prompts.prompt(args.system_len, 0);
    let start = Instant::now();
    let runs = (0..args.conversations).map(|c| {
        let system = system.clone();
        async move {
            let mut history = system;
            let mut out = Vec::new();
            for t in 0..args.turns {
                history.extend(prompts.prompt(args.turn_len, 1 + c * 64 + t));
                let body = json!({"prompt": history, "max_tokens": args.output_len, "temperature": 0,
                    "ignore_eos": true, "stream": true, "logprobs": 0});
                let timing = stream_request(url, "/v1/completions", &body).await?;
                out.push((t, history.len(), timing));
                // The reply as the client sends it back next turn: ids of the same length
                // (a reply re-tokenized need not give the sampled ids).
                history.extend(prompts.prompt(args.output_len, 1_000_000 + c * 64 + t));
            }
            anyhow::Ok(out)
        }
    });
    let results: Vec<_> = futures::future::try_join_all(runs).await?.into_iter().flatten().collect();
    let seconds = start.elapsed().as_secs_f64();
    let ttft =
        |later: bool| percentiles(results.iter().filter(|r| (r.0 > 0) == later).map(|r| r.2.0).collect());
    Ok(ChatFigure {
        conversations: args.conversations,
        turns: args.turns,
        requests: results.len(),
        seconds,
        output_tokens_per_s: results.iter().map(|r| r.2.2).sum::<usize>() as f64 / seconds,
        prompt_tokens_per_s: results.iter().map(|r| r.1).sum::<usize>() as f64 / seconds,
        ttft_first_turn: ttft(false),
        ttft_later_turns: ttft(true),
    })
}

pub async fn run(args: ServeBenchArgs) -> anyhow::Result<()> {
    let (url, engine) = match &args.url {
        Some(u) => (u.trim_end_matches('/').to_string(), None),
        None => {
            let mut sargs = args.server.clone();
            sargs.port = 0;
            let engine = Engine::start(sargs.engine.clone()).await?;
            let (server, addr) = crate::web::start_with_engine(sargs, engine.clone())?;
            actix_rt::spawn(server);
            (format!("http://{addr}"), Some(engine))
        }
    };
    let prompts = match &engine {
        Some(e) => Prompts::Vocab(e.model_config().vocab_size),
        None => Prompts::of_server(&awc::Client::default(), &url).await?,
    };
    if args.workload == Workload::Chat {
        let f = chat(&url, &args, &prompts).await?;
        match args.json {
            true => println!("{}", serde_json::to_string_pretty(&f)?),
            false => println!(
                "chat: {} conversations x {} turns over a {}-token system prompt: {:.1} s, {:.1} output tok/s, \
                 {:.0} prompt tok/s; TTFT first turn p50 {:.1} ms, later turns p50 {:.1} / p90 {:.1} ms",
                f.conversations,
                f.turns,
                args.system_len,
                f.seconds,
                f.output_tokens_per_s,
                f.prompt_tokens_per_s,
                f.ttft_first_turn.p50_ms,
                f.ttft_later_turns.p50_ms,
                f.ttft_later_turns.p90_ms
            ),
        }
        actix::System::current().stop();
        return Ok(());
    }
    let mut figures = Vec::new();
    for &c in &args.concurrency {
        let mut f =
            load(&url, c, args.requests_per_client, args.input_len, args.output_len, &prompts).await?;
        if let Some(e) = &engine {
            // The same work through the Engine: clients × requests, `c` at a time.
            let t = Instant::now();
            let mut tokens = 0;
            for _ in 0..args.requests_per_client {
                let d = decode_run(e, c, args.input_len, args.output_len).await?;
                tokens += d.tokens;
            }
            f.offline_tokens_per_s = Some(tokens as f64 / t.elapsed().as_secs_f64());
        }
        if !args.json {
            let off = f.offline_tokens_per_s.map_or(String::new(), |o| {
                format!(", offline {o:.1} tok/s (HTTP at {:.1}%)", 100.0 * f.output_tokens_per_s / o)
            });
            println!(
                "{:>3} clients: {:>7.1} tok/s, TTFT p50 {:.1} / p90 {:.1} / p99 {:.1} ms, ITL p50 {:.1} / p90 {:.1} / p99 {:.1} ms{off}",
                c,
                f.output_tokens_per_s,
                f.ttft.p50_ms,
                f.ttft.p90_ms,
                f.ttft.p99_ms,
                f.itl.p50_ms,
                f.itl.p90_ms,
                f.itl.p99_ms
            );
        }
        figures.push(f);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&figures)?);
    }
    actix::System::current().stop();
    Ok(())
}
