//! Requests as the engine takes them: validated [`SamplingParams`] (vLLM's names and range
//! checks), the events a request's stream carries, and how it finished.

use serde::{Deserialize, Serialize};

/// Limits on a request's shape that protect every other user of the server.
pub const MAX_N: usize = 128;
pub const MAX_STOP_STRINGS: usize = 16;
/// Longest stop string, in bytes.
pub const MAX_STOP_BYTES: usize = 1024;
pub const MAX_LOGPROBS: usize = 20;

/// vLLM's `SamplingParams`, with its defaults. Build with struct update syntax from
/// `SamplingParams::default()`, then [`SamplingParams::validate`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    pub n: usize,
    /// 0 = greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// -1 (or 0) = off.
    pub top_k: i32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub seed: Option<u64>,
    /// None = up to the model's context length.
    pub max_tokens: Option<usize>,
    pub min_tokens: usize,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub include_stop_str_in_output: bool,
    pub ignore_eos: bool,
    /// Number of top logprobs to return per token (None = no logprobs).
    pub logprobs: Option<usize>,
    /// Number of top logprobs to return per prompt position, beside the prompt token's own
    /// (None = none). The request's prompt is then computed whole: no prefix-cache reads.
    #[serde(default)]
    pub prompt_logprobs: Option<usize>,
    pub skip_special_tokens: bool,
    /// The grammar the output follows (structured output), compiled at the edge.
    #[serde(skip)]
    pub guide: Option<crate::structured::Guide>,
    /// Added to these tokens' logits before anything else reads them (OpenAI's
    /// `logit_bias`, -100 to 100).
    pub logit_bias: Vec<(u32, f32)>,
    /// Only these tokens may be generated (vLLM's `allowed_token_ids`).
    pub allowed_token_ids: Option<Vec<u32>>,
    /// Token sequences never generated whole: the last token of each is masked whenever
    /// the output ends with the ones before it (vLLM's `bad_words`, tokenized).
    pub bad_words_ids: Vec<Vec<u32>>,
    /// The request's priority under `--scheduling-policy priority` (lower goes first;
    /// vLLM's request `priority`, carried with the sampling fields).
    pub priority: i64,
    /// Beam search (vLLM's `use_beam_search`): `n` results of this many beams.
    pub beam: Option<BeamParams>,
}

/// Beam search as transformers' `generate(num_beams=…)` runs it: scores are the raw
/// log-probabilities (no temperature or cuts), hypotheses end at a stop token or the length
/// limit.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BeamParams {
    /// Beams kept each step (`best_of`, else `n`).
    pub width: usize,
    /// A finished hypothesis scores its log-probability over its length to this power.
    pub length_penalty: f32,
    pub early_stopping: EarlyStopping,
}

/// When beam search ends (transformers' and vLLM's `early_stopping`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EarlyStopping {
    /// `false`: when no running beam can, by a heuristic on its current length, beat the
    /// worst finished hypothesis.
    Heuristic,
    /// `true`: as soon as `width` hypotheses have finished.
    Done,
    /// `"never"`: only when no running beam can beat them at any length.
    Never,
}

/// Most beams a request may ask for: each step every beam reports its top
/// `2 × width` tokens, which the samplers return at most [`MAX_LOGPROBS`] of.
pub const MAX_BEAM_WIDTH: usize = MAX_LOGPROBS / 2;

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            n: 1,
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            max_tokens: Some(16),
            min_tokens: 0,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            include_stop_str_in_output: false,
            ignore_eos: false,
            logprobs: None,
            prompt_logprobs: None,
            skip_special_tokens: true,
            guide: None,
            logit_bias: Vec::new(),
            allowed_token_ids: None,
            bad_words_ids: Vec::new(),
            priority: 0,
            beam: None,
        }
    }
}

/// Defaults for the sampling fields a request leaves unset, from the model's
/// `generation_config.json` (vLLM's `--generation-config auto`): only the fields vLLM takes
/// from it, each only when the file sets it.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct SamplingDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    /// `max_new_tokens`, the default `max_tokens`.
    #[serde(rename = "max_new_tokens")]
    pub max_tokens: Option<usize>,
}

