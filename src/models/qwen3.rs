//! Qwen3, after HF `transformers/models/qwen3/modeling_qwen3.py`: Qwen2's layers without the
//! q/k/v bias and with an RMSNorm over each head of q and k before RoPE (`q_norm`,
//! `k_norm`), a sliding window on the layers its config marks. Its layers are Llama's
//! (`llama.rs`) with those options.

use super::ModelError;
use super::config::{ModelConfig, parse_hf};
use super::llama::{LlamaArch, LlamaConfig, LlamaFamily, STACKED_PARAMS, family_entry};
use super::registry::ModelEntry;
use crate::kernels::Device;

/// Qwen3's options of Llama's layers.
pub fn arch(cfg: &ModelConfig) -> Result<LlamaArch, ModelError> {
    let c: LlamaConfig = parse_hf(&cfg.hf, &cfg.architecture)?;
    let mut a = c.arch(cfg)?;
    a.qk_norm = true;
    a.windows = c.windows(&cfg.architecture, cfg.num_layers)?;
    Ok(a)
}

/// `Qwen3ForCausalLM`: its options of the layers, read from its config.
pub struct Qwen3;

impl LlamaFamily for Qwen3 {
    fn arch(cfg: &ModelConfig) -> Result<LlamaArch, ModelError> {
        arch(cfg)
    }
}

/// The registry's entry for `Qwen3ForCausalLM`.
pub fn entry<D: Device>() -> ModelEntry<D> {
    family_entry::<D, Qwen3>(STACKED_PARAMS)
}
