//! The GPU sampler's wire format: a step's sampling rows encoded as the words sampling.cu
//! reads (parameters, then penalty and masking entries), and its output words decoded back
//! into tokens and logprobs.

use crate::request::{MAX_LOGPROBS, TokenLogprobs};
use crate::sampling::{SampleInput, noise_base, token_rules};

/// Words per row of a device sampler's parameters (the layout sampling.cu reads).
pub const PARAM_WORDS: usize = 13;
/// Words per entry of a device sampler's token rules (the third is written by the device).
pub const ENTRY_WORDS: usize = 3;
/// Words per row of a device sampler's logprob output: the chosen token's logprob, then
/// up to [`MAX_LOGPROBS`] (id, logprob) pairs.
pub const LOGPROB_WORDS: usize = 1 + 2 * MAX_LOGPROBS;

/// A step's sampling rows encoded for a device sampler (see sampling.cu for the layout).
#[derive(Debug, Default)]
pub struct DeviceRows {
    pub params: Vec<u32>,
    pub entries: Vec<u32>,
    /// Whether any row asked for logprobs (only then do they come back).
    pub logprobs: bool,
    /// Whether any row needs the full per-row pass (logprobs, or a top-k or top-p cut to
    /// search for).
    pub full: bool,
    /// Whether any row does not (the split sampler takes those).
    pub split: bool,
}

impl DeviceRows {
    pub fn encode(inputs: &[SampleInput], vocab: usize) -> Self {
        let mut rows = DeviceRows::default();
        for inp in inputs {
            let p = inp.params;
            let first = rows.entries.len() / ENTRY_WORDS;
            for (t, r) in token_rules(inp, vocab) {
                let info = (r.masked as u32) << 31 | (r.seen as u32) << 30 | r.count.min(0x3fff_ffff);
                rows.entries.extend([t, info, 0]);
            }
            let base = noise_base(inp.seed, inp.index, inp.generated());
            let n_logprobs = p.logprobs.map_or(-1, |n| n.min(MAX_LOGPROBS) as i32);
            rows.logprobs |= n_logprobs >= 0;
            let temperature = if p.greedy() { 0.0 } else { p.temperature };
            let full = n_logprobs >= 0 || (!p.greedy() && (p.top_k > 0 || p.top_p < 1.0));
            rows.full |= full;
            rows.split |= !full;
            rows.params.extend([
                temperature.to_bits(),
                p.top_p.to_bits(),
                p.min_p.to_bits(),
                p.top_k.max(0) as u32,
                p.repetition_penalty.to_bits(),
                p.presence_penalty.to_bits(),
                p.frequency_penalty.to_bits(),
                n_logprobs as u32,
                first as u32,
                (rows.entries.len() / ENTRY_WORDS - first) as u32,
                base as u32,
                (base >> 32) as u32,
                full as u32,
            ]);
        }
        rows
    }

    /// The logprobs each row asked for, all that [`Self::decode`] needs of the inputs: a
    /// sampling whose results are read later keeps this instead of the inputs.
    pub fn logprob_counts(inputs: &[SampleInput]) -> Vec<Option<usize>> {
        inputs.iter().map(|inp| inp.params.logprobs).collect()
    }

    /// The sampled tokens, with their logprobs where asked (`logprobs[i]` for row i, as
    /// [`Self::logprob_counts`] gives them), from the device's output words
    /// (`logprob_words` empty when no row asked).
    pub fn decode(
        logprobs: &[Option<usize>],
        tokens: &[u32],
        logprob_words: &[u32],
        vocab: usize,
    ) -> Vec<(u32, Option<TokenLogprobs>)> {
        let f = f32::from_bits;
        logprobs
            .iter()
            .zip(tokens)
            .enumerate()
            .map(|(i, (asked, &token))| {
                let logprobs = asked.map(|n| {
                    let w = &logprob_words[i * LOGPROB_WORDS..(i + 1) * LOGPROB_WORDS];
                    let n = n.min(MAX_LOGPROBS).min(vocab);
                    let top = (0..n).map(|j| (w[1 + 2 * j], f(w[2 + 2 * j]))).collect();
                    TokenLogprobs { token_id: token, logprob: f(w[0]), top }
                });
                (token, logprobs)
            })
            .collect()
    }
}
