//! A real server in front of an engine whose model misbehaves at a chosen position (the
//! tiny random Llama, wrapped and registered out of tree): a step that hangs makes
//! `/health` answer 503 until it ends; a step that fails in the middle of a stream ends
//! that stream with an error event (SSE) or frame (WebSocket), and the server goes on
//! serving.

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

fn release_stalled_step() {
    *RELEASED.0.lock().unwrap() = true;
    RELEASED.1.notify_all();
}

/// What the wrapped model does at its position.
#[derive(Clone, Copy)]
enum Fault {
    Stall,
    Fail,
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
            Fault::Stall if meta.positions.contains(&STALL_AT) => {
                let mut released = RELEASED.0.lock().unwrap();
                while !*released {
                    released = RELEASED.1.wait(released).unwrap();
                }
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
