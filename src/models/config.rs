//! The configuration every architecture shares, resolved once into [`ModelConfig`]: what the
//! engine sizes its cache and checks requests by. Each model file parses the rest of
//! `config.json` itself (its own serde struct, read with [`parse_hf`]) and declares its LoRA
//! targets; the rotary embedding's fields, which most (not all) families have, are parsed
//! by [`RopeConfig`].

use std::sync::Arc;

use serde::Deserialize;
use serde::de::DeserializeOwned;

use super::ModelError;
use super::lora::LoraTarget;
use crate::kernels::{RopeByLen, RopeSpec};

/// `eos_token_id` is an int in some files and a list in others.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(i) => vec![*i],
            TokenIds::Many(v) => v.clone(),
        }
    }
}

/// The fields of config.json every decoder-only family shares (under these names).
#[derive(Debug, Clone, Deserialize)]
pub struct HfCommon {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub max_position_embeddings: Option<usize>,
    pub vocab_size: usize,
    pub tie_word_embeddings: Option<bool>,
    pub torch_dtype: Option<String>,
    pub dtype: Option<String>,
    pub eos_token_id: Option<TokenIds>,
}

/// The resolved configuration the engine works with, with no Options left.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub architecture: String,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub vocab_size: usize,
    pub tie_word_embeddings: bool,
    pub eos_token_ids: Vec<u32>,
    /// The checkpoint's own dtype (`torch_dtype` / `dtype`), if it says.
    pub checkpoint_dtype: Option<String>,
    /// The projections PEFT adapters may target, in the order the model applies them.
    pub lora_targets: Vec<LoraTarget>,
    /// Experts in each mixture-of-experts block (0 for a dense model).
    pub moe_experts: usize,
    /// config.json as read: the model file parses its own fields from it.
    pub hf: Arc<serde_json::Value>,
}

/// `layer_types`, when given, names one kind per layer.
pub fn check_layer_types(arch: &str, types: Option<&[String]>, layers: usize) -> Result<(), ModelError> {
    match types {
        Some(t) if t.len() != layers => Err(ModelError::Config(format!(
            "config.json of {arch}: layer_types has {} entries for {layers} layers",
            t.len()
        ))),
        _ => Ok(()),
    }
}

/// Parses `T` (a model file's view of config.json) from `hf`; a missing or mistyped field
/// is named with the architecture it is for.
pub fn parse_hf<T: DeserializeOwned>(hf: &serde_json::Value, architecture: &str) -> Result<T, ModelError> {
    T::deserialize(hf).map_err(|e| ModelError::Config(format!("config.json of {architecture}: {e}")))
}

/// An unsupported value of a config field, named with the field and the architecture.
pub fn unsupported(
    architecture: &str,
    field: &str,
    value: impl std::fmt::Debug,
    supported: &str,
) -> ModelError {
    ModelError::Config(format!(
        "config.json of {architecture}: {field} {value:?} is not supported (supported: {supported})"
    ))
}

/// The most decoder layers a config may declare (the largest served models have under 200).
pub const MAX_LAYERS: usize = 4096;

