//! OPT, after HF `transformers/models/opt/modeling_opt.py` and vLLM `models/opt.py` (the
//! first seed's worked example): LayerNorms with bias, attention without rotary embedding
//! over learned absolute positions (offset 2), q/k/v/out projections with bias, a plain
//! ReLU MLP (`fc1`, `fc2`), norms before (`do_layer_norm_before`, every size but 350m) or
//! after each block, and word embeddings of `word_embed_proj_dim` projected in and out of
//! the hidden size when they differ. The LM head is the embedding table, tied.

use std::sync::Arc;

use serde::Deserialize;

use super::config::{ModelConfig, parse_hf, unsupported};
use super::layers::lora::{LayerLora, layer_modules, proj_lora, set_slot_in_layers};
use super::layers::{
    ColumnParallelLinear, LayerNorm, LearnedPositions, Norm, PagedAttention, ParallelLMHead,
    QKVParallelLinear, RotaryEmbedding, RowParallelLinear, VocabParallelEmbedding, gather_last_rows,
};
use super::loader::{ParamView, StackedParam, WeightStore};
use super::lora::{LoraAdapter, LoraTarget, Proj, Shard};
use super::registry::ModelEntry;
use super::{CausalLM, LoadOptions, ModelError};
use crate::kernels::attn::AttnMetadata;
use crate::kernels::{Activation, AttnShape, CacheShape, DevResult, Device};

/// q, k and v are stacked into one projection at load.
pub const STACKED_PARAMS: &[StackedParam] = &[
    StackedParam { param: "qkv_proj", shard: "q_proj", index: 0 },
    StackedParam { param: "qkv_proj", shard: "k_proj", index: 1 },
    StackedParam { param: "qkv_proj", shard: "v_proj", index: 2 },
];

/// The LM head is always the embedding table.
fn skip_tensor(name: &str, _: &ModelConfig) -> bool {
    name.starts_with("lm_head.")
}

/// OPT's fields of config.json.
#[derive(Debug, Deserialize)]
pub struct OptConfig {
    pub ffn_dim: usize,
    pub word_embed_proj_dim: Option<usize>,
    pub do_layer_norm_before: Option<bool>,
    pub activation_function: Option<String>,
    pub enable_bias: Option<bool>,
    pub layer_norm_elementwise_affine: Option<bool>,
    #[serde(rename = "_remove_final_layer_norm")]
    pub remove_final_layer_norm: Option<bool>,
}

/// OPT's resolved options.
#[derive(Debug, Clone)]
struct OptArch {
    ffn_dim: usize,
    embed_dim: usize,
    pre_norm: bool,
    act: Activation,
    bias: bool,
    final_norm: bool,
}

fn arch(cfg: &ModelConfig) -> Result<OptArch, ModelError> {
    let name = cfg.architecture.as_str();
    let c: OptConfig = parse_hf(&cfg.hf, name)?;
    let act_name = c.activation_function.as_deref().unwrap_or("relu");
    let act = Activation::from_hf(act_name)
        .ok_or_else(|| unsupported(name, "activation_function", act_name, Activation::HF_NAMES))?;
    if c.layer_norm_elementwise_affine == Some(false) {
        return Err(unsupported(name, "layer_norm_elementwise_affine", false, "true"));
    }
    let pre_norm = c.do_layer_norm_before.unwrap_or(true);
    Ok(OptArch {
        ffn_dim: c.ffn_dim,
        embed_dim: c.word_embed_proj_dim.unwrap_or(cfg.hidden_size),
        pre_norm,
        act,
        bias: c.enable_bias.unwrap_or(true),
        final_norm: pre_norm && !c.remove_final_layer_norm.unwrap_or(false),
    })
}

fn targets(cfg: &ModelConfig, a: &OptArch) -> Vec<LoraTarget> {
    let h = cfg.hidden_size;
    use {LoraTarget as T, Proj::*, Shard::*};
    vec![
        T::column("q_proj", "self_attn.q_proj", Qkv, (h, h), QHeads),
        T::column("k_proj", "self_attn.k_proj", Qkv, (h, h), KvHeads),
        T::column("v_proj", "self_attn.v_proj", Qkv, (h, h), KvHeads),
        T::row("out_proj", "self_attn.out_proj", Out, (h, h), QHeads),
        T::column("fc1", "fc1", Up, (h, a.ffn_dim), Even),
        T::row("fc2", "fc2", Down, (a.ffn_dim, h), Even),
    ]
}

