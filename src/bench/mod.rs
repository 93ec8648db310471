//! Benchmarks. `actorllm bench offline`: engine throughput without HTTP, decode tokens/s at
//! each batch size (sequences started together, EOS ignored) and prefill tokens/s for one
//! long prompt. `actorllm bench serve` (serve.rs): concurrent streaming HTTP clients.
//! Figures go to stdout as text, or as JSON with `--json`.

pub mod gpu;
pub mod serve;

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde::Serialize;

use crate::config::EngineArgs;
use crate::engine::{Engine, RequestStream};
use crate::request::{SamplingParams, TokenEvent};

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub mode: BenchMode,
}

#[derive(Debug, clap::Subcommand)]
pub enum BenchMode {
    /// Decode tokens/s at several batch sizes and prefill tokens/s, through the Engine.
    Offline {
        #[command(flatten)]
        engine: EngineArgs,
        /// Concurrent sequences per run (comma separated).
        #[arg(long, value_delimiter = ',', default_value = "1,16")]
        batch_sizes: Vec<usize>,
        /// Prompt tokens of each decode sequence.
        #[arg(long, default_value_t = 32)]
        input_len: usize,
        /// Generated tokens per sequence.
        #[arg(long, default_value_t = 128)]
        output_len: usize,
        /// Prompt tokens of the prefill run.
        #[arg(long, default_value_t = 500)]
        prefill_len: usize,
        /// Also run each batch with its requests spread over this many random LoRA adapters
        /// (written to a temp dir), and report the ratio to the base model.
        #[arg(long, default_value_t = 0)]
        random_loras: usize,
        #[arg(long, default_value_t = 16)]
        random_lora_rank: usize,
        #[arg(long)]
        json: bool,
    },
    /// Concurrent streaming clients against the HTTP server.
    Serve(Box<serve::ServeBenchArgs>),
    /// Decode latency of one batch (vLLM's benchmark_latency): ms/step and tok/s beside
    /// the model's bandwidth bound.
    Latency {
        #[command(flatten)]
        engine: EngineArgs,
        #[arg(long, default_value_t = 1)]
        batch_size: usize,
        #[arg(long, default_value_t = 128)]
        input_len: usize,
        #[arg(long, default_value_t = 256)]
        output_len: usize,
        /// Also print where a decode step's time goes (host scheduling, input preparation,
        /// device time, sampling, output handling).
        #[arg(long)]
        breakdown: bool,
        /// Every request's output follows this JSON schema (the schema's text, or a file
        /// holding it): the cost of structured output's masks shows in --breakdown.
        #[arg(long)]
        guided_json: Option<String>,
        /// Sequences per prompt: sampled at temperature 1, or the beams of a beam search.
        #[arg(long, default_value_t = 1)]
        n: usize,
        /// A beam search of `n` beams per prompt (its `n` best hypotheses returned), timed
        /// end to end as the same `n` sampled sequences are.
        #[arg(long)]
        use_beam_search: bool,
        #[arg(long)]
        json: bool,
    },
    /// Offline throughput (vLLM's benchmark_throughput): requests with a fixed-seed
    /// ShareGPT-like length mix (input ≈ 200, output ≈ 180 tokens), all submitted at once.
    Throughput {
        #[command(flatten)]
        engine: EngineArgs,
        /// Requests in the run; their lengths come from the engine's `--seed` (0 when not
        /// given), which also seeds their sampling.
        #[arg(long, default_value_t = 1000)]
        num_prompts: usize,
        /// Sampling temperature of every request (vLLM's benchmark samples at 1.0; 0 is greedy).
        #[arg(long, default_value_t = 1.0)]
        temperature: f32,
        #[arg(long, default_value_t = 1.0)]
        top_p: f32,
        /// Also run the requests again spread over this many random LoRA adapters (written
        /// to a temp dir), request i on adapter i mod N, and report the ratio to the base
        /// model's run on the same engine.
        #[arg(long, default_value_t = 0)]
        random_loras: usize,
        #[arg(long, default_value_t = 16)]
        random_lora_rank: usize,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Serialize)]
