//! The CUDA device (cudarc, loaded dynamically so that the crate builds and runs without
//! CUDA): kernels are CUDA C sources in this folder compiled by NVRTC at start-up for the
//! device's architecture and cached on disk (keyed by source hash and architecture);
//! GEMMs go through cuBLAS. Activations and the KV cache are f32; 2-D weights stay in
//! their dtype (f32, or bf16/f16 multiplied by cublasGemmEx with f32 accumulation after the
//! activations are rounded to the weight's type), 1-D weights (norms, biases) are f32.

use std::sync::Arc;

use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

use super::{
    AttnShape, CacheShape, DType, Device, DeviceError, HostTensor, LoraShape, LoraSlotWeights, RopeSpec,
};
use crate::models::attn::AttnMetadata;

const SOURCES: [(&str, &str); 2] =
    [("elementwise", include_str!("elementwise.cu")), ("attention", include_str!("attention.cu"))];

const KERNELS: [&str; 14] = [
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
    "split_qkv_rope_f32",
    "write_kv_f32",
    "paged_attention_f32",
    "lora_f32",
];

fn err(e: impl std::fmt::Debug) -> DeviceError {
    DeviceError::Other(format!("{e:?}"))
}

/// `[rows, cols]` f32 on the device.
pub struct CudaTensor {
    pub buf: CudaSlice<f32>,
    pub rows: usize,
    pub cols: usize,
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

pub struct CudaCache {
    pub shape: CacheShape,
    pub k: CudaSlice<f32>,
    pub v: CudaSlice<f32>,
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
    funcs: std::collections::HashMap<&'static str, CudaFunction>,
    arch: String,
    /// This step's attention metadata on the device, uploaded once for all layers.
    step: std::cell::RefCell<Option<StepBufs>>,
    /// The rotary inverse frequencies, uploaded on first use.
    inv_freq: std::cell::RefCell<Option<(Vec<f32>, CudaSlice<f32>)>>,
}

/// Attention metadata of one step on the device, with the host copy it came from.
struct StepBufs {
    host: AttnMetadata,
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
        let ctx = CudaContext::new(ordinal).map_err(err)?;
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone()).map_err(err)?;
        let (major, minor) = ctx.compute_capability().map_err(err)?;
        let arch = format!("sm_{major}{minor}");
        let mut funcs = std::collections::HashMap::new();
        for (name, src) in SOURCES {
            let ptx = Self::compile(name, src, &arch)?;
            let module = ctx.load_module(ptx).map_err(err)?;
            for k in KERNELS {
                if let Ok(f) = module.load_function(k) {
                    funcs.insert(k, f);
                }
            }
        }
        Ok(Self {
            ctx,
            stream,
            blas,
            funcs,
            arch,
            step: std::cell::RefCell::new(None),
            inv_freq: std::cell::RefCell::new(None),
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
    fn step_bufs(&self, meta: &AttnMetadata) {
        let fresh = self.step.borrow().as_ref().is_some_and(|b| {
            b.host.positions == meta.positions
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
        let bufs = StepBufs {
            positions: self.upload_u32(&meta.positions),
            slots: self.stream.clone_htod(&slots).expect("host to device copy"),
            token_seq: self.upload_u32(&meta.token_seq),
            tables: self.upload_u32(&flat),
            table_offsets: self.upload_u32(&offs),
            ctx_max: meta.positions.iter().copied().max().unwrap_or(0) as usize + 1,
            host: AttnMetadata { last_token_rows: Vec::new(), lora_slots: Vec::new(), ..meta.clone() },
        };
        *self.step.borrow_mut() = Some(bufs);
    }

    fn inv_freq(&self, rope: &RopeSpec) {
        if self.inv_freq.borrow().as_ref().is_some_and(|(h, _)| *h == rope.inv_freq) {
            return;
        }
        let dev = self.stream.clone_htod(&rope.inv_freq).expect("host to device copy");
        *self.inv_freq.borrow_mut() = Some((rope.inv_freq.clone(), dev));
    }

    pub fn arch(&self) -> &str {
        &self.arch
    }

    fn f(&self, name: &str) -> &CudaFunction {
        &self.funcs[name]
    }

    fn zeros(&self, n: usize) -> CudaSlice<f32> {
        self.stream.alloc_zeros::<f32>(n.max(1)).expect("device allocation")
    }

    /// An uninitialized activation tensor: every kernel and GEMM that makes one writes all
    /// of it, so it is not cleared first.
    fn tensor(&self, rows: usize, cols: usize) -> CudaTensor {
        // SAFETY: callers write every element before anything reads it.
        let buf = unsafe { self.stream.alloc::<f32>((rows * cols).max(1)) }.expect("device allocation");
        CudaTensor { buf, rows, cols }
    }

    fn upload_u32(&self, v: &[u32]) -> CudaSlice<u32> {
        if v.is_empty() {
            return self.stream.alloc_zeros::<u32>(1).expect("device allocation");
        }
        self.stream.clone_htod(v).expect("host to device copy")
    }

    /// Copies host f32 data into a new device tensor (tests and benchmarks).
    pub fn from_host(&self, data: &[f32], rows: usize, cols: usize) -> CudaTensor {
        CudaTensor { buf: self.stream.clone_htod(data).expect("host to device copy"), rows, cols }
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
        // SAFETY: w is [n, k] row-major (= k×n column-major, transposed to n×k), x is
        // [m, k] row-major (= k×m column-major), out holds m·n floats.
        unsafe { self.blas.gemm(cfg, w, &x.buf, out) }.expect("cuBLAS sgemm");
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
        use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cudaDataType};
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        let (m, k) = (x.rows, x.cols);
        let total = (m * k) as i64;
        let mut xh = self.stream.alloc_zeros::<u16>((m * k).max(1)).expect("device allocation");
        let conv = if f16 { "f32_to_f16" } else { "f32_to_bf16" };
        // SAFETY: x holds m·k floats and xh m·k 16-bit values.
        unsafe {
            self.stream
                .launch_builder(self.f(conv))
                .arg(&x.buf)
                .arg(&mut xh)
                .arg(&total)
                .launch(Self::grid(total as usize))
        }
        .expect("conversion launch");
        let ty = if f16 { cudaDataType::CUDA_R_16F } else { cudaDataType::CUDA_R_16BF };
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (wp, _w) = w.device_ptr(&self.stream);
        let (xp, _x) = xh.device_ptr(&self.stream);
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

impl Device for CudaDevice {
    type Tensor = CudaTensor;
    type Weight = CudaWeight;
    type Cache = CudaCache;
    type Lora = CudaLora;

    fn name(&self) -> String {
        let name = self.ctx.name().unwrap_or_else(|_| "CUDA".into());
        format!("{name} ({})", self.arch)
    }

    fn memory_info(&self) -> Option<(usize, usize)> {
        self.ctx.bind_to_thread().ok()?;
        cudarc::driver::result::mem_get_info().ok()
    }

    fn upload(&self, t: HostTensor) -> Result<CudaWeight, DeviceError> {
        let numel: usize = t.shape.iter().product();
        let need = numel * t.dtype.size();
        if t.data.len() != need {
            return Err(DeviceError::WeightSize { shape: t.shape, dtype: t.dtype, got: t.data.len(), need });
        }
        let buf = match (t.dtype, t.shape.len()) {
            (DType::BF16, 2) => WeightBuf::Bf16(
                self.stream.clone_htod(&bytemuck::pod_collect_to_vec::<u8, u16>(&t.data)).map_err(err)?,
            ),
            (DType::F16, 2) => WeightBuf::F16(
                self.stream.clone_htod(&bytemuck::pod_collect_to_vec::<u8, u16>(&t.data)).map_err(err)?,
            ),
            _ => {
                let mut bytes = Vec::new();
                DType::F32.convert_from(t.dtype, &t.data, &mut bytes);
                let host: Vec<f32> = bytemuck::pod_collect_to_vec(&bytes);
                WeightBuf::F32(self.stream.clone_htod(&host).map_err(err)?)
            }
        };
        Ok(CudaWeight { shape: t.shape, buf })
    }

    fn alloc_cache(&self, shape: CacheShape) -> Result<CudaCache, DeviceError> {
        let n = shape.num_blocks * shape.block_size * shape.num_kv_heads * shape.head_dim;
        Ok(CudaCache {
            shape,
            k: self.stream.alloc_zeros(n).map_err(err)?,
            v: self.stream.alloc_zeros(n).map_err(err)?,
        })
    }

    fn to_host(&self, t: &CudaTensor) -> Vec<f32> {
        let mut v = self.stream.clone_dtoh(&t.buf).expect("device to host copy");
        v.truncate(t.rows * t.cols);
        v
    }

    fn shape(&self, t: &CudaTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn embedding(&self, table: &CudaWeight, ids: &[u32]) -> CudaTensor {
        let hidden = table.shape[1];
        let mut out = self.tensor(ids.len(), hidden);
        let ids = self.upload_u32(ids);
        let h = hidden as i32;
        let cfg = Self::rows(out.rows);
        let (name, table_ptr) = match &table.buf {
            WeightBuf::F32(t) => ("embedding_f32", t as &dyn WeightArg),
            WeightBuf::Bf16(t) => ("embedding_bf16", t as &dyn WeightArg),
            WeightBuf::F16(t) => ("embedding_f16", t as &dyn WeightArg),
        };
        let mut launch = self.stream.launch_builder(self.f(name));
        table_ptr.push(&mut launch);
        // SAFETY: table is [vocab, hidden]; ids were validated against the vocabulary at admission.
        unsafe { launch.arg(&ids).arg(&mut out.buf).arg(&h).launch(cfg) }.expect("embedding launch");
        out
    }

    fn linear(&self, x: &CudaTensor, w: &CudaWeight, bias: Option<&CudaWeight>) -> CudaTensor {
        let (n, k) = (w.shape[0], w.shape[1]);
        assert_eq!(x.cols, k, "linear: input has {} features, weight expects {k}", x.cols);
        let mut out = self.tensor(x.rows, n);
        match &w.buf {
            WeightBuf::F32(wb) => self.gemm(x, wb, n, &mut out.buf),
            WeightBuf::Bf16(wb) => self.gemm_16(x, wb, n, &mut out.buf, false),
            WeightBuf::F16(wb) => self.gemm_16(x, wb, n, &mut out.buf, true),
        }
        if let Some(b) = bias {
            let total = (x.rows * n) as i64;
            let cols = n as i32;
            // SAFETY: out is [rows, n] and b holds n values.
            unsafe {
                self.stream
                    .launch_builder(self.f("add_bias_f32"))
                    .arg(&mut out.buf)
                    .arg(b.f32())
                    .arg(&cols)
                    .arg(&total)
                    .launch(Self::grid(total as usize))
            }
            .expect("bias launch");
        }
        out
    }

    fn rms_norm(&self, x: &CudaTensor, w: &CudaWeight, eps: f32) -> CudaTensor {
        let mut out = self.tensor(x.rows, x.cols);
        let mut dummy = self.zeros(1);
        let (use_res, cols) = (0i32, x.cols as i32);
        // SAFETY: x and out are [rows, cols]; w holds cols values; residual unused.
        unsafe {
            self.stream
                .launch_builder(self.f("rms_norm_f32"))
                .arg(&x.buf)
                .arg(&mut dummy)
                .arg(&use_res)
                .arg(w.f32())
                .arg(&mut out.buf)
                .arg(&cols)
                .arg(&eps)
                .launch(Self::rows(x.rows))
        }
        .expect("rms_norm launch");
        out
    }

    fn add_rms_norm(
        &self,
        x: &CudaTensor,
        residual: &mut CudaTensor,
        w: &CudaWeight,
        eps: f32,
    ) -> CudaTensor {
        let mut out = self.tensor(x.rows, x.cols);
        let (use_res, cols) = (1i32, x.cols as i32);
        // SAFETY: x, residual and out are [rows, cols]; w holds cols values.
        unsafe {
            self.stream
                .launch_builder(self.f("rms_norm_f32"))
                .arg(&x.buf)
                .arg(&mut residual.buf)
                .arg(&use_res)
                .arg(w.f32())
                .arg(&mut out.buf)
                .arg(&cols)
                .arg(&eps)
                .launch(Self::rows(x.rows))
        }
        .expect("add_rms_norm launch");
        out
    }

    fn add_inplace(&self, acc: &mut CudaTensor, x: &CudaTensor) {
        let n = (acc.rows * acc.cols) as i64;
        // SAFETY: both hold n values.
        unsafe {
            self.stream
                .launch_builder(self.f("add_f32"))
                .arg(&mut acc.buf)
                .arg(&x.buf)
                .arg(&n)
                .launch(Self::grid(n as usize))
        }
        .expect("add launch");
    }

    fn silu_mul(&self, gate_up: &CudaTensor) -> CudaTensor {
        let inter = gate_up.cols / 2;
        let mut out = self.tensor(gate_up.rows, inter);
        let total = (gate_up.rows * inter) as i64;
        let i = inter as i32;
        // SAFETY: gate_up is [rows, 2·inter], out [rows, inter].
        unsafe {
            self.stream
                .launch_builder(self.f("silu_mul_f32"))
                .arg(&gate_up.buf)
                .arg(&mut out.buf)
                .arg(&i)
                .arg(&total)
                .launch(Self::grid(total as usize))
        }
        .expect("silu_mul launch");
        out
    }

    fn split_qkv_rope(
        &self,
        qkv: &CudaTensor,
        s: AttnShape,
        rope: &RopeSpec,
        positions: &[u32],
    ) -> (CudaTensor, CudaTensor, CudaTensor) {
        let n = qkv.rows;
        let (mut q, mut k, mut v) = (
            self.tensor(n, s.num_heads * s.head_dim),
            self.tensor(n, s.num_kv_heads * s.head_dim),
            self.tensor(n, s.num_kv_heads * s.head_dim),
        );
        let pos = self.upload_u32(positions);
        self.inv_freq(rope);
        let inv_guard = self.inv_freq.borrow();
        let inv = &inv_guard.as_ref().expect("uploaded above").1;
        let (h, kvh, hd, half) =
            (s.num_heads as i32, s.num_kv_heads as i32, s.head_dim as i32, rope.inv_freq.len() as i32);
        // SAFETY: qkv is [n, (h + 2·kvh)·hd]; q, k, v are sized for their heads.
        unsafe {
            self.stream
                .launch_builder(self.f("split_qkv_rope_f32"))
                .arg(&qkv.buf)
                .arg(&mut q.buf)
                .arg(&mut k.buf)
                .arg(&mut v.buf)
                .arg(&pos)
                .arg(inv)
                .arg(&h)
                .arg(&kvh)
                .arg(&hd)
                .arg(&half)
                .launch(Self::rows(n))
        }
        .expect("rope launch");
        (q, k, v)
    }

    fn paged_attention(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        cache: &mut CudaCache,
        s: AttnShape,
        meta: &AttnMetadata,
    ) -> CudaTensor {
        let width = (s.num_kv_heads * s.head_dim) as i32;
        self.step_bufs(meta);
        let guard = self.step.borrow();
        let b = guard.as_ref().expect("uploaded above");
        let slots = &b.slots;
        // SAFETY: k, v are [n, width]; slots index inside the cache (checked by the scheduler).
        unsafe {
            self.stream
                .launch_builder(self.f("write_kv_f32"))
                .arg(&k.buf)
                .arg(&v.buf)
                .arg(&mut cache.k)
                .arg(&mut cache.v)
                .arg(slots)
                .arg(&width)
                .launch(Self::rows(k.rows))
        }
        .expect("write_kv launch");
        let (tables, offs, pos, seq, ctx_max) =
            (&b.tables, &b.table_offsets, &b.positions, &b.token_seq, b.ctx_max);
        let mut out = self.tensor(q.rows, s.num_heads * s.head_dim);
        let cfg = LaunchConfig {
            grid_dim: ((q.rows * s.num_heads) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: (ctx_max * 4) as u32,
        };
        let (h, kvh, hd, bs) =
            (s.num_heads as i32, s.num_kv_heads as i32, s.head_dim as i32, cache.shape.block_size as i32);
        // SAFETY: every index is bounded by the metadata built from the scheduler's tables.
        unsafe {
            self.stream
                .launch_builder(self.f("paged_attention_f32"))
                .arg(&q.buf)
                .arg(&cache.k)
                .arg(&cache.v)
                .arg(&mut out.buf)
                .arg(pos)
                .arg(seq)
                .arg(tables)
                .arg(offs)
                .arg(&h)
                .arg(&kvh)
                .arg(&hd)
                .arg(&bs)
                .arg(&s.scale)
                .launch(cfg)
        }
        .expect("paged_attention launch");
        out
    }

    fn gather_rows(&self, x: &CudaTensor, rows: &[usize]) -> CudaTensor {
        let mut out = self.tensor(rows.len(), x.cols);
        let r: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let r = self.upload_u32(&r);
        let cols = x.cols as i32;
        // SAFETY: rows index inside x.
        unsafe {
            self.stream
                .launch_builder(self.f("gather_rows_f32"))
                .arg(&x.buf)
                .arg(&r)
                .arg(&mut out.buf)
                .arg(&cols)
                .launch(Self::rows(rows.len()))
        }
        .expect("gather launch");
        out
    }

    fn alloc_lora(&self, shape: LoraShape) -> Result<CudaLora, DeviceError> {
        let (s, r) = (shape.slots, shape.max_rank);
        Ok(CudaLora {
            shape,
            a: self.stream.alloc_zeros(s * r * shape.in_features).map_err(err)?,
            bt: self.stream.alloc_zeros(s * r * shape.out_features).map_err(err)?,
            ranks: vec![0; s],
            ranks_dev: self.stream.alloc_zeros(s.max(1)).map_err(err)?,
        })
    }

    fn set_lora_slot(&self, l: &mut CudaLora, slot: usize, w: Option<LoraSlotWeights>) {
        let LoraShape { max_rank: rm, in_features: fin, out_features: fout, .. } = l.shape;
        let mut a = vec![0f32; rm * fin];
        let mut bt = vec![0f32; rm * fout];
        l.ranks[slot] = 0;
        if let Some(w) = w {
            a[..w.rank * fin].copy_from_slice(w.a);
            for o in 0..fout {
                for r in 0..w.rank {
                    bt[r * fout + o] = w.b[o * w.rank + r] * w.scale;
                }
            }
            l.ranks[slot] = w.rank as i32;
        }
        let mut av = l.a.slice_mut(slot * rm * fin..(slot + 1) * rm * fin);
        self.stream.memcpy_htod(&a, &mut av).expect("host to device copy");
        let mut bv = l.bt.slice_mut(slot * rm * fout..(slot + 1) * rm * fout);
        self.stream.memcpy_htod(&bt, &mut bv).expect("host to device copy");
        self.stream.memcpy_htod(&l.ranks, &mut l.ranks_dev).expect("host to device copy");
    }

    fn add_lora(&self, y: &mut CudaTensor, x: &CudaTensor, modules: &[(&CudaLora, usize)], slots: &[i32]) {
        let s = self.stream.clone_htod(slots).expect("host to device copy");
        for (l, off) in modules {
            let LoraShape { max_rank, in_features, out_features, .. } = l.shape;
            let args = [max_rank as i32, in_features as i32, out_features as i32, *off as i32, y.cols as i32];
            let cfg = LaunchConfig {
                grid_dim: (y.rows as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: (max_rank * 4) as u32,
            };
            // SAFETY: slots hold one entry per row of y and x; offsets are within y's row.
            unsafe {
                self.stream
                    .launch_builder(self.f("lora_f32"))
                    .arg(&mut y.buf)
                    .arg(&x.buf)
                    .arg(&l.a)
                    .arg(&l.bt)
                    .arg(&l.ranks_dev)
                    .arg(&s)
                    .arg(&args[0])
                    .arg(&args[1])
                    .arg(&args[2])
                    .arg(&args[3])
                    .arg(&args[4])
                    .launch(cfg)
            }
            .expect("lora launch");
        }
    }
}
