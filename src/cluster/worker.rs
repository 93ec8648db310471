//! A node other than node 0 (`--node-rank` 1..): it serves no API. It resolves the model
//! as node 0 does, joins node 0 (which compares their settings), loads its ranks' shares of
//! the weights (one rank on the CPU; one per local GPU, joined to the group's NCCL
//! communicator), then runs each step and command node 0 sends until node 0 goes away.

use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc;

use super::lead::Follower;
use super::{ClusterArgs, GroupSetup, NodeAnswer, NodeCommand, NodeMessage};
use crate::actors::model_runner::{ModelRunner, RunnerConfig, RunnerError, ShardStep, WireLora};
use crate::config::{EngineArgs, EngineConfig};
use crate::engine::{kv_scales_for, load_options, on_gpu, profile_batch, resolve_model};
use crate::error::EngineError;
use crate::kernels::Device;
use crate::kernels::cpu::CpuDevice;
use crate::kernels::cuda::CudaDevice;
use crate::models::config::ModelConfig;
use crate::models::lora::{LoraAdapter, load_peft};
use crate::models::registry::ModelRegistry;

/// Runs this node until node 0 ends the group: always an error that says why (node 0 has
/// closed the connection, or a step failed), since a node cannot go on alone.
pub fn run(mut args: EngineArgs) -> Result<(), EngineError> {
    if on_gpu(&mut args)? { run_on::<CudaDevice>(args) } else { run_on::<CpuDevice>(args) }
}

fn stop(e: String) -> EngineError {
    EngineError::Cluster(format!("this node stops: {e}"))
}

fn run_on<D: NodeDevice>(mut args: EngineArgs) -> Result<(), EngineError> {
    let cluster = args.cluster.clone();
    let registry = ModelRegistry::<D>::default();
    let (model_config, config) = resolve_model(&mut args, &registry)?;
    let setup = GroupSetup::of(&args, &model_config, &config);
    D::fits(&args, &cluster)?;
    tracing::info!(node = cluster.node_rank, master = %format!("{}:{}", cluster.master_addr, cluster.master_port), "joining node 0");
    let (link, welcome) = Follower::join(&cluster, &setup).map_err(EngineError::Cluster)?;
    let link = Arc::new(link);
    link.watch().map_err(EngineError::Cluster)?;
    let devs = D::open_ranks(&args, &cluster, &link, welcome.nccl_id);
    let runners = devs.and_then(|devs| {
        tracing::info!(node = cluster.node_rank, ranks = devs.len(), "joined: loading this node's weights");
        load_ranks(devs, &registry, &args, &model_config, &config)
    });
    // Node 0 waits for every node's weights (or its error) before it serves.
    link.done(runners.as_ref().map(|_| ()).map_err(ToString::to_string)).map_err(stop)?;
    let runners = runners?;
    tracing::info!(node = cluster.node_rank, "ready: taking steps from node 0");
    let max_rank = config.lora.as_ref().map_or(0, |l| l.max_rank);
    // Adapters are read again from their path when a step places them in a slot: node 0
    // does so only when a slot's adapter changes.
    let adapter = |w: &WireLora| -> Result<Arc<LoraAdapter>, RunnerError> {
        load_peft(&w.path, &w.name, w.id, &model_config, max_rank)
            .map(Arc::new)
            .map_err(|e| RunnerError::Device(format!("LoRA adapter {} at {}: {e}", w.name, w.path.display())))
    };
    let ranks = LocalRanks::start(runners).map_err(stop)?;
    loop {
        match link.next().map_err(stop)? {
            NodeMessage::Step(bytes) => {
                let outcome =
                    ShardStep::decode(&bytes, adapter).map_err(|e| e.to_string()).and_then(|s| ranks.step(s));
                let failed = outcome.as_ref().err().cloned();
                link.done(outcome).map_err(stop)?;
                if let Some(e) = failed {
                    return Err(stop(format!("a step failed here: {e}")));
                }
            }
            NodeMessage::Command(command) => {
                let outcome = ranks.command(command);
                let failed = outcome.as_ref().err().cloned();
                link.answer(outcome).map_err(stop)?;
                if let Some(e) = failed {
                    return Err(stop(format!("a command failed here: {e}")));
                }
            }
        }
    }
}

