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

/// A projection PEFT adapters may target, as its model declares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraTarget {
    /// The name `target_modules` gives (`q_proj`, `qkv_proj`, `fc1`, …).
    pub name: &'static str,
    /// Its path inside a decoder layer, as adapter keys spell it (`self_attn.q_proj`).
    pub path: &'static str,
    /// The (possibly fused) projection whose forward applies it.
    pub proj: Proj,
    pub in_features: usize,
    pub out_features: usize,
    /// How its weights split over tensor-parallel ranks, following its base layer.
    pub split: LoraSplit,
}

/// The projections of a decoder layer that apply adapters, each in one pass over its
/// input (the targets of one projection share it: q, k and v; gate and up).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proj {
    Qkv,
    Out,
    Up,
    Down,
}

/// How a target's weights split over ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoraSplit {
    /// A column-parallel layer's output rows (rows of B), in sections of (rows, how they
    /// split): one section for `q_proj`, three for a fused `qkv_proj`.
    Out(Vec<(usize, Shard)>),
    /// A row-parallel layer's input columns (columns of A).
    In(Shard),
}

/// How one section of features splits: by the rank's query heads, its KV heads, or evenly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shard {
    QHeads,
    KvHeads,
    Even,
}

impl LoraTarget {
    /// A target read from one section split as `shard` on its output (`in` → `out`).
    pub fn column(
        name: &'static str,
        path: &'static str,
        proj: Proj,
        (i, o): (usize, usize),
        shard: Shard,
    ) -> Self {
        Self { name, path, proj, in_features: i, out_features: o, split: LoraSplit::Out(vec![(o, shard)]) }
    }
    /// A row-parallel target whose input splits as `shard`.
    pub fn row(
        name: &'static str,
        path: &'static str,
        proj: Proj,
        (i, o): (usize, usize),
        shard: Shard,
    ) -> Self {
        Self { name, path, proj, in_features: i, out_features: o, split: LoraSplit::In(shard) }
    }
}

/// The targets of a Llama-shaped layer: q, k, v, o (`self_attn`), gate, up, down (`mlp`).
pub fn llama_targets(cfg: &ModelConfig, intermediate: usize) -> Vec<LoraTarget> {
    let (h, q, kv) = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim);
    use {LoraTarget as T, Proj::*, Shard::*};
    vec![
        T::column("q_proj", "self_attn.q_proj", Qkv, (h, q), QHeads),
        T::column("k_proj", "self_attn.k_proj", Qkv, (h, kv), KvHeads),
        T::column("v_proj", "self_attn.v_proj", Qkv, (h, kv), KvHeads),
        T::row("o_proj", "self_attn.o_proj", Out, (q, h), QHeads),
        T::column("gate_proj", "mlp.gate_proj", Up, (h, intermediate), Even),
        T::column("up_proj", "mlp.up_proj", Up, (h, intermediate), Even),
        T::row("down_proj", "mlp.down_proj", Down, (intermediate, h), Even),
    ]
}

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
    /// (layer, index into the model's [`ModelConfig::lora_targets`]) → weights.
    pub weights: HashMap<(usize, usize), LoraWeights>,
}

impl LoraAdapter {
    pub fn bytes(&self) -> usize {
        self.weights.values().map(|w| 4 * (w.a.len() + w.b.len())).sum()
    }
}

fn io_err(path: &Path, e: impl std::fmt::Display) -> LoraError {
    LoraError::Io { path: path.display().to_string(), message: e.to_string() }
}

/// Parses `….layers.N.PATH.lora_(A|B).weight` into (layer, target index, is A), PATH being
/// one of the model's targets' paths.
fn parse_key(key: &str, targets: &[LoraTarget]) -> Option<(usize, usize, bool)> {
    let (_, rest) = key.split_once("layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (path, is_a) = match (rest.strip_suffix(".lora_A.weight"), rest.strip_suffix(".lora_B.weight")) {
        (Some(p), _) => (p, true),
        (_, Some(p)) => (p, false),
        _ => return None,
    };
    Some((layer.parse().ok()?, targets.iter().position(|t| t.path == path)?, is_a))
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

/// Largest `lora_alpha / r` accepted.
pub const MAX_LORA_SCALE: f64 = 1024.0;

/// Refuses anything but a regular file (a FIFO would block the read forever).
fn regular_file(path: &Path) -> Result<(), LoraError> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => Ok(()),
        Ok(_) => Err(io_err(path, "not a regular file")),
        Err(e) => Err(io_err(path, e)),
    }
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
    regular_file(&cfg_path)?;
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| io_err(&cfg_path, e))?;
    let pc: PeftConfig = serde_json::from_str(&text).map_err(|e| io_err(&cfg_path, e))?;
    if pc.r == 0 {
        return Err(LoraError::Invalid("adapter rank r must be at least 1".into()));
    }
    if pc.r > max_rank {
        return Err(LoraError::RankTooLarge { rank: pc.r, max: max_rank });
    }
    // A scale past this is no fine-tune: it would swamp the base model's activations.
    if !(pc.lora_alpha.is_finite() && pc.lora_alpha > 0.0 && pc.lora_alpha / pc.r as f64 <= MAX_LORA_SCALE) {
        return Err(LoraError::Invalid(format!(
            "lora_alpha {} is not a usable value: it must be positive and lora_alpha / r at most {MAX_LORA_SCALE}",
            pc.lora_alpha
        )));
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
    let known: Vec<&str> = cfg.lora_targets.iter().map(|t| t.name).collect();
    let targets: Vec<String> = match pc.target_modules {
        Targets::Many(v) => v,
        Targets::One(s) if s == "all-linear" => known.iter().map(|m| m.to_string()).collect(),
        Targets::One(s) => vec![s],
    };
    if let Some(bad) = targets.iter().find(|t| !known.contains(&t.as_str())) {
        let experts = match cfg.moe_experts {
            0 => String::new(),
            n => format!(
                "; adapters on the MLPs of a mixture-of-experts model ({n} experts a layer) are not supported"
            ),
        };
        return Err(LoraError::Invalid(format!(
            "target module {bad:?} is not supported by {} (supported: {}){experts}",
            cfg.architecture,
            known.join(", ")
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
    regular_file(&st)?;
    let scale =
        if pc.use_rslora { pc.lora_alpha / (pc.r as f64).sqrt() } else { pc.lora_alpha / pc.r as f64 } as f32;
    let ckpt = Checkpoint::open_file(&st).map_err(|e| LoraError::Invalid(e.to_string()))?;
    // (layer, module) → (A, B) as they are read.
    type Halves = (Option<Vec<f32>>, Option<Vec<f32>>);
    let mut halves: HashMap<(usize, usize), Halves> = HashMap::new();
    for (key, t) in ckpt.tensors() {
        let (layer, m, is_a) = parse_key(key, &cfg.lora_targets).ok_or_else(|| {
            LoraError::Invalid(format!(
                "tensor {key} is not a LoRA weight of a module {} supports",
                cfg.architecture
            ))
        })?;
        if layer >= cfg.num_layers {
            return Err(LoraError::Invalid(format!(
                "tensor {key}: the base model has {} layers",
                cfg.num_layers
            )));
        }
        let (fin, fout) = (cfg.lora_targets[m].in_features, cfg.lora_targets[m].out_features);
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
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            return Err(LoraError::Invalid(format!(
                "tensor {key} holds a non-finite value ({}) at {i}",
                v[i]
            )));
        }
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
                    cfg.lora_targets[m].path
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
