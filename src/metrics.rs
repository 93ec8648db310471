//! Engine metrics: lock-free counters and fixed-bucket histograms written by the Scheduler
//! and read by `/metrics` (Prometheus text, vLLM's names where they exist).

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

use crate::request::{AbortReason, FinishReason};

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0,
];

/// A Prometheus histogram over fixed buckets (seconds), updated without locks.
pub struct Histogram {
    counts: Vec<AtomicU64>,
    sum_micros: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    fn new() -> Self {
        Self {
            counts: LATENCY_BUCKETS.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }
    pub fn observe(&self, seconds: f64) {
        if let Some(i) = LATENCY_BUCKETS.iter().position(|&b| seconds <= b) {
            self.counts[i].fetch_add(1, Relaxed);
        }
        self.sum_micros.fetch_add((seconds * 1e6) as u64, Relaxed);
        self.count.fetch_add(1, Relaxed);
    }
    pub fn count(&self) -> u64 {
        self.count.load(Relaxed)
    }
    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (b, c) in LATENCY_BUCKETS.iter().zip(&self.counts) {
            cum += c.load(Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels}le=\"{b}\"}} {cum}");
        }
        let count = self.count.load(Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels}le=\"+Inf\"}} {count}");
        let _ = writeln!(
            out,
            "{name}_sum{{{}}} {}",
            labels.trim_end_matches(','),
            self.sum_micros.load(Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "{name}_count{{{}}} {count}", labels.trim_end_matches(','));
    }
}

pub struct Metrics {
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub requests_added: AtomicU64,
    pub finished_stop: AtomicU64,
    pub finished_length: AtomicU64,
    pub aborts_client: AtomicU64,
    pub aborts_cancelled: AtomicU64,
    pub aborts_engine: AtomicU64,
    pub aborts_slow: AtomicU64,
    pub preemptions: AtomicU64,
    /// Prompt tokens looked up in the prefix cache, and those found there.
    pub prefix_queries: AtomicU64,
    pub prefix_hits: AtomicU64,
    pub steps: AtomicU64,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    /// Where the engine's steps spend their time (`bench latency --breakdown`).
    pub profile: StepProfile,
    seed_state: AtomicU64,
}

/// Cumulative nanoseconds of each phase of the engine's steps, and the step count.
#[derive(Debug, Default)]
pub struct StepProfile {
    pub steps: AtomicU64,
    /// The whole step, from scheduling to the outputs handled.
    pub step_ns: AtomicU64,
    /// The Scheduler choosing the batch and building the runner's message.
    pub schedule_ns: AtomicU64,
    /// The BlockManager's reservation round trip.
    pub blocks_ns: AtomicU64,
    /// The ModelRunner's phases (see [`RunnerTiming`](crate::actors::model_runner::RunnerTiming)).
    pub prepare_ns: AtomicU64,
    pub launch_ns: AtomicU64,
    pub device_ns: AtomicU64,
    pub sample_ns: AtomicU64,
    /// Of `sample_ns`: computing grammar masks (structured output), while the device runs
    /// the forward.
    pub mask_ns: AtomicU64,
    /// The Scheduler applying the sampled tokens: detokenizing, stop checks, queueing events.
    pub output_ns: AtomicU64,
    /// Sending the queued events to the clients' streams: while the next step runs, not part
    /// of any step's time.
    pub events_ns: AtomicU64,
    /// Device memory allocations made by the steps (a count, not a time).
    pub device_allocs: AtomicU64,
    /// Steps whose forward was a CUDA graph replay.
    pub graph_steps: AtomicU64,
    /// Steps planned and sent while another was still running (`--async-scheduling`).
    pub pipelined_steps: AtomicU64,
    /// Tokens sampled for a sequence that had already stopped or been aborted (a step
    /// planned before that was known), and dropped.
    pub dropped_tokens: AtomicU64,
    /// Of those steps, the time not spent waiting for the device's forward (the host's
    /// share of a decode step; the sampling kernel's own time is in it). Only steps not
    /// planned while another ran count: the time of those includes the other's.
    pub graph_host_ns: AtomicU64,
    /// The steps `graph_host_ns` counts.
    pub graph_host_steps: AtomicU64,
    /// Of those steps, the ones that followed another without a pause in the work, and
    /// the device's idle time before their forwards (see `RunnerTiming::idle_ns`).
    pub graph_idle_steps: AtomicU64,
    pub graph_idle_ns: AtomicU64,
    /// Steps issued before the tokens of the step before them were back on the host: the
    /// device took them from that step's sampling itself.
    pub fed_steps: AtomicU64,
}

