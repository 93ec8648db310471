//! Llama (Llama 2/3, Mistral without sliding window, Qwen2 with q/k/v bias, SmolLM), after
//! HF `transformers/models/llama/modeling_llama.py` and vLLM `models/llama.py`.
//! Deviations: q/k/v and gate/up are fused at load (the stacked-params table below), and
//! attention goes through the paged KV cache.

use super::attn::AttnMetadata;
use super::config::ModelConfig;
use std::borrow::Cow;

use super::layers::{
    MergedColumnParallelLinear, PagedAttention, ParallelLMHead, ProjLora, QKVParallelLinear, RMSNorm,
    RotaryEmbedding, RowParallelLinear, VocabParallelEmbedding, qkv_heads, shard,
};
use super::loader::{ParamView, StackedParam, WeightStore};
use super::lora::{LORA_MODULES, LoraAdapter};
use super::{CausalLM, LoadOptions, LoraCapacity, ModelError};
use crate::kernels::{CacheShape, DevResult, Device, LoraShape, LoraSlotWeights};

/// Checkpoint shards that load into fused parameters (vLLM's stacked_params_mapping).
pub const STACKED_PARAMS: &[StackedParam] = &[
    StackedParam { param: "qkv_proj", shard: "q_proj", index: 0 },
    StackedParam { param: "qkv_proj", shard: "k_proj", index: 1 },
    StackedParam { param: "qkv_proj", shard: "v_proj", index: 2 },
    StackedParam { param: "gate_up_proj", shard: "gate_proj", index: 0 },
    StackedParam { param: "gate_up_proj", shard: "up_proj", index: 1 },
];

/// Checkpoint tensors the model does not use.
pub fn skip_tensor(name: &str, cfg: &ModelConfig) -> bool {
    name.contains("rotary_emb.inv_freq") || (cfg.tie_word_embeddings && name.starts_with("lm_head."))
}

/// Per-module LoRA buffers of one decoder layer, indexed like [`LORA_MODULES`], with the
/// column offset of each module's output inside its (possibly fused) projection and the
/// part of the adapter's weights this rank holds.
pub struct LayerLora<D: Device> {
    modules: Vec<(D::Lora, usize)>,
    parts: Vec<LoraPart>,
}

/// The share of one module's adapter weights a tensor-parallel rank holds, following its
/// base layer: a column-parallel layer's output rows (rows of B), a row-parallel layer's
/// input columns (columns of A, whose delta joins the partial product before the sum).
#[derive(Debug, Clone)]
enum LoraPart {
    Out(std::ops::Range<usize>),
    In { cols: std::ops::Range<usize>, of: usize },
}

impl LoraPart {
    /// (A, B) of this rank from an adapter's full `a` `[rank, in]` and `b` `[out, rank]`.
    fn slice<'w>(&self, a: &'w [f32], b: &'w [f32], rank: usize) -> (Cow<'w, [f32]>, Cow<'w, [f32]>) {
        match self {
            LoraPart::Out(rows) => (a.into(), b[rows.start * rank..rows.end * rank].into()),
            LoraPart::In { cols, of } => {
                let a: Vec<f32> = a.chunks_exact(*of).flat_map(|row| &row[cols.clone()]).copied().collect();
                (a.into(), b.into())
            }
        }
    }
}

