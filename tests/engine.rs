//! The engine through its actors on a tiny random Llama the test writes itself: batching,
//! preemption, block accounting, seeds, stop conditions, n > 1 and admission errors.

mod common;

use actorllm::config::EngineArgs;
use actorllm::kernels::cpu::CpuDevice;
use actorllm::models::registry::ModelRegistry;
use actorllm::request::{AbortReason, FinishReason, StopReason};
use actorllm::{Engine, SamplingParams};
use common::{Outcome, ScratchDir, collect, greedy, run, tiny_model, wait_all_blocks_free};

fn prompts() -> Vec<Vec<u32>> {
    (0..6u32).map(|i| (0..(5 + 7 * i)).map(|j| (i * 31 + j * 17) % 250 + 3).collect()).collect()
}

fn long(max_tokens: usize) -> SamplingParams {
    SamplingParams { ignore_eos: true, ..greedy(max_tokens) }
}

async fn solo_outputs(engine: &Engine, params: &SamplingParams) -> Vec<Outcome> {
    let mut out = Vec::new();
    for p in prompts() {
        out.push(run(engine, p, params.clone()).await);
    }
    out
}

#[actix_rt::test]
async fn a_batch_gives_each_request_its_solo_output() {
    let model = tiny_model(1);
    let engine = Engine::start(common::args(&model)).await.unwrap();
    let params = long(24);
    let solo = solo_outputs(&engine, &params).await;
    let together =
        futures::future::join_all(prompts().into_iter().map(|p| run(&engine, p, params.clone()))).await;
    for (s, t) in solo.iter().zip(&together) {
        assert_eq!(s.tokens, t.tokens);
        assert_eq!(s.tokens[0].len(), 24);
        assert_eq!(t.finish[0], Some(FinishReason::Length));
    }
    assert_eq!(wait_all_blocks_free(&engine).await.0, wait_all_blocks_free(&engine).await.1);
}

#[actix_rt::test]
async fn a_pool_too_small_for_everyone_preempts_and_still_completes_identically() {
    let model = tiny_model(2);
    let reference = Engine::start(common::args(&model)).await.unwrap();
    let params = long(60);
    let solo = solo_outputs(&reference, &params).await;
    // 12 blocks × 16 tokens = 192 slots for six sequences of up to 100 tokens.
    let args =
        EngineArgs { num_gpu_blocks_override: Some(12), max_model_len: Some(128), ..common::args(&model) };
    let small = Engine::start(args).await.unwrap();
    let together =
        futures::future::join_all(prompts().into_iter().map(|p| run(&small, p, params.clone()))).await;
    for (s, t) in solo.iter().zip(&together) {
        assert_eq!(s.tokens, t.tokens, "output unchanged by preemption");
    }
    let preempted = small.metrics().preemptions.load(std::sync::atomic::Ordering::Relaxed);
    assert!(preempted > 0, "the small pool must have preempted");
    let (free, total) = wait_all_blocks_free(&small).await;
    assert_eq!((free, total), (12, 12));
}

#[actix_rt::test]
async fn blocks_come_back_after_abort_and_dropped_streams() {
    let model = tiny_model(3);
    let engine = Engine::start(common::args(&model)).await.unwrap();
    let p = prompts();
    let keep = engine.add_request("keep".into(), p[1].clone(), long(40)).await.unwrap();
    let cancelled = engine.add_request("cancel-me".into(), p[2].clone(), long(2000)).await.unwrap();
    let dropped = engine.add_request("drop-me".into(), p[3].clone(), long(2000)).await.unwrap();
    drop(dropped);
    assert!(engine.abort("cancel-me", AbortReason::Cancelled).await);
    let c = collect(cancelled, 1).await;
    assert_eq!(c.finish[0], Some(FinishReason::Abort));
    let k = collect(keep, 1).await;
    assert_eq!(k.tokens[0].len(), 40, "the other request is undisturbed");
    let (free, total) = wait_all_blocks_free(&engine).await;
    assert_eq!(free, total);
    assert_eq!(engine.metrics().aborts(AbortReason::Cancelled), 1);
    assert_eq!(engine.metrics().aborts(AbortReason::ClientGone), 1);
    assert!(!engine.abort("cancel-me", AbortReason::Cancelled).await, "already gone");
}

