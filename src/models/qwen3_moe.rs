//! Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B), after HF
//! `transformers/models/qwen3_moe/modeling_qwen3_moe.py` and vLLM `models/qwen3_moe.py`:
//! Qwen3's attention (q/k RMSNorms, no bias; a sliding window on every layer with
//! `use_sliding_window`) with Qwen2-MoE's expert blocks, without a shared expert. Its layers
//! are Llama's (`llama.rs`) with those options.

use serde::Deserialize;

use super::ModelError;
use super::config::{ModelConfig, parse_hf};
use super::llama::{LlamaArch, LlamaConfig, LlamaFamily, STACKED_PARAMS, family_entry};
use super::qwen2_moe::QwenMoeConfig;
use super::registry::ModelEntry;
use crate::kernels::Device;

#[derive(Debug, Deserialize)]
struct Window {
    use_sliding_window: Option<bool>,
    sliding_window: Option<usize>,
}

pub fn arch(cfg: &ModelConfig) -> Result<LlamaArch, ModelError> {
    let c: LlamaConfig = parse_hf(&cfg.hf, &cfg.architecture)?;
    let m: QwenMoeConfig = parse_hf(&cfg.hf, &cfg.architecture)?;
    let w: Window = parse_hf(&cfg.hf, &cfg.architecture)?;
    let mut a = c.arch(cfg)?;
    a.qk_norm = true;
    let window = w.sliding_window.filter(|_| w.use_sliding_window == Some(true)).unwrap_or(0);
    a.windows = vec![window; cfg.num_layers];
    a.moe = Some(m.moe(&cfg.architecture, cfg.num_layers, false)?);
    Ok(a)
}

/// `Qwen3MoeForCausalLM`: its options of the layers, read from its config.
pub struct Qwen3Moe;

impl LlamaFamily for Qwen3Moe {
    fn arch(cfg: &ModelConfig) -> Result<LlamaArch, ModelError> {
        arch(cfg)
    }
}

/// The registry's entry for `Qwen3MoeForCausalLM`.
pub fn entry<D: Device>() -> ModelEntry<D> {
    family_entry::<D, Qwen3Moe>(STACKED_PARAMS)
}