impl<D: Device> LayerLora<D> {
    fn new(dev: &D, cfg: &ModelConfig, cap: LoraCapacity) -> Result<Self, ModelError> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (qh, kvh) = qkv_heads(cfg.num_heads, cfg.num_kv_heads, dev.tp());
        let (q, kv, i) =
            (qh.start * d..qh.end * d, kvh.start * d..kvh.end * d, shard(cfg.intermediate_size, dev.tp()));
        let (ql, kvl, il) = (q.len(), kv.len(), i.len());
        let (q_in, i_in) = (
            LoraPart::In { cols: q.clone(), of: cfg.num_heads * d },
            LoraPart::In { cols: i.clone(), of: cfg.intermediate_size },
        );
        // (in, out, offset in the fused output, this rank's part) for q, k, v, o, gate, up, down.
        let dims = [
            (h, ql, 0, LoraPart::Out(q)),
            (h, kvl, ql, LoraPart::Out(kv.clone())),
            (h, kvl, ql + kvl, LoraPart::Out(kv)),
            (ql, h, 0, q_in),
            (h, il, 0, LoraPart::Out(i.clone())),
            (h, il, il, LoraPart::Out(i)),
            (il, h, 0, i_in),
        ];
        let parts = dims.iter().map(|d| d.3.clone()).collect();
        let mut modules = Vec::with_capacity(dims.len());
        // Each projection's modules (they read the same x) are allocated as one group.
        for group in [QKV, O, GATE_UP, DOWN] {
            let shapes: Vec<LoraShape> = dims[group.clone()]
                .iter()
                .map(|&(fin, fout, ..)| LoraShape {
                    slots: cap.slots,
                    max_rank: cap.max_rank,
                    in_features: fin,
                    out_features: fout,
                    bf16: cap.bf16,
                })
                .collect();
            let offsets = dims[group].iter().map(|d| d.2);
            modules.extend(dev.alloc_lora(&shapes)?.into_iter().zip(offsets));
        }
        Ok(Self { modules, parts })
    }

    /// Modules `range` (one projection's), with their column offsets in its output, when
    /// the batch has adapter slots.
    fn modules(&self, range: std::ops::Range<usize>, meta: &AttnMetadata) -> Vec<(&D::Lora, usize)> {
        match meta.lora_slots.is_empty() {
            true => Vec::new(),
            false => self.modules[range].iter().map(|(l, off)| (l, *off)).collect(),
        }
    }

    /// Whether [`Self::modules`] of `range` would apply any adapter to this batch.
    fn applies(&self, range: std::ops::Range<usize>, meta: &AttnMetadata) -> bool {
        !meta.lora_slots.is_empty() && !self.modules[range].is_empty()
    }
}

/// A projection's LoRA as the linear layers take it: `modules` (from
/// [`LayerLora::modules`]) and the batch's slots, or none without modules.
fn proj_lora<'a, D: Device>(modules: &'a [(&'a D::Lora, usize)], meta: &'a AttnMetadata) -> ProjLora<'a, D> {
    (!modules.is_empty()).then_some((modules, &meta.lora_slots[..]))
}

/// Module index ranges per projection (see [`LORA_MODULES`]).
const QKV: std::ops::Range<usize> = 0..3;
const O: std::ops::Range<usize> = 3..4;
const GATE_UP: std::ops::Range<usize> = 4..6;
const DOWN: std::ops::Range<usize> = 6..7;

pub struct LlamaMlp<D: Device> {
    gate_up_proj: MergedColumnParallelLinear<D>,
    down_proj: RowParallelLinear<D>,
}

impl<D: Device> LlamaMlp<D> {
    fn load(dev: &D, w: &ParamView, cfg: &ModelConfig) -> Result<Self, ModelError> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Self {
            gate_up_proj: MergedColumnParallelLinear::load(dev, w, h, i)?,
            down_proj: RowParallelLinear::load(dev, &w.pp("down_proj"), i, h)?,
        })
    }
    /// The MLP of `x` added to `residual`, then `norm` of the sum for the next projection
    /// (with `gemm_only`, that projection applies no adapters).
    #[allow(clippy::too_many_arguments)]
    fn forward_add_norm(
        &self,
        dev: &D,
        x: &D::Tensor,
        lora: Option<&LayerLora<D>>,
        meta: &AttnMetadata,
        residual: &mut D::Tensor,
        norm: &RMSNorm<D>,
        gemm_only: bool,
    ) -> DevResult<D::Tensor> {
        let modules = |range| lora.map(|l| l.modules(range, meta)).unwrap_or_default();
        let (gate_up_lora, down_lora) = (modules(GATE_UP), modules(DOWN));
        let down = proj_lora::<D>(&down_lora, meta);
        let act = self.gate_up_proj.forward_silu_mul(
            dev,
            x,
            proj_lora::<D>(&gate_up_lora, meta),
            down.is_none(),
        )?; // [n, intermediate]
        self.down_proj.forward_add_norm(dev, &act, down, residual, norm, gemm_only) // [n, hidden]
    }
}

pub struct LlamaAttention<D: Device> {
    qkv_proj: QKVParallelLinear<D>,
    o_proj: RowParallelLinear<D>,
    attn: PagedAttention,
}