/// A beam search cancelled or dropped while its beams fork gives back every block, its
/// choices end with `abort`, and a request beside it is undisturbed.
#[actix_rt::test]
async fn an_aborted_beam_search_gives_back_every_block() {
    use actorllm::request::{BeamParams, EarlyStopping};
    let model = tiny_model(3);
    let engine = Engine::start(common::args(&model)).await.unwrap();
    let p = prompts();
    let beams = SamplingParams {
        n: 3,
        beam: Some(BeamParams { width: 4, length_penalty: 1.0, early_stopping: EarlyStopping::Never }),
        ..long(1500)
    };
    let keep = engine.add_request("keep".into(), p[1].clone(), long(40)).await.unwrap();
    let cancelled = engine.add_request("cancel-beams".into(), p[2].clone(), beams.clone()).await.unwrap();
    let dropped = engine.add_request("drop-beams".into(), p[3].clone(), beams).await.unwrap();
    // Let the searches fork for a while first.
    while engine.metrics().steps.load(std::sync::atomic::Ordering::Relaxed) < 20 {
        actix_rt::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    drop(dropped);
    assert!(engine.abort("cancel-beams", AbortReason::Cancelled).await);
    let c = collect(cancelled, 3).await;
    assert_eq!(c.finish, vec![Some(FinishReason::Abort); 3]);
    assert!(c.tokens.iter().all(Vec::is_empty), "a beam search sends its choices only at its end");
    let k = collect(keep, 1).await;
    assert_eq!(k.tokens[0].len(), 40, "the other request is undisturbed");
    let (free, total) = wait_all_blocks_free(&engine).await;
    assert_eq!(free, total);
    assert_eq!(engine.metrics().aborts(AbortReason::ClientGone), 1);
}

#[actix_rt::test]
async fn the_same_seed_gives_the_same_output_whatever_else_is_running() {
    let model = tiny_model(4);
    let engine = Engine::start(common::args(&model)).await.unwrap();
    let sampled = |seed| SamplingParams { temperature: 1.0, top_p: 0.95, seed: Some(seed), ..long(32) };
    let p = prompts();
    let alone = run(&engine, p[0].clone(), sampled(7)).await;
    let others = p[1..].iter().map(|q| (q.clone(), sampled(99))).collect();
    let batch = common::run_among(&engine, p[0].clone(), sampled(7), others).await;
    assert_eq!(alone.tokens, batch.tokens);
    let other_seed = run(&engine, p[0].clone(), sampled(8)).await;
    assert_ne!(alone.tokens, other_seed.tokens, "a different seed samples differently");
}

#[actix_rt::test]
async fn stop_strings_and_stop_token_ids_end_the_output() {
    let model = tiny_model(5);
    let engine = Engine::start(common::args(&model)).await.unwrap();
    let prompt = prompts()[4].clone();
    let full = run(&engine, prompt.clone(), long(30)).await;
    let tok = engine.tokenizer();
    // A stop token: the output ends with it, finish reason stop.
    let stop_tok = full.tokens[0][6];
    let first = full.tokens[0].iter().position(|&t| t == stop_tok).unwrap();
    let o = run(&engine, prompt.clone(), SamplingParams { stop_token_ids: vec![stop_tok], ..long(30) }).await;
    assert_eq!(o.tokens[0], full.tokens[0][..=first]);
    assert_eq!(
        (o.finish[0], o.stop[0].clone()),
        (Some(FinishReason::Stop), Some(StopReason::Token(stop_tok)))
    );
    // A stop string taken from the middle of the text: cut before it, never streamed.
    let text = tok.decode(&full.tokens[0], true).unwrap();
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let cut = &text[..text.find(&stop).unwrap()];
    let o = run(&engine, prompt.clone(), SamplingParams { stop: vec![stop.clone()], ..long(30) }).await;
    assert_eq!(o.text[0], cut);
    assert_eq!(o.stop[0], Some(StopReason::Text(stop.clone())));
    let o = run(
        &engine,
        prompt,
        SamplingParams { stop: vec![stop.clone()], include_stop_str_in_output: true, ..long(30) },
    )
    .await;
    assert_eq!(o.text[0], format!("{cut}{stop}"));
}

#[actix_rt::test]
async fn n_choices_share_a_prompt_and_each_is_reproducible() {
    let model = tiny_model(6);
    let engine = Engine::start(common::args(&model)).await.unwrap();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 13) % 250 + 3).collect();
    let params = SamplingParams { n: 3, temperature: 1.0, seed: Some(11), ..long(16) };
    let a = run(&engine, prompt.clone(), params.clone()).await;
    let b = run(&engine, prompt, params).await;
    assert_eq!(a.tokens, b.tokens);
    assert!(a.tokens.iter().all(|t| t.len() == 16));
    assert_ne!(a.tokens[0], a.tokens[1], "choices draw independently");
    assert_eq!(a.usage.unwrap().completion_tokens, 48);
    let (free, total) = wait_all_blocks_free(&engine).await;
    assert_eq!(free, total);
}

