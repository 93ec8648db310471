//! A real server in front of an engine whose model misbehaves at a chosen position (the
//! tiny random Llama, wrapped and registered out of tree): a step that hangs makes
//! `/health` answer 503 until it ends; a step that fails in the middle of a stream ends
//! that stream with an error event (SSE) or frame (WebSocket), and the server goes on
//! serving. Under tensor parallelism, a rank that hangs past `--rank-timeout` or fails
//! part-way fails the group: the stream ends with an error naming the rank, no other
//! rank stays blocked, and `/health` answers 503 from then on.

mod common;

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use actorllm::config::EngineArgs;
use actorllm::kernels::attn::AttnMetadata;
use actorllm::kernels::cpu::CpuDevice;
use actorllm::kernels::{CacheShape, DevResult, Device, DeviceError};
use actorllm::models::llama::{LlamaForCausalLM, STACKED_PARAMS, skip_tensor};
use actorllm::models::lora::LoraAdapter;
use actorllm::models::registry::{ModelEntry, ModelRegistry};
use actorllm::models::{CausalLM, ModelError};
use actorllm::web::ServeArgs;
use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};

use common::server::{TestServer, serve};

/// A step whose tokens include this position waits until [`release_stalled_step`].
const STALL_AT: u32 = 40;
/// A step whose tokens include this position fails.
const FAIL_AT: u32 = 30;

static RELEASED: (Mutex<bool>, Condvar) = (Mutex::new(false), Condvar::new());
/// Releases rank 1's stall ([`Fault::StallRank1`]), apart from the test above's.
static RANK_RELEASED: (Mutex<bool>, Condvar) = (Mutex::new(false), Condvar::new());

fn release(gate: &(Mutex<bool>, Condvar)) {
    *gate.0.lock().unwrap() = true;
    gate.1.notify_all();
}

fn release_stalled_step() {
    release(&RELEASED);
}

fn wait_for(gate: &(Mutex<bool>, Condvar)) {
    let mut released = gate.0.lock().unwrap();
    while !*released {
        released = gate.1.wait(released).unwrap();
    }
}

/// What the wrapped model does at its position.
#[derive(Clone, Copy)]
enum Fault {
    Stall,
    Fail,
    /// Rank 1 of a tensor-parallel group hangs at [`STALL_AT`] until released.
    StallRank1,
    /// Rank 1 of a tensor-parallel group fails at [`FAIL_AT`].
    FailRank1,
}

struct Faulty {
    inner: LlamaForCausalLM<CpuDevice>,
    fault: Fault,
}

impl CausalLM<CpuDevice> for Faulty {
    fn forward(
        &self,
        dev: &CpuDevice,
        input_ids: &[u32],
        kv_caches: &mut [<CpuDevice as Device>::Cache],
        meta: &AttnMetadata,
    ) -> DevResult<<CpuDevice as Device>::Tensor> {
        match self.fault {
            Fault::Fail if meta.positions.contains(&FAIL_AT) => {
                return Err(DeviceError::Other(format!("injected failure at position {FAIL_AT}")));
            }
            Fault::Stall if meta.positions.contains(&STALL_AT) => wait_for(&RELEASED),
            Fault::StallRank1 if dev.tp().rank == 1 && meta.positions.contains(&STALL_AT) => {
                wait_for(&RANK_RELEASED)
            }
            Fault::FailRank1 if dev.tp().rank == 1 && meta.positions.contains(&FAIL_AT) => {
                return Err(DeviceError::Other(format!("injected failure on rank 1 at position {FAIL_AT}")));
            }
            _ => {}
        }
        self.inner.forward(dev, input_ids, kv_caches, meta)
    }
    fn compute_logits(
        &self,
        dev: &CpuDevice,
        hidden: &<CpuDevice as Device>::Tensor,
        meta: &AttnMetadata,
    ) -> DevResult<<CpuDevice as Device>::Tensor> {
        self.inner.compute_logits(dev, hidden, meta)
    }
    fn cache_shape(&self, num_blocks: usize, block_size: usize) -> (usize, CacheShape) {
        self.inner.cache_shape(num_blocks, block_size)
    }
    fn weight_bytes(&self) -> usize {
        self.inner.weight_bytes()
    }
    fn set_lora_slot(
        &mut self,
        dev: &CpuDevice,
        slot: usize,
        adapter: Option<&LoraAdapter>,
    ) -> DevResult<()> {
        self.inner.set_lora_slot(dev, slot, adapter)
    }
    fn has_lora(&self) -> bool {
        self.inner.has_lora()
    }
    fn prefix_cacheable(&self) -> bool {
        self.inner.prefix_cacheable()
    }

    fn recompute_past(&self) -> Option<u32> {
        self.inner.recompute_past()
    }
}

