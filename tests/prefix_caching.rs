//! Automatic prefix caching on the default model: outputs are the same with it on and off
//! (greedy and seeded sampling, mixed LoRA adapters, prompts prefilled in chunks and
//! preempted under a small KV cache), later requests reuse the blocks earlier ones computed
//! (`usage.cached_tokens`), adapters never share blocks, and the server reports hits in
//! each response's usage and in /metrics under vLLM's names.

mod common;

use actorllm::Engine;
use actorllm::config::{EngineArgs, LoraArgs};
use actorllm::kernels::cpu::CpuDevice;
use actorllm::models::registry::ModelRegistry;
use actorllm::request::SamplingParams;
use common::Outcome;
use serde_json::json;

/// 70 tokens shared by every prompt (four full blocks of 16), then each prompt's own.
fn prompt(i: u32) -> Vec<u32> {
    let system = (0..70u32).map(|t| 200 + t * 37 % 3000);
    system.chain([1000 + i, 2000 + i * 3, 500 + i]).collect()
}

fn seeded(i: u64) -> SamplingParams {
    SamplingParams { temperature: 0.9, top_p: 0.95, seed: Some(i), ..common::greedy(12) }
}

/// Two waves: three prompts, then (once they are done) six, the first three again among
/// them, each under `lora[i % len]`.
async fn waves(args: EngineArgs, lora: &[Option<&'static str>]) -> Vec<Outcome> {
    waves_preempting(args, lora).await.0
}

/// [`waves`], and how many sequences were preempted on the way.
async fn waves_preempting(args: EngineArgs, lora: &[Option<&'static str>]) -> (Vec<Outcome>, u64) {
    let engine = Engine::start(args).await.unwrap();
    let run = |i: u32| {
        let engine = &engine;
        let params = if i.is_multiple_of(2) { common::greedy(12) } else { seeded(i as u64) };
        let adapter = lora[i as usize % lora.len()];
        async move {
            let id = engine.next_request_id("t");
            let s = engine.add_request_with_lora(id, prompt(i), params.clone(), adapter).await.unwrap();
            common::collect(s, params.n).await
        }
    };
    let mut out = futures::future::join_all((0..3).map(run)).await;
    out.extend(futures::future::join_all((0..6).map(run)).await);
    (out, engine.metrics().preemptions.load(std::sync::atomic::Ordering::Relaxed))
}

fn tokens(o: &[Outcome]) -> Vec<Vec<u32>> {
    o.iter().map(|o| o.tokens[0].clone()).collect()
}

fn cached(o: &[Outcome]) -> Vec<usize> {
    o.iter().map(|o| o.usage.unwrap().cached_tokens).collect()
}

fn off(args: EngineArgs) -> EngineArgs {
    EngineArgs { no_enable_prefix_caching: true, ..args }
}

#[actix_rt::test]
async fn outputs_are_the_same_with_caching_on_and_off() {
    let args = common::args(common::default_model());
    let on = waves(args.clone(), &[None]).await;
    let off = waves(off(args), &[None]).await;
    assert_eq!(tokens(&on), tokens(&off));
    assert!(cached(&off).iter().all(|&c| c == 0));
    // The first wave's three started together: none found the others' blocks computed.
    // Every later request found the system prompt's four blocks (the repeated ones more).
    let c = cached(&on);
    assert!(c[3..].iter().all(|&n| n >= 64), "{c:?}");
}

#[actix_rt::test]
async fn chunked_and_preempted_sequences_give_the_same_outputs() {
    // Prompts of 73 tokens take 5 blocks and grow to 6: ten blocks do not hold four.
    let small = EngineArgs {
        max_num_batched_tokens: Some(32),
        max_num_seqs: Some(4),
        num_gpu_blocks_override: Some(10),
        max_model_len: Some(96),
        ..common::args(common::default_model())
    };
    let (on, preempted) = waves_preempting(small.clone(), &[None]).await;
    assert!(preempted > 0, "no sequence was preempted");
    assert_eq!(tokens(&on), tokens(&waves(off(small), &[None]).await));
}

#[actix_rt::test]
async fn adapters_never_share_blocks_and_outputs_stay_the_same() {
    let model = common::default_model();
    let cfg = ModelRegistry::<CpuDevice>::default().read_config(&model).unwrap();
    let dir = common::scratch("prefix-lora");
    let (a, b) = (dir.join("a"), dir.join("b"));
    actorllm::models::random::make_random_lora(&cfg, &a, 8, 1).unwrap();
    actorllm::models::random::make_random_lora(&cfg, &b, 8, 2).unwrap();
    let args = EngineArgs {
        lora: LoraArgs {
            enable_lora: true,
            lora_modules: vec![("a".into(), a), ("b".into(), b)],
            max_loras: 2,
            max_lora_rank: 8,
            ..Default::default()
        },
        ..common::args(&model)
    };
    let adapters = [None, Some("a"), Some("b")];
    let on = waves(args.clone(), &adapters).await;
    assert_eq!(tokens(&on), tokens(&waves(off(args.clone()), &adapters).await));
    let c = cached(&on);
    // Prompts 3, 4, 5 run under base, a, b: each finds the system prompt computed under its
    // own adapter in the first wave (prompts 0, 1, 2 ran under base, a, b) and nothing else.
    assert!(c[3..].iter().all(|&n| n >= 64), "{c:?}");

    // A prompt computed under `a` only: `b` finds nothing of it, `a` finds it all.
    let engine = Engine::start(args).await.unwrap();
    let only = |adapter: &'static str| {
        let engine = &engine;
        async move {
            let id = engine.next_request_id("t");
            let s =
                engine.add_request_with_lora(id, prompt(9), common::greedy(2), Some(adapter)).await.unwrap();
            common::collect(s, 1).await.usage.unwrap().cached_tokens
        }
    };
    assert_eq!(only("a").await, 0);
    assert_eq!(only("b").await, 0, "a's blocks serve no other adapter");
    assert_eq!(only("a").await, 64);
}

#[actix_rt::test]
async fn the_server_reports_cached_tokens_and_hits() {
    let s = common::server::start(common::default_model(), |_| {}).await;
    let text = "You are a careful assistant who answers in one short sentence. ".repeat(4);
    let body =
        json!({"prompt": format!("{text}What is the capital of France?"), "max_tokens": 4, "temperature": 0});
    let (st, first) = s.post("/v1/completions", &body).await;
    assert_eq!(st, 200, "{first}");
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (_, again) = s.post("/v1/completions", &body).await;
    let hit = again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    let prompt = again["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(hit >= 16 && hit < prompt && hit % 16 == 0, "{again}");
    assert_eq!(again["choices"][0]["text"], first["choices"][0]["text"]);
    assert_eq!(s.metric("vllm:prefix_cache_queries_total").await, (2 * prompt) as f64);
    assert_eq!(s.metric("vllm:prefix_cache_hits_total").await, hit as f64);
}
