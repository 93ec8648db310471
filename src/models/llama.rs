//! Llama, after HF `transformers/models/llama/modeling_llama.py` and vLLM
//! `models/llama.py`: RMSNorm, rotary attention over q/k/v (with GQA), a gated SiLU MLP.
//! The same layers, with the options of [`LlamaArch`], serve the families shaped like it:
//! Mistral (sliding window), Qwen2 (q/k/v bias, sliding window on upper layers), Qwen3
//! (q/k norms, `qwen3.rs`), Gemma (`(1 + w)` norms, GELU-tanh, scaled embeddings,
//! `gemma.rs`) and Phi-3 (fused checkpoint projections, LongRoPE, `phi3.rs`).
//! Deviations: q/k/v and gate/up are fused at load (the stacked-params table below), and
//! attention goes through the paged KV cache.

use serde::Deserialize;

use super::config::{ModelConfig, Rope, RopeConfig, check_layer_types, parse_hf, unsupported};
use super::layers::lora::{LayerLora, layer_modules, plain, proj_lora, set_slot_in_layers};
use super::layers::{
    MergedColumnParallelLinear, MoeConfig, Norm, PagedAttention, ParallelLMHead, QKVParallelLinear, RMSNorm,
    RotaryEmbedding, RowParallelLinear, SparseMoeBlock, VocabParallelEmbedding, gather_last_rows,
};
use super::loader::{ParamView, StackedParam, WeightStore};
use super::lora::{LoraAdapter, Proj, llama_targets};
use super::registry::ModelEntry;
use super::{CausalLM, LoadOptions, ModelError};
use crate::kernels::attn::AttnMetadata;
use crate::kernels::{Activation, AttnShape, CacheShape, DevResult, Device};

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

/// Llama's own fields of config.json (and those of the families that share its layers).
#[derive(Debug, Deserialize)]
pub struct LlamaConfig {
    pub intermediate_size: usize,
    pub rms_norm_eps: Option<f64>,
    pub hidden_act: Option<String>,
    pub attention_bias: Option<bool>,
    pub mlp_bias: Option<bool>,
    pub sliding_window: Option<usize>,
    pub use_sliding_window: Option<bool>,
    pub max_window_layers: Option<usize>,
    pub layer_types: Option<Vec<String>>,
    #[serde(flatten)]
    pub rope: RopeConfig,
}

/// What varies among the families that share Llama's layers.
#[derive(Debug, Clone)]
pub struct LlamaArch {
    pub intermediate_size: usize,
    pub rms_norm_eps: f32,
    pub act: Activation,
    pub qkv_bias: bool,
    /// RMSNorm over each head of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Norms of `(1 + w) · x/rms` (Gemma).
    pub norm_offset: bool,
    /// Embeddings multiplied by √hidden (Gemma).
    pub embed_scale: bool,
    /// q/k/v and gate/up stored fused in the checkpoint (Phi-3).
    pub fused_checkpoint: bool,
    /// Per layer: its sliding window (0: full attention).
    pub windows: Vec<usize>,
    pub rope: Rope,
    /// Mixture-of-experts blocks in place of the MLP on the layers it marks (Mixtral,
    /// Qwen2-MoE, Qwen3-MoE).
    pub moe: Option<MoeConfig>,
}

impl LlamaConfig {
    /// The activation named by `hidden_act`, SiLU when absent.
    pub fn act(&self, arch: &str) -> Result<Activation, ModelError> {
        let name = self.hidden_act.as_deref().unwrap_or("silu");
        Activation::from_hf(name).ok_or_else(|| unsupported(arch, "hidden_act", name, Activation::HF_NAMES))
    }
    /// Per layer, its window: `sliding_window` on the layers `layer_types` (or, in older
    /// files, `use_sliding_window` with `max_window_layers`) marks sliding.
    pub fn windows(&self, arch: &str, layers: usize) -> Result<Vec<usize>, ModelError> {
        check_layer_types(arch, self.layer_types.as_deref(), layers)?;
        let Some(w) = self.sliding_window.filter(|_| self.use_sliding_window != Some(false)) else {
            return Ok(vec![0; layers]);
        };
        Ok(match (&self.layer_types, self.max_window_layers) {
            (Some(types), _) => types.iter().map(|t| if t == "sliding_attention" { w } else { 0 }).collect(),
            (None, Some(first)) if self.use_sliding_window == Some(true) => {
                (0..layers).map(|i| if i >= first { w } else { 0 }).collect()
            }
            _ => vec![w; layers],
        })
    }
    /// The options every Llama-shaped family starts from.
    pub fn arch(&self, cfg: &ModelConfig) -> Result<LlamaArch, ModelError> {
        let arch = cfg.architecture.as_str();
        if self.mlp_bias == Some(true) {
            return Err(unsupported(arch, "mlp_bias", true, "false"));
        }
        Ok(LlamaArch {
            intermediate_size: self.intermediate_size,
            rms_norm_eps: self.rms_norm_eps.unwrap_or(1e-6) as f32,
            act: self.act(arch)?,
            qkv_bias: self.attention_bias.unwrap_or(false),
            qk_norm: false,
            norm_offset: false,
            embed_scale: false,
            fused_checkpoint: false,
            windows: vec![0; cfg.num_layers],
            rope: self.rope.resolve(arch, cfg.head_dim, "full_attention", 10000.0)?,
            moe: None,
        })
    }
}

