//! The CUDA device (cudarc, loaded dynamically so that the crate builds and runs without
//! CUDA): kernels are CUDA C sources in this folder compiled by NVRTC at start-up for the
//! device's architecture and cached on disk (keyed by source hash and architecture);
//! GEMMs go through cuBLAS, or cuBLASLt where its algorithm timed faster at start-up
//! (tune.rs). Activations are f32; 2-D weights stay in their dtype (f32, or
//! bf16/f16 multiplied by cublasGemmEx with f32 accumulation, the kernels that feed a GEMM
//! also writing their output in the weights' type, and a 16-bit MLP's gate/up projection
//! kept in that type for silu_mul), 1-D weights (norms, biases) are f32. A norm or SiLU·mul
//! output that only such a GEMM reads is written in the weights' type alone. Decode steps of
//! up to 8 rows run their projections on our own GEMV (gemv.cu), which also takes over the
//! small kernels around it: SiLU·mul, the residual add and RMSNorm (its 1/rms left to the
//! next GEMV), and RoPE with the cache write. Quantized weights stay packed (rows.rs):
//! the GEMVs read them as they are; larger steps widen them for cuBLAS, or, for FP8 rows
//! with one scale a row, run W8A8 through cuBLASLt (fp8_gemm.rs, fp8.cu).
//! The KV cache is f32 for an f32 model and the weights' type for a 16-bit one, written by
//! the RoPE kernel (or that GEMV); prefill and decode attention of 16-bit models run on
//! tensor cores (flash.cu). Sampling runs here too (sample.rs, sampling.cu), and so do
//! batched LoRA adapters (lora.rs, lora.cu); decode steps can be recorded as CUDA graphs
//! (graph.rs).
//! Every operation runs on the device's one stream; a failed one is a `DeviceError`.

use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

use super::{AttnShape, CacheShape, DType, DevResult, DeviceError, RopeSpec, TpRank};

mod attend;
mod fp8_gemm;
mod gemm;
mod graph;
mod lora;
mod moe;
mod nvrtc;
mod ops;
mod pool;
mod profile;
mod rope;
mod sample;
mod step;
mod tune;
pub mod wire;

use attend::KvKernels;
use gemm::{GateUpPath, push_outputs};
pub use graph::CudaGraphStep;
use graph::GraphMode;
pub use lora::CudaLora;
pub use moe::moe_on_tensor_cores;
use nvrtc::{COMMON, SOURCES};
use pool::{BufPool, PooledBuf};
use step::{Inputs, StepBufs};

fn err(e: impl std::fmt::Debug) -> DeviceError {
    DeviceError::Other(format!("{e:?}"))
}

/// A failed CUDA call (launch, copy, allocation, library call) as a [`DeviceError`] naming
/// what was being done.
fn cuda<E: std::fmt::Debug>(what: &'static str) -> impl FnOnce(E) -> DeviceError {
    move |e| DeviceError::Cuda { what, detail: format!("{e:?}") }
}

/// `[rows, cols]` f32 on the device. Its buffer may be longer than `rows · cols` (pooled
/// buffers come in power-of-two sizes). Tensors that feed a GEMM of 16-bit weights (norm,
/// SiLU·mul and attention outputs) also carry their values rounded to that type in `half`,
/// written by the same kernel, so the GEMM needs no conversion first.
pub struct CudaTensor {
    pub buf: PooledBuf,
    pub rows: usize,
    pub cols: usize,
    half: Option<Half>,
    /// The values are in `half` only and `buf` was not written: a norm or SiLU·mul output
    /// that only the GEMM (or GEMV) of a projection without adapters reads, through `half`
    /// (`Device::rms_norm_for_gemm`, `Device::gate_up_act`). `to_host` reads `half`.
    half_only: bool,
    /// A norm whose 1/rms is still to apply (`Device::linear_add_rms_norm`): `half` holds
    /// the norm's weights times the residual, and only the GEMV of the next projection
    /// (which scales its products) or `to_host` reads it.
    scale: Option<RowScale>,
}

/// What a norm left to the GEMV that reads it (gemv.cu's `NormScale`): row t of the tensor
/// is to be multiplied by rsqrt(Σ sums[t · parts .. (t + 1) · parts] / cols + eps).
struct RowScale {
    sums: PooledBuf,
    parts: usize,
    eps: f32,
}

/// 16-bit copy of a tensor's values: `kind` 1 is bf16, 2 is f16 (in f32-sized slots).
struct Half {
    buf: PooledBuf,
    kind: i32,
}

