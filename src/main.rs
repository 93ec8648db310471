//! The `actorllm` command line: serve, run-batch, generate, bench, import-gguf and
//! make-random-model.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use actorllm::config::EngineArgs;
use actorllm::gguf::import::{ImportDtype, ImportOptions, import_gguf};
use actorllm::request::SamplingParams;
use actorllm::tokenizer::ChatMessage;
use actorllm::{Engine, TokenEvent};
use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use futures::StreamExt;

#[derive(Parser)]
#[command(name = "actorllm", version, about = "An LLM serving engine built from actix actors")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Convert a llama.cpp GGUF file into a Hugging Face model directory.
    ImportGguf {
        file: PathBuf,
        out: PathBuf,
        /// Dtype of the dequantized weights.
        #[arg(long, value_enum, default_value_t = ImportDtype::F32)]
        dtype: ImportDtype,
        /// Keep Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K matrices in their blocks, for the CPU's quantized
        /// kernels (other types are dequantized).
        #[arg(long)]
        keep_quantized: bool,
    },
    /// Serve the OpenAI-compatible API, the WebSocket protocol and the playground.
    Serve(actorllm::web::ServeArgs),
    /// Run an OpenAI batch file (JSONL requests) through the engine, as vLLM's run-batch.
    RunBatch(actorllm::web::batch::RunBatchArgs),
    /// Generate text from a prompt (or a chat message) and print it as it is produced.
    Generate(GenerateArgs),
    /// Write a model directory of a known architecture's shapes with random weights.
    MakeRandomModel {
        #[arg(long, value_enum)]
        like: actorllm::models::random::Like,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, value_enum, default_value_t = actorllm::config::DTypeArg::Bfloat16)]
        dtype: actorllm::config::DTypeArg,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Write config.json and the tokenizer only, to serve with `--load-format dummy`
        /// (the shapes of models too large to write out).
        #[arg(long)]
        no_weights: bool,
    },
    /// Offline engine benchmarks (no HTTP).
    Bench(actorllm::bench::BenchArgs),
}

#[derive(clap::Args)]
struct GenerateArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// Raw prompt text (completion).
    #[arg(long, conflicts_with = "chat", required_unless_present = "chat")]
    prompt: Option<String>,
    /// A user message, sent through the model's chat template.
    #[arg(long)]
    chat: Option<String>,
    /// System message for --chat.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    #[command(flatten)]
    sampling: SamplingArgs,
}

/// vLLM's SamplingParams as flags (the engine's `--seed` seeds the sampling).
#[derive(clap::Args)]
struct SamplingArgs {
    #[arg(long, default_value_t = 1)]
    n: usize,
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = -1)]
    top_k: i32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    #[arg(long, default_value_t = 0)]
    min_tokens: usize,
    #[arg(long)]
    stop: Vec<String>,
    #[arg(long, value_delimiter = ',')]
    stop_token_ids: Vec<u32>,
    #[arg(long)]
    ignore_eos: bool,
}

impl SamplingArgs {
    fn params(&self) -> SamplingParams {
        SamplingParams {
            n: self.n,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            max_tokens: Some(self.max_tokens),
            min_tokens: self.min_tokens,
            stop: self.stop.clone(),
            stop_token_ids: self.stop_token_ids.clone(),
            ignore_eos: self.ignore_eos,
            ..SamplingParams::default()
        }
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // RUST_LOG wins; else `serve --uvicorn-log-level` (info by default).
    let level = match &cli.cmd {
        Cmd::Serve(a) => a.uvicorn_log_level.directive(),
        _ => "info",
    };
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
            let others = if level == "error" { "error" } else { "warn" };
            format!("actorllm={level},{others}").into()
        }))
        .with_writer(std::io::stderr)
        // Colour only on a terminal: logs piped to a file or a collector stay plain text.
        .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none())
        .init();
    match cli.cmd {
        Cmd::ImportGguf { file, out, dtype, keep_quantized } => {
            import_gguf(&file, &out, ImportOptions { dtype, keep_quantized })
                .with_context(|| format!("importing {}", file.display()))?;
            eprintln!("wrote {}", out.display());
            Ok(())
        }
        Cmd::MakeRandomModel { like, out, dtype, seed, no_weights } => {
            use actorllm::config::DTypeArg;
            use actorllm::kernels::DType;
            let dtype = match dtype {
                DTypeArg::Float32 => DType::F32,
                DTypeArg::Float16 => DType::F16,
                DTypeArg::Bfloat16 | DTypeArg::Auto => DType::BF16,
            };
            like.write(&out, dtype, seed, !no_weights)?;
            eprintln!("wrote {}", out.display());
            Ok(())
        }
        Cmd::Serve(args) => with_engine_threads(async move {
            actorllm::web::serve(args).await?;
            Ok(())
        }),
        Cmd::RunBatch(args) => with_engine_threads(async move {
            actorllm::web::batch::run(args).await?;
            Ok(())
        }),
        Cmd::Generate(args) => with_engine_threads(generate(args)),
        Cmd::Bench(args) => with_engine_threads(actorllm::bench::run(args)),
    }
}

/// Runs `fut` in an actix System, then lets the ModelRunner threads release their devices
/// before the process exits (a GPU context or NCCL communicator torn down by the exit
/// handlers while its thread still uses it can crash the process).
fn with_engine_threads(fut: impl std::future::Future<Output = anyhow::Result<()>>) -> anyhow::Result<()> {
    let res = actix::System::new().block_on(fut);
    actorllm::actors::model_runner::wait_for_runners(std::time::Duration::from_secs(10));
    res
}

async fn generate(args: GenerateArgs) -> anyhow::Result<()> {
    let engine = Engine::start(args.engine).await?;
    let tok = engine.tokenizer().clone();
    let prompt_ids = match (&args.prompt, &args.chat) {
        (Some(p), _) => tok.encode(p, true)?,
        (None, Some(c)) => {
            let mut msgs = Vec::new();
            if let Some(s) = &args.system {
                msgs.push(ChatMessage { role: "system".into(), content: s.clone(), ..Default::default() });
            }
            msgs.push(ChatMessage { role: "user".into(), content: c.clone(), ..Default::default() });
            tok.encode(&tok.apply_chat_template(&msgs, true)?, false)?
        }
        (None, None) => bail!("give --prompt or --chat"),
    };
    let params = args.sampling.params();
    let n = params.n;
    let id = engine.next_request_id("gen");
    let mut stream = engine.add_request(id, prompt_ids, params).await?;
    let mut texts = vec![String::new(); n];
    let mut stdout = std::io::stdout();
    while let Some(ev) = stream.next().await {
        match ev {
            TokenEvent::Token { index, text, .. } => {
                if n == 1 {
                    write!(stdout, "{text}")?;
                    stdout.flush()?;
                }
                texts[index].push_str(&text);
            }
            TokenEvent::Finished { index, reason, .. } => {
                if n > 1 {
                    println!("--- choice {index} ({}) ---\n{}", reason.as_str(), texts[index]);
                }
            }
            TokenEvent::Done { usage } => {
                println!();
                eprintln!("[{} prompt + {} generated tokens]", usage.prompt_tokens, usage.completion_tokens);
                break;
            }
            TokenEvent::Error { message } => bail!("generation failed: {message}"),
            // This command does not ask for them.
            TokenEvent::PromptLogprobs { .. } => {}
        }
    }
    Ok(())
}
