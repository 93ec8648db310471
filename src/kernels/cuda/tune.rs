//! GEMM algorithms chosen by measurement. For a 16-bit projection cublasGemmEx picks one
//! algorithm from its model of the GPU; at some batch sizes another of cuBLASLt's candidates
//! for the same shape runs 5 – 15 % faster (an H200 on Llama-3-8B's projections at 768 –
//! 4096 rows), and at others cublasGemmEx's pick beats every one of them.
//!
//! So at start-up, once the profiling step has run every projection, each shape (operand
//! and output types, the weight's rows and columns) is timed at a set of row counts:
//! cublasGemmEx against cuBLASLt's heuristic candidates, on random operands of the shape.
//! A candidate that fails or whose output strays from cublasGemmEx's is dropped. A GEMM of
//! m rows then runs what was fastest at the smallest tuned row count ≥ m (an algorithm
//! chosen for more rows serves fewer: its workspace only shrinks), and cublasGemmEx past
//! the largest or before tuning.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;

use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::cublasOperation_t as Op;
use cudarc::cublas::sys::cudaDataType as DataType;
use cudarc::cublaslt::result::CublasError;
use cudarc::cublaslt::sys as lt;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

use super::gemm::GEMV_ROWS;
use super::{CudaDevice, DevResult, DeviceError, cuda, err};
use crate::kernels::GemmTuning;

/// Bytes of GEMM workspace, shared by cuBLAS and cuBLASLt (what cuBLAS itself reserves on
/// Hopper).
const BLAS_WORKSPACE: usize = 32 << 20;
/// cuBLASLt's heuristic candidates asked for at each shape and row count.
const CANDIDATES: usize = 8;
/// GPU time a timed batch of one candidate's runs should at least take, in µs (events
/// resolve about half a µs).
const TIMED_US: f64 = 300.0;
/// Output values compared with cublasGemmEx's at each end of a candidate's output.
const SAMPLE: usize = 1 << 16;

/// What a projection's GEMM runs.
#[derive(Clone, Copy)]
enum Algo {
    /// cublasGemmEx with its default algorithm.
    GemmEx,
    Lt(lt::cublasLtMatmulAlgo_t),
}

/// A projection's GEMM: operand and output types and the weight's `[n, k]`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct ShapeKey {
    ty: DataType,
    c_ty: DataType,
    n: usize,
    k: usize,
}

struct Shape {
    /// The most rows a GEMM of the shape has had.
    rows_seen: usize,
    /// The chosen algorithms, by the row count they were timed at.
    algos: BTreeMap<usize, Algo>,
    /// cuBLASLt layouts of the weight (k × n column-major), x (k × m) and the output
    /// (n × m); m is set at each call. None where cuBLASLt does not take the types.
    layouts: Option<[lt::cublasLtMatrixLayout_t; 3]>,
}

/// The GEMM workspace and cuBLASLt's handle, with the algorithms chosen per shape.
pub(super) struct Gemms {
    workspace: CudaSlice<u8>,
    ws_ptr: CUdeviceptr,
    handle: lt::cublasLtHandle_t,
    /// `out = op(w) · x` in cuBLAS's column-major terms: f32 compute and scale, w transposed.
    desc: lt::cublasLtMatmulDesc_t,
    shapes: RefCell<HashMap<ShapeKey, Shape>>,
    /// Whether the last GEMM through `gemm_tuned` ran a cuBLASLt algorithm.
    last_on_lt: Cell<bool>,
}

fn lt_err(what: &'static str) -> impl Fn(CublasError) -> DeviceError {
    move |e| DeviceError::Other(format!("{what}: {e:?}"))
}

/// Bytes of one value of a GEMM output type (f32, or a 16-bit type).
fn value_bytes(t: DataType) -> usize {
    if t == DataType::CUDA_R_32F { 4 } else { 2 }
}

fn lt_type(t: DataType) -> Option<lt::cudaDataType_t> {
    Some(match t {
        DataType::CUDA_R_16BF => lt::cudaDataType_t::CUDA_R_16BF,
        DataType::CUDA_R_16F => lt::cudaDataType_t::CUDA_R_16F,
        DataType::CUDA_R_32F => lt::cudaDataType_t::CUDA_R_32F,
        _ => return None,
    })
}

