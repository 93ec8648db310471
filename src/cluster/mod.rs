//! Tensor parallelism across processes (nodes): `--nnodes`, `--node-rank`, `--master-addr`
//! and `--master-port`, as vLLM names them. Node 0 serves; it listens on the master
//! address, each other node connects to it (a versioned handshake that also compares the
//! settings every rank must share) and then runs headless: it takes each step's inputs from
//! node 0 over the same framed TCP channel ([`channel`]) and runs its share of the forward.
//!
//! On the CPU one process is one rank, and the collectives travel over that channel too:
//! node 0 gathers every rank's part, combines them in rank order and sends the result back
//! ([`lead::Lead`], [`worker`]), so every rank holds bit-identical sums, as in one process.
//! A node that closes its connection or does not answer within `--rank-timeout` fails the
//! step in flight with an error naming it; node 0 then stays failed (its `/health` answers
//! 503) until it is restarted, and the other nodes exit.

pub mod channel;
pub mod lead;
pub mod worker;

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::{EngineArgs, EngineConfig};
use crate::models::config::ModelConfig;

/// The protocol's version: nodes of different versions refuse each other at the handshake.
pub const PROTOCOL_VERSION: u32 = 1;

/// How the processes of one tensor-parallel group find each other, and how long a rank may
/// keep the others waiting.
#[derive(Debug, Clone, clap::Args)]
pub struct ClusterArgs {
    /// Nodes (processes) the tensor-parallel group spans. On the CPU each node is one rank:
    /// --tensor-parallel-size must equal it.
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
        if self.nnodes > 1 && !cpu {
            return Err(format!(
                "--nnodes {} runs on the CPU (--device cpu): GPU ranks on several nodes are not served",
                self.nnodes
            ));
        }
        if self.nnodes > 1 && tp != self.nnodes {
            return Err(format!(
                "--nnodes {} on the CPU runs one rank a node: --tensor-parallel-size must be {}, not {tp}",
                self.nnodes, self.nnodes
            ));
        }
        Ok(())
    }
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
