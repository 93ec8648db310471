//! The ModelRunner's messages and their answers: a step ([`ExecuteBatch`]) and what it
//! returns, a tensor-parallel rank's share of one, the start-up requests, and how a step's
//! answer may wait for the next message ([`StepReply`]).

use std::sync::{Arc, Mutex};

use actix::dev::{MessageResponse, OneshotSender};
use actix::{Message, SyncContext};

use super::ModelRunner;
use crate::core::block_pool::{BlockId, SeqId};
use crate::kernels::attn::AttnMetadata;
use crate::kernels::{Device, DeviceError, GemmTuning};
use crate::models::lora::LoraAdapter;
use crate::request::{SamplingParams, TokenLogprobs};

/// State a sequence brings on its first step (or after a preemption).
#[derive(Debug, Clone)]
pub struct NewSeq {
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub params: Arc<SamplingParams>,
    pub seed: u64,
    /// Choice index within its request.
    pub index: usize,
}

/// One sequence's part of a step: its tokens `start..start + len`.
#[derive(Debug, Clone)]
pub struct BatchSeq {
    pub seq: SeqId,
    pub new: Option<NewSeq>,
    pub start: usize,
    pub len: usize,
    pub sample: bool,
    pub block_table: Vec<BlockId>,
    /// Adapter slot, -1 for the base model.
    pub lora_slot: i32,
}

/// One step. A step sent with `followed` (the Scheduler's) on a device that feeds sampled
/// tokens to the next step ([`Device::feeds_sampled_tokens`]) is answered only once the
/// next message has arrived and issued its own work, so that the device never waits for
/// the host between steps: its sender follows every such step with another message, an
/// [`ExecuteBatch::flush`] when it has no step to send.
#[derive(Message, Default)]
#[rtype(result = "Result<StepOutput, RunnerError>")]
pub struct ExecuteBatch {
    pub seqs: Vec<BatchSeq>,
    /// Sequences to forget before this step (finished, aborted, preempted).
    pub dropped: Vec<SeqId>,
    /// Adapters to place in slots before this step runs.
    pub lora_loads: Vec<(usize, Arc<LoraAdapter>)>,
    /// (source, destination) cache blocks copied before this step runs (forked beams).
    pub copies: Vec<(BlockId, BlockId)>,
    /// Whether the step was planned while the one before it ran or as soon as it ended
    /// (the scheduler had work throughout): the device's wait for it is then host overhead.
    pub follows: bool,
    /// Whether the sender sends another message after this one in any case: the runner
    /// may then answer this step when that message comes (see above).
    pub followed: bool,
}

impl ExecuteBatch {
    /// A message with no work: the runner answers the step before it.
    pub fn flush() -> Self {
        Self::default()
    }
}

#[derive(Debug, Clone)]
pub struct Sampled {
    pub seq: SeqId,
    pub token: u32,
    pub logprobs: Option<TokenLogprobs>,
}

#[derive(Debug, Default)]
pub struct StepOutput {
    pub sampled: Vec<Sampled>,
    /// Prompt logprobs computed by this step (`prompt_logprobs`).
    pub prompt_logprobs: Vec<PromptOutput>,
    pub timing: RunnerTiming,
}

/// A prompt token's logprob, at position `at` of sequence `seq`.
#[derive(Debug)]
pub struct PromptOutput {
    pub seq: SeqId,
    pub at: usize,
    pub logprob: crate::request::PromptLogprob,
}

/// Where a runner's step went, in nanoseconds.
#[derive(Debug, Default, Clone, Copy)]
pub struct RunnerTiming {
    /// Flat inputs and attention metadata built from the batch.
    pub prepare_ns: u64,
    /// The host issuing the forward and the logits (on the CPU: computing them).
    pub launch_ns: u64,
    /// Waiting for the device to finish them, and to sample: the sampler is issued behind
    /// the forward, with no wait in between, and its results come back in this time.
    pub device_ns: u64,
    /// Building the rows' sampling inputs, while the device runs the forward.
    pub sample_ns: u64,
    /// Of `sample_ns`: the grammar masks of the rows that follow one (structured output).
    pub mask_ns: u64,
    /// Device memory allocations the step made (none in steady state).
    pub device_allocs: u64,
    /// Whether the forward was a graph replay.
    pub graph: bool,
    /// Whether the step was issued before the tokens of the step before it were back on
    /// the host (the device put them in place).
    pub fed: bool,
    /// For a step that follows another: from the end of that step's work (its sampled
    /// tokens back on the host) to this forward's issue, the time the device sat idle; 0
    /// when it was issued before that step's tokens were back (fed on the device).
    pub idle_ns: Option<u64>,
}

