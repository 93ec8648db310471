//! Beam search over one request, as transformers' `generate(num_beams=…)` runs it
//! (`GenerationMixin._beam_search` in transformers 5): every step takes the top
//! `max(2, 1 + stop tokens) × width` continuations of all running beams by accumulated
//! log-probability; of those, the best `width` that hit no stop condition run on, and a stop
//! (a stop token, or the length limit) among the first `width` becomes a finished hypothesis
//! scored by its log-probability divided by its generated length to the power
//! `length_penalty`. The search ends by `early_stopping`'s rule. Scores are added in f32, and
//! the ±1e9 masks are transformers' own, so that near ties fall as they fall there.
//!
//! A plain struct: the Scheduler actor feeds it each running beam's top log-probabilities
//! and forks or drops sequences as it answers; it knows nothing of blocks or devices.

use crate::request::EarlyStopping;

/// transformers' mask for scores that must not be chosen.
const MASKED: f32 = -1.0e9;

/// One hypothesis: its generated tokens and its score (accumulated log-probability while
/// running; length-penalised once finished).
#[derive(Debug, Clone, PartialEq)]
pub struct Hypothesis {
    pub tokens: Vec<u32>,
    pub score: f32,
}

/// What a step decided.
#[derive(Debug, PartialEq)]
pub enum BeamStep {
    /// The beams that run on, best first: (index of the running beam it extends, token).
    Continue(Vec<(usize, u32)>),
    /// The search has ended: [`BeamSearch::results`] holds the answer.
    Done,
}

#[derive(Debug)]
pub struct BeamSearch {
    width: usize,
    length_penalty: f32,
    early_stopping: EarlyStopping,
    /// Tokens that end a hypothesis.
    stop_ids: Vec<u32>,
    /// Generated tokens at which every hypothesis ends (`max_tokens`).
    max_new: usize,
    /// Running beams, best first (one, the prompt, before the first step).
    running: Vec<Hypothesis>,
    /// `width` slots, best first; unfilled ones hold no tokens, a masked score and false.
    finished: Vec<(Hypothesis, bool)>,
    /// transformers' `is_early_stop_heuristic_unsatisfied`: an open beam could still beat
    /// the worst finished one.
    improvable: bool,
}

impl BeamSearch {
    pub fn new(
        width: usize,
        length_penalty: f32,
        early_stopping: EarlyStopping,
        stop_ids: Vec<u32>,
        max_new: usize,
    ) -> Self {
        let empty = (Hypothesis { tokens: Vec::new(), score: MASKED }, false);
        Self {
            width,
            length_penalty,
            early_stopping,
            stop_ids,
            max_new,
            running: vec![Hypothesis { tokens: Vec::new(), score: 0.0 }],
            finished: vec![empty; width],
            improvable: true,
        }
    }

