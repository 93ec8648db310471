//! Scheduler actor: owns the waiting/running queues (through the plain
//! [`crate::core::scheduler::Scheduler`]) and every live request's output state, and drives
//! the step loop. Receives [`AddRequest`] / [`Abort`] / [`GetStats`] from the Engine handle
//! (HTTP, WebSocket and CLI all go through it); sends [`Reserve`] to the BlockManager and
//! [`ExecuteBatch`] to the ModelRunner, one of each per step. New requests and aborts are
//! handled between steps, so an abort frees its blocks at the next step. A step's events go
//! to the clients once the next step is with the runner, or when the step ends if none was
//! planned behind it; with `--async-scheduling` that next step is planned while the
//! previous one still runs (two steps in flight). Each request's event channel is bounded
//! ([`crate::Engine::set_stream_backlog`]): the scheduler never waits on a client, and
//! aborts a request whose client has stopped reading. The message handlers are in `handlers`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use actix::prelude::*;
use tokio::sync::mpsc;

use super::block_manager::{Reserve, Reserved};
use super::model_runner::{BatchSeq, ExecuteBatch, NewSeq, StepOutput};
use crate::core::block_pool::{AllocStatus, BlockError, BlockId, SeqId};
use crate::core::output::{SeqOutput, StopLimits};
use crate::core::scheduler::{PENDING, ScheduledSeq, Scheduler, SchedulerConfig};
use crate::error::EngineError;
use crate::metrics::Metrics;
use crate::models::lora::LoraAdapter;
use crate::request::{AbortReason, FinishReason, PromptLogprob, SamplingParams, TokenEvent, Usage};
use crate::tokenizer::Tokenizer;

/// A validated request entering the engine.
#[derive(Message)]
#[rtype(result = "Result<(), EngineError>")]
pub struct AddRequest {
    pub id: Arc<str>,
    pub prompt_ids: Vec<u32>,
    pub params: Arc<SamplingParams>,
    pub events: mpsc::Sender<TokenEvent>,
    /// The adapter this request runs with (None = the base model).
    pub lora: Option<Arc<LoraAdapter>>,
}

/// Aborts a request by id; returns whether it was live.
#[derive(Message)]
#[rtype(result = "bool")]
pub struct Abort {
    pub id: Arc<str>,
    pub reason: AbortReason,
}

/// Places adapters in free device slots before any request names them (`--lora-modules`
/// at start-up), so that no step waits for their weights; returns how many were loaded.
#[derive(Message)]
#[rtype(result = "Result<usize, EngineError>")]
pub struct PreloadLoras(pub Vec<Arc<LoraAdapter>>);

#[derive(Message)]
#[rtype(result = "SchedulerStats")]
pub struct GetStats;

#[derive(Debug, Clone, Default)]
pub struct SchedulerStats {
    pub num_running: usize,
    pub num_waiting: usize,
    pub free_blocks: usize,
    pub total_blocks: usize,
    pub num_preemptions: u64,
    /// When the last step finished (None before the first).
    pub last_step: Option<Instant>,
    /// A step is running now.
    pub busy: bool,
    /// Adapter slots holding an adapter.
    pub lora_slots_used: usize,
    /// Adapters (load ids) of the running sequences, and of the waiting ones.
    pub running_loras: Vec<u64>,
    pub waiting_loras: Vec<u64>,
}

/// Limits the scheduler enforces on admission.
#[derive(Debug, Clone, Copy)]
pub struct AdmissionLimits {
    pub max_model_len: usize,
    pub vocab_size: usize,
    /// Most sequences that may wait to be scheduled; a request that would go past it is
    /// refused with [`EngineError::QueueFull`]. None: no bound.
    pub max_waiting: Option<usize>,
}

/// Ends every live request with an error event carrying the message (the server's
/// shutdown, once its drain time is over).
#[derive(Message)]
#[rtype(result = "()")]
pub struct EndAll(pub String);

/// Sets [`AdmissionLimits::max_waiting`] (the server's `--max-waiting-requests`).
#[derive(Message)]
#[rtype(result = "()")]
pub struct SetMaxWaiting(pub Option<usize>);

