//! Gemma 3's text model, after HF `transformers/models/gemma3/modeling_gemma3.py`
//! (`Gemma3ForCausalLM`): Gemma 2's layers (`gemma2.rs`) with `(1 + w)` RMSNorms over each
//! head of q and k, five sliding layers to one global (`sliding_window_pattern`), and two
//! rotary embeddings: the global layers' (`rope_theta`, with `rope_scaling`) and the
//! sliding layers' (`rope_local_base_freq`), or per kind in newer files' `rope_parameters`.
//! No soft caps unless the config sets them.

use std::sync::Arc;

use serde::Deserialize;

use super::config::{ModelConfig, Rope, RopeScaling, parse_hf};
use super::gemma2::{Gemma2Arch, Gemma2Config, Gemma2ForCausalLM, gemma2_config};
use super::llama::{STACKED_PARAMS, skip_tensor};
use super::loader::WeightStore;
use super::registry::ModelEntry;
use super::{CausalLM, LoadOptions, ModelError};
use crate::kernels::Device;

/// Gemma 3's own fields beyond Gemma 2's.
#[derive(Debug, Deserialize)]
struct Gemma3Extra {
    sliding_window_pattern: Option<usize>,
    rope_local_base_freq: Option<f64>,
}

/// Gemma 3's options of Gemma 2's layers.
pub fn arch(cfg: &ModelConfig) -> Result<Gemma2Arch, ModelError> {
    let name = cfg.architecture.as_str();
    let c: Gemma2Config = parse_hf(&cfg.hf, name)?;
    let extra: Gemma3Extra = parse_hf(&cfg.hf, name)?;
    let per_kind = c.rope.rope_parameters.as_ref().is_some_and(|p| p.get("sliding_attention").is_some());
    let rope_full = c.rope.resolve(name, cfg.head_dim, "full_attention", 1_000_000.0)?;
    let rope_local = match per_kind {
        true => c.rope.resolve(name, cfg.head_dim, "sliding_attention", 10_000.0)?,
        false => Rope {
            theta: match extra.rope_local_base_freq.unwrap_or(10_000.0) {
                t if t.is_finite() && t > 0.0 => t,
                t => {
                    return Err(ModelError::Config(format!(
                        "config.json of {name}: rope_local_base_freq {t} must be a positive number"
                    )));
                }
            },
            rotary_dim: cfg.head_dim,
            scaling: RopeScaling::None,
            context: None,
        },
    };
    let mut a = c.arch(cfg)?;
    a.windows = c.windows(name, cfg.num_layers, extra.sliding_window_pattern.unwrap_or(6))?;
    a.rope_full = rope_full;
    a.rope_local = rope_local;
    a.qk_norm = true;
    Ok(a)
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

/// The registry's entry for `Gemma3ForCausalLM`.
pub fn entry<D: Device>() -> ModelEntry<D> {
    ModelEntry { config: read, construct: build::<D>, stacked_params: STACKED_PARAMS, skip: skip_tensor }
}
