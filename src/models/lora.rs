//! LoRA adapters in PEFT's format: `adapter_config.json` (r, lora_alpha, target_modules,
//! use_rslora, fan_in_fan_out) and `adapter_model.safetensors` (`…layers.N.self_attn.q_proj
//! .lora_A.weight` `[r, in]`, `…lora_B.weight` `[out, r]`). Loaded to host f32 with the
//! scaling (alpha / r, or alpha / √r with rsLoRA) kept beside the weights.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::config::ModelConfig;
use super::loader::Checkpoint;
use crate::kernels::DType;

/// Projections an adapter may target, in the order the model applies them.
pub const LORA_MODULES: [&str; 7] =
    ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];

#[derive(Debug, Clone, thiserror::Error)]
pub enum LoraError {
    #[error("{0}")]
    Invalid(String),
    #[error("LoRA rank {rank} is greater than max_lora_rank {max}")]
    RankTooLarge { rank: usize, max: usize },
    #[error("cannot read adapter at {path}: {message}")]
    Io { path: String, message: String },
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Targets {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
struct PeftConfig {
    r: usize,
    lora_alpha: f64,
    target_modules: Targets,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    fan_in_fan_out: bool,
    #[serde(default)]
    bias: Option<String>,
    #[serde(default)]
    use_dora: bool,
}

/// One target module's weights: `a` is `[r, in]`, `b` is `[out, r]`.
#[derive(Debug, Clone)]
pub struct LoraWeights {
    pub a: Vec<f32>,
    pub b: Vec<f32>,
}

/// A loaded adapter on the host.
#[derive(Debug)]
pub struct LoraAdapter {
    /// Unique per load: a replaced adapter gets a new id, so running requests keep theirs.
    pub id: u64,
    pub name: String,
    pub path: PathBuf,
    pub rank: usize,
    pub scale: f32,
    pub targets: Vec<String>,
    /// (layer, index into [`LORA_MODULES`]) → weights.
    pub weights: HashMap<(usize, usize), LoraWeights>,
}

impl LoraAdapter {
    pub fn bytes(&self) -> usize {
        self.weights.values().map(|w| 4 * (w.a.len() + w.b.len())).sum()
    }
}

/// (in, out) features of a target module.
fn module_shape(cfg: &ModelConfig, m: usize) -> (usize, usize) {
    let (h, q, kv, i) = (
        cfg.hidden_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    );
    match LORA_MODULES[m] {
        "q_proj" => (h, q),
        "k_proj" | "v_proj" => (h, kv),
        "o_proj" => (q, h),
        "gate_proj" | "up_proj" => (h, i),
        _ => (i, h),
    }
}

fn io_err(path: &Path, e: impl std::fmt::Display) -> LoraError {
    LoraError::Io { path: path.display().to_string(), message: e.to_string() }
}

/// Parses `model.layers.N.(self_attn|mlp).MODULE.lora_(A|B).weight` (after PEFT's prefix).
fn parse_key(key: &str) -> Option<(usize, usize, bool)> {
    let k = key.strip_prefix("base_model.model.").unwrap_or(key);
    let rest = k.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (_, rest) = rest.split_once('.')?; // self_attn | mlp
    let (module, rest) = rest.split_once('.')?;
    let is_a = match rest {
        "lora_A.weight" => true,
        "lora_B.weight" => false,
        _ => return None,
    };
    Some((layer.parse().ok()?, LORA_MODULES.iter().position(|m| *m == module)?, is_a))
}

fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0.0; v.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = v[r * cols + c];
        }
    }
    t
}

