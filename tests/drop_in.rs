//! `actorllm` where a script expects `vllm`: LLaMA-Factory's engine arguments written as
//! vLLM flags, model ids from a Hugging Face cache laid out as `huggingface_hub` lays it,
//! the server flags vLLM users pass (TLS, root path, log switches, several names, adapters
//! in JSON), `run-batch` over an OpenAI batch file, and `--seed`.
//!
//! The TLS key and certificate under tests/fixtures/tls/ are a self-signed test pair for
//! localhost and 127.0.0.1 (not a CA, which rustls refuses as a server's certificate), made
//! with `openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days
//! 36500 -subj /CN=localhost -addext subjectAltName=DNS:localhost,IP:127.0.0.1 -addext
//! basicConstraints=critical,CA:FALSE -addext extendedKeyUsage=serverAuth -addext
//! keyUsage=critical,digitalSignature`.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// A server process and the lines of its log.
struct Served {
    child: Child,
    lines: mpsc::Receiver<String>,
    log: Vec<String>,
}

impl Served {
    fn spawn(args: &[&str], env: &[(&str, &str)]) -> Served {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_actorllm"));
        cmd.arg("serve").args(args).env_remove("RUST_LOG").stdout(Stdio::null()).stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("actorllm serve starts");
        let (tx, lines) = mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Served { child, lines, log: Vec::new() }
    }

    /// The address of the "listening on" line.
    fn address(&mut self) -> String {
        loop {
            let line = self
                .lines
                .recv_timeout(Duration::from_secs(120))
                .unwrap_or_else(|_| panic!("the server says where it listens:\n{}", self.log.join("\n")));
            self.log.push(line.clone());
            if let Some(at) = line.find("listening on ") {
                let url = line[at + "listening on ".len()..].split_whitespace().next().unwrap();
                let rest = url.split_once("://").unwrap().1;
                return rest.split('/').next().unwrap().to_string();
            }
        }
    }

    /// Stops the server and returns its whole log.
    fn stop(mut self) -> String {
        self.child.kill().ok();
        self.child.wait().ok();
        self.log.extend(self.lines.try_iter());
        std::thread::sleep(Duration::from_millis(100));
        self.log.extend(self.lines.try_iter());
        self.log.join("\n")
    }
}

/// One HTTP/1.1 exchange on `stream`: (status, headers, body).
fn exchange(
    mut stream: impl Read + Write,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> (u16, String, String) {
    let body = body.map(Value::to_string).unwrap_or_default();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(req.as_bytes()).unwrap();
    let mut raw = Vec::new();
    // A TLS peer may close without close_notify once the response is complete.
    let _ = stream.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, head.to_string(), body.to_string())
}

fn http(addr: &str, method: &str, path: &str, body: Option<&Value>) -> (u16, String, String) {
    exchange(TcpStream::connect(addr).expect("server reachable"), method, path, body)
}

fn json_body(r: &(u16, String, String)) -> Value {
    serde_json::from_str(&r.2).unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", r))
}

/// A Hugging Face cache under `root` holding the default model as `org/name`: `main` and
/// the tag `v1` point at one commit, whose files are symlinks into `blobs/`.
fn hf_cache(root: &Path, org_name: &str) -> PathBuf {
    let model = common::default_model();
    let repo = root.join(format!("models--{}", org_name.replace('/', "--")));
    let commit = "0123456789abcdef0123456789abcdef01234567";
    let snap = repo.join("snapshots").join(commit);
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    for (i, entry) in std::fs::read_dir(&model).unwrap().enumerate() {
        let entry = entry.unwrap();
        let blob = repo.join("blobs").join(format!("blob{i:02}"));
        std::os::unix::fs::symlink(std::fs::canonicalize(entry.path()).unwrap(), &blob).unwrap();
        std::os::unix::fs::symlink(format!("../../blobs/blob{i:02}"), snap.join(entry.file_name())).unwrap();
    }
    for r in ["main", "v1"] {
        std::fs::write(repo.join("refs").join(r), commit).unwrap();
    }
    snap
}

