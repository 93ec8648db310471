//! ModelRegistry: `architectures[0]` of config.json → the architecture's entry (vLLM's
//! `ModelRegistry`): how to read its config, how to build it, and its checkpoint's stacked
//! parameters. Adding an architecture is one file in `src/models/` and one line in
//! [`ModelRegistry::default`]; code outside the crate adds its own with
//! [`ModelRegistry::register_model`].

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use super::config::ModelConfig;
use super::loader::{Checkpoint, StackedParam, WeightStore};
use super::{
    CausalLM, LoadOptions, ModelError, gemma, gemma2, gemma3, llama, mixtral, opt, phi3, qwen2_moe, qwen3,
    qwen3_moe,
};
use crate::kernels::{DType, Device, KvScales};

pub type Constructor<D> =
    fn(&D, &ModelConfig, &WeightStore, &LoadOptions) -> Result<Box<dyn CausalLM<D>>, ModelError>;

/// Reads an architecture's config.json (as JSON, with its architecture's name) into the
/// shared config, checking the architecture's own fields and declaring its LoRA targets.
pub type ConfigReader = fn(&Arc<serde_json::Value>, &str) -> Result<ModelConfig, ModelError>;

/// What the registry knows of one architecture.
pub struct ModelEntry<D: Device> {
    pub config: ConfigReader,
    pub construct: Constructor<D>,
    /// How checkpoint shards map onto fused parameters.
    pub stacked_params: &'static [StackedParam],
    /// Checkpoint tensors the model does not use.
    pub skip: fn(&str, &ModelConfig) -> bool,
}

pub struct ModelRegistry<D: Device> {
    entries: BTreeMap<String, ModelEntry<D>>,
}

impl<D: Device> Default for ModelRegistry<D> {
    fn default() -> Self {
        let mut r = Self { entries: BTreeMap::new() };
        r.register_model("LlamaForCausalLM", llama::entry());
        r.register_model("MistralForCausalLM", llama::entry());
        r.register_model("Qwen2ForCausalLM", llama::qwen2_entry());
        r.register_model("Qwen3ForCausalLM", qwen3::entry());
        r.register_model("GemmaForCausalLM", gemma::entry());
        r.register_model("Gemma2ForCausalLM", gemma2::entry());
        r.register_model("Gemma3ForCausalLM", gemma3::entry());
        r.register_model("Phi3ForCausalLM", phi3::entry());
        r.register_model("OPTForCausalLM", opt::entry());
        r.register_model("MixtralForCausalLM", mixtral::entry());
        r.register_model("Qwen2MoeForCausalLM", qwen2_moe::entry());
        r.register_model("Qwen3MoeForCausalLM", qwen3_moe::entry());
        r
    }
}

/// A model read from a directory: its resolved config, the weights on the device, and the
/// checkpoint's FP8 KV cache scales by layer, if it has any (with how many it gave).
pub struct LoadedModel<D: Device> {
    pub config: ModelConfig,
    pub model: Box<dyn CausalLM<D>>,
    pub dtype: DType,
    pub kv_scales: Option<(Vec<KvScales>, usize)>,
}

impl<D: Device> ModelRegistry<D> {
    pub fn register_model(&mut self, architecture: &str, entry: ModelEntry<D>) {
        self.entries.insert(architecture.to_string(), entry);
    }

    pub fn architectures(&self) -> Vec<&str> {
        self.entries.keys().map(String::as_str).collect()
    }

    /// Reads `dir/config.json`: its architecture must be registered (checked before any
    /// other field is read), then the architecture's entry reads the rest.
    pub fn read_config(&self, dir: &Path) -> Result<ModelConfig, ModelError> {
        let path = dir.join("config.json");
        if !path.exists() {
            return Err(ModelError::MissingFile { path, hint: "not a Hugging Face model directory" });
        }
        let text = std::fs::read(&path).map_err(|e| ModelError::io(&path, e))?;
        self.config_from_json(&text, &path.display().to_string())
    }

