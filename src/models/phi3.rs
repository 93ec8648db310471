//! Phi-3, after HF `transformers/models/phi3/modeling_phi3.py` and vLLM `models/phi3.py`:
//! Llama's layers, with q/k/v and gate/up stored fused in the checkpoint (`qkv_proj`,
//! `gate_up_proj`, which are also the names its adapters target), LongRoPE scaling
//! (`original_max_position_embeddings` at the top level) and a sliding window on every
//! layer.

use super::ModelError;
use super::config::{ModelConfig, parse_hf};
use super::llama::{LlamaArch, LlamaConfig, LlamaFamily, family_entry, llama_config};
use super::lora::{LoraSplit, LoraTarget, Proj, Shard};
use super::registry::ModelEntry;
use crate::kernels::Device;

/// Phi-3's options of Llama's layers.
pub fn arch(cfg: &ModelConfig) -> Result<LlamaArch, ModelError> {
    let c: LlamaConfig = parse_hf(&cfg.hf, &cfg.architecture)?;
    let mut a = c.arch(cfg)?;
    a.fused_checkpoint = true;
    a.windows = vec![c.sliding_window.unwrap_or(0); cfg.num_layers];
    Ok(a)
}

/// The fused projections adapters target.
fn targets(cfg: &ModelConfig, intermediate: usize) -> Vec<LoraTarget> {
    let (h, q, kv) = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim);
    let qkv = LoraSplit::Out(vec![(q, Shard::QHeads), (kv, Shard::KvHeads), (kv, Shard::KvHeads)]);
    let gate_up = LoraSplit::Out(vec![(intermediate, Shard::Even), (intermediate, Shard::Even)]);
    vec![
        LoraTarget {
            name: "qkv_proj",
            path: "self_attn.qkv_proj",
            proj: Proj::Qkv,
            in_features: h,
            out_features: q + 2 * kv,
            split: qkv,
        },
        LoraTarget::row("o_proj", "self_attn.o_proj", Proj::Out, (q, h), Shard::QHeads),
        LoraTarget {
            name: "gate_up_proj",
            path: "mlp.gate_up_proj",
            proj: Proj::Up,
            in_features: h,
            out_features: 2 * intermediate,
            split: gate_up,
        },
        LoraTarget::row("down_proj", "mlp.down_proj", Proj::Down, (intermediate, h), Shard::Even),
    ]
}

/// `Phi3ForCausalLM`: its options of the layers, read from its config.
pub struct Phi3;

impl LlamaFamily for Phi3 {
    fn arch(cfg: &ModelConfig) -> Result<LlamaArch, ModelError> {
        arch(cfg)
    }
    /// Its adapters target the fused projections.
    fn read(cfg: ModelConfig) -> Result<ModelConfig, ModelError> {
        let a = arch(&cfg)?;
        let mut cfg = llama_config(cfg, &a);
        cfg.lora_targets = targets(&cfg, a.intermediate_size);
        Ok(cfg)
    }
}

/// The registry's entry for `Phi3ForCausalLM`.
pub fn entry<D: Device>() -> ModelEntry<D> {
    family_entry::<D, Phi3>(&[])
}
