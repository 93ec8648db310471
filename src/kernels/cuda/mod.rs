//! The CUDA device (cudarc, loaded dynamically so that the crate builds and runs without
//! CUDA): kernels are CUDA C sources in this folder compiled by NVRTC at start-up for the
//! device's architecture and cached on disk (keyed by source hash and architecture);
//! GEMMs go through cuBLAS. Activations are f32; 2-D weights stay in their dtype (f32, or
//! bf16/f16 multiplied by cublasGemmEx with f32 accumulation, the kernels that feed a GEMM
//! also writing their output in the weights' type), 1-D weights (norms, biases) are f32.
//! The KV cache is f32 for an f32 model and the weights' type for a 16-bit one; prefill
//! attention of 16-bit models runs on tensor cores (flash.cu).

use std::sync::Arc;

use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

use super::{AttnShape, CacheShape, DType, DeviceError, LoraShape, RopeSpec, TpRank};
use crate::models::attn::AttnMetadata;

/// Prepended to every source (16-bit types and the rounding store the kernels share).
const COMMON: &str = include_str!("common.cuh");

const SOURCES: [(&str, &str); 3] = [
    ("elementwise", include_str!("elementwise.cu")),
    ("attention", include_str!("attention.cu")),
    ("flash", include_str!("flash.cu")),
];

const KERNELS: [&str; 27] = [
    "embedding_f32",
    "embedding_bf16",
    "embedding_f16",
    "f32_to_bf16",
    "f32_to_f16",
    "rms_norm_f32",
    "silu_mul_f32",
    "add_f32",
    "add_bias_f32",
    "gather_rows_f32",
    "join_shards_f32",
    "argmax_f32",
    "split_qkv_rope_f32",
    "write_kv_f32",
    "write_kv_bf16",
    "write_kv_f16",
    "paged_attention_f32",
    "paged_attention_bf16",
    "paged_attention_f16",
    "paged_attention_reduce_f32",
    "lora_f32",
    "flash_prefill_h64_f32",
    "flash_prefill_h128_f32",
    "flash_prefill_h64_bf16",
    "flash_prefill_h128_bf16",
    "flash_prefill_h64_f16",
    "flash_prefill_h128_f16",
];

fn err(e: impl std::fmt::Debug) -> DeviceError {
    DeviceError::Other(format!("{e:?}"))
}

/// Every entry point: [`KERNELS`] and the split attention kernel's instantiations
/// `paged_attention_split_g{G}_d{D}_{kv type}` (see [`ops::split_kernel`]).
fn kernel_names() -> Vec<String> {
    let mut names: Vec<String> = KERNELS.iter().map(|k| k.to_string()).collect();
    for sfx in ["f32", "bf16", "f16"] {
        for g in [1, 2, 4, 8] {
            for d in [2, 4, 8] {
                names.push(format!("paged_attention_split_g{g}_d{d}_{sfx}"));
            }
        }
    }
    names
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
}

/// Activation buffers no longer in use, by power-of-two length, for the next tensors of
/// that size: in steady state a step allocates no device memory. At most `POOL_LIMIT`
/// bytes wait here; beyond that a buffer is freed.
#[derive(Default)]
pub struct BufPool {
    /// Bytes waiting, and the buffers by length.
    free: std::sync::Mutex<(usize, FreeLists)>,
}

type FreeLists = std::collections::HashMap<usize, Vec<CudaSlice<f32>>>;

const POOL_LIMIT: usize = 4 << 30;

impl BufPool {
    fn take(&self, len: usize) -> Option<CudaSlice<f32>> {
        let mut g = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let buf = g.1.get_mut(&len)?.pop()?;
        g.0 -= len * 4;
        Some(buf)
    }
    fn put(&self, buf: CudaSlice<f32>) {
        let mut g = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let bytes = buf.len() * 4;
        if g.0 + bytes <= POOL_LIMIT {
            g.0 += bytes;
            g.1.entry(buf.len()).or_default().push(buf);
        }
    }
}

/// A device buffer that goes back to its pool when dropped.
pub struct PooledBuf {
    slice: std::mem::ManuallyDrop<CudaSlice<f32>>,
    pool: Option<Arc<BufPool>>,
}

