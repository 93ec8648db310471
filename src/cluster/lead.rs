//! Node 0's end of the group: it takes the other nodes in at start ([`Lead::accept`]),
//! sends them each step ([`RemoteRanks`]) and combines their parts of every collective
//! ([`Collective`]).

use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::channel::{Channel, Tag};
use super::{ClusterArgs, GroupSetup, NodeMessage, PROTOCOL_VERSION};
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

/// Node 0's answer to a node it takes in: what the group's ranks share beyond the settings
/// they were started with.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Welcome {
    /// The NCCL unique id node 0 made, on GPUs: every rank joins the communicator by it.
    pub nccl_id: Option<Vec<u8>>,
}

/// How often node 0 looks at the other nodes' connections between their answers.
const WATCH_EVERY: Duration = Duration::from_millis(100);

/// Node 0's end of a group whose other nodes are 1..: on the CPU one rank each, whose
/// collectives node 0 combines; on GPUs their ranks meet in NCCL, and the channel carries
/// steps and commands only.
pub struct Lead {
    /// Nodes 1.. in rank order.
    nodes: Vec<Mutex<Channel>>,
    /// The same connections, for the watch ([`Lead::watch`]) and for closing them while
    /// another thread waits on one.
    sockets: Vec<(String, TcpStream)>,
    timeout: Duration,
    /// On GPUs: how long a step sent may stay unanswered before the group is failed. A
    /// GPU rank waits for the others inside NCCL, on the device, where no timeout of the
    /// collectives' own reaches it.
    step_deadline: Option<Duration>,
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
    /// When the step in flight was sent.
    sent: Option<Instant>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Lead {
    /// Listens on `--master-addr:--master-port` until every other node has joined with this
    /// protocol's version and `setup`, or 10 × `--rank-timeout` has passed. A connection that
    /// is no node of ours is dropped; a node whose version or settings differ is refused,
    /// and so is the start. Each node taken in gets `welcome`. With `gpu`, a step that stays
    /// unanswered for `--rank-timeout` fails the group (see [`Lead::watch`]).
    pub fn accept(
        args: &ClusterArgs,
        setup: &GroupSetup,
        welcome: &Welcome,
        gpu: bool,
    ) -> Result<Arc<Lead>, String> {
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
            let welcome = serde_json::to_vec(welcome).expect("a welcome serializes");
            chan.send(Tag::Welcome, &welcome).map_err(|e| format!("node {}: {e}", hello.node_rank))?;
            chan.set_peer(format!("node {} ({from})", hello.node_rank));
            tracing::info!(node = hello.node_rank, %from, "node joined");
            nodes[hello.node_rank - 1] = Some(chan);
        }
        let nodes: Vec<Channel> = nodes.into_iter().map(|c| c.expect("every node joined")).collect();
        let sockets = nodes
            .iter()
            .map(|c| Ok((c.peer().to_string(), c.socket().map_err(|e| format!("{}: {e}", c.peer()))?)))
            .collect::<Result<_, String>>()?;
        let lead = Arc::new(Lead {
            nodes: nodes.into_iter().map(Mutex::new).collect(),
            sockets,
            timeout,
            step_deadline: gpu.then_some(timeout),
            state: Mutex::new(State { broken: None, in_step: true, loaded: false, sent: None }),
        });
        let weak = Arc::downgrade(&lead);
        std::thread::Builder::new()
            .name("cluster-watch".into())
            .spawn(move || Lead::watch(weak))
            .map_err(|e| format!("the thread watching the other nodes: {e}"))?;
        Ok(lead)
    }

