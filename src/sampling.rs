//! Token sampling on the host from one row of logits, in vLLM's order: logprobs of the raw
//! logits, penalties, then greedy argmax or temperature → top-k → top-p → min-p → a draw.
//!
//! Draws are counter-based: the uniform number for a token is a hash of (seed, choice index,
//! output position). The same seed therefore gives the same output whatever else is in the
//! batch, and a sequence preempted and recomputed continues exactly where it was.

use crate::request::{SamplingParams, TokenLogprobs};

/// One sequence's sampling inputs for this step.
pub struct SampleInput<'a> {
    pub params: &'a SamplingParams,
    pub seed: u64,
    /// Choice index within the request (n > 1).
    pub index: usize,
    /// Prompt followed by the tokens generated so far.
    pub tokens: &'a [u32],
    pub prompt_len: usize,
    /// Tokens that end the sequence (masked while fewer than `min_tokens` are generated).
    pub eos_ids: &'a [u32],
}

impl SampleInput<'_> {
    /// Whether the token is the plain argmax of the logits: greedy, without penalties,
    /// logprobs or min_tokens masking (what the device samples by itself).
    pub fn plain_greedy(&self) -> bool {
        let p = self.params;
        let masking = self.tokens.len() - self.prompt_len < p.min_tokens;
        p.greedy() && p.logprobs.is_none() && !p.uses_penalties() && !masking
    }
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Uniform in [0, 1) for (seed, choice, position).
pub fn uniform(seed: u64, index: usize, position: usize) -> f64 {
    let h = splitmix64(splitmix64(seed ^ splitmix64(index as u64)) ^ position as u64);
    (h >> 11) as f64 / (1u64 << 53) as f64
}

/// The `k` most likely tokens with their logprobs, most likely first.
fn top_logprobs(logprobs: &[f32], k: usize) -> Vec<(u32, f32)> {
    if k == 0 {
        return Vec::new();
    }
    let mut idx: Vec<u32> = (0..logprobs.len() as u32).collect();
    let k = k.min(idx.len());
    let cmp = |a: &u32, b: &u32| logprobs[*b as usize].total_cmp(&logprobs[*a as usize]).then(a.cmp(b));
    idx.select_nth_unstable_by(k - 1, cmp);
    idx.truncate(k);
    idx.sort_by(cmp);
    idx.into_iter().map(|i| (i, logprobs[i as usize])).collect()
}

fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = logits.iter().map(|l| (l - max).exp()).sum();
    let lse = max + sum.ln();
    logits.iter().map(|l| l - lse).collect()
}

/// First index of the maximum (ties → lowest id, as torch.argmax).
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

fn apply_penalties(logits: &mut [f32], inp: &SampleInput) {
    let p = inp.params;
    if p.repetition_penalty != 1.0 {
        // HF / vLLM: over prompt and output; divide positive logits, multiply negative ones.
        let mut seen = vec![false; logits.len()];
        for &t in inp.tokens {
            if let Some(s) = seen.get_mut(t as usize) {
                *s = true;
            }
        }
        for (l, s) in logits.iter_mut().zip(seen) {
            if s {
                *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
            }
        }
    }
    if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        // OpenAI semantics over the generated tokens only.
        let mut counts = std::collections::HashMap::<u32, f32>::new();
        for &t in &inp.tokens[inp.prompt_len..] {
            *counts.entry(t).or_default() += 1.0;
        }
        for (t, c) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= p.frequency_penalty * c + p.presence_penalty;
            }
        }
    }
}

