//! Offline inference from Rust, as vLLM's `LLM.generate`: every prompt is submitted to the
//! engine at once, batched continuously, and the finished outputs come back in the
//! prompts' order.
//!
//! ```no_run
//! # async fn demo() -> Result<(), actorllm::EngineError> {
//! use actorllm::{Engine, SamplingParams, config::EngineArgs};
//! let engine = Engine::start(EngineArgs::default()).await?;
//! let params = SamplingParams { temperature: 0.0, max_tokens: Some(16), ..Default::default() };
//! for out in engine.generate(["The capital of France is", "Hello, my name is"], &params, None).await? {
//!     println!("{:?} -> {:?}", out.prompt, out.outputs[0].text);
//! }
//! # Ok(()) }
//! ```

use std::path::PathBuf;

use futures::StreamExt;

use crate::actors::lora_manager::{ListAdapters, Register};
use crate::engine::{Engine, EngineError, RequestStream};
use crate::request::{FinishReason, PromptLogprob, SamplingParams, StopReason, TokenEvent, TokenLogprobs};

/// A prompt as text (tokenized with the model's special tokens, as `/v1/completions`
/// does) or as token ids.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

impl From<&str> for Prompt {
    fn from(s: &str) -> Self {
        Prompt::Text(s.to_string())
    }
}

impl From<String> for Prompt {
    fn from(s: String) -> Self {
        Prompt::Text(s)
    }
}

impl From<Vec<u32>> for Prompt {
    fn from(ids: Vec<u32>) -> Self {
        Prompt::Tokens(ids)
    }
}

/// vLLM's `LoRARequest`: the adapter by name, loaded from `path` the first time it is
/// asked for (or when the name was registered from another path). The engine must have
/// been started with `--enable-lora`.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraRequest {
    pub name: String,
    pub path: PathBuf,
}

/// One choice of a request (vLLM's `CompletionOutput`).
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionOutput {
    pub index: usize,
    pub text: String,
    pub token_ids: Vec<u32>,
    /// The sum of the sampled tokens' logprobs, when the params asked for logprobs.
    pub cumulative_logprob: Option<f32>,
    /// Each token's logprob and top alternatives, when the params asked for them.
    pub logprobs: Option<Vec<TokenLogprobs>>,
    pub finish_reason: Option<FinishReason>,
    pub stop_reason: Option<StopReason>,
}

/// A finished request (vLLM's `RequestOutput`).
#[derive(Debug, Clone, PartialEq)]
pub struct RequestOutput {
    pub request_id: String,
    /// The prompt's text, when it was given as text.
    pub prompt: Option<String>,
    pub prompt_token_ids: Vec<u32>,
    /// `n` choices, by index.
    pub outputs: Vec<CompletionOutput>,
    /// Prompt tokens whose KV came from the prefix cache.
    pub num_cached_tokens: usize,
    /// Each prompt position's logprob (None for the first), when `prompt_logprobs` asked.
    pub prompt_logprobs: Option<Vec<Option<PromptLogprob>>>,
    pub finished: bool,
}

impl Engine {
    /// Generates for every prompt with `params` (on `lora`'s adapter when given) and
    /// returns the outputs in the prompts' order once all have finished. A prompt the engine
    /// refuses (too long, out-of-vocabulary ids) fails the call, and the requests already
    /// submitted are aborted.
    pub async fn generate<P: Into<Prompt>>(
        &self,
        prompts: impl IntoIterator<Item = P>,
        params: &SamplingParams,
        lora: Option<&LoraRequest>,
    ) -> Result<Vec<RequestOutput>, EngineError> {
        let prompts: Vec<Prompt> = prompts.into_iter().map(Into::into).collect();
        let adapter = match lora {
            Some(l) => Some(self.ensure_adapter(l).await?),
            None => None,
        };
        let tok = self.tokenizer().clone();
        let encoded = actix_rt::task::spawn_blocking(move || {
            prompts
                .into_iter()
                .map(|p| match p {
                    Prompt::Text(t) => Ok((tok.encode(&t, true)?, Some(t))),
                    Prompt::Tokens(ids) => Ok((ids, None)),
                })
                .collect::<Result<Vec<_>, EngineError>>()
        })
        .await
        .map_err(|e| EngineError::Device(format!("tokenizing thread: {e}")))??;
        let mut streams = Vec::with_capacity(encoded.len());
        for (ids, _) in &encoded {
            let id = self.next_request_id("generate");
            streams
                .push(self.add_request_with_lora(id, ids.clone(), params.clone(), adapter.as_deref()).await?);
        }
        let n = params.n.max(1);
        let outputs = futures::future::join_all(streams.into_iter().map(|s| collect(s, n))).await;
        encoded
            .into_iter()
            .zip(outputs)
            .map(|((prompt_token_ids, prompt), out)| {
                let Collected { request_id, outputs, cached_tokens: num_cached_tokens, prompt_logprobs } =
                    out?;
                Ok(RequestOutput {
                    request_id,
                    prompt,
                    prompt_token_ids,
                    outputs,
                    num_cached_tokens,
                    prompt_logprobs,
                    finished: true,
                })
            })
            .collect()
    }

    /// Registers `l` with the LoRAManager unless an adapter of its name from its path is
    /// there already; returns the name to submit requests with.
    async fn ensure_adapter(&self, l: &LoraRequest) -> Result<String, EngineError> {
        let manager = self.lora_manager().ok_or(EngineError::LoraDisabled)?;
        let known = manager.send(ListAdapters).await.map_err(|_| EngineError::Stopped)?;
        if !known.iter().any(|a| a.name == l.name && a.path == l.path) {
            let reg = Register { name: l.name.clone(), path: l.path.clone(), root: None };
            manager.send(reg).await.map_err(|_| EngineError::Stopped)??;
        }
        Ok(l.name.clone())
    }
}

/// A request's stream read to its end.
struct Collected {
    request_id: String,
    outputs: Vec<CompletionOutput>,
    cached_tokens: usize,
    prompt_logprobs: Option<Vec<Option<PromptLogprob>>>,
}

async fn collect(mut stream: RequestStream, n: usize) -> Result<Collected, EngineError> {
    let mut prompt_logprobs = None;
    let mut outs: Vec<CompletionOutput> = (0..n)
        .map(|index| CompletionOutput {
            index,
            text: String::new(),
            token_ids: Vec::new(),
            cumulative_logprob: None,
            logprobs: None,
            finish_reason: None,
            stop_reason: None,
        })
        .collect();
    while let Some(ev) = stream.next().await {
        match ev {
            TokenEvent::Token { index, token_id, text, logprobs } => {
                let o = &mut outs[index];
                o.token_ids.push(token_id);
                o.text.push_str(&text);
                if let Some(l) = logprobs {
                    *o.cumulative_logprob.get_or_insert(0.0) += l.logprob;
                    o.logprobs.get_or_insert_with(Vec::new).push(l);
                }
            }
            TokenEvent::Finished { index, reason, stop_reason } => {
                outs[index].finish_reason = Some(reason);
                outs[index].stop_reason = stop_reason;
            }
            TokenEvent::PromptLogprobs { positions } => prompt_logprobs = Some(positions),
            TokenEvent::Done { usage } => {
                return Ok(Collected {
                    request_id: stream.id().to_string(),
                    outputs: outs,
                    cached_tokens: usage.cached_tokens,
                    prompt_logprobs,
                });
            }
            TokenEvent::Error { message } => return Err(EngineError::Device(message)),
        }
    }
    Err(EngineError::Stopped)
}