/// A device a node's ranks run on.
trait NodeDevice: Device + Sized {
    /// Whether it is a GPU, whose group joins NCCL by node 0's id.
    const GPU: bool;
    /// Whether this machine can run the node's ranks, checked before it joins node 0.
    fn fits(args: &EngineArgs, cluster: &ClusterArgs) -> Result<(), EngineError>;
    /// This node's ranks: on the CPU one, whose collectives go to node 0 over `link`; on
    /// GPUs one per local GPU, joined to node 0's NCCL communicator by `nccl_id`.
    fn open_ranks(
        args: &EngineArgs,
        cluster: &ClusterArgs,
        link: &Arc<Follower>,
        nccl_id: Option<Vec<u8>>,
    ) -> Result<Vec<Self>, EngineError>;
}

fn same_device(node_0: &str, here: &str) -> EngineError {
    EngineError::Cluster(format!(
        "node 0 runs on {node_0} and this node on {here}: start every node with the same --device"
    ))
}

impl NodeDevice for CpuDevice {
    const GPU: bool = false;
    fn fits(args: &EngineArgs, _: &ClusterArgs) -> Result<(), EngineError> {
        crate::kernels::cpu::family::choose(args.cpu_kernels).map(drop).map_err(EngineError::Device)
    }
    fn open_ranks(
        args: &EngineArgs,
        cluster: &ClusterArgs,
        link: &Arc<Follower>,
        nccl_id: Option<Vec<u8>>,
    ) -> Result<Vec<Self>, EngineError> {
        if nccl_id.is_some() {
            return Err(same_device("GPUs", "the CPU"));
        }
        let family = crate::kernels::cpu::family::choose(args.cpu_kernels).map_err(EngineError::Device)?;
        tracing::info!(family = family.name(), "CPU kernels");
        Ok(vec![CpuDevice::in_group(cluster.node_rank, link.clone(), None).with_family(family)])
    }
}

impl NodeDevice for CudaDevice {
    const GPU: bool = true;
    fn fits(args: &EngineArgs, cluster: &ClusterArgs) -> Result<(), EngineError> {
        let local = cluster.local_ranks(args.tensor_parallel_size);
        CudaDevice::node_fits(local).map_err(|e| EngineError::Device(e.to_string()))
    }
    fn open_ranks(
        args: &EngineArgs,
        cluster: &ClusterArgs,
        link: &Arc<Follower>,
        nccl_id: Option<Vec<u8>>,
    ) -> Result<Vec<Self>, EngineError> {
        let Some(id) = nccl_id else { return Err(same_device("the CPU", "a GPU")) };
        let tp = args.tensor_parallel_size;
        let local = cluster.local_ranks(tp);
        let first = cluster.node_rank * local;
        tracing::info!(ranks = %format!("{first}..{}", first + local), world = tp, "joining the NCCL group");
        let devs =
            CudaDevice::node_group(first, local, tp, &id).map_err(|e| EngineError::Device(e.to_string()))?;
        Ok(devs.into_iter().map(|d| d.in_node_group(link.clone(), None)).collect())
    }
}

/// Loads each rank's weights (on a thread of its own) and makes its runner, with the cache
/// node 0 starts with: on GPUs the profiling step's, until node 0 sizes the cache.
fn load_ranks<D: NodeDevice>(
    devs: Vec<D>,
    registry: &ModelRegistry<D>,
    args: &EngineArgs,
    model_config: &ModelConfig,
    config: &EngineConfig,
) -> Result<Vec<ModelRunner<D>>, EngineError> {
    let opts = load_options(args, model_config, config);
    let num_blocks = if D::GPU && args.num_gpu_blocks_override.is_none() {
        profile_batch(config).1
    } else {
        config.num_blocks
    };
    let dir: &Path = &config.model_dir;
    std::thread::scope(|s| {
        let loads: Vec<_> = devs
            .into_iter()
            .map(|dev| {
                let opts = &opts;
                s.spawn(move || -> Result<ModelRunner<D>, EngineError> {
                    let loaded = registry.load(&dev, dir, config.dtype, opts)?;
                    let runner_cfg = RunnerConfig {
                        num_blocks,
                        block_size: config.block_size,
                        kv_dtype: config.kv_cache_dtype,
                        kv_scales: kv_scales_for(
                            config.kv_cache_dtype,
                            loaded.kv_scales,
                            config.calculate_kv_scales,
                        ),
                        calculate_kv_scales: config.calculate_kv_scales,
                    };
                    ModelRunner::new(dev, loaded.model, runner_cfg, Arc::from(Vec::new()))
                        .map_err(|e| EngineError::Device(e.to_string()))
                })
            })
            .collect();
        loads
            .into_iter()
            .map(|h| h.join().map_err(|_| EngineError::Device("a rank's loading thread panicked".into()))?)
            .collect()
    })
}

