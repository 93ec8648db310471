//! Qwen3, after HF `transformers/models/qwen3/modeling_qwen3.py`: Qwen2's layers without the
//! q/k/v bias and with an RMSNorm over each head of q and k before RoPE (`q_norm`,
//! `k_norm`), a sliding window on the layers its config marks. Its layers are Llama's
//! (`llama.rs`) with those options.

use std::sync::Arc;

use super::config::{ModelConfig, parse_hf};
use super::llama::{LlamaArch, LlamaConfig, LlamaForCausalLM, STACKED_PARAMS, llama_config, skip_tensor};
use super::loader::WeightStore;
use super::registry::ModelEntry;
use super::{CausalLM, LoadOptions, ModelError};
use crate::kernels::Device;

/// Qwen3's options of Llama's layers.
pub fn arch(cfg: &ModelConfig) -> Result<LlamaArch, ModelError> {
    let c: LlamaConfig = parse_hf(&cfg.hf, &cfg.architecture)?;
    let mut a = c.arch(cfg)?;
    a.qk_norm = true;
    a.windows = c.windows(&cfg.architecture, cfg.num_layers)?;
    Ok(a)
}

fn read(hf: &Arc<serde_json::Value>, name: &str) -> Result<ModelConfig, ModelError> {
    let cfg = ModelConfig::from_hf(hf, name)?;
    let a = arch(&cfg)?;
    Ok(llama_config(cfg, &a))
}

fn build<D: Device>(
    d: &D,
    c: &ModelConfig,
    w: &WeightStore,
    o: &LoadOptions,
) -> Result<Box<dyn CausalLM<D>>, ModelError> {
    Ok(Box::new(LlamaForCausalLM::load_arch(d, c, w, o, &arch(c)?)?))
}

/// The registry's entry for `Qwen3ForCausalLM`.
pub fn entry<D: Device>() -> ModelEntry<D> {
    ModelEntry { config: read, construct: build::<D>, stacked_params: STACKED_PARAMS, skip: skip_tensor }
}
