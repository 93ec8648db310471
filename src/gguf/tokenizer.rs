//! The tokenizer.json and tokenizer_config.json of a GGUF file's vocabulary: byte-level
//! BPE (`tokenizer.ggml.model` `gpt2`: its merges and pre-tokenizer family), or
//! SentencePiece (`llama`: Llama, Mistral, Gemma), rebuilt as transformers converts a
//! SentencePiece model: BPE over the pieces with byte fallback, each pair of pieces that
//! joins into a piece a merge ranked by the joined piece's score, and `▁` for spaces, with
//! a leading one where the file says so (`tokenizer.ggml.add_space_prefix`, default true).

use std::path::Path;

use serde_json::{Value as Json, json};

use super::import::{ImportError, string_array, write_json};
use super::{GgufFile, Value};

/// The pre-tokenizer of a `tokenizer.ggml.pre` family, as HF's tokenizer.json spells it.
fn pre_tokenizer(pre: &str) -> Result<Json, ImportError> {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    Ok(match pre {
        // StarCoder lineage (SmolLM, SmolLM2): every digit is its own pre-token.
        "smollm" | "starcoder" | "refact" | "codeshell" => json!({
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level(true)]
        }),
        "gpt2" | "default" => byte_level(true),
        "llama-bpe" | "llama3" | "qwen2" => {
            let pattern = if pre == "qwen2" {
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
            } else {
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
            };
            json!({
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
                    byte_level(false)
                ]
            })
        }
        other => return Err(ImportError::PreTokenizer(other.to_string())),
    })
}

/// A SentencePiece vocabulary's pieces as merges, as transformers' converter derives them:
/// every split of a piece into two pieces, those of one piece in the order of the halves'
/// ids, all ranked by the joined piece's score, highest first (a stable sort).
fn spm_merges(tokens: &[String], scores: &[f32]) -> Vec<(String, String)> {
    let id: std::collections::HashMap<&str, usize> =
        tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i)).collect();
    let mut merges: Vec<(usize, usize, f32)> = Vec::new();
    for (joined, piece) in tokens.iter().enumerate() {
        let mut local: Vec<(usize, usize, f32)> = piece
            .char_indices()
            .skip(1)
            .filter_map(|(at, _)| {
                let (l, r) = piece.split_at(at);
                Some((*id.get(l)?, *id.get(r)?, scores.get(joined).copied().unwrap_or(0.0)))
            })
            .collect();
        local.sort_by_key(|&(l, r, _)| (l, r));
        merges.extend(local);
    }
    merges.sort_by(|a, b| b.2.total_cmp(&a.2));
    merges.into_iter().map(|(l, r, _)| (tokens[l].clone(), tokens[r].clone())).collect()
}

