//! Request bodies of both endpoints, validated as the server does (JSON shape, sampling
//! fields, prompts, messages through the chat template, context and size limits) against
//! a tiny random model's engine.
#![no_main]

use std::sync::OnceLock;

use actorllm::Engine;
use actorllm::web::protocol::{ChatRequest, CompletionRequest, prepare_chat, prepare_completion};

fn engine() -> &'static Engine {
    static E: OnceLock<Engine> = OnceLock::new();
    E.get_or_init(|| {
        let dir = actorllm::scratch::ScratchDir::new("fuzz-request").expect("scratch directory");
        let shape = actorllm::models::random::Preset::Tiny.shape();
        actorllm::models::random::make_random_model(shape, dir.path(), actorllm::kernels::DType::F32, 1, 4.0)
            .expect("tiny model");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            actix::System::new().block_on(async move {
                let args =
                    actorllm::config::EngineArgs { model: dir.path().to_path_buf(), ..Default::default() };
                tx.send(Engine::start(args).await.expect("engine starts")).unwrap();
                std::future::pending::<()>().await;
            });
        });
        rx.recv().expect("engine")
    })
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let names = ["m".to_string()];
    if let Ok(r) = serde_json::from_slice::<CompletionRequest>(data) {
        let _ = prepare_completion(engine(), &names, r);
    }
    if let Ok(r) = serde_json::from_slice::<ChatRequest>(data) {
        let _ = prepare_chat(engine(), &names, r);
    }
});
