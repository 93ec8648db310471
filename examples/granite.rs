//! An architecture registered out of tree: IBM's Granite (`GraniteForCausalLM`, after HF
//! `transformers/models/granite/modeling_granite.py`), written against actorllm's public
//! layers and served through its public entry point, as a crate of your own would. Granite
//! is Llama with four scalars: embeddings multiplied by `embedding_multiplier`, attention
//! scaled by `attention_multiplier` instead of 1/√head_dim, each block's output multiplied
//! by `residual_multiplier` before it joins the residual, logits divided by
//! `logits_scaling`. (Adapters are not wired here; see `src/models/llama.rs` for how a
//! model applies them.)
//!
//!     cargo run --release --example granite -- --model DIR [serve flags…]
//!
//! Its test checks it against transformers (tests/fixtures/out-of-tree/granite.json, made
//! by scripts/make_model_goldens.py): `cargo test --release --example granite`.

use std::sync::Arc;

use actorllm::kernels::attn::AttnMetadata;
use actorllm::kernels::{AttnShape, CacheShape, DevResult, Device};
use actorllm::models::config::{ModelConfig, RopeConfig, parse_hf};
use actorllm::models::layers::{
    MergedColumnParallelLinear, PagedAttention, ParallelLMHead, QKVParallelLinear, RMSNorm, RotaryEmbedding,
    RowParallelLinear, VocabParallelEmbedding, gather_last_rows,
};
use actorllm::models::llama::{STACKED_PARAMS, skip_tensor};
use actorllm::models::loader::{ParamView, WeightStore};
use actorllm::models::lora::{LoraAdapter, llama_targets};
use actorllm::models::registry::{ModelEntry, ModelRegistry};
use actorllm::models::{CausalLM, LoadOptions, ModelError};
use actorllm::{Architectures, kernels::Activation};
use serde::Deserialize;

/// Granite's fields of config.json.
#[derive(Debug, Deserialize)]
struct GraniteConfig {
    intermediate_size: usize,
    rms_norm_eps: Option<f64>,
    embedding_multiplier: f32,
    attention_multiplier: f32,
    residual_multiplier: f32,
    logits_scaling: f32,
    #[serde(flatten)]
    rope: RopeConfig,
}

fn read(hf: &Arc<serde_json::Value>, name: &str) -> Result<ModelConfig, ModelError> {
    let mut cfg = ModelConfig::from_hf(hf, name)?;
    let c: GraniteConfig = parse_hf(hf, name)?;
    cfg.lora_targets = llama_targets(&cfg, c.intermediate_size);
    Ok(cfg)
}

struct Layer<D: Device> {
    input_layernorm: RMSNorm<D>,
    qkv_proj: QKVParallelLinear<D>,
    o_proj: RowParallelLinear<D>,
    attn: PagedAttention,
    post_attention_layernorm: RMSNorm<D>,
    gate_up_proj: MergedColumnParallelLinear<D>,
    down_proj: RowParallelLinear<D>,
}

impl<D: Device> Layer<D> {
    fn load(dev: &D, w: &ParamView, cfg: &ModelConfig, c: &GraniteConfig) -> Result<Self, ModelError> {
        let (h, i, eps) = (cfg.hidden_size, c.intermediate_size, c.rms_norm_eps.unwrap_or(1e-6) as f32);
        let attn_w = w.pp("self_attn");
        let qkv_proj =
            QKVParallelLinear::load(dev, &attn_w, h, (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim), false)?;
        let shape = AttnShape {
            scale: c.attention_multiplier,
            ..AttnShape::causal(qkv_proj.num_heads, qkv_proj.num_kv_heads, cfg.head_dim)
        };
        Ok(Self {
            input_layernorm: RMSNorm::load(dev, &w.pp("input_layernorm"), h, eps)?,
            attn: PagedAttention::new(shape),
            qkv_proj,
            o_proj: RowParallelLinear::load(dev, &attn_w.pp("o_proj"), cfg.num_heads * cfg.head_dim, h)?,
            post_attention_layernorm: RMSNorm::load(dev, &w.pp("post_attention_layernorm"), h, eps)?,
            gate_up_proj: MergedColumnParallelLinear::load(dev, &w.pp("mlp"), h, i)?,
            down_proj: RowParallelLinear::load(dev, &w.pp("mlp").pp("down_proj"), i, h)?,
        })
    }
}