impl<D: Device> LlamaAttention<D> {
    fn load(dev: &D, w: &ParamView, cfg: &ModelConfig) -> Result<Self, ModelError> {
        let heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let qkv_proj = QKVParallelLinear::load(dev, w, cfg.hidden_size, heads, cfg.qkv_bias)?;
        let q_size = cfg.num_heads * cfg.head_dim;
        Ok(Self {
            attn: PagedAttention::new(qkv_proj.num_heads, qkv_proj.num_kv_heads, cfg.head_dim),
            qkv_proj,
            o_proj: RowParallelLinear::load(dev, &w.pp("o_proj"), q_size, cfg.hidden_size)?,
        })
    }
    /// Attention over `x` added to `residual`, then `norm` of the sum for the MLP (with
    /// `gemm_only`, its gate/up projection applies no adapters).
    #[allow(clippy::too_many_arguments)]
    fn forward_add_norm(
        &self,
        dev: &D,
        x: &D::Tensor,
        (positions, rope): (&[u32], &RotaryEmbedding),
        cache: &mut D::Cache,
        lora: Option<&LayerLora<D>>,
        meta: &AttnMetadata,
        (residual, norm, gemm_only): (&mut D::Tensor, &RMSNorm<D>, bool),
    ) -> DevResult<D::Tensor> {
        let modules = |range| lora.map(|l| l.modules(range, meta)).unwrap_or_default();
        let (qkv_lora, o_lora) = (modules(QKV), modules(O));
        let attn = match proj_lora::<D>(&qkv_lora, meta) {
            None => {
                let w = (&self.qkv_proj.weight, self.qkv_proj.bias.as_ref());
                self.attn.forward_projecting(dev, x, w, positions, rope, cache, meta)?
            }
            lora => {
                let qkv = self.qkv_proj.forward(dev, x, lora)?; // [n, (heads + 2·kv_heads)·head_dim]
                self.attn.forward(dev, &qkv, positions, rope, cache, meta)?
            }
        }; // [n, heads·head_dim]
        let o_lora = proj_lora::<D>(&o_lora, meta);
        self.o_proj.forward_add_norm(dev, &attn, o_lora, residual, norm, gemm_only) // [n, hidden]
    }
}

pub struct LlamaDecoderLayer<D: Device> {
    input_layernorm: RMSNorm<D>,
    self_attn: LlamaAttention<D>,
    post_attention_layernorm: RMSNorm<D>,
    mlp: LlamaMlp<D>,
    lora: Option<LayerLora<D>>,
}

impl<D: Device> LlamaDecoderLayer<D> {
    fn load(dev: &D, w: &ParamView, cfg: &ModelConfig, opts: &LoadOptions) -> Result<Self, ModelError> {
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        Ok(Self {
            input_layernorm: RMSNorm::load(dev, &w.pp("input_layernorm"), h, eps)?,
            self_attn: LlamaAttention::load(dev, &w.pp("self_attn"), cfg)?,
            post_attention_layernorm: RMSNorm::load(dev, &w.pp("post_attention_layernorm"), h, eps)?,
            mlp: LlamaMlp::load(dev, &w.pp("mlp"), cfg)?,
            lora: opts.lora.map(|cap| LayerLora::new(dev, cfg, cap)).transpose()?,
        })
    }
}

pub struct LlamaForCausalLM<D: Device> {
    cfg: ModelConfig,
    embed_tokens: VocabParallelEmbedding<D>,
    layers: Vec<LlamaDecoderLayer<D>>,
    norm: RMSNorm<D>,
    lm_head: ParallelLMHead<D>,
    rotary_emb: RotaryEmbedding,
    weight_bytes: usize,
}

impl<D: Device> LlamaForCausalLM<D> {
    pub fn load(
        dev: &D,
        cfg: &ModelConfig,
        store: &WeightStore,
        opts: &LoadOptions,
    ) -> Result<Self, ModelError> {
        let root = store.root();
        let w = root.pp("model");
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let layers = (0..cfg.num_layers)
            .map(|i| LlamaDecoderLayer::load(dev, &w.pp("layers").pp(i), cfg, opts))
            .collect::<Result<Vec<_>, _>>()?;
        let tied = cfg.tie_word_embeddings || !root.contains("lm_head.weight");
        let per_layer = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
            + cfg.num_heads * cfg.head_dim * h
            + 3 * h * cfg.intermediate_size
            + 2 * h;
        let params = v * h * if tied { 1 } else { 2 } + cfg.num_layers * per_layer + h;
        Ok(Self {
            cfg: cfg.clone(),
            embed_tokens: VocabParallelEmbedding::load(dev, &w.pp("embed_tokens"), v, h)?,
            layers,
            norm: RMSNorm::load(dev, &w.pp("norm"), h, cfg.rms_norm_eps)?,
            lm_head: ParallelLMHead::load(dev, &root.pp("lm_head"), v, h, tied)?,
            rotary_emb: RotaryEmbedding::new(cfg),
            // Per rank: everything but the norms is split over the ranks.
            weight_bytes: params * store.dtype.size() / dev.tp().world,
        })
    }
}