    /// Continuations each running beam must report: its top `candidates()` tokens hold
    /// every one of its continuations that can make the step's overall top.
    pub fn candidates(width: usize, stop_ids: usize) -> usize {
        2.max(1 + stop_ids) * width
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// One step: `tops[i]` is running beam i's most likely next tokens with their
    /// log-probabilities, most likely first (at least [`Self::candidates`] of them, or the
    /// whole vocabulary).
    pub fn step(&mut self, tops: &[Vec<(u32, f32)>]) -> BeamStep {
        let k = Self::candidates(self.width, self.stop_ids.len());
        let generated = self.running[0].tokens.len();
        // (accumulated score, beam, token), best first; ties keep transformers' flat order
        // (beam, then token id).
        let mut cands: Vec<(f32, usize, u32)> = tops
            .iter()
            .zip(&self.running)
            .flat_map(|(top, beam)| top.iter().map(move |&(t, lp)| (beam.score + lp, t)))
            .zip(tops.iter().enumerate().flat_map(|(b, top)| std::iter::repeat_n(b, top.len())))
            .map(|((s, t), b)| (s, b, t))
            .collect();
        cands.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        cands.truncate(k);
        let hits: Vec<bool> = cands
            .iter()
            .map(|&(_, _, t)| self.stop_ids.contains(&t) || generated + 1 >= self.max_new)
            .collect();

        // The best `width` continuations that hit no stop run on.
        let mut order: Vec<usize> = (0..cands.len()).collect();
        let run_score = |c: usize| cands[c].0 + if hits[c] { MASKED } else { 0.0 };
        order.sort_by(|&a, &b| run_score(b).total_cmp(&run_score(a)).then(a.cmp(&b)));
        order.truncate(self.width);
        let next: Vec<(usize, u32)> = order.iter().map(|&c| (cands[c].1, cands[c].2)).collect();
        let next_running: Vec<Hypothesis> = order
            .iter()
            .map(|&c| {
                let mut tokens = self.running[cands[c].1].tokens.clone();
                tokens.push(cands[c].2);
                Hypothesis { tokens, score: run_score(c) }
            })
            .collect();

        self.update_finished(&cands, &hits, generated);
        self.running = next_running;
        self.check_improvable(generated + 1);
        let all_full = self.finished.iter().all(|f| f.1);
        let done = !self.improvable
            || (all_full && self.early_stopping == EarlyStopping::Done)
            || hits.iter().all(|&h| h);
        if done { BeamStep::Done } else { BeamStep::Continue(next) }
    }

    /// Merges the candidates that just finished (a stop among the first `width`) into the
    /// finished slots, keeping the best `width`.
    fn update_finished(&mut self, cands: &[(f32, usize, u32)], hits: &[bool], generated: usize) {
        let norm = ((generated + 1) as f64).powf(self.length_penalty as f64) as f32;
        let full = self.finished.iter().all(|f| f.1) && self.early_stopping == EarlyStopping::Done;
        let mut merged = std::mem::take(&mut self.finished);
        for (c, &(score, beam, token)) in cands.iter().enumerate() {
            let just_finished = hits[c] && c < self.width;
            let mut s = score / norm;
            if full {
                s += MASKED;
            }
            if !self.improvable {
                s += MASKED;
            }
            if !just_finished {
                s += MASKED;
            }
            let mut tokens = self.running[beam].tokens.clone();
            tokens.push(token);
            merged.push((Hypothesis { tokens, score: s }, just_finished));
        }
        // Stable: on equal scores the earlier slot (an older hypothesis) stays first.
        merged.sort_by(|a, b| b.0.score.total_cmp(&a.0.score));
        merged.truncate(self.width);
        self.finished = merged;
    }

    /// transformers' `_check_early_stop_heuristic`, with `len` tokens generated.
    fn check_improvable(&mut self, len: usize) {
        let best_len = if self.early_stopping == EarlyStopping::Never && self.length_penalty > 0.0 {
            self.max_new
        } else {
            len
        };
        let best_possible = self.running.first().map_or(MASKED, |b| b.score)
            / (best_len as f64).powf(self.length_penalty as f64) as f32;
        let worst = self.finished.iter().map(|f| f.0.score).fold(f32::INFINITY, f32::min);
        let beatable = self.finished.iter().any(|f| best_possible > if f.1 { worst } else { MASKED });
        self.improvable &= beatable;
    }

    /// The finished hypotheses, best first (the search's answer once it is done).
    pub fn results(&self) -> impl Iterator<Item = &Hypothesis> {
        self.finished.iter().filter(|f| f.1).map(|f| &f.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy model: the next token's log-probabilities depend on the last token only.
    fn table(last: u32) -> Vec<(u32, f32)> {
        let mut v: Vec<(u32, f32)> = match last {
            // From the prompt: 1 is likely, 2 (the stop token) less, 3 and 4 behind.
            0 => vec![(1, -0.5), (2, -1.2), (3, -1.6), (4, -3.0)],
            1 => vec![(3, -0.2), (2, -2.0), (4, -2.2), (1, -4.0)],
            3 => vec![(2, -0.1), (4, -3.0), (1, -3.5), (3, -4.0)],
            _ => vec![(2, -0.3), (1, -1.5), (3, -3.0), (4, -4.0)],
        };
        v.sort_by(|a, b| b.1.total_cmp(&a.1));
        v
    }

    fn run(width: usize, lp: f32, es: EarlyStopping, max_new: usize) -> Vec<Hypothesis> {
        let mut s = BeamSearch::new(width, lp, es, vec![2], max_new);
        let mut last: Vec<u32> = vec![0];
        loop {
            let tops: Vec<_> = last.iter().map(|&t| table(t)).collect();
            match s.step(&tops) {
                BeamStep::Done => return s.results().cloned().collect(),
                BeamStep::Continue(next) => {
                    assert_eq!(next.len(), width);
                    last = next.iter().map(|&(_, t)| t).collect();
                }
            }
        }
    }

    #[test]
    fn the_first_step_extends_the_prompt_and_finished_ones_are_ordered_by_penalised_score() {
        // Step 1: [2] ends at -1.2 (length 1); [1] and [3] run. Step 2: [3, 2] ends at
        // -1.7 over 2 tokens; [1, 3] (-0.7) runs on. With early_stopping=true two finished
        // hypotheses end the search there; the heuristic sees that [1, 3] can still win.
        let done = run(2, 1.0, EarlyStopping::Done, 10);
        let tokens: Vec<&[u32]> = done.iter().map(|h| h.tokens.as_slice()).collect();
        assert_eq!(tokens, [&[3, 2][..], &[2]]);
        let out = run(2, 1.0, EarlyStopping::Heuristic, 10);
        // [1, 3, 2]: -0.5 - 0.2 - 0.1 = -0.8 over 3 tokens.
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].tokens, vec![1, 3, 2]);
        assert!((out[0].score - (-0.8 / 3.0)).abs() < 1e-6, "{out:?}");
        for w in out.windows(2) {
            assert!(w[0].score >= w[1].score);
        }
        assert!(out.iter().all(|h| h.tokens.last() == Some(&2)));
    }

    #[test]
    fn a_length_penalty_changes_which_hypotheses_win() {
        // Without normalisation (0) short hypotheses win; with a long-favouring penalty
        // the longer ones move up.
        let short = run(2, 0.0, EarlyStopping::Never, 10);
        let long = run(2, 2.0, EarlyStopping::Never, 10);
        assert_eq!(short[0].tokens, vec![1, 3, 2]);
        assert!(long[0].tokens.len() >= short[0].tokens.len());
        assert_ne!(short, long);
    }

    #[test]
    fn the_length_limit_finishes_the_best_running_beams() {
        // Step 1: [2] finishes at -1.2; [1], [3], [4] run. Step 2 hits the limit: the best
        // three of all continuations finish, [1, 3] (-0.7 over 2) without a stop token.
        let out = run(3, 1.0, EarlyStopping::Heuristic, 2);
        let tokens: Vec<&[u32]> = out.iter().map(|h| h.tokens.as_slice()).collect();
        assert_eq!(tokens, [&[1, 3][..], &[3, 2], &[2]]);
        let scores: Vec<f32> = out.iter().map(|h| h.score).collect();
        assert!(
            (scores[0] + 0.35).abs() < 1e-6
                && (scores[1] + 0.85).abs() < 1e-6
                && (scores[2] + 1.2).abs() < 1e-6
        );
    }

    #[test]
    fn candidates_cover_two_per_beam_or_one_more_than_the_stop_tokens() {
        assert_eq!(BeamSearch::candidates(4, 1), 8);
        assert_eq!(BeamSearch::candidates(4, 0), 8);
        assert_eq!(BeamSearch::candidates(4, 2), 12);
    }
}
