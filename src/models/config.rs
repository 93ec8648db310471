//! Hugging Face `config.json` for Llama-family models, in the older form (`rope_theta`,
//! `rope_scaling`) and the newer (`rope_parameters`), resolved once into [`ModelConfig`].

use serde::Deserialize;

use super::ModelError;

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

/// `rope_scaling` (old) or `rope_parameters` (new).
#[derive(Debug, Clone, Deserialize, Default)]
pub struct RopeParams {
    #[serde(alias = "type")]
    pub rope_type: Option<String>,
    pub rope_theta: Option<f64>,
    pub factor: Option<f64>,
    pub low_freq_factor: Option<f64>,
    pub high_freq_factor: Option<f64>,
    pub original_max_position_embeddings: Option<usize>,
    pub partial_rotary_factor: Option<f64>,
}

/// Mirrors config.json; every field the file may omit is an Option.
#[derive(Debug, Clone, Deserialize)]
pub struct HfConfig {
    #[serde(default)]
    pub architectures: Vec<String>,
    pub model_type: Option<String>,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub max_position_embeddings: Option<usize>,
    pub rms_norm_eps: Option<f64>,
    pub rope_theta: Option<f64>,
    pub rope_scaling: Option<RopeParams>,
    pub rope_parameters: Option<RopeParams>,
    pub vocab_size: usize,
    pub tie_word_embeddings: Option<bool>,
    pub attention_bias: Option<bool>,
    pub hidden_act: Option<String>,
    pub torch_dtype: Option<String>,
    pub dtype: Option<String>,
    pub eos_token_id: Option<TokenIds>,
    pub bos_token_id: Option<u32>,
    pub sliding_window: Option<usize>,
    pub use_sliding_window: Option<bool>,
}

/// How rotary frequencies are adjusted.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    Linear { factor: f64 },
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position: usize },
}

/// The resolved configuration, with no Options left.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub architecture: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub vocab_size: usize,
    pub tie_word_embeddings: bool,
    pub qkv_bias: bool,
    pub eos_token_ids: Vec<u32>,
    /// The checkpoint's own dtype (`torch_dtype` / `dtype`), if it says.
    pub checkpoint_dtype: Option<String>,
}

impl HfConfig {
    pub fn resolve(self) -> Result<ModelConfig, ModelError> {
        let architecture = self
            .architectures
            .first()
            .cloned()
            .ok_or_else(|| ModelError::Config("config.json has no `architectures` entry".to_string()))?;
        if self.num_attention_heads == 0 || !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(ModelError::Config(format!(
                "hidden_size {} is not divisible by num_attention_heads {}",
                self.hidden_size, self.num_attention_heads
            )));
        }
        let num_kv_heads = self.num_key_value_heads.unwrap_or(self.num_attention_heads);
        if num_kv_heads == 0 || !self.num_attention_heads.is_multiple_of(num_kv_heads) {
            return Err(ModelError::Config(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {num_kv_heads}",
                self.num_attention_heads
            )));
        }
        if let Some(act) = &self.hidden_act
            && act != "silu"
        {
            return Err(ModelError::Config(format!("hidden_act {act:?} is not supported (supported: silu)")));
        }
        if self.use_sliding_window == Some(true) {
            return Err(ModelError::Config("sliding-window attention is not supported".to_string()));
        }
        let head_dim = self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads);
        let params = self.rope_parameters.clone().or(self.rope_scaling.clone()).unwrap_or_default();
        let rope_theta = params.rope_theta.or(self.rope_theta).unwrap_or(10000.0);
        let rotary_dim = match params.partial_rotary_factor {
            Some(f) => ((head_dim as f64 * f) as usize) & !1,
            None => head_dim,
        };
        let factor = params.factor.unwrap_or(1.0);
        let rope_scaling = match params.rope_type.as_deref() {
            None | Some("default") => RopeScaling::None,
            Some("linear") => RopeScaling::Linear { factor },
            Some("llama3") => RopeScaling::Llama3 {
                factor,
                low_freq_factor: params.low_freq_factor.unwrap_or(1.0),
                high_freq_factor: params.high_freq_factor.unwrap_or(4.0),
                original_max_position: params.original_max_position_embeddings.unwrap_or(8192),
            },
            Some(other) => {
                return Err(ModelError::Config(format!(
                    "rope type {other:?} is not supported (supported: default, linear, llama3)"
                )));
            }
        };
        let qkv_bias = self.attention_bias.unwrap_or(self.model_type.as_deref() == Some("qwen2"));
        Ok(ModelConfig {
            architecture,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_layers: self.num_hidden_layers,
            num_heads: self.num_attention_heads,
            num_kv_heads,
            head_dim,
            rotary_dim,
            max_position_embeddings: self.max_position_embeddings.unwrap_or(2048),
            rms_norm_eps: self.rms_norm_eps.unwrap_or(1e-6) as f32,
            rope_theta,
            rope_scaling,
            vocab_size: self.vocab_size,
            tie_word_embeddings: self.tie_word_embeddings.unwrap_or(false),
            qkv_bias,
            eos_token_ids: self.eos_token_id.map(|e| e.to_vec()).unwrap_or_default(),
            checkpoint_dtype: self.torch_dtype.or(self.dtype),
        })
    }
}

impl ModelConfig {
    /// Inverse frequencies of the rotary embedding, as HF computes them (f32), adjusted by
    /// the scaling rule.
    pub fn inv_freq(&self) -> Vec<f32> {
        let d = self.rotary_dim;
        let base: Vec<f32> =
            (0..d / 2).map(|i| 1.0 / (self.rope_theta as f32).powf((2 * i) as f32 / d as f32)).collect();
        match self.rope_scaling {
            RopeScaling::None => base,
            RopeScaling::Linear { factor } => base.iter().map(|f| f / factor as f32).collect(),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
                let old = original_max_position as f32;
                let (lo, hi, factor) = (low_freq_factor as f32, high_freq_factor as f32, factor as f32);
                let (low_wavelen, high_wavelen) = (old / lo, old / hi);
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - lo) / (hi - lo);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(extra: &str) -> Result<ModelConfig, ModelError> {
        let text = format!(
            r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100{extra}}}"#
        );
        serde_json::from_str::<HfConfig>(&text).unwrap().resolve()
    }

    #[test]
    fn old_and_new_rope_forms_resolve_alike() {
        let old = parse(r#","rope_theta":500000.0,"rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}"#).unwrap();
        let new = parse(r#","rope_parameters":{"rope_type":"llama3","rope_theta":500000.0,"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}"#).unwrap();
        assert_eq!(old.rope_theta, 500000.0);
        assert_eq!(old.rope_scaling, new.rope_scaling);
        assert_eq!(old.inv_freq(), new.inv_freq());
        // Llama 3: the highest frequencies are kept, the lowest divided by the factor.
        let plain = parse(r#","rope_theta":500000.0"#).unwrap().inv_freq();
        let scaled = old.inv_freq();
        assert_eq!(scaled[0], plain[0]);
        assert!((scaled[7] - plain[7] / 8.0).abs() < 1e-12);
    }

    #[test]
    fn eos_as_int_or_list_and_clear_errors() {
        assert_eq!(parse(r#","eos_token_id":[1,2]"#).unwrap().eos_token_ids, vec![1, 2]);
        assert_eq!(parse(r#","eos_token_id":7"#).unwrap().eos_token_ids, vec![7]);
        let e = parse(r#","rope_scaling":{"type":"yarn","factor":2.0}"#).unwrap_err().to_string();
        assert!(e.contains("yarn") && e.contains("llama3"), "{e}");
    }
}