/// Rank 0's flat inputs of one step, for the other ranks of a tensor-parallel group.
#[derive(Message, Clone)]
#[rtype(result = "Result<(), RunnerError>")]
pub struct ShardStep {
    pub ids: Arc<[u32]>,
    pub meta: Arc<AttnMetadata>,
    /// Adapters to place in slots first (each rank keeps its share of them).
    pub lora_loads: Vec<(usize, Arc<LoraAdapter>)>,
    /// Cache blocks copied first, as [`ExecuteBatch::copies`].
    pub copies: Arc<[(BlockId, BlockId)]>,
    /// Rows whose logits are computed after the forward, as the lead rank computes them
    /// for the prompt logprobs it reads back.
    pub prompt_rows: Arc<[usize]>,
}

/// Drops the KV cache and the sequences (after the profiling step) and answers the
/// device's (free, total) memory: what a cache may then take. None on the CPU; an error
/// when the device failed (a fault in the profiling step or a graph capture).
#[derive(Message)]
#[rtype(result = "Result<Option<(usize, usize)>, RunnerError>")]
pub struct ReleaseCache;

/// Times the device's GEMMs at these row counts and keeps the fastest algorithm of each
/// (`Device::tune_gemms`), after the profiling step has run every projection.
#[derive(Message, Clone)]
#[rtype(result = "Result<GemmTuning, RunnerError>")]
pub struct TuneGemms {
    pub rows: Vec<usize>,
}

/// Records decode steps as graphs (CUDA graphs) for every batch size of `sizes` and every
/// context bound of `bounds`; answers how many were recorded (none on a device without
/// graphs, or under tensor parallelism).
#[derive(Message, Clone)]
#[rtype(result = "Result<usize, RunnerError>")]
pub struct CaptureGraphs {
    pub sizes: Vec<usize>,
    pub bounds: Vec<usize>,
}

/// Allocates the KV cache anew with `num_blocks` blocks.
#[derive(Message)]
#[rtype(result = "Result<(), RunnerError>")]
pub struct AllocateCache {
    pub num_blocks: usize,
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum RunnerError {
    #[error("sequence {0} was never registered with the model runner")]
    UnknownSeq(SeqId),
    #[error("sequence {seq}: tokens {start}..{end} requested but it has {have}")]
    Range { seq: SeqId, start: usize, end: usize, have: usize },
    #[error("tensor-parallel rank {0} has stopped")]
    RankGone(usize),
    #[error("{0}")]
    Device(String),
}

impl From<DeviceError> for RunnerError {
    fn from(e: DeviceError) -> Self {
        RunnerError::Device(e.to_string())
    }
}

pub(super) type Answer = Result<StepOutput, RunnerError>;

/// Where a deferred step's answer goes: the sender actix hands [`StepReply`].
pub(super) type ReplySlot = Arc<Mutex<Option<OneshotSender<Answer>>>>;

/// A step's answer: now, or (`Later`) sent through the runner's reply slot once the next
/// message has issued its work, the step's tokens having stayed on the device meanwhile.
pub enum StepReply {
    Now(Answer),
    Later(ReplySlot),
}

impl<D: Device> MessageResponse<ModelRunner<D>, ExecuteBatch> for StepReply {
    fn handle(self, _: &mut SyncContext<ModelRunner<D>>, tx: Option<OneshotSender<Answer>>) {
        match self {
            StepReply::Now(answer) => {
                if let Some(tx) = tx {
                    let _ = tx.send(answer);
                }
            }
            StepReply::Later(slot) => {
                if let Ok(mut slot) = slot.lock() {
                    *slot = tx;
                }
            }
        }
    }
}