impl Gemms {
    /// The workspace, set on `blas` too (a fixed address that CUDA graphs may record), and
    /// a cuBLASLt handle.
    pub(super) fn new(stream: &std::sync::Arc<CudaStream>, blas: &CudaBlas) -> Result<Self, DeviceError> {
        use cudarc::driver::DevicePtrMut;
        let mut workspace = stream.alloc_zeros::<u8>(BLAS_WORKSPACE).map_err(err)?;
        let ws_ptr = workspace.device_ptr_mut(stream).0;
        // SAFETY: the workspace lives as long as the handle (both are fields of the device).
        unsafe {
            cudarc::cublas::sys::cublasSetWorkspace_v2(*blas.handle(), ws_ptr as *mut _, BLAS_WORKSPACE)
        }
        .result()
        .map_err(err)?;
        // Made before cuBLASLt's objects, so that Drop frees those made if a later one fails.
        let mut gemms = Self {
            workspace,
            ws_ptr,
            handle: std::ptr::null_mut(),
            desc: std::ptr::null_mut(),
            shapes: RefCell::default(),
            last_on_lt: Cell::new(false),
        };
        // Without libcublasLt (it ships with libcublas) every GEMM stays on cublasGemmEx.
        // SAFETY: only tries to open the library.
        if !unsafe { lt::is_culib_present() } {
            return Ok(gemms);
        }
        let t = Op::CUBLAS_OP_T;
        // SAFETY: out-pointers to fill; the attribute is a cublasOperation_t, as given.
        unsafe {
            lt::cublasLtCreate(&mut gemms.handle).result().map_err(lt_err("cuBLASLt handle"))?;
            lt::cublasLtMatmulDescCreate(
                &mut gemms.desc,
                lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                lt::cudaDataType_t::CUDA_R_32F,
            )
            .result()
            .map_err(lt_err("cuBLASLt matmul descriptor"))?;
            lt::cublasLtMatmulDescSetAttribute(
                gemms.desc,
                lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                (&t as *const Op).cast(),
                size_of::<Op>(),
            )
            .result()
            .map_err(lt_err("cuBLASLt transpose"))?;
        }
        Ok(gemms)
    }

    /// cuBLASLt's handle and the workspace (address, bytes), where cuBLASLt is present.
    pub(super) fn lt(&self) -> Option<(lt::cublasLtHandle_t, CUdeviceptr, usize)> {
        (!self.handle.is_null()).then_some((self.handle, self.ws_ptr, self.workspace.len()))
    }

    /// The algorithm a GEMM of `m` rows of `key` runs, noting the shape and its rows.
    fn algo(&self, key: ShapeKey, m: usize) -> Algo {
        let mut shapes = self.shapes.borrow_mut();
        let shape = shapes.entry(key).or_insert_with(|| Shape {
            rows_seen: 0,
            algos: BTreeMap::new(),
            // SAFETY: layouts of the shape's own types and sizes.
            layouts: if self.desc.is_null() { None } else { unsafe { Self::layouts(key) } },
        });
        shape.rows_seen = shape.rows_seen.max(m);
        shape.algos.range(m..).next().map_or(Algo::GemmEx, |(_, a)| *a)
    }

    /// # Safety
    /// Creates cuBLASLt objects only.
    unsafe fn layouts(key: ShapeKey) -> Option<[lt::cublasLtMatrixLayout_t; 3]> {
        let (ty, c_ty) = (lt_type(key.ty)?, lt_type(key.c_ty)?);
        let mut out = [std::ptr::null_mut(); 3];
        // (type, rows, columns): the weight k × n, x k × m and the output n × m, m set later.
        for (l, (t, rows, cols)) in out.iter_mut().zip([(ty, key.k, key.n), (ty, key.k, 1), (c_ty, key.n, 1)])
        {
            // SAFETY: an out-pointer; the leading dimension is the rows (packed columns).
            unsafe { lt::cublasLtMatrixLayoutCreate(l, t, rows as u64, cols as u64, rows as i64) }
                .result()
                .ok()?;
        }
        Some(out)
    }