pub(crate) struct DecodeFigure {
    batch_size: usize,
    /// Generated tokens in the run.
    tokens: usize,
    /// Generated tokens / time from the last first-token to the end (decode only).
    decode_tokens_per_s: f64,
    /// All generated tokens / wall time including prefill.
    total_tokens_per_s: f64,
    ms_per_step: f64,
    /// From submission until every sequence of the batch had its first token (at batch 1,
    /// the time to first token).
    first_token_ms: f64,
    /// From submission until the last sequence ended (vLLM's benchmark_latency figure).
    latency_ms: f64,
}

#[derive(Debug, Serialize)]
struct OfflineReport {
    model: String,
    dtype: String,
    weight_mib: usize,
    decode: Vec<DecodeFigure>,
    /// With `--random-loras`: each batch again, its requests spread over the adapters.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    on_adapters: Vec<AdapterFigure>,
    prefill_tokens: usize,
    prefill_tokens_per_s: f64,
}

/// A decode run over random LoRA adapters beside the base model's run of the same batch.
#[derive(Debug, Serialize)]
struct AdapterFigure {
    adapters: usize,
    #[serde(flatten)]
    figure: DecodeFigure,
    /// Its decode tok/s over the base model's.
    ratio_to_base: f64,
}

/// Deterministic prompt ids of length `len` from the ordinary (non-special) vocabulary.
/// (Skips the low ids, where vocabularies keep their special tokens, and the last two.)
/// Two salts less than the vocabulary's size apart give different first tokens, so that
/// the prefix cache finds nothing of one prompt in another.
pub(crate) fn prompt(len: usize, salt: usize, vocab: usize) -> Vec<u32> {
    let base = (vocab / 8).min(1000);
    (0..len).map(|i| (base + (i * 7919 + salt * 104729) % (vocab - base - 2)) as u32).collect()
}

/// `n` salts for [`prompt`] that no earlier run of this process used: each run of a benchmark
/// prefills its prompts whole, as vLLM's benchmarks mean to, instead of finding them in the
/// prefix cache from its warm-up or from the run before.
pub(crate) fn fresh_salts(n: usize) -> std::ops::Range<usize> {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let first = NEXT.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    first..first + n
}

/// Drains a stream; returns (time of first token, tokens).
async fn drain(mut s: RequestStream) -> anyhow::Result<(Option<Instant>, usize)> {
    let (mut first, mut n) = (None, 0);
    while let Some(ev) = s.next().await {
        match ev {
            TokenEvent::Token { .. } => {
                first.get_or_insert_with(Instant::now);
                n += 1;
            }
            TokenEvent::Error { message } => anyhow::bail!(message),
            TokenEvent::Done { .. } => break,
            TokenEvent::Finished { .. } | TokenEvent::PromptLogprobs { .. } => {}
        }
    }
    Ok((first, n))
}

pub(crate) async fn decode_run(
    engine: &Engine,
    batch: usize,
    input_len: usize,
    output_len: usize,
) -> anyhow::Result<DecodeFigure> {
    decode_run_with(engine, batch, input_len, output_len, &DecodeOpts::default()).await
}

/// What a decode run's requests ask for beyond one greedy sequence each.
#[derive(Default)]
pub(crate) struct DecodeOpts<'a> {
    /// Request b runs on adapter `lora{b % loras}` (none when 0).
    pub loras: usize,
    /// Every output follows this grammar (structured output).
    pub guide: Option<&'a crate::structured::Guide>,
    /// Sequences per request (0 or 1: one, greedy); more are sampled at temperature 1.
    pub n: usize,
    /// The `n` sequences are a beam search's beams.
    pub beam: bool,
}

