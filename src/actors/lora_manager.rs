//! LoRAManager actor: owns the adapter registry (name → load id, path, rank, targets) and a
//! host-side LRU of loaded adapters (`--max-cpu-loras`). The Engine asks it to
//! [`Resolve`] a name when a request arrives; the web layer registers and removes adapters
//! at run time. Loading reads files on a blocking thread, off the step loop, and a failed
//! load only fails that call. Device slots are assigned by the Scheduler (admission
//! depends on them); this actor hands it the host weights.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use actix::prelude::*;

use crate::models::config::ModelConfig;
use crate::models::lora::{LoraAdapter, LoraError, load_peft};

#[derive(Debug, Clone, thiserror::Error)]
pub enum LoraManagerError {
    #[error("The model `{0}` does not exist.")]
    NotFound(String),
    #[error(transparent)]
    Load(#[from] LoraError),
    #[error("loading thread failed: {0}")]
    Thread(String),
    #[error(
        "adapter name {0:?} is not allowed: use 1 to 128 letters, digits and the characters - _ . : / @ +"
    )]
    BadName(String),
}

/// Whether `name` may name an adapter: it is echoed in responses and metric labels, so it
/// holds letters, digits and `-_.:/@+` only.
pub fn valid_adapter_name(name: &str) -> bool {
    (1..=128).contains(&name.len())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.:/@+".contains(c))
}

/// Returns the adapter's host weights, loading them if they are not cached.
#[derive(Message)]
#[rtype(result = "Result<Arc<LoraAdapter>, LoraManagerError>")]
pub struct Resolve {
    pub name: String,
}

/// Loads an adapter from `path` and registers it under `name` (replacing any adapter of
/// that name: running requests keep the weights they started with).
#[derive(Message)]
#[rtype(result = "Result<AdapterInfo, LoraManagerError>")]
pub struct Register {
    pub name: String,
    pub path: PathBuf,
    /// The canonical root a runtime-loaded adapter must stay inside, checked again at
    /// every read of its files; None for adapters the operator named at start-up.
    pub root: Option<PathBuf>,
}

#[derive(Message)]
#[rtype(result = "Result<(), LoraManagerError>")]
pub struct Unregister {
    pub name: String,
}

#[derive(Message)]
#[rtype(result = "Vec<AdapterInfo>")]
pub struct ListAdapters;

#[derive(Message)]
#[rtype(result = "LoraStats")]
pub struct GetLoraStats;

#[derive(Debug, Clone, PartialEq)]
pub struct AdapterInfo {
    pub name: String,
    pub id: u64,
    pub path: PathBuf,
    pub root: Option<PathBuf>,
    pub rank: usize,
    pub targets: Vec<String>,
}

#[derive(Debug, Clone, Default)]
pub struct LoraStats {
    pub registered: usize,
    /// Adapters whose weights are in host memory.
    pub loaded: usize,
    /// Requests per adapter name since start.
    pub requests: BTreeMap<String, u64>,
    /// Registered adapters' names by load id.
    pub names: HashMap<u64, String>,
}

/// Limits the manager enforces.
#[derive(Debug, Clone)]
pub struct LoraLimits {
    pub max_rank: usize,
    pub max_cpu_loras: usize,
}

pub struct LoraManager {
    model: Arc<ModelConfig>,
    limits: LoraLimits,
    registry: BTreeMap<String, AdapterInfo>,
    /// Load id → weights, least recently used first in `order`.
    cache: HashMap<u64, Arc<LoraAdapter>>,
    order: VecDeque<u64>,
    next_id: u64,
    requests: BTreeMap<String, u64>,
}

fn load_blocking(
    path: PathBuf,
    root: Option<PathBuf>,
    name: String,
    id: u64,
    model: Arc<ModelConfig>,
    max_rank: usize,
) -> ResponseFuture<Result<Arc<LoraAdapter>, LoraManagerError>> {
    Box::pin(async move {
        actix_rt::task::spawn_blocking(move || {
            if let Some(root) = &root {
                within_root(root, &path).map_err(|e| LoraError::Invalid(format!("adapter {name:?}: {e}")))?;
            }
            load_peft(&path, &name, id, &model, max_rank)
        })
        .await
        .map_err(|e| LoraManagerError::Thread(e.to_string()))?
        .map(Arc::new)
        .map_err(LoraManagerError::from)
    })
}

impl LoraManager {
    pub fn new(model: Arc<ModelConfig>, limits: LoraLimits) -> Self {
        Self {
            model,
            limits,
            registry: BTreeMap::new(),
            cache: HashMap::new(),
            order: VecDeque::new(),
            next_id: 1,
            requests: BTreeMap::new(),
        }
    }

    fn cache_insert(&mut self, a: Arc<LoraAdapter>) {
        self.order.retain(|&i| i != a.id);
        self.order.push_back(a.id);
        self.cache.insert(a.id, a);
        while self.cache.len() > self.limits.max_cpu_loras.max(1) {
            // Running requests hold their own Arc: dropping the cached copy is safe.
            if let Some(old) = self.order.pop_front() {
                self.cache.remove(&old);
            }
        }
    }

    fn touch(&mut self, id: u64) -> Option<Arc<LoraAdapter>> {
        let a = self.cache.get(&id)?.clone();
        self.order.retain(|&i| i != id);
        self.order.push_back(id);
        Some(a)
    }