    /// Runs `algo` for `m` rows of `key`: `out = w · x + beta · out` (column-major, w
    /// transposed).
    ///
    /// # Safety
    /// The pointers must hold the shape's operands for `m` rows until the stream ran it.
    unsafe fn run(
        &self,
        stream: &CudaStream,
        key: ShapeKey,
        algo: &lt::cublasLtMatmulAlgo_t,
        m: usize,
        (w, x, out): (CUdeviceptr, CUdeviceptr, CUdeviceptr),
        beta: f32,
    ) -> Result<(), CublasError> {
        let shapes = self.shapes.borrow();
        let Some([lw, lx, lo]) = shapes.get(&key).and_then(|s| s.layouts) else {
            return Err(CublasError(lt::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED));
        };
        let alpha = 1.0f32;
        // SAFETY: the layouts are this shape's; the caller's operands.
        unsafe {
            set_cols(&[lx, lo], m)?;
            lt::cublasLtMatmul(
                self.handle,
                self.desc,
                (&alpha as *const f32).cast(),
                w as *const c_void,
                lw,
                x as *const c_void,
                lx,
                (&beta as *const f32).cast(),
                out as *const c_void,
                lo,
                out as *mut c_void,
                lo,
                algo,
                self.ws_ptr as *mut c_void,
                self.workspace.len(),
                stream.cu_stream() as _,
            )
            .result()
        }
    }

    /// cuBLASLt's heuristic candidates for `m` rows of `key` (its layouts set to m).
    fn candidates(&self, key: ShapeKey, m: usize) -> Vec<lt::cublasLtMatmulAlgo_t> {
        let shapes = self.shapes.borrow();
        let Some(layouts) = shapes.get(&key).and_then(|s| s.layouts) else { return Vec::new() };
        // SAFETY: cuBLASLt objects of this shape.
        unsafe {
            if set_cols(&layouts[1..], m).is_err() {
                return Vec::new();
            }
            heuristic((self.handle, self.desc), layouts, BLAS_WORKSPACE, CANDIDATES)
        }
    }
}

/// cuBLASLt's heuristic candidates, at most `count`, for `desc` over the layouts of the
/// weight, x and the output, within `ws` bytes of workspace; none where it offers none.
///
/// # Safety
/// The handle, descriptor and layouts must be live.
pub(super) unsafe fn heuristic(
    (handle, desc): (lt::cublasLtHandle_t, lt::cublasLtMatmulDesc_t),
    [lw, lx, lo]: [lt::cublasLtMatrixLayout_t; 3],
    ws: usize,
    count: usize,
) -> Vec<lt::cublasLtMatmulAlgo_t> {
    let ws = ws as u64;
    let mut pref = std::ptr::null_mut();
    // SAFETY: the caller's live objects, and out-pointers sized as passed.
    unsafe {
        if lt::cublasLtMatmulPreferenceCreate(&mut pref).result().is_err() {
            return Vec::new();
        }
        let attr = lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES;
        let mut found = vec![std::mem::zeroed::<lt::cublasLtMatmulHeuristicResult_t>(); count];
        let mut got = 0;
        let asked = lt::cublasLtMatmulPreferenceSetAttribute(pref, attr, (&ws as *const u64).cast(), 8)
            .result()
            .and_then(|_| {
                lt::cublasLtMatmulAlgoGetHeuristic(
                    handle,
                    desc,
                    lw,
                    lx,
                    lo,
                    lo,
                    pref,
                    count as i32,
                    found.as_mut_ptr(),
                    &mut got,
                )
                .result()
            });
        lt::cublasLtMatmulPreferenceDestroy(pref);
        if asked.is_err() {
            return Vec::new();
        }
        found.truncate(got.max(0) as usize);
        found.into_iter().filter(|r| r.state.result().is_ok()).map(|r| r.algo).collect()
    }
}

/// Sets layouts (x's and the output's) to `m` columns: the GEMM's rows.
///
/// # Safety
/// The layouts must be live.
pub(super) unsafe fn set_cols(layouts: &[lt::cublasLtMatrixLayout_t], m: usize) -> Result<(), CublasError> {
    let cols = m as u64;
    let attr = lt::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_COLS;
    for &l in layouts {
        // SAFETY: the caller's live layout; the attribute is a u64.
        unsafe { lt::cublasLtMatrixLayoutSetAttribute(l, attr, (&cols as *const u64).cast(), 8) }.result()?;
    }
    Ok(())
}