/// The shared config of a Llama-shaped family, its LoRA targets declared, and its
/// context the one its rotary embedding serves.
pub fn llama_config(cfg: ModelConfig, arch: &LlamaArch) -> ModelConfig {
    let mut cfg = cfg;
    cfg.lora_targets = llama_targets(&cfg, arch.intermediate_size);
    if let Some(moe) = &arch.moe {
        // Adapters apply to attention: not to the experts (nor a model's few dense MLPs).
        cfg.lora_targets.retain(|t| t.path.starts_with("self_attn."));
        cfg.moe_experts = moe.experts;
    }
    if let Some(context) = arch.rope.context {
        cfg.max_position_embeddings = context;
    }
    cfg
}

/// `LlamaForCausalLM` and `MistralForCausalLM` (a sliding window on every layer).
pub fn arch(cfg: &ModelConfig) -> Result<LlamaArch, ModelError> {
    let c: LlamaConfig = parse_hf(&cfg.hf, &cfg.architecture)?;
    let mut a = c.arch(cfg)?;
    if cfg.architecture == "MistralForCausalLM" {
        a.windows = vec![c.sliding_window.unwrap_or(0); cfg.num_layers];
    }
    Ok(a)
}

/// `Qwen2ForCausalLM`: q/k/v bias, a sliding window on the layers its config marks.
pub fn qwen2_arch(cfg: &ModelConfig) -> Result<LlamaArch, ModelError> {
    let c: LlamaConfig = parse_hf(&cfg.hf, &cfg.architecture)?;
    let mut a = c.arch(cfg)?;
    a.qkv_bias = c.attention_bias.unwrap_or(true);
    a.windows = c.windows(&cfg.architecture, cfg.num_layers)?;
    Ok(a)
}

/// A family that shares Llama's layers: how its config sets their options. Its registry
/// entry is [`family_entry`].
pub trait LlamaFamily {
    /// The layers' options, from the family's config.json.
    fn arch(cfg: &ModelConfig) -> Result<LlamaArch, ModelError>;
    /// The shared config as the family resolves it (its LoRA targets and context set).
    fn read(cfg: ModelConfig) -> Result<ModelConfig, ModelError> {
        let a = Self::arch(&cfg)?;
        Ok(llama_config(cfg, &a))
    }
}

fn read_family<F: LlamaFamily>(
    hf: &std::sync::Arc<serde_json::Value>,
    name: &str,
) -> Result<ModelConfig, ModelError> {
    F::read(ModelConfig::from_hf(hf, name)?)
}

fn build_family<D: Device, F: LlamaFamily>(
    d: &D,
    c: &ModelConfig,
    w: &WeightStore,
    o: &LoadOptions,
) -> Result<Box<dyn CausalLM<D>>, ModelError> {
    Ok(Box::new(LlamaForCausalLM::load_arch(d, c, w, o, &F::arch(c)?)?))
}

/// The registry's entry for family `F`, its checkpoint stacked by `stacked_params`.
pub fn family_entry<D: Device, F: LlamaFamily>(stacked_params: &'static [StackedParam]) -> ModelEntry<D> {
    ModelEntry {
        config: read_family::<F>,
        construct: build_family::<D, F>,
        stacked_params,
        skip: skip_tensor,
    }
}

/// `LlamaForCausalLM` and `MistralForCausalLM`.
pub struct Llama;

impl LlamaFamily for Llama {
    fn arch(cfg: &ModelConfig) -> Result<LlamaArch, ModelError> {
        arch(cfg)
    }
}

/// `Qwen2ForCausalLM`.
pub struct Qwen2;

impl LlamaFamily for Qwen2 {
    fn arch(cfg: &ModelConfig) -> Result<LlamaArch, ModelError> {
        qwen2_arch(cfg)
    }
}

