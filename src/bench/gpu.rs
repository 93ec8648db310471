//! `actorllm bench latency` and `actorllm bench throughput` (vLLM's two offline benchmarks),
//! each printed beside the bandwidth bound of the model: weight bytes / measured copy
//! bandwidth of the device it runs on.

use std::time::Instant;

use futures::StreamExt;
use serde::Serialize;

use super::prompt;
use crate::config::{DeviceArg, EngineArgs};
use crate::engine::Engine;
use crate::kernels::cuda::CudaDevice;
use crate::metrics::{StepBreakdown, StepProfile};
use crate::request::{SamplingParams, TokenEvent};
use crate::sampling::uniform;

/// Bytes/s a device copies (reads + writes), the bound for weight-streaming decode.
fn copy_bandwidth(args: &EngineArgs) -> f64 {
    let cuda = match args.device {
        DeviceArg::Cuda => true,
        DeviceArg::Cpu => false,
        DeviceArg::Auto => CudaDevice::available(),
    };
    if cuda && let Ok(bw) = CudaDevice::new(0).and_then(|d| d.copy_bandwidth()) {
        return bw;
    }
    let n = 256usize << 20;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    dst.copy_from_slice(&src);
    let start = Instant::now();
    for _ in 0..3 {
        dst.copy_from_slice(std::hint::black_box(&src));
    }
    std::hint::black_box(&dst);
    (3 * 2 * n) as f64 / start.elapsed().as_secs_f64()
}

#[derive(Debug, Serialize)]
struct Bound {
    /// The weights one token's forward reads (a mixture-of-experts model's chosen experts
    /// only).
    weight_bytes: usize,
    copy_bandwidth_gb_s: f64,
    /// Batch-1 decode can not beat reading those weights once per token.
    bound_tokens_per_s: f64,
}

fn bound(engine: &Engine, args: &EngineArgs) -> Bound {
    // Memory traffic of a copy (bytes read + written per second): the rate at which the
    // device moves bytes, each weight byte moving once per decode step.
    // Under tensor parallelism each rank streams its share of the weights at once.
    let bw = copy_bandwidth(args);
    let tp = engine.config().tensor_parallel_size as f64;
    Bound {
        weight_bytes: engine.active_weight_bytes(),
        copy_bandwidth_gb_s: bw / 1e9,
        bound_tokens_per_s: bw * tp / engine.active_weight_bytes() as f64,
    }
}

#[derive(Debug, Serialize)]
struct LatencyReport {
    batch_size: usize,
    input_len: usize,
    output_len: usize,
    /// Sequences per prompt, and whether they are a beam search's beams.
    n: usize,
    use_beam_search: bool,
    /// Of decode steps, once every sequence had its first token (not for a beam search,
    /// whose tokens all come at its end).
    #[serde(skip_serializing_if = "Option::is_none")]
    ms_per_step: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tokens_per_s: Option<f64>,
    /// Until every sequence had its first token (batch 1: time to first token).
    first_token_ms: f64,
    /// Submission to the end of the last sequence.
    latency_ms: f64,
    bound: Bound,
    #[serde(skip_serializing_if = "Option::is_none")]
    breakdown: Option<StepBreakdown>,
}

/// The shape of a latency run.
pub struct LatencyRun {
    pub batch_size: usize,
    pub input_len: usize,
    pub output_len: usize,
    pub breakdown: bool,
    /// A JSON schema (text or file) every output follows.
    pub guided_json: Option<String>,
    /// Sequences per prompt, sampled or (`use_beam_search`) the beams of a beam search.
    pub n: usize,
    pub use_beam_search: bool,
}

