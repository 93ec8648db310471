//! Token sampling from one row of logits, in vLLM's order: logprobs of the raw logits,
//! min_tokens masking, penalties, then greedy argmax or temperature → top-k → top-p →
//! min-p → a draw. The same rules run on the GPU (src/kernels/cuda/sampling.cu), and both
//! pick the same token, so they are written so that a row needs no sort:
//! - top-k and top-p cut at a logit *value*: top-k keeps the logits at or above the k-th
//!   largest; top-p then keeps those at or above the largest value v such that the tokens
//!   at or above v hold at least top_p of the remaining probability. Tokens tied at a cut
//!   stay together;
//! - min-p keeps the tokens whose probability is at least min_p times the largest;
//! - the draw is an exponential race (Gumbel-max): kept token i scores
//!   `(l_i − max)/T − ln(−ln u_i)` and the highest score wins, which picks i with
//!   probability softmax(l/T) over the kept tokens.
//!
//! `u_i` is a hash of (seed, choice index, output position, i): the same seed gives the same
//! output whatever else is in the batch, and a sequence preempted and recomputed continues
//! exactly where it was.

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
    /// The penalty rules' view of `tokens`, when the caller keeps one (else it is counted
    /// from `tokens` each time).
    pub history: Option<&'a TokenHistory>,
    /// The tokens a row may take next (a grammar, `allowed_token_ids`, `bad_words`): bit
    /// `t % 32` of word `t / 32`. Every other token is masked, and `logit_bias` added,
    /// before anything else reads the row, logprobs included.
    pub allowed: Option<&'a [u32]>,
}

impl SampleInput<'_> {
    pub(crate) fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    fn masks_eos(&self) -> bool {
        self.generated() < self.params.min_tokens
    }
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The hash of (seed, choice, position) that a row's per-token noise derives from.
pub fn noise_base(seed: u64, index: usize, position: usize) -> u64 {
    splitmix64(splitmix64(seed ^ splitmix64(index as u64)) ^ position as u64)
}

/// Uniform in [0, 1) for (seed, choice, position).
pub fn uniform(seed: u64, index: usize, position: usize) -> f64 {
    (noise_base(seed, index, position) >> 11) as f64 / (1u64 << 53) as f64
}

/// `−ln(−ln u)` for token `i` of a row with noise `base`, u uniform in (0, 1): Gumbel noise.
fn gumbel(base: u64, i: u32) -> f64 {
    let h = splitmix64(base ^ i as u64);
    let u = ((h >> 12) as f64 + 0.5) * (1.0 / (1u64 << 52) as f64);
    -(-u.ln()).ln()
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

/// The log-probability of `token` under `logits`, its rank and the `k` most likely tokens
/// (a prompt position's `prompt_logprobs`).
pub fn prompt_logprob(logits: &[f32], token: u32, k: usize) -> crate::request::PromptLogprob {
    let lp = log_softmax(logits);
    let logprob = lp.get(token as usize).copied().unwrap_or(f32::NEG_INFINITY);
    crate::request::PromptLogprob {
        token_id: token,
        logprob,
        rank: 1 + lp.iter().filter(|&&l| l > logprob).count(),
        top: top_logprobs(&lp, k),
    }
}

fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // Summed in f64: 10^5 terms in f32 drift by about 1e-5.
    let sum: f64 = logits.iter().map(|l| f64::from((l - max).exp())).sum();
    let lse = max + sum.ln() as f32;
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

/// What the masking and penalty rules do to one token.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub(crate) struct TokenRule {
    /// An end token while fewer than `min_tokens` are generated: never sampled.
    pub(crate) masked: bool,
    /// In the prompt or the output: the repetition penalty applies.
    pub(crate) seen: bool,
    /// Times in the output (presence and frequency penalties).
    pub(crate) count: u32,
}

/// What the penalty rules need of a sequence: each distinct token of the prompt and output
/// with its count in the output. Kept as tokens are appended, so that a step reads it in
/// time proportional to the distinct tokens rather than re-counting the whole sequence.
#[derive(Debug, Clone, Default)]
pub struct TokenHistory {
    counts: std::collections::HashMap<u32, u32>,
}

