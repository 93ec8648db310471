//! A node other than node 0 (`--node-rank` 1..): it serves no API. It resolves the model
//! as node 0 does, joins node 0 (which compares their settings), loads its rank's share of
//! the weights, then runs each step node 0 sends until node 0 goes away.

use std::sync::Arc;

use super::GroupSetup;
use super::lead::Follower;
use crate::actors::model_runner::{ModelRunner, RunnerConfig, RunnerError, ShardStep, WireLora};
use crate::config::EngineArgs;
use crate::engine::{kv_scales_for, load_options, resolve_model};
use crate::error::EngineError;
use crate::kernels::cpu::CpuDevice;
use crate::models::lora::{LoraAdapter, load_peft};
use crate::models::registry::ModelRegistry;

/// Runs this node until node 0 ends the group: always an error that says why (node 0 has
/// closed the connection, or a step failed), since a node cannot go on alone.
pub fn run(mut args: EngineArgs) -> Result<(), EngineError> {
    let cluster = args.cluster.clone();
    cluster.check(args.tensor_parallel_size, true).map_err(EngineError::Cluster)?;
    let registry = ModelRegistry::<CpuDevice>::default();
    let (model_config, config) = resolve_model(&mut args, &registry)?;
    let setup = GroupSetup::of(&args, &model_config, &config);
    let family = crate::kernels::cpu::family::choose(args.cpu_kernels).map_err(EngineError::Device)?;
    tracing::info!(node = cluster.node_rank, master = %format!("{}:{}", cluster.master_addr, cluster.master_port), "joining node 0");
    let link = Arc::new(Follower::join(&cluster, &setup).map_err(EngineError::Cluster)?);
    tracing::info!(node = cluster.node_rank, family = family.name(), "joined: loading this rank's weights");
    let dev = CpuDevice::in_group(cluster.node_rank, link.clone(), None).with_family(family);
    let opts = load_options(&args, &model_config, &config);
    let runner = registry
        .load(&dev, &config.model_dir, config.dtype, &opts)
        .map_err(EngineError::from)
        .and_then(|loaded| {
            let runner_cfg = RunnerConfig {
                num_blocks: config.num_blocks,
                block_size: config.block_size,
                kv_dtype: config.kv_cache_dtype,
                kv_scales: kv_scales_for(config.kv_cache_dtype, loaded.kv_scales, config.calculate_kv_scales),
                calculate_kv_scales: config.calculate_kv_scales,
            };
            ModelRunner::new(dev, loaded.model, runner_cfg, Arc::from(Vec::new()))
                .map_err(|e| EngineError::Device(e.to_string()))
        });
    // Node 0 waits for every node's weights (or its error) before it serves.
    let stop = |e: String| EngineError::Cluster(format!("this node stops: {e}"));
    link.done(runner.as_ref().map(|_| ()).map_err(ToString::to_string)).map_err(stop)?;
    let mut runner = runner?;
    tracing::info!(node = cluster.node_rank, "ready: taking steps from node 0");
    let max_rank = config.lora.as_ref().map_or(0, |l| l.max_rank);
    // Adapters are read again from their path when a step places them in a slot: node 0
    // does so only when a slot's adapter changes.
    let adapter = |w: &WireLora| -> Result<Arc<LoraAdapter>, RunnerError> {
        load_peft(&w.path, &w.name, w.id, &model_config, max_rank)
            .map(Arc::new)
            .map_err(|e| RunnerError::Device(format!("LoRA adapter {} at {}: {e}", w.name, w.path.display())))
    };
    loop {
        let bytes = link.next_step().map_err(stop)?;
        let outcome = ShardStep::decode(&bytes, adapter).and_then(|step| runner.run_shard(&step));
        let failed = outcome.as_ref().err().map(ToString::to_string);
        link.done(outcome.map_err(|e| e.to_string())).map_err(stop)?;
        if let Some(e) = failed {
            return Err(EngineError::Cluster(format!("this node stops: a step failed here: {e}")));
        }
    }
}