impl SamplingDefaults {
    /// The defaults of a generation_config.json's text; `source` names it in errors.
    pub fn from_json(text: &str, source: &str) -> Result<Self, String> {
        serde_json::from_str(text).map_err(|e| format!("{source}: {e}"))
    }

    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// A sampling field outside its range: names the field, the rule and the value given.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{param} {rule}, got {value}")]
pub struct ValidationError {
    pub param: &'static str,
    pub rule: String,
    pub value: String,
}

fn check(
    ok: bool,
    param: &'static str,
    rule: &str,
    value: impl std::fmt::Display,
) -> Result<(), ValidationError> {
    if ok { Ok(()) } else { Err(ValidationError { param, rule: rule.to_string(), value: value.to_string() }) }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<(), ValidationError> {
        check((1..=MAX_N).contains(&self.n), "n", &format!("must be between 1 and {MAX_N}"), self.n)?;
        check(
            self.temperature.is_finite() && self.temperature >= 0.0,
            "temperature",
            "must be non-negative",
            self.temperature,
        )?;
        check(self.top_p > 0.0 && self.top_p <= 1.0, "top_p", "must be in (0, 1]", self.top_p)?;
        check(
            self.top_k == -1 || self.top_k >= 0,
            "top_k",
            "must be -1 (disable), 0 (disable) or at least 1",
            self.top_k,
        )?;
        check((0.0..=1.0).contains(&self.min_p), "min_p", "must be in [0, 1]", self.min_p)?;
        check(
            self.repetition_penalty.is_finite()
                && self.repetition_penalty > 0.0
                && self.repetition_penalty <= 2.0,
            "repetition_penalty",
            "must be in (0, 2]",
            self.repetition_penalty,
        )?;
        check(
            (-2.0..=2.0).contains(&self.presence_penalty),
            "presence_penalty",
            "must be in [-2, 2]",
            self.presence_penalty,
        )?;
        check(
            (-2.0..=2.0).contains(&self.frequency_penalty),
            "frequency_penalty",
            "must be in [-2, 2]",
            self.frequency_penalty,
        )?;
        if let Some(m) = self.max_tokens {
            check(m >= 1, "max_tokens", "must be at least 1", m)?;
            check(
                self.min_tokens <= m,
                "min_tokens",
                &format!("must be less than or equal to max_tokens={m}"),
                self.min_tokens,
            )?;
        }
        check(
            self.stop.len() <= MAX_STOP_STRINGS,
            "stop",
            &format!("may hold at most {MAX_STOP_STRINGS} strings"),
            self.stop.len(),
        )?;
        check(self.stop.iter().all(|s| !s.is_empty()), "stop", "must not contain empty strings", "\"\"")?;
        let longest = self.stop.iter().map(String::len).max().unwrap_or(0);
        check(
            longest <= MAX_STOP_BYTES,
            "stop",
            &format!("strings must be at most {MAX_STOP_BYTES} bytes long"),
            format!("a string of {longest} bytes"),
        )?;
        if let Some(l) = self.logprobs {
            check(l <= MAX_LOGPROBS, "logprobs", &format!("must be between 0 and {MAX_LOGPROBS}"), l)?;
        }
        if let Some(l) = self.prompt_logprobs {
            let rule = format!("must be between 0 and {MAX_LOGPROBS}");
            check(l <= MAX_LOGPROBS, "prompt_logprobs", &rule, l)?;
        }
        if let Some((t, b)) = self.logit_bias.iter().find(|(_, b)| !(-100.0..=100.0).contains(b)) {
            return Err(ValidationError {
                param: "logit_bias",
                rule: "values must be between -100 and 100".into(),
                value: format!("{b} for token {t}"),
            });
        }
        check(
            self.allowed_token_ids.as_ref().is_none_or(|a| !a.is_empty()),
            "allowed_token_ids",
            "must not be empty",
            "[]",
        )?;
        check(
            self.bad_words_ids.iter().all(|w| !w.is_empty()),
            "bad_words",
            "must not contain empty words",
            "\"\"",
        )?;
        if let Some(b) = &self.beam {
            self.validate_beam(b)?;
        }
        Ok(())
    }

    /// Beam search scores beams by the raw log-probabilities and ends them at stop tokens and
    /// the length limit: fields that would change that are refused, naming the field.
    fn validate_beam(&self, b: &BeamParams) -> Result<(), ValidationError> {
        let width = format!("must be between 1 and {MAX_BEAM_WIDTH} with use_beam_search");
        check((1..=MAX_BEAM_WIDTH).contains(&b.width), "best_of", &width, b.width)?;
        check(self.n <= b.width, "n", &format!("must be at most best_of={} (the beams)", b.width), self.n)?;
        check(b.length_penalty.is_finite(), "length_penalty", "must be finite", b.length_penalty)?;
        let raw = "with use_beam_search: beams are scored by the model's raw log-probabilities";
        check(
            self.temperature == 0.0 || self.temperature == 1.0,
            "temperature",
            &format!("must be 0 or 1 {raw}"),
            self.temperature,
        )?;
        let unsupported: [(&'static str, bool); 13] = [
            ("top_p", self.top_p != 1.0),
            ("top_k", self.top_k > 0),
            ("min_p", self.min_p != 0.0),
            ("repetition_penalty", self.repetition_penalty != 1.0),
            ("presence_penalty", self.presence_penalty != 0.0),
            ("frequency_penalty", self.frequency_penalty != 0.0),
            ("min_tokens", self.min_tokens != 0),
            ("stop", !self.stop.is_empty()),
            ("logprobs", self.logprobs.is_some()),
            ("prompt_logprobs", self.prompt_logprobs.is_some()),
            ("logit_bias", !self.logit_bias.is_empty()),
            ("allowed_token_ids", self.allowed_token_ids.is_some()),
            ("bad_words", !self.bad_words_ids.is_empty()),
        ];
        if let Some((param, _)) = unsupported.iter().find(|(_, set)| *set) {
            return Err(ValidationError {
                param,
                rule: "is not supported with use_beam_search".into(),
                value: "a non-default value".into(),
            });
        }
        check(self.guide.is_none(), "use_beam_search", "cannot be combined with structured output", "true")
    }

    /// Whether the tokens a row may take are limited each step beyond the penalty rules
    /// (a grammar, `allowed_token_ids` or `bad_words`): the sampler then gets a mask.
    pub fn masks_tokens(&self) -> bool {
        self.guide.is_some() || self.allowed_token_ids.is_some() || !self.bad_words_ids.is_empty()
    }

    pub fn greedy(&self) -> bool {
        self.temperature == 0.0
    }

    pub fn uses_penalties(&self) -> bool {
        self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// EOS, a stop token or a stop string.
    Stop,
    /// max_tokens or the context length.
    Length,
    /// Cancelled by the client or the server.
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// Why a request was aborted (counted in metrics by reason).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AbortReason {
    /// The client closed its connection or dropped the stream.
    ClientGone,
    /// An explicit cancel (WebSocket frame, HTTP cancel endpoint, `Engine::abort`).
    Cancelled,
    /// The engine could not serve it (for example a prompt larger than the whole KV cache).
    Engine,
    /// The client left more events unread than its stream may hold (`--stream-backlog`).
    SlowClient,
}

impl AbortReason {
    pub fn as_str(self) -> &'static str {
        match self {
            AbortReason::ClientGone => "client_disconnected",
            AbortReason::Cancelled => "cancelled",
            AbortReason::Engine => "engine",
            AbortReason::SlowClient => "client_not_reading",
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    /// Prompt tokens whose keys and values came from the prefix cache
    /// (`usage.prompt_tokens_details.cached_tokens`).
    #[serde(default)]
    pub cached_tokens: usize,
}

/// The logprob of the chosen token and the top alternatives at one position.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub token_id: u32,
    pub logprob: f32,
    /// (token id, logprob), most likely first.
    pub top: Vec<(u32, f32)>,
}

/// A prompt token's log-probability given the tokens before it (`prompt_logprobs`).
#[derive(Debug, Clone, PartialEq)]
pub struct PromptLogprob {
    pub token_id: u32,
    pub logprob: f32,
    /// 1 + the number of tokens more likely than it.
    pub rank: usize,
    /// (token id, logprob), most likely first.
    pub top: Vec<(u32, f32)>,
}

/// What a request's stream carries, in order, for each of its `n` choices.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenEvent {
    /// A new token of choice `index`, with the text it made stable (may be empty while a
    /// multi-byte character or a possible stop string is incomplete).
    Token { index: usize, token_id: u32, text: String, logprobs: Option<TokenLogprobs> },
    /// The request's prompt logprobs (`prompt_logprobs`), once, before its first token: one
    /// per prompt position, None for the first (nothing precedes it).
    PromptLogprobs { positions: Vec<Option<PromptLogprob>> },
    /// Choice `index` ended (its last text came with its last Token event).
    Finished { index: usize, reason: FinishReason, stop_reason: Option<StopReason> },
    /// Every choice has ended.
    Done { usage: Usage },
    /// The engine failed the request.
    Error { message: String },
}

/// What stopped a choice, when it was a stop string or token (vLLM's `stop_reason`).
#[derive(Debug, Clone, PartialEq)]
pub enum StopReason {
    Eos,
    Token(u32),
    Text(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_errors_name_field_limit_and_value() {
        SamplingParams::default().validate().unwrap();
        let e = SamplingParams { top_p: 1.5, ..Default::default() }.validate().unwrap_err();
        assert_eq!(e.to_string(), "top_p must be in (0, 1], got 1.5");
        let e = SamplingParams { temperature: -0.1, ..Default::default() }.validate().unwrap_err();
        assert_eq!(e.param, "temperature");
        let e = SamplingParams { min_tokens: 5, max_tokens: Some(2), ..Default::default() }
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("max_tokens=2"));
        let e = SamplingParams { n: 1000, ..Default::default() }.validate().unwrap_err();
        assert!(e.to_string().contains("128"));
        let e = SamplingParams { logprobs: Some(21), ..Default::default() }.validate().unwrap_err();
        assert_eq!(e.param, "logprobs");
    }
}