struct GraniteForCausalLM<D: Device> {
    cfg: ModelConfig,
    c: GraniteConfig,
    embed_tokens: VocabParallelEmbedding<D>,
    layers: Vec<Layer<D>>,
    norm: RMSNorm<D>,
    lm_head: ParallelLMHead<D>,
    rotary_emb: RotaryEmbedding,
}

impl<D: Device> GraniteForCausalLM<D> {
    fn load(dev: &D, cfg: &ModelConfig, store: &WeightStore, _: &LoadOptions) -> Result<Self, ModelError> {
        let c: GraniteConfig = parse_hf(&cfg.hf, &cfg.architecture)?;
        let (root, (v, h)) = (store.root(), (cfg.vocab_size, cfg.hidden_size));
        let w = root.pp("model");
        let layers = (0..cfg.num_layers)
            .map(|i| Layer::load(dev, &w.pp("layers").pp(i), cfg, &c))
            .collect::<Result<Vec<_>, _>>()?;
        let tied = cfg.tie_word_embeddings || !root.contains("lm_head.weight");
        let rope = c.rope.resolve(&cfg.architecture, cfg.head_dim, "full_attention", 10000.0)?;
        Ok(Self {
            embed_tokens: VocabParallelEmbedding::load(dev, &w.pp("embed_tokens"), v, h)?,
            layers,
            norm: RMSNorm::load(dev, &w.pp("norm"), h, c.rms_norm_eps.unwrap_or(1e-6) as f32)?,
            lm_head: ParallelLMHead::load(dev, &root.pp("lm_head"), v, h, tied)?,
            rotary_emb: RotaryEmbedding::new(&rope, cfg.head_dim),
            cfg: cfg.clone(),
            c,
        })
    }
}

impl<D: Device> CausalLM<D> for GraniteForCausalLM<D> {
    fn forward(
        &self,
        dev: &D,
        input_ids: &[u32],
        kv_caches: &mut [D::Cache],
        meta: &AttnMetadata,
    ) -> DevResult<D::Tensor> {
        let mut residual = self.embed_tokens.forward(dev, input_ids)?; // [n, hidden]
        dev.scale(&mut residual, self.c.embedding_multiplier)?;
        for (layer, cache) in self.layers.iter().zip(kv_caches.iter_mut()) {
            let x = layer.input_layernorm.forward(dev, &residual)?;
            let qkv = layer.qkv_proj.forward(dev, &x, None)?; // [n, (heads + 2·kv_heads)·head_dim]
            let attn = layer.attn.forward(dev, &qkv, &self.rotary_emb, cache, meta)?;
            let mut out = layer.o_proj.forward(dev, &attn, None)?; // [n, hidden]
            dev.scale(&mut out, self.c.residual_multiplier)?;
            let x = layer.post_attention_layernorm.forward_residual(dev, &out, &mut residual)?;
            let act = layer.gate_up_proj.forward_act_mul(dev, &x, None, Activation::Silu, false)?;
            let mut out = layer.down_proj.forward(dev, &act, None)?;
            dev.scale(&mut out, self.c.residual_multiplier)?;
            dev.add_inplace(&mut residual, &out)?;
        }
        self.norm.forward(dev, &residual)
    }

    fn compute_logits(&self, dev: &D, hidden: &D::Tensor, meta: &AttnMetadata) -> DevResult<D::Tensor> {
        let gathered = gather_last_rows(dev, hidden, meta)?;
        let mut logits = self.lm_head.forward(
            dev,
            gathered.as_ref().unwrap_or(hidden),
            &self.embed_tokens,
            self.cfg.vocab_size,
        )?;
        dev.scale(&mut logits, 1.0 / self.c.logits_scaling)?;
        Ok(logits)
    }

