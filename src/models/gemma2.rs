//! Gemma 2, after HF `transformers/models/gemma2/modeling_gemma2.py` and vLLM
//! `models/gemma2.py`: four `(1 + w)` RMSNorms a layer (the attention's and the MLP's
//! outputs are normed before they join the residual), attention scaled by
//! `query_pre_attn_scalar^-½` with soft-capped scores, sliding-window attention on
//! alternate layers, a gated GELU-tanh MLP, embeddings scaled by √hidden, and soft-capped
//! final logits. Gemma 3's text model (`gemma3.rs`) is these layers with q/k norms and a
//! second rotary embedding for its sliding layers ([`Gemma2Arch`]).

use std::sync::Arc;

use serde::Deserialize;

use super::config::{ModelConfig, Rope, RopeConfig, check_layer_types, parse_hf};
use super::gemma::{gemma_act, tied};
use super::layers::lora::{LayerLora, layer_modules, proj_lora, set_slot_in_layers};
use super::layers::{
    MergedColumnParallelLinear, Norm, PagedAttention, ParallelLMHead, QKVParallelLinear, RMSNorm,
    RotaryEmbedding, RowParallelLinear, VocabParallelEmbedding, gather_last_rows,
};
use super::llama::{STACKED_PARAMS, skip_tensor};
use super::loader::{ParamView, WeightStore};
use super::lora::{LoraAdapter, Proj, llama_targets};
use super::registry::ModelEntry;
use super::{CausalLM, LoadOptions, ModelError};
use crate::kernels::attn::AttnMetadata;
use crate::kernels::{Activation, AttnShape, CacheShape, DevResult, Device};

/// Gemma 2's own fields of config.json.
#[derive(Debug, Deserialize)]
pub struct Gemma2Config {
    pub intermediate_size: usize,
    pub rms_norm_eps: Option<f64>,
    pub query_pre_attn_scalar: Option<f64>,
    pub sliding_window: Option<usize>,
    pub layer_types: Option<Vec<String>>,
    pub final_logit_softcapping: Option<f64>,
    pub attn_logit_softcapping: Option<f64>,
    pub attention_bias: Option<bool>,
    #[serde(flatten)]
    pub rope: RopeConfig,
}

/// What varies between Gemma 2 and Gemma 3's text model.
#[derive(Debug, Clone)]
pub struct Gemma2Arch {
    pub intermediate_size: usize,
    pub rms_norm_eps: f32,
    pub act: Activation,
    pub qkv_bias: bool,
    pub scale: f32,
    /// Soft caps of the attention scores and of the final logits (0: none).
    pub attn_softcap: f32,
    pub final_softcap: f32,
    /// Per layer: its sliding window (0: full attention).
    pub windows: Vec<usize>,
    /// The rotary embeddings of full-attention and of sliding layers.
    pub rope_full: Rope,
    pub rope_local: Rope,
    /// RMSNorms over each head of q and k before RoPE (Gemma 3).
    pub qk_norm: bool,
}

impl Gemma2Config {
    /// Per layer, sliding or not: `layer_types`, else sliding unless `(i + 1) % every == 0`.
    pub fn windows(&self, arch: &str, layers: usize, every: usize) -> Result<Vec<usize>, ModelError> {
        check_layer_types(arch, self.layer_types.as_deref(), layers)?;
        let w = self.sliding_window.unwrap_or(0);
        Ok(match &self.layer_types {
            Some(types) => types.iter().map(|t| if t == "sliding_attention" { w } else { 0 }).collect(),
            None if every == 0 => {
                return Err(ModelError::Config(format!(
                    "config.json of {arch}: sliding_window_pattern is 0"
                )));
            }
            None => (0..layers).map(|i| if (i + 1) % every != 0 { w } else { 0 }).collect(),
        })
    }
    /// Gemma 2's options.
    pub fn arch(&self, cfg: &ModelConfig) -> Result<Gemma2Arch, ModelError> {
        let arch = cfg.architecture.as_str();
        let rope = self.rope.resolve(arch, cfg.head_dim, "full_attention", 10000.0)?;
        let bad = |field: &str, v: f64| {
            ModelError::Config(format!("config.json of {arch}: {field} {v} must be a positive number"))
        };
        let scalar = self.query_pre_attn_scalar.unwrap_or(256.0);
        if !(scalar.is_finite() && scalar > 0.0) {
            return Err(bad("query_pre_attn_scalar", scalar));
        }
        for (field, v) in [
            ("attn_logit_softcapping", self.attn_logit_softcapping),
            ("final_logit_softcapping", self.final_logit_softcapping),
        ] {
            // 0 (or none) turns soft-capping off.
            if let Some(v) = v.filter(|v| !(v.is_finite() && *v >= 0.0)) {
                return Err(bad(field, v));
            }
        }
        Ok(Gemma2Arch {
            intermediate_size: self.intermediate_size,
            rms_norm_eps: self.rms_norm_eps.unwrap_or(1e-6) as f32,
            act: gemma_act(&cfg.hf, arch)?,
            qkv_bias: self.attention_bias.unwrap_or(false),
            scale: scalar.powf(-0.5) as f32,
            attn_softcap: self.attn_logit_softcapping.unwrap_or(0.0) as f32,
            final_softcap: self.final_logit_softcapping.unwrap_or(0.0) as f32,
            windows: self.windows(arch, cfg.num_layers, 2)?,
            rope_local: rope.clone(),
            rope_full: rope,
            qk_norm: false,
        })
    }
}