/// The registry's entry for `LlamaForCausalLM` and `MistralForCausalLM`.
pub fn entry<D: Device>() -> ModelEntry<D> {
    family_entry::<D, Llama>(STACKED_PARAMS)
}

/// The registry's entry for `Qwen2ForCausalLM`.
pub fn qwen2_entry<D: Device>() -> ModelEntry<D> {
    family_entry::<D, Qwen2>(STACKED_PARAMS)
}

/// A layer's MLP: dense, or a mixture-of-experts block.
pub enum Mlp<D: Device> {
    Dense(LlamaMlp<D>),
    Sparse(SparseMoeBlock<D>),
}

impl<D: Device> Mlp<D> {
    /// The MLP of `x` added to `residual`, then `norm` of the sum for the next projection
    /// (see [`LlamaMlp::forward_add_norm`]).
    #[allow(clippy::too_many_arguments)]
    fn forward_add_norm(
        &self,
        dev: &D,
        x: &D::Tensor,
        lora: Option<&LayerLora<D>>,
        meta: &AttnMetadata,
        residual: &mut D::Tensor,
        norm: &Norm<D>,
        gemm_only: bool,
    ) -> DevResult<D::Tensor> {
        match self {
            Mlp::Dense(m) => m.forward_add_norm(dev, x, lora, meta, residual, norm, gemm_only),
            Mlp::Sparse(m) => norm.forward_to_proj(dev, &m.forward(dev, x)?, Some(residual), gemm_only),
        }
    }
}

pub struct LlamaMlp<D: Device> {
    gate_up_proj: MergedColumnParallelLinear<D>,
    down_proj: RowParallelLinear<D>,
    act: Activation,
}