/// As [`decode_run`], with `opts`.
pub(crate) async fn decode_run_with(
    engine: &Engine,
    batch: usize,
    input_len: usize,
    output_len: usize,
    opts: &DecodeOpts<'_>,
) -> anyhow::Result<DecodeFigure> {
    let vocab = engine.model_config().vocab_size;
    let n = opts.n.max(1);
    let beam = opts.beam.then_some(crate::request::BeamParams {
        width: n,
        length_penalty: 1.0,
        early_stopping: crate::request::EarlyStopping::Heuristic,
    });
    let params = SamplingParams {
        n,
        temperature: if n > 1 && beam.is_none() { 1.0 } else { 0.0 },
        max_tokens: Some(output_len),
        ignore_eos: true,
        guide: opts.guide.cloned(),
        beam,
        ..Default::default()
    };
    let start = Instant::now();
    let mut streams = Vec::new();
    for (b, salt) in fresh_salts(batch).enumerate() {
        let id = engine.next_request_id("bench");
        let lora = (opts.loras > 0).then(|| format!("lora{}", b % opts.loras));
        streams.push(
            engine
                .add_request_with_lora(id, prompt(input_len, salt, vocab), params.clone(), lora.as_deref())
                .await?,
        );
    }
    let results = futures::future::try_join_all(streams.into_iter().map(drain)).await?;
    let end = Instant::now();
    let tokens: usize = results.iter().map(|r| r.1).sum();
    let last_first = results.iter().filter_map(|r| r.0).max().unwrap_or(start);
    let decode_time = (end - last_first).max(Duration::from_micros(1)).as_secs_f64();
    let decode_tokens = tokens.saturating_sub(batch * n);
    Ok(DecodeFigure {
        batch_size: batch,
        tokens,
        decode_tokens_per_s: decode_tokens as f64 / decode_time,
        total_tokens_per_s: tokens as f64 / (end - start).as_secs_f64(),
        ms_per_step: decode_time * 1e3 / (output_len - 1).max(1) as f64,
        first_token_ms: (last_first - start).as_secs_f64() * 1e3,
        latency_ms: (end - start).as_secs_f64() * 1e3,
    })
}

