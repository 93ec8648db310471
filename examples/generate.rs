//! Offline generation from Rust, as vLLM's `LLM.generate`: start the engine, hand it every
//! prompt at once, read the finished outputs in the prompts' order.
//!
//!     cargo run --release --example generate -- [MODEL_DIR_OR_ID] [PROMPT…]
//!
//! With no arguments it runs three prompts greedily on the default model. Its test checks
//! the greedy outputs against transformers' (tests/fixtures/golden_smollm2.json):
//! `cargo test --release --example generate`.

use actorllm::config::{DEFAULT_MODEL_DIR, EngineArgs};
use actorllm::{Engine, RequestOutput, SamplingParams};

/// Greedy continuations of `prompts`, `max_tokens` each, on `model`.
async fn generate(
    model: &str,
    prompts: Vec<String>,
    max_tokens: usize,
) -> anyhow::Result<Vec<RequestOutput>> {
    let engine = Engine::start(EngineArgs { model: model.into(), ..EngineArgs::default() }).await?;
    let params =
        SamplingParams { temperature: 0.0, max_tokens: Some(max_tokens), ..SamplingParams::default() };
    Ok(engine.generate(prompts, &params, None).await?)
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let model = args.next().unwrap_or_else(|| DEFAULT_MODEL_DIR.to_string());
    let mut prompts: Vec<String> = args.collect();
    if prompts.is_empty() {
        prompts =
            ["Hello, my name is", "The capital of France is", "The future of AI is"].map(String::from).into();
    }
    let outputs = actix::System::new().block_on(generate(&model, prompts, 32))?;
    for out in outputs {
        println!("Prompt: {:?}, Generated text: {:?}", out.prompt.unwrap_or_default(), out.outputs[0].text);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use actorllm::FinishReason;
    use serde::Deserialize;

    #[derive(Deserialize)]
    struct Prompt {
        text: String,
        prompt_ids: Vec<u32>,
        output_ids: Vec<u32>,
        output_text: String,
    }

    #[derive(Deserialize)]
    struct Golden {
        prompts: Vec<Prompt>,
    }

    /// Every golden prompt, submitted together, gives transformers' greedy ids and text.
    #[actix_rt::test]
    async fn greedy_outputs_equal_transformers() {
        let root = env!("CARGO_MANIFEST_DIR");
        let golden: Golden = serde_json::from_str(
            &std::fs::read_to_string(format!("{root}/tests/fixtures/golden_smollm2.json")).unwrap(),
        )
        .unwrap();
        let model = std::env::var("ACTORLLM_TEST_MODEL")
            .unwrap_or_else(|_| format!("{root}/{}", actorllm::config::DEFAULT_MODEL_DIR));
        // transformers generated up to 32 tokens, stopping at the end-of-sequence token.
        let prompts = golden.prompts.iter().map(|p| p.text.clone()).collect();
        let outputs = super::generate(&model, prompts, 32).await.unwrap();
        assert_eq!(outputs.len(), golden.prompts.len());
        for (out, p) in outputs.iter().zip(&golden.prompts) {
            assert_eq!(out.prompt.as_deref(), Some(p.text.as_str()));
            assert_eq!(out.prompt_token_ids, p.prompt_ids);
            let c = &out.outputs[0];
            assert_eq!(c.token_ids, p.output_ids, "{:?}", p.text);
            assert_eq!(c.text, p.output_text);
            let ended = if p.output_ids.len() < 32 { FinishReason::Stop } else { FinishReason::Length };
            assert_eq!(c.finish_reason, Some(ended), "{:?}", p.text);
        }
    }
}