impl<D: Device> CausalLM<D> for LlamaForCausalLM<D> {
    fn forward(
        &self,
        dev: &D,
        input_ids: &[u32],
        positions: &[u32],
        kv_caches: &mut [D::Cache],
        meta: &AttnMetadata,
    ) -> DevResult<D::Tensor> {
        // Whether a projection of `lora` applies no adapters this step: then only its GEMM
        // reads the norm before it.
        let plain = |lora: Option<&LayerLora<D>>, range| lora.is_none_or(|l| !l.applies(range, meta));
        let mut residual = self.embed_tokens.forward(dev, input_ids)?; // [n, hidden]
        let first = &self.layers[0];
        let mut x =
            first.input_layernorm.forward_to_proj(dev, &residual, None, plain(first.lora.as_ref(), QKV))?;
        // Each projection into the residual comes with the norm after it: the next layer's
        // input norm, and after the last layer the model's (hidden states, not only a GEMM's
        // input).
        for (i, (layer, cache)) in self.layers.iter().zip(kv_caches.iter_mut()).enumerate() {
            let lora = layer.lora.as_ref();
            let post = (&mut residual, &layer.post_attention_layernorm, plain(lora, GATE_UP));
            let rope = (positions, &self.rotary_emb);
            let h = layer.self_attn.forward_add_norm(dev, &x, rope, cache, lora, meta, post)?;
            let (next_norm, gemm_only) = match self.layers.get(i + 1) {
                Some(next) => (&next.input_layernorm, plain(next.lora.as_ref(), QKV)),
                None => (&self.norm, false),
            };
            x = layer.mlp.forward_add_norm(dev, &h, lora, meta, &mut residual, next_norm, gemm_only)?;
        }
        Ok(x)
    }

    fn compute_logits(&self, dev: &D, hidden: &D::Tensor, meta: &AttnMetadata) -> DevResult<D::Tensor> {
        // Every row in order (decode steps not padded, such as batch 1's): the hidden states
        // as they are, with the 16-bit copy the final norm wrote for the GEMM. Gathered, they
        // would be copied, and converted again for a 16-bit lm_head: on the H200 two kernels
        // between the last layer and lm_head at batch 1.
        let rows = &meta.last_token_rows;
        let all = dev.shape(hidden).0 == rows.len() && rows.iter().enumerate().all(|(i, &r)| i == r);
        let gathered;
        let last = match all {
            true => hidden,
            false => {
                gathered = dev.gather_rows(hidden, rows)?; // [num_seqs, hidden]
                &gathered
            }
        };
        self.lm_head.forward(dev, last, &self.embed_tokens, self.cfg.vocab_size) // [num_seqs, vocab]
    }

    fn cache_shape(&self, num_blocks: usize, block_size: usize) -> (usize, CacheShape) {
        let shape = CacheShape {
            num_blocks,
            block_size,
            num_kv_heads: self.layers[0].self_attn.attn.shape.num_kv_heads,
            head_dim: self.cfg.head_dim,
        };
        (self.cfg.num_layers, shape)
    }

    fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    fn has_lora(&self) -> bool {
        self.layers.first().is_some_and(|l| l.lora.is_some())
    }

    fn set_lora_slot(&mut self, dev: &D, slot: usize, adapter: Option<&LoraAdapter>) -> DevResult<()> {
        for (i, layer) in self.layers.iter_mut().enumerate() {
            let Some(l) = layer.lora.as_mut() else { return Ok(()) };
            for (m, ((buf, _), part)) in l.modules.iter_mut().zip(&l.parts).enumerate() {
                let w = adapter.and_then(|a| a.weights.get(&(i, m)).map(|w| (a, w)));
                let sliced = w.map(|(a, w)| (part.slice(&w.a, &w.b, a.rank), a.rank, a.scale));
                let slot_weights = sliced.as_ref().map(|((a, b), rank, scale)| LoraSlotWeights {
                    a,
                    b,
                    rank: *rank,
                    scale: *scale,
                });
                dev.set_lora_slot(buf, slot, slot_weights)?;
            }
        }
        debug_assert_eq!(LORA_MODULES.len(), 7);
        Ok(())
    }
}
