//! Per-sequence output processing: incremental detokenization, stop conditions (EOS, stop
//! token ids, stop strings, max_tokens, context length) and the text each token releases.
//! Text that could still turn out to be the start of a stop string is held back, so a
//! client never sees part of a stop string.

use crate::request::{FinishReason, SamplingParams, StopReason};
use crate::tokenizer::{IncrementalDetokenizer, Tokenizer, TokenizerError};

/// What one new token produced.
#[derive(Debug, PartialEq)]
pub struct TokenOutcome {
    /// Text released by this token (the rest of the output when it finishes the sequence).
    pub text: String,
    pub finish: Option<(FinishReason, Option<StopReason>)>,
}

/// Limits resolved for a request at admission.
pub struct StopLimits<'a> {
    pub params: &'a SamplingParams,
    pub eos_ids: &'a [u32],
    pub max_tokens: usize,
    pub max_model_len: usize,
}

pub struct SeqOutput {
    detok: IncrementalDetokenizer,
    text: String,
    sent: usize,
    holdback: usize,
}

impl SeqOutput {
    pub fn new(prompt_len: usize, params: &SamplingParams) -> Self {
        let holdback = params.stop.iter().map(|s| s.len()).max().unwrap_or(1) - 1;
        Self {
            detok: IncrementalDetokenizer::new(prompt_len, params.skip_special_tokens),
            text: String::new(),
            sent: 0,
            holdback,
        }
    }

    /// The output text so far (complete once finished).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Processes the last token of `tokens` (prompt + generated).
    pub fn push(
        &mut self,
        tok: &Tokenizer,
        tokens: &[u32],
        prompt_len: usize,
        lim: &StopLimits,
    ) -> Result<TokenOutcome, TokenizerError> {
        let p = lim.params;
        let token = *tokens.last().expect("a token was just appended");
        let generated = tokens.len() - prompt_len;
        let before = self.text.len();
        self.text.push_str(&self.detok.step(tok, tokens)?);
        let min_ok = generated >= p.min_tokens;
        let mut finish = None;
        if !p.ignore_eos && lim.eos_ids.contains(&token) && min_ok {
            finish = Some((FinishReason::Stop, Some(StopReason::Eos)));
        } else if p.stop_token_ids.contains(&token) && min_ok {
            finish = Some((FinishReason::Stop, Some(StopReason::Token(token))));
        } else if !p.stop.is_empty() && min_ok {
            finish = self.find_stop(p, before).map(|s| (FinishReason::Stop, Some(StopReason::Text(s))));
        }
        if finish.is_none() && (generated >= lim.max_tokens || tokens.len() >= lim.max_model_len) {
            finish = Some((FinishReason::Length, None));
        }
        let end = if finish.is_some() { self.text.len() } else { self.releasable() };
        let text = self.text[self.sent..end].to_string();
        self.sent = end;
        Ok(TokenOutcome { text, finish })
    }

    /// Looks for a stop string overlapping the text added after `before`; cuts the text there.
    fn find_stop(&mut self, p: &SamplingParams, before: usize) -> Option<String> {
        let mut best: Option<(usize, &String)> = None;
        for s in &p.stop {
            let mut from = before.saturating_sub(s.len() - 1);
            while !self.text.is_char_boundary(from) {
                from -= 1;
            }
            if let Some(i) = self.text[from..].find(s.as_str()) {
                let at = from + i;
                if best.is_none_or(|(b, _)| at < b) {
                    best = Some((at, s));
                }
            }
        }
        let (at, s) = best?;
        let cut = if p.include_stop_str_in_output { at + s.len() } else { at };
        let s = s.clone();
        self.text.truncate(cut);
        self.sent = self.sent.min(cut);
        Some(s)
    }

    /// End of the text that cannot be part of a stop string still to come.
    fn releasable(&self) -> usize {
        let mut end = self.text.len().saturating_sub(self.holdback).max(self.sent);
        while !self.text.is_char_boundary(end) {
            end -= 1;
        }
        end
    }
}