    /// Fails the group as soon as another node closes its connection (its process ended),
    /// and on GPUs once a step has gone unanswered past its deadline, so that rank 0 and
    /// the requests in flight do not wait for a node that is gone: a GPU rank waiting on
    /// the device polls the group's health ([`GroupHealth::failure`]). Runs until the
    /// group fails or node 0 drops it.
    fn watch(lead: std::sync::Weak<Lead>) {
        loop {
            std::thread::sleep(WATCH_EVERY);
            let Some(lead) = lead.upgrade() else { return };
            if lock(&lead.state).broken.is_some() {
                return;
            }
            if let Some((peer, _)) = lead.sockets.iter().find(|(_, s)| super::channel::closed(s)) {
                lead.break_group(format!("{peer} closed the connection"));
                return;
            }
            let late = {
                let s = lock(&lead.state);
                match (lead.step_deadline, s.sent) {
                    (Some(limit), Some(sent)) if s.loaded && sent.elapsed() > limit => Some(limit),
                    _ => None,
                }
            };
            if let Some(limit) = late {
                lead.break_group(format!(
                    "the other nodes did not finish a step within {:.1} s (--rank-timeout)",
                    limit.as_secs_f64()
                ));
                return;
            }
        }
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
        for (_, socket) in &self.sockets {
            let _ = socket.shutdown(std::net::Shutdown::Both);
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
}

impl GroupHealth for Lead {
    fn failure(&self) -> Option<String> {
        lock(&self.state).broken.clone()
    }

    fn fail(&self, why: String) {
        self.break_group(why);
    }
}

impl RemoteRanks for Lead {
    fn send_step(&self, step: &[u8]) -> DevResult<()> {
        self.guarded(|| {
            // A step that failed on node 0 after it was sent left the nodes inside it.
            {
                let mut s = lock(&self.state);
                if std::mem::replace(&mut s.in_step, true) {
                    return Err("a step failed on node 0 while the other nodes ran it".into());
                }
                s.sent = Some(Instant::now());
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
            (s.in_step, s.loaded, s.sent) = (false, true, None);
            Ok(())
        })
    }

    fn command(&self, command: &[u8]) -> DevResult<Vec<Vec<u8>>> {
        self.guarded(|| {
            if lock(&self.state).in_step {
                return Err("a command was sent while the other nodes ran a step".into());
            }
            self.nodes.iter().try_for_each(|n| lock(n).send(Tag::Command, command))?;
            // Commands allocate caches and time GEMMs: they may take longer than a step.
            self.nodes.iter().map(|n| lock(n).expect(Tag::Answer, Some(self.timeout * 10))).collect()
        })
    }
}

/// A node's end of the group (nodes 1..): it takes steps and commands from node 0; on the
/// CPU its parts of each collective go to node 0, which answers with the result.
pub struct Follower {
    chan: Mutex<Channel>,
    /// The same connection, watched ([`Follower::watch`]).
    socket: TcpStream,
    broken: Mutex<Option<String>>,
    rank: usize,
    world: usize,
    timeout: Duration,
}

impl Follower {
    /// Joins node 0 at `--master-addr:--master-port`, trying again until node 0 listens or
    /// 10 × `--rank-timeout` has passed, with this node's `setup`.
    pub fn join(args: &ClusterArgs, setup: &GroupSetup) -> Result<(Follower, Welcome), String> {
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
        let welcome = chan.expect(Tag::Welcome, Some(timeout * 10))?;
        let welcome = serde_json::from_slice::<Welcome>(&welcome)
            .map_err(|e| format!("node 0's welcome does not decode: {e}"))?;
        let socket = chan.socket().map_err(|e| format!("node 0 ({addr}): {e}"))?;
        let follower = Follower {
            chan: Mutex::new(chan),
            socket,
            broken: Mutex::default(),
            rank: args.node_rank,
            world: args.nnodes,
            timeout,
        };
        Ok((follower, welcome))
    }

    /// Fails this node's group as soon as node 0 closes its connection, also while this
    /// node's ranks are busy: a GPU rank waiting on the device for a collective node 0
    /// never joins polls the group's health ([`GroupHealth::failure`]). Runs until the
    /// group fails or the node drops it.
    pub fn watch(self: &Arc<Self>) -> Result<(), String> {
        let weak = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("cluster-watch".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(WATCH_EVERY);
                    let Some(node) = weak.upgrade() else { return };
                    if node.failure().is_some() {
                        return;
                    }
                    if super::channel::closed(&node.socket) {
                        node.fail("node 0 closed the connection".into());
                        return;
                    }
                }
            })
            .map(drop)
            .map_err(|e| format!("the thread watching node 0: {e}"))
    }

    /// The next step's inputs or command, waiting as long as node 0 has none; an error
    /// once node 0 has gone.
    pub fn next(&self) -> Result<NodeMessage, String> {
        let mut chan = lock(&self.chan);
        match chan.recv(None)? {
            (Tag::Step, bytes) => Ok(NodeMessage::Step(bytes)),
            (Tag::Command, bytes) => serde_json::from_slice(&bytes)
                .map(NodeMessage::Command)
                .map_err(|e| format!("{}: a command that does not decode: {e}", chan.peer())),
            (tag, _) => Err(format!("{}: sent {tag:?} where a step or a command was due", chan.peer())),
        }
    }

    /// Answers a command: its answer, or why it failed.
    pub fn answer(&self, outcome: Result<super::NodeAnswer, String>) -> Result<(), String> {
        let mut chan = lock(&self.chan);
        match outcome {
            Ok(a) => chan.send(Tag::Answer, &serde_json::to_vec(&a).expect("an answer serializes")),
            Err(e) => chan.send(Tag::Done, &serde_json::to_vec(&Some(e)).expect("a string serializes")),
        }
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
}

impl GroupHealth for Follower {
    fn failure(&self) -> Option<String> {
        lock(&self.broken).clone()
    }

    fn fail(&self, why: String) {
        tracing::error!(reason = %why, "this node leaves the tensor-parallel group");
        *lock(&self.broken) = Some(why);
        let _ = self.socket.shutdown(std::net::Shutdown::Both);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{NodeAnswer, NodeCommand};

    fn setup() -> GroupSetup {
        GroupSetup {
            world: 2,
            architecture: "LlamaForCausalLM".into(),
            hidden_size: 64,
            num_layers: 2,
            vocab_size: 128,
            dtype: "F32".into(),
            num_blocks: 8,
            block_size: 16,
            kv_cache_dtype: crate::kernels::KvDtype::Auto,
            calculate_kv_scales: false,
            max_loras: 0,
            max_lora_rank: 0,
        }
    }

    /// Node 0 and node 1 of a group of two, on a free port of 127.0.0.1.
    fn pair(gpu: bool, rank_timeout: f64) -> (Arc<Lead>, Follower, Welcome) {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let args = ClusterArgs { nnodes: 2, master_port: port, rank_timeout, ..ClusterArgs::default() };
        let welcome = Welcome { nccl_id: gpu.then(|| (0..128).collect()) };
        let lead_args = args.clone();
        let lead = std::thread::spawn(move || Lead::accept(&lead_args, &setup(), &welcome, gpu));
        let follower = ClusterArgs { node_rank: 1, ..args };
        let (follower, welcome) = Follower::join(&follower, &setup()).unwrap();
        (lead.join().unwrap().unwrap(), follower, welcome)
    }

    /// Why the group failed, waiting up to 5 s for it to.
    fn failed_within_5_s(lead: &Lead) -> String {
        let t = Instant::now();
        while lead.failure().is_none() && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        lead.failure().expect("the group failed within 5 s")
    }

    /// The node's side of its loading and of one command, as the worker runs them.
    fn load(lead: &Lead, follower: &Follower) {
        follower.done(Ok(())).unwrap();
        lead.join_step().unwrap();
    }

    #[test]
    fn the_welcome_carries_the_nccl_id_and_commands_come_back_answered() {
        let (lead, follower, welcome) = pair(true, 5.0);
        assert_eq!(welcome.nccl_id, Some((0..128).collect()));
        load(&lead, &follower);
        let node = std::thread::spawn(move || {
            let NodeMessage::Command(c) = follower.next().unwrap() else {
                panic!("a step where a command was due")
            };
            assert_eq!(c, NodeCommand::ReleaseCache);
            follower.answer(Ok(NodeAnswer::Memory(vec![Some((7, 9))]))).unwrap();
            let NodeMessage::Command(c) = follower.next().unwrap() else {
                panic!("a step where a command was due")
            };
            assert_eq!(c, NodeCommand::AllocateCache { num_blocks: 3 });
            follower.answer(Err("out of memory".into())).unwrap();
            follower
        });
        let answers = crate::cluster::command(lead.as_ref(), &NodeCommand::ReleaseCache).unwrap();
        assert_eq!(answers, vec![NodeAnswer::Memory(vec![Some((7, 9))])]);
        let e = crate::cluster::command(lead.as_ref(), &NodeCommand::AllocateCache { num_blocks: 3 })
            .unwrap_err();
        assert!(e.contains("node 1") && e.contains("out of memory"), "{e}");
        // A failed command fails the group: nothing more is sent.
        assert!(lead.failure().is_some());
        drop(node.join().unwrap());
    }

    #[test]
    fn a_node_whose_process_ends_fails_the_group_while_node_0_waits_elsewhere() {
        let (lead, follower, _) = pair(false, 60.0);
        load(&lead, &follower);
        lead.send_step(b"{}").unwrap();
        assert_eq!(follower.next().map(|m| matches!(m, NodeMessage::Step(_))), Ok(true));
        // Node 0 is busy with its own share (a GPU waiting in NCCL): it reads nothing, and
        // the watch alone sees the node go.
        drop(follower);
        let why = failed_within_5_s(&lead);
        assert!(why.contains("node 1") && why.contains("closed the connection"), "{why}");
        assert!(lead.send_step(b"{}").is_err());
    }

    #[test]
    fn a_node_sees_node_0_go_while_its_ranks_are_busy() {
        let (lead, follower, _) = pair(true, 60.0);
        let follower = Arc::new(follower);
        follower.watch().unwrap();
        load(&lead, &follower);
        assert_eq!(follower.failure(), None);
        drop(lead);
        let t = Instant::now();
        while follower.failure().is_none() && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        let why = follower.failure().expect("the node saw node 0 go within 5 s");
        assert!(why.contains("node 0 closed the connection"), "{why}");
        assert!(follower.next().is_err());
    }

    #[test]
    fn on_gpus_a_step_left_unanswered_past_the_rank_timeout_fails_the_group() {
        let (lead, follower, _) = pair(true, 0.5);
        load(&lead, &follower);
        lead.send_step(b"{}").unwrap();
        // The node takes the step and never answers, its connection open.
        assert!(matches!(follower.next(), Ok(NodeMessage::Step(_))));
        let t = Instant::now();
        let why = failed_within_5_s(&lead);
        assert!(why.contains("did not finish a step within 0.5 s"), "{why}");
        assert!(t.elapsed() >= Duration::from_millis(400), "{:?}", t.elapsed());
    }

    #[test]
    fn a_cpu_group_waits_for_a_long_step() {
        // On the CPU a step's length is the CPU's: only the collectives' own timeout holds.
        let (lead, follower, _) = pair(false, 0.3);
        load(&lead, &follower);
        lead.send_step(b"{}").unwrap();
        assert!(matches!(follower.next(), Ok(NodeMessage::Step(_))));
        std::thread::sleep(Duration::from_millis(800));
        assert_eq!(lead.failure(), None);
        follower.done(Ok(())).unwrap();
        lead.join_step().unwrap();
    }
}
