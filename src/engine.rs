//! The Engine handle: starts the actors (Scheduler, BlockManager, one ModelRunner per
//! device), then takes requests and hands back their event streams. Everything that
//! reaches the engine (HTTP, WebSocket, the `generate` CLI, benchmarks) goes through it.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context as TaskContext, Poll};

use actix::prelude::*;
use futures::Stream;
use tokio::sync::mpsc;

use crate::actors::block_manager::{BlockManager, BlockStats, GetBlockStats};
use crate::actors::lora_manager::{LoraLimits, LoraManager, LoraManagerError, Register, Resolve};
use crate::actors::model_runner::{
    AllocateCache, BatchSeq, CaptureGraphs, ExecuteBatch, ModelRunner, NewSeq, ReleaseCache, RunnerConfig,
    TuneGemms,
};
use crate::actors::scheduler::{
    Abort, AddRequest, AdmissionLimits, EndAll, GetStats, PreloadLoras, SchedulerActor, SchedulerStats,
    SetMaxWaiting,
};
use crate::config::{DeviceArg, EngineArgs, EngineConfig};
use crate::core::scheduler::SchedulerConfig;
pub use crate::error::EngineError;
use crate::kernels::cpu::CpuDevice;
use crate::kernels::cuda::CudaDevice;
use crate::kernels::{Device, GroupHealth};
use crate::metrics::Metrics;
use crate::models::config::ModelConfig;
use crate::models::registry::ModelRegistry;
use crate::models::{LoadOptions, LoraCapacity};
use crate::request::{AbortReason, SamplingParams, TokenEvent};
use crate::tokenizer::Tokenizer;

impl From<LoraManagerError> for EngineError {
    fn from(e: LoraManagerError) -> Self {
        match e {
            LoraManagerError::NotFound(n) => EngineError::LoraNotFound(n),
            other => EngineError::Lora(other.to_string()),
        }
    }
}

struct Inner {
    scheduler: Addr<SchedulerActor>,
    block_manager: Addr<BlockManager>,
    lora: Option<Addr<LoraManager>>,
    tokenizer: Arc<Tokenizer>,
    config: EngineConfig,
    model_config: ModelConfig,
    metrics: Arc<Metrics>,
    weight_bytes: usize,
    /// Of them, those one token's forward reads (all but the idle experts).
    active_weight_bytes: usize,
    next_id: std::sync::atomic::AtomicU64,
    /// Events each choice of a request may leave unread (see [`Engine::set_stream_backlog`]).
    stream_backlog: std::sync::atomic::AtomicUsize,
    /// Structured output's grammar compiler, built on the first constrained request.
    grammars: crate::structured::LazyGrammars,
    /// The tensor-parallel group's health, under tensor parallelism on the CPU.
    group: Option<Arc<dyn GroupHealth>>,
}

/// Events each choice may leave unread before its request is aborted, by default.
pub const DEFAULT_STREAM_BACKLOG: usize = 4096;

/// Cheap to clone; every clone talks to the same actors.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

/// Architectures that code outside the crate adds to the registry (vLLM's out-of-tree
/// `ModelRegistry.register_model`), for whichever device the engine runs on.
pub trait Architectures {
    fn register<D: Device>(registry: &mut ModelRegistry<D>);
}

/// The built-in architectures alone.
impl Architectures for () {
    fn register<D: Device>(_: &mut ModelRegistry<D>) {}
}

impl Engine {
    /// Loads the model and starts the actors. Must be called inside an actix System.
    /// `--device auto` takes the first CUDA GPU when one is present, else the CPU.
    pub async fn start(args: EngineArgs) -> Result<Engine, EngineError> {
        Self::start_with_architectures::<()>(args).await
    }

    /// As [`Engine::start`], with the architectures `A` registers beside the built-in ones
    /// (code outside the crate serving a model of its own, on the CPU or a GPU).
    pub async fn start_with_architectures<A: Architectures>(
        mut args: EngineArgs,
    ) -> Result<Engine, EngineError> {
        if on_gpu(&mut args)? {
            let tp = args.tensor_parallel_size;
            let mut registry = ModelRegistry::<CudaDevice>::default();
            A::register(&mut registry);
            let cluster = args.cluster.clone();
            if cluster.node_rank > 0 {
                return Err(headless(cluster.node_rank));
            }
            Self::start_on(args, registry, move |setup| {
                if cluster.nnodes == 1 {
                    return CudaDevice::group(tp).map_err(|e| EngineError::Device(e.to_string()));
                }
                let local = cluster.local_ranks(tp);
                CudaDevice::node_fits(local).map_err(|e| EngineError::Device(e.to_string()))?;
                // The other nodes join NCCL by node 0's id, which they get on joining.
                let nccl_id = CudaDevice::nccl_id().map_err(|e| EngineError::Device(e.to_string()))?;
                let welcome = crate::cluster::lead::Welcome { nccl_id: Some(nccl_id.clone()) };
                let lead = crate::cluster::lead::Lead::accept(&cluster, setup, &welcome, true)
                    .map_err(EngineError::Cluster)?;
                tracing::info!(ranks = local, world = tp, "joining the NCCL group of every node's GPUs");
                let devs = CudaDevice::node_group(0, local, tp, &nccl_id)
                    .map_err(|e| EngineError::Device(e.to_string()))?;
                Ok(devs
                    .into_iter()
                    .enumerate()
                    .map(|(i, d)| {
                        let remote = (i == 0).then(|| lead.clone() as Arc<dyn crate::kernels::RemoteRanks>);
                        d.in_node_group(lead.clone(), remote)
                    })
                    .collect())
            })
            .await
        } else {
            let mut registry = ModelRegistry::<CpuDevice>::default();
            A::register(&mut registry);
            Self::start_with(args, registry).await
        }
    }