/// A server on the tiny model with `fault` at its position, `tweak` applied to its flags.
async fn faulty_server(fault: Fault, tweak: impl FnOnce(&mut ServeArgs)) -> TestServer {
    let model = common::tiny_model(51);
    let mut registry = ModelRegistry::<CpuDevice>::default();
    let config = actorllm::models::llama::entry::<CpuDevice>().config;
    let construct: actorllm::models::registry::Constructor<CpuDevice> = match fault {
        Fault::Stall => |d, c, w, o| -> Result<Box<dyn CausalLM<CpuDevice>>, ModelError> {
            Ok(Box::new(Faulty { inner: LlamaForCausalLM::load(d, c, w, o)?, fault: Fault::Stall }))
        },
        Fault::Fail => |d, c, w, o| -> Result<Box<dyn CausalLM<CpuDevice>>, ModelError> {
            Ok(Box::new(Faulty { inner: LlamaForCausalLM::load(d, c, w, o)?, fault: Fault::Fail }))
        },
        Fault::StallRank1 => |d, c, w, o| -> Result<Box<dyn CausalLM<CpuDevice>>, ModelError> {
            Ok(Box::new(Faulty { inner: LlamaForCausalLM::load(d, c, w, o)?, fault: Fault::StallRank1 }))
        },
        Fault::FailRank1 => |d, c, w, o| -> Result<Box<dyn CausalLM<CpuDevice>>, ModelError> {
            Ok(Box::new(Faulty { inner: LlamaForCausalLM::load(d, c, w, o)?, fault: Fault::FailRank1 }))
        },
    };
    registry.register_model(
        "LlamaForCausalLM",
        ModelEntry { config, construct, stacked_params: STACKED_PARAMS, skip: skip_tensor },
    );
    let mut args = ServeArgs::new(EngineArgs { model: model.to_path_buf(), ..EngineArgs::default() });
    args.port = 0;
    args.served_model_name = vec!["test-model".into()];
    tweak(&mut args);
    let engine = actorllm::Engine::start_with(args.engine.clone(), registry).await.expect("engine starts");
    let mut s = serve(engine, args);
    s.dirs.push(model);
    s
}

/// Polls `/health` until it answers `status` (at most 60 s); returns its body.
async fn health_becomes(s: &TestServer, status: u16) -> String {
    let start = Instant::now();
    loop {
        let (st, body) = s.get_text("/health").await;
        if st == status {
            return body;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "/health stayed {st}, expected {status}");
        actix_rt::time::sleep(Duration::from_millis(50)).await;
    }
}

#[actix_rt::test]
async fn health_reports_a_stuck_step_until_it_ends() {
    let s = faulty_server(Fault::Stall, |a| a.engine_iteration_timeout = 0.5).await;
    assert_eq!(s.get_text("/health").await.0, 200);
    // The prompt takes positions 0 .. 2: the step at position 40 hangs.
    let body = json!({"prompt": [3, 4, 5], "max_tokens": 60, "temperature": 0, "ignore_eos": true});
    let (client, url) = (s.client.clone(), s.url("/v1/completions"));
    let request = actix_rt::spawn(async move {
        let mut r = client.post(url).send_json(&body).await.unwrap();
        let v: Value = r.json().await.unwrap();
        v
    });
    let body = health_becomes(&s, 503).await;
    let v: Value = serde_json::from_str(&body).expect("an OpenAI error body");
    assert!(v["error"]["message"].as_str().unwrap().contains("stuck"), "{v}");
    assert_eq!(s.metric("vllm:num_requests_running").await, 1.0, "the stalled request is still running");
    release_stalled_step();
    let v = request.await.unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 60, "the request completes once the step ends: {v}");
    health_becomes(&s, 200).await;
}