impl Drop for Gemms {
    fn drop(&mut self) {
        // SAFETY: objects made by `new` and `layouts`, destroyed once; nothing uses them after.
        unsafe {
            for shape in self.shapes.get_mut().values() {
                for l in shape.layouts.into_iter().flatten() {
                    lt::cublasLtMatrixLayoutDestroy(l);
                }
            }
            if !self.desc.is_null() {
                lt::cublasLtMatmulDescDestroy(self.desc);
            }
            if !self.handle.is_null() {
                lt::cublasLtDestroy(self.handle);
            }
        }
    }
}

/// Scratch operands for timing: a weight, x and the output, each as large as the largest
/// point needs.
struct Operands {
    w: CudaSlice<u16>,
    x: CudaSlice<u16>,
    out: CudaSlice<u8>,
}

impl CudaDevice {
    /// `out = x · wᵀ + beta · out` for a projection's 16-bit weight `w` `[n, k]` and x
    /// `[m, k]` of type `ty`, out `[m, n]` of type `c_ty`, by the algorithm tuned for the
    /// shape and rows (cublasGemmEx where none was, or where cuBLASLt refuses the call).
    ///
    /// # Safety
    /// As [`Self::gemm_raw`]: the addresses hold the operands while the stream runs the call.
    pub(super) unsafe fn gemm_tuned(
        &self,
        (ty, c_ty): (DataType, DataType),
        (w, x, out): (CUdeviceptr, CUdeviceptr, CUdeviceptr),
        (n, m, k): (usize, usize, usize),
        beta: f32,
    ) -> DevResult<()> {
        let key = ShapeKey { ty, c_ty, n, k };
        if let Algo::Lt(algo) = self.gemms.algo(key, m) {
            // SAFETY: the caller's operands.
            if unsafe { self.gemms.run(&self.stream, key, &algo, m, (w, x, out), beta) }.is_ok() {
                self.gemms.last_on_lt.set(true);
                return Ok(());
            }
        }
        self.gemms.last_on_lt.set(false);
        // SAFETY: the caller's operands.
        unsafe { self.gemm_raw(ty, Op::CUBLAS_OP_T, (n, m, k), (w, k), (x, k), beta, (out, n, c_ty)) }
    }

    /// Whether the last 16-bit projection past the GEMV's rows ran a cuBLASLt algorithm (as
    /// tuned), rather than cublasGemmEx.
    pub fn last_gemm_on_cublaslt(&self) -> bool {
        self.gemms.last_on_lt.get()
    }

