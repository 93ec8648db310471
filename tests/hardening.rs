//! The server under hostile or careless clients: connections that go away before their
//! response, pages from other origins, broken WebSocket frames, floods, and a shutdown with
//! streams still running. Real sockets and clients throughout.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use serde_json::{Value, json};

use common::server::{TestServer, default_server, long_request};

/// Sends a raw HTTP/1.1 request on a new connection and returns the connection.
fn raw_post(s: &TestServer, path: &str, body: &Value) -> TcpStream {
    let addr = s.base.trim_start_matches("http://");
    let mut c = TcpStream::connect(addr).expect("connect");
    let body = body.to_string();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    c.write_all(head.as_bytes()).and_then(|_| c.write_all(body.as_bytes())).expect("request written");
    c
}

/// Sends `request` (a whole HTTP/1.1 request, `Connection: close`) on a new connection and
/// returns the status and the raw response.
async fn raw_exchange(s: &TestServer, request: String) -> (u16, String) {
    let addr = s.base.trim_start_matches("http://").to_string();
    actix_rt::task::spawn_blocking(move || {
        let mut c = TcpStream::connect(addr).expect("connect");
        c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        c.write_all(request.as_bytes()).expect("request written");
        // Read to the end, but an upgraded connection stays open: stop after its head.
        let (mut out, mut buf) = (Vec::new(), [0u8; 4096]);
        while let Ok(n @ 1..) = c.read(&mut buf) {
            out.extend_from_slice(&buf[..n]);
            if out.starts_with(b"HTTP/1.1 101") && out.windows(4).any(|w| w == b"\r\n\r\n") {
                break;
            }
        }
        let text = String::from_utf8_lossy(&out).into_owned();
        let status = text.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
        (status, text)
    })
    .await
    .unwrap()
}

/// A GET of `path` with the given extra header lines.
fn get(path: &str, host: &str, extra: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n{extra}Connection: close\r\n\r\n")
}

/// The WebSocket upgrade of /v1/ws with the given extra header lines.
fn upgrade(host: &str, extra: &str) -> String {
    format!(
        "GET /v1/ws HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n{extra}\r\n"
    )
}

