//! tokenizer.json and chat templates as loaded from a model directory: the first byte picks
//! which the rest replaces (the other stays a minimal valid one); whatever loads must
//! encode, decode and render without a panic. The files are handed over as bytes, as
//! `Tokenizer::load` hands them on after reading them.
#![no_main]

use actorllm::tokenizer::{ChatMessage, Tokenizer, TokenizerFiles};

/// The smallest tokenizer.json that loads, under the templates: a template is read and
/// rendered the same whatever the vocabulary, and a small one leaves the time to them.
const BASE: &[u8] = br#"{"model":{"type":"WordLevel","vocab":{"Hello":0,"[UNK]":1},"unk_token":"[UNK]"},"pre_tokenizer":{"type":"Whitespace"}}"#;

/// `tokenizers` panics on some malformed files, and `Tokenizer` catches those panics and
/// answers with an error, as it does when serving. libFuzzer's panic hook would abort on
/// them all, so it is replaced by one that only reports: a panic that escapes the target
/// still aborts the run (libfuzzer-sys catches it and aborts).
fn report_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        std::panic::set_hook(Box::new(|info| eprintln!("panic (a crash unless caught): {info}")));
    });
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    report_panics();
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
            ChatMessage { role: "system".into(), content: "Be brief.".into(), ..Default::default() },
            ChatMessage { role: "user".into(), content: "Hi".into(), ..Default::default() },
        ];
        let _ = t.apply_chat_template(&msgs, true);
    }
});