    /// Times every projection shape this device has run at each of `rows` (those past the
    /// GEMV's rows and up to the most rows the shape has had) and keeps the algorithm that
    /// `pick` chooses from the candidates' times, cublasGemmEx's first. `Device::tune_gemms`
    /// picks the fastest.
    pub fn tune_gemms_by(&self, rows: &[usize], pick: &dyn Fn(&[f64]) -> usize) -> DevResult<GemmTuning> {
        let mut points: Vec<(ShapeKey, usize)> = {
            let shapes = self.gemms.shapes.borrow();
            let mut keys: Vec<_> = shapes.iter().filter(|(_, s)| s.layouts.is_some()).collect();
            keys.sort_by_key(|(k, _)| **k);
            keys.into_iter()
                .flat_map(|(k, s)| {
                    rows.iter().filter(|&&r| r > GEMV_ROWS && r <= s.rows_seen).map(|&r| (*k, r))
                })
                .collect()
        };
        points.dedup();
        let mut report = GemmTuning::default();
        if points.is_empty() {
            return Ok(report);
        }
        let Some(mut ops) = self.tuning_operands(&points) else {
            report.skipped = points.len();
            return Ok(report);
        };
        let events =
            [(); 2].map(|_| self.ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)));
        let [Ok(e0), Ok(e1)] = events else {
            return Err(DeviceError::Other("CUDA events for GEMM timing".into()));
        };
        let mut filled = None;
        for (key, m) in points {
            if filled != Some(key.ty) {
                self.fill_random(&mut ops, key.ty)?;
                filled = Some(key.ty);
            }
            let (algo, timed) = self.tune_point(key, m, &mut ops, (&e0, &e1), pick)?;
            if let Some(shape) = self.gemms.shapes.borrow_mut().get_mut(&key) {
                shape.algos.insert(m, algo);
            }
            report.points += 1;
            report.lt_chosen += usize::from(matches!(algo, Algo::Lt(_)));
            report.candidates += timed.candidates;
            report.rejected += timed.rejected;
            report.gemm_ex_us += timed.gemm_ex_us;
            report.chosen_us += timed.chosen_us;
        }
        Ok(report)
    }

    /// Scratch operands for `points`, or None where GPU memory does not hold them.
    fn tuning_operands(&self, points: &[(ShapeKey, usize)]) -> Option<Operands> {
        let most = |f: &dyn Fn(&(ShapeKey, usize)) -> usize| points.iter().map(f).max().unwrap_or(1);
        let w = most(&|(k, _)| k.n * k.k);
        let x = most(&|(k, m)| m * k.k);
        let out = most(&|(k, m)| m * k.n * value_bytes(k.c_ty));
        // SAFETY: filled before any read (`fill_random`, and each GEMM writes its output).
        let ops = unsafe { (self.uninit::<u16>(w), self.uninit::<u16>(x), self.uninit::<u8>(out)) };
        match ops {
            (Ok(w), Ok(x), Ok(out)) => Some(Operands { w, x, out }),
            _ => {
                tracing::warn!(
                    weight_mib = (w * 2) >> 20,
                    x_mib = (x * 2) >> 20,
                    out_mib = out >> 20,
                    "GEMMs not tuned: their timing operands do not fit in GPU memory"
                );
                None
            }
        }
    }

    /// Fills the weight and x scratch with values in [-1, 1) of 16-bit type `ty`: GEMMs
    /// run at a speed that depends on what they multiply (zeros draw less power).
    fn fill_random(&self, ops: &mut Operands, ty: DataType) -> DevResult<()> {
        let kind: i32 = if ty == DataType::CUDA_R_16F { 2 } else { 1 };
        for (i, buf) in [&mut ops.w, &mut ops.x].into_iter().enumerate() {
            let (n, seed) = (buf.len() as i64, i as u32 + 1);
            let cfg = LaunchConfig { grid_dim: (1024, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: buf holds n 16-bit values.
            unsafe {
                self.stream
                    .launch_builder(self.f("fill_random_16"))
                    .arg(buf)
                    .arg(&n)
                    .arg(&kind)
                    .arg(&seed)
                    .launch(cfg)
            }
            .map_err(cuda("fill launch"))?;
        }
        Ok(())
    }
}

/// One point's timing: candidates timed and dropped, and one GEMM's time by cublasGemmEx
/// and by the chosen algorithm (µs).
struct Timed {
    candidates: usize,
    rejected: usize,
    gemm_ex_us: f64,
    chosen_us: f64,
}

impl CudaDevice {
    /// Times cublasGemmEx and cuBLASLt's candidates at `m` rows of `key` and returns the
    /// one `pick` takes.
    fn tune_point(
        &self,
        key: ShapeKey,
        m: usize,
        ops: &mut Operands,
        (e0, e1): (&cudarc::driver::CudaEvent, &cudarc::driver::CudaEvent),
        pick: &dyn Fn(&[f64]) -> usize,
    ) -> DevResult<(Algo, Timed)> {
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        let ptrs = (
            ops.w.device_ptr(&self.stream).0,
            ops.x.device_ptr(&self.stream).0,
            ops.out.device_ptr_mut(&self.stream).0,
        );
        let out_len = m * key.n;
        // SAFETY (every run below): the operands hold m rows of the shape.
        let run = |algo: &Algo| -> DevResult<()> {
            match algo {
                Algo::GemmEx => unsafe {
                    self.gemm_raw(
                        key.ty,
                        Op::CUBLAS_OP_T,
                        (key.n, m, key.k),
                        (ptrs.0, key.k),
                        (ptrs.1, key.k),
                        0.0,
                        (ptrs.2, key.n, key.c_ty),
                    )
                },
                Algo::Lt(a) => unsafe { self.gemms.run(&self.stream, key, a, m, ptrs, 0.0) }
                    .map_err(|s| DeviceError::Other(format!("cuBLASLt matmul: {s:?}"))),
            }
        };
        run(&Algo::GemmEx)?;
        let reference = self.output_sample(ptrs.2, out_len, key.c_ty)?;
        let found = self.gemms.candidates(key, m);
        let mut algos = vec![Algo::GemmEx];
        let out_bytes = out_len * value_bytes(key.c_ty);
        for a in &found {
            let algo = Algo::Lt(*a);
            // NaNs first, so that a candidate that writes nothing can not pass for one that agrees.
            // SAFETY: the output scratch holds out_bytes.
            unsafe {
                cudarc::driver::result::memset_d8_async(ptrs.2, 0xff, out_bytes, self.stream.cu_stream())
            }
            .map_err(cuda("GEMM output reset"))?;
            if run(&algo).is_ok() && agrees(&self.output_sample(ptrs.2, out_len, key.c_ty)?, &reference) {
                algos.push(algo);
            }
        }
        let time = |algo: &Algo, reps: usize| -> DevResult<f64> {
            e0.record(&self.stream).map_err(cuda("event record"))?;
            for _ in 0..reps {
                run(algo)?;
            }
            e1.record(&self.stream).map_err(cuda("event record"))?;
            Ok(e0.elapsed_ms(e1).map_err(cuda("event time"))? as f64 * 1000.0 / reps as f64)
        };
        let first = algos.iter().map(|a| time(a, 1)).collect::<DevResult<Vec<f64>>>()?;
        let reps =
            (TIMED_US / first.iter().cloned().fold(f64::MAX, f64::min)).ceil().clamp(1.0, 16.0) as usize;
        let mut best = vec![f64::MAX; algos.len()];
        for _ in 0..2 {
            for (b, a) in best.iter_mut().zip(&algos) {
                *b = b.min(time(a, reps)?);
            }
        }
        let chosen = pick(&best).min(algos.len() - 1);
        let timed = Timed {
            candidates: found.len(),
            rejected: found.len() + 1 - algos.len(),
            gemm_ex_us: best[0],
            chosen_us: best[chosen],
        };
        tracing::debug!(n = key.n, k = key.k, rows = m, candidates = ?best, chosen, "GEMM tuned");
        Ok((algos[chosen], timed))
    }

    /// The first and last [`SAMPLE`] values of an output of `len` values of type `ty`, as f32.
    fn output_sample(&self, out: CUdeviceptr, len: usize, ty: DataType) -> DevResult<Vec<f32>> {
        let size = value_bytes(ty);
        // The head, and the tail where it does not overlap the head.
        let tail = len.saturating_sub(SAMPLE).max(SAMPLE.min(len));
        let mut values = Vec::new();
        for r in [0..SAMPLE.min(len), tail..len] {
            if r.is_empty() {
                continue;
            }
            let mut bytes = vec![0u8; r.len() * size];
            // SAFETY: out holds len values of `size` bytes; r lies within them.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    &mut bytes,
                    out + (r.start * size) as u64,
                    self.stream.cu_stream(),
                )
            }
            .map_err(cuda("GEMM output read-back"))?;
            self.stream.synchronize().map_err(cuda("stream synchronize"))?;
            values.extend(bytes.chunks_exact(size).map(|b| match (size, ty) {
                (4, _) => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
                (_, DataType::CUDA_R_16F) => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
                _ => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
            }));
        }
        Ok(values)
    }
}

/// Whether a candidate's output sample matches cublasGemmEx's: each value within 1 % of
/// its magnitude plus the sample's mean magnitude (summation orders differ; a wrong layout
/// or a broken kernel does not come close).
fn agrees(got: &[f32], reference: &[f32]) -> bool {
    let scale = reference.iter().map(|v| v.abs() as f64).sum::<f64>() / reference.len().max(1) as f64;
    got.len() == reference.len()
        && got.iter().zip(reference).all(|(&a, &b)| ((a - b).abs() as f64) <= 1e-2 * (b.abs() as f64 + scale))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_candidate_agrees_within_rounding_and_not_past_it() {
        let reference = [1.0f32, -2.0, 0.5, 0.0];
        assert!(super::agrees(&[1.001, -2.002, 0.5005, 0.001], &reference));
        assert!(!super::agrees(&[1.0, -2.0, 0.5, 0.5], &reference), "a zero that became 0.5");
        assert!(!super::agrees(&[-1.0, -2.0, 0.5, 0.0], &reference), "a flipped sign");
        assert!(!super::agrees(&[1.0, -2.0, 0.5], &reference), "a short sample");
        assert!(!super::agrees(&[1.0, f32::NAN, 0.5, 0.0], &reference), "a value never written");
    }
}