impl TokenHistory {
    pub fn new(tokens: &[u32], prompt_len: usize) -> Self {
        let mut h = Self::default();
        for &t in &tokens[..prompt_len] {
            h.counts.entry(t).or_insert(0);
        }
        for &t in &tokens[prompt_len..] {
            h.push(t);
        }
        h
    }

    /// A generated token.
    pub fn push(&mut self, token: u32) {
        *self.counts.entry(token).or_insert(0) += 1;
    }
}

/// The distinct tokens (below `vocab`) the masking and penalty rules touch, in no order.
pub(crate) fn token_rules(inp: &SampleInput, vocab: usize) -> Vec<(u32, TokenRule)> {
    let p = inp.params;
    let (rep, counted) =
        (p.repetition_penalty != 1.0, p.presence_penalty != 0.0 || p.frequency_penalty != 0.0);
    let mut rules = Vec::new();
    if rep || counted {
        let built;
        let history = match inp.history {
            Some(h) => h,
            None => {
                built = TokenHistory::new(inp.tokens, inp.prompt_len);
                &built
            }
        };
        // Repetition penalty (HF / vLLM) over prompt and output; presence and frequency
        // (OpenAI) over the output only.
        for (&t, &count) in history.counts.iter().filter(|&(&t, _)| (t as usize) < vocab) {
            let rule = TokenRule { masked: false, seen: rep, count: if counted { count } else { 0 } };
            if rule.seen || rule.count > 0 {
                rules.push((t, rule));
            }
        }
    }
    if inp.masks_eos() {
        for &t in inp.eos_ids.iter().chain(&p.stop_token_ids).filter(|&&t| (t as usize) < vocab) {
            match rules.iter_mut().find(|(id, _)| *id == t) {
                Some((_, r)) => r.masked = true,
                None => rules.push((t, TokenRule { masked: true, ..Default::default() })),
            }
        }
    }
    rules
}

/// A logit after the rules: repetition penalty (divide positive logits, multiply negative
/// ones), presence and frequency penalties, masking.
fn apply_rule(l: f32, rule: TokenRule, p: &SamplingParams) -> f32 {
    let mut l = l;
    if rule.seen {
        l = if l > 0.0 { l / p.repetition_penalty } else { l * p.repetition_penalty };
    }
    if rule.count > 0 {
        l -= p.frequency_penalty * rule.count as f32 + p.presence_penalty;
    }
    if rule.masked { f32::NEG_INFINITY } else { l }
}

