//! LoRA on the default model: greedy output token-identical to transformers + PEFT for two
//! adapters of different ranks and targets, in mixed batches with the base model, with more
//! adapters than slots; a zero-B adapter equals the base model; PEFT format checks; runtime
//! loading over HTTP with path confinement, /v1/models and 404 for unknown adapters.

mod common;

use std::path::Path;

use actorllm::Engine;
use actorllm::config::{EngineArgs, LoraArgs};
use common::greedy;
use common::lora::{AdapterSpec, golden, write_adapter};
use common::scratch;
use futures::StreamExt;
use serde_json::json;

fn lora_args(modules: Vec<(String, std::path::PathBuf)>, max_loras: usize) -> EngineArgs {
    EngineArgs {
        lora: LoraArgs {
            enable_lora: true,
            lora_modules: modules,
            max_loras,
            max_lora_rank: 16,
            ..Default::default()
        },
        ..common::args(common::default_model())
    }
}

/// Greedy `tokens` tokens of `prompt` on `lora` (None = the base model).
async fn on(engine: &Engine, prompt: &[u32], lora: &Option<String>, tokens: usize) -> common::Outcome {
    let id = engine.next_request_id("t");
    let s = engine.add_request_with_lora(id, prompt.to_vec(), greedy(tokens), lora.as_deref()).await.unwrap();
    common::collect(s, 1).await
}

/// Base-model greedy continuations of the golden prompts (HF references, tests/fixtures).
fn base_outputs() -> Vec<(Vec<u32>, Vec<u32>)> {
    common::golden::load().prompts.into_iter().map(|p| (p.prompt_ids, p.output_ids)).collect()
}

#[actix_rt::test]
async fn adapters_match_peft_in_one_mixed_batch_with_the_base_model() {
    adapters_match_peft(1).await;
}

/// Split over 3 ranks, each holds its share of every adapter (B's rows under q/k/v and
/// gate/up, A's columns under o and down), and the outputs are still PEFT's.
#[actix_rt::test]
async fn adapters_match_peft_over_three_ranks() {
    adapters_match_peft(3).await;
}

async fn adapters_match_peft(tensor_parallel_size: usize) {
    let g = golden();
    let root = scratch(&format!("peft-tp{tensor_parallel_size}"));
    let modules =
        g.adapters.iter().map(|a| (a.spec.name.clone(), write_adapter(&root, &a.spec, false))).collect();
    let engine = Engine::start(EngineArgs { tensor_parallel_size, ..lora_args(modules, 2) }).await.unwrap();
    // The adapters named at start-up are on the device (every rank) before any request.
    let (s, _) = engine.stats().await.unwrap();
    assert_eq!(s.lora_slots_used, g.adapters.len().min(2), "adapters placed at start-up");
    let mut runs = Vec::new();
    let mut want = Vec::new();
    let mut want_text = Vec::new();
    for a in &g.adapters {
        for o in &a.outputs {
            runs.push((o.prompt_ids.clone(), Some(a.spec.name.clone())));
            want.push(o.output_ids.clone());
            want_text.push(&o.output_text);
        }
    }
    for (p, out) in base_outputs().into_iter().take(2) {
        runs.push((p, None));
        want.push(out[..g.tokens.min(out.len())].to_vec());
    }
    let got = futures::future::join_all(runs.iter().map(|(p, lora)| on(&engine, p, lora, g.tokens))).await;
    assert_eq!(got.len(), runs.len());
    for (i, (((p, lora), want), got)) in runs.iter().zip(&want).zip(&got).enumerate() {
        assert_eq!(&got.tokens[0], want, "prompt {p:?} with adapter {lora:?}");
        if let Some(text) = want_text.get(i) {
            assert_eq!(
                &got.text[0], *text,
                "text of prompt {p:?} with adapter {lora:?} against PEFT's decode"
            );
        }
    }
    // The adapters really change the output.
    assert_ne!(want[0], want[want.len() - 2][..want[0].len().min(want[want.len() - 2].len())]);
    let (s, _) = engine.stats().await.unwrap();
    assert!(s.lora_slots_used <= 2);
}

