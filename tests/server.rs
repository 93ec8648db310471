//! The HTTP server on 127.0.0.1:0 with real HTTP and WebSocket clients: SSE framing as
//! clients parse it, usage chunks, n > 1, stop strings, WebSocket concurrency and cancel,
//! disconnects that abort, bad input in OpenAI's error shape, the API key.

mod common;

use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};

use common::server::{LONG, TestServer, default_server, long_request, start_tiny};

async fn tiny_server() -> TestServer {
    start_tiny(21, |a| a.engine.max_model_len = Some(512)).await
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

/// The first golden prompt, greedy: transformers' continuation (it ends with EOS).
fn golden_request() -> (Value, String) {
    let p = common::golden::load().prompts.remove(0);
    let body = json!({"prompt": p.text, "max_tokens": p.output_ids.len() + 2, "temperature": 0});
    (body, p.output_text)
}

fn ws_text(v: Value) -> awc::ws::Message {
    awc::ws::Message::Text(v.to_string().into())
}

/// The next text frame as JSON, answering the server's pings meanwhile as a client does
/// (other frames are skipped).
async fn next_json<S>(ws: &mut S) -> Value
where
    S: futures::Stream<Item = Result<awc::ws::Frame, awc::error::WsProtocolError>>
        + futures::Sink<awc::ws::Message, Error = awc::error::WsProtocolError>
        + Unpin,
{
    loop {
        let frame = tokio::time::timeout(Duration::from_secs(60), ws.next()).await.expect("a frame in time");
        match frame.expect("socket open").expect("a frame") {
            awc::ws::Frame::Text(t) => return serde_json::from_slice(&t).expect("JSON frame"),
            awc::ws::Frame::Ping(p) => ws.send(awc::ws::Message::Pong(p)).await.expect("pong sent"),
            _ => {}
        }
    }
}

#[actix_rt::test]
async fn websocket_runs_concurrent_generations_and_cancels_one() {
    let s = default_server(|_| {}).await;
    let (request, want) = golden_request();
    let (_resp, mut ws) = s.client.ws(s.url("/v1/ws")).connect().await.expect("websocket connects");
    ws.send(ws_text(
        json!({"type": "generate", "id": "keep", "endpoint": "completions", "request": request}),
    ))
    .await
    .unwrap();
    ws.send(ws_text(
        json!({"type": "generate", "id": "stop-me", "endpoint": "completions", "request": long_request()}),
    ))
    .await
    .unwrap();
    let (mut keep_text, mut cancelled_deltas, mut done) = (String::new(), 0, serde_json::Map::new());
    while done.len() < 2 {
        let v = next_json(&mut ws).await;
        match (v["type"].as_str().unwrap(), v["id"].as_str().unwrap()) {
            ("delta", "keep") => keep_text.push_str(v["text"].as_str().unwrap()),
            ("delta", "stop-me") => {
                cancelled_deltas += 1;
                if cancelled_deltas == 3 {
                    ws.send(ws_text(json!({"type": "cancel", "id": "stop-me"}))).await.unwrap();
                }
            }
            ("done", id) => {
                done.insert(id.to_string(), v.clone());
            }
            ("started", _) => assert!(v["request_id"].as_str().unwrap().starts_with("cmpl-")),
            other => panic!("unexpected frame {other:?}: {v}"),
        }
    }
    assert_eq!(keep_text, want, "the other generation gives transformers' text");
    assert_eq!(done["keep"]["finish_reason"], "stop");
    assert_eq!(done["stop-me"]["finish_reason"], "abort");
    assert!((3..LONG).contains(&cancelled_deltas), "{cancelled_deltas} deltas");
    assert_eq!(
        done["stop-me"]["usage"]["completion_tokens"], cancelled_deltas,
        "every sampled token was sent"
    );
    // Bad frames get an error frame and the socket stays open.
    ws.send(ws_text(json!({"type": "generate", "id": "bad", "endpoint": "completions", "request": {"prompt": "x", "top_p": 9}})))
        .await
        .unwrap();
    let v = next_json(&mut ws).await;
    assert_eq!((v["type"].as_str(), v["id"].as_str()), (Some("error"), Some("bad")));
    assert_eq!(v["error"]["param"], "top_p");
    assert_eq!(
        s.metric("actorllm:request_aborts_total{model_name=\"test-model\",reason=\"cancelled\"}").await,
        1.0
    );
    assert_eq!(s.metric("vllm:num_requests_running").await, 0.0);
}

/// Closing a socket aborts its generations; so does a socket that stays silent (no frame,
/// not even a pong) past `--ws-idle-timeout`, which the server closes with "going away".
/// A client that answers the pings stays connected.
#[actix_rt::test]
async fn websocket_close_and_silence_abort_its_generations() {
    let s = default_server(|a| a.ws_idle_timeout = 2.0).await;
    let gone = "actorllm:request_aborts_total{model_name=\"test-model\",reason=\"client_disconnected\"}";
    let generate =
        json!({"type": "generate", "id": "g", "endpoint": "completions", "request": long_request()});
    // Closed by the client once its generation is under way.
    let (_resp, mut ws) = s.client.ws(s.url("/v1/ws")).connect().await.expect("websocket connects");
    ws.send(ws_text(generate.clone())).await.unwrap();
    while next_json(&mut ws).await["type"] != "delta" {}
    ws.send(awc::ws::Message::Close(None)).await.unwrap();
    drop(ws);
    s.wait_for_metric(gone, 1.0).await;
    s.wait_for_metric("vllm:num_requests_running", 0.0).await;
    // Silent: the server closes it and aborts the generation.
    let (_resp, mut silent) = s.client.ws(s.url("/v1/ws")).connect().await.expect("websocket connects");
    silent.send(ws_text(generate.clone())).await.unwrap();
    let closed = loop {
        let frame =
            tokio::time::timeout(Duration::from_secs(60), silent.next()).await.expect("closed in time");
        match frame {
            Some(Ok(awc::ws::Frame::Close(reason))) => break reason,
            Some(Ok(_)) => {}
            other => panic!("expected a close frame, got {other:?}"),
        }
    };
    assert_eq!(closed.map(|r| r.code), Some(awc::ws::CloseCode::Away));
    s.wait_for_metric(gone, 2.0).await;
    s.wait_for_metric("vllm:num_requests_running", 0.0).await;
    // Answering pings for two timeouts keeps the socket open.
    let (_resp, mut live) = s.client.ws(s.url("/v1/ws")).connect().await.expect("websocket connects");
    let until = Instant::now() + Duration::from_secs(4);
    let mut pings = 0;
    while let Ok(frame) = tokio::time::timeout_at(until.into(), live.next()).await {
        match frame {
            Some(Ok(awc::ws::Frame::Ping(p))) => {
                pings += 1;
                live.send(awc::ws::Message::Pong(p)).await.unwrap();
            }
            other => panic!("expected pings, got {other:?}"),
        }
    }
    assert!(pings >= 8, "{pings} pings in two timeouts");
    let (request, want) = golden_request();
    live.send(ws_text(json!({"type": "generate", "id": "g", "endpoint": "completions", "request": request})))
        .await
        .unwrap();
    let mut text = String::new();
    loop {
        let frame =
            tokio::time::timeout(Duration::from_secs(60), live.next()).await.expect("a frame in time");
        match frame.expect("socket open").expect("a frame") {
            awc::ws::Frame::Ping(p) => live.send(awc::ws::Message::Pong(p)).await.unwrap(),
            awc::ws::Frame::Text(t) => {
                let v: Value = serde_json::from_slice(&t).unwrap();
                match v["type"].as_str().unwrap() {
                    "delta" => text.push_str(v["text"].as_str().unwrap()),
                    "done" => break,
                    _ => {}
                }
            }
            other => panic!("unexpected frame {other:?}"),
        }
    }
    assert_eq!(text, want);
}

/// Sixteen streams; the clients of eight go away while all sixteen are generating. Those
/// eight are aborted (as client_disconnected) while the other eight keep running, and
/// every block comes back once the rest are cancelled.
#[actix_rt::test]
async fn dropped_streams_are_aborted_and_free_their_blocks() {
    let s = default_server(|_| {}).await;
    let mut body = long_request();
    body["stream"] = json!(true);
    let mut keep = Vec::new();
    let mut drop_later = Vec::new();
    for i in 0..16 {
        let r = s.client.post(s.url("/v1/completions")).send_json(&body).await.unwrap();
        if i % 2 == 0 { keep.push(r) } else { drop_later.push(r) }
    }
    s.wait_for_metric("vllm:num_requests_running", 16.0).await;
    drop(drop_later);
    s.wait_for_metric("vllm:num_requests_running", 8.0).await;
    let gone = "actorllm:request_aborts_total{model_name=\"test-model\",reason=\"client_disconnected\"}";
    assert_eq!(s.metric(gone).await, 8.0);
    // The kept eight are still streaming; cancel them by id.
    for r in &mut keep {
        let id = r.headers().get("x-request-id").unwrap().to_str().unwrap().to_string();
        let (st, v) = s.post(&format!("/v1/requests/{id}/cancel"), &json!({})).await;
        assert_eq!((st, v["cancelled"].as_bool()), (200, Some(true)), "{id} was still running");
    }
    for mut r in keep {
        let mut text = String::new();
        while let Some(c) = r.next().await {
            text.push_str(&String::from_utf8_lossy(&c.unwrap()));
        }
        assert!(text.contains("\"finish_reason\":\"abort\"") && text.ends_with("data: [DONE]\n\n"), "{text}");
    }
    s.wait_for_metric("actorllm:kv_cache_blocks_free", s.metric("actorllm:kv_cache_blocks_total").await)
        .await;
    assert_eq!(s.metric(gone).await, 8.0, "the kept streams were cancelled, not dropped");
}

#[actix_rt::test]
async fn cancel_endpoint_aborts_by_request_id() {
    let s = default_server(|_| {}).await;
    let mut body = long_request();
    body["stream"] = json!(true);
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

/// Every route but `/health` and the playground's files refuses a request without the
/// key or with a wrong one, as a header or (on the WebSocket) as `?api_key=`.
#[actix_rt::test]
async fn api_key_guards_every_route_but_health() {
    let s = start_tiny(22, |a| a.api_key = Some("sekrit".into())).await;
    let guarded = [
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("POST", "/v1/requests/cmpl-x/cancel"),
        ("POST", "/v1/load_lora_adapter"),
        ("POST", "/v1/unload_lora_adapter"),
        ("GET", "/v1/ws"),
        ("GET", "/metrics"),
        ("GET", "/v1/no-such-route"),
    ];
    let status = |method: &'static str, path: &'static str, key: Option<&'static str>| {
        let mut r = match method {
            "GET" => s.client.get(s.url(path)),
            _ => s.client.post(s.url(path)).insert_header(("content-type", "application/json")),
        };
        if let Some(k) = key {
            r = r.insert_header(("Authorization", format!("Bearer {k}")));
        }
        async move {
            let mut resp = r.send_body("{}").await.expect("request sent");
            let body: Value = resp.json().await.unwrap_or(Value::Null);
            (resp.status().as_u16(), body)
        }
    };
    for (method, path) in guarded {
        for key in [None, Some("wrong"), Some("sekri"), Some("sekrit2")] {
            let (st, v) = status(method, path, key).await;
            assert_eq!(st, 401, "{method} {path} with key {key:?}");
            assert_eq!(v["error"]["type"], "authentication_error", "{method} {path}: {v}");
        }
        let (st, _) = status(method, path, Some("sekrit")).await;
        assert_ne!(st, 401, "{method} {path} with the right key");
    }
    for path in ["/health", "/", "/static/app.js", "/static/style.css", "/favicon.ico"] {
        assert_eq!(s.get_text(path).await.0, 200, "{path} is open");
    }
    let (st, v) = status("POST", "/v1/completions", Some("sekrit")).await;
    assert_eq!(st, 400, "the key lets the request through to validation: {v}");
    // Browsers cannot set headers on a WebSocket: the key may come as ?api_key=.
    for (query, ok) in
        [("?api_key=sekrit", true), ("?api_key=wrong", false), ("", false), ("?api_key=", false)]
    {
        let res = s.client.ws(s.url(&format!("/v1/ws{query}"))).connect().await;
        match (res, ok) {
            (Ok((resp, _)), true) => assert_eq!(resp.status().as_u16(), 101),
            (Err(awc::error::WsClientError::InvalidResponseStatus(st)), false) => {
                assert_eq!(st.as_u16(), 401)
            }
            (other, _) => panic!("/v1/ws{query}: {:?}", other.map(|(r, _)| r.status())),
        }
    }
}

/// What the OpenAI clients read beyond the text: chat logprobs, completions echo, a list
/// of prompts, on the default model against transformers' continuations.
#[actix_rt::test]
async fn chat_logprobs_echo_and_prompt_lists() {
    let s = default_server(|_| {}).await;
    let golden = common::golden::load();
    // Chat logprobs: one entry per token, the greedy token first among its alternatives.
    let chat = &golden.chats[0];
    let body = json!({"messages": chat.messages, "max_tokens": 12, "temperature": 0, "logprobs": true,
        "top_logprobs": 3});
    let (st, v) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(st, 200, "{v}");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(chat.output_text.starts_with(content) && !content.is_empty(), "{content:?}");
    let entries = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(entries.len() as u64, v["usage"]["completion_tokens"].as_u64().unwrap());
    let mut joined = String::new();
    for e in entries {
        let token = e["token"].as_str().unwrap();
        joined.push_str(token);
        let bytes: Vec<u8> =
            e["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8).collect();
        assert_eq!(bytes, token.as_bytes());
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(
            (&top[0]["token"], &top[0]["logprob"]),
            (&e["token"], &e["logprob"]),
            "greedy takes the top"
        );
        let lps: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(lps.windows(2).all(|w| w[0] >= w[1]) && lps[0] <= 0.0, "{lps:?}");
    }
    assert_eq!(joined, content, "the tokens spell the answer");
    // Echo: the prompt, then the continuation; logprobs offsets count from the prompt's end.
    let p = &golden.prompts[0];
    let (_, plain) =
        s.post("/v1/completions", &json!({"prompt": p.text, "max_tokens": 6, "temperature": 0})).await;
    let continuation = plain["choices"][0]["text"].as_str().unwrap();
    assert!(p.output_text.starts_with(continuation) && !continuation.is_empty());
    let body = json!({"prompt": p.text, "max_tokens": 6, "temperature": 0, "echo": true, "logprobs": 1});
    let (_, v) = s.post("/v1/completions", &body).await;
    assert_eq!(v["choices"][0]["text"], format!("{}{continuation}", p.text));
    assert_eq!(v["choices"][0]["logprobs"]["text_offset"][0], p.text.len());
    assert_eq!(v["choices"][0]["logprobs"]["tokens"].as_array().unwrap().len(), 6);
    // A list of prompts: one choice each, in order, each its own greedy continuation.
    let texts: Vec<&str> = golden.prompts[..3].iter().map(|p| p.text.as_str()).collect();
    let (st, v) =
        s.post("/v1/completions", &json!({"prompt": texts, "max_tokens": 6, "temperature": 0})).await;
    assert_eq!(st, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    let mut prompt_tokens = 0;
    for (i, (c, p)) in choices.iter().zip(&golden.prompts).enumerate() {
        assert_eq!(c["index"], i);
        let text = c["text"].as_str().unwrap();
        assert!(p.output_text.starts_with(text) && !text.is_empty(), "choice {i}: {text:?}");
        prompt_tokens += p.prompt_ids.len();
    }
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(v["usage"]["completion_tokens"], 18);
}

/// The counters and histograms move by what the requests did.
#[actix_rt::test]
async fn metrics_count_what_the_requests_did() {
    let s = tiny_server().await;
    let requests = [(vec![5, 6, 7], 4), (vec![8; 11], 9), (vec![9, 10], 1)];
    for (prompt, max_tokens) in &requests {
        let body = json!({"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true, "stream": true});
        let (st, _) = s.sse("/v1/completions", &body).await;
        assert_eq!(st, 200);
    }
    let n = requests.len() as f64;
    let prompt_tokens: usize = requests.iter().map(|r| r.0.len()).sum();
    let generated: usize = requests.iter().map(|r| r.1).sum();
    let m = |name: &'static str| s.metric(name);
    assert_eq!(m("vllm:prompt_tokens_total").await, prompt_tokens as f64);
    assert_eq!(m("vllm:generation_tokens_total").await, generated as f64);
    let by_reason =
        |r: &str| format!("vllm:request_success_total{{model_name=\"test-model\",finished_reason=\"{r}\"}}");
    assert_eq!(s.metric(&by_reason("length")).await, n);
    assert_eq!(s.metric(&by_reason("stop")).await, 0.0);
    assert_eq!(m("vllm:e2e_request_latency_seconds_count").await, n);
    assert_eq!(m("vllm:time_to_first_token_seconds_count").await, n);
    assert_eq!(m("vllm:inter_token_latency_seconds_count").await, (generated as f64) - n);
    assert!(m("vllm:e2e_request_latency_seconds_sum").await > 0.0);
    let bucket = |le: &str| {
        format!("vllm:e2e_request_latency_seconds_bucket{{model_name=\"test-model\",le=\"{le}\"}}")
    };
    assert_eq!(s.metric(&bucket("+Inf")).await, n, "every request falls in the last bucket");
    assert_eq!(m("vllm:num_requests_running").await, 0.0);
    s.wait_for_metric("vllm:kv_cache_usage_perc", 0.0).await;
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
    // Refused from its header, with the reason in the close frame.
    let mut reason = None;
    while let Some(frame) = ws.next().await {
        match frame {
            Ok(awc::ws::Frame::Close(r)) => {
                reason = r;
                break;
            }
            Ok(awc::ws::Frame::Ping(_)) => {}
            Ok(other) => panic!("expected the close, got {other:?}"),
            Err(_) => break,
        }
    }
    let reason = reason.expect("a close frame with a reason");
    assert_eq!(reason.code, awc::ws::CloseCode::Size);
    assert!(reason.description.unwrap_or_default().contains("over the limit of 1048576 bytes"));
}

/// `bench serve`'s client sees the first token when a raw socket reader does (one write,
/// bytes read as they arrive): a client whose request waited on Nagle's algorithm, or
/// whose reads batched the stream, would show the delayed-ACK wait (about 40 ms) on top.
#[actix_rt::test]
async fn the_bench_client_times_streams_as_a_raw_socket_reader_does() {
    let s = start_tiny(61, |_| {}).await;
    let body = json!({"prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 16, "temperature": 0,
        "ignore_eos": true, "stream": true, "logprobs": 0});
    let host = s.url("").trim_start_matches("http://").to_string();
    let raw = |body: Value| {
        let host = host.clone();
        actix_rt::task::spawn_blocking(move || {
            use std::io::{Read, Write};
            let body = body.to_string();
            let req = format!(
                "POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let mut sock = std::net::TcpStream::connect(&host).unwrap();
            sock.set_nodelay(true).unwrap();
            let start = Instant::now();
            sock.write_all(req.as_bytes()).unwrap();
            let (mut seen, mut buf) = (Vec::new(), [0u8; 4096]);
            loop {
                let n = sock.read(&mut buf).unwrap();
                assert!(n > 0, "the stream ended before a token");
                seen.extend_from_slice(&buf[..n]);
                if String::from_utf8_lossy(&seen).contains("\"text\":\"") {
                    return start.elapsed().as_secs_f64();
                }
            }
        })
    };
    let (mut bench, mut socket) = (Vec::new(), Vec::new());
    for _ in 0..7 {
        let (ttft, _, tokens) =
            actorllm::bench::serve::stream_request(&s.url(""), "/v1/completions", &body).await.unwrap();
        assert_eq!(tokens, 16);
        bench.push(ttft);
        socket.push(raw(body.clone()).await.unwrap());
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2] * 1e3
    };
    let (b, r) = (median(bench), median(socket));
    assert!(
        b <= 2.0 * r + 10.0,
        "bench client's first token after {b:.1} ms, a raw reader's after {r:.1} ms"
    );
}

/// Logprob counts: up to 20 alternatives a token on both endpoints; -1 (vLLM's "the whole
/// vocabulary") and 21 are refused with a 400 naming the field.
#[actix_rt::test]
async fn logprob_counts_go_to_twenty_and_minus_one_is_refused_by_name() {
    let s = start_tiny(62, |_| {}).await;
    let chat = |top: i64| {
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "logprobs": true, "top_logprobs": top})
    };
    let (st, v) = s.post("/v1/chat/completions", &chat(20)).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["logprobs"]["content"][0]["top_logprobs"].as_array().unwrap().len(), 20);
    let completion = |n: i64| json!({"prompt": [5, 6, 7], "max_tokens": 2, "logprobs": n});
    // (Completions key them by text, where the tiny model's byte tokens may coincide.)
    let (st, v) = s.post("/v1/completions", &completion(20)).await;
    assert_eq!(st, 200, "{v}");
    for (path, body, field) in [
        ("/v1/completions", completion(-1), "logprobs"),
        ("/v1/completions", completion(21), "logprobs"),
        ("/v1/chat/completions", chat(-1), "top_logprobs"),
        ("/v1/chat/completions", chat(21), "top_logprobs"),
    ] {
        let (st, v) = s.post(path, &body).await;
        assert_eq!(st, 400, "{path} {body}: {v}");
        assert_eq!(v["error"]["param"], field, "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(field) && message.contains("20"), "{message}");
    }
}

/// Fields clients send routinely are accepted; a vLLM field that would change the output
/// and is not implemented gets a 400 naming it (never silently ignored); at its default
/// value it is accepted.
#[actix_rt::test]
async fn unimplemented_fields_are_refused_by_name_and_routine_ones_accepted() {
    let s = start_tiny(63, |_| {}).await;
    let with = |extra: Value| {
        let mut body = json!({"prompt": [5, 6, 7], "max_tokens": 2});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    let routine = json!({"user": "u1", "metadata": {"k": "v"}, "store": false, "service_tier": "auto",
        "use_beam_search": false, "length_penalty": 1.0, "early_stopping": false, "bad_words": [],
        "priority": 0, "chat_template_kwargs": {}});
    let (st, v) = s.post("/v1/completions", &with(routine)).await;
    assert_eq!(st, 200, "{v}");
    for (field, value) in [
        // These two need use_beam_search.
        ("length_penalty", json!(0.8)),
        ("early_stopping", json!(true)),
        ("truncate_prompt_tokens", json!(2)),
        // A priority needs --scheduling-policy priority.
        ("priority", json!(3)),
    ] {
        let (st, v) = s.post("/v1/completions", &with(json!({ field: value }))).await;
        assert_eq!(st, 400, "{field}: {v}");
        assert_eq!(v["error"]["param"], field, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(field), "{v}");
    }
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "truncate_prompt_tokens": 2});
    let (st, v) = s.post("/v1/chat/completions", &chat).await;
    assert_eq!((st, &v["error"]["param"]), (400, &json!("truncate_prompt_tokens")), "{v}");
}

/// `use_beam_search` over HTTP on the default model: completions give transformers'
/// hypotheses best first (text, finish reason, usage); chat gives what completions gives
/// for its rendered prompt; a streamed beam search, and what beam search cannot honour, are
/// 400s naming the field.
#[actix_rt::test]
async fn beam_search_over_http_gives_transformers_hypotheses() {
    let s = common::server::start(common::default_model(), |_| {}).await;
    let g = common::golden::load();
    // A search whose hypotheses all run to the length limit, and one where most end at EOS.
    for b in [&g.beams[0], &g.beams[5]] {
        let body = json!({"prompt": b.prompt_ids, "use_beam_search": true, "n": b.n, "best_of": b.num_beams,
            "length_penalty": b.length_penalty, "early_stopping": b.early_stopping, "max_tokens": b.max_tokens});
        let (st, v) = s.post("/v1/completions", &body).await;
        assert_eq!(st, 200, "{v}");
        let choices = v["choices"].as_array().unwrap();
        assert_eq!(choices.len(), b.n, "{v}");
        for (i, (c, want)) in choices.iter().zip(&b.output_ids).enumerate() {
            let stopped = want.last() == Some(&2);
            let ids = &want[..want.len() - usize::from(stopped)];
            let (_, d) = s.post("/detokenize", &json!({ "tokens": ids })).await;
            assert_eq!(
                (&c["index"], &c["text"]),
                (&json!(i), &d["prompt"]),
                "hypothesis {i} of {:?}",
                b.prompt_ids
            );
            assert_eq!(c["finish_reason"], if stopped { "stop" } else { "length" });
        }
        let generated: usize = b.output_ids.iter().map(Vec::len).sum();
        assert_eq!(v["usage"]["completion_tokens"], generated);
    }
    // The WebSocket, which always streams, gets the search's hypotheses whole when it ends.
    let b = &g.beams[0];
    let body = json!({"prompt": b.prompt_ids, "use_beam_search": true, "n": b.n, "best_of": b.num_beams,
        "length_penalty": b.length_penalty, "early_stopping": b.early_stopping, "max_tokens": b.max_tokens});
    let (_, http) = s.post("/v1/completions", &body).await;
    let (_resp, mut ws) = s.client.ws(s.url("/v1/ws")).connect().await.expect("websocket connects");
    ws.send(ws_text(json!({"type": "generate", "id": "b", "endpoint": "completions", "request": body})))
        .await
        .unwrap();
    let mut texts = vec![String::new(); b.n];
    let done = loop {
        let v = next_json(&mut ws).await;
        match v["type"].as_str().unwrap() {
            "delta" => texts[v["index"].as_u64().unwrap() as usize] += v["text"].as_str().unwrap(),
            "done" => break v,
            "started" => {}
            other => panic!("unexpected frame {other}: {v}"),
        }
    };
    for (i, t) in texts.iter().enumerate() {
        assert_eq!(http["choices"][i]["text"], json!(t), "WebSocket choice {i}");
        assert_eq!(done["choices"][i]["finish_reason"], http["choices"][i]["finish_reason"]);
    }
    // Chat: the same search as on the rendered prompt.
    let messages = json!([{"role": "user", "content": "Name three colours of the rainbow."}]);
    let (_, t) = s.post("/tokenize", &json!({"messages": messages, "add_generation_prompt": true})).await;
    let (_, chat) = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": messages, "use_beam_search": true, "n": 2, "best_of": 3, "max_tokens": 10}),
        )
        .await;
    let (_, plain) = s
        .post(
            "/v1/completions",
            &json!({"prompt": t["tokens"], "use_beam_search": true, "n": 2, "best_of": 3, "max_tokens": 10}),
        )
        .await;
    assert_eq!(chat["choices"].as_array().map(Vec::len), Some(2), "{chat}");
    for i in 0..2 {
        let (c, p) = (&chat["choices"][i], &plain["choices"][i]);
        assert_eq!(
            (&c["message"]["content"], &c["finish_reason"]),
            (&p["text"], &p["finish_reason"]),
            "choice {i}"
        );
    }
    assert_ne!(chat["choices"][0]["message"]["content"], chat["choices"][1]["message"]["content"]);
    let streamed = json!({"messages": messages, "use_beam_search": true, "max_tokens": 4, "stream": true});
    let (st, v) = s.post("/v1/chat/completions", &streamed).await;
    assert_eq!((st, &v["error"]["param"]), (400, &json!("stream")), "{v}");
    for (extra, field) in [
        (json!({"temperature": 0.7}), "temperature"),
        (json!({"top_p": 0.9}), "top_p"),
        (json!({"n": 4, "best_of": 3}), "n"),
        (json!({"best_of": 11}), "best_of"),
        (json!({"logprobs": 1}), "logprobs"),
        (json!({"stop": ["."]}), "stop"),
        (json!({"guided_choice": ["yes", "no"]}), "use_beam_search"),
        (json!({"early_stopping": "sometimes"}), "early_stopping"),
        (json!({"stream": true}), "stream"),
    ] {
        let mut body = json!({"prompt": "Hello", "use_beam_search": true, "max_tokens": 4});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (st, v) = s.post("/v1/completions", &body).await;
        assert_eq!((st, &v["error"]["param"]), (400, &json!(field)), "{extra}: {v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(field), "{v}");
    }
}

/// `prompt_logprobs` in vLLM's shape: per prompt position null (the first) or an object
/// keyed by token id holding the prompt token and the top ones, each with its logprob,
/// rank and text; in every choice of a completion (and in the stream before the first
/// token), beside the choices of a chat response. The values are transformers' (see
/// tests/golden.rs); bad counts and beam search are 400s naming the field.
#[actix_rt::test]
async fn prompt_logprobs_over_http_in_vllm_shape() {
    let s = common::server::start(common::default_model(), |_| {}).await;
    let want = common::golden::load().prompt_logprobs.remove(0);
    let body =
        json!({"prompt": want.prompt_ids, "max_tokens": 2, "temperature": 0, "n": 2, "prompt_logprobs": 3});
    let (st, v) = s.post("/v1/completions", &body).await;
    assert_eq!(st, 200, "{v}");
    let lps = &v["choices"][0]["prompt_logprobs"];
    assert_eq!(&v["choices"][1]["prompt_logprobs"], lps, "every choice carries them");
    let lps = lps.as_array().expect("a list");
    assert_eq!(lps.len(), want.prompt_ids.len());
    assert!(lps[0].is_null());
    for (pos, (got, w)) in lps[1..].iter().zip(&want.positions).enumerate() {
        let entry = &got[w.token_id.to_string()];
        let at = format!("position {}: {got}", pos + 1);
        assert!((entry["logprob"].as_f64().unwrap() - f64::from(w.logprob)).abs() <= 1e-4, "{at}");
        assert_eq!(entry["rank"], w.rank, "{at}");
        assert!(entry["decoded_token"].is_string(), "{at}");
        for (r, (id, _)) in w.top.iter().take(3).enumerate() {
            assert_eq!(got[id.to_string()]["rank"], if *id == w.token_id { w.rank } else { r + 1 }, "{at}");
        }
        let keys = got.as_object().unwrap().len();
        assert_eq!(keys, if w.rank <= 3 { 3 } else { 4 }, "{at}");
    }
    // Streamed: a chunk before the first token carries the same list for each choice.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, data) = s.sse("/v1/completions", &streamed).await;
    let c = chunks(&data);
    let first =
        c.iter().position(|x| x["choices"][0].get("prompt_logprobs").is_some()).expect("a chunk of them");
    assert_eq!(c[first]["choices"].as_array().unwrap().len(), 2);
    assert_eq!(c[first]["choices"][1]["prompt_logprobs"], v["choices"][0]["prompt_logprobs"]);
    assert!(c[..first].iter().all(|x| x["choices"][0]["text"].as_str().is_none_or(str::is_empty)));
    // The WebSocket: a frame of them before the first delta.
    let (_resp, mut ws) = s.client.ws(s.url("/v1/ws")).connect().await.expect("websocket connects");
    ws.send(ws_text(json!({"type": "generate", "id": "p", "endpoint": "completions", "request": body})))
        .await
        .unwrap();
    let frames: Vec<Value> = {
        let mut frames = Vec::new();
        while frames.last().is_none_or(|f: &Value| f["type"] != "done") {
            frames.push(next_json(&mut ws).await);
        }
        frames
    };
    let kinds: Vec<&str> = frames.iter().map(|f| f["type"].as_str().unwrap()).collect();
    assert_eq!(kinds[..3], ["started", "prompt_logprobs", "delta"], "{kinds:?}");
    assert_eq!(frames[1]["prompt_logprobs"], v["choices"][0]["prompt_logprobs"]);
    // Chat: beside the choices, one per prompt token.
    let chat =
        json!({"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 1, "prompt_logprobs": 0});
    let (st, v) = s.post("/v1/chat/completions", &chat).await;
    assert_eq!(st, 200, "{v}");
    let lps = v["prompt_logprobs"].as_array().expect("prompt_logprobs beside the choices");
    assert_eq!(json!(lps.len()), v["usage"]["prompt_tokens"]);
    assert!(
        lps[1..].iter().all(|p| p.as_object().is_some_and(|o| o.len() == 1)),
        "0: the prompt token alone"
    );
    for (extra, field) in [
        (json!({"prompt_logprobs": 21}), "prompt_logprobs"),
        (json!({"prompt_logprobs": -1}), "prompt_logprobs"),
        (json!({"prompt_logprobs": 1, "use_beam_search": true}), "prompt_logprobs"),
    ] {
        let mut body = json!({"prompt": "Hello", "max_tokens": 2});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (st, v) = s.post("/v1/completions", &body).await;
        assert_eq!((st, &v["error"]["param"]), (400, &json!(field)), "{extra}: {v}");
    }
}

/// `logit_bias`, `allowed_token_ids` and `bad_words` on the default model: each changes
/// the output as it says, greedy and sampled; bad values are 400s naming the field.
#[actix_rt::test]
async fn logit_bias_allowed_token_ids_and_bad_words_shape_the_output() {
    let s = common::server::start(common::default_model(), |_| {}).await;
    let tokens = |text: &'static str| {
        let s = &s;
        async move {
            let (_, v) = s.post("/tokenize", &json!({"prompt": text, "add_special_tokens": false})).await;
            v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect::<Vec<u32>>()
        }
    };
    let prompt = "The capital of France is";
    let base = json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0});
    let (_, plain) = s.post("/v1/completions", &base).await;
    let text = plain["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(text.contains("Paris"), "{text}");
    let first: Vec<u32> = tokens(" Paris").await;
    // A bias of -100 on the greedy first token moves it; +100 on another makes it every token.
    let mut b = base.clone();
    b["logit_bias"] = json!({ first[0].to_string(): -100 });
    let (_, v) = s.post("/v1/completions", &b).await;
    assert!(!v["choices"][0]["text"].as_str().unwrap().starts_with(" Paris"), "{v}");
    let banana = tokens(" banana").await;
    assert_eq!(banana.len(), 1);
    b["logit_bias"] = json!({ banana[0].to_string(): 100, first[0].to_string(): 5 });
    b["temperature"] = json!(1.0);
    b["max_tokens"] = json!(4);
    let (_, v) = s.post("/v1/completions", &b).await;
    assert_eq!(v["choices"][0]["text"], " banana banana banana banana", "{v}");
    // Only the allowed tokens, sampled.
    let (yes, no) = (tokens(" yes").await, tokens(" no").await);
    let allowed = json!({"prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": 5, "n": 4,
        "allowed_token_ids": [yes[0], no[0]]});
    let (_, v) = s.post("/v1/completions", &allowed).await;
    for c in v["choices"].as_array().unwrap() {
        let t = c["text"].as_str().unwrap();
        assert!(!t.is_empty() && t.replace(" yes", "").replace(" no", "").is_empty(), "{t}");
    }
    // A bad word is never generated, as a whole or after a space; the rest of the greedy
    // text is what it would be up to it.
    let mut b = base.clone();
    b["bad_words"] = json!(["Paris"]);
    let (_, v) = s.post("/v1/completions", &b).await;
    let banned = v["choices"][0]["text"].as_str().unwrap();
    assert!(!banned.contains("Paris"), "{banned}");
    let before = &text[..text.find(" Paris").unwrap()];
    assert!(banned.starts_with(before), "{banned:?} vs {text:?}");
    // Bad values.
    for (extra, field) in [
        (json!({"logit_bias": {"abc": 1}}), "logit_bias"),
        (json!({"logit_bias": {"5": 101}}), "logit_bias"),
        (json!({"logit_bias": {"999999": 1}}), "logit_bias"),
        (json!({"allowed_token_ids": []}), "allowed_token_ids"),
        (json!({"allowed_token_ids": [999999]}), "allowed_token_ids"),
        (json!({"bad_words": [" "]}), "bad_words"),
    ] {
        let mut body = json!({"prompt": prompt, "max_tokens": 2});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (st, v) = s.post("/v1/completions", &body).await;
        assert_eq!((st, v["error"]["param"].as_str()), (400, Some(field)), "{body}: {v}");
    }
}

/// `--scheduling-policy priority`: with one batch place, a request of higher priority
/// (lower number) that arrives while another runs preempts it, finishes first, and the
/// preempted one then goes on.
#[actix_rt::test]
async fn a_higher_priority_request_preempts_a_running_one() {
    let s = default_server(|a| {
        a.engine.scheduling_policy = actorllm::config::SchedulingPolicy::Priority;
        a.engine.max_num_seqs = Some(1);
    })
    .await;
    let mut low = long_request();
    low["priority"] = json!(10);
    low["stream"] = json!(true);
    let mut running = s.client.post(s.url("/v1/completions")).send_json(&low).await.expect("sent");
    assert_eq!(running.status().as_u16(), 200);
    // Reads the stream until a token event comes.
    async fn next_event<S>(stream: &mut S)
    where
        S: futures::Stream<Item = Result<actix_web::web::Bytes, awc::error::PayloadError>> + Unpin,
    {
        loop {
            let bytes = stream.next().await.expect("the stream goes on").expect("bytes");
            if String::from_utf8_lossy(&bytes).contains("\"text\"") {
                return;
            }
        }
    }
    // Its first token came: it runs.
    next_event(&mut running).await;
    let urgent =
        json!({"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": true, "priority": -1});
    let (status, v) = s.post("/v1/completions", &urgent).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert!(s.metric("vllm:num_preemptions_total").await >= 1.0, "the running request gave way");
    // The low one still runs (it has thousands of tokens to go) and goes on streaming.
    assert_eq!(s.metric("vllm:num_requests_running").await, 1.0);
    for _ in 0..3 {
        next_event(&mut running).await;
    }
    drop(running);
    s.wait_for_metric("vllm:num_requests_running", 0.0).await;
}