pub(super) fn write_tokenizer(g: &GgufFile, tokens: &[String], out: &Path) -> Result<(), ImportError> {
    let model = g.get_str("tokenizer.ggml.model")?;
    let spm = match model {
        "gpt2" => false,
        "llama" => true,
        other => return Err(ImportError::TokenizerModel(other.to_string())),
    };
    let types: Vec<u64> = match g.get("tokenizer.ggml.token_type") {
        Ok(Value::Array(a)) => a.iter().map(|v| v.as_u64().unwrap_or(1)).collect(),
        _ => vec![1; tokens.len()],
    };
    let mut vocab = serde_json::Map::new();
    let mut added = Vec::new();
    let mut added_decoder = serde_json::Map::new();
    for (id, tok) in tokens.iter().enumerate() {
        vocab.insert(tok.clone(), json!(id));
        // 2 = unknown and 3 = control (special), 4 = user-defined (added, not special).
        let ty = types.get(id).copied().unwrap_or(1);
        if ty == 3 || ty == 4 || (spm && ty == 2) {
            let entry = json!({
                "id": id, "content": tok, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": ty != 4
            });
            added_decoder.insert(id.to_string(), entry.clone());
            added.push(entry);
        }
    }
    let add_bos = g.get("tokenizer.ggml.add_bos_token").ok().and_then(Value::as_bool).unwrap_or(spm);
    let tok_name = |key: &str| g.get_u64(key).ok().and_then(|id| tokens.get(id as usize)).cloned();
    let bos = tok_name("tokenizer.ggml.bos_token_id");
    let post_processor = match (&bos, add_bos) {
        (Some(b), true) => json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {b.as_str(): {"id": b, "ids": [g.get_u64("tokenizer.ggml.bos_token_id")?], "tokens": [b]}}
        }),
        _ if spm => Json::Null,
        _ => json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true}),
    };
    let (normalizer, pre_tokenizer, decoder, model) = if spm {
        let scores: Vec<f32> = match g.get("tokenizer.ggml.scores") {
            Ok(Value::Array(a)) => a.iter().map(|v| v.as_f64().unwrap_or(0.0) as f32).collect(),
            _ => vec![0.0; tokens.len()],
        };
        let merges: Vec<Json> = spm_merges(tokens, &scores).into_iter().map(|(l, r)| json!([l, r])).collect();
        let space_prefix =
            g.get("tokenizer.ggml.add_space_prefix").ok().and_then(Value::as_bool).unwrap_or(true);
        let unk = tok_name("tokenizer.ggml.unknown_token_id")
            .or_else(|| types.iter().position(|&t| t == 2).map(|i| tokens[i].clone()));
        let replace = json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "});
        let (normalizer, pre, decoder) = match space_prefix {
            // Llama and Mistral: `▁` for every space, and one before the text.
            true => (
                Json::Null,
                json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false}),
                json!({"type": "Sequence", "decoders": [replace, {"type": "ByteFallback"}, {"type": "Fuse"},
                       {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}),
            ),
            // Gemma: spaces become `▁`, none is added.
            false => (
                json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"}),
                Json::Null,
                json!({"type": "Sequence", "decoders": [replace, {"type": "ByteFallback"}, {"type": "Fuse"}]}),
            ),
        };
        let model = json!({
            "type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
            "ignore_merges": false, "vocab": vocab, "merges": merges
        });
        (normalizer, pre, decoder, model)
    } else {
        let pre = g.get_str("tokenizer.ggml.pre").unwrap_or("default");
        let merges = string_array(g, "tokenizer.ggml.merges")?;
        let model = json!({
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab, "merges": merges
        });
        let decoder =
            json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
        (Json::Null, pre_tokenizer(pre)?, decoder, model)
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": decoder,
        "model": model,
    });
    let text = serde_json::to_string(&tokenizer).expect("JSON values always serialize");
    tokenizers::Tokenizer::from_bytes(text.as_bytes()).map_err(|e| ImportError::Tokenizer(e.to_string()))?;
    let path = out.join("tokenizer.json");
    std::fs::write(&path, text)
        .map_err(|source| ImportError::Write { path: path.display().to_string(), source })?;

    let arch = g.get_str("general.architecture").unwrap_or("llama");
    let mut cfg = json!({
        "add_bos_token": add_bos,
        "add_eos_token": false,
        "added_tokens_decoder": added_decoder,
        "bos_token": bos,
        "eos_token": tok_name("tokenizer.ggml.eos_token_id"),
        "pad_token": tok_name("tokenizer.ggml.padding_token_id"),
        "unk_token": tok_name("tokenizer.ggml.unknown_token_id"),
        "clean_up_tokenization_spaces": false,
        "model_max_length": g.get_u64(&format!("{arch}.context_length")).unwrap_or(2048),
        "tokenizer_class": if spm { "LlamaTokenizerFast" } else { "GPT2Tokenizer" },
    });
    if let Ok(t) = g.get_str("tokenizer.chat_template") {
        cfg["chat_template"] = json!(t);
    }
    write_json(out, "tokenizer_config.json", &cfg)
}