#[actix_rt::test]
async fn a_zero_b_adapter_gives_exactly_the_base_output_and_more_adapters_than_slots_complete() {
    let g = golden();
    let root = scratch("zero");
    let zero = AdapterSpec { name: "zero".into(), ..g.adapters[1].spec.clone() };
    let mut modules = vec![("zero".to_string(), write_adapter(&root, &zero, true))];
    modules.extend(g.adapters.iter().map(|a| (a.spec.name.clone(), write_adapter(&root, &a.spec, false))));
    // One slot for three adapters: requests wait for the slot and all still complete.
    let engine = Engine::start(lora_args(modules, 1)).await.unwrap();
    let (prompt, base) = base_outputs().remove(0);
    let mut reqs = vec![(prompt.clone(), Some("zero".to_string()), base[..g.tokens].to_vec())];
    for a in &g.adapters {
        reqs.push((
            a.outputs[0].prompt_ids.clone(),
            Some(a.spec.name.clone()),
            a.outputs[0].output_ids.clone(),
        ));
    }
    reqs.push((prompt, None, base[..g.tokens].to_vec()));
    let got = futures::future::join_all(reqs.iter().map(|(p, lora, _)| on(&engine, p, lora, g.tokens))).await;
    for ((_, lora, want), got) in reqs.iter().zip(got) {
        assert_eq!(&got.tokens[0], want, "adapter {lora:?}");
    }
}

#[actix_rt::test]
async fn peft_format_and_rank_errors_are_clear() {
    let g = golden();
    let root = scratch("errors");
    let dir = write_adapter(&root, &g.adapters[1].spec, false);
    let args = EngineArgs {
        lora: LoraArgs {
            enable_lora: true,
            lora_modules: vec![("big".into(), dir.clone())],
            max_lora_rank: 8,
            ..Default::default()
        },
        ..common::args(common::default_model())
    };
    let e = Engine::start(args).await.err().unwrap().to_string();
    assert!(e.contains("LoRA rank 16 is greater than max_lora_rank 8"), "{e}");
    std::fs::rename(dir.join("adapter_model.safetensors"), dir.join("adapter_model.bin")).unwrap();
    let e = Engine::start(lora_args(vec![("bin".into(), dir)], 1)).await.err().unwrap().to_string();
    assert!(e.contains("adapter_model.bin") && e.contains("safetensors only"), "{e}");
    // Without --enable-lora an adapter name is an unknown model.
    let engine = Engine::start(common::args(common::default_model())).await.unwrap();
    let e = engine.add_request_with_lora("x".into(), vec![1, 2], greedy(2), Some("qv8")).await.err().unwrap();
    assert!(e.to_string().contains("does not exist"), "{e}");
}

