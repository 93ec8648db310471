//! Model code: the forward contract every architecture implements, the HF config, the
//! checkpoint loader, the shared layers and the registry of architectures.

pub mod config;
pub mod fp8;
pub mod gemma;
pub mod gemma2;
pub mod gemma3;
pub mod kv_scales;
pub mod layers;
pub mod llama;
pub mod loader;
pub mod lora;
pub mod mixtral;
pub mod opt;
pub mod packed;
pub mod phi3;
pub mod qwen2_moe;
pub mod qwen3;
pub mod qwen3_moe;
pub mod random;
pub mod registry;

use std::path::{Path, PathBuf};

use crate::kernels::attn::AttnMetadata;
use crate::kernels::{CacheShape, DevResult, Device, DeviceError};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("missing file {}: {hint}", path.display())]
    MissingFile { path: PathBuf, hint: &'static str },
    #[error("invalid config: {0}")]
    Config(String),
    #[error("architecture {arch:?} is not registered (registered: {known})")]
    UnknownArchitecture { arch: String, known: String },
    #[error(
        "architecture {arch:?} needs the checkpoint's remote code ({code} in auto_map), which cannot run \
         here: there is no Python, whatever --trust-remote-code says. The built-in architectures are: {known}"
    )]
    RemoteCode { arch: String, code: String, known: String },
    #[error("checkpoint: {0}")]
    Weights(String),
    #[error("checkpoint has no tensor {0}")]
    MissingTensor(String),
    #[error("tensor {name} has shape {got:?}, expected {expected:?}")]
    Shape { name: String, expected: Vec<usize>, got: Vec<usize> },
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error(transparent)]
    Quantization(#[from] crate::quantization::QuantError),
}

impl ModelError {
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        Self::Io { path: path.to_path_buf(), source }
    }
}

/// Engine options a model is built with (beyond its config.json).
#[derive(Debug, Clone, Copy, Default)]
pub struct LoadOptions {
    /// Adapter slots and the largest rank they hold, when LoRA is enabled.
    pub lora: Option<LoraCapacity>,
    /// Weights made of the config's shapes instead of read (`--load-format dummy`).
    pub dummy: bool,
    /// Projections quantized to FP8 as they load (`--quantization fp8` on a checkpoint
    /// that is not quantized).
    pub online_fp8: bool,
}

#[derive(Debug, Clone, Copy)]
pub struct LoraCapacity {
    pub slots: usize,
    pub max_rank: usize,
    /// Adapter weights kept in bf16 on the device.
    pub bf16: bool,
}

/// The forward contract (vLLM's): flat tokens of any mix of prefill and decode sequences.
/// Models never see paging: the attention layer hides it behind `kv_caches` and `meta`.
pub trait CausalLM<D: Device>: Send {
    /// `[num_tokens]` ids (at `meta.positions`) → `[num_tokens, hidden]` hidden states.
    fn forward(
        &self,
        dev: &D,
        input_ids: &[u32],
        kv_caches: &mut [D::Cache],
        meta: &AttnMetadata,
    ) -> DevResult<D::Tensor>;
    /// Hidden states → `[num_seqs, vocab]` logits of each sequence's last token.
    fn compute_logits(&self, dev: &D, hidden: &D::Tensor, meta: &AttnMetadata) -> DevResult<D::Tensor>;
    /// Geometry of one layer's KV cache for `num_blocks` blocks, and the layer count.
    fn cache_shape(&self, num_blocks: usize, block_size: usize) -> (usize, CacheShape);
    /// Bytes of weights on the device.
    fn weight_bytes(&self) -> usize;
    /// Bytes of weights one token's forward reads on this rank: all of them, but for the
    /// experts of a mixture-of-experts model that the token does not take.
    fn active_weight_bytes(&self) -> usize {
        self.weight_bytes()
    }
    /// Whether a block of keys and values depends only on the tokens before it (and so may
    /// serve another sequence with the same prefix): not where the rotary embedding changes
    /// with the sequence's length (dynamic NTK, LongRoPE past its original context).
    fn prefix_cacheable(&self) -> bool {
        true
    }
    /// Places an adapter's weights in a LoRA slot (None clears it). A no-op on a model
    /// built without LoRA capacity: the scheduler never assigns slots then.
    fn set_lora_slot(&mut self, dev: &D, slot: usize, adapter: Option<&lora::LoraAdapter>) -> DevResult<()>;
    /// Whether the model was built with LoRA capacity (its forward then applies the
    /// adapters of `AttnMetadata::lora_slots`).
    fn has_lora(&self) -> bool;
    /// A length past which a sequence's whole context is computed again, once, as it first
    /// grows past it (LongRoPE's switch to its long factors, for which transformers' Phi-3
    /// recomputes its cache): the runner then runs every token of the sequence in that step.
    fn recompute_past(&self) -> Option<u32> {
        None
    }
}
