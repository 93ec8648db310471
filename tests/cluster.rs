//! Tensor parallelism across processes: node 0 runs in the test, the other nodes are
//! `actorllm serve --node-rank N` processes on 127.0.0.1, joined over the framed TCP
//! channel that carries both the steps and the CPU's collectives. Split over two and three
//! processes, the models give one process's greedy tokens; a node killed mid-stream ends
//! the stream with an error at once and leaves node 0 answering 503; nodes whose settings
//! differ refuse each other by name.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use actorllm::Engine;
use actorllm::cluster::ClusterArgs;
use actorllm::config::EngineArgs;
use actorllm::request::SamplingParams;
use common::{greedy, run};
use futures::StreamExt;
use serde_json::{Value, json};

/// A node process, killed when dropped.
struct Node(Child);

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Node {
    /// Waits (at most 30 s) for the process to exit; its status and what it printed.
    fn exit(mut self) -> (bool, String) {
        let start = Instant::now();
        while self.0.try_wait().unwrap().is_none() {
            assert!(start.elapsed() < Duration::from_secs(30), "the node process did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut err = String::new();
        std::io::Read::read_to_string(self.0.stderr.as_mut().unwrap(), &mut err).unwrap();
        (self.0.wait().unwrap().success(), err)
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Node `rank` of `nnodes` on `model`, with `extra` flags.
fn node(model: &Path, nnodes: usize, rank: usize, port: u16, extra: &[&str]) -> Node {
    let (n, r, p) = (nnodes.to_string(), rank.to_string(), port.to_string());
    let mut args = vec!["serve", "--model", model.to_str().unwrap(), "--device", "cpu"];
    args.extend(["--tensor-parallel-size", &n, "--nnodes", &n, "--node-rank", &r, "--master-port", &p]);
    args.extend(["--rank-timeout", "20"]);
    args.extend(extra);
    let child = Command::new(env!("CARGO_BIN_EXE_actorllm"))
        .args(&args)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("actorllm runs");
    Node(child)
}

/// Node 0's flags for a group of `nnodes` meeting at `port`.
fn lead_args(model: &Path, nnodes: usize, port: u16) -> EngineArgs {
    EngineArgs {
        tensor_parallel_size: nnodes,
        cluster: ClusterArgs { nnodes, master_port: port, rank_timeout: 20.0, ..ClusterArgs::default() },
        ..common::args(model)
    }
}

/// Greedy tokens of `prompts`, submitted together.
async fn outputs(engine: &Engine, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let params = SamplingParams { ignore_eos: true, ..greedy(24) };
    let runs = prompts.iter().map(|p| run(engine, p.clone(), params.clone()));
    futures::future::join_all(runs).await.into_iter().map(|o| o.tokens[0].clone()).collect()
}

/// Greedy tokens of `prompts` from a group of `nnodes` processes (node 0 in this one).
async fn group_outputs(model: &Path, nnodes: usize, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let port = free_port();
    let _nodes: Vec<Node> = (1..nnodes).map(|r| node(model, nnodes, r, port, &[])).collect();
    let engine = Engine::start(lead_args(model, nnodes, port)).await.expect("the group starts");
    outputs(&engine, prompts).await
}

/// The group's collectives combine the ranks' parts in rank order, as the ranks of one
/// process do: n processes give exactly the tokens of n ranks in one process (and, on the
/// tiny model, of one rank).
#[actix_rt::test]
async fn two_and_three_processes_give_one_process_tokens() {
    let in_one = |model: &Path, tp: usize| EngineArgs { tensor_parallel_size: tp, ..common::args(model) };
    let tiny = common::tiny_model(41);
    let v = actorllm::models::random::Preset::Tiny.shape().vocab as u32;
    let p = vec![vec![1, 2, 3], (10..60).map(|i| i * 7 % (v - 2)).collect(), vec![v - 3, 5]];
    let one = outputs(&Engine::start(in_one(tiny.path(), 1)).await.unwrap(), &p).await;
    assert!(one.iter().all(|o| o.len() == 24));
    assert_eq!(outputs(&Engine::start(in_one(tiny.path(), 2)).await.unwrap(), &p).await, one);
    assert_eq!(group_outputs(tiny.path(), 2, &p).await, one, "tiny model over 2 processes");
    // The default model's 9 heads and 3 KV heads split over 3 processes.
    let model = common::default_model();
    let p = vec![vec![1, 504, 3458, 282, 4649, 314], (100..180).collect(), vec![28, 9, 1234]];
    let one = outputs(&Engine::start(in_one(&model, 3)).await.unwrap(), &p).await;
    assert_eq!(group_outputs(&model, 3, &p).await, one, "default model over 3 processes");
}

#[actix_rt::test]
async fn a_node_killed_mid_stream_ends_it_with_an_error_and_node_0_answers_503() {
    let model = common::default_model();
    let port = free_port();
    let _one = node(&model, 3, 1, port, &[]);
    let mut two = node(&model, 3, 2, port, &[]);
    let engine = Engine::start(lead_args(&model, 3, port)).await.expect("the group starts");
    let mut args = actorllm::web::ServeArgs::new(lead_args(&model, 3, port));
    args.port = 0;
    let s = common::server::serve(engine, args);
    assert_eq!(s.get_text("/health").await.0, 200);
    let body = json!({"prompt": [21, 22, 23], "max_tokens": 4000, "temperature": 0, "ignore_eos": true, "stream": true});
    let mut r = s.client.post(s.url("/v1/completions")).send_json(&body).await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let mut text = String::new();
    let mut killed = None;
    while let Some(chunk) =
        tokio::time::timeout(Duration::from_secs(30), r.next()).await.expect("a chunk in time")
    {
        text.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
        if killed.is_none() && text.matches("data: {").count() >= 5 {
            two.0.kill().unwrap();
            killed = Some(Instant::now());
        }
    }
    let took = killed.expect("tokens streamed before the kill").elapsed();
    assert!(took < Duration::from_secs(5), "the stream ended {took:?} after the kill");
    let data = common::server::parse_sse(&text);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let error: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    let message = error["error"]["message"].as_str().expect("an error event before [DONE]");
    assert!(message.contains("node 2"), "{message}");
    // Node 0 stays failed, and says why.
    let (status, health) = s.get_text("/health").await;
    assert_eq!(status, 503, "{health}");
    assert!(health.contains("node 2"), "{health}");
    let (status, v) = s.post("/v1/completions", &json!({"prompt": [1, 2], "max_tokens": 2})).await;
    assert_eq!(status, 503, "{v}");
    // The surviving node stops too: it cannot go on without node 0's group.
    let (ok, err) = _one.exit();
    assert!(!ok && err.contains("this node stops"), "{err}");
}

#[actix_rt::test]
async fn nodes_whose_settings_differ_refuse_each_other() {
    let tiny = common::tiny_model(43);
    let port = free_port();
    let other = node(tiny.path(), 2, 1, port, &["--dtype", "bfloat16"]);
    let e = Engine::start(lead_args(tiny.path(), 2, port)).await.err().expect("refused").to_string();
    assert!(e.contains("node 1") && e.contains("dtype"), "{e}");
    let (ok, err) = other.exit();
    assert!(!ok && err.contains("refused") && err.contains("dtype"), "{err}");

    let refused =
        |args: EngineArgs| async move { Engine::start(args).await.err().expect("refused").to_string() };
    let e = refused(EngineArgs { tensor_parallel_size: 1, ..lead_args(tiny.path(), 2, port) }).await;
    assert!(e.contains("--tensor-parallel-size must be 2"), "{e}");
    let mut args = lead_args(tiny.path(), 2, port);
    args.cluster.node_rank = 2;
    assert!(refused(args).await.contains("--node-rank 2 must be below --nnodes 2"));
    let mut args = lead_args(tiny.path(), 2, port);
    args.cluster.node_rank = 1;
    assert!(refused(args).await.contains("runs headless"));
    // Nobody joins: node 0 gives up after 10 × --rank-timeout, naming who is missing.
    let mut args = lead_args(tiny.path(), 2, free_port());
    args.cluster.rank_timeout = 0.1;
    let e = refused(args).await;
    assert!(e.contains("node(s) 1 did not join"), "{e}");
}

/// Adapters over three processes: each node reads every adapter node 0 places in a slot
/// from its path and keeps its share; with one slot for two adapters, slots are refilled
/// as requests alternate, and every output is still PEFT's.
#[actix_rt::test]
async fn adapters_over_three_processes_give_peft_tokens() {
    use common::lora::{golden, write_adapter};
    let g = golden();
    let root = common::scratch("cluster-lora");
    let modules: Vec<(String, std::path::PathBuf)> = g
        .adapters
        .iter()
        .map(|a| (a.spec.name.clone(), write_adapter(root.path(), &a.spec, false)))
        .collect();
    let flags: Vec<String> = ["--enable-lora", "--max-loras", "1", "--max-lora-rank", "16", "--lora-modules"]
        .into_iter()
        .map(String::from)
        .chain(modules.iter().map(|(n, p)| format!("{n}={}", p.display())))
        .collect();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let model = common::default_model();
    let port = free_port();
    let _nodes: Vec<Node> = (1..3).map(|r| node(&model, 3, r, port, &flags)).collect();
    let mut args = lead_args(&model, 3, port);
    args.lora = actorllm::config::LoraArgs {
        enable_lora: true,
        lora_modules: modules,
        max_loras: 1,
        max_lora_rank: 16,
        ..Default::default()
    };
    let engine = Engine::start(args).await.expect("the group starts");
    for _round in 0..2 {
        for a in &g.adapters {
            let o = &a.outputs[0];
            let id = engine.next_request_id("t");
            let s =
                engine.add_request_with_lora(id, o.prompt_ids.clone(), greedy(g.tokens), Some(&a.spec.name));
            let got = common::collect(s.await.unwrap(), 1).await;
            assert_eq!(got.tokens[0], o.output_ids, "adapter {}", a.spec.name);
        }
    }
}