#[actix_rt::test]
async fn runtime_loading_is_confined_to_the_lora_root() {
    let g = golden();
    // The root and a directory beside it that requests must not reach.
    let base = scratch("runtime");
    let (root, outside) = (base.path().join("root"), base.path().join("outside"));
    write_adapter(&root, &g.adapters[0].spec, false);
    let evil =
        write_adapter(&outside, &AdapterSpec { name: "evil".into(), ..g.adapters[0].spec.clone() }, false);
    std::os::unix::fs::symlink(&evil, root.join("link-out")).unwrap();
    let sneaky = root.join("sneaky");
    std::fs::create_dir_all(&sneaky).unwrap();
    std::fs::copy(evil.join("adapter_config.json"), sneaky.join("adapter_config.json")).unwrap();
    std::os::unix::fs::symlink(
        evil.join("adapter_model.safetensors"),
        sneaky.join("adapter_model.safetensors"),
    )
    .unwrap();
    let s = common::server::start(&common::default_model(), |a| {
        a.engine.lora = LoraArgs {
            enable_lora: true,
            max_loras: 2,
            allow_runtime_lora: true,
            lora_root: Some(root.clone()),
            ..Default::default()
        };
    })
    .await;
    let outside_abs = evil.display().to_string();
    let escapes = [
        "../outside/evil".to_string(),
        "qv8/../../outside/evil".to_string(),
        outside_abs.clone(),
        "/etc".to_string(),
        "link-out".to_string(),
        "sneaky".to_string(),
        "qv8/../..".to_string(),
        "".to_string(),
        "does-not-exist".to_string(),
        format!("{}/../outside/evil", root.display()),
    ];
    for path in &escapes {
        let (st, v) = s.post("/v1/load_lora_adapter", &json!({"lora_name": "evil", "lora_path": path})).await;
        assert!(st == 400 || st == 403, "{path:?} → {st} {v}");
        assert!(v["error"]["message"].is_string(), "{v}");
    }
    let (_, models) = s.get_text("/v1/models").await;
    assert!(!models.contains("evil"), "nothing was loaded: {models}");
    let (st, v) = s.post("/v1/completions", &json!({"model": "evil", "prompt": "hi"})).await;
    assert_eq!(st, 404, "{v}");
    // A path inside the root loads; the adapter is listed with its parent and answers.
    let (st, v) = s.post("/v1/load_lora_adapter", &json!({"lora_name": "qv8", "lora_path": "qv8"})).await;
    assert_eq!(st, 200, "{v}");
    let (_, models) = s.get_text("/v1/models").await;
    let models: serde_json::Value = serde_json::from_str(&models).unwrap();
    let entry =
        models["data"].as_array().unwrap().iter().find(|m| m["id"] == "qv8").expect("adapter listed").clone();
    assert_eq!(entry["parent"], "test-model");
    let want = &g.adapters[0].outputs[0];
    let body = json!({"model": "qv8", "prompt": want.prompt_ids, "max_tokens": g.tokens, "temperature": 0});
    let (st, v) = s.post("/v1/completions", &body).await;
    assert_eq!((st, v["model"].as_str()), (200, Some("qv8")));
    assert_eq!(v["choices"][0]["text"], want.output_text, "PEFT's text");
    // The same through LLaMA-Factory's lora_request shape.
    let body = json!({"prompt": want.prompt_ids, "max_tokens": g.tokens, "temperature": 0,
        "lora_request": {"lora_name": "qv8", "lora_int_id": 1, "lora_path": "ignored"}});
    let (_, v2) = s.post("/v1/completions", &body).await;
    assert_eq!(v2["choices"][0]["text"], v["choices"][0]["text"]);
    // A request running when its adapter is unloaded keeps it to the end: the unload is
    // sent once the stream's first token is out, the request is still running when the
    // unload has been answered, and every token it streams is the adapter's.
    let reference = json!({"model": "qv8", "prompt": want.prompt_ids, "max_tokens": 160, "temperature": 0,
        "ignore_eos": true});
    let (_, full) = s.post("/v1/completions", &reference).await;
    let mut long = reference.clone();
    long["stream"] = json!(true);
    let mut r = s.client.post(s.url("/v1/completions")).send_json(&long).await.unwrap();
    let mut body = Vec::new();
    while !body.windows(6).any(|w| w == b"data: ") {
        body.extend_from_slice(&r.next().await.expect("a first event").unwrap());
    }
    let (st, _) = s.post("/v1/unload_lora_adapter", &json!({"lora_name": "qv8"})).await;
    assert_eq!(st, 200);
    assert_eq!(s.metric("vllm:num_requests_running").await, 1.0, "the request outlived the unload");
    while let Some(chunk) = r.next().await {
        body.extend_from_slice(&chunk.unwrap());
    }
    let text: String = common::server::parse_sse(&String::from_utf8(body).unwrap())
        .iter()
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(text, full["choices"][0]["text"].as_str().unwrap());
    let (st, _) = s.post("/v1/completions", &json!({"model": "qv8", "prompt": "hi"})).await;
    assert_eq!(st, 404, "unloaded adapters are unknown models, not the base model");
    assert!(Path::new(&outside_abs).exists());
}