impl ModelConfig {
    /// The shared part of `hf` for `architecture`, checked: heads divide the hidden size
    /// (unless `head_dim` is given), KV heads divide the heads. LoRA targets are the model
    /// file's to add.
    pub fn from_hf(hf: &Arc<serde_json::Value>, architecture: &str) -> Result<Self, ModelError> {
        let c: HfCommon = parse_hf(hf, architecture)?;
        let bad = |m: String| ModelError::Config(format!("config.json of {architecture}: {m}"));
        for (field, v) in [
            ("hidden_size", c.hidden_size),
            ("num_hidden_layers", c.num_hidden_layers),
            ("num_attention_heads", c.num_attention_heads),
            ("vocab_size", c.vocab_size),
            ("head_dim", c.head_dim.unwrap_or(1)),
            ("max_position_embeddings", c.max_position_embeddings.unwrap_or(1)),
        ] {
            if v == 0 {
                return Err(bad(format!("{field} is 0")));
            }
        }
        // Layers size per-layer tables as the config is read, before any weight: a count
        // past every real model's is refused here rather than allocated.
        if c.num_hidden_layers > MAX_LAYERS {
            return Err(bad(format!("num_hidden_layers {} is more than {MAX_LAYERS}", c.num_hidden_layers)));
        }
        if c.head_dim.is_none() && !c.hidden_size.is_multiple_of(c.num_attention_heads) {
            return Err(bad(format!(
                "hidden_size {} is not divisible by num_attention_heads {}",
                c.hidden_size, c.num_attention_heads
            )));
        }
        let num_kv_heads = c.num_key_value_heads.unwrap_or(c.num_attention_heads);
        if num_kv_heads == 0 || !c.num_attention_heads.is_multiple_of(num_kv_heads) {
            return Err(bad(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {num_kv_heads}",
                c.num_attention_heads
            )));
        }
        Ok(Self {
            architecture: architecture.to_string(),
            hidden_size: c.hidden_size,
            num_layers: c.num_hidden_layers,
            num_heads: c.num_attention_heads,
            num_kv_heads,
            head_dim: c.head_dim.unwrap_or(c.hidden_size / c.num_attention_heads),
            max_position_embeddings: c.max_position_embeddings.unwrap_or(2048),
            vocab_size: c.vocab_size,
            tie_word_embeddings: c.tie_word_embeddings.unwrap_or(false),
            eos_token_ids: c.eos_token_id.map(|e| e.to_vec()).unwrap_or_default(),
            checkpoint_dtype: c.torch_dtype.or(c.dtype),
            lora_targets: Vec::new(),
            moe_experts: 0,
            hf: hf.clone(),
        })
    }
}

/// `rope_scaling` (old) or `rope_parameters` (new) of one attention kind.
#[derive(Debug, Clone, Deserialize, Default)]
pub struct RopeParams {
    pub rope_type: Option<String>,
    /// The older name of `rope_type` (files may carry both).
    #[serde(rename = "type")]
    pub legacy_type: Option<String>,
    pub rope_theta: Option<f64>,
    pub factor: Option<f64>,
    pub low_freq_factor: Option<f64>,
    pub high_freq_factor: Option<f64>,
    pub original_max_position_embeddings: Option<usize>,
    pub partial_rotary_factor: Option<f64>,
    pub attention_factor: Option<f64>,
    pub beta_fast: Option<f64>,
    pub beta_slow: Option<f64>,
    pub mscale: Option<f64>,
    pub mscale_all_dim: Option<f64>,
    pub truncate: Option<bool>,
    pub short_factor: Option<Vec<f64>>,
    pub long_factor: Option<Vec<f64>>,
}

/// The rotary fields of config.json: the theta, partial rotary factor and scaling given
/// at the top level (older files) or in `rope_parameters` (newer ones, which may hold one
/// entry per attention kind, such as Gemma 3's "sliding_attention" and "full_attention").
#[derive(Debug, Clone, Deserialize, Default)]
pub struct RopeConfig {
    pub rope_theta: Option<f64>,
    pub partial_rotary_factor: Option<f64>,
    pub rope_scaling: Option<RopeParams>,
    pub rope_parameters: Option<serde_json::Value>,
    pub max_position_embeddings: Option<usize>,
    pub original_max_position_embeddings: Option<usize>,
}

/// How rotary frequencies are adjusted, as transformers' `ROPE_INIT_FUNCTIONS` define it.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    Linear {
        factor: f64,
    },
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position: usize,
    },
    Yarn {
        factor: f64,
        attention_factor: f64,
        beta_fast: f64,
        beta_slow: f64,
        original_max_position: usize,
        truncate: bool,
    },
    /// Dynamic NTK: the default frequencies up to `original_max_position` (the config's
    /// `max_position_embeddings`), a base grown with the length beyond it.
    Dynamic {
        factor: f64,
        original_max_position: usize,
    },
    /// LongRoPE: the short factors while the forward's length stays within
    /// `original_max_position`, the long ones beyond it.
    LongRope {
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        attention_factor: f64,
        original_max_position: usize,
    },
}

/// One attention kind's resolved rotary embedding.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    pub theta: f64,
    /// Dims of each head that rotate (the rest pass through).
    pub rotary_dim: usize,
    pub scaling: RopeScaling,
    /// The context these frequencies serve where it is not the config's
    /// `max_position_embeddings` (dynamic NTK: `factor` times it).
    pub context: Option<usize>,
}