#[actix_rt::test]
async fn a_failure_in_the_middle_of_a_stream_ends_it_with_an_error_and_the_server_goes_on() {
    let s = faulty_server(Fault::Fail, |_| {}).await;
    // The prompt takes positions 0 .. 2 and the k-th token is fed at position 2 + k: the
    // step at position 30 fails after 28 tokens were sampled.
    // With logprobs, every token gets a chunk (even one whose text is still incomplete).
    let long =
        json!({"prompt": [3, 4, 5], "max_tokens": 100, "temperature": 0, "ignore_eos": true, "logprobs": 1});
    let mut sse = long.clone();
    sse["stream"] = json!(true);
    let (status, data) = s.sse("/v1/completions", &sse).await;
    assert_eq!(status, 200, "the stream began");
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let events: Vec<Value> =
        data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    let (error, tokens) = events.split_last().unwrap();
    assert_eq!(tokens.len(), 28, "one chunk per token sampled before the failure");
    assert!(tokens.iter().all(|t| t["choices"][0]["finish_reason"].is_null()));
    let message = error["error"]["message"].as_str().expect("the last event is an OpenAI error");
    assert!(message.contains("injected failure"), "{message}");
    assert!(error["error"]["type"].is_string() && error["error"].get("code").is_some(), "{error}");

    // Over the WebSocket: deltas, then an error frame for that id; the socket stays open
    // and serves the next generation, which no step of the failed one disturbs.
    let (_resp, mut ws) = s.client.ws(s.url("/v1/ws")).connect().await.expect("websocket connects");
    let frame = |v: Value| awc::ws::Message::Text(v.to_string().into());
    ws.send(frame(json!({"type": "generate", "id": "bad", "endpoint": "completions", "request": long})))
        .await
        .unwrap();
    let mut next_json = async || loop {
        let next = tokio::time::timeout(Duration::from_secs(60), ws.next()).await.expect("a frame in time");
        if let awc::ws::Frame::Text(t) = next.unwrap().unwrap() {
            return serde_json::from_slice::<Value>(&t).unwrap();
        }
    };
    let mut deltas = 0;
    let error = loop {
        let v = next_json().await;
        match (v["type"].as_str().unwrap(), v["id"].as_str()) {
            ("delta", Some("bad")) => deltas += 1,
            ("error", Some("bad")) => break v,
            ("started", _) => {}
            other => panic!("unexpected frame {other:?}: {v}"),
        }
    };
    assert_eq!(deltas, 28, "every token sampled before the failing step is sent");
    assert!(error["error"]["message"].as_str().unwrap().contains("injected failure"), "{error}");
    ws.send(frame(json!({"type": "generate", "id": "after", "endpoint": "completions",
        "request": {"prompt": [3, 4, 5], "max_tokens": 5, "temperature": 0, "ignore_eos": true}})))
        .await
        .unwrap();
    loop {
        let next = tokio::time::timeout(Duration::from_secs(60), ws.next()).await.expect("a frame in time");
        let awc::ws::Frame::Text(t) = next.unwrap().unwrap() else { continue };
        let v: Value = serde_json::from_slice(&t).unwrap();
        assert_ne!(v["type"], "error", "{v}");
        if v["id"] == "after" && v["type"] == "done" {
            assert_eq!(v["usage"]["completion_tokens"], 5, "{v}");
            break;
        }
    }
    let short = json!({"prompt": [3, 4, 5], "max_tokens": 5, "ignore_eos": true});
    let (st, v) = s.post("/v1/completions", &short).await;
    assert_eq!((st, v["usage"]["completion_tokens"].as_u64()), (200, Some(5)), "{v}");
    assert_eq!(s.get_text("/health").await.0, 200);
}

/// Streams a long request and returns its events' data (the last is `[DONE]`), with how
/// long after the first token the stream ended.
async fn stream_until_it_ends(s: &TestServer) -> (Vec<String>, Duration) {
    let body =
        json!({"prompt": [3, 4, 5], "max_tokens": 100, "temperature": 0, "ignore_eos": true, "stream": true});
    let mut r = s.client.post(s.url("/v1/completions")).send_json(&body).await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let (mut text, mut first) = (String::new(), None);
    while let Some(chunk) =
        tokio::time::timeout(Duration::from_secs(60), r.next()).await.expect("a chunk in time")
    {
        text.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
        first.get_or_insert_with(Instant::now);
    }
    (common::server::parse_sse(&text), first.unwrap().elapsed())
}

/// A server on two ranks with `fault` and `--rank-timeout rank_timeout`, and a long
/// stream's events on it, as [`stream_until_it_ends`] gives them.
async fn two_ranks_stream(fault: Fault, rank_timeout: f64) -> (TestServer, Vec<String>, Duration) {
    let s = faulty_server(fault, |a| {
        a.engine.tensor_parallel_size = 2;
        a.engine.cluster.rank_timeout = rank_timeout;
    })
    .await;
    let (data, took) = stream_until_it_ends(&s).await;
    (s, data, took)
}

/// The error event a stream ended with, checked to come right before `[DONE]`.
fn last_error(data: &[String]) -> String {
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let v: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    v["error"]["message"].as_str().expect("an error event before [DONE]").to_string()
}

#[actix_rt::test]
async fn a_rank_that_hangs_past_the_rank_timeout_fails_the_group_by_name() {
    let (s, data, took) = two_ranks_stream(Fault::StallRank1, 1.0).await;
    let message = last_error(&data);
    assert!(message.contains("rank 1 did not reach a collective within 1.0 s"), "{message}");
    assert!(took < Duration::from_secs(20), "the stream ended {took:?} after its first token");
    // The group stays failed, and says why.
    let body = health_becomes(&s, 503).await;
    assert!(body.contains("rank 1 did not reach"), "{body}");
    let (status, v) = s.post("/v1/completions", &json!({"prompt": [3, 4], "max_tokens": 2})).await;
    assert_eq!(status, 503, "{v}");
    // The hung rank, released, finds the group failed and stops waiting too.
    release(&RANK_RELEASED);
}

#[actix_rt::test]
async fn a_rank_that_fails_part_way_fails_the_group_at_once() {
    // A rank timeout far past the test's own: the others stop waiting because rank 1
    // failed the group, not because it timed out.
    let (s, data, took) = two_ranks_stream(Fault::FailRank1, 600.0).await;
    let message = last_error(&data);
    assert!(message.contains("injected failure on rank 1"), "{message}");
    assert!(took < Duration::from_secs(20), "the stream ended {took:?} after its first token");
    let body = health_becomes(&s, 503).await;
    assert!(body.contains("rank 1: "), "{body}");
}