#[actix_rt::test]
async fn chunked_prefill_gives_the_same_output() {
    let model = tiny_model(7);
    let whole = Engine::start(common::args(&model)).await.unwrap();
    let args = EngineArgs { max_num_batched_tokens: Some(16), max_num_seqs: Some(4), ..common::args(&model) };
    let chunked = Engine::start(args).await.unwrap();
    let prompt: Vec<u32> = (0..45).map(|i| (i * 7) % 250 + 3).collect();
    let a = run(&whole, prompt.clone(), long(10)).await;
    let b = run(&chunked, prompt, long(10)).await;
    assert_eq!(a.tokens, b.tokens);
}

#[actix_rt::test]
async fn admission_errors_say_the_limit_and_the_fix() {
    let model = tiny_model(8);
    let args = EngineArgs { max_model_len: Some(64), ..common::args(&model) };
    let engine = Engine::start(args).await.unwrap();
    let e = engine.add_request("x".into(), vec![5; 70], greedy(4)).await.err().unwrap();
    assert_eq!(e.to_string(), "Input prompt (70 tokens) is too long and exceeds limit of 64");
    let e = engine
        .add_request("y".into(), vec![5; 4], SamplingParams { top_p: 0.0, ..greedy(4) })
        .await
        .err()
        .unwrap();
    assert!(e.to_string().contains("top_p"), "{e}");
    let e = engine.add_request("z".into(), vec![999; 4], greedy(4)).await.err().unwrap();
    assert!(e.to_string().contains("out of vocabulary"), "{e}");
    let args =
        EngineArgs { num_gpu_blocks_override: Some(4), max_model_len: Some(1000), ..common::args(&model) };
    let e = Engine::start(args).await.err().unwrap().to_string();
    assert!(
        e.contains("larger than the maximum number of tokens that can be stored in KV cache (64)"),
        "{e}"
    );
    assert!(e.contains("lower --max-model-len"), "{e}");
    let e = Engine::start(common::args(std::path::Path::new("/nonexistent/model")))
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("config.json"), "{e}");
}

fn copy_model(src: &std::path::Path, name: &str, edit: impl Fn(&mut serde_json::Value)) -> ScratchDir {
    let dst = common::scratch(name);
    for f in std::fs::read_dir(src).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), dst.join(f.file_name())).unwrap();
    }
    let config = dst.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(config, cfg.to_string()).unwrap();
    dst
}

#[actix_rt::test]
async fn unknown_architectures_and_wrong_shapes_are_named() {
    use actorllm::kernels::cpu::CpuDevice;
    use actorllm::models::registry::{ModelEntry, ModelRegistry};
    let base = tiny_model(9);
    let foo = copy_model(&base, "foo", |c| c["architectures"] = serde_json::json!(["FooForCausalLM"]));
    let e = Engine::start(common::args(&foo)).await.err().unwrap().to_string();
    assert!(e.contains("FooForCausalLM") && e.contains("LlamaForCausalLM"), "{e}");
    // Out-of-tree registration (the seed's ModelRegistry.register_model).
    let mut registry = ModelRegistry::<CpuDevice>::default();
    let llama = ModelRegistry::<CpuDevice>::default();
    let known = llama.architectures();
    assert!(known.contains(&"Qwen2ForCausalLM"));
    registry.register_model(
        "FooForCausalLM",
        ModelEntry {
            construct: |d, c, w, o| {
                Ok(Box::new(actorllm::models::llama::LlamaForCausalLM::load(d, c, w, o)?))
            },
            ..actorllm::models::llama::entry()
        },
    );
    let engine = Engine::start_with(common::args(&foo), registry).await.unwrap();
    let want = run(&Engine::start(common::args(&base)).await.unwrap(), vec![5, 6, 7], long(8)).await;
    assert_eq!(run(&engine, vec![5, 6, 7], long(8)).await.tokens, want.tokens);
    let bad = copy_model(&base, "badshape", |c| c["intermediate_size"] = serde_json::json!(100));
    let e = Engine::start(common::args(&bad)).await.err().unwrap().to_string();
    assert!(e.contains("model.layers.0.mlp.gate_proj.weight has shape [128, 64], expected [100, 64]"), "{e}");
}

