//! Node 0's end of the group: it takes the other nodes in at start ([`Lead::accept`]),
//! sends them each step ([`RemoteRanks`]) and combines their parts of every collective
//! ([`Collective`]).

use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::channel::{Channel, Tag};
use super::{ClusterArgs, GroupSetup, PROTOCOL_VERSION};
use crate::kernels::cpu::group::{Collective, add_in_rank_order, gather_cols};
use crate::kernels::{DevResult, DeviceError, GroupHealth, RemoteRanks};

/// The first frame a node sends.
#[derive(Debug, Serialize, Deserialize)]
pub struct Hello {
    pub magic: String,
    pub version: u32,
    pub node_rank: usize,
    pub nnodes: usize,
    pub setup: GroupSetup,
}

pub const MAGIC: &str = "actorllm-node";

/// Node 0 (rank 0) of a group whose other ranks are nodes 1.. (one rank each).
pub struct Lead {
    /// Nodes 1.. in rank order.
    nodes: Vec<Mutex<Channel>>,
    timeout: Duration,
    state: Mutex<State>,
}

struct State {
    /// Why the group failed, once it has.
    broken: Option<String>,
    /// A step was sent and not yet joined (at start: the nodes' loading of their weights,
    /// which they answer as a step).
    in_step: bool,
    /// Whether the nodes have answered that they are loaded.
    loaded: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Lead {
    /// Listens on `--master-addr:--master-port` until every other node has joined with this
    /// protocol's version and `setup`, or 10 × `--rank-timeout` has passed. A connection that
    /// is no node of ours is dropped; a node whose version or settings differ is refused,
    /// and so is the start.
    pub fn accept(args: &ClusterArgs, setup: &GroupSetup) -> Result<Arc<Lead>, String> {
        let addr = format!("{}:{}", args.master_addr, args.master_port);
        let listener =
            TcpListener::bind(&addr).map_err(|e| format!("--master-addr/--master-port {addr}: {e}"))?;
        listener.set_nonblocking(true).map_err(|e| e.to_string())?;
        let timeout = args.timeout();
        let deadline = Instant::now() + timeout * 10;
        let mut nodes: Vec<Option<Channel>> = (1..args.nnodes).map(|_| None).collect();
        tracing::info!(%addr, waiting = nodes.len(), "waiting for the other nodes");
        while nodes.iter().any(Option::is_none) {
            let (stream, from) = match listener.accept() {
                Ok(c) => c,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        let missing: Vec<String> = (1..args.nnodes)
                            .filter(|r| nodes[r - 1].is_none())
                            .map(|r| r.to_string())
                            .collect();
                        return Err(format!(
                            "node(s) {} did not join {addr} within {:.0} s (10 × --rank-timeout)",
                            missing.join(", "),
                            (timeout * 10).as_secs_f64()
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
                Err(e) => return Err(format!("{addr}: {e}")),
            };
            stream.set_nonblocking(false).map_err(|e| e.to_string())?;
            let mut chan =
                Channel::new(stream, format!("a connection from {from}")).map_err(|e| e.to_string())?;
            let hello = match chan.expect(Tag::Hello, Some(timeout)) {
                Ok(bytes) => serde_json::from_slice::<Hello>(&bytes).ok().filter(|h| h.magic == MAGIC),
                Err(_) => None,
            };
            let Some(hello) = hello else {
                tracing::warn!(%from, "a connection that is no node of this group: dropped");
                continue;
            };
            let refuse = |chan: &mut Channel, why: String| {
                let _ = chan.send(Tag::Refuse, why.as_bytes());
                Err(format!("node {} ({from}) refused: {why}", hello.node_rank))
            };
            if hello.version != PROTOCOL_VERSION {
                return refuse(
                    &mut chan,
                    format!("its protocol version is {}, node 0's is {PROTOCOL_VERSION}", hello.version),
                );
            }
            if hello.nnodes != args.nnodes {
                return refuse(
                    &mut chan,
                    format!("it has --nnodes {}, node 0 has {}", hello.nnodes, args.nnodes),
                );
            }
            if hello.node_rank == 0 || hello.node_rank >= args.nnodes {
                return refuse(
                    &mut chan,
                    format!("--node-rank {} is not one of 1..{}", hello.node_rank, args.nnodes),
                );
            }
            if nodes[hello.node_rank - 1].is_some() {
                return refuse(&mut chan, format!("node {} has joined already", hello.node_rank));
            }
            let differences = setup.differences(&hello.setup);
            if !differences.is_empty() {
                return refuse(&mut chan, format!("its settings differ: {}", differences.join("; ")));
            }
            chan.send(Tag::Welcome, b"").map_err(|e| format!("node {}: {e}", hello.node_rank))?;
            chan.set_peer(format!("node {} ({from})", hello.node_rank));
            tracing::info!(node = hello.node_rank, %from, "node joined");
            nodes[hello.node_rank - 1] = Some(chan);
        }
        Ok(Arc::new(Lead {
            nodes: nodes.into_iter().map(|c| Mutex::new(c.expect("every node joined"))).collect(),
            timeout,
            state: Mutex::new(State { broken: None, in_step: true, loaded: false }),
        }))
    }

    /// Runs `f` unless the group has failed; a failure of `f` fails the group, and every
    /// node's connection is closed so that the nodes stop.
    fn guarded<R>(&self, f: impl FnOnce() -> Result<R, String>) -> DevResult<R> {
        if let Some(why) = &lock(&self.state).broken {
            return Err(DeviceError::Other(format!("the tensor-parallel group has failed: {why}")));
        }
        f().map_err(|why| {
            self.break_group(why.clone());
            DeviceError::Other(format!("the tensor-parallel group has failed: {why}"))
        })
    }

    fn break_group(&self, why: String) {
        let mut s = lock(&self.state);
        if s.broken.is_none() {
            tracing::error!(reason = %why, "the tensor-parallel group has failed");
            s.broken = Some(why);
        }
        drop(s);
        for n in &self.nodes {
            lock(n).close();
        }
    }

    /// Every node's part of the collective in progress, in rank order.
    fn parts(&self) -> Result<Vec<Vec<f32>>, String> {
        self.nodes.iter().map(|n| lock(n).expect_f32(Tag::Part, Some(self.timeout))).collect()
    }

    fn send_all(&self, values: &[f32]) -> Result<(), String> {
        self.nodes.iter().try_for_each(|n| lock(n).send_f32(Tag::Result, values))
    }
}

impl Collective for Lead {
    fn world(&self) -> usize {
        self.nodes.len() + 1
    }

    fn all_reduce(&self, _rank: usize, x: &mut [f32]) -> DevResult<()> {
        self.guarded(|| {
            let parts = self.parts()?;
            let others: Vec<&[f32]> = parts.iter().map(Vec::as_slice).collect();
            add_in_rank_order(x, &others).map_err(|e| e.to_string())?;
            self.send_all(x)
        })
    }

    fn all_gather_cols(
        &self,
        _rank: usize,
        x: &[f32],
        rows: usize,
        keep: usize,
        total: usize,
    ) -> DevResult<Vec<f32>> {
        self.guarded(|| {
            let parts = self.parts()?;
            let all: Vec<&[f32]> = std::iter::once(x).chain(parts.iter().map(Vec::as_slice)).collect();
            let out = gather_cols(&all, rows, keep, total).map_err(|e| e.to_string())?;
            self.send_all(&out)?;
            Ok(out)
        })
    }

    fn fail(&self, why: String) {
        self.break_group(why);
    }
}

impl GroupHealth for Lead {
    fn failure(&self) -> Option<String> {
        lock(&self.state).broken.clone()
    }
}

impl RemoteRanks for Lead {
    fn send_step(&self, step: &[u8]) -> DevResult<()> {
        self.guarded(|| {
            // A step that failed on node 0 after it was sent left the nodes inside it.
            if std::mem::replace(&mut lock(&self.state).in_step, true) {
                return Err("a step failed on node 0 while the other nodes ran it".into());
            }
            self.nodes.iter().try_for_each(|n| lock(n).send(Tag::Step, step))
        })
    }

    fn join_step(&self) -> DevResult<()> {
        self.guarded(|| {
            // Loading may take a node longer than a step.
            let timeout = if lock(&self.state).loaded { self.timeout } else { self.timeout * 10 };
            for n in &self.nodes {
                let mut n = lock(n);
                let done = n.expect(Tag::Done, Some(timeout))?;
                match serde_json::from_slice::<Option<String>>(&done) {
                    Ok(None) => {}
                    Ok(Some(e)) => return Err(format!("{} failed: {e}", n.peer())),
                    Err(e) => return Err(format!("{}: its answer does not decode: {e}", n.peer())),
                }
            }
            let mut s = lock(&self.state);
            (s.in_step, s.loaded) = (false, true);
            Ok(())
        })
    }
}

/// A node's end of the group (ranks 1..): its parts go to node 0, which answers with the
/// collective's result.
pub struct Follower {
    chan: Mutex<Channel>,
    broken: Mutex<Option<String>>,
    rank: usize,
    world: usize,
    timeout: Duration,
}

impl Follower {
    /// Joins node 0 at `--master-addr:--master-port`, trying again until node 0 listens or
    /// 10 × `--rank-timeout` has passed, with this node's `setup`.
    pub fn join(args: &ClusterArgs, setup: &GroupSetup) -> Result<Follower, String> {
        let addr = format!("{}:{}", args.master_addr, args.master_port);
        let timeout = args.timeout();
        let deadline = Instant::now() + timeout * 10;
        let stream = loop {
            match TcpStream::connect(&addr) {
                Ok(s) => break s,
                Err(e) if Instant::now() > deadline => {
                    return Err(format!(
                        "node 0 at {addr} did not answer within {:.0} s: {e}",
                        (timeout * 10).as_secs_f64()
                    ));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        };
        let mut chan = Channel::new(stream, format!("node 0 ({addr})")).map_err(|e| e.to_string())?;
        let hello = Hello {
            magic: MAGIC.into(),
            version: PROTOCOL_VERSION,
            node_rank: args.node_rank,
            nnodes: args.nnodes,
            setup: setup.clone(),
        };
        chan.send(Tag::Hello, &serde_json::to_vec(&hello).expect("a greeting serializes"))?;
        chan.expect(Tag::Welcome, Some(timeout * 10))?;
        Ok(Follower {
            chan: Mutex::new(chan),
            broken: Mutex::default(),
            rank: args.node_rank,
            world: args.nnodes,
            timeout,
        })
    }

    /// The next step's inputs, waiting as long as node 0 has none; an error once node 0
    /// has gone.
    pub fn next_step(&self) -> Result<Vec<u8>, String> {
        lock(&self.chan).expect(Tag::Step, None)
    }

    /// Tells node 0 the step is done, or why it failed.
    pub fn done(&self, outcome: Result<(), String>) -> Result<(), String> {
        let payload = serde_json::to_vec(&outcome.err()).expect("a string serializes");
        lock(&self.chan).send(Tag::Done, &payload)
    }

    fn exchange(&self, part: &[f32]) -> DevResult<Vec<f32>> {
        let mut chan = lock(&self.chan);
        chan.send_f32(Tag::Part, part)
            .and_then(|()| chan.expect_f32(Tag::Result, Some(self.timeout)))
            .map_err(|e| DeviceError::Other(format!("the tensor-parallel group has failed: {e}")))
    }
}

impl Collective for Follower {
    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce(&self, rank: usize, x: &mut [f32]) -> DevResult<()> {
        debug_assert_eq!(rank, self.rank);
        let sum = self.exchange(x)?;
        if sum.len() != x.len() {
            return Err(DeviceError::Other(format!("node 0 sent {} sums for {} values", sum.len(), x.len())));
        }
        x.copy_from_slice(&sum);
        Ok(())
    }

    fn all_gather_cols(
        &self,
        _rank: usize,
        x: &[f32],
        rows: usize,
        _keep: usize,
        total: usize,
    ) -> DevResult<Vec<f32>> {
        let out = self.exchange(x)?;
        if out.len() != rows * total {
            return Err(DeviceError::Other(format!("node 0 sent {} values for {rows} × {total}", out.len())));
        }
        Ok(out)
    }

    fn fail(&self, why: String) {
        tracing::error!(reason = %why, "this node leaves the tensor-parallel group");
        *lock(&self.broken) = Some(why);
        lock(&self.chan).close();
    }
}

impl GroupHealth for Follower {
    fn failure(&self) -> Option<String> {
        lock(&self.broken).clone()
    }
}