    /// As [`Engine::start`] on the CPU, with a registry that may hold out-of-tree
    /// architectures.
    pub async fn start_with(
        args: EngineArgs,
        registry: ModelRegistry<CpuDevice>,
    ) -> Result<Engine, EngineError> {
        let tp = args.tensor_parallel_size;
        let cluster = args.cluster.clone();
        cluster.check(tp, true).map_err(EngineError::Cluster)?;
        if cluster.node_rank > 0 {
            return Err(headless(cluster.node_rank));
        }
        let family = crate::kernels::cpu::family::choose(args.cpu_kernels).map_err(EngineError::Device)?;
        tracing::info!(family = family.name(), threads = rayon::current_num_threads(), "CPU kernels");
        Self::start_on(args, registry, move |setup| {
            if cluster.nnodes > 1 {
                let welcome = crate::cluster::lead::Welcome::default();
                let lead = crate::cluster::lead::Lead::accept(&cluster, setup, &welcome, false)
                    .map_err(EngineError::Cluster)?;
                return Ok(vec![CpuDevice::in_group(0, lead.clone(), Some(lead)).with_family(family)]);
            }
            let ranks = CpuDevice::group_with_timeout(tp, cluster.timeout());
            Ok(ranks.into_iter().map(|d| d.with_family(family)).collect())
        })
        .await
    }

