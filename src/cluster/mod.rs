//! Tensor parallelism across processes (nodes): `--nnodes`, `--node-rank`, `--master-addr`
//! and `--master-port`, as vLLM names them. Node 0 serves; it listens on the master
//! address, each other node connects to it (a versioned handshake that also compares the
//! settings every rank must share) and then runs headless: it takes each step's inputs from
//! node 0 over the same framed TCP channel ([`channel`]) and runs its share of the forward.
//!
//! On the CPU one process is one rank, and the collectives travel over that channel too:
//! node 0 gathers every rank's part, combines them in rank order and sends the result back
//! ([`lead::Lead`], [`worker`]), so every rank holds bit-identical sums, as in one process.
//!
//! On GPUs each node runs one rank per local GPU (--tensor-parallel-size / --nnodes of
//! them, GPUs 0..), ranks numbered node by node. Node 0 makes an NCCL unique id and hands
//! it to every node in its welcome; all ranks join one NCCL communicator by it, and the
//! collectives go through NCCL. The channel carries the steps and the commands that size
//! and allocate the KV cache after node 0's profiling step ([`NodeCommand`]): the cache
//! takes what the fullest GPU of the group leaves.
//!
//! A node that closes its connection or does not answer within `--rank-timeout` fails the
//! step in flight with an error naming it; node 0 then stays failed (its `/health` answers
//! 503) until it is restarted, and the other nodes exit.

pub mod channel;
pub mod lead;
pub mod worker;

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::{EngineArgs, EngineConfig};
use crate::kernels::RemoteRanks;
use crate::models::config::ModelConfig;

/// The protocol's version: nodes of different versions refuse each other at the handshake.
pub const PROTOCOL_VERSION: u32 = 2;

/// What node 0 sends another node: a step's inputs (an encoded
/// [`crate::actors::model_runner::ShardStep`]), or a command.
#[derive(Debug)]
pub enum NodeMessage {
    Step(Vec<u8>),
    Command(NodeCommand),
}

/// The work outside the steps that node 0 has every node do on each of its ranks, in the
/// order node 0 does it on its own: after the profiling step, tune the GEMMs, release the
/// cache and report the memory left, then allocate the cache that fits every GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum NodeCommand {
    TuneGemms { rows: Vec<usize> },
    ReleaseCache,
    AllocateCache { num_blocks: usize },
}

/// A node's answer to a [`NodeCommand`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum NodeAnswer {
    Done,
    /// Each local rank's (free, total) device memory once its cache was released.
    Memory(Vec<Option<(usize, usize)>>),
}

/// How the processes of one tensor-parallel group find each other, and how long a rank may
/// keep the others waiting.
#[derive(Debug, Clone, clap::Args)]
pub struct ClusterArgs {
    /// Nodes (processes) the tensor-parallel group spans. On the CPU each node is one rank:
    /// --tensor-parallel-size must equal it. On GPUs each node runs
    /// --tensor-parallel-size / --nnodes ranks, one per local GPU.
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// This node's place, 0 to --nnodes − 1. Node 0 serves the API; the others run
    /// headless and take their steps from node 0.
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// The address node 0 listens on for the other nodes.
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    #[arg(long, default_value_t = 29501)]
    pub master_port: u16,
    /// Seconds a tensor-parallel rank (a thread, or a process on another node) may take to
    /// reach a collective or answer within a step before the group is failed, naming it.
    /// Node 0 waits 10 times as long for the other nodes to join and load.
    #[arg(long, default_value_t = 30.0)]
    pub rank_timeout: f64,
}

impl Default for ClusterArgs {
    fn default() -> Self {
        Self {
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 29501,
            rank_timeout: 30.0,
        }
    }
}

impl ClusterArgs {
    pub fn timeout(&self) -> Duration {
        Duration::from_secs_f64(self.rank_timeout.max(0.001))
    }