/// Per-step milliseconds of each phase between two snapshots of a [`StepProfile`].
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct StepBreakdown {
    pub steps: u64,
    pub step_ms: f64,
    pub schedule_ms: f64,
    pub blocks_ms: f64,
    pub prepare_ms: f64,
    pub launch_ms: f64,
    pub device_ms: f64,
    pub sample_ms: f64,
    /// Of `sample_ms`: grammar masks (structured output).
    pub mask_ms: f64,
    pub output_ms: f64,
    /// What is left: messages between the actors and waiting on their mailboxes.
    pub messaging_ms: f64,
    /// Device memory allocations over all these steps (none once every shape was seen).
    pub device_allocations: u64,
    /// Steps replayed from CUDA graphs.
    pub graph_steps: u64,
    /// Per graph-replayed (decode) step not planned while another ran: milliseconds not
    /// spent waiting for the forward (with `--async-scheduling` a step's time includes
    /// waiting for the one before, so those steps do not count).
    pub graph_host_ms: f64,
    /// Per graph-replayed step that followed another: milliseconds the device sat idle
    /// before its forward (from the last step's results read back to this forward's issue),
    /// the host's share of a step that no overlap hid.
    pub graph_idle_ms: f64,
    /// Per step: sending its events, while the next step runs.
    pub events_ms: f64,
    /// Steps planned and sent while another was still running (`--async-scheduling`).
    pub pipelined_steps: u64,
    /// Steps whose input tokens the device took from the step before's sampling, issued
    /// before the host had them.
    pub fed_steps: u64,
}

impl StepProfile {
    pub fn snapshot(&self) -> [u64; 19] {
        [
            &self.steps,
            &self.step_ns,
            &self.schedule_ns,
            &self.blocks_ns,
            &self.prepare_ns,
            &self.launch_ns,
            &self.device_ns,
            &self.sample_ns,
            &self.output_ns,
            &self.device_allocs,
            &self.graph_steps,
            &self.graph_host_ns,
            &self.events_ns,
            &self.pipelined_steps,
            &self.graph_idle_steps,
            &self.graph_idle_ns,
            &self.graph_host_steps,
            &self.fed_steps,
            &self.mask_ns,
        ]
        .map(|a| a.load(Relaxed))
    }

    /// The per-step breakdown of what happened between snapshots `a` and `b`.
    pub fn between(a: [u64; 19], b: [u64; 19]) -> StepBreakdown {
        let d: Vec<u64> = a.iter().zip(&b).map(|(x, y)| y - x).collect();
        let steps = d[0].max(1);
        let ms = |ns: u64| ns as f64 / steps as f64 / 1e6;
        let parts: u64 = d[2..9].iter().sum();
        StepBreakdown {
            steps: d[0],
            step_ms: ms(d[1]),
            schedule_ms: ms(d[2]),
            blocks_ms: ms(d[3]),
            prepare_ms: ms(d[4]),
            launch_ms: ms(d[5]),
            device_ms: ms(d[6]),
            sample_ms: ms(d[7]),
            mask_ms: ms(d[18]),
            output_ms: ms(d[8]),
            messaging_ms: ms(d[1].saturating_sub(parts)),
            device_allocations: d[9],
            graph_steps: d[10],
            graph_host_ms: d[11] as f64 / d[16].max(1) as f64 / 1e6,
            events_ms: ms(d[12]),
            pipelined_steps: d[13],
            graph_idle_ms: d[15] as f64 / d[14].max(1) as f64 / 1e6,
            fed_steps: d[17],
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Self {
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            requests_added: AtomicU64::new(0),
            finished_stop: AtomicU64::new(0),
            finished_length: AtomicU64::new(0),
            aborts_client: AtomicU64::new(0),
            aborts_cancelled: AtomicU64::new(0),
            aborts_engine: AtomicU64::new(0),
            aborts_slow: AtomicU64::new(0),
            preemptions: AtomicU64::new(0),
            prefix_queries: AtomicU64::new(0),
            prefix_hits: AtomicU64::new(0),
            steps: AtomicU64::new(0),
            ttft: Histogram::new(),
            itl: Histogram::new(),
            e2e: Histogram::new(),
            profile: StepProfile::default(),
            seed_state: AtomicU64::new(t),
        }
    }
}

/// The counters the periodic stats line is the difference of.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Totals {
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub prefix_queries: u64,
    pub prefix_hits: u64,
}

