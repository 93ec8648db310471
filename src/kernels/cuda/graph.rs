//! CUDA graphs for decode steps: a forward is recorded once per batch-size bucket and then
//! replayed with one launch, so the host no longer issues its hundreds of kernels.
//!
//! A graph holds device addresses, so everything it reads or writes must stay put:
//! - its inputs live in a second input set (`CudaDevice::inputs[1]`), sized by the first
//!   and largest capture and never moved after; a replay copies the step's ids and
//!   metadata into them first;
//! - its activations come from the graphs' pool, filled by a warm-up run of the same
//!   forward just before the capture; the capture itself allocates nothing. The graphs
//!   share that pool: they never run at the same time, and each replay writes its
//!   activations before reading them;
//! - its launch shapes may not depend on the step: attention is shaped for a context
//!   bound (the longest context a sequence may have), and its kernels skip what lies past
//!   each row's own context.

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};

use super::{CudaDevice, CudaTensor, DevResult, DeviceError, cuda};
use crate::models::attn::AttnMetadata;

/// Where a step's inputs go and whether a capture is recording.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum GraphMode {
    Off,
    /// Inputs go to the graphs' set; attention is shaped for `ctx_bound`.
    Staging {
        ctx_bound: usize,
    },
    /// As `Staging`, while the stream records: nothing is copied or allocated.
    Capturing {
        ctx_bound: usize,
    },
}

impl GraphMode {
    pub(super) fn ctx_bound(self) -> Option<usize> {
        match self {
            GraphMode::Off => None,
            GraphMode::Staging { ctx_bound } | GraphMode::Capturing { ctx_bound } => Some(ctx_bound),
        }
    }
}

/// A recorded forward of one batch size and context bound.
pub struct CudaGraphStep {
    graph: cudarc::driver::CudaGraph,
    /// The context bound its attention was shaped for.
    ctx_bound: usize,
    /// The hidden states the graph writes, `[rows, hidden]`.
    hidden: CudaTensor,
}

// SAFETY: as the device's: a graph is made, replayed and dropped by its ModelRunner's
// thread only; moving it between threads is allowed, using it from two at once is not.
unsafe impl Send for CudaGraphStep {}

impl CudaDevice {
    /// Copies a step's ids and metadata into the buffers its operations read (the same
    /// uploads the forward would make).
    fn stage_inputs(&self, ids: &[u32], meta: &AttnMetadata) -> DevResult<()> {
        let ids = self.stage("embedding ids", ids)?;
        self.restage("embedding ids", ids);
        self.rope_positions(&meta.positions)?;
        if !meta.lora_slots.is_empty() {
            self.upload_lora_slots(&meta.lora_slots)?;
        }
        // Decode rows never form tensor-core tiles, whatever the model.
        self.step_bufs(meta, false)
    }

    /// Records `forward` (run on inputs `ids` and `meta`, returning the hidden states) as a
    /// graph whose attention serves contexts up to `ctx_bound`.
    pub(super) fn capture(
        &self,
        ids: &[u32],
        meta: &AttnMetadata,
        ctx_bound: usize,
        forward: &mut dyn FnMut() -> DevResult<CudaTensor>,
    ) -> DevResult<CudaGraphStep> {
        if self.prof.is_some() {
            return Err(DeviceError::Other("CUDA graphs are off while kernels are profiled".into()));
        }
        let shared = self.pool.replace(self.graph_pool.clone());
        self.graph.set(GraphMode::Staging { ctx_bound });
        let result = self.record(ids, meta, ctx_bound, forward);
        self.graph.set(GraphMode::Off);
        self.pool.replace(shared);
        let (graph, hidden) = result?;
        self.graph_inputs_fixed.set(true);
        Ok(CudaGraphStep { graph, ctx_bound, hidden })
    }

    fn record(
        &self,
        ids: &[u32],
        meta: &AttnMetadata,
        ctx_bound: usize,
        forward: &mut dyn FnMut() -> DevResult<CudaTensor>,
    ) -> DevResult<(cudarc::driver::CudaGraph, CudaTensor)> {
        self.stage_inputs(ids, meta)?;
        // The warm-up fills the graph's pool (and sizes every other buffer) so that the
        // capture finds them all.
        drop(forward()?);
        self.stream.synchronize().map_err(cuda("stream synchronize"))?;
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(cuda("graph capture begin"))?;
        self.graph.set(GraphMode::Capturing { ctx_bound });
        let hidden = forward();
        self.graph.set(GraphMode::Staging { ctx_bound });
        // The capture ends whatever the forward did, so that the stream is usable again.
        let graph = self.stream.end_capture(CUgraphInstantiate_flags(0)).map_err(cuda("graph capture end"));
        let (hidden, graph) = (hidden?, graph?);
        let graph = graph.ok_or_else(|| DeviceError::Other("the graph capture recorded nothing".into()))?;
        graph.upload().map_err(cuda("graph upload"))?;
        Ok((graph, hidden))
    }

    /// Replays `g` on inputs `ids` and `meta` (shaped as at its capture) and returns its
    /// hidden states.
    pub(super) fn replay<'g>(
        &self,
        g: &'g CudaGraphStep,
        ids: &[u32],
        meta: &AttnMetadata,
    ) -> DevResult<&'g CudaTensor> {
        self.graph.set(GraphMode::Staging { ctx_bound: g.ctx_bound });
        let staged = self.stage_inputs(ids, meta);
        self.graph.set(GraphMode::Off);
        staged?;
        g.graph.launch().map_err(cuda("graph launch"))?;
        Ok(&g.hidden)
    }
}
