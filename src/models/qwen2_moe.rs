//! Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B), after HF
//! `transformers/models/qwen2_moe/modeling_qwen2_moe.py` and vLLM `models/qwen2_moe.py`:
//! Qwen2's attention (q/k/v bias, sliding windows where `layer_types` marks them) with a
//! mixture-of-experts block on the layers `decoder_sparse_step` and `mlp_only_layers`
//! select (a dense MLP on the others): `num_experts` experts, `num_experts_per_tok` a
//! token, their weights renormalized only with `norm_topk_prob`, and a shared expert added
//! under its sigmoid gate. Its layers are Llama's (`llama.rs`) with those options.

use serde::Deserialize;

use super::ModelError;
use super::config::{ModelConfig, parse_hf};
use super::layers::{ExpertNames, MoeConfig};
use super::llama::{LlamaArch, LlamaConfig, LlamaFamily, STACKED_PARAMS, family_entry};
use super::registry::ModelEntry;
use crate::kernels::Device;

/// The expert fields of the Qwen MoE families' config.json.
#[derive(Debug, Deserialize)]
pub struct QwenMoeConfig {
    #[serde(alias = "num_local_experts")]
    num_experts: usize,
    num_experts_per_tok: usize,
    moe_intermediate_size: usize,
    #[serde(default)]
    shared_expert_intermediate_size: usize,
    #[serde(default)]
    norm_topk_prob: bool,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
    qkv_bias: Option<bool>,
}

impl QwenMoeConfig {
    /// The expert blocks, with a shared expert where `shared`. A layer has one unless
    /// `mlp_only_layers` names it, when `(layer + 1)` is a multiple of `decoder_sparse_step`.
    pub fn moe(&self, arch: &str, layers: usize, shared: bool) -> Result<MoeConfig, ModelError> {
        let step = self.decoder_sparse_step.unwrap_or(1);
        if step == 0 {
            return Err(super::config::unsupported(arch, "decoder_sparse_step", 0, "1 or more"));
        }
        let dense = self.mlp_only_layers.clone().unwrap_or_default();
        let moe = MoeConfig {
            experts: self.num_experts,
            top_k: self.num_experts_per_tok,
            renormalize: self.norm_topk_prob,
            inter: self.moe_intermediate_size,
            shared_inter: if shared { self.shared_expert_intermediate_size } else { 0 },
            names: ExpertNames::QWEN,
            sparse: (0..layers)
                .map(|i| !dense.contains(&i) && self.num_experts > 0 && (i + 1) % step == 0)
                .collect(),
        };
        moe.check(arch)?;
        Ok(moe)
    }
}

pub fn arch(cfg: &ModelConfig) -> Result<LlamaArch, ModelError> {
    let c: LlamaConfig = parse_hf(&cfg.hf, &cfg.architecture)?;
    let m: QwenMoeConfig = parse_hf(&cfg.hf, &cfg.architecture)?;
    let mut a = c.arch(cfg)?;
    a.qkv_bias = m.qkv_bias.unwrap_or(true);
    a.windows = c.windows(&cfg.architecture, cfg.num_layers)?;
    a.moe = Some(m.moe(&cfg.architecture, cfg.num_layers, true)?);
    Ok(a)
}

/// `Qwen2MoeForCausalLM`: its options of the layers, read from its config.
pub struct Qwen2Moe;

impl LlamaFamily for Qwen2Moe {
    fn arch(cfg: &ModelConfig) -> Result<LlamaArch, ModelError> {
        arch(cfg)
    }
}

/// The registry's entry for `Qwen2MoeForCausalLM`.
pub fn entry<D: Device>() -> ModelEntry<D> {
    family_entry::<D, Qwen2Moe>(STACKED_PARAMS)
}
