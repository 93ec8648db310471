//! tokenizer.json and chat templates as loaded from a model directory: the first byte picks
//! which the rest replaces (the other stays a minimal valid one); whatever loads must
//! encode, decode and render without a panic. The files are handed over as bytes, as
//! `Tokenizer::load` hands them on after reading them.
#![no_main]

use actorllm::tokenizer::{ChatMessage, Tokenizer, TokenizerFiles};

/// The smallest tokenizer.json that loads, under the templates: a template is read and
/// rendered the same whatever the vocabulary, and a small one leaves the time to them.
const BASE: &[u8] = br#"{"model":{"type":"WordLevel","vocab":{"Hello":0,"[UNK]":1},"unk_token":"[UNK]"},"pre_tokenizer":{"type":"Whitespace"}}"#;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Some((&kind, rest)) = data.split_first() else { return };
    let config;
    let files = if kind % 2 == 0 {
        TokenizerFiles { tokenizer_json: rest, ..TokenizerFiles::default() }
    } else {
        config = serde_json::json!({"chat_template": String::from_utf8_lossy(rest)}).to_string();
        TokenizerFiles {
            tokenizer_json: BASE,
            tokenizer_config: Some(config.as_bytes()),
            ..TokenizerFiles::default()
        }
    };
    if let Ok(t) = Tokenizer::from_files(files, &[]) {
        if let Ok(ids) = t.encode("Hello, wörld! 123", true) {
            let _ = t.decode(&ids, false);
        }
        let msgs = [
            ChatMessage { role: "system".into(), content: "Be brief.".into() },
            ChatMessage { role: "user".into(), content: "Hi".into() },
        ];
        let _ = t.apply_chat_template(&msgs, true);
    }
});
