//! The scheduler actor's side of beam search: each beam's step answers with its most likely
//! next tokens; once every running beam of a request has answered, [`BeamSearch`] picks the
//! beams that run on, and the core scheduler extends, forks (sharing blocks, copying the
//! last partial one) and drops sequences to match. The request's choices are sent whole when
//! the search ends: beam search does not stream.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use super::super::model_runner::Sampled;
use super::SchedulerActor;
use crate::core::beam::{BeamSearch, BeamStep};
use crate::core::block_pool::SeqId;
use crate::core::output::{SeqOutput, StopLimits};
use crate::core::scheduler::ScheduledSeq;
use crate::error::EngineError;
use crate::request::{
    AbortReason, BeamParams, FinishReason, MAX_LOGPROBS, SamplingParams, TokenEvent, ValidationError,
};

/// One request's beam search.
pub(super) struct BeamRun {
    search: BeamSearch,
    /// What the runner samples a beam with: greedy, reporting the top tokens the search needs.
    pub(super) params: Arc<SamplingParams>,
    prompt: Vec<u32>,
    /// The running beams' sequences, in the search's order.
    pub(super) live: Vec<SeqId>,
    /// This step's answers so far: each beam's top (token, log-probability).
    results: HashMap<SeqId, Vec<(u32, f32)>>,
    /// Prompt tokens the first step found in the prefix cache.
    pub(super) cached_tokens: usize,
    steps: usize,
}

impl SchedulerActor {
    /// A beam search for a new request (its `live` beams are set once admitted).
    pub(super) fn beam_run(
        &self,
        params: &SamplingParams,
        b: BeamParams,
        prompt: &[u32],
    ) -> Result<BeamRun, EngineError> {
        let mut stop_ids = params.stop_token_ids.clone();
        if !params.ignore_eos {
            stop_ids.extend_from_slice(&self.tokenizer.eos_ids);
        }
        stop_ids.sort_unstable();
        stop_ids.dedup();
        // A beam's continuations that can be chosen are among its top `width + stop tokens`
        // (fewer than `width` others rank above one that runs on, and at most every stop
        // token), which the samplers return up to MAX_LOGPROBS of.
        let top = b.width + stop_ids.len();
        if top > MAX_LOGPROBS {
            return Err(EngineError::InvalidParams(ValidationError {
                param: "best_of",
                rule: format!(
                    "with {} stop tokens allows at most {} beams",
                    stop_ids.len(),
                    MAX_LOGPROBS.saturating_sub(stop_ids.len())
                ),
                value: b.width.to_string(),
            }));
        }
        let max_new = params.max_tokens.unwrap_or(usize::MAX).min(self.limits.max_model_len - prompt.len());
        let runner = SamplingParams { temperature: 0.0, logprobs: Some(top), ..params.clone() };
        Ok(BeamRun {
            search: BeamSearch::new(b.width, b.length_penalty, b.early_stopping, stop_ids, max_new),
            params: Arc::new(runner),
            prompt: prompt.to_vec(),
            live: Vec::new(),
            results: HashMap::new(),
            cached_tokens: 0,
            steps: 0,
        })
    }

    /// Records a beam's step answer: Some(true) when every running beam of the request has
    /// now answered, None when the answer is stale (the beam was preempted or moved on).
    pub(super) fn beam_result(
        &mut self,
        group: u64,
        scheduled: &[ScheduledSeq],
        sm: Sampled,
    ) -> Option<bool> {
        let s = scheduled.iter().find(|s| s.seq == sm.seq)?;
        if !self.core.take_beam_result(sm.seq, s.start + s.len) {
            return None;
        }
        let b = self.requests.get_mut(&group)?.beam.as_mut()?;
        b.results.insert(sm.seq, sm.logprobs.map(|l| l.top).unwrap_or_default());
        Some(b.live.iter().all(|s| b.results.contains_key(s)))
    }