    /// Starts the actors with one ModelRunner per device that `make` opens: one device, or
    /// the ranks of a tensor-parallel group in rank order. Each rank loads its shard of the
    /// weights on a thread of its own.
    pub async fn start_on<D: Device>(
        mut args: EngineArgs,
        registry: ModelRegistry<D>,
        make: impl FnOnce(&crate::cluster::GroupSetup) -> Result<Vec<D>, EngineError> + Send + 'static,
    ) -> Result<Engine, EngineError> {
        let (model_config, mut config) = resolve_model(&mut args, &registry)?;
        config.sampling_defaults = sampling_defaults(&args)?;
        let mut tokenizer = Tokenizer::load(&config.model_dir, &model_config.eos_token_ids)?;
        if let Some(t) = &args.chat_template {
            tokenizer.set_chat_template(chat_template_arg(t)?);
        }
        let tokenizer = Arc::new(tokenizer);
        let (dir, dtype) = (config.model_dir.clone(), config.dtype);
        let opts = load_options(&args, &model_config, &config);
        let setup = crate::cluster::GroupSetup::of(&args, &model_config, &config);
        let started = std::time::Instant::now();
        let ranks = actix_rt::task::spawn_blocking(move || -> Result<_, EngineError> {
            let devs = make(&setup)?;
            tracing::info!(seconds = started.elapsed().as_secs_f32(), "devices open");
            let (registry, dir) = (&registry, &dir);
            std::thread::scope(|s| {
                let loads: Vec<_> = devs
                    .into_iter()
                    .map(|dev| {
                        s.spawn(move || -> Result<_, EngineError> {
                            let loaded = registry.load(&dev, dir, dtype, &opts)?;
                            Ok((dev, loaded.model, loaded.kv_scales))
                        })
                    })
                    .collect();
                let ranks = loads
                    .into_iter()
                    .map(|h| {
                        h.join()
                            .map_err(|_| EngineError::Device("a rank's loading thread panicked".into()))?
                    })
                    .collect::<Result<Vec<(D, _, _)>, _>>()?;
                if let Some(r) = ranks[0].0.remote_ranks() {
                    // The other nodes answer once their weights are loaded.
                    r.join_step().map_err(|e| EngineError::Cluster(e.to_string()))?;
                }
                Ok(ranks)
            })
        })
        .await
        .map_err(|e| EngineError::Device(format!("model loading thread: {e}")))??;
        // Every rank read the same scales.
        let kv_scales = kv_scales_for(config.kv_cache_dtype, ranks[0].2.clone(), config.calculate_kv_scales);
        let ranks: Vec<(D, _)> = ranks.into_iter().map(|(dev, model, _)| (dev, model)).collect();
        // The ranks on other nodes, which size and allocate their caches as node 0 has them.
        let remote = ranks[0].0.remote_ranks();
        // On a GPU the KV cache takes what --gpu-memory-utilization leaves after the weights
        // and a profiling step at the largest batch (see `size_kv_cache`).
        let profile = ranks[0].0.memory_info().is_some() && args.num_gpu_blocks_override.is_none();
        let elem_bytes = ranks[0].0.kv_cache_elem_bytes(config.kv_cache_dtype);
        tracing::info!(seconds = started.elapsed().as_secs_f32(), "weights loaded");
        let weight_bytes = ranks.iter().map(|(_, m)| m.weight_bytes()).sum();
        let active_weight_bytes = ranks.iter().map(|(_, m)| m.active_weight_bytes()).sum();
        let prefix_caching =
            !args.no_enable_prefix_caching && ranks.iter().all(|(_, m)| m.prefix_cacheable());
        if !args.no_enable_prefix_caching && !prefix_caching {
            tracing::info!(
                "prefix caching off: this model's rotary embedding changes with the sequence's length"
            );
        }
        let dev_name = ranks[0].0.name();
        let group = ranks[0].0.group_health();
        // A GPU's count comes with `profiled the largest batch`, below.
        let kv_blocks = if profile { "after profiling".to_string() } else { config.num_blocks.to_string() };
        tracing::info!(
            model = %config.model_dir.display(),
            dtype = ?config.dtype,
            weights_mib = weight_bytes >> 20,
            kv_blocks = %kv_blocks,
            kv_cache_dtype = ?config.kv_cache_dtype,
            block_size = config.block_size,
            max_model_len = config.max_model_len,
            tensor_parallel_size = ranks.len(),
            "model loaded on {dev_name}",
        );
        let eos: Arc<[u32]> = tokenizer.eos_ids.clone().into();
        let (profile_step, profile_blocks) = profile_batch(&config);
        let num_blocks = if profile { profile_blocks } else { config.num_blocks };
        let runner_cfg = RunnerConfig {
            num_blocks,
            block_size: config.block_size,
            kv_dtype: config.kv_cache_dtype,
            kv_scales,
            calculate_kv_scales: config.calculate_kv_scales,
        };
        let mut runners = ranks
            .into_iter()
            .map(|(dev, model)| ModelRunner::new(dev, model, runner_cfg.clone(), eos.clone()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| EngineError::Device(e.to_string()))?;
        let peers: Vec<_> = runners.split_off(1).into_iter().map(start_runner).collect();
        let runner_addr = start_runner(runners.remove(0).with_peers(peers.clone()));
        // Decode steps replay CUDA graphs: one per batch size (see `graph_shapes`) and
        // context bound (powers of two from 512 up to --max-model-len).
        let graphs = (!args.enforce_eager).then(|| graph_shapes(config.max_num_seqs, config.max_model_len));
        if profile {
            let all: Vec<_> = std::iter::once(runner_addr.clone()).chain(peers).collect();
            let kv = KvSizing { model: &model_config, elem_bytes, utilization: args.gpu_memory_utilization };
            size_kv_cache(&all, remote.as_deref(), profile_step, graphs.clone(), &mut config, kv).await?;
        }
        tracing::info!(seconds = started.elapsed().as_secs_f32(), "KV cache allocated");
        if let Some(shapes) = graphs {
            let t = std::time::Instant::now();
            // A capture that fails leaves the engine eager, as with --enforce-eager.
            match runner_addr.send(shapes).await.map_err(|_| EngineError::Stopped)? {
                Ok(0) => {}
                Ok(n) => {
                    tracing::info!(graphs = n, seconds = t.elapsed().as_secs_f32(), "CUDA graphs captured")
                }
                Err(e) => tracing::warn!(error = %e, "CUDA graphs not captured: every step runs eagerly"),
            }
        }
        let block_manager = BlockManager::new(config.num_blocks, config.block_size).start();
        let metrics = Arc::new(match args.seed {
            Some(seed) => Metrics::default().with_seed(seed),
            None => Metrics::default(),
        });
        let sched_cfg = SchedulerConfig {
            max_num_seqs: config.max_num_seqs,
            max_num_batched_tokens: config.max_num_batched_tokens,
            block_size: config.block_size,
            num_blocks: config.num_blocks,
            max_loras: config.lora.as_ref().map_or(0, |l| l.max_loras),
            prefix_caching,
            priority: config.scheduling_policy == crate::config::SchedulingPolicy::Priority,
        };
        let limits = AdmissionLimits {
            max_model_len: config.max_model_len,
            vocab_size: model_config.vocab_size,
            max_waiting: None,
        };
        let scheduler = SchedulerActor::new(
            sched_cfg,
            block_manager.clone().recipient(),
            runner_addr.recipient(),
            tokenizer.clone(),
            limits,
            metrics.clone(),
        )
        .with_async_scheduling(args.async_scheduling)
        .with_request_log(config.log_requests)
        .start();
        let lora = match &config.lora {
            None => None,
            Some(l) => {
                let limits = LoraLimits { max_rank: l.max_rank, max_cpu_loras: l.max_cpu_loras };
                let manager = LoraManager::new(Arc::new(model_config.clone()), limits).start();
                for (name, path) in &l.modules {
                    let reg = Register { name: name.clone(), path: path.clone(), root: None };
                    manager.send(reg).await.map_err(|_| EngineError::Stopped)?.map_err(|e| {
                        EngineError::Lora(format!("--lora-modules {name}={}: {e}", path.display()))
                    })?;
                }
                // The first --max-loras of them go to the device now, so that neither the
                // first request on each nor a step waits for its weights.
                let mut adapters = Vec::new();
                for (name, _) in l.modules.iter().take(l.max_loras) {
                    let resolve = Resolve { name: name.clone() };
                    adapters.push(manager.send(resolve).await.map_err(|_| EngineError::Stopped)??);
                }
                let loaded =
                    scheduler.send(PreloadLoras(adapters)).await.map_err(|_| EngineError::Stopped)??;
                if loaded > 0 {
                    tracing::info!(adapters = loaded, "LoRA adapters placed on the device");
                }
                Some(manager)
            }
        };
        let engine = Engine {
            inner: Arc::new(Inner {
                scheduler,
                block_manager,
                lora,
                tokenizer,
                config,
                model_config,
                metrics,
                weight_bytes,
                active_weight_bytes,
                next_id: std::sync::atomic::AtomicU64::new(0),
                stream_backlog: std::sync::atomic::AtomicUsize::new(DEFAULT_STREAM_BACKLOG),
                grammars: Default::default(),
                group,
            }),
        };
        if !args.disable_log_stats {
            spawn_stats_log(&engine);
        }
        Ok(engine)
    }

    /// Why the engine can no longer run steps, once a rank of its tensor-parallel group is
    /// lost (failed, stopped, or too slow to reach a collective): it stays so until
    /// restarted.
    pub fn failure(&self) -> Option<String> {
        self.inner.group.as_ref().and_then(|g| g.failure())
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.inner.tokenizer
    }

    /// Compiles a structured-output grammar against the model's vocabulary; the error
    /// names what is wrong with it. A grammar held back by reasoning waits for the end of
    /// the `<think>` block when the model's vocabulary has it as one token.
    pub fn compile_guide(
        &self,
        spec: crate::structured::GuideSpec,
    ) -> Result<crate::structured::Guide, String> {
        let grammars = self.inner.grammars.get(&self.inner.tokenizer, self.inner.model_config.vocab_size)?;
        let guide = grammars.compile(spec)?;
        let end = self.inner.config.reasoning_parser.and_then(|_| {
            let ids = self.inner.tokenizer.encode(crate::structured::reasoning::THINK_END, false).ok()?;
            (ids.len() == 1).then(|| ids[0])
        });
        Ok(guide.held_until(end))
    }

    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    pub fn model_config(&self) -> &ModelConfig {
        &self.inner.model_config
    }

    /// The LoRAManager, when the engine serves adapters.
    pub fn lora_manager(&self) -> Option<&Addr<LoraManager>> {
        self.inner.lora.as_ref()
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.metrics
    }

    pub fn weight_bytes(&self) -> usize {
        self.inner.weight_bytes
    }

    /// Bytes of weights one token's forward reads: [`Self::weight_bytes`] but for the
    /// experts of a mixture-of-experts model that it does not take.
    pub fn active_weight_bytes(&self) -> usize {
        self.inner.active_weight_bytes
    }

    /// A fresh request id (`cmpl-<n>`), unique within this engine.
    pub fn next_request_id(&self, prefix: &str) -> String {
        let n = self.inner.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format!("{prefix}-{n:x}")
    }

    /// Submits a request; its events arrive on the returned stream. Dropping the stream
    /// before it ends aborts the request.
    pub async fn add_request(
        &self,
        id: String,
        prompt_ids: Vec<u32>,
        params: SamplingParams,
    ) -> Result<RequestStream, EngineError> {
        self.add_request_with_lora(id, prompt_ids, params, None).await
    }

    /// As [`Engine::add_request`], on the named LoRA adapter (None = the base model).
    pub async fn add_request_with_lora(
        &self,
        id: String,
        prompt_ids: Vec<u32>,
        params: SamplingParams,
        lora: Option<&str>,
    ) -> Result<RequestStream, EngineError> {
        params.validate()?;
        let lora = match (lora, &self.inner.lora) {
            (None, _) => None,
            (Some(name), None) => return Err(EngineError::LoraNotFound(name.to_string())),
            (Some(name), Some(m)) => {
                Some(m.send(Resolve { name: name.to_string() }).await.map_err(|_| EngineError::Stopped)??)
            }
        };
        // Each step sends a choice at most one token (and once its end); one place more is
        // kept for the event that ends the request, so that a client that stops reading
        // still learns why its stream ended.
        let backlog = self.inner.stream_backlog.load(std::sync::atomic::Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(params.n.max(1) * (backlog + 1) + 1);
        let id: Arc<str> = id.into();
        let msg = AddRequest { id: id.clone(), prompt_ids, params: Arc::new(params), events: tx, lora };
        self.inner.scheduler.send(msg).await.map_err(|_| EngineError::Stopped)??;
        Ok(RequestStream { id, rx, scheduler: self.inner.scheduler.clone(), ended: false })
    }

    /// Bounds the sequences that may wait to be scheduled (None: no bound); past it new
    /// requests get [`EngineError::QueueFull`].
    /// Takes effect before any request submitted after the call.
    pub fn set_max_waiting(&self, limit: Option<usize>) {
        self.inner.scheduler.do_send(SetMaxWaiting(limit));
    }

    /// Bounds the events each choice of a request may leave unread (at least 1). A request
    /// whose client falls further behind is aborted with an error event, so that a client
    /// that stops reading holds neither memory nor KV blocks. Takes effect for requests
    /// submitted after the call.
    pub fn set_stream_backlog(&self, events: usize) {
        self.inner.stream_backlog.store(events.max(1), std::sync::atomic::Ordering::Relaxed);
    }

    /// Ends every live request with an error event carrying `message`.
    pub async fn end_all(&self, message: &str) -> Result<(), EngineError> {
        self.inner.scheduler.send(EndAll(message.to_string())).await.map_err(|_| EngineError::Stopped)
    }

    /// Aborts a live request; returns whether it was live.
    pub async fn abort(&self, id: &str, reason: AbortReason) -> bool {
        self.inner.scheduler.send(Abort { id: id.into(), reason }).await.unwrap_or(false)
    }

    pub async fn stats(&self) -> Result<(SchedulerStats, BlockStats), EngineError> {
        let s = self.inner.scheduler.send(GetStats).await.map_err(|_| EngineError::Stopped)?;
        let b = self.inner.block_manager.send(GetBlockStats).await.map_err(|_| EngineError::Stopped)?;
        Ok((s, b))
    }
}

/// Logs vLLM's stats line (throughput, queue, KV cache usage, prefix-cache hits) every
/// `VLLM_LOG_STATS_INTERVAL` seconds (10 by default) while the engine is busy, until the
/// engine is dropped.
fn spawn_stats_log(engine: &Engine) {
    let seconds = std::env::var("VLLM_LOG_STATS_INTERVAL")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .unwrap_or(10.0);
    let every = std::time::Duration::from_secs_f64(seconds);
    let weak = Arc::downgrade(&engine.inner);
    actix_rt::spawn(async move {
        let mut before = match weak.upgrade() {
            Some(inner) => inner.metrics.totals(),
            None => return,
        };
        let mut at = std::time::Instant::now();
        loop {
            actix_rt::time::sleep(every).await;
            let Some(inner) = weak.upgrade() else { return };
            let engine = Engine { inner };
            let Ok((s, b)) = engine.stats().await else { return };
            let now = engine.inner.metrics.totals();
            let load =
                crate::metrics::Load { running: s.num_running, waiting: s.num_waiting, kv_usage: b.usage() };
            if let Some(line) = crate::metrics::stats_line(before, now, at.elapsed().as_secs_f64(), load) {
                tracing::info!("{line}");
            }
            (before, at) = (now, std::time::Instant::now());
        }
    });
}

/// The template `--chat-template` gives, as vLLM reads it: a path that exists is a file to
/// read, anything else the template itself.
/// Finds the model (importing a GGUF file, fetching from the hub's cache) and reads its
/// config, then the engine's settings from the flags and it. `args.model` becomes the
/// model's directory.
pub(crate) fn resolve_model<D: Device>(
    args: &mut EngineArgs,
    registry: &ModelRegistry<D>,
) -> Result<(ModelConfig, EngineConfig), EngineError> {
    import_if_gguf(args)?;
    let located = crate::hub::locate(&args.model, args.revision.as_deref(), args.download_dir.as_deref())?;
    if let Some(commit) = &located.commit {
        tracing::info!(model = %args.model.display(), commit, dir = %located.dir.display(), "model found in the Hugging Face cache");
    }
    args.model = located.dir;
    log_inapplicable(args);
    let model_config = registry.read_config(&args.model)?;
    crate::quantization::check_flag(&model_config.hf, args.quantization.as_deref())?;
    // A device that reports its memory (a GPU) sizes the KV cache from it after a
    // profiling step, and checks --max-model-len then.
    let sized_by_device = D::SIZES_KV_CACHE && args.num_gpu_blocks_override.is_none();
    let config = EngineConfig::resolve(args, &model_config, sized_by_device)?;
    Ok((model_config, config))
}

/// How each rank loads its weights, from the flags and the resolved settings.
pub(crate) fn load_options(args: &EngineArgs, model: &ModelConfig, config: &EngineConfig) -> LoadOptions {
    LoadOptions {
        lora: config.lora.as_ref().map(|l| LoraCapacity {
            slots: l.max_loras,
            max_rank: l.max_rank,
            bf16: l.bf16,
        }),
        dummy: args.load_format == crate::config::LoadFormat::Dummy,
        online_fp8: crate::quantization::online_fp8(&model.hf, args.quantization.as_deref()),
    }
}

/// The KV cache scales the runners take, logged: the checkpoint's where the cache is FP8
/// (scale 1 where it has none, as vLLM's), none else, nor where they are `calculated` from
/// the first keys and values (--calculate-kv-scales).
pub(crate) fn kv_scales_for(
    kv: crate::kernels::KvDtype,
    found: Option<(Vec<crate::kernels::KvScales>, usize)>,
    calculated: bool,
) -> Option<Arc<[crate::kernels::KvScales]>> {
    if calculated {
        tracing::info!(
            checkpoint_scales = found.map_or(0, |(_, n)| n),
            "FP8 KV cache: each layer's scales from the first keys and values it stores (--calculate-kv-scales)"
        );
        return None;
    }
    match (kv.fp8(), found) {
        (Some(_), Some((scales, n))) => {
            tracing::info!(
                scales = n,
                layers = scales.len(),
                "FP8 KV cache: the checkpoint's k_scale and v_scale"
            );
            Some(scales.into())
        }
        (Some(crate::kernels::Fp8Format::E4m3), None) => {
            tracing::warn!(
                "FP8 KV cache of scale 1: the checkpoint has no k_scale or v_scale; keys and values \
                 past ±448 saturate"
            );
            None
        }
        (Some(crate::kernels::Fp8Format::E5m2), None) => None,
        (None, Some((_, n))) => {
            tracing::info!(
                scales = n,
                "the checkpoint's KV cache scales are unused: --kv-cache-dtype fp8 stores the cache by them"
            );
            None
        }
        (None, None) => None,
    }
}

fn chat_template_arg(t: &str) -> Result<String, EngineError> {
    match std::fs::read_to_string(t) {
        Ok(text) => Ok(text),
        Err(_) if !std::path::Path::new(t).exists() => Ok(t.to_string()),
        Err(e) => Err(crate::config::ConfigError::ChatTemplate(format!("{t}: {e}")).into()),
    }
}

/// The sampling defaults `--generation-config` names: the model's generation_config.json
/// (`auto`; none when the file is absent), none (`vllm`), or a directory's.
fn sampling_defaults(args: &EngineArgs) -> Result<crate::request::SamplingDefaults, EngineError> {
    let dir = match args.generation_config.as_str() {
        "vllm" => return Ok(Default::default()),
        "auto" => args.model.clone(),
        other => std::path::PathBuf::from(other),
    };
    let path = dir.join("generation_config.json");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(_) if args.generation_config == "auto" => return Ok(Default::default()),
        Err(e) => {
            return Err(
                crate::config::ConfigError::GenerationConfig(format!("{}: {e}", path.display())).into()
            );
        }
    };
    let defaults = crate::request::SamplingDefaults::from_json(&text, &path.display().to_string())
        .map_err(crate::config::ConfigError::GenerationConfig)?;
    if !defaults.is_empty() {
        tracing::info!(
            ?defaults,
            "default sampling parameters come from the model's generation config (--generation-config vllm \
             keeps vLLM's)"
        );
    }
    Ok(defaults)
}

/// Checks `--quantization` and `--keep-quantized`, and turns a GGUF file given as `--model`
/// into the model directory it imports to (dequantized to f32, or to bf16 with a 16-bit
/// `--dtype`, but for the blocks `--keep-quantized` keeps; imported the first time only).
fn import_if_gguf(args: &mut EngineArgs) -> Result<(), EngineError> {
    use crate::gguf::import::{ImportDtype, ImportError, ImportOptions, imported, is_gguf_file};
    let gguf = is_gguf_file(&args.model);
    crate::quantization::check_arg(args.quantization.as_deref(), &args.model, gguf)?;
    if args.keep_quantized && !gguf {
        return Err(crate::quantization::QuantError::KeepNeedsGguf {
            model: args.model.display().to_string(),
        }
        .into());
    }
    if gguf {
        let root = crate::hub::import_cache(args.download_dir.as_deref());
        std::fs::create_dir_all(&root)
            .map_err(|source| ImportError::Write { path: root.display().to_string(), source })?;
        // As `import-gguf` does by default: dequantized blocks are exact in f32, not in bf16.
        let dtype = match args.dtype {
            crate::config::DTypeArg::Auto | crate::config::DTypeArg::Float32 => ImportDtype::F32,
            _ => ImportDtype::Bf16,
        };
        args.model =
            imported(&args.model, &root, ImportOptions { dtype, keep_quantized: args.keep_quantized })?;
    }
    Ok(())
}

/// One log line for each vLLM flag given that does less here than in vLLM.
fn log_inapplicable(args: &EngineArgs) {
    if args.trust_remote_code {
        tracing::info!(
            "--trust-remote-code: a checkpoint's own modeling code cannot run here (there is no Python); \
             the built-in architectures serve the model"
        );
    }
    if args.max_logprobs < 0 || args.max_logprobs > crate::request::MAX_LOGPROBS as i64 {
        tracing::info!(
            "--max-logprobs {}: this engine returns at most {} logprobs per token, the limit requests get",
            args.max_logprobs,
            crate::request::MAX_LOGPROBS
        );
    }
}

/// Whether `args` run on a GPU (`--device auto` takes one when present), with the GPU's
/// defaults applied to them and the settings a GPU does not take refused.
pub(crate) fn on_gpu(args: &mut EngineArgs) -> Result<bool, EngineError> {
    let cuda = match args.device {
        DeviceArg::Cpu => false,
        DeviceArg::Cuda => true,
        DeviceArg::Auto => CudaDevice::available(),
    };
    if cuda {
        if args.keep_quantized {
            return Err(crate::quantization::QuantError::KeepOnGpu.into());
        }
        if args.kv_cache_dtype == crate::kernels::KvDtype::Fp8E5m2 {
            return Err(crate::config::ConfigError::Fp8E5m2OnGpu.into());
        }
        if args.calculate_kv_scales {
            return Err(crate::config::ConfigError::CalculateKvScalesOnGpu.into());
        }
        args.gpu_batch_defaults(CudaDevice::large_gpu());
    }
    args.cluster.check(args.tensor_parallel_size, !cuda).map_err(EngineError::Cluster)?;
    Ok(cuda)
}

fn headless(node_rank: usize) -> EngineError {
    EngineError::Cluster(format!(
        "--node-rank {node_rank} runs headless: start it with `actorllm serve`, which then serves no API"
    ))
}

/// A step at the largest batch the scheduler may form: `max_num_batched_tokens` tokens
/// over `max_num_seqs` prefilling sequences, each sampling. Also the KV blocks it needs.
pub(crate) fn profile_batch(config: &EngineConfig) -> (ExecuteBatch, usize) {
    let seqs = config.max_num_seqs.min(config.max_num_batched_tokens).max(1);
    let tokens = config.max_num_batched_tokens.max(1);
    let params = Arc::new(SamplingParams { temperature: 0.0, ..Default::default() });
    let mut next_block = 0u32;
    let batch = (0..seqs)
        .map(|i| {
            let len = tokens / seqs + usize::from(i < tokens % seqs);
            let blocks = len.div_ceil(config.block_size) as u32;
            let block_table = (next_block..next_block + blocks).collect();
            next_block += blocks;
            BatchSeq {
                seq: i as u64,
                new: Some(NewSeq {
                    tokens: vec![0; len],
                    prompt_len: len,
                    params: params.clone(),
                    seed: 0,
                    index: 0,
                }),
                start: 0,
                len,
                sample: true,
                block_table,
                lora_slot: -1,
            }
        })
        .collect();
    (ExecuteBatch { seqs: batch, ..Default::default() }, next_block as usize)
}

/// The decode steps recorded as graphs. Batch sizes: powers of two up to 32, multiples of
/// 32 up to 256, then of 64, up to `max_seqs` (a step is padded to the next size, and
/// from a few dozen rows on a padded row costs about as much as a real one). Context
/// bounds: powers of two from 512 up to `max_len`.
fn graph_shapes(max_seqs: usize, max_len: usize) -> CaptureGraphs {
    let sizes = graph_sizes(max_seqs);
    let mut bounds: Vec<usize> = std::iter::successors(Some(512.min(max_len)), |&x| Some(x * 2))
        .take_while(|&x| x < max_len)
        .collect();
    bounds.push(max_len);
    CaptureGraphs { sizes, bounds }
}

/// The row counts GEMMs are tuned at: the graphs' batch sizes, then powers of two up to
/// --max-num-batched-tokens and that itself (a GEMM takes the choice of the next count up).
fn gemm_tune_rows(seqs: usize, tokens: usize) -> Vec<usize> {
    let mut rows = graph_sizes(seqs);
    rows.extend(
        std::iter::successors(Some(seqs.next_power_of_two()), |&r| Some(r * 2)).take_while(|&r| r < tokens),
    );
    rows.push(tokens);
    rows.sort_unstable();
    rows.dedup();
    rows
}

/// Each rank times the GEMMs the profiling step ran (see `Device::tune_gemms`).
async fn tune_gemms<D: Device>(
    runners: &[Addr<ModelRunner<D>>],
    config: &EngineConfig,
) -> Result<(), EngineError> {
    let t = std::time::Instant::now();
    let rows = gemm_tune_rows(config.max_num_seqs, config.max_num_batched_tokens);
    let asked = runners.iter().map(|r| r.send(TuneGemms { rows: rows.clone() }));
    let mut tuned = Vec::new();
    for answer in futures::future::join_all(asked).await {
        let answer = answer.map_err(|_| EngineError::Stopped)?;
        tuned.push(answer.map_err(|e| EngineError::Device(format!("tuning GEMMs: {e}")))?);
    }
    let g = &tuned[0];
    if g.points > 0 {
        tracing::info!(
            seconds = t.elapsed().as_secs_f32(),
            points = g.points,
            cublaslt_chosen = g.lt_chosen,
            candidates = g.candidates,
            rejected = g.rejected,
            gain_pct = format!("{:.1}", 100.0 * (1.0 - g.chosen_us / g.gemm_ex_us)),
            "GEMMs tuned (shape and row-count points; GPU time saved against cublasGemmEx's picks)"
        );
    }
    if g.skipped > 0 {
        tracing::warn!(points = g.skipped, "GEMMs left untuned for want of device memory");
    }
    Ok(())
}

/// `graph_shapes`' batch sizes.
fn graph_sizes(max_seqs: usize) -> Vec<usize> {
    let mut sizes: Vec<usize> = std::iter::successors(Some(1), |&x| {
        Some(match x {
            ..32 => x * 2,
            32..256 => x + 32,
            _ => x + 64,
        })
    })
    .take_while(|&x| x < max_seqs)
    .collect();
    sizes.push(max_seqs);
    sizes
}

/// What the KV cache is sized from.
struct KvSizing<'a> {
    model: &'a ModelConfig,
    /// Bytes per cached K or V element.
    elem_bytes: usize,
    utilization: f64,
}