/// Masks every logit whose token `allowed` does not hold (bit `t % 32` of word `t / 32`).
pub fn apply_mask(logits: &mut [f32], allowed: &[u32]) {
    for (w, chunk) in logits.chunks_mut(32).enumerate() {
        let bits = allowed.get(w).copied().unwrap_or(0);
        if bits == u32::MAX {
            continue;
        }
        for (b, l) in chunk.iter_mut().enumerate() {
            if bits >> b & 1 == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

/// Samples one token from `logits` (modified in place).
pub fn sample(logits: &mut [f32], inp: &SampleInput) -> (u32, Option<TokenLogprobs>) {
    let p = inp.params;
    if let Some(allowed) = inp.allowed {
        apply_mask(logits, allowed);
    }
    for &(t, bias) in &p.logit_bias {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += bias;
        }
    }
    let raw_logprobs = p.logprobs.map(|_| log_softmax(logits));
    for (t, rule) in token_rules(inp, logits.len()) {
        logits[t as usize] = apply_rule(logits[t as usize], rule, p);
    }
    let token = if p.greedy() {
        argmax(logits)
    } else {
        draw(logits, p, noise_base(inp.seed, inp.index, inp.generated()))
    };
    let logprobs = raw_logprobs.map(|lp| TokenLogprobs {
        token_id: token,
        logprob: lp[token as usize],
        top: top_logprobs(&lp, p.logprobs.unwrap_or(0)),
    });
    (token, logprobs)
}

/// The lowest logit kept by top-k and top-p (`f32::MIN`, keeping every finite logit, when
/// neither cuts).
fn cut(logits: &[f32], p: &SamplingParams, key: impl Fn(f32) -> f32) -> f32 {
    let mut floor = f32::MIN;
    if p.top_k <= 0 && p.top_p >= 1.0 {
        return floor;
    }
    let mut kept: Vec<f32> = logits.iter().copied().filter(|&l| l > f32::NEG_INFINITY).collect();
    if p.top_k > 0 && (p.top_k as usize) < kept.len() {
        let k = p.top_k as usize;
        kept.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
        floor = kept[k - 1];
        kept.retain(|&l| l >= floor);
    }
    if p.top_p < 1.0 {
        kept.sort_unstable_by(|a, b| b.total_cmp(a));
        let mass: f64 = kept.iter().map(|&l| key(l).exp() as f64).sum();
        let target = p.top_p as f64 * mass;
        let mut cum = 0.0;
        for (i, &l) in kept.iter().enumerate() {
            cum += key(l).exp() as f64;
            // Only at the end of a run of equal values: ties stay together.
            if cum >= target && kept.get(i + 1).is_none_or(|&next| next < l) {
                floor = floor.max(l);
                break;
            }
        }
    }
    floor
}

fn draw(logits: &[f32], p: &SamplingParams, base: u64) -> u32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return 0;
    }
    let t = p.temperature;
    let key = |l: f32| (l - max) / t;
    let floor = cut(logits, p, key);
    let mut best = (f64::NEG_INFINITY, 0);
    for (i, &l) in logits.iter().enumerate() {
        if l == f32::NEG_INFINITY || l < floor {
            continue;
        }
        let k = key(l);
        if p.min_p > 0.0 && k.exp() < p.min_p {
            continue;
        }
        let score = k as f64 + gumbel(base, i as u32);
        if score > best.0 {
            best = (score, i as u32);
        }
    }
    best.1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input<'a>(params: &'a SamplingParams, tokens: &'a [u32], seed: u64) -> SampleInput<'a> {
        SampleInput {
            params,
            seed,
            index: 0,
            tokens,
            prompt_len: 1,
            eos_ids: &[0],
            history: None,
            allowed: None,
        }
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

    fn penalize(logits: &mut [f32], inp: &SampleInput) {
        for (t, rule) in token_rules(inp, logits.len()) {
            logits[t as usize] = apply_rule(logits[t as usize], rule, inp.params);
        }
    }

    /// How often each token is drawn from `logits` over `n` seeds.
    fn frequencies(params: &SamplingParams, logits: &[f32], n: u64) -> Vec<f64> {
        let mut counts = vec![0.0; logits.len()];
        for s in 0..n {
            counts[sample(&mut logits.to_vec(), &input(params, &[2], s)).0 as usize] += 1.0 / n as f64;
        }
        counts
    }

    #[test]
    fn cuts_keep_ties_together_and_renormalize() {
        // p ∝ [4, 2, 2, 1, 1]: top_k 2 keeps the tie at the cut, so tokens 0, 1, 2 stay
        // with p = [0.5, 0.25, 0.25].
        let logits: Vec<f32> = [4.0f32, 2.0, 2.0, 1.0, 1.0].iter().map(|x| x.ln()).collect();
        let params = SamplingParams { temperature: 1.0, top_k: 2, ..Default::default() };
        let f = frequencies(&params, &logits, 6000);
        for (got, want) in f.iter().zip([0.5, 0.25, 0.25, 0.0, 0.0]) {
            assert!((got - want).abs() < 0.03, "top_k {f:?}");
        }
        // top_p 0.6: token 0 holds 0.4, {0, 1, 2} hold 0.8 ≥ 0.6, so the two tied tokens
        // stay and tokens 3, 4 go.
        let params = SamplingParams { temperature: 1.0, top_p: 0.6, ..Default::default() };
        let f = frequencies(&params, &logits, 6000);
        assert_eq!((f[3], f[4]), (0.0, 0.0), "top_p {f:?}");
        assert!((f[0] - 0.5).abs() < 0.03, "top_p {f:?}");
        // min_p 0.3: tokens below 0.3 × p_max (p ∝ 1 against 4) go.
        let params = SamplingParams { temperature: 1.0, min_p: 0.3, ..Default::default() };
        let f = frequencies(&params, &logits, 6000);
        assert_eq!((f[3], f[4]), (0.0, 0.0), "min_p {f:?}");
        // Temperature 0.5 squares the odds: p ∝ [16, 4, 4, 1, 1].
        let params = SamplingParams { temperature: 0.5, ..Default::default() };
        let f = frequencies(&params, &logits, 8000);
        assert!((f[0] - 16.0 / 26.0).abs() < 0.03, "temperature {f:?}");
    }

    #[test]
    fn a_kept_history_gives_the_rules_a_recount_gives() {
        let params = SamplingParams {
            repetition_penalty: 1.3,
            frequency_penalty: 0.5,
            min_tokens: 8,
            stop_token_ids: vec![9],
            ..Default::default()
        };
        let mut tokens = vec![4, 7, 4, 9];
        let mut history = TokenHistory::new(&tokens, 2);
        for next in [7, 7, 12, 300, 4] {
            tokens.push(next);
            history.push(next);
            let inp = |h| SampleInput {
                params: &params,
                seed: 0,
                index: 0,
                tokens: &tokens,
                prompt_len: 2,
                eos_ids: &[12],
                history: h,
                allowed: None,
            };
            let sorted = |mut v: Vec<(u32, TokenRule)>| {
                v.sort_by_key(|r| r.0);
                v
            };
            let (kept, recount) =
                (sorted(token_rules(&inp(Some(&history)), 256)), sorted(token_rules(&inp(None), 256)));
            assert_eq!(kept, recount);
            // Token 300 lies outside the vocabulary; 12 (EOS) and 9 (a stop id) are masked.
            assert!(kept.iter().all(|(t, _)| *t < 256));
            assert!(
                kept.iter().any(|(t, r)| *t == 12 && r.masked)
                    && kept.iter().any(|(t, r)| *t == 9 && r.masked)
            );
            assert_eq!(
                kept.iter().find(|(t, _)| *t == 7).map(|(_, r)| r.count),
                Some(tokens[2..].iter().filter(|&&t| t == 7).count() as u32)
            );
        }
    }

    #[test]
    fn a_grammar_mask_leaves_only_its_tokens_for_greedy_and_sampled_draws() {
        // 40 tokens: the best is 0; the mask allows 5 and 33 only.
        let mut logits: Vec<f32> = (0..40).map(|i| -(i as f32) / 10.0).collect();
        let allowed = [1u32 << 5, 1u32 << 1];
        let greedy = SamplingParams { temperature: 0.0, logprobs: Some(3), ..Default::default() };
        let inp = SampleInput { allowed: Some(&allowed), ..input(&greedy, &[2], 0) };
        let (t, lp) = sample(&mut logits.clone(), &inp);
        assert_eq!(t, 5);
        // Logprobs are of the masked distribution: two tokens share all of it.
        let lp = lp.unwrap();
        assert_eq!(lp.top.len(), 3);
        assert_eq!((lp.top[0].0, lp.top[1].0), (5, 33));
        assert_eq!(lp.top[2].1, f32::NEG_INFINITY);
        let sampled = SamplingParams { temperature: 1.5, ..Default::default() };
        for seed in 0..200 {
            let inp = SampleInput { allowed: Some(&allowed), ..input(&sampled, &[2], seed) };
            assert!([5, 33].contains(&sample(&mut logits, &inp).0));
            logits = (0..40).map(|i| -(i as f32) / 10.0).collect();
        }
    }

    #[test]
    fn logit_bias_adds_before_the_draw_and_the_logprobs() {
        let params = SamplingParams {
            temperature: 0.0,
            logprobs: Some(1),
            logit_bias: vec![(2, 5.0), (0, -100.0), (99, 1.0)],
            ..Default::default()
        };
        let mut logits = vec![3.0, 1.0, 0.0];
        let (t, lp) = sample(&mut logits, &input(&params, &[2], 0));
        assert_eq!((t, logits.clone()), (2, vec![-97.0, 1.0, 5.0]));
        assert_eq!(lp.unwrap().top[0].0, 2);
    }

    #[test]
    fn penalties_follow_hf_and_openai_rules() {
        let params = SamplingParams { temperature: 0.0, repetition_penalty: 2.0, ..Default::default() };
        let mut logits = vec![4.0, 3.0, -1.0];
        let inp = SampleInput {
            params: &params,
            seed: 0,
            index: 0,
            tokens: &[0, 2],
            prompt_len: 1,
            eos_ids: &[],
            history: None,
            allowed: None,
        };
        penalize(&mut logits, &inp);
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
            history: None,
            allowed: None,
        };
        penalize(&mut logits, &inp);
        assert_eq!(logits, vec![4.0, 0.5, -0.5]);
    }
}