impl RopeConfig {
    /// The rotary embedding of the attention kind `kind` ("full_attention" or
    /// "sliding_attention" in per-kind `rope_parameters`; the global parameters serve
    /// every kind otherwise), for heads of `head_dim`, with `default_theta` when the file
    /// gives none.
    pub fn resolve(
        &self,
        arch: &str,
        head_dim: usize,
        kind: &str,
        default_theta: f64,
    ) -> Result<Rope, ModelError> {
        let params: RopeParams = match &self.rope_parameters {
            Some(v) if v.get(kind).is_some() => parse_hf(&v[kind], arch)?,
            Some(v) if v.get("rope_type").is_some() || v.get("rope_theta").is_some() => parse_hf(v, arch)?,
            _ => self.rope_scaling.clone().unwrap_or_default(),
        };
        let theta = params.rope_theta.or(self.rope_theta).unwrap_or(default_theta);
        let bad = |m: String| ModelError::Config(format!("config.json of {arch}: {m}"));
        if !(theta.is_finite() && theta > 0.0) {
            return Err(bad(format!("rope_theta {theta} must be a positive number")));
        }
        if let Some(f) = params.factor
            && !(f.is_finite() && f > 0.0)
        {
            return Err(bad(format!("rope factor {f} must be a positive number")));
        }
        let rotary_dim = match params.partial_rotary_factor.or(self.partial_rotary_factor) {
            Some(f) if f > 0.0 && f <= 1.0 && ((head_dim as f64 * f) as usize) >= 2 => {
                ((head_dim as f64 * f) as usize) & !1
            }
            Some(f) => {
                return Err(bad(format!(
                    "partial_rotary_factor {f} must be in (0, 1] and leave at least 2 rotary dims of {head_dim}"
                )));
            }
            None => head_dim,
        };
        let max_pos = self.max_position_embeddings.unwrap_or(2048);
        let original = self.original_max_position_embeddings.or(params.original_max_position_embeddings);
        let factor = params.factor.unwrap_or(1.0);
        let mut context = None;
        let scaling = match params.rope_type.as_deref().or(params.legacy_type.as_deref()) {
            None | Some("default") => RopeScaling::None,
            Some("linear") => RopeScaling::Linear { factor },
            Some("dynamic") => {
                // transformers grows the base past `max_position_embeddings`, without a
                // bound; vLLM serves up to `factor` times that, and so does this.
                context = Some((max_pos as f64 * factor.max(1.0)) as usize);
                RopeScaling::Dynamic { factor, original_max_position: max_pos }
            }
            Some("llama3") => RopeScaling::Llama3 {
                factor,
                low_freq_factor: params.low_freq_factor.unwrap_or(1.0),
                high_freq_factor: params.high_freq_factor.unwrap_or(4.0),
                original_max_position: original.unwrap_or(8192),
            },
            Some("yarn") => {
                let original = original.unwrap_or(max_pos);
                let factor = params.factor.unwrap_or(max_pos as f64 / original as f64);
                let attention_factor =
                    params.attention_factor.unwrap_or_else(|| match (params.mscale, params.mscale_all_dim) {
                        (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                            yarn_mscale(factor, m) / yarn_mscale(factor, all)
                        }
                        _ => yarn_mscale(factor, 1.0),
                    });
                RopeScaling::Yarn {
                    factor,
                    attention_factor,
                    beta_fast: params.beta_fast.unwrap_or(32.0),
                    beta_slow: params.beta_slow.unwrap_or(1.0),
                    original_max_position: original,
                    truncate: params.truncate.unwrap_or(true),
                }
            }
            Some("longrope") => {
                let original = original.unwrap_or(max_pos);
                let factors = |name: &str, v: &Option<Vec<f64>>| match v {
                    None => Err(bad(format!("longrope needs {name}"))),
                    Some(v) if v.len() != rotary_dim / 2 => Err(bad(format!(
                        "longrope {name} has {} entries, rotary dims need {}",
                        v.len(),
                        rotary_dim / 2
                    ))),
                    Some(v) if v.iter().any(|f| !(f.is_finite() && *f > 0.0)) => {
                        Err(bad(format!("longrope {name} must hold positive numbers")))
                    }
                    Some(v) => Ok(v.clone()),
                };
                let short_factor = factors("short_factor", &params.short_factor)?;
                let long_factor = factors("long_factor", &params.long_factor)?;
                let factor = params.factor.unwrap_or(max_pos as f64 / original as f64);
                let attention_factor = params.attention_factor.unwrap_or(match factor <= 1.0 {
                    true => 1.0,
                    false => (1.0 + factor.ln() / (original as f64).ln()).sqrt(),
                });
                RopeScaling::LongRope {
                    short_factor,
                    long_factor,
                    attention_factor,
                    original_max_position: original,
                }
            }
            Some(other) => {
                return Err(unsupported(
                    arch,
                    "rope type",
                    other,
                    "default, linear, dynamic, yarn, llama3, longrope",
                ));
            }
        };
        Ok(Rope { theta, rotary_dim, scaling, context })
    }
}

fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 { 1.0 } else { 0.1 * mscale * scale.ln() + 1.0 }
}

impl Rope {
    /// Inverse frequencies as transformers computes them (f32), adjusted by the scaling
    /// rule, and the factor cos and sin are multiplied by.
    pub fn spec(&self, head_dim: usize) -> RopeSpec {
        let d = self.rotary_dim;
        let exps: Vec<f32> = (0..d / 2).map(|i| (2 * i) as f32 / d as f32).collect();
        let theta = self.theta as f32;
        let base: Vec<f32> = exps.iter().map(|&e| 1.0 / theta.powf(e)).collect();
        let mut by_len = RopeByLen::Fixed;
        let (inv_freq, attention_scaling) = match &self.scaling {
            RopeScaling::None => (base, 1.0),
            RopeScaling::Linear { factor } => (base.iter().map(|f| f / *factor as f32).collect(), 1.0),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
                let old = *original_max_position as f32;
                let (lo, hi, factor) = (*low_freq_factor as f32, *high_freq_factor as f32, *factor as f32);
                let (low_wavelen, high_wavelen) = (old / lo, old / hi);
                let f = base.iter().map(|&f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - lo) / (hi - lo);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                });
                (f.collect(), 1.0)
            }
            RopeScaling::Yarn {
                factor,
                attention_factor,
                beta_fast,
                beta_slow,
                original_max_position,
                truncate,
            } => {
                let (dim, base_f) = (d as f64, self.theta);
                let correction = |rot: f64| {
                    dim * (*original_max_position as f64 / (rot * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * base_f.ln())
                };
                let (mut low, mut high) = (correction(*beta_fast), correction(*beta_slow));
                if *truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0) as f32, high.min(dim - 1.0) as f32);
                if low == high {
                    high += 0.001;
                }
                let pos_freqs: Vec<f32> = exps.iter().map(|&e| theta.powf(e)).collect();
                let f = pos_freqs.iter().enumerate().map(|(i, &p)| {
                    let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                    let extrapolation = 1.0 - ramp;
                    let (inter, extra) = (1.0 / (*factor as f32 * p), 1.0 / p);
                    inter * (1.0 - extrapolation) + extra * extrapolation
                });
                (f.collect(), *attention_factor as f32)
            }
            RopeScaling::Dynamic { factor, original_max_position } => {
                by_len = RopeByLen::Ntk {
                    original: *original_max_position as u32,
                    theta: self.theta,
                    factor: *factor,
                };
                (base, 1.0)
            }
            RopeScaling::LongRope { short_factor, long_factor, attention_factor, original_max_position } => {
                let scaled = |factors: &[f64]| -> Vec<f32> {
                    exps.iter().zip(factors).map(|(&e, &s)| 1.0 / (s as f32 * theta.powf(e))).collect()
                };
                by_len =
                    RopeByLen::Long { original: *original_max_position as u32, long: scaled(long_factor) };
                (scaled(short_factor), *attention_factor as f32)
            }
        };
        RopeSpec { inv_freq, head_dim, attention_scaling, by_len }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rope(extra: &str) -> Result<Rope, ModelError> {
        let text = format!(r#"{{"max_position_embeddings":131072{extra}}}"#);
        serde_json::from_str::<RopeConfig>(&text).unwrap().resolve(
            "LlamaForCausalLM",
            64,
            "full_attention",
            10000.0,
        )
    }

    #[test]
    fn old_and_new_rope_forms_resolve_alike() {
        let old = rope(r#","rope_theta":500000.0,"rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}"#).unwrap();
        let new = rope(r#","rope_parameters":{"rope_type":"llama3","rope_theta":500000.0,"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}"#).unwrap();
        assert_eq!(old.theta, 500000.0);
        assert_eq!(old, new);
        // Llama 3: the highest frequencies are kept, the lowest divided by the factor.
        let plain = rope(r#","rope_theta":500000.0"#).unwrap().spec(64).inv_freq;
        let scaled = old.spec(64).inv_freq;
        assert_eq!(scaled[0], plain[0]);
        assert!((scaled[31] - plain[31] / 8.0).abs() < 1e-12);
    }

    #[test]
    fn per_kind_rope_parameters_and_clear_errors() {
        let per_kind = r#","rope_parameters":{"full_attention":{"rope_type":"linear","factor":8.0,"rope_theta":1000000.0},"sliding_attention":{"rope_type":"default","rope_theta":10000.0}}"#;
        let c: RopeConfig =
            serde_json::from_str(&format!(r#"{{"max_position_embeddings":8192{per_kind}}}"#)).unwrap();
        let full = c.resolve("Gemma3ForCausalLM", 64, "full_attention", 1.0).unwrap();
        let local = c.resolve("Gemma3ForCausalLM", 64, "sliding_attention", 1.0).unwrap();
        assert_eq!((full.theta, full.scaling.clone()), (1e6, RopeScaling::Linear { factor: 8.0 }));
        assert_eq!((local.theta, local.scaling), (1e4, RopeScaling::None));
        let e = rope(r#","rope_scaling":{"type":"su","factor":2.0}"#).unwrap_err().to_string();
        assert!(e.contains("su") && e.contains("yarn") && e.contains("LlamaForCausalLM"), "{e}");
    }

    #[test]
    fn yarn_and_longrope_scale_cos_and_sin() {
        let y = rope(
            r#","rope_scaling":{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}"#,
        )
        .unwrap();
        let spec = y.spec(64);
        assert!((spec.attention_scaling - (0.1 * 4f32.ln() + 1.0)).abs() < 1e-6);
        let plain = rope("").unwrap().spec(64).inv_freq;
        assert_eq!(spec.inv_freq[0], plain[0], "the fastest dims extrapolate");
        assert!((spec.inv_freq[31] - plain[31] / 4.0).abs() < 1e-9, "the slowest interpolate");
        let (short, long) = (vec![1.5; 32], vec![3.0; 32]);
        let l = rope(&format!(
            r#","original_max_position_embeddings":4096,"rope_scaling":{{"type":"longrope","short_factor":{short:?},"long_factor":{long:?}}}"#
        ))
        .unwrap();
        assert_eq!(l.context, None, "the long factors serve the whole context");
        let spec = l.spec(64);
        assert!((spec.inv_freq[3] - plain[3] / 1.5).abs() < 1e-9);
        assert!((spec.attention_scaling - (1.0 + 32f32.ln() / 4096f32.ln()).sqrt()).abs() < 1e-6);
        assert_eq!(spec.inv_freq_at(4096), spec.inv_freq, "short factors up to the original length");
        assert!((spec.inv_freq_at(4097)[3] - plain[3] / 3.0).abs() < 1e-9, "long factors beyond it");
        let missing = rope(&format!(
            r#","original_max_position_embeddings":4096,"rope_scaling":{{"type":"longrope","short_factor":{short:?}}}"#
        ));
        assert!(missing.unwrap_err().to_string().contains("long_factor"));
    }

    #[test]
    fn dynamic_ntk_grows_the_base_only_past_the_configured_context() {
        let d = rope(r#","rope_theta":10000.0,"rope_scaling":{"type":"dynamic","factor":2.0}"#).unwrap();
        assert_eq!(d.context, Some(262144));
        let spec = d.spec(64);
        let plain = rope("").unwrap().spec(64).inv_freq;
        assert_eq!(spec.inv_freq, plain);
        assert_eq!(spec.inv_freq_at(131072), plain);
        // At twice the context: base · (2 · 2 − 1)^(64 / 62).
        let base = 10000f64 * 3f64.powf(64.0 / 62.0);
        let grown = spec.inv_freq_at(262144);
        assert_eq!(grown[0], 1.0);
        assert!((grown[31] as f64 - base.powf(-62.0 / 64.0)).abs() < 1e-6 * grown[31] as f64);
        assert!(spec.inv_freq_at(131073)[31] < plain[31], "one token past it already grows");
    }
}