impl CudaTensor {
    /// The tensor's `rows · cols` values.
    pub fn view(&self) -> cudarc::driver::CudaView<'_, f32> {
        self.buf.slice(0..self.rows * self.cols)
    }

    /// Whether the values are kept in 16 bits only (see `half_only`).
    pub fn in_16_bits_only(&self) -> bool {
        self.half_only
    }

    /// An error where `buf` holds no values (`half_only`), for the operations that read it
    /// as f32 where only a projection's 16-bit GEMM is expected.
    fn f32_values(&self, what: &str) -> DevResult<()> {
        match self.half_only {
            true => Err(DeviceError::Other(format!("{what} was given values kept in 16 bits only"))),
            false => Ok(()),
        }
    }

    /// An error where a norm's scale is still to apply (`scale`), for the GEMMs that can
    /// not apply it: only the GEMV does.
    fn final_values(&self, what: &str) -> DevResult<()> {
        match self.scale {
            Some(_) => {
                Err(DeviceError::Other(format!("{what} was given a norm whose scale only a GEMV applies")))
            }
            None => Ok(()),
        }
    }
}

/// A weight on the device; 16-bit types are kept as raw bits, 4-bit rows as their bytes
/// (kernels/int4.rs's layout).
pub enum WeightBuf {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
    F16(CudaSlice<u16>),
    /// Packed rows (kernels/rows.rs); for FP8 rows with one scale a row on a GPU with FP8
    /// tensor cores, those scales again as one vector, for the W8A8 GEMM (fp8_gemm.rs).
    Rows {
        buf: CudaSlice<u8>,
        format: crate::kernels::rows::RowFormat,
        scales: Option<CudaSlice<f32>>,
    },
}

pub struct CudaWeight {
    pub shape: Vec<usize>,
    pub buf: WeightBuf,
}

impl CudaWeight {
    /// The f32 buffer of a 1-D weight (norms and biases are always uploaded as f32).
    fn f32(&self) -> &CudaSlice<f32> {
        match &self.buf {
            WeightBuf::F32(b) => b,
            _ => unreachable!("1-D weights are uploaded as f32"),
        }
    }
}

/// One layer's K and V cache: f32, the 16-bit type of a 16-bit model's weights (half the
/// bytes for attention to read), or e4m3 bytes (--kv-cache-dtype fp8).
pub struct CudaCache {
    pub shape: CacheShape,
    k: KvBuf,
    v: KvBuf,
    /// The attention kernels for the cache's element type.
    kernels: KvKernels,
    /// What K and V are divided by as they are stored (an FP8 cache's per-layer scales).
    scales: crate::kernels::KvScales,
}

enum KvBuf {
    F32(CudaSlice<f32>),
    Half(CudaSlice<u16>),
    Fp8(CudaSlice<u8>),
}

impl KvBuf {
    fn is_half(&self) -> bool {
        matches!(self, KvBuf::Half(_))
    }

    /// Whether prefill attention over this cache is flash.cu's flash_prefill_pipe (16-bit
    /// and FP8 caches; an f32 one is staged through registers).
    fn prefill_piped(&self) -> bool {
        !matches!(self, KvBuf::F32(_))
    }

    fn arg(&mut self) -> &mut dyn WeightArg {
        match self {
            KvBuf::F32(b) => b,
            KvBuf::Half(b) => b,
            KvBuf::Fp8(b) => b,
        }
    }
}

pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    /// The GEMM workspace, cuBLASLt, and the algorithms tuned per shape (tune.rs).
    gemms: tune::Gemms,
    /// Each kernel, and whether it waits for the one before it (graph.rs launches only
    /// those early).
    funcs: std::collections::HashMap<String, (CudaFunction, bool)>,
    arch: String,
    /// Whether the GPU has mma.sync for bf16 (sm_80 and later): tensor-core prefill.
    sm80: bool,
    /// The most query heads a flash_prefill block takes on this GPU (its shared memory).
    prefill_heads_max: usize,
    /// Warps (partitions of a row) flash_decode_join's blocks take at most: as many as the
    /// GPU's shared memory holds, up to `attend::DECODE_JOIN_WARPS`.
    decode_join_warps: usize,
    /// The GPU's multiprocessors.
    sms: usize,
    /// A step's inputs on the device: eager steps' (0) and CUDA graphs' (1), which never
    /// move once a graph has been captured (see `graph.rs`).
    inputs: [Inputs; 2],
    /// Whether inputs go to the graphs' set, and whether a capture is recording.
    graph: std::cell::Cell<GraphMode>,
    /// The graphs' input buffers are sized (by the first, largest capture) and may not move.
    graph_inputs_fixed: std::cell::Cell<bool>,
    /// The rotary inverse frequencies, uploaded on first use.
    /// Each rotary embedding's frequencies on the device (a model may have several: Gemma
    /// 3's sliding and global layers), uploaded at their first use.
    inv_freq: std::cell::RefCell<Vec<(Vec<f32>, CudaSlice<f32>)>>,
    /// The NCCL communicator of a tensor-parallel group, with this device's rank.
    comm: Option<cudarc::nccl::Comm>,
    /// Where the group spans nodes: its health, polled while the host waits on the device
    /// (a rank on a lost node never joins the collective this GPU waits in), and on rank 0
    /// the other nodes' ranks.
    node: Option<NodeLink>,
    tp: TpRank,
    /// Where activation buffers come from: the device's pool, or a graph's own while it is
    /// captured.
    pool: std::cell::RefCell<Arc<BufPool>>,
    /// The CUDA graphs' activation buffers (see `graph.rs`).
    graph_pool: Arc<BufPool>,
    /// Activations rounded to 16 bits for the GEMMs of 16-bit weights, grown as needed.
    scratch16: std::cell::RefCell<Option<CudaSlice<u16>>>,
    /// A 4-bit weight widened to 16 bits for a prompt's GEMM (`widen_int4`), sized at
    /// upload for the largest such weight, so that it never moves under a CUDA graph.
    widened: std::cell::RefCell<Option<CudaSlice<u16>>>,
    /// W8A8 GEMMs of FP8 rows (fp8_gemm.rs), on GPUs with FP8 tensor cores where cuBLASLt
    /// is present.
    fp8: Option<fp8_gemm::Fp8Gemms>,
    /// x quantized to FP8 for them.
    fp8_x: fp8_gemm::Fp8Scratch,
    /// GPU time per operation, when `ACTORLLM_PROFILE_KERNELS` asks for it.
    prof: Option<profile::Profiler>,
    /// The 16-bit type of the 2-D weights (1 bf16, 2 f16; 0 for f32): activations that feed
    /// GEMMs are also written in it.
    act16: std::cell::Cell<i32>,
    /// Whether the KV caches allocated are FP8 (--kv-cache-dtype fp8).
    kv_fp8: std::cell::Cell<bool>,
    /// Prefill attention on tensor cores: by default for 16-bit models on sm_80 and later.
    tensor_core_attention: std::cell::Cell<Option<bool>>,
    /// Whether the last attention's decode rows went to flash_decode.
    decode_on_tensor_cores: std::cell::Cell<bool>,
    /// Set once an attention with options (a sliding window, a soft cap) has run that the
    /// flash kernels cannot take (not on tensor cores, or another head size): from then on
    /// every attention of the device takes the one-block-per-head kernel, which honours
    /// them, so that a step's metadata serves all its layers alike.
    plain_attention: std::cell::Cell<bool>,
    /// Whether flash_decode's blocks joined the last attention's partitions themselves.
    decode_joined: std::cell::Cell<bool>,
    /// The model's attention shape, from its first attention call: step inputs staged for
    /// a graph replay are shaped by it without an attention call.
    attn_shape: std::cell::Cell<Option<AttnShape>>,
    /// Whether the last `linear_lora` wrote the adapters' deltas before the projection.
    lora_deltas_first: std::cell::Cell<bool>,
    /// How the last `gate_up_act` ran.
    gate_up_path: std::cell::Cell<GateUpPath>,
    /// Whether the last `linear_add_rms_norm` left its norm's scale to the next GEMV.
    norm_in_gemv: std::cell::Cell<bool>,
    /// Whether the last `project_qkv_attention` projected with RoPE in one GEMV.
    qkv_on_gemv: std::cell::Cell<bool>,
    /// Device buffers allocated so far (`Device::allocations`).
    allocs: std::cell::Cell<u64>,
    /// Where adapter weights are carved from (lora.rs).
    lora_arena: std::cell::RefCell<lora::LoraArena>,
    /// Samplings issued and not yet collected, and the host buffers their results go to.
    sampled: std::cell::RefCell<sample::SampledHost>,
}

/// A rank's link to a group that spans nodes ([`CudaDevice::in_node_group`]).
struct NodeLink {
    health: Arc<dyn super::GroupHealth>,
    remote: Option<Arc<dyn super::RemoteRanks>>,
}

// SAFETY: the device is used from its ModelRunner's thread only (the context is bound
// there); cudarc's handles are thread-safe to move.
unsafe impl Send for CudaDevice {}
impl Unpin for CudaDevice {}