/// Gemma 2's options.
pub fn arch(cfg: &ModelConfig) -> Result<Gemma2Arch, ModelError> {
    parse_hf::<Gemma2Config>(&cfg.hf, &cfg.architecture)?.arch(cfg)
}

/// The shared config of a Gemma 2-shaped family: tied, Llama's LoRA targets, its context
/// the one its rotary embeddings serve.
pub fn gemma2_config(cfg: ModelConfig, a: &Gemma2Arch) -> ModelConfig {
    let mut cfg = tied(cfg);
    cfg.lora_targets = llama_targets(&cfg, a.intermediate_size);
    if let Some(context) = [a.rope_full.context, a.rope_local.context].into_iter().flatten().min() {
        cfg.max_position_embeddings = context;
    }
    cfg
}

fn read(hf: &Arc<serde_json::Value>, name: &str) -> Result<ModelConfig, ModelError> {
    let cfg = ModelConfig::from_hf(hf, name)?;
    let a = arch(&cfg)?;
    Ok(gemma2_config(cfg, &a))
}

fn build<D: Device>(
    d: &D,
    c: &ModelConfig,
    w: &WeightStore,
    o: &LoadOptions,
) -> Result<Box<dyn CausalLM<D>>, ModelError> {
    Ok(Box::new(Gemma2ForCausalLM::load(d, c, w, o, &arch(c)?)?))
}

/// The registry's entry for `Gemma2ForCausalLM`.
pub fn entry<D: Device>() -> ModelEntry<D> {
    ModelEntry { config: read, construct: build::<D>, stacked_params: STACKED_PARAMS, skip: skip_tensor }
}

fn norm<D: Device>(dev: &D, w: &ParamView, size: usize, a: &Gemma2Arch) -> Result<Norm<D>, ModelError> {
    Ok(RMSNorm::load_offset(dev, w, size, a.rms_norm_eps)?.into())
}

pub struct Gemma2Mlp<D: Device> {
    gate_up_proj: MergedColumnParallelLinear<D>,
    down_proj: RowParallelLinear<D>,
    act: Activation,
}

impl<D: Device> Gemma2Mlp<D> {
    fn load(dev: &D, w: &ParamView, cfg: &ModelConfig, a: &Gemma2Arch) -> Result<Self, ModelError> {
        let (h, i) = (cfg.hidden_size, a.intermediate_size);
        Ok(Self {
            gate_up_proj: MergedColumnParallelLinear::load(dev, w, h, i)?,
            down_proj: RowParallelLinear::load(dev, &w.pp("down_proj"), i, h)?,
            act: a.act,
        })
    }
    fn forward(
        &self,
        dev: &D,
        x: &D::Tensor,
        lora: Option<&LayerLora<D>>,
        meta: &AttnMetadata,
    ) -> DevResult<D::Tensor> {
        let (up, down) = (layer_modules(lora, Proj::Up, meta), layer_modules(lora, Proj::Down, meta));
        let (up, down) = (proj_lora::<D>(&up, meta), proj_lora::<D>(&down, meta));
        let act = self.gate_up_proj.forward_act_mul(dev, x, up, self.act, down.is_none())?; // [n, intermediate]
        self.down_proj.forward(dev, &act, down) // [n, hidden]
    }
}

