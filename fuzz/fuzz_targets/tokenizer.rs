//! tokenizer.json and chat templates as loaded from a model directory: the first byte picks
//! which the rest replaces (the other stays the tiny random model's); whatever loads must
//! encode, decode and render without a panic.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use actorllm::tokenizer::{ChatMessage, Tokenizer};

/// A model directory of the process's own, and its valid tokenizer.json.
fn base() -> &'static (PathBuf, Vec<u8>) {
    static B: OnceLock<(PathBuf, Vec<u8>)> = OnceLock::new();
    B.get_or_init(|| {
        let dir = actorllm::scratch::ScratchDir::new("fuzz-tokenizer").expect("scratch directory");
        let shape = actorllm::models::random::Preset::Tiny.shape();
        actorllm::models::random::make_random_model(shape, dir.path(), actorllm::kernels::DType::F32, 1, 4.0)
            .expect("tiny model");
        let tokenizer = std::fs::read(dir.join("tokenizer.json")).expect("tokenizer.json");
        let path = dir.path().to_path_buf();
        std::mem::forget(dir);
        (path, tokenizer)
    })
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Some((&kind, rest)) = data.split_first() else { return };
    let (dir, tokenizer) = base();
    if kind % 2 == 0 {
        std::fs::write(dir.join("tokenizer.json"), rest).unwrap();
        let _ = std::fs::remove_file(dir.join("tokenizer_config.json"));
    } else {
        std::fs::write(dir.join("tokenizer.json"), tokenizer).unwrap();
        let cfg = serde_json::json!({"chat_template": String::from_utf8_lossy(rest)});
        std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    }
    if let Ok(t) = Tokenizer::load(dir, &[]) {
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