/// The state of the queue and the KV cache when the stats line is written.
#[derive(Debug, Clone, Copy)]
pub struct Load {
    pub running: usize,
    pub waiting: usize,
    /// Fraction of KV cache blocks in use.
    pub kv_usage: f64,
}

impl Metrics {
    pub fn totals(&self) -> Totals {
        Totals {
            prompt_tokens: self.prompt_tokens.load(Relaxed),
            generation_tokens: self.generation_tokens.load(Relaxed),
            prefix_queries: self.prefix_queries.load(Relaxed),
            prefix_hits: self.prefix_hits.load(Relaxed),
        }
    }
}

/// vLLM's periodic stats line over the `seconds` between `before` and `now`, or None when
/// the engine was idle all along (nothing came in or out and nothing is queued).
pub fn stats_line(before: Totals, now: Totals, seconds: f64, load: Load) -> Option<String> {
    if before == now && load.running == 0 && load.waiting == 0 {
        return None;
    }
    let rate = |a: u64, b: u64| (b - a) as f64 / seconds.max(1e-9);
    let queries = now.prefix_queries - before.prefix_queries;
    let hit_rate =
        if queries == 0 { 0.0 } else { (now.prefix_hits - before.prefix_hits) as f64 / queries as f64 };
    Some(format!(
        "Avg prompt throughput: {:.1} tokens/s, Avg generation throughput: {:.1} tokens/s, Running: {} reqs, \
         Waiting: {} reqs, KV cache usage: {:.1}%, Prefix cache hit rate: {:.1}%",
        rate(before.prompt_tokens, now.prompt_tokens),
        rate(before.generation_tokens, now.generation_tokens),
        load.running,
        load.waiting,
        100.0 * load.kv_usage,
        100.0 * hit_rate
    ))
}

