//! The engine's error: what starting the engine or submitting a request can fail with.
//! It sits below the engine handle and the actors, which both return it.

use crate::config::ConfigError;
use crate::models::ModelError;
use crate::request::ValidationError;
use crate::tokenizer::TokenizerError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Hub(#[from] crate::hub::HubError),
    #[error(transparent)]
    Quantization(#[from] crate::quantization::QuantError),
    #[error("importing the GGUF file: {0}")]
    GgufImport(#[from] crate::gguf::import::ImportError),
    #[error(transparent)]
    InvalidParams(#[from] ValidationError),
    #[error("Input prompt ({prompt_tokens} tokens) is too long and exceeds limit of {max_model_len}")]
    PromptTooLong { prompt_tokens: usize, max_model_len: usize },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("token id {token} is out of vocabulary (size {vocab_size})")]
    TokenOutOfRange { token: u32, vocab_size: usize },
    #[error("a request with id {0:?} is already running")]
    DuplicateId(String),
    #[error("the engine has stopped")]
    Stopped,
    #[error(
        "The server is overloaded: {waiting} sequences are waiting (the limit is {limit}, \
         --max-waiting-requests). Retry later."
    )]
    QueueFull { waiting: usize, limit: usize },
    #[error("device: {0}")]
    Device(String),
    /// The nodes of a tensor-parallel group across processes: their flags, handshake or link.
    #[error("{0}")]
    Cluster(String),
    /// The HTTP server could not start: its address or its TLS files.
    #[error("server: {0}")]
    Server(String),
    #[error("The model `{0}` does not exist.")]
    LoraNotFound(String),
    #[error("LoRA adapter: {0}")]
    Lora(String),
    #[error("this server was started without --enable-lora")]
    LoraDisabled,
}
