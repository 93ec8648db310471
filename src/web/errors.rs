//! The web layer's one error type and its one mapping: HTTP status plus OpenAI's body
//! `{"error":{"message","type","param","code"}}`, the same object inside the final SSE
//! event of a stream that already started, and inside WebSocket error frames.

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use serde_json::{Value, json};

use crate::engine::EngineError;
use crate::tokenizer::TokenizerError;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// A field outside its range or of the wrong shape.
    #[error("{message}")]
    BadRequest { message: String, param: Option<String> },
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    #[error("{0}")]
    NotFound(String),
    #[error("Request body is larger than the limit of {limit} bytes.")]
    TooLarge { limit: usize },
    #[error("Unauthorized: a valid API key is required (Authorization: Bearer <key>).")]
    Unauthorized,
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    Timeout(String),
    #[error("{0}")]
    Unavailable(String),
    /// 429 with `Retry-After`.
    #[error("{0}")]
    Overloaded(String),
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    pub fn bad(message: impl Into<String>, param: Option<&str>) -> Self {
        ApiError::BadRequest { message: message.into(), param: param.map(str::to_string) }
    }

    /// vLLM's over-long request message; it names the limit and the input token count.
    pub fn context_length(prompt: usize, completion: usize, max_model_len: usize) -> Self {
        let message = if completion == 0 {
            format!(
                "This model's maximum context length is {max_model_len} tokens. However, your request has \
                 {prompt} input tokens. Please reduce the length of the input."
            )
        } else {
            format!(
                "This model's maximum context length is {max_model_len} tokens. However, you requested {} tokens \
                 ({prompt} in the input, {completion} in the completion). Please reduce the length of the input \
                 or completion.",
                prompt + completion
            )
        };
        ApiError::bad(message, Some("max_tokens"))
    }

    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::BadRequest { .. } | ApiError::TooLarge { .. } => "invalid_request_error",
            ApiError::ModelNotFound(_) | ApiError::NotFound(_) => "not_found_error",
            ApiError::Unauthorized => "authentication_error",
            ApiError::Forbidden(_) => "permission_error",
            ApiError::Timeout(_) => "timeout_error",
            ApiError::Unavailable(_) => "service_unavailable",
            ApiError::Overloaded(_) => "rate_limit_error",
            ApiError::Internal(_) => "internal_error",
        }
    }

    /// The `error` object of OpenAI's error body.
    pub fn body(&self) -> Value {
        let param = match self {
            ApiError::BadRequest { param, .. } => param.clone(),
            ApiError::ModelNotFound(_) => Some("model".to_string()),
            _ => None,
        };
        json!({
            "error": {
                "message": self.to_string(),
                "type": self.kind(),
                "param": param,
                "code": self.status_code().as_u16(),
            }
        })
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        match self {
            ApiError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::ModelNotFound(_) | ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::Timeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Overloaded(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn error_response(&self) -> HttpResponse {
        let mut res = HttpResponse::build(self.status_code());
        if let ApiError::Overloaded(_) = self {
            res.insert_header(("Retry-After", "1"));
        }
        res.json(self.body())
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::InvalidParams(v) => ApiError::bad(v.to_string(), Some(v.param)),
            EngineError::PromptTooLong { prompt_tokens, max_model_len } => {
                ApiError::context_length(prompt_tokens, 0, max_model_len)
            }
            EngineError::EmptyPrompt => ApiError::bad("The prompt is empty.", Some("prompt")),
            EngineError::TokenOutOfRange { .. } => ApiError::bad(e.to_string(), Some("prompt")),
            EngineError::DuplicateId(_) => ApiError::bad(e.to_string(), None),
            EngineError::Stopped => ApiError::Unavailable("The engine has stopped.".into()),
            EngineError::QueueFull { .. } => ApiError::Overloaded(e.to_string()),
            EngineError::LoraNotFound(name) => ApiError::ModelNotFound(name),
            EngineError::Lora(m) => ApiError::Internal(m),
            other => ApiError::Internal(other.to_string()),
        }
    }
}

impl From<TokenizerError> for ApiError {
    fn from(e: TokenizerError) -> Self {
        match e {
            TokenizerError::NoChatTemplate | TokenizerError::Template(_) => {
                ApiError::bad(e.to_string(), Some("messages"))
            }
            other => ApiError::Internal(other.to_string()),
        }
    }
}

/// Maps the JSON extractor's errors (malformed JSON, wrong types, body too large) to the
/// OpenAI shape instead of the framework's plain text.
pub fn json_error(
    err: actix_web::error::JsonPayloadError,
    _req: &actix_web::HttpRequest,
) -> actix_web::Error {
    use actix_web::error::JsonPayloadError as J;
    let api = match &err {
        J::OverflowKnownLength { limit, .. } | J::Overflow { limit } => ApiError::TooLarge { limit: *limit },
        J::ContentType => ApiError::bad("Content-Type must be application/json.", None),
        J::Deserialize(e) => ApiError::bad(format!("Invalid request body: {e}"), None),
        J::Payload(actix_web::error::PayloadError::Io(e)) if e.kind() == std::io::ErrorKind::TimedOut => {
            ApiError::Timeout(e.to_string())
        }
        other => ApiError::bad(format!("Invalid request body: {other}"), None),
    };
    api.into()
}