/// Loads and validates the PEFT adapter in `dir` against the base model's shapes.
pub fn load_peft(
    dir: &Path,
    name: &str,
    id: u64,
    cfg: &ModelConfig,
    max_rank: usize,
) -> Result<LoraAdapter, LoraError> {
    let cfg_path = dir.join("adapter_config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| io_err(&cfg_path, e))?;
    let pc: PeftConfig = serde_json::from_str(&text).map_err(|e| io_err(&cfg_path, e))?;
    if pc.r == 0 {
        return Err(LoraError::Invalid("adapter rank r must be at least 1".into()));
    }
    if pc.r > max_rank {
        return Err(LoraError::RankTooLarge { rank: pc.r, max: max_rank });
    }
    if pc.use_dora {
        return Err(LoraError::Invalid("DoRA adapters (use_dora) are not supported".into()));
    }
    if pc.bias.as_deref().is_some_and(|b| b != "none") {
        return Err(LoraError::Invalid(format!(
            "adapter bias {:?} is not supported (only \"none\")",
            pc.bias
        )));
    }
    let targets: Vec<String> = match pc.target_modules {
        Targets::Many(v) => v,
        Targets::One(s) if s == "all-linear" => LORA_MODULES.iter().map(|m| m.to_string()).collect(),
        Targets::One(s) => vec![s],
    };
    if let Some(bad) = targets.iter().find(|t| !LORA_MODULES.contains(&t.as_str())) {
        return Err(LoraError::Invalid(format!(
            "target module {bad:?} is not supported (supported: {})",
            LORA_MODULES.join(", ")
        )));
    }
    let st = dir.join("adapter_model.safetensors");
    if !st.exists() {
        if dir.join("adapter_model.bin").exists() {
            return Err(LoraError::Invalid(
                "adapter_model.bin is not supported: safetensors only (save the adapter with safe_serialization=True)"
                    .into(),
            ));
        }
        return Err(io_err(&st, "file not found"));
    }
    let scale =
        if pc.use_rslora { pc.lora_alpha / (pc.r as f64).sqrt() } else { pc.lora_alpha / pc.r as f64 } as f32;
    let ckpt = Checkpoint::open_file(&st).map_err(|e| LoraError::Invalid(e.to_string()))?;
    // (layer, module) → (A, B) as they are read.
    type Halves = (Option<Vec<f32>>, Option<Vec<f32>>);
    let mut halves: HashMap<(usize, usize), Halves> = HashMap::new();
    for (key, t) in ckpt.tensors() {
        let (layer, m, is_a) = parse_key(key).ok_or_else(|| {
            LoraError::Invalid(format!("tensor {key} is not a LoRA weight of a supported module"))
        })?;
        if layer >= cfg.num_layers {
            return Err(LoraError::Invalid(format!(
                "tensor {key}: the base model has {} layers",
                cfg.num_layers
            )));
        }
        let (fin, fout) = module_shape(cfg, m);
        let (rows, cols) = match (is_a, pc.fan_in_fan_out) {
            (true, false) => (pc.r, fin),
            (false, false) => (fout, pc.r),
            (true, true) => (fin, pc.r),
            (false, true) => (pc.r, fout),
        };
        if t.shape != [rows, cols] {
            return Err(LoraError::Invalid(format!(
                "tensor {key} has shape {:?}, expected [{rows}, {cols}]",
                t.shape
            )));
        }
        let mut bytes = Vec::new();
        DType::F32.convert_from(t.dtype, t.bytes, &mut bytes);
        let mut v: Vec<f32> = bytemuck::pod_collect_to_vec(&bytes);
        if pc.fan_in_fan_out {
            v = transpose(&v, rows, cols);
        }
        let e = halves.entry((layer, m)).or_default();
        if is_a { e.0 = Some(v) } else { e.1 = Some(v) }
    }
    let mut weights = HashMap::new();
    for ((layer, m), pair) in halves {
        match pair {
            (Some(a), Some(b)) => {
                weights.insert((layer, m), LoraWeights { a, b });
            }
            _ => {
                return Err(LoraError::Invalid(format!(
                    "layer {layer} {}: lora_A and lora_B must both be present",
                    LORA_MODULES[m]
                )));
            }
        }
    }
    if weights.is_empty() {
        return Err(LoraError::Invalid("the adapter holds no LoRA weights".into()));
    }
    Ok(LoraAdapter {
        id,
        name: name.to_string(),
        path: dir.to_path_buf(),
        rank: pc.r,
        scale,
        targets,
        weights,
    })
}