/// Samples one token from `logits` (modified in place).
pub fn sample(logits: &mut [f32], inp: &SampleInput) -> (u32, Option<TokenLogprobs>) {
    let p = inp.params;
    let raw_logprobs = p.logprobs.map(|_| log_softmax(logits));
    let generated = inp.tokens.len() - inp.prompt_len;
    if generated < p.min_tokens {
        for &t in inp.eos_ids.iter().chain(&p.stop_token_ids) {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    apply_penalties(logits, inp);
    let token = if p.greedy() { argmax(logits) } else { draw(logits, inp, generated) };
    let logprobs = raw_logprobs.map(|lp| TokenLogprobs {
        token_id: token,
        logprob: lp[token as usize],
        top: top_logprobs(&lp, p.logprobs.unwrap_or(0)),
    });
    (token, logprobs)
}

fn draw(logits: &[f32], inp: &SampleInput, position: usize) -> u32 {
    let p = inp.params;
    let t = p.temperature;
    // Candidates sorted by logit, most likely first (ties by id for determinism).
    let mut cand: Vec<u32> =
        (0..logits.len() as u32).filter(|&i| logits[i as usize] > f32::NEG_INFINITY).collect();
    if cand.is_empty() {
        return argmax(logits);
    }
    let cmp = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    let k = if p.top_k > 0 { (p.top_k as usize).min(cand.len()) } else { cand.len() };
    if k < cand.len() {
        cand.select_nth_unstable_by(k - 1, cmp);
        cand.truncate(k);
    }
    cand.sort_by(cmp);
    let max = logits[cand[0] as usize] / t;
    let mut probs: Vec<f64> = cand.iter().map(|&i| ((logits[i as usize] / t - max) as f64).exp()).collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|x| *x /= total);
    let mut keep = probs.len();
    if p.top_p < 1.0 {
        let mut cum = 0.0;
        for (i, &q) in probs.iter().enumerate() {
            cum += q;
            if cum >= p.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
    }
    if p.min_p > 0.0 {
        let floor = probs[0] * p.min_p as f64;
        keep = keep.min(probs.iter().take_while(|&&q| q >= floor).count().max(1));
    }
    let mass: f64 = probs[..keep].iter().sum();
    let u = uniform(inp.seed, inp.index, position) * mass;
    let mut cum = 0.0;
    for (i, &q) in probs[..keep].iter().enumerate() {
        cum += q;
        if u < cum {
            return cand[i];
        }
    }
    cand[keep - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input<'a>(params: &'a SamplingParams, tokens: &'a [u32], seed: u64) -> SampleInput<'a> {
        SampleInput { params, seed, index: 0, tokens, prompt_len: 1, eos_ids: &[0] }
    }

    #[test]
    fn greedy_takes_argmax_and_reports_logprobs() {
        let params = SamplingParams { temperature: 0.0, logprobs: Some(2), ..Default::default() };
        let mut logits = vec![0.0, 3.0, 1.0, 3.0];
        let (t, lp) = sample(&mut logits, &input(&params, &[2], 1));
        assert_eq!(t, 1);
        let lp = lp.unwrap();
        assert_eq!(lp.top.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3]);
        let z: f32 = [0.0f32, 3.0, 1.0, 3.0].iter().map(|x| x.exp()).sum();
        assert!((lp.logprob - (3.0 - z.ln())).abs() < 1e-6);
    }

    #[test]
    fn min_tokens_masks_eos_and_top_k_one_is_greedy() {
        let params = SamplingParams { temperature: 0.0, min_tokens: 2, ..Default::default() };
        let mut logits = vec![9.0, 1.0, 2.0];
        assert_eq!(sample(&mut logits, &input(&params, &[2], 1)).0, 2);
        let params = SamplingParams { temperature: 1.0, top_k: 1, ..Default::default() };
        for seed in 0..20 {
            let mut logits = vec![0.5, 1.0, 0.9];
            assert_eq!(sample(&mut logits, &input(&params, &[2], seed)).0, 1);
        }
    }

    #[test]
    fn seeded_draws_repeat_and_follow_the_distribution() {
        let params = SamplingParams { temperature: 1.0, ..Default::default() };
        let logits = vec![0.0f32, (3.0f32).ln()]; // p = [0.25, 0.75]
        let draws: Vec<u32> =
            (0..4000u64).map(|s| sample(&mut logits.clone(), &input(&params, &[2], s)).0).collect();
        let again: Vec<u32> =
            (0..4000u64).map(|s| sample(&mut logits.clone(), &input(&params, &[2], s)).0).collect();
        assert_eq!(draws, again);
        let ones = draws.iter().filter(|&&t| t == 1).count() as f64 / 4000.0;
        assert!((ones - 0.75).abs() < 0.03, "{ones}");
        // top_p = 0.5 keeps only the most likely token.
        let params = SamplingParams { temperature: 1.0, top_p: 0.5, ..Default::default() };
        assert!((0..200u64).all(|s| sample(&mut logits.clone(), &input(&params, &[2], s)).0 == 1));
    }

    #[test]
    fn penalties_follow_hf_and_openai_rules() {
        let params = SamplingParams { temperature: 0.0, repetition_penalty: 2.0, ..Default::default() };
        let mut logits = vec![4.0, 3.0, -1.0];
        let inp =
            SampleInput { params: &params, seed: 0, index: 0, tokens: &[0, 2], prompt_len: 1, eos_ids: &[] };
        apply_penalties(&mut logits, &inp);
        assert_eq!(logits, vec![2.0, 3.0, -2.0]);
        let params = SamplingParams { frequency_penalty: 1.0, presence_penalty: 0.5, ..Default::default() };
        let mut logits = vec![4.0, 3.0, 1.0];
        let inp = SampleInput {
            params: &params,
            seed: 0,
            index: 0,
            tokens: &[1, 1, 1, 2],
            prompt_len: 1,
            eos_ids: &[],
        };
        apply_penalties(&mut logits, &inp);
        assert_eq!(logits, vec![4.0, 0.5, -0.5]);
    }
}
