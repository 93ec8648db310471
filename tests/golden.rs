//! The default model against Hugging Face transformers: greedy output token-identical with
//! the references in tests/fixtures/golden_smollm2.json (made by scripts/make_golden.py),
//! prompts submitted together so that batching is exercised too; tokenizer parity on
//! varied text; the chat template rendered as HF renders it.

mod common;

use actorllm::Engine;
use actorllm::config::EngineArgs;
use actorllm::tokenizer::ChatMessage;
use serde::Deserialize;

#[derive(Deserialize)]
struct Prompt {
    text: String,
    prompt_ids: Vec<u32>,
    output_ids: Vec<u32>,
}

#[derive(Deserialize)]
struct Chat {
    messages: Vec<ChatMessage>,
    prompt_text: String,
    prompt_ids: Vec<u32>,
    output_ids: Vec<u32>,
}

#[derive(Deserialize)]
struct TokCase {
    text: String,
    ids: Vec<u32>,
    decoded: String,
}

#[derive(Deserialize)]
struct Golden {
    prompts: Vec<Prompt>,
    chats: Vec<Chat>,
    tokenizer: Vec<TokCase>,
}

fn golden() -> Golden {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/golden_smollm2.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[actix_rt::test]
async fn greedy_output_matches_transformers() {
    greedy_matches(common::args(&common::default_model())).await;
}

/// Split over 3 ranks (9 heads, 3 KV heads, 1536 MLP features, a tied 49152-row
/// vocabulary: 3 each), the CPU's tensor parallelism still gives HF's tokens.
#[actix_rt::test]
async fn greedy_output_matches_transformers_over_three_ranks() {
    greedy_matches(EngineArgs { tensor_parallel_size: 3, ..common::args(&common::default_model()) }).await;
}

#[actix_rt::test]
async fn two_ranks_cannot_split_nine_heads() {
    let args = EngineArgs { tensor_parallel_size: 2, ..common::args(&common::default_model()) };
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
        cases.push((p.text.clone(), p.prompt_ids.clone(), p.output_ids.clone()));
    }
    for c in &g.chats {
        let text = tok.apply_chat_template(&c.messages, true).unwrap();
        assert_eq!(text, c.prompt_text, "chat template rendering");
        assert_eq!(tok.encode(&text, false).unwrap(), c.prompt_ids, "chat prompt encoding");
        cases.push((text, c.prompt_ids.clone(), c.output_ids.clone()));
    }
    assert!(g.prompts.len() >= 5 && g.chats.len() >= 2);
    // All at once: the engine batches them; each must still equal HF's solo greedy run.
    let runs = cases.iter().map(|(_, ids, _)| common::run(&engine, ids.clone(), common::greedy(32)));
    let outcomes = futures::future::join_all(runs).await;
    for ((text, _, want), got) in cases.iter().zip(outcomes) {
        assert_eq!(got.tokens[0], *want, "greedy continuation of {text:?}");
        let decoded = tok.decode(want, true).unwrap();
        assert_eq!(got.text[0], decoded, "streamed text equals a full decode for {text:?}");
    }
}

#[test]
fn tokenizer_matches_transformers_on_varied_text() {
    let g = golden();
    let dir = common::default_model();
    let tok = actorllm::tokenizer::Tokenizer::load(&dir, &[]).unwrap();
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
