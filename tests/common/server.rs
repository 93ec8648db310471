//! A real server on 127.0.0.1:0 and a small client for its HTTP, SSE and WebSocket APIs.
#![allow(dead_code)]

use std::path::Path;

use actorllm::config::EngineArgs;
use actorllm::web::ServeArgs;
use futures::StreamExt;
use serde_json::{Value, json};

pub struct TestServer {
    pub base: String,
    pub client: awc::Client,
    /// Directories the server reads from, kept for its life.
    pub dirs: Vec<super::ScratchDir>,
}

/// A server on `model` under the names "test-model" and "test-alias", with `tweak` applied
/// to its flags.
pub async fn start(model: impl AsRef<Path>, tweak: impl FnOnce(&mut ServeArgs)) -> TestServer {
    let mut args =
        ServeArgs::new(EngineArgs { model: model.as_ref().to_path_buf(), ..EngineArgs::default() });
    args.port = 0;
    args.served_model_name = vec!["test-model".into(), "test-alias".into()];
    tweak(&mut args);
    let engine = actorllm::Engine::start(args.engine.clone()).await.expect("engine starts");
    serve(engine, args)
}

/// A server in front of an engine the test started itself.
pub fn serve(engine: actorllm::Engine, args: ServeArgs) -> TestServer {
    let (server, addr) = actorllm::web::start_with_engine(args, engine).expect("server starts");
    actix_rt::spawn(server);
    let client = awc::Client::builder().timeout(std::time::Duration::from_secs(120)).finish();
    TestServer { base: format!("http://{addr}"), client, dirs: Vec::new() }
}

/// A server on the tiny random model of `seed`.
pub async fn start_tiny(seed: u64, tweak: impl FnOnce(&mut ServeArgs)) -> TestServer {
    let model = super::tiny_model(seed);
    let mut s = start(&model, tweak).await;
    s.dirs.push(model);
    s
}

/// A server on the default model, whose generations are slow enough on a CPU that a
/// request of [`LONG`] tokens is still running when a test cancels it or drops its client.
pub async fn default_server(tweak: impl FnOnce(&mut actorllm::web::ServeArgs)) -> TestServer {
    start(super::default_model(), |a| {
        a.engine.kv_cache_space = 1.0;
        tweak(a);
    })
    .await
}

/// Tokens of a request that must still be running when the test acts on it: minutes of
/// generation on the default model, never reached.
pub const LONG: usize = 4000;

pub fn long_request() -> Value {
    json!({"prompt": [21, 22, 23], "max_tokens": LONG, "temperature": 0, "ignore_eos": true})
}

impl TestServer {
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// POSTs JSON; returns (status, body as JSON).
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let mut r = self.client.post(self.url(path)).send_json(body).await.expect("request sent");
        let bytes = r.body().limit(16 << 20).await.expect("body read");
        (r.status().as_u16(), serde_json::from_slice(&bytes).unwrap_or(Value::Null))
    }

    /// POSTs raw bytes with a content type; returns (status, body as JSON).
    pub async fn post_raw(&self, path: &str, content_type: &str, body: Vec<u8>) -> (u16, Value) {
        let mut r = self
            .client
            .post(self.url(path))
            .insert_header(("content-type", content_type))
            .send_body(body)
            .await
            .expect("request sent");
        let bytes = r.body().limit(16 << 20).await.expect("body read");
        (r.status().as_u16(), serde_json::from_slice(&bytes).unwrap_or(Value::Null))
    }

    pub async fn get_text(&self, path: &str) -> (u16, String) {
        let mut r = self.client.get(self.url(path)).send().await.expect("request sent");
        let bytes = r.body().limit(16 << 20).await.expect("body read");
        (r.status().as_u16(), String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Reads a Prometheus sample (first line starting with `prefix`).
    pub async fn metric(&self, prefix: &str) -> f64 {
        let (_, text) = self.get_text("/metrics").await;
        text.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("metric {prefix} missing"))
    }

    /// Polls a metric until it reads `want` (at most 60 s).
    pub async fn wait_for_metric(&self, name: &str, want: f64) {
        let start = std::time::Instant::now();
        loop {
            let v = self.metric(name).await;
            if v == want {
                return;
            }
            assert!(
                start.elapsed() < std::time::Duration::from_secs(60),
                "{name} stayed {v}, expected {want}"
            );
            actix_rt::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// Streams an SSE request and returns the raw `data:` payloads in order (as sent).
    pub async fn sse(&self, path: &str, body: &Value) -> (u16, Vec<String>) {
        let mut r = self.client.post(self.url(path)).send_json(body).await.expect("request sent");
        let status = r.status().as_u16();
        let mut buf = Vec::new();
        while let Some(chunk) = r.next().await {
            buf.extend_from_slice(&chunk.expect("stream chunk"));
        }
        (status, parse_sse(&String::from_utf8(buf).expect("utf-8 stream")))
    }
}

/// Splits an event stream into the data payloads of its events, as an SSE client does;
/// asserts that every event is `data: …` followed by a blank line (or a `:` comment).
pub fn parse_sse(text: &str) -> Vec<String> {
    assert!(text.ends_with("\n\n"), "an event stream ends with a blank line: {text:?}");
    let mut out = Vec::new();
    for event in text.split("\n\n").filter(|e| !e.is_empty()) {
        if event.starts_with(':') {
            continue;
        }
        let data = event.strip_prefix("data: ").unwrap_or_else(|| panic!("event without data: {event:?}"));
        assert!(!data.contains('\n'), "one data line per event: {event:?}");
        out.push(data.to_string());
    }
    out
}