fn read(hf: &Arc<serde_json::Value>, name: &str) -> Result<ModelConfig, ModelError> {
    let mut cfg = ModelConfig::from_hf(hf, name)?;
    let a = arch(&cfg)?;
    cfg.tie_word_embeddings = true;
    cfg.lora_targets = targets(&cfg, &a);
    Ok(cfg)
}

fn build<D: Device>(
    d: &D,
    c: &ModelConfig,
    w: &WeightStore,
    o: &LoadOptions,
) -> Result<Box<dyn CausalLM<D>>, ModelError> {
    Ok(Box::new(OptForCausalLM::load(d, c, w, o)?))
}

/// The registry's entry for `OPTForCausalLM`.
pub fn entry<D: Device>() -> ModelEntry<D> {
    ModelEntry { config: read, construct: build::<D>, stacked_params: STACKED_PARAMS, skip: skip_tensor }
}

pub struct OptAttention<D: Device> {
    qkv_proj: QKVParallelLinear<D>,
    out_proj: RowParallelLinear<D>,
    attn: PagedAttention,
}

impl<D: Device> OptAttention<D> {
    fn load(dev: &D, w: &ParamView, cfg: &ModelConfig, a: &OptArch) -> Result<Self, ModelError> {
        let h = cfg.hidden_size;
        let qkv_proj =
            QKVParallelLinear::load(dev, w, h, (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim), a.bias)?;
        let shape = AttnShape::causal(qkv_proj.num_heads, qkv_proj.num_kv_heads, cfg.head_dim);
        Ok(Self {
            attn: PagedAttention::new(shape),
            qkv_proj,
            out_proj: RowParallelLinear::load_with_bias(dev, &w.pp("out_proj"), (h, h), a.bias)?,
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
        let qkv = self.qkv_proj.forward(dev, x, proj_lora::<D>(&qkv_lora, meta))?; // [n, 3·hidden]
        let attn = self.attn.forward(dev, &qkv, rope, cache, meta)?; // [n, hidden]
        self.out_proj.forward(dev, &attn, proj_lora::<D>(&o_lora, meta))
    }
}

pub struct OptDecoderLayer<D: Device> {
    self_attn_layer_norm: Norm<D>,
    self_attn: OptAttention<D>,
    final_layer_norm: Norm<D>,
    fc1: ColumnParallelLinear<D>,
    fc2: RowParallelLinear<D>,
    lora: Option<LayerLora<D>>,
}

impl<D: Device> OptDecoderLayer<D> {
    fn load(
        dev: &D,
        w: &ParamView,
        cfg: &ModelConfig,
        a: &OptArch,
        opts: &LoadOptions,
    ) -> Result<Self, ModelError> {
        let h = cfg.hidden_size;
        let ln = |name: &str| LayerNorm::load(dev, &w.pp(name), h, 1e-5, true).map(Norm::from);
        Ok(Self {
            self_attn_layer_norm: ln("self_attn_layer_norm")?,
            self_attn: OptAttention::load(dev, &w.pp("self_attn"), cfg, a)?,
            final_layer_norm: ln("final_layer_norm")?,
            fc1: ColumnParallelLinear::load(dev, &w.pp("fc1"), (h, a.ffn_dim), a.bias, false)?,
            fc2: RowParallelLinear::load_with_bias(dev, &w.pp("fc2"), (a.ffn_dim, h), a.bias)?,
            lora: opts.lora.map(|cap| LayerLora::new(dev, cfg, cap)).transpose()?,
        })
    }
    /// `fc2(act(fc1(x)))`.
    fn mlp(&self, dev: &D, x: &D::Tensor, act: Activation, meta: &AttnMetadata) -> DevResult<D::Tensor> {
        let lora = self.lora.as_ref();
        let (up, down) = (layer_modules(lora, Proj::Up, meta), layer_modules(lora, Proj::Down, meta));
        let mut h = dev.project(x, &self.fc1.weight, self.fc1.bias.as_ref(), proj_lora::<D>(&up, meta))?; // [n, ffn]
        dev.activation(&mut h, act)?;
        self.fc2.forward(dev, &h, proj_lora::<D>(&down, meta)) // [n, hidden]
    }
}

pub struct OptForCausalLM<D: Device> {
    cfg: ModelConfig,
    arch: OptArch,
    embed_tokens: VocabParallelEmbedding<D>,
    embed_positions: LearnedPositions<D>,
    project_in: Option<ColumnParallelLinear<D>>,
    project_out: Option<ColumnParallelLinear<D>>,
    layers: Vec<OptDecoderLayer<D>>,
    final_layer_norm: Option<Norm<D>>,
    lm_head: ParallelLMHead<D>,
    rope: RotaryEmbedding,
    weight_bytes: usize,
}

impl<D: Device> OptForCausalLM<D> {
    pub fn load(
        dev: &D,
        cfg: &ModelConfig,
        store: &WeightStore,
        opts: &LoadOptions,
    ) -> Result<Self, ModelError> {
        let a = arch(cfg)?;
        let root = store.root();
        // Checkpoints name the decoder `model.decoder` or (older ones) `decoder`.
        let w = match root.contains("model.decoder.embed_tokens.weight") {
            true => root.pp("model").pp("decoder"),
            false => root.pp("decoder"),
        };
        let (v, h, e) = (cfg.vocab_size, cfg.hidden_size, a.embed_dim);
        // Projections between the embedding width and the hidden size, replicated.
        let projection = |name: &str, (i, o): (usize, usize)| match e == h {
            true => Ok(None),
            false => ColumnParallelLinear::load(dev, &w.pp(name), (i, o), false, true).map(Some),
        };
        let layers = (0..cfg.num_layers)
            .map(|i| OptDecoderLayer::load(dev, &w.pp("layers").pp(i), cfg, &a, opts))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            embed_tokens: VocabParallelEmbedding::load(dev, &w.pp("embed_tokens"), v, e)?,
            embed_positions: LearnedPositions::load(
                dev,
                &w.pp("embed_positions"),
                cfg.max_position_embeddings + 2,
                h,
                2,
            )?,
            project_in: projection("project_in", (e, h))?,
            project_out: projection("project_out", (h, e))?,
            layers,
            final_layer_norm: match a.final_norm {
                true => Some(LayerNorm::load(dev, &w.pp("final_layer_norm"), h, 1e-5, true)?.into()),
                false => None,
            },
            lm_head: ParallelLMHead::load(dev, &root.pp("lm_head"), v, e, true)?,
            rope: RotaryEmbedding::none(cfg.head_dim),
            // Evaluated last: every parameter above is loaded.
            weight_bytes: store.served_bytes(),
            cfg: cfg.clone(),
            arch: a,
        })
    }
}