struct Choice {
    seq: SeqId,
    out: SeqOutput,
    /// Why the choice ended, once it has.
    finish: Option<FinishReason>,
}

impl Choice {
    fn done(&self) -> bool {
        self.finish.is_some()
    }
}

struct LiveRequest {
    id: Arc<str>,
    params: Arc<SamplingParams>,
    seed: u64,
    max_tokens: usize,
    prompt_len: usize,
    choices: Vec<Choice>,
    events: mpsc::Sender<TokenEvent>,
    lora: Option<u64>,
    arrival: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    completion_tokens: usize,
    /// A beam search's state (`use_beam_search`): its choices are its results.
    beam: Option<Box<BeamRun>>,
    /// The prompt's logprobs as the runner computes them (`prompt_logprobs`), by position;
    /// taken when they are sent, before the first token.
    prompt_logprobs: Option<Vec<Option<PromptLogprob>>>,
}

pub struct SchedulerActor {
    core: Scheduler,
    block_manager: Recipient<Reserve>,
    runner: Recipient<ExecuteBatch>,
    tokenizer: Arc<Tokenizer>,
    limits: AdmissionLimits,
    metrics: Arc<Metrics>,
    requests: HashMap<u64, LiveRequest>,
    by_id: HashMap<Arc<str>, u64>,
    /// seq → (group, choice index)
    seq_owner: HashMap<SeqId, (u64, usize)>,
    next_group: u64,
    /// Adapters of live requests: load id → (weights, live requests using it).
    adapters: HashMap<u64, (Arc<LoraAdapter>, usize)>,
    /// Steps planned and not yet answered.
    in_flight: usize,
    /// Failed steps so far. A step planned before a failure carries only requests that
    /// failure ended; if it fails too (the runner's state of their sequences went with the
    /// first failure), that is no new failure for the requests live now.
    failures: u64,
    /// Of those, the ones still waiting for their blocks (not yet sent to the runner).
    planning: usize,
    /// Whether the last message to the runner was a step: the runner may hold its answer
    /// until another message comes (`ExecuteBatch`'s doc), so one must.
    unfollowed: bool,
    /// Steps that may be in flight at once: 2 with `--async-scheduling` (the next step is
    /// planned and queued at the runner while one runs), else 1.
    max_in_flight: usize,
    /// Set while the end of a step plans the next one: that step follows without a gap.
    chained: bool,
    last_step: Option<Instant>,
    total_blocks: usize,
    /// Events for the clients' streams, with their request, in the order they happened. A
    /// step's are sent once the next step is on its way to the runner (at once when none
    /// starts), so that the device runs that step while the streams are fed; every event
    /// goes through here, so each request's stay in order.
    outbox: Vec<(u64, mpsc::Sender<TokenEvent>, TokenEvent)>,
    /// Log a line as each request ends (not `--disable-log-requests`).
    log_requests: bool,
}

