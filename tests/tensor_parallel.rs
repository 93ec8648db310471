//! Tensor parallelism on the CPU (ranks are threads joined by an in-process all-reduce):
//! split over 2, 3 and 4 ranks, the model gives the greedy output of one rank, through
//! every parallel layer (split and replicated KV heads, q/k/v bias, a vocabulary that does
//! not divide, tied and untied heads); shapes that cannot split are refused by name.

mod common;

use actorllm::Engine;
use actorllm::config::{DeviceArg, EngineArgs};
use actorllm::kernels::DType;
use actorllm::models::random::{Preset, Shape, make_random_model};
use actorllm::request::SamplingParams;
use common::{greedy, run, tiny_model};

/// 12 heads over 6 KV heads (2 or 3 per rank at TP 2 and 3), q/k/v bias, an untied head
/// and a vocabulary of 331 (no rank count divides it: the last shard is padded).
fn odd_model() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("actorllm-tp-odd-{}", std::process::id()));
    let shape = Shape {
        hidden: 96,
        intermediate: 192,
        layers: 2,
        heads: 12,
        kv_heads: 6,
        vocab: 331,
        max_pos: 1024,
        rope_theta: 10000.0,
        tied: false,
        qkv_bias: true,
    };
    make_random_model(shape, &dir, DType::F32, 21, 4.0).expect("write model");
    dir
}

fn args(model: &std::path::Path, tp: usize) -> EngineArgs {
    EngineArgs { tensor_parallel_size: tp, ..common::args(model) }
}

/// Greedy outputs of a batch of prompts, submitted together.
async fn outputs(model: &std::path::Path, tp: usize, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let engine = Engine::start(args(model, tp)).await.unwrap();
    let params = SamplingParams { ignore_eos: true, ..greedy(24) };
    let runs = prompts.iter().map(|p| run(&engine, p.clone(), params.clone()));
    futures::future::join_all(runs).await.into_iter().map(|o| o.tokens[0].clone()).collect()
}

fn prompts(vocab: u32) -> Vec<Vec<u32>> {
    vec![vec![1, 2, 3], (10..60).map(|i| i * 7 % (vocab - 2)).collect(), vec![vocab - 3, 5]]
}

#[actix_rt::test]
async fn split_over_two_and_three_ranks_gives_the_single_rank_output() {
    let model = odd_model();
    let p = prompts(331);
    let one = outputs(&model, 1, &p).await;
    assert!(one.iter().all(|o| o.len() == 24));
    assert_eq!(outputs(&model, 2, &p).await, one, "TP=2");
    assert_eq!(outputs(&model, 3, &p).await, one, "TP=3");
}

#[actix_rt::test]
async fn kv_heads_replicate_when_ranks_outnumber_them() {
    // 4 heads over 2 KV heads: at TP=4 each KV head serves two ranks.
    let model = tiny_model(31);
    let p = prompts(Preset::Tiny.shape().vocab as u32);
    let one = outputs(&model, 1, &p).await;
    assert_eq!(outputs(&model, 4, &p).await, one, "TP=4");
}

#[actix_rt::test]
async fn shapes_that_do_not_split_are_refused_by_name() {
    let err =
        |tp| async move { Engine::start(args(&odd_model(), tp)).await.err().expect("refused").to_string() };
    let e = err(5).await;
    assert!(e.contains("--tensor-parallel-size 5") && e.contains("12 attention heads"), "{e}");
    let e = err(4).await;
    assert!(e.contains("6 KV heads"), "{e}");
    let e = err(0).await;
    assert!(e.contains("at least 1"), "{e}");
}

#[actix_rt::test]
async fn more_ranks_than_gpus_is_refused_with_the_count() {
    let cuda = EngineArgs { device: DeviceArg::Cuda, ..args(&tiny_model(33), 4) };
    let e = Engine::start(cuda).await.err().expect("refused").to_string();
    assert!(e.contains("needs 4 GPUs, this machine has"), "{e}");
}