/// Writes `n` random rank-`rank` adapters for the engine's model to a scratch directory and
/// serves them as `lora0` .. `lora{n-1}`, all in one batch (`--max-loras n`); the directory
/// goes when the returned guard drops, after the run. Nothing when n is 0.
fn with_random_loras(
    engine: &mut EngineArgs,
    n: usize,
    rank: usize,
) -> anyhow::Result<Option<crate::scratch::ScratchDir>> {
    if n == 0 {
        return Ok(None);
    }
    let cfg = crate::models::registry::ModelRegistry::<crate::kernels::cpu::CpuDevice>::default()
        .read_config(&engine.model)?;
    let root = crate::scratch::ScratchDir::new("bench-loras")?;
    for i in 0..n {
        let dir = root.join(format!("lora{i}"));
        crate::models::random::make_random_lora(&cfg, &dir, rank, i as u64 + 1)?;
        engine.lora.lora_modules.push((format!("lora{i}"), dir));
    }
    engine.lora.enable_lora = true;
    engine.lora.max_loras = n;
    engine.lora.max_lora_rank = rank;
    Ok(Some(root))
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let mut args = args;
    // The offline benchmarks run as vLLM's LLM class does: its larger default batches.
    match &mut args.mode {
        BenchMode::Offline { engine, .. }
        | BenchMode::Latency { engine, .. }
        | BenchMode::Throughput { engine, .. } => {
            // As vLLM's LLM class: no periodic stats line in the benchmark's output.
            engine.offline = true;
            engine.disable_log_stats = true;
        }
        BenchMode::Serve(_) => {}
    }
    let (eargs, batch_sizes, input_len, output_len, prefill_len, json, (loras, _adapters)) = match args.mode {
        BenchMode::Offline {
            engine,
            batch_sizes,
            input_len,
            output_len,
            prefill_len,
            json,
            random_loras,
            random_lora_rank,
        } => {
            let mut engine = engine;
            let adapters = with_random_loras(&mut engine, random_loras, random_lora_rank)?;
            (engine, batch_sizes, input_len, output_len, prefill_len, json, (random_loras, adapters))
        }
        BenchMode::Serve(a) => return serve::run(*a).await,
        BenchMode::Latency {
            engine,
            batch_size,
            input_len,
            output_len,
            breakdown,
            guided_json,
            n,
            use_beam_search,
            json,
        } => {
            let run = gpu::LatencyRun {
                batch_size,
                input_len,
                output_len,
                breakdown,
                guided_json,
                n,
                use_beam_search,
            };
            gpu::latency(engine, run, json).await?;
            actix::System::current().stop();
            return Ok(());
        }
        BenchMode::Throughput {
            mut engine,
            num_prompts,
            temperature,
            top_p,
            random_loras,
            random_lora_rank,
            json,
        } => {
            let sampling = SamplingParams { temperature, top_p, ..Default::default() };
            let seed = *engine.seed.get_or_insert(0);
            let _adapters = with_random_loras(&mut engine, random_loras, random_lora_rank)?;
            let run = gpu::ThroughputRun { num_prompts, seed, sampling, loras: random_loras };
            gpu::throughput(engine, run, json).await?;
            actix::System::current().stop();
            return Ok(());
        }
    };
    let engine = Engine::start(eargs).await?;
    // Warm-up: touches every weight page and the allocator.
    decode_run(&engine, 1, 16, 4).await?;
    let mut decode = Vec::new();
    let mut on_adapters = Vec::new();
    for &b in &batch_sizes {
        let f = decode_run(&engine, b, input_len, output_len).await?;
        if !json {
            println!(
                "decode batch {:>3}: {:>8.1} tok/s decode, {:>8.1} tok/s incl. prefill, {:>6.1} ms/step",
                b, f.decode_tokens_per_s, f.total_tokens_per_s, f.ms_per_step
            );
        }
        if loras > 0 {
            let opts = DecodeOpts { loras, ..DecodeOpts::default() };
            let l = decode_run_with(&engine, b, input_len, output_len, &opts).await?;
            let ratio_to_base = l.decode_tokens_per_s / f.decode_tokens_per_s;
            if !json {
                println!(
                    "  … on {loras} adapters: {:>8.1} tok/s decode ({:.1}% of the base model)",
                    l.decode_tokens_per_s,
                    100.0 * ratio_to_base
                );
            }
            on_adapters.push(AdapterFigure { adapters: loras, figure: l, ratio_to_base });
        }
        decode.push(f);
    }
    let vocab = engine.model_config().vocab_size;
    let params =
        SamplingParams { temperature: 0.0, max_tokens: Some(1), ignore_eos: true, ..Default::default() };
    let start = Instant::now();
    let s = engine
        .add_request(
            engine.next_request_id("bench"),
            prompt(prefill_len, fresh_salts(1).start, vocab),
            params,
        )
        .await?;
    let (first, _) = drain(s).await?;
    let ttft = (first.unwrap_or_else(Instant::now) - start).as_secs_f64();
    let report = OfflineReport {
        model: engine.config().model_dir.display().to_string(),
        dtype: format!("{:?}", engine.config().dtype),
        weight_mib: engine.weight_bytes() >> 20,
        decode,
        on_adapters,
        prefill_tokens: prefill_len,
        prefill_tokens_per_s: prefill_len as f64 / ttft,
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "prefill {prefill_len} tokens: {:.1} tok/s ({:.0} ms)",
            report.prefill_tokens_per_s,
            ttft * 1e3
        );
    }
    actix::System::current().stop();
    Ok(())
}