/// LLaMA-Factory's engine arguments as vLLM flags, with the model given by id from a
/// cache in --download-dir and vLLM's server flags around them: the server starts, serves
/// transformers' greedy text on the base model and on an adapter named in JSON, under
/// its --root-path and without it, and each switch does what it says.
#[test]
fn llamafactory_engine_arguments_start_the_server_and_each_has_its_effect() {
    let cache = common::scratch("hf-cache");
    hf_cache(cache.path(), "HuggingFaceTB/SmolLM2-135M-Instruct");
    let lora = common::lora::golden();
    let qv8 = &lora.adapters[0];
    let adapters = common::scratch("drop-in-adapters");
    let qv8_dir = common::lora::write_adapter(adapters.path(), &qv8.spec, false);
    let lora_json =
        json!({"name": "sql", "path": qv8_dir, "base_model_name": "SmolLM2-135M-Instruct"}).to_string();
    let cache_dir = cache.path().to_str().unwrap();
    let mut served = Served::spawn(
        &[
            "--model",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            "--trust-remote-code",
            "--download-dir",
            cache_dir,
            "--dtype",
            "float32",
            "--max-model-len",
            "2048",
            "--tensor-parallel-size",
            "1",
            "--gpu-memory-utilization",
            "0.9",
            "--disable-log-stats",
            "--disable-log-requests",
            "--enforce-eager",
            "--enable-lora",
            "--max-lora-rank",
            "64",
            "--lora-modules",
            &lora_json,
            "--seed",
            "7",
            "--max-logprobs",
            "5",
            "--disable-uvicorn-access-log",
            "--root-path",
            "/llm",
            "--served-model-name",
            "smol",
            "smol-alias",
            "--port",
            "0",
        ],
        &[("VLLM_LOG_STATS_INTERVAL", "0.2"), ("HF_HOME", "/nonexistent")],
    );
    let addr = served.address();
    let models = json_body(&http(&addr, "GET", "/llm/v1/models", None));
    let ids: Vec<&str> =
        models["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["smol", "smol-alias", "sql"], "{models}");
    let golden = common::golden::load();
    let p = &golden.prompts[0];
    let req =
        json!({"model": "smol-alias", "prompt": p.text, "max_tokens": p.output_ids.len(), "temperature": 0});
    for path in ["/llm/v1/completions", "/v1/completions"] {
        let r = json_body(&http(&addr, "POST", path, Some(&req)));
        assert_eq!(r["choices"][0]["text"], p.output_text.as_str(), "{path}: {r}");
        assert_eq!(r["model"], "smol-alias");
    }
    let out = &qv8.outputs[0];
    let req = json!({"model": "sql", "prompt": out.prompt_ids, "max_tokens": out.output_ids.len(), "temperature": 0});
    let r = json_body(&http(&addr, "POST", "/llm/v1/completions", Some(&req)));
    assert_eq!(r["choices"][0]["text"], out.output_text.as_str(), "the adapter of --lora-modules JSON: {r}");
    // --max-logprobs 5: five are given, six refused naming the flag.
    let ask = |n: u32| json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": true, "top_logprobs": n});
    let r = json_body(&http(&addr, "POST", "/v1/chat/completions", Some(&ask(5))));
    assert_eq!(r["choices"][0]["logprobs"]["content"][0]["top_logprobs"].as_array().unwrap().len(), 5, "{r}");
    let refused = http(&addr, "POST", "/v1/chat/completions", Some(&ask(6)));
    assert_eq!(refused.0, 400);
    let e = json_body(&refused);
    assert!(e["error"]["message"].as_str().unwrap().contains("--max-logprobs"), "{e}");
    assert_eq!(e["error"]["param"], "top_logprobs");
    // --root-path: the prefix alone goes to the playground, whose links stay under it.
    let redirect = http(&addr, "GET", "/llm", None);
    assert_eq!(redirect.0, 308);
    assert!(redirect.1.to_ascii_lowercase().contains("location: /llm/"), "{}", redirect.1);
    let page = http(&addr, "GET", "/llm/", None);
    assert_eq!(page.0, 200);
    assert!(page.2.contains("src=\"static/app.js\"") && !page.2.contains("\"/static/"), "relative links");
    assert_eq!(http(&addr, "GET", "/llm/static/app.js", None).0, 200);
    std::thread::sleep(Duration::from_millis(600));
    let log = served.stop();
    assert!(log.contains("--trust-remote-code: a checkpoint's own modeling code cannot run here"), "{log}");
    assert!(log.contains("model found in the Hugging Face cache"), "{log}");
    assert!(log.contains("listening on http://") && log.contains("/llm"), "{log}");
    for quiet in ["Avg prompt throughput", "request started", "request finished", "actorllm::web::ops: http"]
    {
        assert!(!log.contains(quiet), "{quiet:?} logged despite the flags:\n{log}");
    }
}

/// Without the two switches, the same server logs each request and, while busy, the
/// periodic stats line, and each HTTP request its access line; `--uvicorn-log-level debug`
/// shows debug lines; the served name
/// defaults to `--model` as given.
#[test]
fn stats_and_request_lines_are_logged_unless_switched_off() {
    let tiny = common::tiny_model(71);
    let model = tiny.path().to_str().unwrap();
    let mut served = Served::spawn(
        &["--model", model, "--port", "0", "--uvicorn-log-level", "debug"],
        &[("VLLM_LOG_STATS_INTERVAL", "0.2")],
    );
    let addr = served.address();
    let models = json_body(&http(&addr, "GET", "/v1/models", None));
    assert_eq!(models["data"][0]["id"], model, "the served name is --model as given");
    let req = json!({"prompt": "hello", "max_tokens": 400, "ignore_eos": true});
    assert_eq!(http(&addr, "POST", "/v1/completions", Some(&req)).0, 200);
    std::thread::sleep(Duration::from_millis(600));
    let log = served.stop();
    for line in [
        "Avg prompt throughput",
        "Avg generation throughput",
        "request started",
        "request finished",
        "DEBUG",
        "actorllm::web::ops: http",
    ] {
        assert!(log.contains(line), "{line:?} missing:\n{log}");
    }
}

/// A blocking TLS client that trusts the test certificate only.
fn tls_get(addr: &str, path: &str) -> std::io::Result<(u16, String, String)> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName};
    let mut roots = rustls::RootCertStore::empty();
    let cert = CertificateDer::from_pem_file(common::fixture("tests/fixtures/tls/cert.pem")).unwrap();
    roots.add(cert).unwrap();
    #[allow(deprecated)]
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let name = ServerName::try_from("localhost").unwrap();
    let conn = rustls::ClientConnection::new(std::sync::Arc::new(config), name).unwrap();
    let tcp = TcpStream::connect(addr)?;
    Ok(exchange(rustls::StreamOwned::new(conn, tcp), "GET", path, None))
}

