//! Gemma, after HF `transformers/models/gemma/modeling_gemma.py` and vLLM
//! `models/gemma.py`: Llama's layers with RMSNorms of `(1 + w)`, a gated GELU (tanh
//! approximation) MLP, embeddings scaled by √hidden and a tied LM head. The legacy
//! `hidden_act: "gelu"` of the official configs means the tanh approximation, as
//! transformers reads it.

use serde::Deserialize;

use super::ModelError;
use super::config::{ModelConfig, parse_hf, unsupported};
use super::llama::{LlamaArch, LlamaConfig, LlamaFamily, STACKED_PARAMS, family_entry, llama_config};
use super::registry::ModelEntry;
use crate::kernels::{Activation, Device};

/// Gemma's own fields beyond Llama's.
#[derive(Debug, Deserialize)]
struct GemmaExtra {
    hidden_activation: Option<String>,
    hidden_act: Option<String>,
}

/// The MLP activation of a Gemma config: `hidden_activation`, else `hidden_act`, where
/// "gelu" stands for GELU's tanh approximation.
pub fn gemma_act(hf: &serde_json::Value, arch: &str) -> Result<Activation, ModelError> {
    let e: GemmaExtra = parse_hf(hf, arch)?;
    let name = e.hidden_activation.or(e.hidden_act).unwrap_or_else(|| "gelu_pytorch_tanh".into());
    let name = if name == "gelu" { "gelu_pytorch_tanh" } else { name.as_str() };
    Activation::from_hf(name)
        .ok_or_else(|| unsupported(arch, "hidden_activation", name, Activation::HF_NAMES))
}

/// Gemma's options of Llama's layers.
pub fn arch(cfg: &ModelConfig) -> Result<LlamaArch, ModelError> {
    let c: LlamaConfig = parse_hf(&cfg.hf, &cfg.architecture)?;
    let mut a = LlamaConfig { hidden_act: None, ..c }.arch(cfg)?;
    a.act = gemma_act(&cfg.hf, &cfg.architecture)?;
    a.norm_offset = true;
    a.embed_scale = true;
    Ok(a)
}

/// Gemma's shared config: a tied LM head unless it says otherwise.
pub fn tied(cfg: ModelConfig) -> ModelConfig {
    let explicit = cfg.hf.get("tie_word_embeddings").and_then(|v| v.as_bool());
    ModelConfig { tie_word_embeddings: explicit.unwrap_or(true), ..cfg }
}

/// `GemmaForCausalLM`: its options of the layers, read from its config.
pub struct Gemma;

impl LlamaFamily for Gemma {
    fn arch(cfg: &ModelConfig) -> Result<LlamaArch, ModelError> {
        arch(cfg)
    }
    /// A tied LM head unless the config says otherwise.
    fn read(cfg: ModelConfig) -> Result<ModelConfig, ModelError> {
        let cfg = tied(cfg);
        let a = arch(&cfg)?;
        Ok(llama_config(cfg, &a))
    }
}

/// The registry's entry for `GemmaForCausalLM`.
pub fn entry<D: Device>() -> ModelEntry<D> {
    family_entry::<D, Gemma>(STACKED_PARAMS)
}
