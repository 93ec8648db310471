//! Rotary embedding and the PagedAttention layer. Prefill, decode and their mix are one
//! call: the device kernel reads each token's context through the block tables.

use super::{ProjLora, QKVParallelLinear, RMSNorm};
use crate::kernels::attn::AttnMetadata;
use crate::kernels::{AttnShape, CacheShape, DevResult, Device, RopeSpec};
use crate::models::config::Rope;

/// HF's rotate-half rotary embedding with the config's frequency scaling (or none, for a
/// model with learned positions).
pub struct RotaryEmbedding {
    pub spec: RopeSpec,
}

impl RotaryEmbedding {
    pub fn new(rope: &Rope, head_dim: usize) -> Self {
        Self { spec: rope.spec(head_dim) }
    }
    /// No rotation: positions are learned embeddings added to the input.
    pub fn none(head_dim: usize) -> Self {
        Self { spec: RopeSpec::none(head_dim) }
    }
}

/// A layer's q and k norms, where it has them.
pub type QkNorms<'a, D> = Option<(&'a RMSNorm<D>, &'a RMSNorm<D>)>;

/// Attention over the paged KV cache with this rank's heads and the model's options
/// (scale, sliding window, soft cap).
pub struct PagedAttention {
    pub shape: AttnShape,
}

impl PagedAttention {
    pub fn new(shape: AttnShape) -> Self {
        Self { shape }
    }
    /// `CausalLM::cache_shape` of a model of `layers` layers like this one: one paged cache
    /// per layer for this rank's KV heads.
    pub fn cache_shape(&self, layers: usize, num_blocks: usize, block_size: usize) -> (usize, CacheShape) {
        let shape = CacheShape {
            num_blocks,
            block_size,
            num_kv_heads: self.shape.num_kv_heads,
            head_dim: self.shape.head_dim,
        };
        (layers, shape)
    }
    /// Splits fused qkv, applies RoPE, writes k/v to the cache and attends.
    /// `[n, q+2kv]` → `[n, heads·head_dim]`.
    pub fn forward<D: Device>(
        &self,
        dev: &D,
        qkv: &D::Tensor,
        rope: &RotaryEmbedding,
        cache: &mut D::Cache,
        meta: &AttnMetadata,
    ) -> DevResult<D::Tensor> {
        dev.qkv_attention(qkv, self.shape, &rope.spec, cache, meta)
    }
    /// [`Self::forward`] of the projection of `x` by a fused qkv weight `w` (with `bias`)
    /// that applies no adapters: the device may project, rotate and write the cache at once.
    pub fn forward_projecting<D: Device>(
        &self,
        dev: &D,
        x: &D::Tensor,
        (w, bias): (&D::Weight, Option<&D::Weight>),
        rope: &RotaryEmbedding,
        cache: &mut D::Cache,
        meta: &AttnMetadata,
    ) -> DevResult<D::Tensor> {
        dev.project_qkv_attention(x, w, bias, (self.shape, &rope.spec), cache, meta)
    }
    /// The attention of `x` through a fused qkv projection with its adapters (`lora`) and
    /// the model's q/k norms, if any: with neither, through [`Self::forward_projecting`],
    /// which the device may fuse; else the projection, the norms and [`Self::forward`].
    pub fn forward_qkv<D: Device>(
        &self,
        dev: &D,
        x: &D::Tensor,
        (qkv_proj, lora, qk_norm): (&QKVParallelLinear<D>, ProjLora<D>, QkNorms<D>),
        rope: &RotaryEmbedding,
        cache: &mut D::Cache,
        meta: &AttnMetadata,
    ) -> DevResult<D::Tensor> {
        if lora.is_none() && qk_norm.is_none() {
            let w = (&qkv_proj.weight, qkv_proj.bias.as_ref());
            return self.forward_projecting(dev, x, w, rope, cache, meta);
        }
        let mut qkv = qkv_proj.forward(dev, x, lora)?; // [n, (heads + 2·kv_heads)·head_dim]
        if let Some((q, k)) = qk_norm {
            dev.qk_norm(&mut qkv, self.shape, &q.weight, &k.weight, q.eps)?;
        }
        self.forward(dev, &qkv, rope, cache, meta)
    }
}