#[actix_rt::test]
async fn logprobs_come_with_each_token_when_asked() {
    use actorllm::TokenEvent;
    use futures::StreamExt;
    let model = tiny_model(10);
    let engine = Engine::start(common::args(&model)).await.unwrap();
    let params = SamplingParams { logprobs: Some(3), ..long(6) };
    let mut s = engine.add_request("lp".into(), vec![5, 6, 7, 8], params).await.unwrap();
    let mut seen = 0;
    while let Some(ev) = s.next().await {
        if let TokenEvent::Token { token_id, logprobs, .. } = ev {
            let lp = logprobs.expect("logprobs requested");
            assert_eq!(lp.token_id, token_id);
            assert_eq!(lp.top.len(), 3);
            assert_eq!(lp.top[0].0, token_id, "greedy picks the most likely token");
            assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
            assert!(lp.logprob <= 0.0 && (lp.logprob - lp.top[0].1).abs() < 1e-6);
            seen += 1;
        }
    }
    assert_eq!(seen, 6);
}

#[actix_rt::test]
async fn aborts_racing_with_steps_never_break_the_engine() {
    let model = tiny_model(11);
    let engine = Engine::start(common::args(&model)).await.unwrap();
    let background = engine.add_request("bg".into(), prompts()[5].clone(), long(300)).await.unwrap();
    // Churn of adds and aborts while steps run. (The precise abort-during-reservation race
    // is pinned down deterministically in the Scheduler actor's unit test.)
    for i in 0..300 {
        let id = format!("race-{i}");
        let s = engine.add_request(id.clone(), prompts()[i % 6].clone(), long(50)).await.unwrap();
        // Spread the aborts over the phases of the running steps.
        actix_rt::time::sleep(std::time::Duration::from_micros((i as u64 * 37) % 1500)).await;
        engine.abort(&id, AbortReason::Cancelled).await;
        drop(s);
    }
    let bg = collect(background, 1).await;
    assert_eq!(bg.tokens[0].len(), 300, "the engine kept running");
    let (free, total) = wait_all_blocks_free(&engine).await;
    assert_eq!(free, total);
    let after = run(&engine, prompts()[0].clone(), long(5)).await;
    assert_eq!(after.tokens[0].len(), 5);
}

/// Splits a model's single safetensors file into two shards with an index.
fn shard(src: &std::path::Path, name: &str) -> ScratchDir {
    let dst = copy_model(src, name, |_| {});
    let bytes = std::fs::read(dst.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().cloned().collect();
    names.sort();
    let (first, second) = names.split_at(names.len() / 2);
    let mut weight_map = serde_json::Map::new();
    for (file, part) in
        [("model-00001-of-00002.safetensors", first), ("model-00002-of-00002.safetensors", second)]
    {
        let views: Vec<(String, safetensors::tensor::TensorView)> =
            part.iter().map(|n| (n.clone(), st.tensor(n).unwrap())).collect();
        safetensors::tensor::serialize_to_file(views, &None, &dst.join(file)).unwrap();
        for n in part {
            weight_map.insert(n.clone(), serde_json::json!(file));
        }
    }
    std::fs::remove_file(dst.join("model.safetensors")).unwrap();
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dst.join("model.safetensors.index.json"), index.to_string()).unwrap();
    dst
}