    /// The flags checked against each other and the tensor-parallel size (`tp`).
    pub fn check(&self, tp: usize, cpu: bool) -> Result<(), String> {
        if self.nnodes == 0 {
            return Err("--nnodes must be at least 1".into());
        }
        if self.node_rank >= self.nnodes {
            return Err(format!("--node-rank {} must be below --nnodes {}", self.node_rank, self.nnodes));
        }
        if !(self.rank_timeout.is_finite() && self.rank_timeout > 0.0) {
            return Err(format!("--rank-timeout {} must be a positive number of seconds", self.rank_timeout));
        }
        if self.nnodes > 1 && !cpu && !tp.is_multiple_of(self.nnodes) {
            return Err(format!(
                "--tensor-parallel-size {tp} over --nnodes {} on GPUs: each node runs the same number \
                 of ranks, one per GPU, so the size must be a multiple of --nnodes",
                self.nnodes
            ));
        }
        if self.nnodes > 1 && cpu && tp != self.nnodes {
            return Err(format!(
                "--nnodes {} on the CPU runs one rank a node: --tensor-parallel-size must be {}, not {tp}",
                self.nnodes, self.nnodes
            ));
        }
        Ok(())
    }

    /// The ranks (GPUs) each node runs in a group of `tp`.
    pub fn local_ranks(&self, tp: usize) -> usize {
        tp / self.nnodes.max(1)
    }
}

/// Has every other node run `command` on each of its ranks; their answers in rank order.
pub fn command(remote: &dyn RemoteRanks, command: &NodeCommand) -> Result<Vec<NodeAnswer>, String> {
    let bytes = serde_json::to_vec(command).expect("a command serializes");
    let answers = remote.command(&bytes).map_err(|e| format!("{command:?} on the other nodes: {e}"))?;
    answers
        .iter()
        .map(|a| serde_json::from_slice(a).map_err(|e| format!("a node's answer to {command:?}: {e}")))
        .collect()
}

/// What every rank of a group must agree on, compared at the handshake: a node started
/// with another model, dtype or cache geometry would compute something else.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupSetup {
    pub world: usize,
    pub architecture: String,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub vocab_size: usize,
    pub dtype: String,
    pub num_blocks: usize,
    pub block_size: usize,
    pub kv_cache_dtype: crate::kernels::KvDtype,
    pub calculate_kv_scales: bool,
    pub max_loras: usize,
    pub max_lora_rank: usize,
}

impl GroupSetup {
    pub fn of(args: &EngineArgs, model: &ModelConfig, config: &EngineConfig) -> Self {
        GroupSetup {
            world: args.tensor_parallel_size,
            architecture: model.architecture.clone(),
            hidden_size: model.hidden_size,
            num_layers: model.num_layers,
            vocab_size: model.vocab_size,
            dtype: format!("{:?}", config.dtype),
            num_blocks: config.num_blocks,
            block_size: config.block_size,
            kv_cache_dtype: config.kv_cache_dtype,
            calculate_kv_scales: config.calculate_kv_scales,
            max_loras: config.lora.as_ref().map_or(0, |l| l.max_loras),
            max_lora_rank: config.lora.as_ref().map_or(0, |l| l.max_rank),
        }
    }

    /// The fields where `other` differs from this, as `field: here vs there`.
    pub fn differences(&self, other: &GroupSetup) -> Vec<String> {
        let (a, b) =
            (serde_json::to_value(self).unwrap_or_default(), serde_json::to_value(other).unwrap_or_default());
        let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else { return vec!["setup".into()] };
        a.iter()
            .filter(|(k, v)| b.get(*k) != Some(v))
            .map(|(k, v)| format!("{k}: {v} on node 0, {} there", b.get(k).cloned().unwrap_or_default()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_nodes_run_an_equal_share_of_the_ranks_and_cpu_nodes_one() {
        let two = ClusterArgs { nnodes: 2, ..ClusterArgs::default() };
        assert_eq!(two.check(16, false), Ok(()));
        assert_eq!(two.local_ranks(16), 8);
        assert_eq!(two.check(2, false), Ok(()));
        let e = two.check(3, false).unwrap_err();
        assert!(e.contains("--tensor-parallel-size 3") && e.contains("multiple of --nnodes"), "{e}");
        assert_eq!(two.check(2, true), Ok(()));
        let e = two.check(4, true).unwrap_err();
        assert!(e.contains("--tensor-parallel-size must be 2"), "{e}");
        let e =
            ClusterArgs { nnodes: 2, node_rank: 2, ..ClusterArgs::default() }.check(2, false).unwrap_err();
        assert!(e.contains("--node-rank 2 must be below --nnodes 2"), "{e}");
    }
}