/// A label value escaped as the Prometheus text format requires (`\\`, `\"`, `\n`).
pub fn label(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

impl Metrics {
    /// Seeds the sequence [`Self::random_seed`] draws from (`--seed`), so that requests
    /// that set no seed sample the same way from one run to the next.
    pub fn with_seed(self, seed: u64) -> Self {
        self.seed_state.store(seed, Relaxed);
        self
    }

    /// A fresh seed for a request that set none.
    pub fn random_seed(&self) -> u64 {
        let s = self.seed_state.fetch_add(0x9E37_79B9_7F4A_7C15, Relaxed);
        crate::sampling::uniform(s, 0, 0).to_bits()
    }
    pub fn on_request_added(&self, prompt_tokens: usize) {
        self.requests_added.fetch_add(1, Relaxed);
        self.prompt_tokens.fetch_add(prompt_tokens as u64, Relaxed);
    }
    pub fn on_step(&self, _tokens: usize, sampled: usize) {
        self.steps.fetch_add(1, Relaxed);
        self.generation_tokens.fetch_add(sampled as u64, Relaxed);
    }
    pub fn on_first_token(&self, arrival: Instant, now: Instant) {
        self.ttft.observe((now - arrival).as_secs_f64());
    }
    pub fn on_inter_token(&self, last: Instant, now: Instant) {
        self.itl.observe((now - last).as_secs_f64());
    }
    pub fn on_finish(&self, reason: FinishReason) {
        match reason {
            FinishReason::Stop => self.finished_stop.fetch_add(1, Relaxed),
            FinishReason::Length => self.finished_length.fetch_add(1, Relaxed),
            FinishReason::Abort => 0,
        };
    }
    pub fn on_request_done(&self, arrival: Instant, _first: Option<Instant>, _tokens: usize) {
        self.e2e.observe(arrival.elapsed().as_secs_f64());
    }
    pub fn on_abort(&self, reason: AbortReason) {
        match reason {
            AbortReason::ClientGone => &self.aborts_client,
            AbortReason::Cancelled => &self.aborts_cancelled,
            AbortReason::Engine => &self.aborts_engine,
            AbortReason::SlowClient => &self.aborts_slow,
        }
        .fetch_add(1, Relaxed);
    }
    pub fn on_preemptions(&self, n: usize) {
        self.preemptions.fetch_add(n as u64, Relaxed);
    }
    /// The scheduler's running totals of prefix-cache lookups.
    pub fn on_prefix_cache(&self, queries: u64, hits: u64) {
        self.prefix_queries.store(queries, Relaxed);
        self.prefix_hits.store(hits, Relaxed);
    }
    pub fn aborts(&self, reason: AbortReason) -> u64 {
        match reason {
            AbortReason::ClientGone => &self.aborts_client,
            AbortReason::Cancelled => &self.aborts_cancelled,
            AbortReason::Engine => &self.aborts_engine,
            AbortReason::SlowClient => &self.aborts_slow,
        }
        .load(Relaxed)
    }

    /// Prometheus text for the counters and histograms (gauges are added by the caller).
    pub fn render(&self, model: &str, out: &mut String) {
        let l = format!("model_name=\"{}\"", label(model));
        let counter = |out: &mut String, name: &str, help: &str, v: u64, extra: &str| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{{l}{extra}}} {v}");
        };
        counter(
            out,
            "vllm:prompt_tokens_total",
            "Prefill tokens processed.",
            self.prompt_tokens.load(Relaxed),
            "",
        );
        counter(
            out,
            "vllm:generation_tokens_total",
            "Generation tokens produced.",
            self.generation_tokens.load(Relaxed),
            "",
        );
        counter(
            out,
            "vllm:num_preemptions_total",
            "Sequences preempted (recompute).",
            self.preemptions.load(Relaxed),
            "",
        );
        counter(
            out,
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in prompt tokens looked up.",
            self.prefix_queries.load(Relaxed),
            "",
        );
        counter(
            out,
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in prompt tokens found cached.",
            self.prefix_hits.load(Relaxed),
            "",
        );
        let _ = writeln!(
            out,
            "# HELP vllm:request_success_total Finished requests by finish reason.\n# TYPE vllm:request_success_total counter"
        );
        let _ = writeln!(
            out,
            "vllm:request_success_total{{{l},finished_reason=\"stop\"}} {}",
            self.finished_stop.load(Relaxed)
        );
        let _ = writeln!(
            out,
            "vllm:request_success_total{{{l},finished_reason=\"length\"}} {}",
            self.finished_length.load(Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP actorllm:request_aborts_total Aborted requests by reason.\n# TYPE actorllm:request_aborts_total counter"
        );
        for r in
            [AbortReason::ClientGone, AbortReason::Cancelled, AbortReason::Engine, AbortReason::SlowClient]
        {
            let _ = writeln!(
                out,
                "actorllm:request_aborts_total{{{l},reason=\"{}\"}} {}",
                r.as_str(),
                self.aborts(r)
            );
        }
        let lbl = format!("{l},");
        self.ttft.render(out, "vllm:time_to_first_token_seconds", "Time to first token.", &lbl);
        self.itl.render(out, "vllm:inter_token_latency_seconds", "Time between tokens.", &lbl);
        self.e2e.render(out, "vllm:e2e_request_latency_seconds", "End-to-end request latency.", &lbl);
    }
}

#[cfg(test)]
mod tests {
    /// A served model name carrying a quote and a newline stays inside its label.
    #[test]
    fn label_values_are_escaped() {
        assert_eq!(super::label("a\"} 1\nforged{x=\"\\"), "a\\\"} 1\\nforged{x=\\\"\\\\");
        let mut out = String::new();
        super::Metrics::default().render("m\"\nx", &mut out);
        assert!(
            out.lines().all(|l| l.starts_with('#') || l.starts_with("vllm:") || l.starts_with("actorllm:"))
        );
    }
}