/// vLLM's memory profiling: runs `step` (the largest batch) on every rank, so that the
/// activation buffers it needs stay in the device pools; then each rank drops its small
/// profiling cache, and the cache takes what `--gpu-memory-utilization` leaves on the
/// fullest rank (every rank holds the same number of blocks).
async fn size_kv_cache<D: Device>(
    runners: &[Addr<ModelRunner<D>>],
    remote: Option<&dyn crate::kernels::RemoteRanks>,
    step: ExecuteBatch,
    graphs: Option<CaptureGraphs>,
    config: &mut EngineConfig,
    kv: KvSizing<'_>,
) -> Result<(), EngineError> {
    use crate::cluster::{NodeAnswer, NodeCommand};
    let profiled = |e: String| EngineError::Device(format!("profiling step at the largest batch: {e}"));
    let on_nodes = |c: NodeCommand| -> Result<Vec<NodeAnswer>, EngineError> {
        remote.map_or(Ok(Vec::new()), |r| crate::cluster::command(r, &c).map_err(EngineError::Cluster))
    };
    runners[0].send(step).await.map_err(|e| profiled(e.to_string()))?.map_err(|e| profiled(e.to_string()))?;
    tune_gemms(runners, config).await?;
    on_nodes(NodeCommand::TuneGemms {
        rows: gemm_tune_rows(config.max_num_seqs, config.max_num_batched_tokens),
    })?;
    // The graphs too: their memory stays out of the cache (they are recorded again on it).
    // A failed capture is reported when they are recorded for good, unless it left the
    // device failing.
    let mut capture = None;
    if let Some(shapes) = graphs {
        capture = runners[0].send(shapes).await.map_err(|e| profiled(e.to_string()))?.err();
    }
    let mut memories = Vec::new();
    for r in runners {
        let released = r.send(ReleaseCache).await.map_err(|_| EngineError::Stopped)?;
        memories.push(released.map_err(|e| {
            let after =
                capture.as_ref().map_or(String::new(), |c| format!(" (a graph capture had failed: {c})"));
            EngineError::Device(format!("after the profiling step: {e}{after}"))
        })?);
    }
    for answer in on_nodes(NodeCommand::ReleaseCache)? {
        match answer {
            NodeAnswer::Memory(m) => memories.extend(m),
            other => return Err(EngineError::Cluster(format!("a node answered {other:?} to ReleaseCache"))),
        }
    }
    // The cache takes what the fullest GPU of the group leaves.
    let (mut left, mut memory) = (usize::MAX, (0, 0));
    for (free, total) in memories.into_iter().map(|m| m.unwrap_or((0, 0))) {
        let keep = ((1.0 - kv.utilization) * total as f64) as usize;
        if free.saturating_sub(keep) < left {
            (left, memory) = (free.saturating_sub(keep), (free, total));
        }
    }
    config.resize_kv(kv.model, left, kv.elem_bytes).map_err(|e| {
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        EngineError::Device(format!(
            "{e} ({:.2} GiB of {:.2} GiB free after the weights and the profiling step, {:.2} GiB of it \
             left out by --gpu-memory-utilization {})",
            gib(memory.0),
            gib(memory.1),
            gib(memory.1) * (1.0 - kv.utilization),
            kv.utilization
        ))
    })?;
    tracing::info!(cache_mib = left >> 20, kv_blocks = config.num_blocks, "profiled the largest batch");
    for r in runners {
        let alloc = AllocateCache { num_blocks: config.num_blocks };
        r.send(alloc)
            .await
            .map_err(|_| EngineError::Stopped)?
            .map_err(|e| EngineError::Device(e.to_string()))?;
    }
    on_nodes(NodeCommand::AllocateCache { num_blocks: config.num_blocks })?;
    Ok(())
}