impl std::ops::Deref for PooledBuf {
    type Target = CudaSlice<f32>;
    fn deref(&self) -> &CudaSlice<f32> {
        &self.slice
    }
}

impl std::ops::DerefMut for PooledBuf {
    fn deref_mut(&mut self) -> &mut CudaSlice<f32> {
        &mut self.slice
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        // SAFETY: the slice is taken once, here, and never touched again.
        let slice = unsafe { std::mem::ManuallyDrop::take(&mut self.slice) };
        if let Some(pool) = &self.pool {
            // Stream order makes reuse safe: later kernels run after earlier readers.
            pool.put(slice);
        }
    }
}

/// A weight on the device; 16-bit types are kept as raw bits.
pub enum WeightBuf {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
    F16(CudaSlice<u16>),
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

/// One layer's K and V cache: f32, or the 16-bit type of a 16-bit model's weights (half the
/// bytes for attention to read).
pub struct CudaCache {
    pub shape: CacheShape,
    k: KvBuf,
    v: KvBuf,
    /// The element type's kernel suffix: "f32", "bf16" or "f16".
    suffix: &'static str,
}

enum KvBuf {
    F32(CudaSlice<f32>),
    Half(CudaSlice<u16>),
}

impl KvBuf {
    fn arg(&mut self) -> &mut dyn WeightArg {
        match self {
            KvBuf::F32(b) => b,
            KvBuf::Half(b) => b,
        }
    }
}

/// LoRA A `[slots, R, in]` and Bᵀ `[slots, R, out]` (scale folded in), ranks per slot.
pub struct CudaLora {
    pub shape: LoraShape,
    a: CudaSlice<f32>,
    bt: CudaSlice<f32>,
    ranks: Vec<i32>,
    ranks_dev: CudaSlice<i32>,
}

pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    funcs: std::collections::HashMap<String, CudaFunction>,
    arch: String,
    /// This step's attention metadata on the device, uploaded once for all layers.
    step: std::cell::RefCell<Option<StepBufs>>,
    /// The rotary inverse frequencies, uploaded on first use.
    inv_freq: std::cell::RefCell<Option<(Vec<f32>, CudaSlice<f32>)>>,
    /// The step's token positions for RoPE, uploaded once for all layers. A copy from
    /// pageable host memory waits for the stream to drain: once per layer it would stall
    /// the host behind the GPU every layer.
    rope_positions: std::cell::RefCell<Option<(Vec<u32>, CudaSlice<u32>)>>,
    /// The NCCL communicator of a tensor-parallel group, with this device's rank.
    comm: Option<cudarc::nccl::Comm>,
    tp: TpRank,
    pool: Arc<BufPool>,
    /// Per-step index lists (token ids, sampled rows, argmax results) by use.
    staging: std::cell::RefCell<std::collections::HashMap<&'static str, CudaSlice<u32>>>,
    /// Activations rounded to 16 bits for the GEMMs of 16-bit weights, grown as needed.
    scratch16: std::cell::RefCell<Option<CudaSlice<u16>>>,
    /// GPU time per operation, when `ACTORLLM_PROFILE_KERNELS` asks for it.
    prof: Option<profile::Profiler>,
    /// The 16-bit type of the 2-D weights (1 bf16, 2 f16; 0 for f32): activations that feed
    /// GEMMs are also written in it.
    act16: std::cell::Cell<i32>,
    /// Prefill attention on tensor cores: by default for 16-bit models on sm_80 and later.
    tensor_core_attention: std::cell::Cell<Option<bool>>,
}

/// Attention metadata of one step on the device, with the host copy it came from.
struct StepBufs {
    host: AttnMetadata,
    /// Whether `rows` and `tiles` split the rows between flash_prefill and the others.
    flash: bool,
    /// Query rows for the split (or one-block-per-head) kernel, and how many.
    rows: CudaSlice<u32>,
    num_rows: usize,
    /// (first row, rows) of each flash_prefill tile, and how many tiles.
    tiles: CudaSlice<u32>,
    num_tiles: usize,
    positions: CudaSlice<u32>,
    slots: CudaSlice<i64>,
    token_seq: CudaSlice<u32>,
    tables: CudaSlice<u32>,
    table_offsets: CudaSlice<u32>,
    ctx_max: usize,
}