impl CudaDevice {
    /// Opens GPU `ordinal`, compiles (or loads cached) kernels for its architecture.
    pub fn new(ordinal: usize) -> Result<Self, DeviceError> {
        Self::open(CudaContext::new(ordinal).map_err(err)?, None)
    }

    /// The GPUs `0..world` as one tensor-parallel group joined by NCCL (loaded dynamically:
    /// libnccl.so must be on the loader path).
    pub fn group(world: usize) -> Result<Vec<Self>, DeviceError> {
        if world == 1 {
            return Ok(vec![Self::new(0)?]);
        }
        let count = Self::count();
        if world > count {
            return Err(DeviceError::Other(format!(
                "--tensor-parallel-size {world} needs {world} GPUs, this machine has {count}"
            )));
        }
        Self::need_nccl()?;
        let ctxs = (0..world).map(CudaContext::new).collect::<Result<Vec<_>, _>>().map_err(err)?;
        let streams = ctxs.iter().map(|c| c.default_stream()).collect();
        let comms = cudarc::nccl::Comm::from_devices(streams).map_err(err)?;
        ctxs.into_iter().zip(comms).map(|(ctx, comm)| Self::open(ctx, Some(comm))).collect()
    }

    /// GPUs `0..local` of this node as ranks `first_rank..first_rank + local` of a
    /// tensor-parallel group of `world` ranks that spans nodes, joined by the NCCL unique id
    /// node 0 made (`nccl_id`, its 128 bytes). Returns once every rank of the group has
    /// joined.
    pub fn node_group(
        first_rank: usize,
        local: usize,
        world: usize,
        nccl_id: &[u8],
    ) -> Result<Vec<Self>, DeviceError> {
        Self::node_fits(local)?;
        let id: [std::ffi::c_char; 128] = nccl_id
            .iter()
            .map(|&b| b as std::ffi::c_char)
            .collect::<Vec<_>>()
            .try_into()
            .map_err(|_| DeviceError::Other(format!("an NCCL id of {} bytes, not 128", nccl_id.len())))?;
        let id = cudarc::nccl::Id::uninit(id);
        let ctxs = (0..local).map(CudaContext::new).collect::<Result<Vec<_>, _>>().map_err(err)?;
        // Several ranks of one thread join inside one NCCL group: none waits for the next.
        cudarc::nccl::group_start().map_err(err)?;
        let comms: Vec<_> = ctxs
            .iter()
            .enumerate()
            .map(|(i, ctx)| {
                ctx.bind_to_thread().map_err(err)?;
                cudarc::nccl::Comm::from_rank(ctx.default_stream(), first_rank + i, world, id).map_err(err)
            })
            .collect();
        cudarc::nccl::group_end().map_err(err)?;
        let comms = comms.into_iter().collect::<Result<Vec<_>, _>>()?;
        ctxs.into_iter().zip(comms).map(|(ctx, comm)| Self::open(ctx, Some(comm))).collect()
    }

    /// Whether this machine can run `local` ranks of a group that spans nodes: as many
    /// GPUs, and NCCL. Checked before a node joins the others, whose NCCL start would wait
    /// for ranks that never come.
    pub fn node_fits(local: usize) -> Result<(), DeviceError> {
        let count = Self::count();
        if local > count {
            return Err(DeviceError::Other(format!(
                "each node runs {local} ranks (--tensor-parallel-size / --nnodes), one per GPU: \
                 this machine has {count}"
            )));
        }
        Self::need_nccl()
    }

    /// A fresh NCCL unique id (node 0 of a group that spans nodes hands it to the others).
    pub fn nccl_id() -> Result<Vec<u8>, DeviceError> {
        Self::need_nccl()?;
        let id = cudarc::nccl::Id::new().map_err(err)?;
        // c_char is i8 on x86-64 and u8 on aarch64.
        #[allow(clippy::unnecessary_cast)]
        Ok(id.internal().iter().map(|&c| c as u8).collect())
    }

