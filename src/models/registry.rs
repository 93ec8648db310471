//! ModelRegistry: `architectures[0]` of config.json → a constructor (vLLM's
//! `ModelRegistry`). Code outside the crate adds its own with [`ModelRegistry::register_model`].

use std::collections::BTreeMap;
use std::path::Path;

use super::config::{HfConfig, ModelConfig};
use super::loader::{Checkpoint, StackedParam, WeightStore};
use super::{CausalLM, LoadOptions, ModelError, llama};
use crate::kernels::{DType, Device};

pub type Constructor<D> =
    fn(&D, &ModelConfig, &WeightStore, &LoadOptions) -> Result<Box<dyn CausalLM<D>>, ModelError>;

/// What the registry knows of one architecture.
pub struct ModelEntry<D: Device> {
    pub construct: Constructor<D>,
    /// How checkpoint shards map onto fused parameters.
    pub stacked_params: &'static [StackedParam],
    /// Checkpoint tensors the model does not use.
    pub skip: fn(&str, &ModelConfig) -> bool,
}

pub struct ModelRegistry<D: Device> {
    entries: BTreeMap<String, ModelEntry<D>>,
}

fn build_llama<D: Device>(
    dev: &D,
    cfg: &ModelConfig,
    w: &WeightStore,
    opts: &LoadOptions,
) -> Result<Box<dyn CausalLM<D>>, ModelError> {
    Ok(Box::new(llama::LlamaForCausalLM::load(dev, cfg, w, opts)?))
}

impl<D: Device> Default for ModelRegistry<D> {
    fn default() -> Self {
        let mut r = Self { entries: BTreeMap::new() };
        for arch in ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"] {
            r.register_model(
                arch,
                ModelEntry {
                    construct: build_llama::<D>,
                    stacked_params: llama::STACKED_PARAMS,
                    skip: llama::skip_tensor,
                },
            );
        }
        r
    }
}

/// A model read from a directory: its resolved config and the weights on the device.
pub struct LoadedModel<D: Device> {
    pub config: ModelConfig,
    pub model: Box<dyn CausalLM<D>>,
    pub dtype: DType,
}

impl<D: Device> ModelRegistry<D> {
    pub fn register_model(&mut self, architecture: &str, entry: ModelEntry<D>) {
        self.entries.insert(architecture.to_string(), entry);
    }

    pub fn architectures(&self) -> Vec<&str> {
        self.entries.keys().map(String::as_str).collect()
    }

    /// Reads `dir/config.json` and resolves it.
    pub fn read_config(dir: &Path) -> Result<ModelConfig, ModelError> {
        let path = dir.join("config.json");
        if !path.exists() {
            return Err(ModelError::MissingFile { path, hint: "not a Hugging Face model directory" });
        }
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        let hf: HfConfig = serde_json::from_str(&text)
            .map_err(|e| ModelError::Config(format!("{}: {e}", path.display())))?;
        hf.resolve()
    }

    /// Loads the model in `dir` onto `dev`, converting weights to `dtype`.
    pub fn load(
        &self,
        dev: &D,
        dir: &Path,
        dtype: DType,
        opts: &LoadOptions,
    ) -> Result<LoadedModel<D>, ModelError> {
        let config = Self::read_config(dir)?;
        let entry =
            self.entries.get(&config.architecture).ok_or_else(|| ModelError::UnknownArchitecture {
                arch: config.architecture.clone(),
                known: self.architectures().join(", "),
            })?;
        let ckpt = Checkpoint::open(dir)?;
        let store = WeightStore::load_weights(
            ckpt.tensors(),
            entry.stacked_params,
            |n| (entry.skip)(n, &config),
            dtype,
        );
        let model = (entry.construct)(dev, &config, &store, opts)?;
        Ok(LoadedModel { config, model, dtype })
    }
}