#[actix_rt::test]
async fn runtime_loading_is_off_unless_allowed() {
    let s = common::server::start(&common::default_model(), |a| {
        a.engine.lora = LoraArgs { enable_lora: true, ..Default::default() };
    })
    .await;
    let (st, v) = s.post("/v1/load_lora_adapter", &json!({"lora_name": "a", "lora_path": "/tmp"})).await;
    assert_eq!(st, 403, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("--allow-runtime-lora"));
}

/// Adapters a hostile or careless user could register: a name that would forge metric lines,
/// a FIFO as its config (which would hang the read), non-finite weights, an absurd
/// lora_alpha, and a file swapped for a link out of the root after registration (refused
/// when the adapter is read again after leaving the host cache). A path outside the root
/// gets the same answer whether it exists or not.
#[actix_rt::test]
async fn hostile_adapters_are_refused_with_a_clear_error() {
    let g = golden();
    let base = scratch("hostile");
    let (root, outside) = (base.path().join("root"), base.path().join("outside"));
    let spec = |name: &str| AdapterSpec { name: name.into(), ..g.adapters[0].spec.clone() };
    for name in ["a", "b", "nan", "alpha"] {
        write_adapter(&root, &spec(name), false);
    }
    let evil = write_adapter(&outside, &spec("evil"), false);
    // One lora_A value becomes NaN: the data section follows the 8-byte length and header.
    let st = root.join("nan/adapter_model.safetensors");
    let mut bytes = std::fs::read(&st).unwrap();
    let at = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&st, bytes).unwrap();
    let cfg = root.join("alpha/adapter_config.json");
    let text =
        std::fs::read_to_string(&cfg).unwrap().replace("\"lora_alpha\":", "\"lora_alpha\":1e30,\"x\":");
    std::fs::write(&cfg, text).unwrap();
    std::fs::create_dir_all(root.join("fifo")).unwrap();
    assert!(
        std::process::Command::new("mkfifo")
            .arg(root.join("fifo/adapter_config.json"))
            .status()
            .unwrap()
            .success()
    );
    let s = common::server::start(&common::default_model(), |a| {
        a.engine.lora = LoraArgs {
            enable_lora: true,
            max_loras: 1,
            max_cpu_loras: Some(1),
            allow_runtime_lora: true,
            lora_root: Some(root.clone()),
            ..Default::default()
        };
    })
    .await;
    let load = |name: &str, path: &str| json!({"lora_name": name, "lora_path": path});
    for (body, status, says) in [
        (load("x\"} 1\nvllm:forged{a=\"", "a"), 400, "is not allowed"),
        (load("fifo", "fifo"), 403, "not an adapter directory"),
        (load("nan", "nan"), 400, "non-finite"),
        (load("alpha", "alpha"), 400, "lora_alpha"),
    ] {
        let (st, v) = s.post("/v1/load_lora_adapter", &body).await;
        assert_eq!(st, status, "{body}: {v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(says), "{says}: {v}");
    }
    let (_, metrics) = s.get_text("/metrics").await;
    assert!(!metrics.contains("vllm:forged"), "{metrics}");
    let missing = outside.join("nothing-here").display().to_string();
    let (_, there) = s.post("/v1/load_lora_adapter", &load("e", &evil.display().to_string())).await;
    let (_, absent) = s.post("/v1/load_lora_adapter", &load("e", &missing)).await;
    let shape =
        |v: &serde_json::Value, path: &str| v["error"]["message"].as_str().unwrap().replace(path, "P");
    assert_eq!(shape(&there, &evil.display().to_string()), shape(&absent, &missing));
    // Registered inside the root, then its weights swapped for a link out of it while the
    // host cache (one adapter) holds the other one.
    for name in ["a", "b"] {
        assert_eq!(s.post("/v1/load_lora_adapter", &load(name, name)).await.0, 200);
    }
    let weights = root.join("a/adapter_model.safetensors");
    std::fs::remove_file(&weights).unwrap();
    std::os::unix::fs::symlink(evil.join("adapter_model.safetensors"), &weights).unwrap();
    let (st, v) = s.post("/v1/completions", &json!({"model": "a", "prompt": "hi", "max_tokens": 2})).await;
    assert_ne!(st, 200, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("outside the LoRA root"), "{v}");
    assert_eq!(
        s.post("/v1/completions", &json!({"model": "b", "prompt": "hi", "max_tokens": 2})).await.0,
        200
    );
}

