//! actorllm: an LLM serving engine built from actix actors, in the spirit of vLLM. It loads
//! Hugging Face checkpoints, batches requests continuously over a paged KV cache and streams
//! tokens to clients.
//!
//! # Layout
//!
//! - `engine`: the [`Engine`] handle: starts the actors, `add_request` → token stream, abort.
//! - `offline`: `Engine::generate`, vLLM's `LLM.generate` (prompts in, finished outputs out).
//! - `actors/`: one actor per file: `scheduler` (queues, step loop), `block_manager` (KV
//!   blocks), `model_runner` (one per device, on its own thread), `lora_manager` (adapter
//!   registry and host copies).
//! - `core/`: the plain structs under the actors: block pool, scheduler, LoRA slots,
//!   output processing.
//! - `models/`: the forward contract, HF config, safetensors loader, shared `layers/`,
//!   `llama.rs`, PEFT `lora.rs`, the `registry` of architectures and the `random` model
//!   maker.
//! - `kernels/`: the `Device` trait and its implementations: `cpu/` (Rust, AVX-512 where
//!   present) and `cuda/` (NVRTC kernels + cuBLAS through cudarc, loaded dynamically).
//! - `request`, `sampling`, `tokenizer`: sampling parameters and events, the sampler, the
//!   tokenizer with chat templates and incremental detokenization.
//! - `structured`: structured output: grammars (JSON schema, regex, choice, Lark, GBNF)
//!   compiled by llguidance, and each sequence's matcher giving the tokens allowed next.
//! - `config`: engine arguments with vLLM's flag names, resolved once.
//! - `hub`: `--model` as a directory or a Hugging Face model id in the local cache.
//! - `gguf`: GGUF reader and the `import-gguf` converter to a HF directory.
//! - `metrics`: counters and histograms for `/metrics`.
//! - `scratch`: temporary directories of their own for benchmarks and tests.
//! - `bench/`: `actorllm bench offline | serve | latency | throughput`.
//! - `web/`: the actix-web server: OpenAI routes with SSE, the WebSocket session actor,
//!   errors in OpenAI's shape, health, metrics and the API key.

pub mod actors;
pub mod bench;
pub mod cluster;
pub mod config;
pub mod core;
pub mod engine;
pub mod error;
pub mod gguf;
pub mod hub;
pub mod kernels;
pub mod mapped;
pub mod metrics;
pub mod models;
pub mod offline;
pub mod quantization;
pub mod request;
pub mod sampling;
pub mod scratch;
pub mod structured;
pub mod tokenizer;
pub mod web;

pub use engine::{Architectures, Engine, EngineError, RequestStream};
pub use offline::{CompletionOutput, LoraRequest, Prompt, RequestOutput};
pub use request::{FinishReason, SamplingParams, TokenEvent};