// SAFETY: the device is used from its ModelRunner's thread only (the context is bound
// there); cudarc's handles are thread-safe to move.
unsafe impl Send for CudaDevice {}
impl Unpin for CudaDevice {}

fn cache_dir() -> std::path::PathBuf {
    std::env::var_os("ACTORLLM_KERNEL_CACHE")
        .map(Into::into)
        .unwrap_or_else(|| std::env::temp_dir().join("actorllm-kernels"))
}

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
        // SAFETY: only tries to open the library.
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            return Err(DeviceError::Other(
                "tensor parallelism on GPUs needs NCCL: libnccl.so was not found on the loader path \
                 (set LD_LIBRARY_PATH to the folder holding it)"
                    .into(),
            ));
        }
        let ctxs = (0..world).map(CudaContext::new).collect::<Result<Vec<_>, _>>().map_err(err)?;
        let streams = ctxs.iter().map(|c| c.default_stream()).collect();
        let comms = cudarc::nccl::Comm::from_devices(streams).map_err(err)?;
        ctxs.into_iter().zip(comms).map(|(ctx, comm)| Self::open(ctx, Some(comm))).collect()
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
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone()).map_err(err)?;
        let (major, minor) = ctx.compute_capability().map_err(err)?;
        let arch = format!("sm_{major}{minor}");
        let mut funcs = std::collections::HashMap::new();
        for (name, src) in SOURCES {
            let ptx = Self::compile(name, &format!("{COMMON}\n{src}"), &arch)?;
            let module = ctx.load_module(ptx).map_err(err)?;
            for k in kernel_names() {
                if let Ok(f) = module.load_function(&k) {
                    funcs.insert(k, f);
                }
            }
        }
        let prof = profile::Profiler::from_env(&ctx);
        Ok(Self {
            ctx,
            stream,
            blas,
            funcs,
            arch,
            step: std::cell::RefCell::new(None),
            inv_freq: std::cell::RefCell::new(None),
            rope_positions: std::cell::RefCell::new(None),
            comm,
            tp,
            pool: Arc::default(),
            staging: Default::default(),
            scratch16: std::cell::RefCell::new(None),
            prof,
            act16: std::cell::Cell::new(0),
            tensor_core_attention: std::cell::Cell::new(None),
        })
    }

    /// Whether a CUDA driver and a GPU are present.
    pub fn available() -> bool {
        // SAFETY: only tries to open the driver library; nothing is called through it yet.
        let present = unsafe { cudarc::driver::sys::is_culib_present() };
        present && CudaContext::device_count().is_ok_and(|n| n > 0)
    }

    fn compile(name: &str, src: &str, arch: &str) -> Result<cudarc::nvrtc::Ptx, DeviceError> {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        src.hash(&mut h);
        let path = cache_dir().join(format!("{name}-{:016x}-{arch}.ptx", h.finish()));
        if let Ok(text) = std::fs::read_to_string(&path) {
            return Ok(cudarc::nvrtc::Ptx::from_src(text));
        }
        let arch_static: &'static str = Box::leak(arch.to_string().into_boxed_str());
        let opts = cudarc::nvrtc::CompileOptions {
            arch: Some(arch_static),
            include_paths: vec!["/usr/local/cuda/include".into()],
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(src, opts)
            .map_err(|e| DeviceError::Other(format!("NVRTC compiling {name}.cu for {arch}: {e:?}")))?;
        let _ = std::fs::create_dir_all(cache_dir());
        let _ = std::fs::write(&path, ptx.to_src());
        Ok(ptx)
    }

    /// Uploads `meta` unless the cached step buffers already hold it (every layer of a
    /// forward passes the same metadata: one upload per step).
    fn step_bufs(&self, meta: &AttnMetadata, flash: bool) {
        let fresh = self.step.borrow().as_ref().is_some_and(|b| {
            b.flash == flash
                && b.host.positions == meta.positions
                && b.host.slot_mapping == meta.slot_mapping
                && b.host.token_seq == meta.token_seq
                && b.host.block_tables == meta.block_tables
        });
        if fresh {
            return;
        }
        let mut flat = Vec::new();
        let mut offs = Vec::with_capacity(meta.block_tables.len());
        for t in &meta.block_tables {
            offs.push(flat.len() as u32);
            flat.extend_from_slice(t);
        }
        let slots = if meta.slot_mapping.is_empty() { vec![-1] } else { meta.slot_mapping.clone() };
        let (rows, tiles) = split_rows(meta, flash);
        // Last step's buffers take this step's metadata when it fits.
        let old = self.step.borrow_mut().take();
        let (
            mut positions,
            mut slot_buf,
            mut token_seq,
            mut tables,
            mut table_offsets,
            mut rows_buf,
            mut tiles_buf,
        ) = match old {
            Some(b) => (
                Some(b.positions),
                Some(b.slots),
                Some(b.token_seq),
                Some(b.tables),
                Some(b.table_offsets),
                Some(b.rows),
                Some(b.tiles),
            ),
            None => (None, None, None, None, None, None, None),
        };
        let bufs = StepBufs {
            flash,
            rows: self.refill(rows_buf.take(), &rows),
            num_rows: rows.len(),
            tiles: self.refill(tiles_buf.take(), &tiles),
            num_tiles: tiles.len() / 2,
            positions: self.refill(positions.take(), &meta.positions),
            slots: self.refill(slot_buf.take(), &slots),
            token_seq: self.refill(token_seq.take(), &meta.token_seq),
            tables: self.refill(tables.take(), &flat),
            table_offsets: self.refill(table_offsets.take(), &offs),
            ctx_max: meta.positions.iter().copied().max().unwrap_or(0) as usize + 1,
            host: AttnMetadata { last_token_rows: Vec::new(), lora_slots: Vec::new(), ..meta.clone() },
        };
        *self.step.borrow_mut() = Some(bufs);
    }

    /// Whether prefill attention goes to flash_prefill for this shape: 16-bit models (or as
    /// set by [`Self::set_tensor_core_attention`]) with head_dim 64 or 128 on sm_80 or later.
    fn flash_for(&self, s: AttnShape) -> bool {
        let on = self.tensor_core_attention.get().unwrap_or(self.act16.get() != 0);
        let sm80 = self.arch.trim_start_matches("sm_").parse::<u32>().is_ok_and(|a| a >= 80);
        on && sm80 && matches!(s.head_dim, 64 | 128)
    }

    /// Forces prefill attention on (or off) tensor cores, whatever the weights' type.
    pub fn set_tensor_core_attention(&self, on: bool) {
        self.tensor_core_attention.set(Some(on));
    }

    /// An uninitialized 16-bit copy for a `[rows, cols]` output when GEMMs take 16-bit
    /// inputs, with the kernels' `kind` argument (0: none).
    fn half(&self, rows: usize, cols: usize) -> (Option<Half>, i32) {
        match self.act16.get() {
            0 => (None, 0),
            kind => (Some(Half { buf: self.tensor((rows * cols).div_ceil(2), 1).buf, kind }), kind),
        }
    }

    fn rope_positions(&self, positions: &[u32]) {
        if self.rope_positions.borrow().as_ref().is_some_and(|(h, _)| h == positions) {
            return;
        }
        let old = self.rope_positions.borrow_mut().take().map(|(_, d)| d);
        let dev = self.refill(old, positions);
        *self.rope_positions.borrow_mut() = Some((positions.to_vec(), dev));
    }

    fn inv_freq(&self, rope: &RopeSpec) {
        if self.inv_freq.borrow().as_ref().is_some_and(|(h, _)| *h == rope.inv_freq) {
            return;
        }
        let dev = self.stream.clone_htod(&rope.inv_freq).expect("host to device copy");
        *self.inv_freq.borrow_mut() = Some((rope.inv_freq.clone(), dev));
    }

    /// RMSNorm of each row, after `residual += x` when a residual is given (the kernel
    /// then normalizes the sum and writes it back to the residual).
    fn norm(
        &self,
        x: &CudaTensor,
        residual: Option<&mut CudaTensor>,
        w: &CudaWeight,
        eps: f32,
    ) -> CudaTensor {
        let mut out = self.tensor(x.rows, x.cols);
        let (mut half, kind) = self.half(x.rows, x.cols);
        let cols = x.cols as i32;
        let _t = self.span(if residual.is_some() { "add_rms_norm" } else { "rms_norm" }, (0, 0), x.rows);
        let mut launch = self.stream.launch_builder(self.f("rms_norm_f32"));
        launch.arg(&*x.buf);
        let use_res = i32::from(residual.is_some());
        match residual {
            Some(r) => launch.arg(&mut *r.buf),
            // Not written when use_residual is 0: x's buffer only fills the slot.
            None => launch.arg(&*x.buf),
        };
        launch.arg(&use_res).arg(w.f32()).arg(&mut *out.buf);
        match &mut half {
            Some(h) => launch.arg(&mut *h.buf),
            None => launch.arg(&*x.buf), // not written with kind 0
        };
        let threads = (x.cols.div_ceil(4).div_ceil(32) * 32).clamp(32, 1024) as u32;
        let cfg =
            LaunchConfig { grid_dim: (x.rows as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: x, out (and the residual) are [rows, cols]; w holds cols values; half (when
        // kind is not 0) holds rows·cols 16-bit values.
        unsafe { launch.arg(&kind).arg(&cols).arg(&eps).launch(cfg) }.expect("rms_norm launch");
        out.half = half;
        out
    }

    /// Times the operation issued until the span drops (profiling only).
    fn span(&self, name: &'static str, nk: (usize, usize), rows: usize) -> Option<profile::Span<'_>> {
        self.prof.as_ref().map(|p| p.span(&self.stream, name, nk, rows))
    }

    pub fn arch(&self) -> &str {
        &self.arch
    }

    fn f(&self, name: &str) -> &CudaFunction {
        &self.funcs[name]
    }

    /// The KV cache's element type for caches allocated now: the 16-bit type of the
    /// weights, else f32.
    fn kv_suffix(&self) -> &'static str {
        match self.act16.get() {
            1 => "bf16",
            2 => "f16",
            _ => "f32",
        }
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
    fn tensor(&self, rows: usize, cols: usize) -> CudaTensor {
        let len = (rows * cols).max(1).next_power_of_two();
        let slice = self.pool.take(len).unwrap_or_else(|| {
            // SAFETY: callers write every element before anything reads it.
            unsafe { self.stream.alloc::<f32>(len) }.expect("device allocation")
        });
        let buf = PooledBuf { slice: std::mem::ManuallyDrop::new(slice), pool: Some(self.pool.clone()) };
        CudaTensor { buf, rows, cols, half: None }
    }

    /// Copies `v` into `buf` when it fits, else into a new buffer of the next power-of-two
    /// length: per-step inputs reuse the device buffers of earlier steps. Stream order
    /// keeps the copy behind the kernels still reading the old contents.
    fn refill<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        buf: Option<CudaSlice<T>>,
        v: &[T],
    ) -> CudaSlice<T> {
        let need = v.len().max(1);
        let mut buf = match buf {
            Some(b) if b.len() >= need => b,
            _ => self.stream.alloc_zeros::<T>(need.next_power_of_two()).expect("device allocation"),
        };
        if !v.is_empty() {
            self.stream.memcpy_htod(v, &mut buf.slice_mut(0..v.len())).expect("host to device copy");
        }
        buf
    }

    /// Uploads a per-step index list into the named staging buffer (see [`Self::refill`]);
    /// hand it back with [`Self::restage`] once the launches that read it are issued.
    fn stage(&self, name: &'static str, v: &[u32]) -> CudaSlice<u32> {
        let old = self.staging.borrow_mut().remove(name);
        self.refill(old, v)
    }

    fn restage(&self, name: &'static str, buf: CudaSlice<u32>) {
        self.staging.borrow_mut().insert(name, buf);
    }

    /// Uploads 16-bit elements, straight from `bytes` when they are 2-byte aligned (the
    /// memory-mapped checkpoint's are).
    fn upload_u16(&self, bytes: &[u8]) -> Result<CudaSlice<u16>, DeviceError> {
        match bytemuck::try_cast_slice::<u8, u16>(bytes) {
            Ok(v) => self.stream.clone_htod(v).map_err(err),
            Err(_) => self.stream.clone_htod(&bytemuck::pod_collect_to_vec::<u8, u16>(bytes)).map_err(err),
        }
    }

    /// Copies host f32 data into a new device tensor (tests and benchmarks).
    pub fn from_host(&self, data: &[f32], rows: usize, cols: usize) -> CudaTensor {
        let slice = self.stream.clone_htod(data).expect("host to device copy");
        CudaTensor {
            buf: PooledBuf { slice: std::mem::ManuallyDrop::new(slice), pool: None },
            rows,
            cols,
            half: None,
        }
    }

    fn grid(n: usize) -> LaunchConfig {
        LaunchConfig { grid_dim: (n.div_ceil(256) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
    }

    fn rows(rows: usize) -> LaunchConfig {
        LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
    }

    /// `out = x @ wᵀ` via cuBLAS (column-major: outᵀ[n, m] = w[n, k] · xᵀ[k, m]).
    fn gemm(&self, x: &CudaTensor, w: &CudaSlice<f32>, n: usize, out: &mut CudaSlice<f32>) {
        let (m, k) = (x.rows as i32, x.cols as i32);
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: n as i32,
            n: m,
            k,
            alpha: 1.0f32,
            lda: k,
            ldb: k,
            beta: 0.0f32,
            ldc: n as i32,
        };
        let _t = self.span("gemm_f32", (n, k as usize), m as usize);
        // SAFETY: w is [n, k] row-major (= k×n column-major, transposed to n×k), x is
        // [m, k] row-major (= k×m column-major), out holds m·n floats.
        unsafe { self.blas.gemm(cfg, w, &*x.buf, out) }.expect("cuBLAS sgemm");
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
    /// `out = x @ wᵀ` for 16-bit weights: x is rounded to the weight's type, cuBLAS
    /// accumulates in f32 and writes f32.
    fn gemm_16(&self, x: &CudaTensor, w: &CudaSlice<u16>, n: usize, out: &mut CudaSlice<f32>, f16: bool) {
        use cudarc::cublas::sys::cudaDataType;
        use cudarc::driver::DevicePtr;
        let (m, k) = (x.rows, x.cols);
        let ty = if f16 { cudaDataType::CUDA_R_16F } else { cudaDataType::CUDA_R_16BF };
        if let Some(h) = x.half.as_ref().filter(|h| h.kind == if f16 { 2 } else { 1 }) {
            let _t = self.span(if f16 { "gemm_f16" } else { "gemm_bf16" }, (n, k), m);
            let (xp, _x) = h.buf.device_ptr(&self.stream);
            self.gemm_16_raw(w, xp, ty, n, m, k, out);
            return;
        }
        let total = (m * k) as i64;
        let mut scratch = self.scratch16.borrow_mut();
        if scratch.as_ref().is_none_or(|b| b.len() < m * k) {
            // SAFETY: the conversion below writes the m·k values the GEMM reads.
            *scratch = Some(
                unsafe { self.stream.alloc::<u16>((m * k).next_power_of_two()) }.expect("device allocation"),
            );
        }
        let xh = scratch.as_mut().expect("allocated above");
        let conv = if f16 { "f32_to_f16" } else { "f32_to_bf16" };
        let t = self.span(conv, (0, 0), m);
        // SAFETY: x holds m·k floats and xh m·k 16-bit values.
        unsafe {
            self.stream
                .launch_builder(self.f(conv))
                .arg(&*x.buf)
                .arg(&mut *xh)
                .arg(&total)
                .launch(Self::grid(total as usize))
        }
        .expect("conversion launch");
        drop(t);
        let _t = self.span(if f16 { "gemm_f16" } else { "gemm_bf16" }, (n, k), m);
        let (xp, _x) = xh.device_ptr(&self.stream);
        self.gemm_16_raw(w, xp, ty, n, m, k, out);
    }

    /// `out = x @ wᵀ` with x `[m, k]` of 16-bit type `ty` at device address `xp`.
    #[allow(clippy::too_many_arguments)]
    fn gemm_16_raw(
        &self,
        w: &CudaSlice<u16>,
        xp: cudarc::driver::sys::CUdeviceptr,
        ty: cudarc::cublas::sys::cudaDataType,
        n: usize,
        m: usize,
        k: usize,
        out: &mut CudaSlice<f32>,
    ) {
        use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cudaDataType};
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (wp, _w) = w.device_ptr(&self.stream);
        let (op, _o) = out.device_ptr_mut(&self.stream);
        // SAFETY: as in `gemm`: w is [n, k], xh [m, k], out [m, n]; pointers live for the call.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                m as i32,
                k as i32,
                (&alpha as *const f32).cast(),
                wp as *const _,
                ty,
                k as i32,
                xp as *const _,
                ty,
                k as i32,
                (&beta as *const f32).cast(),
                op as *mut _,
                cudaDataType::CUDA_R_32F,
                n as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .expect("cuBLAS GemmEx");
    }

    /// Device-to-device copy bandwidth in bytes/s (the bound for weight-streaming decode).
    pub fn copy_bandwidth(&self) -> f64 {
        let n = 256usize << 20; // 1 GiB of f32
        let src = self.stream.alloc_zeros::<f32>(n).expect("device allocation");
        let mut dst = self.stream.alloc_zeros::<f32>(n).expect("device allocation");
        self.stream.memcpy_dtod(&src, &mut dst).expect("copy");
        self.stream.synchronize().expect("sync");
        let start = std::time::Instant::now();
        for _ in 0..5 {
            self.stream.memcpy_dtod(&src, &mut dst).expect("copy");
        }
        self.stream.synchronize().expect("sync");
        // A copy reads and writes every byte.
        (5 * 2 * n * 4) as f64 / start.elapsed().as_secs_f64()
    }
}

mod ops;
mod profile;

/// Splits a step's query rows between the attention kernels: with `flash`, runs of two or
/// more rows of one sequence at consecutive positions (prefill chunks) become flash_prefill
/// tiles of up to 64 rows, `[first row, rows]` pairs; every other row (decodes) goes to the
/// split kernel's row list.
fn split_rows(meta: &AttnMetadata, flash: bool) -> (Vec<u32>, Vec<u32>) {
    const TILE: usize = 64;
    let n = meta.positions.len();
    if !flash {
        return ((0..n as u32).collect(), Vec::new());
    }
    let (mut rows, mut tiles) = (Vec::new(), Vec::new());
    let mut i = 0;
    while i < n {
        let mut j = i + 1;
        while j < n
            && meta.token_seq[j] == meta.token_seq[i]
            && meta.positions[j] == meta.positions[j - 1] + 1
        {
            j += 1;
        }
        if j - i >= 2 {
            for start in (i..j).step_by(TILE) {
                tiles.extend([start as u32, (j - start).min(TILE) as u32]);
            }
        } else {
            rows.push(i as u32);
        }
        i = j;
    }
    (rows, tiles)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_runs_become_tiles_and_decodes_stay_rows() {
        // Sequence 0 decodes one token; sequence 1 prefills 130; sequence 2 decodes one.
        let mut meta = AttnMetadata::default();
        let mut push = |seq: u32, pos: std::ops::Range<u32>| {
            for p in pos {
                meta.token_seq.push(seq);
                meta.positions.push(p);
            }
        };
        push(0, 17..18);
        push(1, 5..135);
        push(2, 40..41);
        let (rows, tiles) = split_rows(&meta, true);
        assert_eq!(rows, vec![0, 131]);
        assert_eq!(tiles, vec![1, 64, 65, 64, 129, 2]);
        let (rows, tiles) = split_rows(&meta, false);
        assert_eq!(rows, (0..132).collect::<Vec<u32>>());
        assert!(tiles.is_empty());
    }
}