    fn need_nccl() -> Result<(), DeviceError> {
        // SAFETY: only tries to open the library.
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            return Err(DeviceError::Other(
                "tensor parallelism on GPUs needs NCCL: libnccl.so was not found on the loader path \
                 (set LD_LIBRARY_PATH to the folder holding it)"
                    .into(),
            ));
        }
        Ok(())
    }

    /// This rank in a group that spans nodes: `health` is polled while the host waits on
    /// the device; on rank 0, `remote` sends each step to the other nodes.
    pub fn in_node_group(
        mut self,
        health: Arc<dyn super::GroupHealth>,
        remote: Option<Arc<dyn super::RemoteRanks>>,
    ) -> Self {
        self.node = Some(NodeLink { health, remote });
        self
    }

    /// Waits until the work queued on the stream so far is done. In a group that spans
    /// nodes it polls, so that a failed group (a node lost while this GPU waits in one of
    /// its collectives) ends the wait with its reason instead of hanging; elsewhere it
    /// blocks.
    fn wait_queued(&self, what: &'static str) -> DevResult<()> {
        if self.node.is_none() {
            return self.stream.synchronize().map_err(cuda(what));
        }
        let event = self.ctx.new_event(None).map_err(cuda("event"))?;
        event.record(&self.stream).map_err(cuda("event record"))?;
        self.wait_event(&event, what)
    }

    /// Waits for `event` as [`Self::wait_queued`] waits for the stream.
    fn wait_event(&self, event: &cudarc::driver::CudaEvent, what: &'static str) -> DevResult<()> {
        let Some(node) = &self.node else {
            return event.synchronize().map_err(cuda(what));
        };
        loop {
            if event.try_is_complete().map_err(cuda(what))? {
                return Ok(());
            }
            if let Some(why) = node.health.failure() {
                return Err(DeviceError::Other(format!("the tensor-parallel group has failed: {why}")));
            }
            std::thread::yield_now();
        }
    }

    /// How many CUDA GPUs the driver sees (0 without a driver).
    pub fn count() -> usize {
        if !Self::available() {
            return 0;
        }
        CudaContext::device_count().map_or(0, |n| n as usize)
    }

    fn open(ctx: Arc<CudaContext>, comm: Option<cudarc::nccl::Comm>) -> Result<Self, DeviceError> {
        let tp = comm.as_ref().map_or(TpRank::SINGLE, |c| TpRank { rank: c.rank(), world: c.world_size() });
        // Every operation of this device runs on its one stream, in order: cudarc's
        // cross-stream events (two created and destroyed per allocation) buy nothing here.
        // SAFETY: no buffer of this context is used from another stream.
        unsafe { ctx.disable_event_tracking() };
        // A stream of its own (graphs can not be captured on the legacy default stream); a
        // tensor-parallel rank stays on the stream its NCCL communicator was made with.
        let stream = match comm {
            Some(_) => ctx.default_stream(),
            None => ctx.new_stream().map_err(err)?,
        };
        let blas = CudaBlas::new(stream.clone()).map_err(err)?;
        let gemms = tune::Gemms::new(&stream, &blas)?;
        let (major, minor) = ctx.compute_capability().map_err(err)?;
        let arch = format!("sm_{major}{minor}");
        let mut funcs = std::collections::HashMap::new();
        for (name, src) in SOURCES {
            let ptx = nvrtc::compile(name, &format!("{COMMON}\n{src}"), &arch)?;
            let entries = nvrtc::entry_points(&ptx.to_src());
            let module = ctx.load_module(ptx).map_err(err)?;
            for (k, waits) in entries {
                if !waits {
                    tracing::warn!(kernel = %k, "kernel does not wait for the one before it (grid_dep_sync): CUDA graphs keep full dependencies into it");
                }
                let f = module.load_function(&k).map_err(err)?;
                funcs.insert(k, (f, waits));
            }
        }
        let (prefill_heads_max, decode_join_warps) = attend::allow_flash_smem(&ctx, &funcs)?;
        let sms = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(err)? as usize;
        let prof = profile::Profiler::from_env(&ctx);
        let fp8 = (fp8_gemm::has_fp8_mma(major, minor) && gemms.lt().is_some())
            .then(fp8_gemm::Fp8Gemms::new)
            .flatten();
        Ok(Self {
            ctx,
            stream,
            blas,
            gemms,
            funcs,
            sm80: major >= 8,
            prefill_heads_max,
            decode_join_warps,
            sms,
            arch,
            inputs: Default::default(),
            graph: std::cell::Cell::new(GraphMode::Off),
            graph_inputs_fixed: std::cell::Cell::new(false),
            inv_freq: std::cell::RefCell::new(Vec::new()),
            comm,
            node: None,
            tp,
            pool: std::cell::RefCell::new(Arc::default()),
            graph_pool: Arc::new(BufPool::unbounded()),
            scratch16: std::cell::RefCell::new(None),
            widened: std::cell::RefCell::new(None),
            fp8,
            fp8_x: std::cell::RefCell::new(None),
            prof,
            act16: std::cell::Cell::new(0),
            kv_fp8: std::cell::Cell::new(false),
            tensor_core_attention: std::cell::Cell::new(None),
            decode_on_tensor_cores: std::cell::Cell::new(false),
            plain_attention: std::cell::Cell::new(false),
            decode_joined: std::cell::Cell::new(false),
            attn_shape: std::cell::Cell::new(None),
            lora_deltas_first: std::cell::Cell::new(false),
            gate_up_path: std::cell::Cell::new(GateUpPath::F32),
            norm_in_gemv: std::cell::Cell::new(false),
            qkv_on_gemv: std::cell::Cell::new(false),
            allocs: std::cell::Cell::new(0),
            lora_arena: std::cell::RefCell::default(),
            sampled: std::cell::RefCell::default(),
        })
    }

    /// Whether a CUDA driver and a GPU are present.
    pub fn available() -> bool {
        // SAFETY: only tries to open the driver library; nothing is called through it yet.
        let present = unsafe { cudarc::driver::sys::is_culib_present() };
        present && CudaContext::device_count().is_ok_and(|n| n > 0)
    }

    /// Whether GPU 0 is one vLLM gives its larger batch defaults: 70 GiB of memory or more,
    /// and not an A100 (false when it can not be asked).
    pub fn large_gpu() -> bool {
        use cudarc::driver::result::{self, device};
        if !Self::available() {
            return false; // no driver to ask (`--device cuda` then fails as it opens the GPU)
        }
        let Ok(dev) = result::init().and_then(|_| device::get(0)) else { return false };
        // SAFETY: `dev` is a device handle the driver just returned.
        let big = unsafe { device::total_mem(dev) }.is_ok_and(|b| b >= 70 << 30);
        big && device::get_name(dev).is_ok_and(|n| !n.contains("A100"))
    }

    /// Whether the last projection with adapters wrote their deltas first and let its GEMM
    /// add itself to them (`Device::linear_lora`), rather than adding them after.
    pub fn lora_deltas_first(&self) -> bool {
        self.lora_deltas_first.get()
    }

    /// Whether the last `Device::gate_up_act` wrote the projection in the weights' 16-bit
    /// type for silu_mul to read, rather than in f32.
    pub fn gate_up_in_16_bits(&self) -> bool {
        self.gate_up_path.get() == GateUpPath::In16Bits
    }

    /// Whether the last `Device::linear_add_rms_norm` was one GEMV that left the norm's
    /// scale to the GEMV of the next projection (no norm kernel).
    pub fn norm_left_to_gemv(&self) -> bool {
        self.norm_in_gemv.get()
    }

    /// Whether the last `Device::project_qkv_attention` projected in one GEMV that applied
    /// RoPE and wrote k and v into the cache (no projection written, no RoPE kernel).
    pub fn qkv_rope_on_gemv(&self) -> bool {
        self.qkv_on_gemv.get()
    }

    /// Whether the last `Device::gate_up_act` was one GEMV that applied act·mul itself,
    /// writing no projection.
    pub fn gate_up_on_gemv(&self) -> bool {
        self.gate_up_path.get() == GateUpPath::Gemv
    }

    /// An uninitialized 16-bit copy for a `[rows, cols]` output when GEMMs take 16-bit
    /// inputs, with the kernels' `kind` argument (0: none).
    fn half(&self, rows: usize, cols: usize) -> DevResult<(Option<Half>, i32)> {
        Ok(match self.act16.get() {
            0 => (None, 0),
            kind => (Some(Half { buf: self.tensor((rows * cols).div_ceil(2), 1)?.buf, kind }), kind),
        })
    }

    /// The index of `rope`'s frequencies in `self.inv_freq`, uploaded if they are new (a
    /// rotation-less `rope` gets one unread value: buffers are never empty).
    fn inv_freq(&self, rope: &RopeSpec) -> DevResult<usize> {
        if let Some(i) = self.inv_freq.borrow().iter().position(|(h, _)| *h == rope.inv_freq) {
            return Ok(i);
        }
        let dev = self.htod(if rope.inv_freq.is_empty() { &[0.0] } else { &rope.inv_freq[..] })?;
        let mut all = self.inv_freq.borrow_mut();
        all.push((rope.inv_freq.clone(), dev));
        Ok(all.len() - 1)
    }

    /// RMSNorm of each row, after `residual += x` when a residual is given (the kernel
    /// then normalizes the sum and writes it back to the residual); with `half_only`, in
    /// the 16-bit copy alone where there is one.
    fn norm(
        &self,
        x: &CudaTensor,
        residual: Option<&mut CudaTensor>,
        w: &CudaWeight,
        eps: f32,
        half_only: bool,
    ) -> DevResult<CudaTensor> {
        self.norm_of(x, None, residual, (w, eps), half_only)
    }

    /// Whether [`Self::norm_of`] can norm x first within the kernel: rows of float4s that
    /// its threads hold in registers (NORM_VECS of them each).
    fn norms_twice(cols: usize) -> bool {
        cols.is_multiple_of(4) && cols / 4 <= 4 * Self::norm_threads(cols) as usize
    }

    /// Two float4s a thread (rows up to 8,192 values; past them up to 1,024 threads). At
    /// one, the 8B model's block of 1,024 threads at 48 registers needs 48 Ki of an SM's
    /// 64 Ki registers, more than an SM running a 16-warp GEMV block (or two 8-warp ones)
    /// has free, so PDL can not launch it beside them; its sum also spans 32 warps. On
    /// the H200, batch 1 4.26 / 4.23 ms → 4.16 / 4.18 (four a thread: 4.20 / 4.20).
    fn norm_threads(cols: usize) -> u32 {
        (cols.div_ceil(8).div_ceil(32) * 32).clamp(32, 1024) as u32
    }

    /// [`Self::norm`], with x first normed itself by `pre` (weights, eps) where given
    /// ([`Self::norms_twice`] must hold then).
    fn norm_of(
        &self,
        x: &CudaTensor,
        pre: Option<(&CudaWeight, f32)>,
        residual: Option<&mut CudaTensor>,
        (w, eps): (&CudaWeight, f32),
        half_only: bool,
    ) -> DevResult<CudaTensor> {
        let mut out = self.tensor(x.rows, x.cols)?;
        let (mut half, kind) = self.half(x.rows, x.cols)?;
        let half_only = half_only && half.is_some();
        let cols = x.cols as i32;
        let name = match (pre.is_some(), residual.is_some()) {
            (true, _) => "rms_norm_add_rms_norm",
            (false, true) => "add_rms_norm",
            (false, false) => "rms_norm",
        };
        let _t = self.span(name, (0, 0), x.rows);
        let mut launch = self.stream.launch_builder(self.f("rms_norm_f32"));
        launch.arg(&*x.buf);
        let use_res = i32::from(residual.is_some());
        match residual {
            Some(r) => launch.arg(&mut *r.buf),
            // Not written when use_residual is 0: x's buffer only fills the slot.
            None => launch.arg(&*x.buf),
        };
        launch.arg(&use_res).arg(w.f32());
        let null = 0u64;
        let pre_eps = pre.map_or(0.0, |p| p.1);
        match pre {
            Some((pw, _)) if Self::norms_twice(x.cols) => launch.arg(pw.f32()),
            Some(_) => {
                return Err(DeviceError::Other(format!("a row of {} can not be normed twice", x.cols)));
            }
            None => launch.arg(&null),
        };
        launch.arg(&pre_eps);
        push_outputs(&mut launch, &mut out, &mut half, &kind, half_only);
        let threads = Self::norm_threads(x.cols);
        let cfg =
            LaunchConfig { grid_dim: (x.rows as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: x, out (and the residual) are [rows, cols]; w holds cols values; half (when
        // kind is not 0) holds rows·cols 16-bit values.
        unsafe { launch.arg(&cols).arg(&eps).launch(cfg) }.map_err(cuda("rms_norm launch"))?;
        out.half = half;
        out.half_only = half_only;
        Ok(out)
    }

    /// Times the operation issued until the span drops (profiling only).
    fn span(&self, name: &'static str, nk: (usize, usize), rows: usize) -> Option<profile::Span<'_>> {
        // Events can not be read back from inside a graph.
        let capturing = matches!(self.graph.get(), GraphMode::Capturing { .. });
        self.prof.as_ref().filter(|_| !capturing).and_then(|p| p.span(&self.stream, name, nk, rows))
    }

    pub fn arch(&self) -> &str {
        &self.arch
    }

    fn f(&self, name: &str) -> &CudaFunction {
        // Every entry point of the sources is loaded: a name missing here is misspelled.
        &self.funcs.get(name).unwrap_or_else(|| panic!("no kernel {name} in the CUDA sources")).0
    }

    /// Rounds activations feeding GEMMs (and KV caches allocated after this) to `dtype`, as
    /// loading 16-bit weights does; F32 turns it off (tests).
    pub fn set_activation_dtype(&self, dtype: DType) {
        self.act16.set(match dtype {
            DType::BF16 => 1,
            DType::F16 => 2,
            _ => 0,
        });
    }

    /// An uninitialized activation tensor: every kernel and GEMM that makes one writes all
    /// of it, so it is not cleared first.
    fn tensor(&self, rows: usize, cols: usize) -> DevResult<CudaTensor> {
        let len = (rows * cols).max(1).next_power_of_two();
        let pool = self.pool.borrow().clone();
        let slice = match pool.take(len) {
            Some(s) => s,
            // A capture runs after a warm-up of the same forward: its buffers are all there.
            None if matches!(self.graph.get(), GraphMode::Capturing { .. }) => {
                return Err(DeviceError::Other("graph capture needed a buffer its warm-up did not".into()));
            }
            // SAFETY: callers write every element before anything reads it.
            None => unsafe { self.uninit::<f32>(len) }?,
        };
        let buf = PooledBuf { slice: std::mem::ManuallyDrop::new(slice), pool: Some(pool) };
        Ok(CudaTensor { buf, rows, cols, half: None, half_only: false, scale: None })
    }

    /// A new zeroed device buffer. Every allocation goes through this, [`Self::uninit`] or
    /// [`Self::htod`], which count them (see `Device::allocations`).
    fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> DevResult<CudaSlice<T>> {
        self.allocs.set(self.allocs.get() + 1);
        self.stream.alloc_zeros(n).map_err(cuda("device allocation"))
    }

    /// A new device buffer left uninitialized.
    ///
    /// # Safety
    /// Nothing may read an element before it is written.
    unsafe fn uninit<T: cudarc::driver::DeviceRepr>(&self, n: usize) -> DevResult<CudaSlice<T>> {
        self.allocs.set(self.allocs.get() + 1);
        // SAFETY: the caller's contract.
        unsafe { self.stream.alloc(n) }.map_err(cuda("device allocation"))
    }

    /// A new device buffer holding `v`.
    fn htod<T: cudarc::driver::DeviceRepr>(&self, v: &[T]) -> DevResult<CudaSlice<T>> {
        self.allocs.set(self.allocs.get() + 1);
        self.stream.clone_htod(v).map_err(cuda("host to device copy"))
    }

    /// Uploads 16-bit elements, straight from `bytes` when they are 2-byte aligned (the
    /// memory-mapped checkpoint's are).
    fn upload_u16(&self, bytes: &[u8]) -> DevResult<CudaSlice<u16>> {
        match bytemuck::try_cast_slice::<u8, u16>(bytes) {
            Ok(v) => self.htod(v),
            Err(_) => self.htod(&bytemuck::pod_collect_to_vec::<u8, u16>(bytes)),
        }
    }

    /// Copies host f32 data into a new device tensor (tests and benchmarks).
    pub fn from_host(&self, data: &[f32], rows: usize, cols: usize) -> DevResult<CudaTensor> {
        let slice = self.htod(data)?;
        Ok(CudaTensor {
            buf: PooledBuf { slice: std::mem::ManuallyDrop::new(slice), pool: None },
            rows,
            cols,
            half: None,
            half_only: false,
            scale: None,
        })
    }

    fn grid(n: usize) -> LaunchConfig {
        LaunchConfig { grid_dim: (n.div_ceil(256) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
    }

    fn rows(rows: usize) -> LaunchConfig {
        LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
    }
}

/// Pushes a weight buffer of any dtype as a kernel argument.
trait WeightArg {
    fn push<'a>(&'a self, launch: &mut cudarc::driver::LaunchArgs<'a>);
}

impl<T> WeightArg for CudaSlice<T> {
    fn push<'a>(&'a self, launch: &mut cudarc::driver::LaunchArgs<'a>) {
        launch.arg(self);
    }
}

impl CudaDevice {
    /// Device-to-device copy bandwidth in bytes/s (the bound for weight-streaming decode).
    pub fn copy_bandwidth(&self) -> DevResult<f64> {
        let n = 256usize << 20; // 1 GiB of f32
        let src = self.zeros::<f32>(n)?;
        let mut dst = self.zeros::<f32>(n)?;
        self.stream.memcpy_dtod(&src, &mut dst).map_err(cuda("copy"))?;
        self.stream.synchronize().map_err(cuda("sync"))?;
        let start = std::time::Instant::now();
        for _ in 0..5 {
            self.stream.memcpy_dtod(&src, &mut dst).map_err(cuda("copy"))?;
        }
        self.stream.synchronize().map_err(cuda("sync"))?;
        // A copy reads and writes every byte.
        Ok((5 * 2 * n * 4) as f64 / start.elapsed().as_secs_f64())
    }
}