    /// Runs a search step on the answers of every running beam of `group`.
    pub(super) fn beam_step(&mut self, group: u64, now: Instant) {
        let Some(mut b) = self.requests.get_mut(&group).and_then(|r| r.beam.take()) else { return };
        if b.steps == 0 {
            b.cached_tokens = b.live.first().and_then(|&s| self.core.seq(s)).map_or(0, |s| s.cached_tokens);
        }
        b.steps += 1;
        let tops: Vec<Vec<(u32, f32)>> =
            b.live.iter().map(|s| b.results.remove(s).unwrap_or_default()).collect();
        match b.search.step(&tops) {
            BeamStep::Continue(next) => {
                b.live = self.move_beams(group, &b.live, &next);
                if let Some(r) = self.requests.get_mut(&group) {
                    r.beam = Some(b);
                }
            }
            BeamStep::Done => {
                for &s in &b.live {
                    self.core.drop_beam(s);
                    self.seq_owner.remove(&s);
                }
                b.live.clear();
                self.send_beam_results(group, &b, now);
            }
        }
    }

    /// Makes the sequences match the search's next beams (`next[i]`: the running beam it
    /// extends, and its token): a beam's first continuation extends it in place, the others
    /// fork from it first, and beams with none are dropped. Returns the new running beams.
    fn move_beams(&mut self, group: u64, live: &[SeqId], next: &[(usize, u32)]) -> Vec<SeqId> {
        let mut first: Vec<Option<usize>> = vec![None; live.len()];
        for (i, &(p, _)) in next.iter().enumerate() {
            first[p].get_or_insert(i);
        }
        let mut beams = vec![0; next.len()];
        for (i, &(p, t)) in next.iter().enumerate() {
            if first[p] != Some(i) {
                beams[i] = self.core.fork_beam(live[p], t);
                self.seq_owner.insert(beams[i], (group, 0));
            }
        }
        for (i, &(p, t)) in next.iter().enumerate() {
            if first[p] == Some(i) {
                self.core.extend_beam(live[p], t);
                beams[i] = live[p];
            }
        }
        for (p, &s) in live.iter().enumerate() {
            if first[p].is_none() {
                self.core.drop_beam(s);
                self.seq_owner.remove(&s);
            }
        }
        beams
    }

    /// Sends the search's best hypotheses as the request's choices, best first, and ends it.
    fn send_beam_results(&mut self, group: u64, b: &BeamRun, now: Instant) {
        let Some(req) = self.requests.get_mut(&group) else { return };
        let lim = StopLimits {
            params: &req.params,
            eos_ids: &self.tokenizer.eos_ids,
            max_tokens: req.max_tokens,
            max_model_len: self.limits.max_model_len,
        };
        let mut events = Vec::new();
        let mut hypotheses = b.search.results();
        for (index, choice) in req.choices.iter_mut().enumerate() {
            let mut out = SeqOutput::new(b.prompt.len(), &req.params);
            let mut tokens = b.prompt.clone();
            let mut finish = None;
            for &t in hypotheses.next().map_or(&[][..], |h| &h.tokens) {
                tokens.push(t);
                let outcome = match out.push(&self.tokenizer, &tokens, b.prompt.len(), &lim) {
                    Ok(o) => o,
                    Err(e) => {
                        events.push(TokenEvent::Error { message: e.to_string() });
                        break;
                    }
                };
                req.completion_tokens += 1;
                events.push(TokenEvent::Token { index, token_id: t, text: outcome.text, logprobs: None });
                if let Some(f) = outcome.finish {
                    finish = Some(f);
                    break;
                }
            }
            let (reason, stop_reason) = finish.unwrap_or((FinishReason::Length, None));
            choice.finish = Some(reason);
            self.metrics.on_finish(reason);
            events.push(TokenEvent::Finished { index, reason, stop_reason });
        }
        self.metrics.on_first_token(req.arrival, now);
        req.first_token = Some(now);
        req.last_token = Some(now);
        let failed = events.iter().any(|e| matches!(e, TokenEvent::Error { .. }));
        for ev in events {
            self.outbox.push((group, req.events.clone(), ev));
        }
        if failed {
            self.metrics.on_abort(AbortReason::Engine);
        }
        self.end_request(group, failed);
    }
}