/// `--ssl-keyfile`/`--ssl-certfile` serve HTTPS that a client trusting the certificate
/// verifies; `--uvicorn-log-level warning` leaves no info line in the log.
#[test]
fn tls_serves_https_and_the_log_level_quiets_the_log() {
    let tiny = common::tiny_model(72);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let (key, cert) =
        (common::fixture("tests/fixtures/tls/key.pem"), common::fixture("tests/fixtures/tls/cert.pem"));
    let served = Served::spawn(
        &[
            "--model",
            tiny.path().to_str().unwrap(),
            "--port",
            &port,
            "--ssl-keyfile",
            key.to_str().unwrap(),
            "--ssl-certfile",
            cert.to_str().unwrap(),
            "--uvicorn-log-level",
            "warning",
        ],
        &[],
    );
    let addr = format!("127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(120);
    let health = loop {
        match tls_get(&addr, "/health") {
            Ok(r) if r.0 != 0 => break r,
            _ if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            other => panic!("no HTTPS answer: {other:?}"),
        }
    };
    assert_eq!(health.0, 200, "{health:?}");
    let models = tls_get(&addr, "/v1/models").unwrap();
    assert_eq!(models.0, 200);
    // Plain HTTP on the TLS port gets no HTTP answer.
    assert_ne!(http(&addr, "GET", "/health", None).0, 200);
    let log = served.stop();
    assert!(!log.contains(" INFO "), "info lines at --uvicorn-log-level warning:\n{log}");
}

/// A model id resolves from HF_HOME's cache by branch and tag; one that is not there stops
/// the server with an error naming where it looked.
#[test]
fn model_ids_resolve_from_hf_home_by_revision_and_a_missing_one_names_the_paths() {
    let home = common::scratch("hf-home");
    let snap = hf_cache(&home.path().join("hub"), "org/smol");
    let home_dir = home.path().to_str().unwrap();
    let mut served =
        Served::spawn(&["--model", "org/smol", "--revision", "v1", "--port", "0"], &[("HF_HOME", home_dir)]);
    let addr = served.address();
    let models = json_body(&http(&addr, "GET", "/v1/models", None));
    assert_eq!(models["data"][0]["id"], "org/smol");
    assert_eq!(models["data"][0]["root"], snap.to_str().unwrap());
    served.stop();
    let out = Command::new(env!("CARGO_BIN_EXE_actorllm"))
        .args(["serve", "--model", "org/absent", "--port", "0"])
        .env("HF_HOME", home_dir)
        .env_remove("HF_HUB_CACHE")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let looked = home.path().join("hub/models--org--absent");
    assert!(err.contains(&looked.display().to_string()) && err.contains("revision `main`"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_actorllm"))
        .args(["serve", "--model", "org/smol", "--revision", "v2", "--port", "0"])
        .env("HF_HOME", home_dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("revision `v2`"));
}

/// Unseeded sampling repeats under the same --seed and changes under another.
#[actix_rt::test]
async fn the_engine_seed_makes_unseeded_sampling_repeatable() {
    let tiny = common::tiny_model(73);
    let run = |seed: u64| {
        let args = actorllm::config::EngineArgs { seed: Some(seed), ..common::args(&tiny) };
        async move {
            let engine = actorllm::Engine::start(args).await.unwrap();
            let params = actorllm::SamplingParams {
                temperature: 1.0,
                max_tokens: Some(12),
                ignore_eos: true,
                n: 2,
                ..Default::default()
            };
            let outs = engine.generate(["hello", "world"], &params, None).await.unwrap();
            outs.into_iter().flat_map(|o| o.outputs.into_iter().map(|c| c.token_ids)).collect::<Vec<_>>()
        }
    };
    let (a, b, c) = (run(7).await, run(7).await, run(8).await);
    assert_eq!(a, b);
    assert_ne!(a, c);
}

/// 200 lines, some malformed and some refused, give one output line each, matched by
/// custom_id; greedy texts equal transformers' and the HTTP server's for the same bodies.
#[actix_rt::test]
async fn run_batch_answers_every_line_as_the_server_does() {
    let golden = common::golden::load();
    let mut bodies: Vec<(&str, Value, String)> = golden
        .prompts
        .iter()
        .map(|p| {
            let b = json!({"prompt": p.text, "max_tokens": p.output_ids.len(), "temperature": 0});
            ("/v1/completions", b, p.output_text.clone())
        })
        .collect();
    for c in &golden.chats {
        let b = json!({"messages": c.messages, "max_tokens": c.output_ids.len(), "temperature": 0});
        bodies.push(("/v1/chat/completions", b, c.output_text.clone()));
    }
    let bad: [(&str, &str); 6] = [
        ("not json at all", "invalid_request"),
        (r#"{"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}"#, "invalid_request"),
        (
            r#"{"custom_id": "BAD-url", "method": "POST", "url": "/v1/embeddings", "body": {}}"#,
            "invalid_request",
        ),
        (
            r#"{"custom_id": "BAD-stream", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "stream": true}}"#,
            "invalid_request",
        ),
        (
            r#"{"custom_id": "BAD-temp", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "temperature": -1}}"#,
            "400",
        ),
        (
            r#"{"custom_id": "BAD-model", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "model": "nope"}}"#,
            "404",
        ),
    ];
    let mut lines = Vec::new();
    let mut expected = std::collections::HashMap::new();
    for i in 0..200 {
        if i % 20 == 7 {
            lines.push(bad[(i / 20) % bad.len()].0.to_string());
            continue;
        }
        let (url, body, text) = &bodies[i % bodies.len()];
        let id = format!("req-{i}");
        lines.push(json!({"custom_id": id, "method": "POST", "url": url, "body": body}).to_string());
        expected.insert(id, (i % bodies.len(), text.clone()));
    }
    let dir = common::scratch("run-batch");
    let (input, output) = (dir.path().join("in.jsonl"), dir.path().join("out.jsonl"));
    std::fs::write(&input, lines.join("\n")).unwrap();
    let model = common::default_model();
    let out = Command::new(env!("CARGO_BIN_EXE_actorllm"))
        .args(["run-batch", "-i", input.to_str().unwrap(), "-o", output.to_str().unwrap()])
        .args(["--model", model.to_str().unwrap(), "--served-model-name", "smol"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("200 requests (190 succeeded, 10 failed)"), "{stderr}");
    let results: Vec<Value> =
        std::fs::read_to_string(&output).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(results.len(), 200, "one line per input line");
    // The same bodies over HTTP, one at a time.
    let server = common::server::start(&model, |a| a.served_model_name = vec!["smol".into()]).await;
    let mut http_texts = Vec::new();
    for (url, body, _) in &bodies {
        let (status, r) = server.post(url, body).await;
        assert_eq!(status, 200, "{r}");
        let choice = &r["choices"][0];
        http_texts
            .push(choice["text"].as_str().or(choice["message"]["content"].as_str()).unwrap().to_string());
    }
    let mut seen = std::collections::HashSet::new();
    let mut failures = Vec::new();
    for r in &results {
        match r["custom_id"].as_str().and_then(|id| expected.get(id).map(|e| (id, e))) {
            Some((id, (kind, text))) => {
                assert!(seen.insert(id.to_string()), "{id} answered twice");
                assert_eq!(r["response"]["status_code"], 200, "{r}");
                let choice = &r["response"]["body"]["choices"][0];
                let got = choice["text"].as_str().or(choice["message"]["content"].as_str()).unwrap();
                assert_eq!(got, text, "{id} against transformers");
                assert_eq!(got, http_texts[*kind], "{id} against the server");
                assert_eq!(r["response"]["body"]["model"], "smol");
            }
            None => failures.push(r.clone()),
        }
    }
    assert_eq!(seen.len(), 190);
    assert_eq!(failures.len(), 10);
    for f in &failures {
        match f["response"]["status_code"].as_u64() {
            Some(code) => {
                assert!(code == 400 || code == 404, "{f}");
                assert!(f["response"]["body"]["error"]["message"].is_string(), "OpenAI's error shape: {f}");
            }
            None => {
                assert_eq!(f["error"]["code"], "invalid_request", "{f}");
                assert!(f["error"]["message"].is_string());
            }
        }
    }
    let by_id = |id: &str| failures.iter().find(|f| f["custom_id"] == id).unwrap_or_else(|| panic!("{id}"));
    assert_eq!(by_id("BAD-temp")["response"]["body"]["error"]["param"], "temperature");
    assert_eq!(by_id("BAD-model")["response"]["status_code"], 404);
    assert!(by_id("BAD-stream")["error"]["message"].as_str().unwrap().contains("stream"));
}

/// `--generation-config auto` (the default) takes unset sampling fields from the model's
/// generation_config.json, as vLLM does; a request's own fields win; `vllm` keeps vLLM's
/// defaults; a directory names another file.
#[actix_rt::test]
async fn the_generation_config_gives_defaults_to_unset_fields() {
    let tiny = common::tiny_model(74);
    let write =
        |dir: &Path, v: Value| std::fs::write(dir.join("generation_config.json"), v.to_string()).unwrap();
    write(
        tiny.path(),
        json!({"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.0, "max_new_tokens": 5}),
    );
    let other = common::scratch("generation-config");
    write(other.path(), json!({"max_new_tokens": 7}));
    let req = json!({"prompt": "hello", "ignore_eos": true});
    let tokens = |r: &Value| r["usage"]["completion_tokens"].as_u64().unwrap();
    let text = |r: &Value| r["choices"][0]["text"].as_str().unwrap().to_string();
    for (flag, want) in [("auto", 5), ("vllm", 16), (other.path().to_str().unwrap(), 7)] {
        let server = common::server::start(&tiny, |a| a.engine.generation_config = flag.into()).await;
        let (status, first) = server.post("/v1/completions", &req).await;
        assert_eq!(status, 200, "{first}");
        assert_eq!(tokens(&first), want, "--generation-config {flag}");
        let (_, again) = server.post("/v1/completions", &req).await;
        if flag == "auto" {
            assert_eq!(text(&first), text(&again), "temperature 0 from the file: greedy");
            let (_, own) = server.post("/v1/completions", &json!({"prompt": "hello", "max_tokens": 3})).await;
            assert_eq!(tokens(&own), 3, "the request's max_tokens wins");
        } else {
            assert_ne!(text(&first), text(&again), "vLLM's temperature 1 samples");
        }
    }
    let missing =
        actorllm::config::EngineArgs { generation_config: "/nonexistent".into(), ..common::args(&tiny) };
    let e = actorllm::Engine::start(missing).await.err().unwrap().to_string();
    assert!(e.contains("--generation-config: /nonexistent/generation_config.json"), "{e}");
}

/// The chat template controls: `continue_final_message` ends the prompt inside the last
/// message as transformers' `apply_chat_template(continue_final_message=True)` renders it
/// for the default model (the string below, from transformers 5.25); a request's
/// `chat_template` with `chat_template_kwargs`, and the server's `--chat-template`, replace
/// the model's; contradictions and broken templates are a 400.
#[actix_rt::test]
async fn chat_template_fields_render_as_transformers_does() {
    let transformers = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face\
        <|im_end|>\n<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\nThe color is ";
    let inline = "{% for m in messages %}[{{ m.content }}]{% endfor %}{{ tail }}";
    let server =
        common::server::start(common::default_model(), |a| a.engine.chat_template = Some(inline.into()))
            .await;
    let ids = |r: &Value| r["tokens"].as_array().unwrap().clone();
    let (_, expected) =
        server.post("/tokenize", &json!({"prompt": transformers, "add_special_tokens": false})).await;
    let messages = json!([{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is "}]);
    let chatml = std::fs::read_to_string(common::default_model().join("tokenizer_config.json")).unwrap();
    let chatml: Value = serde_json::from_str(&chatml).unwrap();
    let chatml = chatml["chat_template"].as_str().unwrap();
    let (status, got) = server
        .post(
            "/tokenize",
            &json!({"messages": messages, "continue_final_message": true, "chat_template": chatml}),
        )
        .await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(ids(&got), ids(&expected));
    // The continued message is answered after its last word, with no new assistant turn.
    let body = json!({"messages": messages, "continue_final_message": true, "chat_template": chatml,
        "max_tokens": 4, "temperature": 0});
    let (status, r) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["usage"]["prompt_tokens"].as_u64().unwrap() as usize, ids(&expected).len());
    // --chat-template is the default template; a request's template and variables win.
    let (_, flag) = server.post("/tokenize", &json!({"messages": [{"role": "user", "content": "Hi"}]})).await;
    let (_, plain) = server.post("/tokenize", &json!({"prompt": "[Hi]", "add_special_tokens": false})).await;
    assert_eq!(ids(&flag), ids(&plain));
    let own = json!({"messages": [{"role": "user", "content": "Hi"}], "chat_template": inline,
        "chat_template_kwargs": {"tail": "!", "messages": "never replaced"}});
    let (_, own) = server.post("/tokenize", &own).await;
    let (_, plain) = server.post("/tokenize", &json!({"prompt": "[Hi]!", "add_special_tokens": false})).await;
    assert_eq!(ids(&own), ids(&plain));
    for (bad, param) in [
        (json!({"continue_final_message": true, "add_generation_prompt": true}), "messages"),
        (json!({"chat_template": "{% for %}"}), "messages"),
    ] {
        let mut body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2});
        body.as_object_mut().unwrap().extend(bad.as_object().unwrap().clone());
        let (status, e) = server.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 400, "{e}");
        assert_eq!(e["error"]["param"], param, "{e}");
    }
}