/// Starts a runner on a thread of its own: a SyncArbiter with one thread calls the factory
/// once, and the runner moves into it.
fn start_runner<D: Device>(runner: ModelRunner<D>) -> Addr<ModelRunner<D>> {
    let slot = Mutex::new(Some(runner));
    SyncArbiter::start(1, move || {
        slot.lock().ok().and_then(|mut s| s.take()).expect("the one runner thread builds its actor once")
    })
}

/// The events of one request. Dropping it before `Done` aborts the request in the engine.
pub struct RequestStream {
    id: Arc<str>,
    rx: mpsc::Receiver<TokenEvent>,
    scheduler: Addr<SchedulerActor>,
    ended: bool,
}

impl RequestStream {
    pub fn id(&self) -> &str {
        &self.id
    }
}

impl Stream for RequestStream {
    type Item = TokenEvent;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<TokenEvent>> {
        let ev = self.rx.poll_recv(cx);
        if let Poll::Ready(Some(TokenEvent::Done { .. } | TokenEvent::Error { .. }) | None) = &ev {
            self.ended = true;
        }
        ev
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.ended {
            self.scheduler.do_send(Abort { id: self.id.clone(), reason: AbortReason::ClientGone });
        }
    }
}

#[cfg(test)]
mod tests {
    /// A decode step is padded to the next graph: by at most 31 rows up to 256 and 63
    /// beyond, never past --max-num-seqs; bounds double from 512 to --max-model-len.
    #[test]
    fn graph_sizes_pad_a_step_by_little() {
        let g = super::graph_shapes(1024, 8192);
        assert_eq!(&g.sizes[..8], &[1, 2, 4, 8, 16, 32, 64, 96]);
        assert_eq!(g.sizes.last(), Some(&1024));
        assert!(g.sizes.windows(2).all(|w| w[1] - w[0] <= if w[1] <= 256 { 32 } else { 64 }));
        assert_eq!(g.bounds, [512, 1024, 2048, 4096, 8192]);
        let small = super::graph_shapes(100, 300);
        assert_eq!(small.sizes, [1, 2, 4, 8, 16, 32, 64, 96, 100]);
        assert_eq!(small.bounds, [300]);
    }

    /// GEMMs are tuned at every graph size, then at powers of two up to the largest step
    /// and at that step itself, so that a prefill of any size finds a tuned count above it.
    #[test]
    fn gemms_are_tuned_from_the_graphs_to_the_largest_step() {
        let rows = super::gemm_tune_rows(1024, 16384);
        assert_eq!(&rows[rows.len() - 5..], &[1024, 2048, 4096, 8192, 16384]);
        assert!(super::graph_sizes(1024).iter().all(|s| rows.contains(s)));
        assert_eq!(super::gemm_tune_rows(256, 10000)[12..], [256, 512, 1024, 2048, 4096, 8192, 10000]);
        assert_eq!(super::gemm_tune_rows(100, 100), super::graph_sizes(100));
    }
}
