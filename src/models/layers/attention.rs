//! Rotary embedding and the PagedAttention layer. Prefill, decode and their mix are one
//! call: the device kernel reads each token's context through the block tables.

use crate::kernels::{AttnShape, DevResult, Device, RopeSpec};
use crate::models::attn::AttnMetadata;
use crate::models::config::ModelConfig;

/// HF's rotate-half rotary embedding with the config's frequency scaling.
pub struct RotaryEmbedding {
    pub spec: RopeSpec,
}

impl RotaryEmbedding {
    pub fn new(cfg: &ModelConfig) -> Self {
        Self { spec: RopeSpec { inv_freq: cfg.inv_freq(), head_dim: cfg.head_dim } }
    }
}

pub struct PagedAttention {
    pub shape: AttnShape,
}

impl PagedAttention {
    pub fn new(num_heads: usize, num_kv_heads: usize, head_dim: usize) -> Self {
        let scale = 1.0 / (head_dim as f32).sqrt();
        Self { shape: AttnShape { num_heads, num_kv_heads, head_dim, scale } }
    }
    /// Splits fused qkv, applies RoPE, writes k/v to the cache and attends.
    /// `[n, q+2kv]` → `[n, heads·head_dim]`.
    pub fn forward<D: Device>(
        &self,
        dev: &D,
        qkv: &D::Tensor,
        positions: &[u32],
        rope: &RotaryEmbedding,
        cache: &mut D::Cache,
        meta: &AttnMetadata,
    ) -> DevResult<D::Tensor> {
        dev.qkv_attention(qkv, self.shape, &rope.spec, positions, cache, meta)
    }
    /// [`Self::forward`] of the projection of `x` by a fused qkv weight `w` (with `bias`)
    /// that applies no adapters: the device may project, rotate and write the cache at once.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_projecting<D: Device>(
        &self,
        dev: &D,
        x: &D::Tensor,
        (w, bias): (&D::Weight, Option<&D::Weight>),
        positions: &[u32],
        rope: &RotaryEmbedding,
        cache: &mut D::Cache,
        meta: &AttnMetadata,
    ) -> DevResult<D::Tensor> {
        dev.project_qkv_attention(x, w, bias, (self.shape, &rope.spec, positions), cache, meta)
    }
}