pub struct Gemma2Attention<D: Device> {
    qkv_proj: QKVParallelLinear<D>,
    q_norm: Option<RMSNorm<D>>,
    k_norm: Option<RMSNorm<D>>,
    o_proj: RowParallelLinear<D>,
    attn: PagedAttention,
}

impl<D: Device> Gemma2Attention<D> {
    fn load(
        dev: &D,
        w: &ParamView,
        cfg: &ModelConfig,
        a: &Gemma2Arch,
        window: usize,
    ) -> Result<Self, ModelError> {
        let heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let qkv_proj = QKVParallelLinear::load(dev, w, cfg.hidden_size, heads, a.qkv_bias)?;
        let head_norm = |name: &str| RMSNorm::load_offset(dev, &w.pp(name), cfg.head_dim, a.rms_norm_eps);
        let (q_norm, k_norm) = match a.qk_norm {
            true => (Some(head_norm("q_norm")?), Some(head_norm("k_norm")?)),
            false => (None, None),
        };
        let shape = AttnShape {
            scale: a.scale,
            window,
            softcap: a.attn_softcap,
            ..AttnShape::causal(qkv_proj.num_heads, qkv_proj.num_kv_heads, cfg.head_dim)
        };
        Ok(Self {
            attn: PagedAttention::new(shape),
            qkv_proj,
            q_norm,
            k_norm,
            o_proj: RowParallelLinear::load(
                dev,
                &w.pp("o_proj"),
                cfg.num_heads * cfg.head_dim,
                cfg.hidden_size,
            )?,
        })
    }
    fn forward(
        &self,
        dev: &D,
        x: &D::Tensor,
        rope: &RotaryEmbedding,
        cache: &mut D::Cache,
        lora: Option<&LayerLora<D>>,
        meta: &AttnMetadata,
    ) -> DevResult<D::Tensor> {
        let (qkv_lora, o_lora) = (layer_modules(lora, Proj::Qkv, meta), layer_modules(lora, Proj::Out, meta));
        let qk_norm = self.q_norm.as_ref().zip(self.k_norm.as_ref());
        let qkv = (&self.qkv_proj, proj_lora::<D>(&qkv_lora, meta), qk_norm);
        let attn = self.attn.forward_qkv(dev, x, qkv, rope, cache, meta)?; // [n, heads·d]
        self.o_proj.forward(dev, &attn, proj_lora::<D>(&o_lora, meta)) // [n, hidden]
    }
}

pub struct Gemma2DecoderLayer<D: Device> {
    input_layernorm: Norm<D>,
    self_attn: Gemma2Attention<D>,
    post_attention_layernorm: Norm<D>,
    pre_feedforward_layernorm: Norm<D>,
    mlp: Gemma2Mlp<D>,
    post_feedforward_layernorm: Norm<D>,
    /// Reads the sliding layers' rotary embedding.
    sliding: bool,
    lora: Option<LayerLora<D>>,
}

impl<D: Device> Gemma2DecoderLayer<D> {
    fn load(
        dev: &D,
        w: &ParamView,
        cfg: &ModelConfig,
        a: &Gemma2Arch,
        i: usize,
        opts: &LoadOptions,
    ) -> Result<Self, ModelError> {
        let h = cfg.hidden_size;
        Ok(Self {
            input_layernorm: norm(dev, &w.pp("input_layernorm"), h, a)?,
            self_attn: Gemma2Attention::load(dev, &w.pp("self_attn"), cfg, a, a.windows[i])?,
            post_attention_layernorm: norm(dev, &w.pp("post_attention_layernorm"), h, a)?,
            pre_feedforward_layernorm: norm(dev, &w.pp("pre_feedforward_layernorm"), h, a)?,
            mlp: Gemma2Mlp::load(dev, &w.pp("mlp"), cfg, a)?,
            post_feedforward_layernorm: norm(dev, &w.pp("post_feedforward_layernorm"), h, a)?,
            sliding: a.windows[i] > 0,
            lora: opts.lora.map(|cap| LayerLora::new(dev, cfg, cap)).transpose()?,
        })
    }
}

pub struct Gemma2ForCausalLM<D: Device> {
    cfg: ModelConfig,
    embed_tokens: VocabParallelEmbedding<D>,
    embed_scale: f32,
    layers: Vec<Gemma2DecoderLayer<D>>,
    norm: Norm<D>,
    lm_head: ParallelLMHead<D>,
    rope_full: RotaryEmbedding,
    rope_local: RotaryEmbedding,
    final_softcap: f32,
    weight_bytes: usize,
}

