//! Llama (Llama 2/3, Mistral without sliding window, Qwen2 with q/k/v bias, SmolLM), after
//! HF `transformers/models/llama/modeling_llama.py` and vLLM `models/llama.py`.
//! Deviations: q/k/v and gate/up are fused at load (the stacked-params table below), and
//! attention goes through the paged KV cache.

use super::attn::AttnMetadata;
use super::config::ModelConfig;
use super::layers::{
    MergedColumnParallelLinear, PagedAttention, ParallelLMHead, QKVParallelLinear, RMSNorm, RotaryEmbedding,
    RowParallelLinear, VocabParallelEmbedding,
};
use super::loader::{ParamView, StackedParam, WeightStore};
use super::{CausalLM, ModelError};
use crate::kernels::{CacheShape, Device};

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
    fn forward(&self, dev: &D, x: &D::Tensor) -> D::Tensor {
        let gate_up = self.gate_up_proj.forward(dev, x); // [n, 2·intermediate]
        let act = dev.silu_mul(&gate_up); // [n, intermediate]
        self.down_proj.forward(dev, &act) // [n, hidden]
    }
}

pub struct LlamaAttention<D: Device> {
    qkv_proj: QKVParallelLinear<D>,
    o_proj: RowParallelLinear<D>,
    attn: PagedAttention,
}

impl<D: Device> LlamaAttention<D> {
    fn load(dev: &D, w: &ParamView, cfg: &ModelConfig) -> Result<Self, ModelError> {
        let q_size = cfg.num_heads * cfg.head_dim;
        let kv_size = cfg.num_kv_heads * cfg.head_dim;
        Ok(Self {
            qkv_proj: QKVParallelLinear::load(dev, w, cfg.hidden_size, q_size, kv_size, cfg.qkv_bias)?,
            o_proj: RowParallelLinear::load(dev, &w.pp("o_proj"), q_size, cfg.hidden_size)?,
            attn: PagedAttention::new(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
        })
    }
    fn forward(
        &self,
        dev: &D,
        x: &D::Tensor,
        positions: &[u32],
        rope: &RotaryEmbedding,
        cache: &mut D::Cache,
        meta: &AttnMetadata,
    ) -> D::Tensor {
        let qkv = self.qkv_proj.forward(dev, x); // [n, (heads + 2·kv_heads)·head_dim]
        let out = self.attn.forward(dev, &qkv, positions, rope, cache, meta); // [n, heads·head_dim]
        self.o_proj.forward(dev, &out) // [n, hidden]
    }
}

pub struct LlamaDecoderLayer<D: Device> {
    input_layernorm: RMSNorm<D>,
    self_attn: LlamaAttention<D>,
    post_attention_layernorm: RMSNorm<D>,
    mlp: LlamaMlp<D>,
}

impl<D: Device> LlamaDecoderLayer<D> {
    fn load(dev: &D, w: &ParamView, cfg: &ModelConfig) -> Result<Self, ModelError> {
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        Ok(Self {
            input_layernorm: RMSNorm::load(dev, &w.pp("input_layernorm"), h, eps)?,
            self_attn: LlamaAttention::load(dev, &w.pp("self_attn"), cfg)?,
            post_attention_layernorm: RMSNorm::load(dev, &w.pp("post_attention_layernorm"), h, eps)?,
            mlp: LlamaMlp::load(dev, &w.pp("mlp"), cfg)?,
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
    pub fn load(dev: &D, cfg: &ModelConfig, store: &WeightStore) -> Result<Self, ModelError> {
        let root = store.root();
        let w = root.pp("model");
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let layers = (0..cfg.num_layers)
            .map(|i| LlamaDecoderLayer::load(dev, &w.pp("layers").pp(i), cfg))
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
            weight_bytes: params * store.dtype.size(),
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
    ) -> D::Tensor {
        let mut residual = self.embed_tokens.forward(dev, input_ids); // [n, hidden]
        let mut x = self.layers[0].input_layernorm.forward(dev, &residual);
        for (i, (layer, cache)) in self.layers.iter().zip(kv_caches.iter_mut()).enumerate() {
            if i > 0 {
                x = layer.input_layernorm.forward_residual(dev, &x, &mut residual);
            }
            let attn = layer.self_attn.forward(dev, &x, positions, &self.rotary_emb, cache, meta);
            let h = layer.post_attention_layernorm.forward_residual(dev, &attn, &mut residual);
            x = layer.mlp.forward(dev, &h);
        }
        self.norm.forward_residual(dev, &x, &mut residual)
    }

    fn compute_logits(&self, dev: &D, hidden: &D::Tensor, meta: &AttnMetadata) -> D::Tensor {
        let last = dev.gather_rows(hidden, &meta.last_token_rows); // [num_seqs, hidden]
        self.lm_head.forward(dev, &last, &self.embed_tokens) // [num_seqs, vocab]
    }

    fn cache_shape(&self, num_blocks: usize, block_size: usize) -> (usize, CacheShape) {
        let shape = CacheShape {
            num_blocks,
            block_size,
            num_kv_heads: self.cfg.num_kv_heads,
            head_dim: self.cfg.head_dim,
        };
        (self.cfg.num_layers, shape)
    }

    fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }
}
