//! The HTTP server on 127.0.0.1:0 with real HTTP and WebSocket clients: SSE framing as
//! clients parse it, usage chunks, n > 1, stop strings, WebSocket concurrency and cancel,
//! disconnects that abort, bad input in OpenAI's error shape, the API key.

mod common;

use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};

use common::server::{TestServer, start};
use common::tiny_model;

async fn tiny_server() -> TestServer {
    start(&tiny_model(21), |a| a.engine.max_model_len = Some(512)).await
}

fn chunks(data: &[String]) -> Vec<Value> {
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "stream ends with [DONE]");
    data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).expect("chunk is JSON")).collect()
}

#[actix_rt::test]
async fn sse_chat_stream_has_role_first_finish_last_usage_and_done() {
    let s = tiny_server().await;
    let body = json!({"model": "test-model", "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 12, "temperature": 0, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}});
    let (status, data) = s.sse("/v1/chat/completions", &body).await;
    assert_eq!(status, 200);
    let c = chunks(&data);
    let id = c[0]["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("chatcmpl-"));
    assert!(c.iter().all(|x| x["id"] == id.as_str() && x["object"] == "chat.completion.chunk"), "stable id");
    assert_eq!(c[0]["choices"][0]["delta"]["role"], "assistant");
    let last_choice = &c[c.len() - 2]["choices"][0];
    assert_eq!(last_choice["finish_reason"], "length");
    let usage = &c[c.len() - 1];
    assert_eq!(usage["choices"].as_array().unwrap().len(), 0);
    assert_eq!(usage["usage"]["completion_tokens"], 12);
    // The streamed text equals the non-streaming response's text.
    let text: String = c.iter().filter_map(|x| x["choices"][0]["delta"]["content"].as_str()).collect();
    let mut plain = body.clone();
    plain["stream"] = json!(false);
    let (st, full) = s.post("/v1/chat/completions", &plain).await;
    assert_eq!(st, 200);
    assert_eq!(full["choices"][0]["message"]["content"].as_str().unwrap(), text);
    assert_eq!(full["usage"]["completion_tokens"], 12);
}

#[actix_rt::test]
async fn sse_completions_interleave_n_choices_and_cut_stop_strings() {
    let s = tiny_server().await;
    let body = json!({"prompt": [5, 6, 7, 8, 9], "max_tokens": 10, "n": 3, "temperature": 1.0, "seed": 3,
        "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true, "continuous_usage_stats": true}});
    let (_, data) = s.sse("/v1/completions", &body).await;
    let c = chunks(&data);
    let mut finished = [false; 3];
    for x in &c[..c.len() - 1] {
        assert_eq!(x["object"], "text_completion");
        assert!(x["usage"]["prompt_tokens"] == 5, "continuous usage on every chunk");
        let ch = &x["choices"][0];
        let i = ch["index"].as_u64().unwrap() as usize;
        assert!(!finished[i], "no chunk for a choice after its finish");
        if !ch["finish_reason"].is_null() {
            finished[i] = true;
        }
    }
    assert_eq!(finished, [true; 3]);
    assert_eq!(c.last().unwrap()["usage"]["completion_tokens"], 30);
    // Stop string: the text is cut before it and the stop string is reported.
    let greedy = json!({"prompt": [5, 6, 7, 8, 9], "max_tokens": 20, "temperature": 0, "ignore_eos": true});
    let (_, full) = s.post("/v1/completions", &greedy).await;
    let text = full["choices"][0]["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[6..8].iter().collect();
    let mut with_stop = greedy.clone();
    with_stop["stop"] = json!([stop]);
    with_stop["stream"] = json!(true);
    let (_, data) = s.sse("/v1/completions", &with_stop).await;
    let c = chunks(&data);
    let streamed: String = c.iter().filter_map(|x| x["choices"][0]["text"].as_str()).collect();
    assert_eq!(streamed, text[..text.find(&stop).unwrap()]);
    let fin = &c.last().unwrap()["choices"][0];
    assert_eq!(
        (fin["finish_reason"].as_str(), fin["stop_reason"].as_str()),
        (Some("stop"), Some(stop.as_str()))
    );
}

#[actix_rt::test]
async fn websocket_runs_concurrent_generations_and_cancels_one() {
    let s = tiny_server().await;
    let request = json!({"prompt": [11, 12, 13], "max_tokens": 40, "temperature": 0, "ignore_eos": true});
    let (_, alone) = s.post("/v1/completions", &request).await;
    let alone_text = alone["choices"][0]["text"].as_str().unwrap().to_string();
    let long = json!({"prompt": [21, 22], "max_tokens": 400, "temperature": 0, "ignore_eos": true});
    let (_resp, mut ws) = s.client.ws(s.url("/v1/ws")).connect().await.expect("websocket connects");
    let send = |v: Value| awc::ws::Message::Text(v.to_string().into());
    ws.send(send(json!({"type": "generate", "id": "keep", "endpoint": "completions", "request": request})))
        .await
        .unwrap();
    ws.send(send(json!({"type": "generate", "id": "stop-me", "endpoint": "completions", "request": long})))
        .await
        .unwrap();
    let (mut keep_text, mut cancelled_deltas, mut done) = (String::new(), 0, serde_json::Map::new());
    let mut sent_cancel = false;
    while done.len() < 2 {
        let frame = tokio::time::timeout(Duration::from_secs(60), ws.next()).await.expect("frame in time");
        let awc::ws::Frame::Text(t) = frame.unwrap().unwrap() else { continue };
        let v: Value = serde_json::from_slice(&t).unwrap();
        match (v["type"].as_str().unwrap(), v["id"].as_str().unwrap()) {
            ("delta", "keep") => keep_text.push_str(v["text"].as_str().unwrap()),
            ("delta", "stop-me") => {
                cancelled_deltas += 1;
                if cancelled_deltas == 3 && !sent_cancel {
                    sent_cancel = true;
                    ws.send(send(json!({"type": "cancel", "id": "stop-me"}))).await.unwrap();
                }
            }
            ("done", id) => {
                done.insert(id.to_string(), v.clone());
            }
            ("started", _) => assert!(v["request_id"].as_str().unwrap().starts_with("cmpl-")),
            other => panic!("unexpected frame {other:?}: {v}"),
        }
    }
    assert_eq!(keep_text, alone_text, "the other generation is undisturbed");
    assert_eq!(done["keep"]["finish_reason"], "length");
    assert_eq!(done["stop-me"]["finish_reason"], "abort");
    assert!(cancelled_deltas < 400);
    // Bad frames get an error frame and the socket stays open.
    ws.send(send(json!({"type": "generate", "id": "bad", "endpoint": "completions", "request": {"prompt": "x", "top_p": 9}})))
        .await
        .unwrap();
    loop {
        let awc::ws::Frame::Text(t) = ws.next().await.unwrap().unwrap() else { continue };
        let v: Value = serde_json::from_slice(&t).unwrap();
        assert_eq!((v["type"].as_str(), v["id"].as_str()), (Some("error"), Some("bad")));
        assert_eq!(v["error"]["param"], "top_p");
        break;
    }
    assert_eq!(
        s.metric("actorllm:request_aborts_total{model_name=\"test-model\",reason=\"cancelled\"}").await,
        1.0
    );
}

#[actix_rt::test]
async fn dropped_streams_are_aborted_and_free_their_blocks() {
    // The default model, so that the kept streams are still generating a second later.
    let s = start(&common::default_model(), |_| {}).await;
    let body =
        json!({"prompt": [3, 4, 5], "max_tokens": 120, "temperature": 0, "ignore_eos": true, "stream": true});
    let mut keep = Vec::new();
    let mut drop_later = Vec::new();
    for i in 0..16 {
        let r = s.client.post(s.url("/v1/completions")).send_json(&body).await.unwrap();
        if i % 2 == 0 { keep.push(r) } else { drop_later.push(r) }
    }
    // Wait until all sixteen are running (the first step may still be under way).
    let start = Instant::now();
    while s.metric("vllm:num_requests_running").await < 16.0 {
        assert!(start.elapsed() < Duration::from_secs(10), "sixteen streams run");
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    drop(drop_later);
    let start = Instant::now();
    let running = loop {
        let n = s.metric("vllm:num_requests_running").await;
        if n <= 8.0 || start.elapsed() > Duration::from_secs(1) {
            break n;
        }
        actix_rt::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(running, 8.0, "the dropped streams are aborted within a second");
    for mut r in keep {
        while let Some(c) = r.next().await {
            c.unwrap();
        }
    }
    let start = Instant::now();
    while s.metric("actorllm:kv_cache_blocks_free").await != s.metric("actorllm:kv_cache_blocks_total").await
    {
        assert!(start.elapsed() < Duration::from_secs(2), "every block comes back");
        actix_rt::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        s.metric("actorllm:request_aborts_total{model_name=\"test-model\",reason=\"client_disconnected\"}")
            .await,
        8.0
    );
}

#[actix_rt::test]
async fn cancel_endpoint_aborts_by_request_id() {
    let s = tiny_server().await;
    let body =
        json!({"prompt": [3, 4], "max_tokens": 400, "temperature": 0, "ignore_eos": true, "stream": true});
    let mut r = s.client.post(s.url("/v1/completions")).send_json(&body).await.unwrap();
    let id = r.headers().get("x-request-id").unwrap().to_str().unwrap().to_string();
    r.next().await.unwrap().unwrap();
    let (st, v) = s.post(&format!("/v1/requests/{id}/cancel"), &json!({})).await;
    assert_eq!((st, v["cancelled"].as_bool()), (200, Some(true)));
    let mut text = String::new();
    while let Some(c) = r.next().await {
        text.push_str(&String::from_utf8_lossy(&c.unwrap()));
    }
    assert!(text.contains("\"finish_reason\":\"abort\""), "the stream ends with finish_reason abort");
    assert!(text.ends_with("data: [DONE]\n\n"));
    let (st, v) = s.post("/v1/requests/cmpl-nope/cancel", &json!({})).await;
    assert_eq!(st, 404);
    assert!(v["error"]["message"].as_str().unwrap().contains("cmpl-nope"));
}

#[actix_rt::test]
async fn bad_input_gets_the_right_status_and_openai_error_shape() {
    let s = tiny_server().await;
    let ok = |v: &Value| {
        v["error"]["message"].is_string()
            && v["error"]["type"].is_string()
            && v["error"].get("param").is_some()
            && v["error"].get("code").is_some()
    };
    let cases: Vec<(Value, u16, &str, &str)> = vec![
        (json!({"model": "nope", "prompt": "x"}), 404, "model", "does not exist"),
        (json!({"prompt": 5}), 400, "", "Invalid request body"),
        (json!({"prompt": "x", "max_tokens": "ten"}), 400, "", "Invalid request body"),
        (json!({"prompt": "x", "temperature": -1}), 400, "temperature", "temperature"),
        (json!({"prompt": "x", "top_p": 0}), 400, "top_p", "top_p"),
        (json!({"prompt": "x", "top_k": -5}), 400, "top_k", "top_k"),
        (json!({"prompt": "x", "min_p": 2}), 400, "min_p", "min_p"),
        (json!({"prompt": "x", "repetition_penalty": 0}), 400, "repetition_penalty", "repetition_penalty"),
        (json!({"prompt": "x", "presence_penalty": 3}), 400, "presence_penalty", "presence_penalty"),
        (json!({"prompt": "x", "frequency_penalty": -3}), 400, "frequency_penalty", "frequency_penalty"),
        (json!({"prompt": "x", "max_tokens": 0}), 400, "max_tokens", "max_tokens"),
        (json!({"prompt": "x", "n": 1000}), 400, "n", "128"),
        (json!({"prompt": "x", "stop": vec!["a"; 40]}), 400, "stop", "16"),
        (json!({"prompt": "x", "logprobs": 50}), 400, "logprobs", "logprobs"),
        (json!({"prompt": [[1, 2], [99999]]}), 400, "prompt", "out of vocabulary"),
        (json!({"prompt": vec![7; 600]}), 400, "max_tokens", "maximum context length is 512 tokens"),
        (
            json!({"prompt": vec![7; 500], "max_tokens": 100}),
            400,
            "max_tokens",
            "maximum context length is 512 tokens",
        ),
    ];
    for (body, status, param, needle) in cases {
        let (st, v) = s.post("/v1/completions", &body).await;
        assert_eq!(st, status, "{body}: {v}");
        assert!(ok(&v), "OpenAI error shape for {body}: {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{msg:?} should contain {needle:?}");
        if !param.is_empty() {
            assert_eq!(v["error"]["param"], param, "{body}");
        }
    }
    // The context-length message names the input token count.
    let (_, v) = s.post("/v1/completions", &json!({"prompt": vec![7; 600]})).await;
    assert!(v["error"]["message"].as_str().unwrap().contains("600"));
    let (st, v) = s.post_raw("/v1/completions", "application/json", b"{not json".to_vec()).await;
    assert_eq!(st, 400);
    assert!(ok(&v));
    let big = format!("{{\"prompt\": \"{}\"}}", "a".repeat(5 << 20));
    let (st, v) = s.post_raw("/v1/completions", "application/json", big.into_bytes()).await;
    assert_eq!(st, 413);
    assert!(ok(&v));
    let (st, v) = s.post("/v1/chat/completions", &json!({"messages": []})).await;
    assert_eq!((st, v["error"]["param"].as_str()), (400, Some("messages")));
    let (st, v) = s.post("/v1/nothing", &json!({})).await;
    assert_eq!(st, 404);
    assert!(ok(&v));
    // The server still serves after all of that.
    let (st, _) = s.post("/v1/completions", &json!({"prompt": "hi", "max_tokens": 2})).await;
    assert_eq!(st, 200);
}

#[actix_rt::test]
async fn api_key_guards_every_route_but_health() {
    let s = start(&tiny_model(22), |a| a.api_key = Some("sekrit".into())).await;
    let (st, v) = s.post("/v1/completions", &json!({"prompt": "x"})).await;
    assert_eq!((st, v["error"]["type"].as_str()), (401, Some("authentication_error")));
    assert_eq!(s.get_text("/v1/models").await.0, 401);
    assert_eq!(s.get_text("/metrics").await.0, 401);
    assert_eq!(s.get_text("/health").await.0, 200);
    let mut r = s
        .client
        .post(s.url("/v1/completions"))
        .insert_header(("Authorization", "Bearer sekrit"))
        .send_json(&json!({"prompt": "x", "max_tokens": 2}))
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let _ = r.body().await;
    let r = s
        .client
        .get(s.url("/v1/models"))
        .insert_header(("Authorization", "Bearer wrong"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
}

#[actix_rt::test]
async fn models_tokenize_detokenize_health_and_metrics() {
    let s = tiny_server().await;
    let (st, body) = s.get_text("/v1/models").await;
    assert_eq!(st, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["data"][0]["id"], "test-model");
    let (st, v) = s.post("/tokenize", &json!({"prompt": "hello"})).await;
    assert_eq!(st, 200);
    assert_eq!(v["count"], 5);
    let (_, d) = s.post("/detokenize", &json!({"tokens": v["tokens"]})).await;
    assert_eq!(d["prompt"], "hello");
    let (st, v) = s.post("/tokenize", &json!({"messages": [{"role": "user", "content": "hi"}]})).await;
    assert_eq!(st, 200);
    assert!(v["count"].as_u64().unwrap() > 2);
    assert_eq!(s.get_text("/health").await.0, 200);
    let (_, m) = s.get_text("/metrics").await;
    for name in [
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_sum",
        "vllm:request_success_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "actorllm:request_aborts_total",
    ] {
        assert!(m.contains(name), "metrics expose {name}");
    }
}

#[actix_rt::test]
async fn websocket_refuses_oversized_frames_and_answers_pings() {
    let s = tiny_server().await;
    let (_resp, mut ws) =
        s.client.ws(s.url("/v1/ws")).max_frame_size(4 << 20).connect().await.expect("connects");
    ws.send(awc::ws::Message::Ping("are you there".into())).await.unwrap();
    loop {
        match ws.next().await.unwrap().unwrap() {
            awc::ws::Frame::Pong(p) => {
                assert_eq!(&p[..], b"are you there");
                break;
            }
            awc::ws::Frame::Ping(_) => continue,
            other => panic!("expected a pong, got {other:?}"),
        }
    }
    let huge = json!({"type": "generate", "id": "big", "endpoint": "completions", "request": {"prompt": "a".repeat(2 << 20)}});
    ws.send(awc::ws::Message::Text(huge.to_string().into())).await.unwrap();
    let mut saw_error = false;
    while let Some(frame) = ws.next().await {
        match frame {
            Ok(awc::ws::Frame::Text(t)) => {
                let v: Value = serde_json::from_slice(&t).unwrap();
                assert_eq!(v["type"], "error");
                saw_error = true;
            }
            Ok(awc::ws::Frame::Close(reason)) => {
                assert_eq!(reason.map(|r| r.code), Some(awc::ws::CloseCode::Size));
                break;
            }
            Ok(_) => {}
            Err(_) => break,
        }
    }
    assert!(saw_error, "the client is told why");
}
