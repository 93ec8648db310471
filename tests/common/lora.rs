//! Writes PEFT-format adapters for the default model at run time, with the deterministic
//! weights scripts/make_lora_golden.py gives PEFT (a 32-bit xorshift; values k·2⁻¹⁴).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::json;

pub const MODULES: [&str; 7] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];

#[derive(Debug, Clone, serde::Deserialize)]
pub struct AdapterSpec {
    pub name: String,
    pub seed: u64,
    pub r: usize,
    pub lora_alpha: f64,
    pub target_modules: Vec<String>,
    pub use_rslora: bool,
}

pub fn xorshift_values(seed: u64, n: usize) -> Vec<f32> {
    let mut x = (seed.wrapping_mul(2654435761).wrapping_add(12345) & 0xFFFF_FFFF) as u32;
    if x == 0 {
        x = 1;
    }
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            ((x % 2001) as f32 - 1000.0) * (2.0f32).powi(-14)
        })
        .collect()
}

fn tensor_seed(adapter_seed: u64, layer: usize, module: &str, which: u64) -> u64 {
    let m = MODULES.iter().position(|x| *x == module).unwrap() as u64;
    adapter_seed * 1000003 + layer as u64 * 101 + m * 7 + which
}

/// (in, out) of a module for SmolLM2-135M's shapes.
fn shape(module: &str) -> (usize, usize) {
    match module {
        "q_proj" | "o_proj" => (576, 576),
        "k_proj" | "v_proj" => (576, 192),
        "gate_proj" | "up_proj" => (576, 1536),
        _ => (1536, 576),
    }
}

/// Writes the adapter under `root/<name>`; `zero_b` makes every B zero (a no-op adapter).
pub fn write_adapter(root: &Path, spec: &AdapterSpec, zero_b: bool) -> PathBuf {
    let dir = root.join(&spec.name);
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = json!({
        "peft_type": "LORA", "r": spec.r, "lora_alpha": spec.lora_alpha, "target_modules": spec.target_modules,
        "use_rslora": spec.use_rslora, "fan_in_fan_out": false, "bias": "none", "lora_dropout": 0.0,
        "base_model_name_or_path": "SmolLM2-135M-Instruct", "task_type": "CAUSAL_LM",
    });
    std::fs::write(dir.join("adapter_config.json"), cfg.to_string()).unwrap();
    let mut tensors: HashMap<String, (Vec<usize>, Vec<u8>)> = HashMap::new();
    for layer in 0..30 {
        for m in &spec.target_modules {
            let (fin, fout) = shape(m);
            let part =
                if ["gate_proj", "up_proj", "down_proj"].contains(&m.as_str()) { "mlp" } else { "self_attn" };
            let base = format!("base_model.model.model.layers.{layer}.{part}.{m}");
            let a = xorshift_values(tensor_seed(spec.seed, layer, m, 0), spec.r * fin);
            let b = if zero_b {
                vec![0.0; fout * spec.r]
            } else {
                xorshift_values(tensor_seed(spec.seed, layer, m, 1), fout * spec.r)
            };
            tensors.insert(
                format!("{base}.lora_A.weight"),
                (vec![spec.r, fin], bytemuck::cast_slice(&a).to_vec()),
            );
            tensors.insert(
                format!("{base}.lora_B.weight"),
                (vec![fout, spec.r], bytemuck::cast_slice(&b).to_vec()),
            );
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, (s, b))| {
            (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap())
        })
        .collect();
    safetensors::tensor::serialize_to_file(views, &None, &dir.join("adapter_model.safetensors")).unwrap();
    dir
}

#[derive(Debug, serde::Deserialize)]
pub struct GoldenOutput {
    pub prompt_ids: Vec<u32>,
    pub output_ids: Vec<u32>,
    /// transformers' decode of `output_ids`, special tokens skipped.
    pub output_text: String,
}

#[derive(Debug, serde::Deserialize)]
pub struct GoldenAdapter {
    #[serde(flatten)]
    pub spec: AdapterSpec,
    pub outputs: Vec<GoldenOutput>,
}

#[derive(Debug, serde::Deserialize)]
pub struct LoraGolden {
    pub tokens: usize,
    pub adapters: Vec<GoldenAdapter>,
}

pub fn golden() -> LoraGolden {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/lora_golden.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}
