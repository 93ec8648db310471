//! The default model's references from transformers (tests/fixtures/golden_smollm2.json,
//! made by scripts/make_golden.py): greedy continuations as ids and as the text
//! transformers decodes them to, chat renderings, tokenizer cases and beam searches.
#![allow(dead_code)]

use actorllm::tokenizer::ChatMessage;
use serde::Deserialize;

#[derive(Deserialize)]
pub struct Prompt {
    pub text: String,
    pub prompt_ids: Vec<u32>,
    pub output_ids: Vec<u32>,
    /// transformers' decode of `output_ids`, special tokens skipped.
    pub output_text: String,
}

#[derive(Deserialize)]
pub struct Chat {
    pub messages: Vec<ChatMessage>,
    pub prompt_text: String,
    pub prompt_ids: Vec<u32>,
    pub output_ids: Vec<u32>,
    pub output_text: String,
}

#[derive(Deserialize)]
pub struct TokCase {
    pub text: String,
    pub ids: Vec<u32>,
    pub decoded: String,
}

/// transformers' `generate(num_beams, num_return_sequences=n, length_penalty,
/// early_stopping, max_new_tokens=max_tokens)`: its hypotheses best first (ending with the
/// EOS id where they stopped) and their scores.
#[derive(Deserialize)]
pub struct Beam {
    pub prompt_ids: Vec<u32>,
    pub num_beams: usize,
    pub n: usize,
    pub length_penalty: f32,
    /// true, false or "never".
    pub early_stopping: serde_json::Value,
    pub max_tokens: usize,
    pub output_ids: Vec<Vec<u32>>,
    pub scores: Vec<f32>,
}

/// transformers' float32 log-softmax over a prompt's logits: for each position after the
/// first, the prompt token's logprob and rank and the most likely tokens.
#[derive(Deserialize)]
pub struct PromptLogprobs {
    pub prompt_ids: Vec<u32>,
    pub positions: Vec<PromptPosition>,
}

#[derive(Deserialize)]
pub struct PromptPosition {
    pub token_id: u32,
    pub logprob: f32,
    pub rank: usize,
    pub top: Vec<(u32, f32)>,
}

#[derive(Deserialize)]
pub struct Golden {
    pub prompts: Vec<Prompt>,
    pub chats: Vec<Chat>,
    pub tokenizer: Vec<TokCase>,
    pub beams: Vec<Beam>,
    pub prompt_logprobs: Vec<PromptLogprobs>,
}

pub fn load() -> Golden {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/golden_smollm2.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("golden fixture")).expect("golden JSON")
}