impl SchedulerActor {
    pub fn new(
        cfg: SchedulerConfig,
        block_manager: Recipient<Reserve>,
        runner: Recipient<ExecuteBatch>,
        tokenizer: Arc<Tokenizer>,
        limits: AdmissionLimits,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            core: Scheduler::new(cfg),
            block_manager,
            runner,
            tokenizer,
            limits,
            metrics,
            requests: HashMap::new(),
            by_id: HashMap::new(),
            seq_owner: HashMap::new(),
            next_group: 0,
            adapters: HashMap::new(),
            in_flight: 0,
            failures: 0,
            planning: 0,
            unfollowed: false,
            max_in_flight: 1,
            chained: false,
            last_step: None,
            total_blocks: cfg.num_blocks,
            outbox: Vec::new(),
            log_requests: true,
        }
    }

    /// With `on`, the next step is planned and sent while one runs (vLLM's
    /// `--async-scheduling`): the host's share of a step overlaps the device's. A sequence
    /// that stops at a step has then already been given the next one, whose token is dropped.
    /// Whether each request's end is logged (`request finished`); on by default.
    pub fn with_request_log(mut self, on: bool) -> Self {
        self.log_requests = on;
        self
    }

    pub fn with_async_scheduling(mut self, on: bool) -> Self {
        self.max_in_flight = if on { 2 } else { 1 };
        self
    }

    fn add(&mut self, msg: AddRequest) -> Result<(), EngineError> {
        let prompt_len = msg.prompt_ids.len();
        let max_len = self.limits.max_model_len;
        if prompt_len == 0 {
            return Err(EngineError::EmptyPrompt);
        }
        if prompt_len >= max_len {
            return Err(EngineError::PromptTooLong { prompt_tokens: prompt_len, max_model_len: max_len });
        }
        if let Some(&bad) = msg.prompt_ids.iter().find(|&&t| t as usize >= self.limits.vocab_size) {
            return Err(EngineError::TokenOutOfRange { token: bad, vocab_size: self.limits.vocab_size });
        }
        if self.core.check_prompt(prompt_len) == AllocStatus::Never {
            return Err(EngineError::PromptTooLong { prompt_tokens: prompt_len, max_model_len: max_len });
        }
        if self.by_id.contains_key(&msg.id) {
            return Err(EngineError::DuplicateId(msg.id.to_string()));
        }
        let waiting = self.core.num_waiting();
        if let Some(limit) = self.limits.max_waiting
            && waiting + msg.params.n > limit
        {
            return Err(EngineError::QueueFull { waiting, limit });
        }
        let group = self.next_group;
        self.next_group += 1;
        let n = msg.params.n;
        let lora = msg.lora.as_ref().map(|a| a.id);
        if let Some(a) = msg.lora {
            self.adapters.entry(a.id).or_insert((a, 0)).1 += 1;
        }
        let beam = match msg.params.beam {
            Some(b) => Some(Box::new(self.beam_run(&msg.params, b, &msg.prompt_ids)?)),
            None => None,
        };
        // A beam search starts from one sequence, the prompt; its choices are filled at the end.
        let seqs = self.core.add(group, &msg.prompt_ids, if beam.is_some() { 1 } else { n }, lora);
        let max_tokens = msg.params.max_tokens.unwrap_or(usize::MAX).min(max_len - prompt_len);
        self.core.set_max_len(group, prompt_len + max_tokens);
        self.core.set_priority(group, msg.params.priority);
        if msg.params.prompt_logprobs.is_some() {
            self.core.set_whole_prompt(group);
        }
        for (i, &seq) in seqs.iter().enumerate() {
            self.seq_owner.insert(seq, (group, i));
        }
        let choices = (0..n)
            .map(|i| Choice {
                seq: seqs[i.min(seqs.len() - 1)],
                out: SeqOutput::new(prompt_len, &msg.params),
                finish: None,
            })
            .collect();
        let beam = beam.map(|mut b| {
            self.core.set_beam(group);
            b.live = seqs.clone();
            b
        });
        let seed = msg.params.seed.unwrap_or_else(|| self.metrics.random_seed());
        let prompt_logprobs = msg.params.prompt_logprobs.map(|_| vec![None; prompt_len]);
        self.metrics.on_request_added(prompt_len);
        self.by_id.insert(msg.id.clone(), group);
        self.requests.insert(
            group,
            LiveRequest {
                id: msg.id,
                params: msg.params,
                seed,
                max_tokens,
                prompt_len,
                choices,
                events: msg.events,
                lora,
                arrival: Instant::now(),
                first_token: None,
                last_token: None,
                completion_tokens: 0,
                beam,
                prompt_logprobs,
            },
        );
        Ok(())
    }

    fn abort(&mut self, id: &str, reason: AbortReason) -> bool {
        let Some(&group) = self.by_id.get(id) else { return false };
        if let Some(req) = self.requests.get_mut(&group) {
            for (index, c) in req.choices.iter_mut().enumerate().filter(|(_, c)| !c.done()) {
                c.finish = Some(FinishReason::Abort);
                let ev = TokenEvent::Finished { index, reason: FinishReason::Abort, stop_reason: None };
                self.outbox.push((group, req.events.clone(), ev));
            }
        }
        self.metrics.on_abort(reason);
        self.end_request(group, true);
        true
    }

    /// Removes a request whose choices have all ended; sends `Done`.
    fn end_request(&mut self, group: u64, aborted: bool) {
        let Some(req) = self.requests.remove(&group) else { return };
        if self.log_requests {
            self.log_finished(&req);
        }
        self.by_id.remove(&req.id);
        if let Some(id) = req.lora
            && let Some(e) = self.adapters.get_mut(&id)
        {
            e.1 -= 1;
            if e.1 == 0 {
                self.adapters.remove(&id);
            }
        }
        for c in &req.choices {
            self.seq_owner.remove(&c.seq);
        }
        for s in req.beam.iter().flat_map(|b| &b.live) {
            self.seq_owner.remove(s);
        }
        let cached_tokens = match &req.beam {
            Some(b) => b.cached_tokens,
            None => req.choices.first().and_then(|c| self.core.seq(c.seq)).map_or(0, |s| s.cached_tokens),
        };
        self.core.remove_group(group);
        let usage = Usage {
            prompt_tokens: req.prompt_len,
            completion_tokens: req.completion_tokens,
            total_tokens: req.prompt_len + req.completion_tokens,
            cached_tokens,
        };
        if !aborted {
            self.metrics.on_request_done(req.arrival, req.first_token, req.completion_tokens);
        }
        self.outbox.push((group, req.events, TokenEvent::Done { usage }));
    }

    /// One line per request as it ends: what it cost and how it ended (a choice that ended
    /// by an engine error shows `error`).
    fn log_finished(&self, req: &LiveRequest) {
        let ms = |d: std::time::Duration| format!("{:.1}", d.as_secs_f64() * 1e3);
        let finish: Vec<&str> =
            req.choices.iter().map(|c| c.finish.map_or("error", FinishReason::as_str)).collect();
        let adapter = req.lora.and_then(|id| self.adapters.get(&id)).map(|(a, _)| a.name.as_str());
        tracing::info!(
            request_id = %req.id,
            prompt_tokens = req.prompt_len,
            completion_tokens = req.completion_tokens,
            ttft_ms = %req.first_token.map_or_else(|| "-".into(), |t| ms(t - req.arrival)),
            total_ms = %ms(req.arrival.elapsed()),
            finish = %finish.join(","),
            adapter = %adapter.unwrap_or("-"),
            "request finished"
        );
    }

    /// Sends the waiting events. A request whose client has gone is aborted, and so is one
    /// whose client has stopped reading: its stream's last free place carries an error
    /// event saying so.
    fn flush_events(&mut self) {
        let started = Instant::now();
        while !self.outbox.is_empty() {
            let mut ended: Vec<(u64, AbortReason)> = Vec::new();
            for (group, tx, ev) in std::mem::take(&mut self.outbox) {
                if ended.iter().any(|(g, _)| *g == group) {
                    continue;
                }
                let last = matches!(ev, TokenEvent::Done { .. } | TokenEvent::Error { .. });
                if !last && tx.capacity() <= 1 && !tx.is_closed() {
                    let unread = tx.max_capacity() - tx.capacity();
                    let message = format!(
                        "the client left {unread} events of this stream unread (--stream-backlog); \
                         the request was aborted"
                    );
                    let _ = tx.try_send(TokenEvent::Error { message });
                    ended.push((group, AbortReason::SlowClient));
                } else if tx.try_send(ev).is_err() {
                    ended.push((group, AbortReason::ClientGone));
                }
            }
            // Their aborts queue events for streams already ended: refused and dropped next round.
            for (group, reason) in ended {
                if let Some(id) = self.requests.get(&group).map(|r| r.id.clone()) {
                    self.abort(&id, reason);
                }
            }
        }
        self.metrics.profile.events_ns.fetch_add(nanos(started, Instant::now()), Relaxed);
    }

    fn fail_all(&mut self, message: String) {
        self.failures += 1;
        tracing::error!(%message, "engine step failed; failing every live request");
        self.end_all(message);
    }

    /// Ends every live request with an error event carrying `message`.
    fn end_all(&mut self, message: String) {
        let groups: Vec<u64> = self.requests.keys().copied().collect();
        for g in groups {
            if let Some(req) = self.requests.get(&g) {
                self.outbox.push((g, req.events.clone(), TokenEvent::Error { message: message.clone() }));
            }
            self.metrics.on_abort(AbortReason::Engine);
            self.end_request(g, true);
        }
        self.flush_events();
    }

    /// The runner's message for a planned step.
    fn build_batch(&self, plan: PlannedStep, reserved: Reserved, follows: bool) -> ExecuteBatch {
        let PlannedStep { seqs, fresh, dropped, lora_loads, copies } = plan;
        let seqs = seqs
            .iter()
            .zip(&fresh)
            .zip(reserved.tables)
            // A request aborted while its blocks were being reserved drops out here; its
            // blocks are freed at the next step.
            .filter_map(|((s, &fresh), block_table)| {
                let seq = self.core.seq(s.seq)?;
                let &(group, index) = self.seq_owner.get(&s.seq)?;
                let req = self.requests.get(&group)?;
                // A beam's runner samples by the beam search's rules.
                let params = req.beam.as_ref().map_or(&req.params, |b| &b.params);
                // Its known tokens: pending ones (a suffix) come from the runner itself.
                let new = fresh.then(|| NewSeq {
                    tokens: seq.tokens.iter().copied().take_while(|&t| t != PENDING).collect(),
                    prompt_len: seq.prompt_len,
                    params: params.clone(),
                    seed: req.seed,
                    index,
                });
                Some(BatchSeq {
                    seq: s.seq,
                    new,
                    start: s.start,
                    len: s.len,
                    sample: s.sample,
                    block_table,
                    lora_slot: s.lora_slot,
                })
            })
            .collect();
        // Every planned load names an adapter of a live request (it was just admitted).
        let lora_loads = lora_loads
            .iter()
            .filter_map(|(slot, id)| self.adapters.get(id).map(|(a, _)| (*slot, a.clone())))
            .collect();
        // Every step is followed by another message (`maybe_step`).
        ExecuteBatch { seqs, dropped, lora_loads, copies, follows, followed: true }
    }

    fn apply(&mut self, scheduled: &[ScheduledSeq], out: StepOutput) {
        let now = Instant::now();
        let mut applied = 0;
        let metrics = self.metrics.clone();
        let dropped = &metrics.profile.dropped_tokens;
        let mut beams_ready = Vec::new();
        // A position computed again (after a preemption) keeps its first answer.
        for p in out.prompt_logprobs {
            let Some(&(group, _)) = self.seq_owner.get(&p.seq) else { continue };
            let slot = self.requests.get_mut(&group).and_then(|r| r.prompt_logprobs.as_mut()?.get_mut(p.at));
            if let Some(slot) = slot.filter(|s| s.is_none()) {
                *slot = Some(p.logprob);
            }
        }
        for sm in out.sampled {
            // Aborted while the step ran: its result is dropped.
            let Some(&(group, index)) = self.seq_owner.get(&sm.seq) else {
                dropped.fetch_add(1, Relaxed);
                continue;
            };
            if self.requests.get(&group).is_some_and(|r| r.beam.is_some()) {
                match self.beam_result(group, scheduled, sm) {
                    Some(true) => beams_ready.push(group),
                    Some(false) => {}
                    None => {
                        dropped.fetch_add(1, Relaxed);
                    }
                }
                continue;
            }
            let at = self.core.resolve_token(sm.seq, sm.token);
            // Stopped at the step before (planned before that was known): dropped too.
            let Some(req) = self.requests.get_mut(&group).filter(|r| !r.choices[index].done()) else {
                dropped.fetch_add(1, Relaxed);
                continue;
            };
            applied += 1;
            let seq = self.core.seq(sm.seq).expect("owned sequences are live");
            // The tokens up to this one (a later step's may be pending behind it).
            let tokens = &seq.tokens[..at.map_or(seq.tokens.len(), |i| i + 1)];
            let lim = StopLimits {
                params: &req.params,
                eos_ids: &self.tokenizer.eos_ids,
                max_tokens: req.max_tokens,
                max_model_len: self.limits.max_model_len,
            };
            let outcome = match req.choices[index].out.push(&self.tokenizer, tokens, seq.prompt_len, &lim) {
                Ok(o) => o,
                Err(e) => {
                    self.outbox.push((
                        group,
                        req.events.clone(),
                        TokenEvent::Error { message: e.to_string() },
                    ));
                    self.metrics.on_abort(AbortReason::Engine);
                    self.end_request(group, true);
                    continue;
                }
            };
            req.completion_tokens += 1;
            match req.first_token {
                None => self.metrics.on_first_token(req.arrival, now),
                Some(_) => self.metrics.on_inter_token(req.last_token.unwrap_or(now), now),
            }
            req.first_token.get_or_insert(now);
            req.last_token = Some(now);
            if let Some(positions) = req.prompt_logprobs.take() {
                self.outbox.push((group, req.events.clone(), TokenEvent::PromptLogprobs { positions }));
            }
            let token =
                TokenEvent::Token { index, token_id: sm.token, text: outcome.text, logprobs: sm.logprobs };
            self.outbox.push((group, req.events.clone(), token));
            if let Some((reason, stop_reason)) = outcome.finish {
                req.choices[index].finish = Some(reason);
                self.outbox.push((
                    group,
                    req.events.clone(),
                    TokenEvent::Finished { index, reason, stop_reason },
                ));
                self.metrics.on_finish(reason);
                self.core.finish(sm.seq);
                if req.choices.iter().all(Choice::done) {
                    self.end_request(group, false);
                }
            }
        }
        for group in beams_ready {
            self.beam_step(group, now);
        }
        self.metrics.on_step(scheduled.iter().map(|s| s.len).sum(), applied);
    }

    /// Starts a step unless one is running or there is nothing to do. When no step follows
    /// the last one sent and nothing else will make one (no other step is answered first,
    /// none waits for blocks), the runner is told that none comes, so that it answers that
    /// step.
    fn maybe_step(&mut self, ctx: &mut Context<Self>) {
        self.plan_step(ctx);
        if self.unfollowed && self.planning == 0 && self.in_flight == 1 {
            self.unfollowed = false;
            self.runner.do_send(ExecuteBatch::flush());
        }
    }

    fn plan_step(&mut self, ctx: &mut Context<Self>) {
        if self.in_flight >= self.max_in_flight {
            return;
        }
        let start = Instant::now();
        let Some(plan) = self.core.schedule() else { return };
        // Planned while another step ran: its time until its results includes that step's.
        let overlapped = self.in_flight > 0;
        if overlapped {
            self.metrics.profile.pipelined_steps.fetch_add(1, Relaxed);
        }
        let follows = overlapped || self.chained;
        self.in_flight += 1;
        self.planning += 1;
        // Counted as computed now, with pending tokens, so that the next plan may follow.
        let fresh: Vec<bool> =
            plan.seqs.iter().map(|s| self.core.seq(s.seq).is_some_and(|q| !q.registered)).collect();
        for s in &plan.seqs {
            self.core.on_launched(s);
        }
        self.metrics.on_preemptions(plan.num_preempted);
        self.metrics.on_prefix_cache(self.core.prefix_queries, self.core.prefix_hits);
        let reserve = Reserve { ops: plan.ops, tables_for: plan.seqs.iter().map(|s| s.seq).collect() };
        let planned = PlannedStep {
            seqs: plan.seqs,
            fresh,
            dropped: plan.dropped,
            lora_loads: plan.lora_loads,
            copies: plan.copies,
        };
        let scheduled_at = Instant::now();
        let failures = self.failures;
        let step = self.block_manager.send(reserve).into_actor(self).then(move |res, act, ctx| {
            act.planning -= 1;
            let reserved_at = Instant::now();
            let reserved = match res {
                Ok(Ok(r)) => r,
                Ok(Err(e)) => return fut::ready(Err(StepError::Blocks(e))).boxed_local(),
                Err(e) => return fut::ready(Err(StepError::Mailbox(e.to_string()))).boxed_local(),
            };
            let scheduled = planned.seqs.clone();
            let batch = act.build_batch(planned, reserved, follows);
            let p = &act.metrics.profile;
            p.blocks_ns.fetch_add(nanos(scheduled_at, reserved_at), Relaxed);
            p.schedule_ns.fetch_add(nanos(start, scheduled_at) + nanos(reserved_at, Instant::now()), Relaxed);
            let sent = act.runner.send(batch);
            act.unfollowed = true;
            // The runner has the step: the last step's events go out while it runs, and
            // with async scheduling the next step is planned behind it.
            act.flush_events();
            act.maybe_step(ctx);
            sent.into_actor(act)
                .map(move |res, _, _| match res {
                    Ok(Ok(out)) => Ok((scheduled, out)),
                    Ok(Err(e)) => Err(StepError::Runner(e.to_string())),
                    Err(e) => Err(StepError::Mailbox(e.to_string())),
                })
                .boxed_local()
        });
        ctx.spawn(step.map(move |res, act, ctx| {
            act.in_flight -= 1;
            let now = Instant::now();
            let since_last = act.last_step.map(|t| now - t);
            act.last_step = Some(now);
            match res {
                Ok((scheduled, out)) => {
                    tracing::debug!(
                        target: "actorllm::steps",
                        seqs = scheduled.len(),
                        tokens = scheduled.iter().map(|s| s.len).sum::<usize>(),
                        graph = out.timing.graph,
                        since_last_us = since_last.map_or(0, |d| d.as_micros() as u64),
                        "step done"
                    );
                    let (t, applying) = (out.timing, Instant::now());
                    act.apply(&scheduled, out);
                    let p = &act.metrics.profile;
                    p.prepare_ns.fetch_add(t.prepare_ns, Relaxed);
                    p.launch_ns.fetch_add(t.launch_ns, Relaxed);
                    p.device_ns.fetch_add(t.device_ns, Relaxed);
                    p.sample_ns.fetch_add(t.sample_ns, Relaxed);
                    p.mask_ns.fetch_add(t.mask_ns, Relaxed);
                    p.device_allocs.fetch_add(t.device_allocs, Relaxed);
                    p.graph_steps.fetch_add(u64::from(t.graph), Relaxed);
                    p.fed_steps.fetch_add(u64::from(t.fed), Relaxed);
                    p.output_ns.fetch_add(nanos(applying, Instant::now()), Relaxed);
                    let step = nanos(start, Instant::now());
                    p.step_ns.fetch_add(step, Relaxed);
                    if t.graph {
                        if !overlapped {
                            p.graph_host_ns.fetch_add(step.saturating_sub(t.device_ns), Relaxed);
                            p.graph_host_steps.fetch_add(1, Relaxed);
                        }
                        if let Some(idle) = t.idle_ns {
                            p.graph_idle_ns.fetch_add(idle, Relaxed);
                            p.graph_idle_steps.fetch_add(1, Relaxed);
                        }
                    }
                    p.steps.fetch_add(1, Relaxed);
                }
                Err(e) if failures == act.failures => act.fail_all(e.to_string()),
                Err(e) => tracing::debug!(error = %e, "a step planned before a failure failed too"),
            }
            let before = act.in_flight;
            act.chained = true;
            act.maybe_step(ctx);
            act.chained = false;
            // A step planned here sends these events once the runner has it. With none
            // (nothing left to run, or every sequence's last token still pending in the
            // step in flight) they go now, not a step later.
            if act.in_flight == before {
                act.flush_events();
            }
        }));
    }
}

fn nanos(a: Instant, b: Instant) -> u64 {
    (b - a).as_nanos() as u64
}

/// A planned step on its way to the runner, once its blocks are reserved.
struct PlannedStep {
    seqs: Vec<ScheduledSeq>,
    /// `fresh[i]`: the runner does not hold sequence i yet (as planned: the plan already
    /// counts as launched).
    fresh: Vec<bool>,
    dropped: Vec<SeqId>,
    lora_loads: Vec<(usize, u64)>,
    copies: Vec<(BlockId, BlockId)>,
}

#[derive(Debug, thiserror::Error)]
enum StepError {
    #[error("block manager: {0}")]
    Blocks(BlockError),
    #[error("model runner: {0}")]
    Runner(String),
    #[error("actor mailbox: {0}")]
    Mailbox(String),
}

mod beam;
mod handlers;

use beam::BeamRun;

#[cfg(test)]
mod tests;