/// The metrics the Gateway API Inference Extension's endpoint picker reads, with vLLM's
/// names, types and labels: queue lengths, KV cache usage, and `vllm:lora_requests_info`
/// naming the adapters of running and waiting requests and the adapter slots.
#[actix_rt::test]
async fn metrics_name_running_and_waiting_adapters_as_vllm_does() {
    let g = golden();
    let root = scratch("gateway-metrics");
    let lora_modules: Vec<_> =
        g.adapters.iter().map(|a| (a.spec.name.clone(), write_adapter(&root, &a.spec, false))).collect();
    let (first, second) = (g.adapters[0].spec.name.clone(), g.adapters[1].spec.name.clone());
    // One slot: a request on the second adapter waits while the first one's runs.
    let s = common::server::start(&common::default_model(), |a| {
        a.engine.lora = LoraArgs { enable_lora: true, max_loras: 1, lora_modules, ..Default::default() };
    })
    .await;
    let info = |text: &str| -> (Vec<(String, String)>, f64) {
        let line = text.lines().find(|l| l.starts_with("vllm:lora_requests_info{")).expect("the info series");
        let (labels, value) = line.rsplit_once(' ').unwrap();
        let labels = labels.trim_start_matches("vllm:lora_requests_info{").trim_end_matches('}');
        let labels = labels
            .split("\",")
            .map(|kv| {
                let (k, v) = kv.split_once("=\"").unwrap();
                (k.to_string(), v.trim_end_matches('"').to_string())
            })
            .collect();
        (labels, value.parse().unwrap())
    };
    let (_, text) = s.get_text("/metrics").await;
    for name in ["vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"] {
        assert!(text.contains(&format!("# TYPE {name} gauge\n")), "{name} is a gauge: {text}");
    }
    assert!(text.contains("# TYPE vllm:lora_requests_info gauge\n"), "{text}");
    let now = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    let (labels, at) = info(&text);
    let label = |labels: &[(String, String)], k: &str| labels.iter().find(|l| l.0 == k).map(|l| l.1.clone());
    assert_eq!(label(&labels, "max_lora").as_deref(), Some("1"));
    assert_eq!(label(&labels, "running_lora_adapters").as_deref(), Some(""), "{labels:?}");
    assert_eq!(label(&labels, "waiting_lora_adapters").as_deref(), Some(""), "{labels:?}");
    assert!((now() - at).abs() < 30.0, "valued at the reading's time: {at}");
    // A long request on the first adapter, then one on the second, both streamed.
    let prompt = &g.adapters[0].outputs[0].prompt_ids;
    let stream = |model: &str| json!({"model": model, "prompt": prompt, "max_tokens": 4000, "ignore_eos": true, "stream": true});
    let mut running = s.client.post(s.url("/v1/completions")).send_json(&stream(&first)).await.unwrap();
    let _ = running.next().await.expect("a first chunk").unwrap();
    let waiting = s.client.post(s.url("/v1/completions")).send_json(&stream(&second)).await.unwrap();
    s.wait_for_metric("vllm:num_requests_waiting", 1.0).await;
    let (_, text) = s.get_text("/metrics").await;
    let (labels, _) = info(&text);
    assert_eq!(label(&labels, "running_lora_adapters"), Some(first.clone()), "{labels:?}");
    assert_eq!(label(&labels, "waiting_lora_adapters"), Some(second.clone()), "{labels:?}");
    assert_eq!(s.metric("vllm:num_requests_running").await, 1.0);
    drop((running, waiting));
    s.wait_for_metric("vllm:num_requests_running", 0.0).await;
    s.wait_for_metric("vllm:num_requests_waiting", 0.0).await;
    let (labels, _) = info(&s.get_text("/metrics").await.1);
    assert_eq!(label(&labels, "running_lora_adapters").as_deref(), Some(""), "{labels:?}");
}