/// Bound to loopback, the server answers only its loopback names (DNS rebinding gets 403),
/// and pages of other origins can neither open the WebSocket nor call the API, unless
/// --allowed-origins lists them; CORS preflights are answered for those it lists.
#[actix_rt::test]
async fn hosts_and_origins_other_than_the_servers_own_are_refused() {
    let s = common::server::start_tiny(3, |_| {}).await;
    let own = s.base.trim_start_matches("http://").to_string();
    let port = own.rsplit(':').next().unwrap().to_string();
    for host in [own.clone(), format!("localhost:{port}"), format!("[::1]:{port}")] {
        assert_eq!(raw_exchange(&s, get("/v1/models", &host, "")).await.0, 200, "Host {host}");
    }
    let (st, text) = raw_exchange(&s, get("/v1/models", "evil.example", "")).await;
    assert_eq!(st, 403, "{text}");
    assert!(text.contains("--allowed-hosts") && text.contains("permission_error"), "{text}");
    // The WebSocket: no Origin (a program), its own origin and loopback pages are let in.
    for origin in ["", &format!("Origin: http://{own}\r\n"), &format!("Origin: http://localhost:{port}\r\n")]
    {
        let (st, text) = raw_exchange(&s, upgrade(&own, origin)).await;
        assert_eq!(st, 101, "{origin}: {text}");
    }
    let (st, text) = raw_exchange(&s, upgrade(&own, "Origin: http://evil.example\r\n")).await;
    assert_eq!(st, 403, "{text}");
    assert!(text.contains("--allowed-origins"), "{text}");
    // A cross-origin POST is refused before it runs, preflight or not.
    let body = r#"{"prompt":"Hi","max_tokens":2}"#;
    let post = |origin: &str, ctype: &str| {
        format!(
            "POST /v1/completions HTTP/1.1\r\nHost: {own}\r\nOrigin: {origin}\r\nContent-Type: {ctype}\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
    };
    assert_eq!(raw_exchange(&s, post("http://evil.example", "text/plain")).await.0, 403);
    let preflight = |origin: &str| {
        get("/v1/completions", &own, &format!(
            "Origin: {origin}\r\nAccess-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: content-type\r\n"
        ))
        .replacen("GET", "OPTIONS", 1)
    };
    assert_eq!(raw_exchange(&s, preflight("http://evil.example")).await.0, 403);
    // Listed origins and hosts are let in, with CORS headers naming the origin.
    let s = common::server::start_tiny(3, |a| {
        a.allowed_origins = vec![r#"["http://friend.example"]"#.into()];
        a.allowed_hosts = vec!["api.example".into()];
        a.allowed_methods = vec!["GET,POST".into()];
    })
    .await;
    let own = s.base.trim_start_matches("http://").to_string();
    let (st, text) = raw_exchange(&s, preflight("http://friend.example")).await;
    assert_eq!(st, 204, "{text}");
    let lower = text.to_ascii_lowercase();
    assert!(lower.contains("access-control-allow-origin: http://friend.example"), "{text}");
    assert!(lower.contains("access-control-allow-headers: content-type"), "{text}");
    let (st, text) = raw_exchange(&s, post("http://friend.example", "application/json")).await;
    assert_eq!(st, 200, "{text}");
    assert!(
        text.to_ascii_lowercase().contains("access-control-allow-origin: http://friend.example"),
        "{text}"
    );
    assert_eq!(raw_exchange(&s, upgrade(&own, "Origin: http://friend.example\r\n")).await.0, 101);
    assert_eq!(raw_exchange(&s, get("/health", "api.example:80", "")).await.0, 200);
    let put = preflight("http://friend.example").replace("Request-Method: POST", "Request-Method: PUT");
    assert_eq!(raw_exchange(&s, put).await.0, 403, "--allowed-methods GET,POST");
}

/// Non-streamed requests whose clients time out and close the connection are aborted, the
/// running one and the queued one alike, and their blocks come back; a client that stays
/// gets its whole response.
#[actix_rt::test]
async fn non_streamed_requests_are_aborted_when_their_client_leaves() {
    let s = default_server(|a| a.engine.max_num_seqs = Some(1)).await;
    let running = raw_post(&s, "/v1/completions", &long_request());
    s.wait_for_metric("vllm:num_requests_running", 1.0).await;
    let queued = raw_post(&s, "/v1/chat/completions", &{
        let mut b = long_request();
        b.as_object_mut().unwrap().remove("prompt");
        b["messages"] = json!([{"role": "user", "content": "Hi"}]);
        b
    });
    s.wait_for_metric("vllm:num_requests_waiting", 1.0).await;
    drop((running, queued));
    s.wait_for_metric("vllm:num_requests_running", 0.0).await;
    s.wait_for_metric("vllm:num_requests_waiting", 0.0).await;
    let gone = "actorllm:request_aborts_total{model_name=\"test-model\",reason=\"client_disconnected\"}";
    assert_eq!(s.metric(gone).await, 2.0, "both were aborted as client_disconnected");
    s.wait_for_metric("actorllm:kv_cache_blocks_free", s.metric("actorllm:kv_cache_blocks_total").await)
        .await;
    // A client that waits is answered in full on the same kind of connection.
    let mut c = raw_post(&s, "/v1/completions", &json!({"prompt": "Hi", "max_tokens": 3, "temperature": 0}));
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let reply = actix_rt::task::spawn_blocking(move || {
        let mut buf = [0u8; 4096];
        let n = c.read(&mut buf).expect("response read");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    })
    .await
    .unwrap();
    assert!(reply.starts_with("HTTP/1.1 200") && reply.contains("\"completion_tokens\":3"), "{reply}");
}

/// A masked client frame.
fn frame(fin: bool, opcode: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![(u8::from(fin) << 7) | opcode];
    match payload.len() {
        n @ 0..=125 => f.push(0x80 | n as u8),
        n @ 126..=65535 => {
            f.push(0x80 | 126);
            f.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            f.push(0x80 | 127);
            f.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    let mask = [7u8, 1, 3, 5];
    f.extend_from_slice(&mask);
    f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    f
}

/// The server's frames (unmasked) as (opcode, payload), from a byte stream.
fn server_frames(mut b: &[u8]) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    while b.len() >= 2 {
        let (op, len7) = (b[0] & 0x0F, (b[1] & 0x7F) as usize);
        let (len, at) = match len7 {
            126 => (u16::from_be_bytes([b[2], b[3]]) as usize, 4),
            127 => (u64::from_be_bytes(b[2..10].try_into().unwrap()) as usize, 10),
            n => (n, 2),
        };
        if b.len() < at + len {
            break;
        }
        out.push((op, b[at..at + len].to_vec()));
        b = &b[at + len..];
    }
    out
}

/// Opens /v1/ws on a raw socket, sends `bytes`, and reads what the server sends until it
/// closes the connection (or 10 s pass): the frames, and the byte count.
async fn ws_exchange(s: &TestServer, bytes: Vec<u8>) -> (Vec<(u8, Vec<u8>)>, usize) {
    let addr = s.base.trim_start_matches("http://").to_string();
    let head = upgrade(&addr, "");
    actix_rt::task::spawn_blocking(move || {
        let mut c = TcpStream::connect(&addr).expect("connect");
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.write_all(head.as_bytes()).unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 65536];
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = c.read(&mut buf).expect("upgrade answered");
            got.extend_from_slice(&buf[..n]);
        }
        let at = got.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
        assert!(got.starts_with(b"HTTP/1.1 101"), "{}", String::from_utf8_lossy(&got));
        let mut rest = got.split_off(at);
        let _ = c.write_all(&bytes);
        while let Ok(n @ 1..) = c.read(&mut buf) {
            rest.extend_from_slice(&buf[..n]);
            if rest.len() > 1 << 20 {
                break;
            }
        }
        (server_frames(&rest), rest.len())
    })
    .await
    .unwrap()
}

fn close_code(frames: &[(u8, Vec<u8>)]) -> Option<u16> {
    frames.iter().find(|(op, _)| *op == 8).map(|(_, p)| u16::from_be_bytes([p[0], p[1]]))
}

/// Broken frames close the socket at once with the right code, and the server sends a few
/// bytes, not an endless stream of errors: an announced 2⁴⁰-byte frame before its payload,
/// an unmasked frame, reserved bits, an unknown opcode, a continuation with nothing to
/// continue, a fragmented message over the limit, and text that is not UTF-8. A message
/// sent in fragments is joined and runs.
#[actix_rt::test]
async fn broken_websocket_frames_close_the_socket_with_their_code() {
    let s = common::server::start_tiny(3, |_| {}).await;
    let huge = {
        let mut f = vec![0x81, 0x80 | 127];
        f.extend_from_slice(&(1u64 << 40).to_be_bytes());
        f.extend_from_slice(&[1, 2, 3, 4]);
        f.extend(vec![b'x'; 1 << 20]);
        f
    };
    let mut unmasked = frame(true, 1, b"{}");
    unmasked[1] &= 0x7F;
    let half = vec![b' '; 600 << 10];
    let cases: Vec<(&str, Vec<u8>, u16)> = vec![
        ("2^40-byte header", huge, 1009),
        ("unmasked", unmasked, 1002),
        ("RSV1", frame(true, 0x41, b"{}"), 1002),
        ("opcode 3", frame(true, 3, b"{}"), 1002),
        ("lone continuation", frame(true, 0, b"{}"), 1002),
        ("1.2 MiB in two fragments", [frame(false, 1, &half), frame(true, 0, &half)].concat(), 1009),
        ("not UTF-8", frame(true, 1, &[0xff, 0xfe]), 1007),
    ];
    for (what, bytes, code) in cases {
        let (frames, n) = ws_exchange(&s, bytes).await;
        assert_eq!(close_code(&frames), Some(code), "{what}: {frames:?}");
        assert!(n < 4096, "{what}: the server sent {n} bytes before closing");
    }
    // A generate frame in three fragments, with a ping between them, runs.
    let msg = json!({"type": "generate", "id": "f", "endpoint": "completions",
        "request": {"prompt": "Hi", "max_tokens": 2, "temperature": 0}})
    .to_string();
    let (a, b) = msg.as_bytes().split_at(10);
    let (b, c) = b.split_at(10);
    let bytes = [frame(false, 1, a), frame(true, 9, b"p"), frame(false, 0, b), frame(true, 0, c)].concat();
    let addr = s.base.trim_start_matches("http://").to_string();
    let got = actix_rt::task::spawn_blocking(move || {
        let mut c = TcpStream::connect(&addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        c.write_all(upgrade(&addr, "").as_bytes()).unwrap();
        c.write_all(&bytes).unwrap();
        let (mut got, mut buf) = (Vec::new(), [0u8; 4096]);
        while !String::from_utf8_lossy(&got).contains("\"type\":\"done\"") {
            let n = c.read(&mut buf).expect("frames");
            assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&got).into_owned()
    })
    .await
    .unwrap();
    assert!(got.contains("\"type\":\"started\"") && got.contains("\"finish_reason\":\"length\""), "{got}");
}

/// A client that asks for a stream and never reads it holds neither memory nor the batch:
/// once it leaves --stream-backlog tokens per choice unread behind what the sockets hold,
/// its request is aborted, over SSE and over the WebSocket (whose session is held back by
/// its socket). Each request would otherwise run 16,000 tokens of about 1 KB. Read at last,
/// the WebSocket's generation ends with an error frame saying why.
#[actix_rt::test]
async fn streams_left_unread_are_aborted_not_buffered() {
    let s = common::server::start_tiny(3, |a| a.stream_backlog = 8).await;
    let request = json!({"prompt": [5, 6, 7], "max_tokens": 2000, "n": 8, "ignore_eos": true,
        "temperature": 0, "logprobs": 20});
    let slow = "actorllm:request_aborts_total{model_name=\"test-model\",reason=\"client_not_reading\"}";
    let all_free = || async {
        s.wait_for_metric("vllm:num_requests_running", 0.0).await;
        s.wait_for_metric("actorllm:kv_cache_blocks_free", s.metric("actorllm:kv_cache_blocks_total").await)
            .await;
    };
    let mut sse = request.clone();
    sse["stream"] = json!(true);
    let unread_sse = raw_post(&s, "/v1/completions", &sse);
    s.wait_for_metric(slow, 1.0).await;
    all_free().await;
    let addr = s.base.trim_start_matches("http://").to_string();
    let mut unread_ws = TcpStream::connect(&addr).unwrap();
    let generate = json!({"type": "generate", "id": "g", "endpoint": "completions", "request": request});
    unread_ws.write_all(upgrade(&addr, "").as_bytes()).unwrap();
    unread_ws.write_all(&frame(true, 1, generate.to_string().as_bytes())).unwrap();
    s.wait_for_metric(slow, 2.0).await;
    all_free().await;
    let gone = "actorllm:request_aborts_total{model_name=\"test-model\",reason=\"client_disconnected\"}";
    assert_eq!(s.metric(gone).await, 0.0, "both were aborted for not reading");
    let got = actix_rt::task::spawn_blocking(move || {
        unread_ws.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let (mut got, mut buf) = (Vec::new(), vec![0u8; 1 << 16]);
        while !String::from_utf8_lossy(&got).contains("\"type\":\"error\"") {
            let n = unread_ws.read(&mut buf).expect("frames");
            assert!(n > 0, "closed before the error frame");
            got.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&got).into_owned()
    })
    .await
    .unwrap();
    let error = got.rsplit("\"type\":\"delta\"").next().unwrap();
    assert!(error.contains("unread (--stream-backlog)"), "{error}");
    drop(unread_sse);
}

/// Past --max-waiting-requests a request gets 429 with Retry-After (and the others run on);
/// n × prompts over --max-num-seqs, a max_tokens that would overflow, a role outside the
/// four, a 1 MB stop string and the structured-output fields this server does not run get
/// 400; a body that stops arriving gets 408.
#[actix_rt::test]
async fn admission_limits_and_bounded_fields() {
    let s = default_server(|a| {
        a.engine.max_num_seqs = Some(2);
        a.max_waiting_requests = Some(1);
        a.request_body_timeout = 1.0;
    })
    .await;
    let mut body = long_request();
    body["stream"] = json!(true);
    let mut live = Vec::new();
    for (running, waiting) in [(1.0, 0.0), (2.0, 0.0), (2.0, 1.0)] {
        let r = s.client.post(s.url("/v1/completions")).send_json(&body).await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
        live.push(r);
        s.wait_for_metric("vllm:num_requests_running", running).await;
        s.wait_for_metric("vllm:num_requests_waiting", waiting).await;
    }
    let r = s.client.post(s.url("/v1/completions")).send_json(&long_request()).await.unwrap();
    assert_eq!(r.status().as_u16(), 429);
    assert_eq!(r.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("1"));
    let (st, v) = s.post("/v1/completions", &long_request()).await;
    assert_eq!(st, 429);
    assert_eq!(v["error"]["type"], "rate_limit_error");
    assert!(v["error"]["message"].as_str().unwrap().contains("--max-waiting-requests"), "{v}");
    assert_eq!(s.metric("vllm:num_requests_running").await, 2.0, "the running ones go on");
    drop(live);
    s.wait_for_metric("vllm:num_requests_running", 0.0).await;

    let chat = |messages: Value| json!({"messages": messages, "max_tokens": 2});
    let cases: Vec<(&str, Value, &str)> = vec![
        ("/v1/completions", json!({"prompt": ["a", "b"], "n": 2, "max_tokens": 2}), "--max-num-seqs"),
        ("/v1/completions", json!({"prompt": "Hi", "max_tokens": u64::MAX}), "maximum context length"),
        ("/v1/chat/completions", chat(json!([{"role": "<|im_start|>system", "content": "x"}])), "role"),
        ("/v1/chat/completions", chat(json!([{"role": "developer", "content": "x"}])), "role"),
        ("/v1/completions", json!({"prompt": "Hi", "stop": ["x".repeat(1 << 20)]}), "at most 1024 bytes"),
        (
            "/v1/chat/completions",
            {
                let mut b = chat(json!([{"role": "user", "content": "x"}]));
                b["tools"] = json!([{"type": "function", "function": {"name": "f"}}]);
                b
            },
            "--enable-auto-tool-choice",
        ),
        (
            "/v1/chat/completions",
            {
                let mut b = chat(json!([{"role": "user", "content": "x"}]));
                b["response_format"] = json!({"type": "xml"});
                b
            },
            "response_format",
        ),
        ("/v1/completions", json!({"prompt": "Hi", "guided_json": {"type": "nonsense"}}), "guided_json"),
    ];
    for (path, body, says) in cases {
        let (st, v) = s.post(path, &body).await;
        assert_eq!(st, 400, "{body:.200}: {v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(says), "{says}: {v}");
    }
    // Fields set to what they mean by default are fine.
    let mut ok = chat(json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]));
    ok["tools"] = json!([]);
    ok["tool_choice"] = json!("none");
    ok["response_format"] = json!({"type": "text"});
    assert_eq!(s.post("/v1/chat/completions", &ok).await.0, 200);

    // A body announced as 100 bytes of which 10 come.
    let addr = s.base.trim_start_matches("http://").to_string();
    let started = std::time::Instant::now();
    let (st, text) = raw_exchange(
        &s,
        format!(
            "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Content-Length: 100\r\nConnection: close\r\n\r\n{{\"prompt\":"
        ),
    )
    .await;
    assert_eq!(st, 408, "{text}");
    assert!(text.contains("did not arrive within 1 s"), "{text}");
    assert!(started.elapsed() < Duration::from_secs(20));
}

/// Reads a whole HTTP/1.1 exchange's raw bytes until the server closes the connection.
fn read_bytes(mut c: TcpStream) -> Vec<u8> {
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut out = Vec::new();
    let _ = c.read_to_end(&mut out);
    out
}

fn read_all(c: TcpStream) -> String {
    String::from_utf8_lossy(&read_bytes(c)).into_owned()
}

/// `actorllm serve` in its own process, sent SIGTERM with a stream, a WebSocket generation
/// and a short non-streamed request running: during the drain /health and new requests get
/// 503 and the short request completes; after --shutdown-timeout the stream ends with an
/// error event and [DONE], the WebSocket with an error frame and close 1001; the process
/// exits cleanly.
#[test]
fn sigterm_drains_then_ends_what_still_runs_with_a_word() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let model = common::default_model();
    let mut server = Command::new(env!("CARGO_BIN_EXE_actorllm"))
        .args(["serve", "--model", model.to_str().unwrap(), "--port", "0", "--shutdown-timeout", "10"])
        .args(["--kv-cache-space", "1"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("actorllm serve starts");
    let mut log = BufReader::new(server.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = log.next().expect("the server says where it listens").unwrap();
        if let Some(at) = line.find("listening on http://") {
            break line[at + "listening on http://".len()..].split_whitespace().next().unwrap().to_string();
        }
    };
    let log = std::thread::spawn(move || log.map_while(Result::ok).collect::<Vec<_>>().join("\n"));
    let post = |body: &Value| {
        let mut c = TcpStream::connect(&addr).unwrap();
        let body = body.to_string();
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        c.write_all(head.as_bytes()).unwrap();
        c
    };
    let mut stream_body = long_request();
    stream_body["stream"] = json!(true);
    let mut sse = post(&stream_body);
    let mut first = [0u8; 256];
    sse.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let n = sse.read(&mut first).unwrap();
    assert!(first[..n].starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&first[..n]));
    let mut ws = TcpStream::connect(&addr).unwrap();
    ws.write_all(upgrade(&addr, "").as_bytes()).unwrap();
    let generate =
        json!({"type": "generate", "id": "w", "endpoint": "completions", "request": long_request()});
    ws.write_all(&frame(true, 1, generate.to_string().as_bytes())).unwrap();
    let get = |path: &str| {
        let mut c = TcpStream::connect(&addr).unwrap();
        c.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes())
            .unwrap();
        read_all(c)
    };
    let running_reaches = |want: usize| {
        let line =
            format!("vllm:num_requests_running{{model_name=\"{}\"}} {want}\n", model.to_str().unwrap());
        for _ in 0..600 {
            if get("/metrics").contains(&line) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("{want} requests never ran");
    };
    running_reaches(2);
    let short = post(&json!({"prompt": "Hi", "max_tokens": 8, "temperature": 0, "ignore_eos": true}));
    running_reaches(3);
    let short = std::thread::spawn(move || read_all(short));
    let (sse, ws) = (std::thread::spawn(move || read_all(sse)), std::thread::spawn(move || read_bytes(ws)));
    let kill = Command::new("kill").args(["-TERM", &server.id().to_string()]).status().unwrap();
    assert!(kill.success());
    std::thread::sleep(Duration::from_millis(300));
    let health = get("/health");
    assert!(health.starts_with("HTTP/1.1 503"), "draining: {health}");
    let refused = read_all(post(&json!({"prompt": "Hi", "max_tokens": 2})));
    assert!(refused.starts_with("HTTP/1.1 503") && refused.contains("shutting down"), "{refused}");
    let short = short.join().unwrap();
    assert!(short.starts_with("HTTP/1.1 200") && short.contains("\"completion_tokens\":8"), "{short}");
    let status = server.wait().unwrap();
    let log = log.join().unwrap();
    assert!(status.success(), "exit {status:?}\n{log}");
    let sse = sse.join().unwrap();
    assert!(sse.contains("the server is shutting down"), "{sse}");
    assert!(sse.contains("data: [DONE]") && sse.ends_with("0\r\n\r\n"), "a whole chunked body: {sse}");
    let ws = ws.join().unwrap();
    let at = ws.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
    let frames = server_frames(&ws[at..]);
    let texts: Vec<String> = frames
        .iter()
        .filter(|(op, _)| *op == 1)
        .map(|(_, p)| String::from_utf8_lossy(p).into_owned())
        .collect();
    assert!(
        texts.iter().any(|t| t.contains("\"type\":\"error\"") && t.contains("shutting down")),
        "{texts:?}"
    );
    assert_eq!(close_code(&frames), Some(1001), "{log}");
    assert!(log.contains("draining") && log.contains("server stopped"), "{log}");
}