impl<D: Device> CausalLM<D> for OptForCausalLM<D> {
    fn forward(
        &self,
        dev: &D,
        input_ids: &[u32],
        kv_caches: &mut [D::Cache],
        meta: &AttnMetadata,
    ) -> DevResult<D::Tensor> {
        let mut embeds = self.embed_tokens.forward(dev, input_ids)?; // [n, word_embed_proj_dim]
        if let Some(p) = &self.project_in {
            embeds = p.forward(dev, &embeds)?; // [n, hidden]
        }
        let mut residual = self.embed_positions.forward(dev, &meta.positions)?;
        dev.add_inplace(&mut residual, &embeds)?;
        let act = self.arch.act;
        for (layer, cache) in self.layers.iter().zip(kv_caches.iter_mut()) {
            let lora = layer.lora.as_ref();
            let rope = &self.rope;
            residual = match self.arch.pre_norm {
                true => {
                    let x = layer.self_attn_layer_norm.forward(dev, &residual)?;
                    let attn = layer.self_attn.forward(dev, &x, rope, cache, lora, meta)?;
                    let x = layer.final_layer_norm.forward_residual(dev, &attn, &mut residual)?;
                    let mlp = layer.mlp(dev, &x, act, meta)?;
                    dev.add_inplace(&mut residual, &mlp)?;
                    residual
                }
                false => {
                    let attn = layer.self_attn.forward(dev, &residual, rope, cache, lora, meta)?;
                    let x = layer.self_attn_layer_norm.forward_residual(dev, &attn, &mut residual)?;
                    let mut mlp = layer.mlp(dev, &x, act, meta)?;
                    dev.add_inplace(&mut mlp, &x)?;
                    layer.final_layer_norm.forward(dev, &mlp)?
                }
            };
        }
        let mut out = match &self.final_layer_norm {
            Some(n) => n.forward(dev, &residual)?,
            None => residual,
        };
        if let Some(p) = &self.project_out {
            out = p.forward(dev, &out)?; // [n, word_embed_proj_dim]
        }
        Ok(out)
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

    fn has_lora(&self) -> bool {
        self.layers.first().is_some_and(|l| l.lora.is_some())
    }

    fn set_lora_slot(&mut self, dev: &D, slot: usize, adapter: Option<&LoraAdapter>) -> DevResult<()> {
        set_slot_in_layers(dev, self.layers.iter_mut().map(|l| l.lora.as_mut()), slot, adapter)
    }
}