/// What a local rank's thread is asked to do.
enum Job {
    Step(ShardStep),
    Command(NodeCommand),
}

/// A rank's outcome: on [`NodeCommand::ReleaseCache`], its memory.
type Outcome = Result<Option<(usize, usize)>, String>;

/// This node's ranks, each on a thread of its own (a GPU rank waits in NCCL for the others,
/// so that they must run side by side), in rank order.
struct LocalRanks {
    ranks: Vec<(mpsc::Sender<Arc<Job>>, mpsc::Receiver<Outcome>)>,
}

impl LocalRanks {
    fn start<D: Device>(runners: Vec<ModelRunner<D>>) -> Result<Self, String> {
        let ranks = runners
            .into_iter()
            .enumerate()
            .map(|(i, mut runner)| {
                let (jobs, take) = mpsc::channel::<Arc<Job>>();
                let (give, outcomes) = mpsc::channel();
                std::thread::Builder::new()
                    .name(format!("node-rank-{i}"))
                    .spawn(move || {
                        while let Ok(job) = take.recv() {
                            let outcome = run_job(&mut runner, &job);
                            if give.send(outcome).is_err() {
                                return;
                            }
                        }
                    })
                    .map(|_| (jobs, outcomes))
                    .map_err(|e| format!("a rank's thread: {e}"))
            })
            .collect::<Result<_, _>>()?;
        Ok(LocalRanks { ranks })
    }

    /// Has every rank run `job`; each rank's outcome, in rank order.
    fn all(&self, job: Job) -> Result<Vec<Option<(usize, usize)>>, String> {
        let job = Arc::new(job);
        for (i, (jobs, _)) in self.ranks.iter().enumerate() {
            jobs.send(job.clone()).map_err(|_| format!("local rank {i} has stopped"))?;
        }
        // Every rank is waited for, so that none is left inside the job; the first error
        // is the answer.
        let outcomes: Vec<Outcome> = self
            .ranks
            .iter()
            .enumerate()
            .map(|(i, (_, outcomes))| outcomes.recv().map_err(|_| format!("local rank {i} has stopped"))?)
            .collect();
        outcomes.into_iter().collect()
    }

    fn step(&self, step: ShardStep) -> Result<(), String> {
        self.all(Job::Step(step)).map(drop)
    }

    fn command(&self, command: NodeCommand) -> Result<NodeAnswer, String> {
        let release = command == NodeCommand::ReleaseCache;
        let memory = self.all(Job::Command(command))?;
        Ok(if release { NodeAnswer::Memory(memory) } else { NodeAnswer::Done })
    }
}

fn run_job<D: Device>(runner: &mut ModelRunner<D>, job: &Job) -> Outcome {
    let outcome = match job {
        Job::Step(step) => runner.run_shard(step).map(|()| None),
        Job::Command(NodeCommand::ReleaseCache) => runner.release_cache(),
        Job::Command(NodeCommand::AllocateCache { num_blocks }) => {
            runner.reallocate_cache(*num_blocks).map(|()| None)
        }
        Job::Command(NodeCommand::TuneGemms { rows }) => runner.tune_gemms(rows).map(|_| None),
    };
    outcome.map_err(|e| {
        let e = e.to_string();
        // Left part-way, the job leaves the group's other ranks waiting in a collective.
        runner.fail_group(&e);
        e
    })
}
