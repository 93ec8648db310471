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

use std::ptr::null_mut;
use std::sync::Arc;

use cudarc::driver::CudaStream;
use cudarc::driver::sys::{CUgraph, CUgraphExec, CUgraphInstantiate_flags, CUstreamCaptureMode};

use super::{CudaDevice, CudaTensor, DevResult, DeviceError, cuda};
use crate::kernels::attn::AttnMetadata;

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
    graph: Recorded,
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
        let ids = self.stage_ids(ids)?;
        self.restage("embedding ids", ids);
        self.rope_positions(&meta.positions)?;
        self.restage_rope_rows(meta)?;
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
    ) -> DevResult<(Recorded, CudaTensor)> {
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
        // SAFETY: the stream is this device's, capturing since begin_capture above.
        let graph = unsafe { cudarc::driver::result::stream::end_capture(self.stream.cu_stream()) }
            .map_err(cuda("graph capture end"));
        let (hidden, graph) = (hidden?, graph?);
        if graph.is_null() {
            return Err(DeviceError::Other("the graph capture recorded nothing".into()));
        }
        let mut recorded = Recorded { graph, exec: std::ptr::null_mut(), stream: self.stream.clone() };
        if self.arch_number() >= 90 {
            // SAFETY: the graph was just captured and is not instantiated yet.
            unsafe { self.overlap_launches(graph) }.map_err(cuda("programmatic graph edges"))?;
        }
        // SAFETY: a complete graph, owned by `recorded`.
        recorded.exec =
            unsafe { cudarc::driver::result::graph::instantiate(graph, CUgraphInstantiate_flags(0)) }
                .map_err(cuda("graph instantiate"))?;
        // SAFETY: the executable graph and the stream are live.
        unsafe { cudarc::driver::result::graph::upload(recorded.exec, self.stream.cu_stream()) }
            .map_err(cuda("graph upload"))?;
        Ok((recorded, hidden))
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
        // SAFETY: the executable graph and the stream are live.
        unsafe { cudarc::driver::result::graph::launch(g.graph.exec, self.stream.cu_stream()) }
            .map_err(cuda("graph launch"))?;
        Ok(&g.hidden)
    }
}

/// A captured graph and its executable form.
struct Recorded {
    graph: CUgraph,
    exec: CUgraphExec,
    stream: Arc<CudaStream>,
}

impl Drop for Recorded {
    fn drop(&mut self) {
        // Destroying needs the context current; a failure leaves the objects to the context.
        if self.stream.context().bind_to_thread().is_err() {
            return;
        }
        // SAFETY: made by `record`, destroyed once, here.
        unsafe {
            if !self.exec.is_null() {
                let _ = cudarc::driver::result::graph::exec_destroy(self.exec);
            }
            let _ = cudarc::driver::result::graph::destroy(self.graph);
        }
    }
}

impl CudaDevice {
    /// The GPU's compute capability as a number (90 for sm_90).
    fn arch_number(&self) -> u32 {
        self.arch.trim_start_matches("sm_").parse().unwrap_or(0)
    }

    /// Turns the captured graph's edges into our kernels from other kernels programmatic
    /// (programmatic dependent launch, sm_90 and later): a kernel is launched as soon as
    /// every block of the one before it has begun, instead of once that one has finished,
    /// so that launch latency no longer separates the forward's hundreds of small
    /// kernels. Each of our kernels first waits for its predecessor to complete and its
    /// writes to land (`grid_dep_sync` in common.cuh), so ordering is as before; one whose
    /// PTX has no such wait (nvrtc.rs) keeps full dependencies, as do edges into cuBLAS's
    /// kernels and to or from other nodes.
    ///
    /// # Safety
    /// `graph` must be a live graph that is not being instantiated or launched.
    unsafe fn overlap_launches(&self, graph: CUgraph) -> Result<usize, cudarc::driver::DriverError> {
        use cudarc::driver::sys::{self, CUgraphEdgeData, CUgraphNode, CUgraphNodeType};
        let ours: std::collections::HashSet<sys::CUfunction> =
            self.funcs.values().filter(|(_, waits)| *waits).map(|(f, _)| f.cu_function()).collect();
        let mut n = 0usize;
        // SAFETY (the calls below): the caller's graph; buffers sized by the edge count.
        unsafe {
            sys::cuGraphGetEdges_v2(graph, null_mut(), null_mut(), null_mut(), &mut n).result()?;
            let (mut from, mut to) = (vec![null_mut(); n], vec![null_mut(); n]);
            let mut data = vec![std::mem::zeroed::<CUgraphEdgeData>(); n];
            sys::cuGraphGetEdges_v2(graph, from.as_mut_ptr(), to.as_mut_ptr(), data.as_mut_ptr(), &mut n)
                .result()?;
            let kernel = |node: CUgraphNode| -> Option<sys::CUfunction> {
                let mut ty = CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
                sys::cuGraphNodeGetType(node, &mut ty).result().ok()?;
                if ty != CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
                    return None;
                }
                let mut params = std::mem::zeroed::<sys::CUDA_KERNEL_NODE_PARAMS>();
                sys::cuGraphKernelNodeGetParams_v2(node, &mut params).result().ok()?;
                Some(params.func)
            };
            let programmatic = CUgraphEdgeData {
                from_port: sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8,
                to_port: 0,
                type_: sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8,
                reserved: [0; 5],
            };
            let mut changed = 0;
            for i in 0..n {
                let plain =
                    data[i].type_ == sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_DEFAULT as u8;
                let into_ours = kernel(to[i]).is_some_and(|f| ours.contains(&f));
                if plain && into_ours && kernel(from[i]).is_some() {
                    sys::cuGraphRemoveDependencies_v2(graph, &from[i], &to[i], &data[i], 1).result()?;
                    sys::cuGraphAddDependencies_v2(graph, &from[i], &to[i], &programmatic, 1).result()?;
                    changed += 1;
                }
            }
            Ok(changed)
        }
    }
}
