//! The `actorllm` binary as a user runs it: `generate` prints transformers' continuation
//! of the default model; `bench offline | latency | throughput` report figures for the
//! runs they were asked for; `serve` on port 0 serves `bench serve`, logging one plain
//! line (no colour codes when not on a terminal) per finished request.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;

fn actorllm(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_actorllm")).args(args).output().expect("actorllm runs");
    assert!(
        out.status.success(),
        "actorllm {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn json_of(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

#[test]
fn generate_prints_transformers_continuations() {
    let model = common::default_model();
    let model = model.to_str().unwrap();
    let golden = common::golden::load();
    let p = &golden.prompts[0];
    let max = p.output_ids.len().to_string();
    let out = actorllm(&["generate", "--model", model, "--prompt", &p.text, "--max-tokens", &max]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), format!("{}\n", p.output_text));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let usage = format!("[{} prompt + {} generated tokens]", p.prompt_ids.len(), p.output_ids.len());
    assert!(stderr.contains(&usage), "{stderr}");
    // --chat goes through the model's chat template.
    let chat = &golden.chats[0];
    assert_eq!(chat.messages.len(), 1);
    let max = chat.output_ids.len().to_string();
    let out =
        actorllm(&["generate", "--model", model, "--chat", &chat.messages[0].content, "--max-tokens", &max]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), format!("{}\n", chat.output_text));
}

#[test]
fn generate_prints_each_of_n_choices() {
    let tiny = common::tiny_model(61);
    let args = ["generate", "--model", tiny.to_str().unwrap(), "--prompt", "hello", "--n", "2"];
    let out = actorllm(
        &[&args[..], &["--temperature", "1", "--seed", "3", "--max-tokens", "6", "--ignore-eos"]].concat(),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    for i in 0..2 {
        assert!(stdout.contains(&format!("--- choice {i} (length) ---")), "{stdout}");
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(" prompt + 12 generated tokens]"), "{stderr}");
}

#[test]
fn benchmarks_report_the_runs_they_were_asked_for() {
    let tiny = common::tiny_model(62);
    let model = tiny.to_str().unwrap();
    let v = json_of(&actorllm(&[
        "bench",
        "offline",
        "--model",
        model,
        "--batch-sizes",
        "1,4",
        "--input-len",
        "8",
        "--output-len",
        "16",
        "--prefill-len",
        "64",
        "--json",
    ]));
    let decode = v["decode"].as_array().unwrap();
    assert_eq!(decode.iter().map(|d| d["batch_size"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 4]);
    for d in decode {
        assert_eq!(d["tokens"].as_u64().unwrap(), 16 * d["batch_size"].as_u64().unwrap(), "{d}");
        assert!(d["decode_tokens_per_s"].as_f64().unwrap() > 0.0 && d["ms_per_step"].as_f64().unwrap() > 0.0);
    }
    assert_eq!(v["prefill_tokens"], 64);
    assert!(v["prefill_tokens_per_s"].as_f64().unwrap() > 0.0);

    let v = json_of(&actorllm(&[
        "bench",
        "latency",
        "--model",
        model,
        "--batch-size",
        "2",
        "--input-len",
        "8",
        "--output-len",
        "16",
        "--json",
    ]));
    assert_eq!(
        (v["batch_size"].as_u64(), v["input_len"].as_u64(), v["output_len"].as_u64()),
        (Some(2), Some(8), Some(16))
    );
    assert!(v["ms_per_step"].as_f64().unwrap() > 0.0 && v["tokens_per_s"].as_f64().unwrap() > 0.0, "{v}");
    assert!(v["bound"]["bound_tokens_per_s"].as_f64().unwrap() > 0.0, "{v}");

    let v = json_of(&actorllm(&["bench", "throughput", "--model", model, "--num-prompts", "20", "--json"]));
    assert_eq!(v["requests"], 20);
    assert!(v["mean_input_len"].as_f64().unwrap() > 0.0 && v["mean_output_len"].as_f64().unwrap() > 0.0);
    assert!(v["output_tokens_per_s"].as_f64().unwrap() > 0.0, "{v}");
    assert!(v["breakdown"]["steps"].as_u64().unwrap() > 0, "{v}");
}

/// `serve` in its own process: its log goes to a pipe, so it carries no colour codes, and
/// says where it listens; `bench serve` drives it; each request that finishes is one line
/// with its id, tokens, times, finish reason and adapter.
#[test]
fn serve_logs_one_plain_line_per_request_and_bench_serve_drives_it() {
    let tiny = common::tiny_model(63);
    let mut server = Command::new(env!("CARGO_BIN_EXE_actorllm"))
        .args(["serve", "--model", tiny.to_str().unwrap(), "--port", "0", "--served-model-name", "tiny"])
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("actorllm serve starts");
    let (tx, rx) = mpsc::channel();
    let stderr = server.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut lines = Vec::new();
    let url = loop {
        let line = rx.recv_timeout(Duration::from_secs(120)).expect("the server says where it listens");
        lines.push(line.clone());
        if let Some(at) = line.find("listening on ") {
            break line[at + "listening on ".len()..].split_whitespace().next().unwrap().to_string();
        }
    };
    let bench = Command::new(env!("CARGO_BIN_EXE_actorllm"))
        .args(["bench", "serve", "--url", &url, "--concurrency", "1,2", "--requests-per-client", "1"])
        .args(["--input-len", "8", "--output-len", "8", "--json"])
        .output()
        .expect("bench serve runs");
    server.kill().expect("server stops");
    server.wait().unwrap();
    reader.join().unwrap();
    lines.extend(rx.try_iter());
    let log = lines.join("\n");
    assert!(bench.status.success(), "bench serve failed: {}\n{log}", String::from_utf8_lossy(&bench.stderr));
    let figures: Value = serde_json::from_slice(&bench.stdout).expect("JSON figures");
    let runs: Vec<(u64, u64)> = figures
        .as_array()
        .unwrap()
        .iter()
        .map(|f| (f["concurrency"].as_u64().unwrap(), f["requests"].as_u64().unwrap()))
        .collect();
    assert_eq!(runs, [(1, 1), (2, 2)]);
    assert!(!log.contains('\u{1b}'), "colour codes in a piped log:\n{log}");
    let finished: Vec<&String> = lines.iter().filter(|l| l.contains("request finished")).collect();
    assert_eq!(finished.len(), 3, "one line per request:\n{log}");
    for l in finished {
        for field in
            ["prompt_tokens=8", "completion_tokens=8", "finish=length", "adapter=-", "ttft_ms=", "total_ms="]
        {
            assert!(l.contains(field), "{field} missing from {l}");
        }
        assert!(l.contains("request_id=cmpl-"), "{l}");
    }
    let http: Vec<&String> =
        lines.iter().filter(|l| l.contains(" http ") && l.contains("path=/v1/completions")).collect();
    assert_eq!(http.len(), 3, "one http line per request:\n{log}");
}
