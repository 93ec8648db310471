//! Tensor parallelism on the CPU (ranks are threads joined by an in-process all-reduce):
//! split over 2, 3 and 4 ranks, the model gives the greedy output of one rank, through
//! every parallel layer (split and replicated KV heads, q/k/v bias, a vocabulary that does
//! not divide, tied and untied heads, experts split by their intermediate size); shapes that
//! cannot split are refused by name.

mod common;

use actorllm::Engine;
use actorllm::config::{DeviceArg, EngineArgs};
use actorllm::kernels::DType;
use actorllm::models::random::{Preset, Shape, make_random_model};
use actorllm::request::SamplingParams;
use common::{ScratchDir, greedy, run, tiny_model};

/// 12 heads over 6 KV heads (2 or 3 per rank at TP 2 and 3), q/k/v bias, an untied head
/// and a vocabulary of 331 (no rank count divides it: the last shard is padded).
fn odd_model() -> ScratchDir {
    let dir = common::scratch("tp-odd");
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
    make_random_model(shape, dir.path(), DType::F32, 21, 4.0).expect("write model");
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
    let one = outputs(model.path(), 1, &p).await;
    assert!(one.iter().all(|o| o.len() == 24));
    assert_eq!(outputs(model.path(), 2, &p).await, one, "TP=2");
    assert_eq!(outputs(model.path(), 3, &p).await, one, "TP=3");
}

/// Mixture-of-experts models split each expert's intermediate size (and a shared expert's,
/// and a dense layer's) over the ranks: at TP=2 they still give transformers' tokens.
#[actix_rt::test]
async fn experts_split_over_two_ranks_give_transformers_tokens() {
    for name in ["mixtral", "qwen2-moe"] {
        let path = common::fixture(&format!("tests/fixtures/models/{name}.json"));
        let g: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let dir = common::scratch(&format!("tp-{name}"));
        actorllm::models::random::write_golden_model(&g, dir.path()).unwrap();
        let ids = |v: &serde_json::Value| -> Vec<u32> {
            v.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
        };
        let runs = g["runs"].as_array().unwrap();
        let p: Vec<Vec<u32>> = runs.iter().map(|r| ids(&r["prompt_ids"])).collect();
        let want: Vec<Vec<u32>> = runs.iter().map(|r| ids(&r["output_ids"])).collect();
        assert_eq!(outputs(dir.path(), 2, &p).await, want, "{name} at TP=2");
    }
}

#[actix_rt::test]
async fn kv_heads_replicate_when_ranks_outnumber_them() {
    // 4 heads over 2 KV heads: at TP=4 each KV head serves two ranks.
    let model = tiny_model(31);
    let p = prompts(Preset::Tiny.shape().vocab as u32);
    let one = outputs(model.path(), 1, &p).await;
    assert_eq!(outputs(model.path(), 4, &p).await, one, "TP=4");
}

#[actix_rt::test]
async fn shapes_that_do_not_split_are_refused_by_name() {
    let model = odd_model();
    let err = |tp| {
        let args = args(model.path(), tp);
        async move { Engine::start(args).await.err().expect("refused").to_string() }
    };
    let e = err(5).await;
    assert!(e.contains("--tensor-parallel-size 5") && e.contains("12 attention heads"), "{e}");
    let e = err(4).await;
    assert!(e.contains("6 KV heads"), "{e}");
    let e = err(0).await;
    assert!(e.contains("at least 1"), "{e}");
}

#[actix_rt::test]
async fn more_ranks_than_gpus_is_refused_with_the_count() {
    let model = tiny_model(33);
    let cuda = EngineArgs { device: DeviceArg::Cuda, ..args(model.path(), 4) };
    let e = Engine::start(cuda).await.err().expect("refused").to_string();
    assert!(e.contains("needs 4 GPUs, this machine has"), "{e}");
}

/// The parallel layers themselves, split over 1, 2 and 3 CPU ranks: a column-parallel
/// layer (with bias, its outputs kept split or gathered) feeding a row-parallel one gives
/// one rank's result on every rank.
#[test]
fn column_then_row_parallel_layers_equal_the_unsplit_ones() {
    use actorllm::kernels::Device;
    use actorllm::kernels::cpu::{CpuDevice, CpuTensor};
    use actorllm::models::layers::{ColumnParallelLinear, RowParallelLinear};
    use actorllm::models::loader::{Checkpoint, WeightStore};

    let vals = |n: usize, k: f32| {
        (0..n).map(|i| ((i as f32 * k).sin() * 0.5).to_le_bytes()).collect::<Vec<_>>().concat()
    };
    let tensors = [
        ("lin.weight", vec![6, 4], vals(24, 0.7)),
        ("lin.bias", vec![6], vals(6, 1.3)),
        ("row.weight", vec![4, 6], vals(24, 0.3)),
    ];
    let views = tensors.iter().map(|(n, s, b)| {
        (n.to_string(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap())
    });
    let dir = common::scratch("tp-layers");
    let path = dir.path().join("layers.safetensors");
    safetensors::tensor::serialize_to_file(views, &None, &path).unwrap();
    let ckpt = Checkpoint::open_file(&path).unwrap();
    let store = WeightStore::load_weights(ckpt.tensors(), &[], |_| false, DType::F32);
    let x: Vec<f32> = (0..8).map(|i| i as f32 * 0.25 - 1.0).collect();
    let run = |world: usize| -> Vec<(Vec<f32>, Vec<f32>)> {
        std::thread::scope(|s| {
            let handles: Vec<_> = CpuDevice::group(world)
                .into_iter()
                .map(|dev| {
                    let (store, x) = (&store, x.clone());
                    s.spawn(move || {
                        let root = store.root();
                        let split =
                            ColumnParallelLinear::load(&dev, &root.pp("lin"), (4, 6), true, false).unwrap();
                        let gathered =
                            ColumnParallelLinear::load(&dev, &root.pp("lin"), (4, 6), true, true).unwrap();
                        let row = RowParallelLinear::load(&dev, &root.pp("row"), 6, 4).unwrap();
                        let x = CpuTensor::new(x, 2, 4);
                        let h = split.forward(&dev, &x).unwrap();
                        assert_eq!(dev.shape(&h), (2, 6 / world));
                        (
                            dev.to_host(&gathered.forward(&dev, &x).unwrap()).unwrap(),
                            dev.to_host(&row.forward(&dev, &h, None).unwrap()).unwrap(),
                        )
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    let one = run(1).remove(0);
    for world in [2, 3] {
        for (rank, (gathered, y)) in run(world).into_iter().enumerate() {
            assert_eq!(gathered, one.0, "gathered outputs, rank {rank} of {world}");
            for (a, b) in y.iter().zip(&one.1) {
                assert!(
                    (a - b).abs() < 1e-5,
                    "row-parallel output, rank {rank} of {world}: {y:?} vs {:?}",
                    one.1
                );
            }
        }
    }
}