pub async fn latency(args: EngineArgs, run: LatencyRun, json: bool) -> anyhow::Result<()> {
    let LatencyRun { batch_size, input_len, output_len, .. } = run;
    let engine = Engine::start(args.clone()).await?;
    let guide = match &run.guided_json {
        Some(s) => {
            let text =
                if std::path::Path::new(s).is_file() { std::fs::read_to_string(s)? } else { s.clone() };
            let schema: serde_json::Value = serde_json::from_str(&text)?;
            let spec = crate::structured::GuideSpec::JsonSchema(schema);
            Some(engine.compile_guide(spec).map_err(|e| anyhow::anyhow!("--guided-json: {e}"))?)
        }
        None => None,
    };
    let opts = super::DecodeOpts { guide: guide.as_ref(), n: run.n, beam: run.use_beam_search, loras: 0 };
    super::decode_run_with(&engine, batch_size, input_len, 8, &opts).await?;
    let before = engine.metrics().profile.snapshot();
    let f = super::decode_run_with(&engine, batch_size, input_len, output_len, &opts).await?;
    let breakdown = StepProfile::between(before, engine.metrics().profile.snapshot());
    let report = LatencyReport {
        batch_size,
        input_len,
        output_len,
        n: run.n.max(1),
        use_beam_search: run.use_beam_search,
        ms_per_step: (!run.use_beam_search).then_some(f.ms_per_step),
        tokens_per_s: (!run.use_beam_search).then_some(f.decode_tokens_per_s),
        first_token_ms: f.first_token_ms,
        latency_ms: f.latency_ms,
        bound: bound(&engine, &args),
        breakdown: run.breakdown.then_some(breakdown),
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else if run.use_beam_search {
        println!(
            "latency: batch {batch_size}, input {input_len}, output {output_len}, beam search of {} beams: \
             {:.1} ms end to end",
            report.n, report.latency_ms
        );
    } else {
        let per = if report.n > 1 { format!(", n {} sampled", report.n) } else { String::new() };
        println!(
            "latency: batch {batch_size}{per}, input {input_len}, output {output_len}: {:.2} ms/step, {:.1} tok/s \
             (bandwidth bound {:.1} tok/s: {:.2} GB of weights at {:.0} GB/s); first token after {:.1} ms; \
             {:.1} ms end to end",
            f.ms_per_step,
            f.decode_tokens_per_s,
            report.bound.bound_tokens_per_s,
            report.bound.weight_bytes as f64 / 1e9,
            report.bound.copy_bandwidth_gb_s,
            report.first_token_ms,
            report.latency_ms
        );
        if let Some(b) = report.breakdown {
            print_breakdown(&b);
        }
    }
    Ok(())
}

/// Where the steps' time went, one line.
fn print_breakdown(b: &StepBreakdown) {
    // With steps in flight together each step's time includes waiting for the one before:
    // the host's share shows only as the device's idle time between forwards.
    let host = if b.pipelined_steps == 0 {
        format!("host time per replayed step (all but the wait for the forward): {:.3} ms, ", b.graph_host_ms)
    } else {
        "(steps overlap: each one's time includes waiting for the one before it) ".to_string()
    };
    println!(
        "per step, over {} steps (prefill steps included): {:.3} ms = scheduling {:.3} + block \
         reservation {:.3} + input preparation {:.3} + forward issued {:.3} + sampling inputs {:.3} \
         (of which grammar masks {:.3}) + device wait (forward and sampling) {:.3} + output handling {:.3} + actor messaging {:.3}; \
         device allocations: {}; \
         steps replayed from CUDA graphs: {}, {host}device idle before each replayed forward: \
         {:.3} ms; then, while the next step runs, event delivery {:.3} ms; steps planned while \
         another ran: {}; steps issued before the last one's tokens were back (fed on the device): {}",
        b.steps,
        b.step_ms,
        b.schedule_ms,
        b.blocks_ms,
        b.prepare_ms,
        b.launch_ms,
        b.sample_ms,
        b.mask_ms,
        b.device_ms,
        b.output_ms,
        b.messaging_ms,
        b.device_allocations,
        b.graph_steps,
        b.graph_idle_ms,
        b.events_ms,
        b.pipelined_steps,
        b.fed_steps
    );
}

/// Log-normal lengths with the given mean (σ = 0.8), clamped, from a fixed seed.
fn lengths(n: usize, mean: f64, seed: u64, lo: usize, hi: usize) -> Vec<usize> {
    let sigma = 0.8f64;
    let mu = mean.ln() - sigma * sigma / 2.0;
    (0..n)
        .map(|i| {
            let (u1, u2) = (uniform(seed, i, 0).max(1e-12), uniform(seed, i, 1));
            let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
            ((mu + sigma * z).exp().round() as usize).clamp(lo, hi)
        })
        .collect()
}

#[derive(Debug, Serialize)]
struct ThroughputReport {
    requests: usize,
    temperature: f32,
    top_p: f32,
    mean_input_len: f64,
    mean_output_len: f64,
    seconds: f64,
    requests_per_s: f64,
    output_tokens_per_s: f64,
    total_tokens_per_s: f64,
    bound: Bound,
    /// Where the steps' time went (every step of the run).
    breakdown: StepBreakdown,
    /// The same requests again on random LoRA adapters (`--random-loras`).
    lora: Option<LoraThroughput>,
}

#[derive(Debug, Serialize)]
struct LoraThroughput {
    adapters: usize,
    seconds: f64,
    output_tokens_per_s: f64,
    /// Of the base model's output tok/s in the run before, on the same engine.
    ratio_to_base: f64,
    breakdown: StepBreakdown,
}

/// The shape of a throughput run.
pub struct ThroughputRun {
    pub num_prompts: usize,
    /// Seeds the length mix (and, offset by the request index, each request's sampling).
    pub seed: u64,
    /// Temperature and top-p of every request.
    pub sampling: SamplingParams,
    /// With adapters `lora0` .. served: the requests run again, request i on `lora{i % loras}`.
    pub loras: usize,
}

/// One pass over the requests (request i on adapter `lora{i % loras}` when `loras` is not
/// 0): seconds, output tokens, and where the steps' time went.
async fn throughput_pass(
    engine: &Engine,
    inputs: &[usize],
    outputs: &[usize],
    run: &ThroughputRun,
    loras: usize,
) -> anyhow::Result<(f64, usize, StepBreakdown)> {
    let vocab = engine.model_config().vocab_size;
    let before = engine.metrics().profile.snapshot();
    let start = Instant::now();
    let mut streams = Vec::with_capacity(inputs.len());
    let salts = super::fresh_salts(inputs.len());
    for ((i, (&inp, &out)), salt) in inputs.iter().zip(outputs).enumerate().zip(salts) {
        let params = SamplingParams {
            max_tokens: Some(out),
            ignore_eos: true,
            seed: Some(run.seed + i as u64),
            ..run.sampling.clone()
        };
        let lora = (loras > 0).then(|| format!("lora{}", i % loras));
        let id = engine.next_request_id("tp");
        streams
            .push(engine.add_request_with_lora(id, prompt(inp, salt, vocab), params, lora.as_deref()).await?);
    }
    let counts = futures::future::join_all(streams.into_iter().map(|mut s| async move {
        let mut n = 0usize;
        while let Some(ev) = s.next().await {
            match ev {
                TokenEvent::Token { .. } => n += 1,
                TokenEvent::Done { .. } => break,
                TokenEvent::Error { message } => return Err(anyhow::anyhow!(message)),
                TokenEvent::Finished { .. } | TokenEvent::PromptLogprobs { .. } => {}
            }
        }
        Ok(n)
    }))
    .await
    .into_iter()
    .collect::<anyhow::Result<Vec<usize>>>()?;
    let secs = start.elapsed().as_secs_f64();
    let breakdown = StepProfile::between(before, engine.metrics().profile.snapshot());
    Ok((secs, counts.iter().sum(), breakdown))
}

pub async fn throughput(args: EngineArgs, run: ThroughputRun, json: bool) -> anyhow::Result<()> {
    let num_prompts = run.num_prompts;
    let engine = Engine::start(args.clone()).await?;
    let max_len = engine.config().max_model_len;
    let inputs = lengths(num_prompts, 200.0, run.seed, 4, 1024);
    let outputs: Vec<usize> = lengths(num_prompts, 180.0, run.seed ^ 0x5eed, 4, 1024)
        .into_iter()
        .zip(&inputs)
        .map(|(out, inp)| out.min(max_len - inp))
        .collect();
    let (secs, out_tokens, breakdown) = throughput_pass(&engine, &inputs, &outputs, &run, 0).await?;
    let in_tokens: usize = inputs.iter().sum();
    let lora = match run.loras {
        0 => None,
        n => {
            let (lsecs, ltokens, lbreakdown) = throughput_pass(&engine, &inputs, &outputs, &run, n).await?;
            let tps = ltokens as f64 / lsecs;
            Some(LoraThroughput {
                adapters: n,
                seconds: lsecs,
                output_tokens_per_s: tps,
                ratio_to_base: tps / (out_tokens as f64 / secs),
                breakdown: lbreakdown,
            })
        }
    };
    let report = ThroughputReport {
        requests: num_prompts,
        temperature: run.sampling.temperature,
        top_p: run.sampling.top_p,
        mean_input_len: in_tokens as f64 / num_prompts as f64,
        mean_output_len: out_tokens as f64 / num_prompts as f64,
        seconds: secs,
        requests_per_s: num_prompts as f64 / secs,
        output_tokens_per_s: out_tokens as f64 / secs,
        total_tokens_per_s: (in_tokens + out_tokens) as f64 / secs,
        bound: bound(&engine, &args),
        breakdown,
        lora,
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "throughput: {} requests (input {:.0}, output {:.0} tokens on average, temperature {}, top_p {}) in \
             {:.1} s: {:.2} req/s, {:.0} output tok/s, {:.0} total tok/s (batch-1 bandwidth bound {:.1} tok/s)",
            report.requests,
            report.mean_input_len,
            report.mean_output_len,
            report.temperature,
            report.top_p,
            secs,
            report.requests_per_s,
            report.output_tokens_per_s,
            report.total_tokens_per_s,
            report.bound.bound_tokens_per_s
        );
        print_breakdown(&report.breakdown);
        if let Some(l) = &report.lora {
            println!(
                "  … on {} adapters (request i on adapter i mod {}): {:.1} s, {:.0} output tok/s ({:.1}% of the base model)",
                l.adapters,
                l.adapters,
                l.seconds,
                l.output_tokens_per_s,
                100.0 * l.ratio_to_base
            );
            print_breakdown(&l.breakdown);
        }
    }
    Ok(())
}