impl<D: Device> LlamaMlp<D> {
    fn load(dev: &D, w: &ParamView, cfg: &ModelConfig, a: &LlamaArch) -> Result<Self, ModelError> {
        let (h, i) = (cfg.hidden_size, a.intermediate_size);
        let gate_up_proj = match a.fused_checkpoint {
            true => MergedColumnParallelLinear::load_fused(dev, w, h, i)?,
            false => MergedColumnParallelLinear::load(dev, w, h, i)?,
        };
        Ok(Self {
            gate_up_proj,
            down_proj: RowParallelLinear::load(dev, &w.pp("down_proj"), i, h)?,
            act: a.act,
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
        norm: &Norm<D>,
        gemm_only: bool,
    ) -> DevResult<D::Tensor> {
        let (up_lora, down_lora) =
            (layer_modules(lora, Proj::Up, meta), layer_modules(lora, Proj::Down, meta));
        let down = proj_lora::<D>(&down_lora, meta);
        let up = proj_lora::<D>(&up_lora, meta);
        let act = self.gate_up_proj.forward_act_mul(dev, x, up, self.act, down.is_none())?; // [n, intermediate]
        self.down_proj.forward_add_norm(dev, &act, down, residual, norm, gemm_only) // [n, hidden]
    }
}

pub struct LlamaAttention<D: Device> {
    qkv_proj: QKVParallelLinear<D>,
    /// Qwen3's per-head RMSNorms of q and k.
    q_norm: Option<RMSNorm<D>>,
    k_norm: Option<RMSNorm<D>>,
    o_proj: RowParallelLinear<D>,
    attn: PagedAttention,
}

impl<D: Device> LlamaAttention<D> {
    fn load(
        dev: &D,
        w: &ParamView,
        cfg: &ModelConfig,
        a: &LlamaArch,
        window: usize,
    ) -> Result<Self, ModelError> {
        let heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let qkv_proj = match a.fused_checkpoint {
            true => QKVParallelLinear::load_fused(dev, w, cfg.hidden_size, heads, a.qkv_bias)?,
            false => QKVParallelLinear::load(dev, w, cfg.hidden_size, heads, a.qkv_bias)?,
        };
        let norm = |name: &str| match a.norm_offset {
            true => RMSNorm::load_offset(dev, &w.pp(name), cfg.head_dim, a.rms_norm_eps),
            false => RMSNorm::load(dev, &w.pp(name), cfg.head_dim, a.rms_norm_eps),
        };
        let (q_norm, k_norm) = match a.qk_norm {
            true => (Some(norm("q_norm")?), Some(norm("k_norm")?)),
            false => (None, None),
        };
        let q_size = cfg.num_heads * cfg.head_dim;
        let mut shape = AttnShape::causal(qkv_proj.num_heads, qkv_proj.num_kv_heads, cfg.head_dim);
        shape.window = window;
        Ok(Self {
            attn: PagedAttention::new(shape),
            qkv_proj,
            q_norm,
            k_norm,
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
        rope: &RotaryEmbedding,
        cache: &mut D::Cache,
        lora: Option<&LayerLora<D>>,
        meta: &AttnMetadata,
        (residual, norm, gemm_only): (&mut D::Tensor, &Norm<D>, bool),
    ) -> DevResult<D::Tensor> {
        let (qkv_lora, o_lora) = (layer_modules(lora, Proj::Qkv, meta), layer_modules(lora, Proj::Out, meta));
        let qk_norm = self.q_norm.as_ref().zip(self.k_norm.as_ref());
        let qkv = (&self.qkv_proj, proj_lora::<D>(&qkv_lora, meta), qk_norm);
        let attn = self.attn.forward_qkv(dev, x, qkv, rope, cache, meta)?; // [n, heads·head_dim]
        let o_lora = proj_lora::<D>(&o_lora, meta);
        self.o_proj.forward_add_norm(dev, &attn, o_lora, residual, norm, gemm_only) // [n, hidden]
    }
}

pub struct LlamaDecoderLayer<D: Device> {
    input_layernorm: Norm<D>,
    self_attn: LlamaAttention<D>,
    post_attention_layernorm: Norm<D>,
    mlp: Mlp<D>,
    lora: Option<LayerLora<D>>,
}

fn load_norm<D: Device>(dev: &D, w: &ParamView, size: usize, a: &LlamaArch) -> Result<Norm<D>, ModelError> {
    Ok(match a.norm_offset {
        true => RMSNorm::load_offset(dev, w, size, a.rms_norm_eps)?,
        false => RMSNorm::load(dev, w, size, a.rms_norm_eps)?,
    }
    .into())
}

impl<D: Device> LlamaDecoderLayer<D> {
    fn load(
        dev: &D,
        w: &ParamView,
        cfg: &ModelConfig,
        a: &LlamaArch,
        i: usize,
        opts: &LoadOptions,
    ) -> Result<Self, ModelError> {
        let h = cfg.hidden_size;
        Ok(Self {
            input_layernorm: load_norm(dev, &w.pp("input_layernorm"), h, a)?,
            self_attn: LlamaAttention::load(dev, &w.pp("self_attn"), cfg, a, a.windows[i])?,
            post_attention_layernorm: load_norm(dev, &w.pp("post_attention_layernorm"), h, a)?,
            mlp: match &a.moe {
                Some(moe) if moe.sparse[i] => {
                    let view = w.pp(moe.names.block);
                    Mlp::Sparse(SparseMoeBlock::load(dev, &view, cfg.hidden_size, moe, a.act)?)
                }
                _ => Mlp::Dense(LlamaMlp::load(dev, &w.pp("mlp"), cfg, a)?),
            },
            lora: opts.lora.map(|cap| LayerLora::new(dev, cfg, cap)).transpose()?,
        })
    }
}

pub struct LlamaForCausalLM<D: Device> {
    cfg: ModelConfig,
    embed_tokens: VocabParallelEmbedding<D>,
    embed_scale: Option<f32>,
    layers: Vec<LlamaDecoderLayer<D>>,
    norm: Norm<D>,
    lm_head: ParallelLMHead<D>,
    rotary_emb: RotaryEmbedding,
    weight_bytes: usize,
    active_weight_bytes: usize,
}

impl<D: Device> LlamaForCausalLM<D> {
    /// Llama's own layers from its config.
    pub fn load(
        dev: &D,
        cfg: &ModelConfig,
        store: &WeightStore,
        opts: &LoadOptions,
    ) -> Result<Self, ModelError> {
        Self::load_arch(dev, cfg, store, opts, &arch(cfg)?)
    }

    /// The layers with a family's options `a`.
    pub fn load_arch(
        dev: &D,
        cfg: &ModelConfig,
        store: &WeightStore,
        opts: &LoadOptions,
        a: &LlamaArch,
    ) -> Result<Self, ModelError> {
        let root = store.root();
        let w = root.pp("model");
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let layers = (0..cfg.num_layers)
            .map(|i| LlamaDecoderLayer::load(dev, &w.pp("layers").pp(i), cfg, a, i, opts))
            .collect::<Result<Vec<_>, _>>()?;
        let tied = cfg.tie_word_embeddings || !root.contains("lm_head.weight");
        let attention = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
            + cfg.num_heads * cfg.head_dim * h
            + 2 * h;
        // (all, read for one token): the experts a token does not take are not read.
        let mlp = |i: usize| match &a.moe {
            Some(m) if m.sparse[i] => (m.block_params(h), m.block_params(h) - m.idle_params(h)),
            _ => (3 * h * a.intermediate_size, 3 * h * a.intermediate_size),
        };
        let embed = v * h * if tied { 1 } else { 2 } + h;
        let params = embed + (0..cfg.num_layers).map(|i| attention + mlp(i).0).sum::<usize>();
        let active = embed + (0..cfg.num_layers).map(|i| attention + mlp(i).1).sum::<usize>();
        Ok(Self {
            cfg: cfg.clone(),
            embed_tokens: VocabParallelEmbedding::load(dev, &w.pp("embed_tokens"), v, h)?,
            // transformers multiplies by √hidden rounded to the activations' type (f32 here).
            embed_scale: a.embed_scale.then(|| (h as f64).sqrt() as f32),
            layers,
            norm: load_norm(dev, &w.pp("norm"), h, a)?,
            lm_head: ParallelLMHead::load(dev, &root.pp("lm_head"), v, h, tied)?,
            rotary_emb: RotaryEmbedding::new(&a.rope, cfg.head_dim),
            // Evaluated last: every parameter above is loaded (this rank's parts).
            weight_bytes: store.served_bytes(),
            active_weight_bytes: store.served_share(active, params),
        })
    }
}

impl<D: Device> CausalLM<D> for LlamaForCausalLM<D> {
    fn forward(
        &self,
        dev: &D,
        input_ids: &[u32],
        kv_caches: &mut [D::Cache],
        meta: &AttnMetadata,
    ) -> DevResult<D::Tensor> {
        let mut residual = self.embed_tokens.forward(dev, input_ids)?; // [n, hidden]
        if let Some(s) = self.embed_scale {
            dev.scale(&mut residual, s)?;
        }
        let first = &self.layers[0];
        let qkv_plain = plain(first.lora.as_ref(), Proj::Qkv, meta) && first.self_attn.q_norm.is_none();
        let mut x = first.input_layernorm.forward_to_proj(dev, &residual, None, qkv_plain)?;
        // Each projection into the residual comes with the norm after it: the next layer's
        // input norm, and after the last layer the model's (hidden states, not only a GEMM's
        // input).
        for (i, (layer, cache)) in self.layers.iter().zip(kv_caches.iter_mut()).enumerate() {
            let lora = layer.lora.as_ref();
            // An expert block reads its input whole (router and experts), not as a GEMM's.
            let mlp_plain = plain(lora, Proj::Up, meta) && matches!(layer.mlp, Mlp::Dense(_));
            let post = (&mut residual, &layer.post_attention_layernorm, mlp_plain);
            let rope = &self.rotary_emb;
            let h = layer.self_attn.forward_add_norm(dev, &x, rope, cache, lora, meta, post)?;
            let (next_norm, gemm_only) = match self.layers.get(i + 1) {
                Some(next) => (
                    &next.input_layernorm,
                    plain(next.lora.as_ref(), Proj::Qkv, meta) && next.self_attn.q_norm.is_none(),
                ),
                None => (&self.norm, false),
            };
            x = layer.mlp.forward_add_norm(dev, &h, lora, meta, &mut residual, next_norm, gemm_only)?;
        }
        Ok(x)
    }

    fn compute_logits(&self, dev: &D, hidden: &D::Tensor, meta: &AttnMetadata) -> DevResult<D::Tensor> {
        let gathered = gather_last_rows(dev, hidden, meta)?;
        let last = gathered.as_ref().unwrap_or(hidden);
        self.lm_head.forward(dev, last, &self.embed_tokens, self.cfg.vocab_size) // [num_seqs, vocab]
    }

    fn cache_shape(&self, num_blocks: usize, block_size: usize) -> (usize, CacheShape) {
        self.layers[0].self_attn.attn.cache_shape(self.cfg.num_layers, num_blocks, block_size)
    }

    fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    fn active_weight_bytes(&self) -> usize {
        self.active_weight_bytes
    }

    fn has_lora(&self) -> bool {
        self.layers.first().is_some_and(|l| l.lora.is_some())
    }

    fn prefix_cacheable(&self) -> bool {
        !self.rotary_emb.spec.varies()
    }

    fn recompute_past(&self) -> Option<u32> {
        self.rotary_emb.spec.recompute_past()
    }

    fn set_lora_slot(&mut self, dev: &D, slot: usize, adapter: Option<&LoraAdapter>) -> DevResult<()> {
        set_slot_in_layers(dev, self.layers.iter_mut().map(|l| l.lora.as_mut()), slot, adapter)
    }
}