    /// Reads a config.json held in memory (`source` names it in errors), as
    /// [`Self::read_config`] does.
    pub fn config_from_json(&self, text: &[u8], source: &str) -> Result<ModelConfig, ModelError> {
        let hf: serde_json::Value =
            serde_json::from_slice(text).map_err(|e| ModelError::Config(format!("{source}: {e}")))?;
        let arch = hf["architectures"].get(0).and_then(|a| a.as_str()).ok_or_else(|| {
            ModelError::Config(format!("{source}: no `architectures` entry names the model class"))
        })?;
        let entry = match self.entry(arch) {
            Err(ModelError::UnknownArchitecture { known, .. }) if hf.get("auto_map").is_some() => {
                let code = hf["auto_map"]["AutoModelForCausalLM"].as_str().unwrap_or("its own modeling code");
                return Err(ModelError::RemoteCode { arch: arch.to_string(), code: code.to_string(), known });
            }
            other => other?,
        };
        crate::quantization::check_config(&hf, source)?;
        (entry.config)(&Arc::new(hf.clone()), arch)
    }

    fn entry(&self, arch: &str) -> Result<&ModelEntry<D>, ModelError> {
        self.entries.get(arch).ok_or_else(|| ModelError::UnknownArchitecture {
            arch: arch.to_string(),
            known: self.architectures().join(", "),
        })
    }

    /// Loads the model in `dir` onto `dev`, converting weights to `dtype`.
    pub fn load(
        &self,
        dev: &D,
        dir: &Path,
        dtype: DType,
        opts: &LoadOptions,
    ) -> Result<LoadedModel<D>, ModelError> {
        let config = self.read_config(dir)?;
        let entry = self.entry(&config.architecture)?;
        if opts.dummy {
            let store = WeightStore::dummy(dtype, crate::quantization::dummy_rows(&config.hf))
                .with_online_fp8(opts.online_fp8);
            let model = (entry.construct)(dev, &config, &store, opts)?;
            return Ok(LoadedModel { config, model, dtype, kv_scales: None });
        }
        let ckpt = Checkpoint::open(dir, crate::quantization::packing(&config.hf))?;
        let kv_scales = ckpt.kv_scales(config.num_layers)?;
        let store = WeightStore::load_weights(
            ckpt.tensors(),
            entry.stacked_params,
            |n| (entry.skip)(n, &config),
            dtype,
        )
        .with_online_fp8(opts.online_fp8);
        let model = (entry.construct)(dev, &config, &store, opts)?;
        Ok(LoadedModel { config, model, dtype, kv_scales })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::CpuDevice;

    /// A config whose class is not built in and that maps it to the checkpoint's own code
    /// is refused as needing remote code, naming that code; without auto_map it is an
    /// unknown architecture.
    #[test]
    fn configs_that_need_remote_code_are_refused_by_name() {
        let registry = ModelRegistry::<CpuDevice>::default();
        let remote = br#"{"architectures": ["ChatGLMModel"],
            "auto_map": {"AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration"}}"#;
        let e = registry.config_from_json(remote, "config.json").unwrap_err().to_string();
        assert!(e.contains("remote code (modeling_chatglm.ChatGLMForConditionalGeneration"), "{e}");
        assert!(e.contains("LlamaForCausalLM"), "the built-in architectures are listed: {e}");
        let unknown = br#"{"architectures": ["ChatGLMModel"]}"#;
        let e = registry.config_from_json(unknown, "config.json").unwrap_err();
        assert!(matches!(e, ModelError::UnknownArchitecture { .. }), "{e}");
    }

    /// A bitsandbytes Llama is refused by its method before any field or weight is read,
    /// not with a missing-tensor error about `q_proj.weight` later.
    #[test]
    fn quantized_checkpoints_are_refused_by_their_method() {
        let registry = ModelRegistry::<CpuDevice>::default();
        let bnb = br#"{"architectures": ["LlamaForCausalLM"],
            "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": true}}"#;
        let e = registry.config_from_json(bnb, "m/config.json").unwrap_err().to_string();
        assert!(
            e.starts_with(
                "m/config.json: the checkpoint is quantized with bitsandbytes (quantization_config)"
            ),
            "{e}"
        );
    }
}
