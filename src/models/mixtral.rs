//! Mixtral, after HF `transformers/models/mixtral/modeling_mixtral.py` and vLLM
//! `models/mixtral.py`: Mistral's attention (a sliding window on every layer where the
//! config sets one) with a mixture-of-experts block in place of every MLP
//! (`block_sparse_moe`: a router over `num_local_experts` experts, `num_experts_per_tok` of
//! them a token, their weights renormalized). Its layers are Llama's (`llama.rs`) with those
//! options; the experts' `w1`/`w3` load stacked as each expert's gate/up.

use serde::Deserialize;

use super::ModelError;
use super::config::{ModelConfig, parse_hf};
use super::layers::{ExpertNames, MoeConfig};
use super::llama::{LlamaArch, LlamaConfig, LlamaFamily, family_entry};
use super::loader::StackedParam;
use super::registry::ModelEntry;
use crate::kernels::Device;

/// Llama's stacked params, and each expert's `w1` (gate) and `w3` (up).
pub const STACKED_PARAMS: &[StackedParam] = &[
    StackedParam { param: "qkv_proj", shard: "q_proj", index: 0 },
    StackedParam { param: "qkv_proj", shard: "k_proj", index: 1 },
    StackedParam { param: "qkv_proj", shard: "v_proj", index: 2 },
    StackedParam { param: "gate_up_proj", shard: "w1", index: 0 },
    StackedParam { param: "gate_up_proj", shard: "w3", index: 1 },
];

/// Mixtral's own fields of config.json.
#[derive(Debug, Deserialize)]
struct MixtralConfig {
    num_local_experts: usize,
    num_experts_per_tok: usize,
    intermediate_size: usize,
}

pub fn arch(cfg: &ModelConfig) -> Result<LlamaArch, ModelError> {
    let c: LlamaConfig = parse_hf(&cfg.hf, &cfg.architecture)?;
    let m: MixtralConfig = parse_hf(&cfg.hf, &cfg.architecture)?;
    let mut a = c.arch(cfg)?;
    a.windows = vec![c.sliding_window.unwrap_or(0); cfg.num_layers];
    let moe = MoeConfig {
        experts: m.num_local_experts,
        top_k: m.num_experts_per_tok,
        renormalize: true,
        inter: m.intermediate_size,
        shared_inter: 0,
        names: ExpertNames::MIXTRAL,
        sparse: vec![true; cfg.num_layers],
    };
    moe.check(&cfg.architecture)?;
    a.moe = Some(moe);
    Ok(a)
}

/// `MixtralForCausalLM`: its options of the layers, read from its config.
pub struct Mixtral;

impl LlamaFamily for Mixtral {
    fn arch(cfg: &ModelConfig) -> Result<LlamaArch, ModelError> {
        arch(cfg)
    }
}

/// The registry's entry for `MixtralForCausalLM`.
pub fn entry<D: Device>() -> ModelEntry<D> {
    family_entry::<D, Mixtral>(STACKED_PARAMS)
}