    fn forget(&mut self, id: u64) {
        self.cache.remove(&id);
        self.order.retain(|&i| i != id);
    }
}

impl Actor for LoraManager {
    type Context = Context<Self>;
}

impl Handler<Resolve> for LoraManager {
    type Result = ResponseActFuture<Self, Result<Arc<LoraAdapter>, LoraManagerError>>;
    fn handle(&mut self, msg: Resolve, _: &mut Context<Self>) -> Self::Result {
        let Some(info) = self.registry.get(&msg.name).cloned() else {
            return Box::pin(fut::ready(Err(LoraManagerError::NotFound(msg.name))));
        };
        *self.requests.entry(msg.name.clone()).or_default() += 1;
        if let Some(a) = self.touch(info.id) {
            return Box::pin(fut::ready(Ok(a)));
        }
        let load = load_blocking(
            info.path.clone(),
            info.root.clone(),
            info.name.clone(),
            info.id,
            self.model.clone(),
            self.limits.max_rank,
        );
        Box::pin(load.into_actor(self).map(move |res, act, _| {
            let a = res?;
            // Replaced or removed while loading: serve this request, cache nothing.
            if act.registry.get(&info.name).is_some_and(|i| i.id == a.id) {
                act.cache_insert(a.clone());
            }
            Ok(a)
        }))
    }
}

impl Handler<Register> for LoraManager {
    type Result = ResponseActFuture<Self, Result<AdapterInfo, LoraManagerError>>;
    fn handle(&mut self, msg: Register, _: &mut Context<Self>) -> Self::Result {
        if !valid_adapter_name(&msg.name) {
            return Box::pin(fut::ready(Err(LoraManagerError::BadName(msg.name))));
        }
        let id = self.next_id;
        self.next_id += 1;
        let load = load_blocking(
            msg.path.clone(),
            msg.root.clone(),
            msg.name.clone(),
            id,
            self.model.clone(),
            self.limits.max_rank,
        );
        Box::pin(load.into_actor(self).map(move |res, act, _| {
            let a = res?;
            let info = AdapterInfo {
                name: msg.name.clone(),
                id,
                path: msg.path.clone(),
                root: msg.root.clone(),
                rank: a.rank,
                targets: a.targets.clone(),
            };
            if let Some(old) = act.registry.insert(msg.name.clone(), info.clone()) {
                act.forget(old.id);
            }
            act.cache_insert(a);
            tracing::info!(adapter = %info.name, rank = info.rank, path = %info.path.display(), "LoRA adapter registered");
            Ok(info)
        }))
    }
}

impl Handler<Unregister> for LoraManager {
    type Result = Result<(), LoraManagerError>;
    fn handle(&mut self, msg: Unregister, _: &mut Context<Self>) -> Self::Result {
        let info = self.registry.remove(&msg.name).ok_or(LoraManagerError::NotFound(msg.name))?;
        self.forget(info.id);
        tracing::info!(adapter = %info.name, "LoRA adapter removed");
        Ok(())
    }
}

impl Handler<ListAdapters> for LoraManager {
    type Result = MessageResult<ListAdapters>;
    fn handle(&mut self, _: ListAdapters, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.registry.values().cloned().collect())
    }
}

impl Handler<GetLoraStats> for LoraManager {
    type Result = MessageResult<GetLoraStats>;
    fn handle(&mut self, _: GetLoraStats, _: &mut Context<Self>) -> Self::Result {
        MessageResult(LoraStats {
            registered: self.registry.len(),
            loaded: self.cache.len(),
            requests: self.requests.clone(),
            names: self.registry.values().map(|a| (a.id, a.name.clone())).collect(),
        })
    }
}

/// Resolves a runtime `lora_path` inside `root`: relative paths are taken from the root,
/// `..` components are refused, and the canonical paths of the directory and of the files
/// the loader reads must stay inside the canonical root (symlinks cannot lead out).
pub fn confine(root: &Path, requested: &str) -> Result<PathBuf, String> {
    // One answer for a path that does not exist and one outside the root, so that the
    // answer tells nothing about what lies outside it.
    let refused = || format!("lora_path {requested:?} is not an adapter directory under the LoRA root");
    let p = Path::new(requested);
    if requested.is_empty() || p.components().any(|c| matches!(c, std::path::Component::ParentDir)) {
        return Err(format!("lora_path {requested:?} must not contain '..'"));
    }
    let root = root.canonicalize().map_err(|e| format!("--lora-root {}: {e}", root.display()))?;
    let joined = if p.is_absolute() { p.to_path_buf() } else { root.join(p) };
    within_root(&root, &joined).map_err(|_| refused())
}

/// The canonical adapter directory `dir`, when it and its two files resolve inside `root`
/// (canonical) and the files are regular. Checked when an adapter is registered and again
/// before each read of its files, so that a link swapped in later is refused too.
pub fn within_root(root: &Path, dir: &Path) -> Result<PathBuf, String> {
    let dir = dir.canonicalize().map_err(|e| e.to_string())?;
    if !dir.starts_with(root) {
        return Err(format!("{} is outside the LoRA root", dir.display()));
    }
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        if let Ok(c) = dir.join(f).canonicalize()
            && (!c.starts_with(root) || !c.is_file())
        {
            return Err(format!("{f} is outside the LoRA root or not a regular file"));
        }
    }
    Ok(dir)
}
