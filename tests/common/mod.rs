//! Helpers shared by the integration tests: model locations, a tiny random model written
//! by the test itself, and collecting a request's stream.
#![allow(dead_code)]

pub mod golden;
pub mod lora;
pub mod quantized;
pub mod server;
pub mod structured;

use std::path::{Path, PathBuf};

use actorllm::config::EngineArgs;
use actorllm::kernels::DType;
use actorllm::models::random::{Preset, make_random_model};
use actorllm::request::{FinishReason, PromptLogprob, StopReason, TokenEvent, Usage};
pub use actorllm::scratch::ScratchDir;
use actorllm::{Engine, RequestStream, SamplingParams};
use futures::StreamExt;

/// The default model, imported by `scripts/fetch_model.sh` (CI runs it first).
pub fn default_model() -> PathBuf {
    let dir = std::env::var_os("ACTORLLM_TEST_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct"));
    assert!(
        dir.join("model.safetensors").exists(),
        "default model missing at {}: run scripts/fetch_model.sh first",
        dir.display()
    );
    dir
}

/// A file or directory of the repository: under the crate's directory where the tests were
/// built, else under the current directory (the repository root of a copy on another
/// machine, such as a GPU host running binaries built elsewhere).
pub fn fixture(path: &str) -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    if built.exists() { built } else { Path::new(path).to_path_buf() }
}

/// A directory of the calling test's own, removed when it is dropped (see
/// [`actorllm::scratch`] for why tests never share one).
pub fn scratch(name: &str) -> ScratchDir {
    ScratchDir::new(name).expect("scratch directory")
}

/// Writes the tiny random Llama of `seed` into a directory of the caller's own.
pub fn tiny_model(seed: u64) -> ScratchDir {
    let dir = scratch(&format!("tiny-{seed}"));
    make_random_model(Preset::Tiny.shape(), dir.path(), DType::F32, seed, 4.0).expect("write tiny model");
    dir
}

pub fn args(model: impl AsRef<Path>) -> EngineArgs {
    EngineArgs { model: model.as_ref().to_path_buf(), ..EngineArgs::default() }
}

/// What one request produced: per choice tokens, text, finish reason and stop reason.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Outcome {
    pub tokens: Vec<Vec<u32>>,
    pub text: Vec<String>,
    pub finish: Vec<Option<FinishReason>>,
    pub stop: Vec<Option<StopReason>>,
    pub usage: Option<Usage>,
    pub prompt_logprobs: Option<Vec<Option<PromptLogprob>>>,
}

pub async fn collect(mut s: RequestStream, n: usize) -> Outcome {
    let mut o = Outcome {
        tokens: vec![Vec::new(); n],
        text: vec![String::new(); n],
        finish: vec![None; n],
        stop: vec![None; n],
        usage: None,
        prompt_logprobs: None,
    };
    while let Some(ev) = s.next().await {
        match ev {
            TokenEvent::PromptLogprobs { positions } => {
                assert!(o.tokens.iter().all(Vec::is_empty), "prompt logprobs come before the first token");
                assert!(o.prompt_logprobs.replace(positions).is_none(), "prompt logprobs come once");
            }
            TokenEvent::Token { index, token_id, text, .. } => {
                o.tokens[index].push(token_id);
                o.text[index].push_str(&text);
            }
            TokenEvent::Finished { index, reason, stop_reason } => {
                o.finish[index] = Some(reason);
                o.stop[index] = stop_reason;
            }
            TokenEvent::Done { usage } => {
                o.usage = Some(usage);
                break;
            }
            TokenEvent::Error { message } => panic!("request failed: {message}"),
        }
    }
    o
}

/// A tiny model's transformers reference (tests/fixtures/models/NAME.json, made by
/// scripts/make_model_goldens.py; `random::write_golden_model` rebuilds its weights).
pub fn model_golden(name: &str) -> serde_json::Value {
    let path = fixture(&format!("tests/fixtures/models/{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

/// The prompt ids of each run of a [`model_golden`] file.
pub fn golden_prompts(g: &serde_json::Value) -> Vec<Vec<u32>> {
    let ids =
        |v: &serde_json::Value| v.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
    g["runs"].as_array().unwrap().iter().map(|r| ids(&r["prompt_ids"])).collect()
}

/// `tokens` greedy tokens of `prompt` (EOS ignored), each with its top-5 logprobs.
pub async fn greedy_top5(engine: &Engine, prompt: Vec<u32>, tokens: usize) -> Vec<(u32, Vec<(u32, f32)>)> {
    greedy_top5_on(engine, prompt, tokens, None).await
}

/// [`greedy_top5`] on LoRA adapter `lora` (None: the base model).
pub async fn greedy_top5_on(
    engine: &Engine,
    prompt: Vec<u32>,
    tokens: usize,
    lora: Option<&str>,
) -> Vec<(u32, Vec<(u32, f32)>)> {
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: Some(tokens),
        ignore_eos: true,
        logprobs: Some(5),
        ..Default::default()
    };
    let id = engine.next_request_id("t");
    let mut s = engine.add_request_with_lora(id, prompt, params, lora).await.unwrap();
    let mut out = Vec::new();
    while let Some(ev) = s.next().await {
        match ev {
            TokenEvent::Token { token_id, logprobs, .. } => out.push((token_id, logprobs.unwrap().top)),
            TokenEvent::Error { message } => panic!("request failed: {message}"),
            TokenEvent::Done { .. } => break,
            TokenEvent::Finished { .. } | TokenEvent::PromptLogprobs { .. } => {}
        }
    }
    out
}

pub fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { temperature: 0.0, max_tokens: Some(max_tokens), ..SamplingParams::default() }
}

pub async fn run(engine: &Engine, prompt: Vec<u32>, params: SamplingParams) -> Outcome {
    let n = params.n;
    let s = engine.add_request(engine.next_request_id("t"), prompt, params).await.expect("request accepted");
    collect(s, n).await
}

/// Runs `prompt` while each of `others` runs beside it (all submitted at once); the
/// outcome of `prompt`.
pub async fn run_among(
    engine: &Engine,
    prompt: Vec<u32>,
    params: SamplingParams,
    others: Vec<(Vec<u32>, SamplingParams)>,
) -> Outcome {
    let crowd = others.into_iter().map(|(p, sp)| run(engine, p, sp));
    let (outcome, _) =
        futures::future::join(run(engine, prompt, params), futures::future::join_all(crowd)).await;
    outcome
}

/// Waits until every KV block is back in the pool (frees are applied at the next step).
pub async fn wait_all_blocks_free(engine: &Engine) -> (usize, usize) {
    let mut last = (0, 0);
    for _ in 0..200 {
        let (_, b) = engine.stats().await.expect("engine alive");
        last = (b.num_free, b.num_total);
        if b.num_free == b.num_total {
            return last;
        }
        actix_rt::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    last
}
