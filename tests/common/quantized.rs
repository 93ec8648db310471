//! Quantized checkpoints written by the tests from a tiny model's f32 weights: the model
//! directory with its tensors replaced and a `quantization_config`, and the comparison of
//! its greedy output with the same model's weights dequantized by the test.

use std::collections::BTreeMap;
use std::path::Path;

use actorllm::Engine;
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use serde_json::Value;

/// The tiny Llama of tests/fixtures/models/llama.json written into a directory of the
/// caller's own: the directory, its f32 `model.safetensors` and the fixture's prompts.
pub struct Golden {
    pub dir: super::ScratchDir,
    pub weights: Vec<u8>,
    pub prompts: Vec<Vec<u32>>,
}

pub fn golden_llama(tag: &str) -> Golden {
    let g = super::model_golden("llama");
    let dir = super::scratch(tag);
    actorllm::models::random::write_golden_model(&g, dir.path()).unwrap();
    let weights = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    Golden { dir, weights, prompts: super::golden_prompts(&g) }
}

/// Tensors to write: name → (dtype, shape, bytes).
pub type Tensors = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

/// `golden` (a model directory) again in `dir`, with `tensors` and `quantization_config`.
pub fn write_model(golden: &Path, dir: &Path, tensors: &Tensors, q: Option<Value>) {
    for e in std::fs::read_dir(golden).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, (dt, shape, data))| (n.clone(), TensorView::new(*dt, shape.clone(), data).unwrap()))
        .collect();
    std::fs::write(dir.join("model.safetensors"), safetensors::serialize(views, &None).unwrap()).unwrap();
    if let Some(q) = q {
        let path = dir.join("config.json");
        let mut config: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        config["quantization_config"] = q;
        std::fs::write(&path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
    }
}

/// Each prompt's greedy tokens with their top-5 logprobs, from the model in `dir`.
pub async fn greedy(dir: &Path, prompts: &[Vec<u32>]) -> Vec<Vec<(u32, Vec<(u32, f32)>)>> {
    let engine = Engine::start(super::args(dir)).await.unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    futures::future::join_all(prompts.iter().map(|p| super::greedy_top5(&engine, p.clone(), 16))).await
}

/// The quantized model in `quantized` gives the tokens and top-5 logprobs (within 1e-6) of
/// the dequantized one in `reference`, for every prompt.
pub async fn assert_serves_reference(what: &str, quantized: &Path, reference: &Path, prompts: &[Vec<u32>]) {
    let (got, want) = (greedy(quantized, prompts).await, greedy(reference, prompts).await);
    assert_eq!(got.len(), prompts.len());
    for (i, (got, want)) in got.iter().zip(&want).enumerate() {
        let ids = |r: &[(u32, Vec<(u32, f32)>)]| r.iter().map(|s| s.0).collect::<Vec<_>>();
        assert_eq!(ids(got), ids(want), "{what}: prompt {i}");
        for (step, ((_, got), (_, want))) in got.iter().zip(want).enumerate() {
            for ((gt, glp), (wt, wlp)) in got.iter().zip(want) {
                assert!(
                    gt == wt && (glp - wlp).abs() <= 1e-6,
                    "{what}: prompt {i} step {step}: {got:?} vs {want:?}"
                );
            }
        }
    }
}

/// Whether some projection weight of `written` differs from the f32 model's `original`:
/// the format rounded the weights, so the model served is not the original unchanged.
pub fn rounded(written: &Tensors, original: &[u8]) -> bool {
    let original = safetensors::SafeTensors::deserialize(original).unwrap();
    written.iter().any(|(n, t)| n.ends_with("proj.weight") && t.2 != original.tensor(n).unwrap().data())
}