    fn cache_shape(&self, num_blocks: usize, block_size: usize) -> (usize, CacheShape) {
        let num_kv_heads = self.layers[0].attn.shape.num_kv_heads;
        (
            self.cfg.num_layers,
            CacheShape { num_blocks, block_size, num_kv_heads, head_dim: self.cfg.head_dim },
        )
    }

    fn weight_bytes(&self) -> usize {
        0
    }

    /// Built without adapter capacity (`has_lora` is false), so the engine assigns none.
    fn set_lora_slot(&mut self, _: &D, _: usize, _: Option<&LoraAdapter>) -> DevResult<()> {
        Ok(())
    }

    fn has_lora(&self) -> bool {
        false
    }
}

fn build<D: Device>(
    d: &D,
    c: &ModelConfig,
    w: &WeightStore,
    o: &LoadOptions,
) -> Result<Box<dyn CausalLM<D>>, ModelError> {
    Ok(Box::new(GraniteForCausalLM::load(d, c, w, o)?))
}

/// What this crate adds to the engine.
struct Granite;

impl Architectures for Granite {
    fn register<D: Device>(registry: &mut ModelRegistry<D>) {
        registry.register_model(
            "GraniteForCausalLM",
            ModelEntry {
                config: read,
                construct: build::<D>,
                stacked_params: STACKED_PARAMS,
                skip: skip_tensor,
            },
        );
    }
}

#[derive(clap::Parser)]
struct Cli {
    #[command(flatten)]
    serve: actorllm::web::ServeArgs,
}

fn main() -> anyhow::Result<()> {
    use clap::Parser;
    tracing_subscriber::fmt().with_env_filter("actorllm=info,warn").init();
    let args = Cli::parse().serve;
    actix::System::new().block_on(async move {
        actorllm::web::serve_with_architectures::<Granite>(args).await?;
        anyhow::Ok(())
    })
}

#[cfg(test)]
mod tests {
    use actorllm::request::TokenEvent;
    use actorllm::{Engine, SamplingParams};
    use futures::StreamExt;

    /// The tiny Granite of tests/fixtures/out-of-tree/granite.json gives transformers'
    /// greedy tokens, through the engine with this crate's architecture registered.
    #[actix_rt::test]
    async fn granite_matches_transformers() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/out-of-tree/granite.json");
        let g: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let dir = actorllm::scratch::ScratchDir::new("granite").unwrap();
        actorllm::models::random::write_golden_model(&g, &dir).unwrap();
        let args = actorllm::config::EngineArgs {
            model: dir.to_path_buf(),
            device: actorllm::config::DeviceArg::Cpu,
            ..Default::default()
        };
        // Without the registration the architecture is unknown.
        let e = Engine::start(args.clone()).await.err().expect("refused").to_string();
        assert!(e.contains("GraniteForCausalLM"), "{e}");
        let engine = Engine::start_with_architectures::<super::Granite>(args).await.unwrap();
        for run in g["runs"].as_array().unwrap() {
            let ids = |v: &serde_json::Value| {
                v.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect::<Vec<_>>()
            };
            let params = SamplingParams {
                temperature: 0.0,
                max_tokens: Some(24),
                ignore_eos: true,
                ..Default::default()
            };
            let mut s = engine
                .add_request(engine.next_request_id("g"), ids(&run["prompt_ids"]), params)
                .await
                .unwrap();
            let mut got = Vec::new();
            while let Some(ev) = s.next().await {
                match ev {
                    TokenEvent::Token { token_id, .. } => got.push(token_id),
                    TokenEvent::Error { message } => panic!("{message}"),
                    TokenEvent::Done { .. } => break,
                    TokenEvent::Finished { .. } | TokenEvent::PromptLogprobs { .. } => {}
                }
            }
            assert_eq!(got, ids(&run["output_ids"]));
        }
    }
}