impl<D: Device> Gemma2ForCausalLM<D> {
    pub fn load(
        dev: &D,
        cfg: &ModelConfig,
        store: &WeightStore,
        opts: &LoadOptions,
        a: &Gemma2Arch,
    ) -> Result<Self, ModelError> {
        let root = store.root();
        let w = root.pp("model");
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let layers = (0..cfg.num_layers)
            .map(|i| Gemma2DecoderLayer::load(dev, &w.pp("layers").pp(i), cfg, a, i, opts))
            .collect::<Result<Vec<_>, _>>()?;
        let tied = cfg.tie_word_embeddings || !root.contains("lm_head.weight");
        Ok(Self {
            cfg: cfg.clone(),
            embed_tokens: VocabParallelEmbedding::load(dev, &w.pp("embed_tokens"), v, h)?,
            embed_scale: (h as f64).sqrt() as f32,
            layers,
            norm: norm(dev, &w.pp("norm"), h, a)?,
            lm_head: ParallelLMHead::load(dev, &root.pp("lm_head"), v, h, tied)?,
            rope_full: RotaryEmbedding::new(&a.rope_full, cfg.head_dim),
            rope_local: RotaryEmbedding::new(&a.rope_local, cfg.head_dim),
            final_softcap: a.final_softcap,
            // Evaluated last: every parameter above is loaded.
            weight_bytes: store.served_bytes(),
        })
    }
}

impl<D: Device> CausalLM<D> for Gemma2ForCausalLM<D> {
    fn forward(
        &self,
        dev: &D,
        input_ids: &[u32],
        kv_caches: &mut [D::Cache],
        meta: &AttnMetadata,
    ) -> DevResult<D::Tensor> {
        let mut residual = self.embed_tokens.forward(dev, input_ids)?; // [n, hidden]
        dev.scale(&mut residual, self.embed_scale)?;
        let mut x = self.layers[0].input_layernorm.forward(dev, &residual)?;
        for (i, (layer, cache)) in self.layers.iter().zip(kv_caches.iter_mut()).enumerate() {
            let lora = layer.lora.as_ref();
            let rope = if layer.sliding { &self.rope_local } else { &self.rope_full };
            let attn = layer.self_attn.forward(dev, &x, rope, cache, lora, meta)?;
            let (post, pre) = (&layer.post_attention_layernorm, &layer.pre_feedforward_layernorm);
            let h = pre.forward_normed_residual(dev, &attn, post, &mut residual)?;
            let mlp = layer.mlp.forward(dev, &h, lora, meta)?;
            let next = self.layers.get(i + 1).map_or(&self.norm, |l| &l.input_layernorm);
            x = next.forward_normed_residual(dev, &mlp, &layer.post_feedforward_layernorm, &mut residual)?;
        }
        Ok(x)
    }

    fn compute_logits(&self, dev: &D, hidden: &D::Tensor, meta: &AttnMetadata) -> DevResult<D::Tensor> {
        let gathered = gather_last_rows(dev, hidden, meta)?;
        let last = gathered.as_ref().unwrap_or(hidden);
        let mut logits = self.lm_head.forward(dev, last, &self.embed_tokens, self.cfg.vocab_size)?;
        if self.final_softcap > 0.0 {
            dev.softcap(&mut logits, self.final_softcap)?;
        }
        Ok(logits) // [num_seqs, vocab]
    }

    fn cache_shape(&self, num_blocks: usize, block_size: usize) -> (usize, CacheShape) {
        self.layers[0].self_attn.attn.cache_shape(self.cfg.num_layers, num_blocks, block_size)
    }

    fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    fn has_lora(&self) -> bool {
        self.layers.first().is_some_and(|l| l.lora.is_some())
    }

    fn prefix_cacheable(&self) -> bool {
        [&self.rope_full, &self.rope_local].iter().all(|r| !r.spec.varies())
    }

    fn recompute_past(&self) -> Option<u32> {
        [&self.rope_full, &self.rope_local].into_iter().filter_map(|r| r.spec.recompute_past()).min()
    }

    fn set_lora_slot(&mut self, dev: &D, slot: usize, adapter: Option<&LoraAdapter>) -> DevResult<()> {
        set_slot_in_layers(dev, self.layers.iter_mut().map(|l| l.lora.as_mut()), slot, adapter)
    }
}