#[actix_rt::test]
async fn sharded_checkpoints_half_precision_and_chat_template_files_load() {
    let base = tiny_model(12);
    let prompt = prompts()[3].clone();
    let want = run(&Engine::start(common::args(&base)).await.unwrap(), prompt.clone(), long(12)).await;
    // Sharded through model.safetensors.index.json: the same model.
    let sharded = shard(&base, "sharded");
    assert!(!sharded.join("model.safetensors").exists());
    let got = run(&Engine::start(common::args(&sharded)).await.unwrap(), prompt.clone(), long(12)).await;
    assert_eq!(got.tokens, want.tokens);
    // bf16 and f16 checkpoints load and generate (rounding may change the tokens).
    for (name, dtype) in [("bf16", actorllm::kernels::DType::BF16), ("f16", actorllm::kernels::DType::F16)] {
        let dir = common::scratch(name);
        actorllm::models::random::make_random_model(
            actorllm::models::random::Preset::Tiny.shape(),
            &dir,
            dtype,
            12,
            4.0,
        )
        .unwrap();
        let engine = Engine::start(common::args(&dir)).await.unwrap();
        assert_eq!(engine.config().dtype, dtype, "--dtype auto keeps the checkpoint's dtype");
        assert_eq!(run(&engine, prompt.clone(), long(12)).await.tokens[0].len(), 12);
    }
    // chat_template.jinja is used when tokenizer_config.json has no template.
    let jinja = copy_model(&base, "jinja", |_| {});
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(jinja.join("tokenizer_config.json")).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("chat_template");
    std::fs::write(jinja.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    std::fs::write(
        jinja.join("chat_template.jinja"),
        "{% for m in messages %}[{{ m.role }}]{{ m.content | upper }}{% endfor %}",
    )
    .unwrap();
    let tok = actorllm::tokenizer::Tokenizer::load(&jinja, &[]).unwrap();
    let msgs = [actorllm::tokenizer::ChatMessage {
        role: "user".into(),
        content: "hi".into(),
        ..Default::default()
    }];
    assert_eq!(tok.apply_chat_template(&msgs, true).unwrap(), "[user]HI");
    // A template that would loop for ever runs out of steps and says so.
    std::fs::write(
        jinja.join("chat_template.jinja"),
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    )
    .unwrap();
    let tok = actorllm::tokenizer::Tokenizer::load(&jinja, &[]).unwrap();
    let e = tok.apply_chat_template(&msgs, true).expect_err("stopped").to_string();
    assert!(e.contains("fuel"), "{e}");
}

/// `--async-scheduling` (the default) plans each step while the one before it runs, so a
/// request that stops has already been given one step more. Every request must still get
/// exactly what it gets without it: lengths that end at different steps, a stop token and
/// a stop string (found a step after the next was planned), seeded sampling with n = 2, and
/// preemption in a pool too small for everyone; and every block must come back. A request
/// that ends by length is given no step past its last token.
#[actix_rt::test]
async fn async_scheduling_gives_the_same_outputs_as_one_step_at_a_time() {
    let model = tiny_model(9);
    let small =
        EngineArgs { num_gpu_blocks_override: Some(12), max_model_len: Some(128), ..common::args(&model) };
    let sync = Engine::start(EngineArgs { async_scheduling: false, ..small.clone() }).await.unwrap();
    let pipelined = Engine::start(EngineArgs { async_scheduling: true, ..small }).await.unwrap();
    let p = prompts();
    // Sequences that end by length are given no step past their last token.
    let lengths: Vec<_> =
        p.iter().enumerate().map(|(i, q)| run(&pipelined, q.clone(), long(5 + 3 * i))).collect();
    futures::future::join_all(lengths).await;
    let dropped = pipelined.metrics().profile.dropped_tokens.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(dropped, 0, "tokens sampled past max_tokens");
    // The stop token and the stop string come from each prompt's own greedy output, so
    // they are met whatever the machine's float rounding makes the random model say.
    let (full2, full5) = (run(&sync, p[2].clone(), long(40)).await, run(&sync, p[5].clone(), long(40)).await);
    let text = sync.tokenizer().decode(&full5.tokens[0], true).unwrap();
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let params: Vec<SamplingParams> = (0..p.len())
        .map(|i| match i % 3 {
            0 if i == 3 => SamplingParams {
                repetition_penalty: 1.3,
                presence_penalty: 0.5,
                logprobs: Some(2),
                ..long(25)
            },
            0 => long(12 + 9 * i),
            1 => SamplingParams { n: 2, temperature: 1.0, seed: Some(i as u64), ..long(20 + i) },
            _ if i == 2 => SamplingParams { stop_token_ids: vec![full2.tokens[0][6]], ..long(40) },
            _ => SamplingParams { stop: vec![stop.clone()], ..long(40) },
        })
        .collect();
    async fn work(engine: &Engine, p: &[Vec<u32>], params: &[SamplingParams]) -> Vec<common::Outcome> {
        let runs = p.iter().zip(params).map(|(q, sp)| run(engine, q.clone(), sp.clone()));
        futures::future::join_all(runs).await
    }
    let (a, b) = (work(&sync, &p, &params).await, work(&pipelined, &p, &params).await);
    // Prefix-cache hits depend on what each engine ran before: the rest of usage may not.
    let uncached = |o: Vec<common::Outcome>| -> Vec<common::Outcome> {
        o.into_iter()
            .map(|mut o| {
                if let Some(u) = o.usage.as_mut() {
                    u.cached_tokens = 0;
                }
                o
            })
            .collect()
    };
    let (a, b) = (uncached(a), uncached(b));
    assert_eq!(a, b, "outputs, finish reasons and usage unchanged");
    for i in [2, 5] {
        assert_eq!(a[i].finish, vec![Some(FinishReason::Stop)], "prompt {i} met its stop condition");
    }
    let m = |e: &Engine| {
        let p = &e.metrics().profile;
        (
            p.pipelined_steps.load(std::sync::atomic::Ordering::Relaxed),
            e.metrics().preemptions.load(std::sync::atomic::Ordering::Relaxed),
        )
    };
    let ((sync_piped, _), (piped, preempted)) = (m(&sync), m(&pipelined));
    assert_eq!(sync_piped, 0);
    assert!(piped > 0, "steps were planned while another ran");
    assert!(preempted > 0, "the small pool preempted");
    for e in [&sync, &pipelined] {
        let (free, total) = wait_all_blocks_free(e).await;
        assert_eq!(free, total);
    }
    // A device that takes a step's sampled tokens as the next step's inputs itself (as a
    // GPU does): the runner answers each step at the next message, and the outputs stay
    // the same, with penalties (whose steps wait for their tokens) among them.
    for async_scheduling in [true, false] {
        let args = EngineArgs {
            async_scheduling,
            num_gpu_blocks_override: Some(12),
            max_model_len: Some(128),
            ..common::args(&model)
        };
        let feeding = |_: &_| Ok(vec![CpuDevice::feeding_sampled_tokens()]);
        let fed = Engine::start_on(args, ModelRegistry::<CpuDevice>::default(), feeding).await.unwrap();
        assert_eq!(work(&fed, &p, &params).await, a, "async scheduling {async_scheduling}");
        let fed_steps = fed.metrics().profile.fed_steps.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(fed_steps > 0, async_scheduling, "{fed_steps} steps took their tokens on the device");
        let (free, total) = wait_all_blocks_free(&fed).await;
        assert_eq!(free, total);
    }
}

/// A client that stops reading its stream holds neither memory nor KV blocks: past
/// `--stream-backlog` unread events per choice its request is aborted, and the events it
/// finds when it reads again end with an error saying why. A reader beside it is served in
/// full.
#[actix_rt::test]
async fn a_stream_left_unread_is_aborted_past_its_backlog() {
    let model = tiny_model(9);
    let engine = Engine::start(common::args(&model)).await.unwrap();
    engine.set_stream_backlog(8);
    let params = SamplingParams { n: 2, ..long(200) };
    let mut idle = engine.add_request(engine.next_request_id("idle"), vec![5, 6, 7], params).await.unwrap();
    let reader = run(&engine, vec![8, 9, 10], long(100)).await;
    assert_eq!(reader.tokens[0].len(), 100, "a client that reads is not held to the backlog");
    let started = std::time::Instant::now();
    while engine.metrics().aborts(AbortReason::SlowClient) == 0 {
        assert!(started.elapsed().as_secs() < 60, "the unread request was never aborted");
        actix_rt::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let (free, total) = wait_all_blocks_free(&engine).await;
    assert_eq!(free, total, "the aborted request's blocks are back");
    let mut tokens = [0usize; 2];
    let mut last = None;
    while let Some(ev) = futures::StreamExt::next(&mut idle).await {
        match ev {
            actorllm::request::TokenEvent::Token { index, .. } => tokens[index] += 1,
            other => last = Some(other),
        }
    }
    assert!(tokens.iter().all(|&t| (8..=9).contains(&t)), "each choice kept about its backlog: {tokens:?}");
    match last {
        Some(actorllm::request::TokenEvent::Error { message }) => {
            assert!(message.contains("unread") && message.contains("--stream-backlog"), "{message}")
        }
        other => panic!("the stream ended with {other:?}, not an error"),
    }
}
