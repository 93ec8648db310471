//! W8A8 GEMMs for FP8 weights with one scale a row (per-tensor and per-channel FP8
//! checkpoints, and `--quantization fp8` at load), past the GEMV's rows: each row of x is
//! quantized to e4m3 with its own scale (fp8.cu's `quantize_fp8_rows`: vLLM's dynamic
//! per-token scales), cuBLASLt multiplies the two FP8 operands on the tensor cores (sm_89
//! and later) into f32 sums, and `fp8_scale_sums` applies x's and the weight's row scales
//! to them. The weight is read as it is kept: its rows' e4m3 values, the rows' length in
//! bytes the leading dimension; its scales are a contiguous copy made at upload. Nothing
//! is widened to 16 bits, as the prompts of other packed rows are (`widen_rows`).
//!
//! The scales come after the GEMM because cuBLASLt 13.1 on Hopper takes FP8 scales only as
//! scalars: it refuses its outer-vector and 128-element block modes there, and a vector
//! alpha. Where it offers no algorithm for a shape, that shape keeps the widening path.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::cublas::sys::cublasOperation_t as Op;
use cudarc::cublas::sys::cudaDataType as DataType;
use cudarc::cublaslt::sys as lt;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::tune::{heuristic, set_cols};
use super::{CudaDevice, CudaWeight, DevResult, DeviceError, WeightBuf, cuda};
use crate::kernels::rows::RowKind;

/// A W8A8 GEMM's shape: the weight's rows, columns and row bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    n: usize,
    k: usize,
    row_bytes: usize,
}

struct Shape {
    /// Layouts of the weight (k × n, leading dimension its row bytes), x (k × m) and the
    /// output (n × m); m is set at each call.
    layouts: [lt::cublasLtMatrixLayout_t; 3],
    /// cuBLASLt's first candidate by the power of two of rows it was asked for (None: it
    /// offered none).
    algos: HashMap<usize, Option<lt::cublasLtMatmulAlgo_t>>,
}

/// cuBLASLt's descriptor for FP8 operands and f32 sums, and its layouts and algorithms per
/// shape.
pub(super) struct Fp8Gemms {
    desc: lt::cublasLtMatmulDesc_t,
    shapes: RefCell<HashMap<Key, Option<Shape>>>,
}

/// Whether a GPU of this compute capability multiplies FP8 on its tensor cores.
pub(super) fn has_fp8_mma(major: i32, minor: i32) -> bool {
    (major, minor) >= (8, 9)
}

/// 0 for f32, 1 for bf16, 2 for f16: the kinds fp8.cu's kernels take.
fn kind(t: DataType) -> i32 {
    match t {
        DataType::CUDA_R_16BF => 1,
        DataType::CUDA_R_16F => 2,
        _ => 0,
    }
}

/// # Safety
/// `value` must be of the type cuBLASLt documents for `attr`.
unsafe fn set_desc<T>(
    desc: lt::cublasLtMatmulDesc_t,
    attr: lt::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> bool {
    // SAFETY: the caller's attribute type; the size is the value's.
    unsafe { lt::cublasLtMatmulDescSetAttribute(desc, attr, (value as *const T).cast(), size_of::<T>()) }
        .result()
        .is_ok()
}

impl Fp8Gemms {
    /// The descriptor: f32 compute and scale, the weight transposed.
    pub(super) fn new() -> Option<Self> {
        let mut desc = std::ptr::null_mut();
        // SAFETY: an out-pointer; the attribute is given its documented type.
        unsafe {
            lt::cublasLtMatmulDescCreate(
                &mut desc,
                lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                lt::cudaDataType_t::CUDA_R_32F,
            )
            .result()
            .ok()?;
            let made = Self { desc, shapes: RefCell::default() };
            let transa = lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA;
            set_desc(desc, transa, &Op::CUBLAS_OP_T).then_some(made)
        }
    }

    /// The shape's layouts, made at its first GEMM; None where cuBLASLt refuses them.
    fn shape(&self, key: Key) -> bool {
        let mut shapes = self.shapes.borrow_mut();
        shapes
            .entry(key)
            .or_insert_with(|| {
                let e4m3 = lt::cudaDataType_t::CUDA_R_8F_E4M3;
                let mut layouts = [std::ptr::null_mut(); 3];
                let specs = [
                    (e4m3, key.k, key.n, key.row_bytes),
                    (e4m3, key.k, 1, key.k),
                    (lt::cudaDataType_t::CUDA_R_32F, key.n, 1, key.n),
                ];
                for (i, (t, rows, cols, ld)) in specs.into_iter().enumerate() {
                    // SAFETY: an out-pointer; made layouts are destroyed on failure.
                    let made = unsafe {
                        lt::cublasLtMatrixLayoutCreate(
                            &mut layouts[i],
                            t,
                            rows as u64,
                            cols as u64,
                            ld as i64,
                        )
                    };
                    if made.result().is_err() {
                        for l in &layouts[..i] {
                            // SAFETY: made above, used nowhere else.
                            unsafe { lt::cublasLtMatrixLayoutDestroy(*l) };
                        }
                        return None;
                    }
                }
                Some(Shape { layouts, algos: HashMap::new() })
            })
            .is_some()
    }

    /// The algorithm for `m` rows of `key`: cuBLASLt's first candidate for the power of two
    /// at or above m (an algorithm for more rows serves fewer), asked once.
    fn algo(
        &self,
        handle: lt::cublasLtHandle_t,
        ws: usize,
        key: Key,
        m: usize,
    ) -> Option<lt::cublasLtMatmulAlgo_t> {
        let bucket = m.next_power_of_two();
        let mut shapes = self.shapes.borrow_mut();
        let shape = shapes.get_mut(&key)?.as_mut()?;
        if let Some(a) = shape.algos.get(&bucket) {
            return *a;
        }
        // SAFETY: this shape's live layouts and the descriptor.
        let found = unsafe {
            match set_cols(&shape.layouts[1..], bucket) {
                Ok(()) => heuristic((handle, self.desc), shape.layouts, ws, 1).first().copied(),
                Err(_) => None,
            }
        };
        if found.is_none() {
            tracing::info!(
                n = key.n,
                k = key.k,
                rows = bucket,
                "cuBLASLt offers no FP8 GEMM for this shape: its prompts widen the weight instead"
            );
        }
        shape.algos.insert(bucket, found);
        found
    }
}

impl Drop for Fp8Gemms {
    fn drop(&mut self) {
        // SAFETY: objects made by `new` and `shape`, destroyed once; nothing uses them after.
        unsafe {
            for shape in self.shapes.get_mut().values().flatten() {
                for l in shape.layouts {
                    lt::cublasLtMatrixLayoutDestroy(l);
                }
            }
            lt::cublasLtMatmulDescDestroy(self.desc);
        }
    }
}

impl CudaDevice {
    /// `out = x @ wᵀ + beta · out` as a W8A8 GEMM, for FP8 rows with one scale a row: `out`
    /// holds `m · n` values of `out_ty` (f32, or the weights' 16-bit type) and `xp` is x
    /// (`m` rows) in the weights' 16-bit type. False, having run nothing, where this does
    /// not apply (other weights, a GPU without FP8 tensor cores, a shape cuBLASLt offers
    /// nothing for).
    pub(super) fn fp8_gemm(
        &self,
        xp: CUdeviceptr,
        m: usize,
        w: &CudaWeight,
        (out, out_ty): (CUdeviceptr, DataType),
        beta: f32,
    ) -> DevResult<bool> {
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        let (Some(fp8), Some((handle, ws_ptr, ws_len))) = (self.fp8.as_ref(), self.gemms.lt()) else {
            return Ok(false);
        };
        let WeightBuf::Rows { buf, format, scales: Some(w_scales) } = &w.buf else { return Ok(false) };
        let (n, k) = (w.shape[0], w.shape[1]);
        if format.kind != RowKind::Fp8 || format.group != 0 || !n.is_multiple_of(4) {
            return Ok(false);
        }
        let key = Key { n, k, row_bytes: format.row_bytes() };
        if !fp8.shape(key) {
            return Ok(false);
        }
        let Some(algo) = fp8.algo(handle, ws_len, key, m) else { return Ok(false) };
        // x's e4m3 values (m · k bytes, 256-byte aligned for the scales after them) and scales.
        let q_bytes = (m * k).next_multiple_of(256);
        let mut scratch = self.fp8_x.borrow_mut();
        if scratch.as_ref().is_none_or(|b| b.len() < q_bytes + 4 * m) {
            // SAFETY: quantize_fp8_rows writes the m · k values and m scales read below.
            *scratch = Some(unsafe { self.uninit::<u8>((q_bytes + 4 * m).next_power_of_two()) }?);
        }
        let qp = scratch.as_mut().expect("allocated above").device_ptr_mut(&self.stream).0;
        let sp = qp + q_bytes as u64;
        let name = if format.f16 { "quantize_fp8_rows_f16" } else { "quantize_fp8_rows_bf16" };
        let ki = k as i32;
        let cfg = LaunchConfig { grid_dim: (m as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        {
            let _t = self.span(name, (0, 0), m);
            // SAFETY: x holds m · k 16-bit values (k % 16 == 0 for FP8 rows), q m · k bytes,
            // the scales m floats; a block a row.
            unsafe {
                self.stream.launch_builder(self.f(name)).arg(&xp).arg(&ki).arg(&qp).arg(&sp).launch(cfg)
            }
            .map_err(cuda("quantize_fp8_rows launch"))?;
        }
        // The f32 sums go to out itself where it is f32 and overwritten, else to a buffer.
        let in_place = out_ty == DataType::CUDA_R_32F && beta == 0.0;
        let mut sums = if in_place { None } else { Some(self.tensor(m, n)?) };
        let raw = sums.as_mut().map_or(out, |t| t.buf.device_ptr_mut(&self.stream).0);
        let wp = buf.device_ptr(&self.stream).0;
        {
            let shapes = fp8.shapes.borrow();
            let shape = shapes.get(&key).and_then(Option::as_ref).expect("made by shape()");
            let (alpha, zero) = (1.0f32, 0.0f32);
            let _t = self.span("gemm_fp8", (n, k), m);
            // SAFETY: the weight holds n rows of row_bytes (their first k bytes e4m3), q m rows
            // of k e4m3 bytes, raw m · n floats; all live until the stream has run the GEMM.
            let ran = unsafe {
                set_cols(&shape.layouts[1..], m).is_ok() && {
                    let [lw, lx, lo] = shape.layouts;
                    lt::cublasLtMatmul(
                        handle,
                        fp8.desc,
                        (&alpha as *const f32).cast(),
                        wp as *const c_void,
                        lw,
                        qp as *const c_void,
                        lx,
                        (&zero as *const f32).cast(),
                        raw as *const c_void,
                        lo,
                        raw as *mut c_void,
                        lo,
                        &algo,
                        ws_ptr as *mut c_void,
                        ws_len,
                        self.stream.cu_stream() as _,
                    )
                    .result()
                    .is_ok()
                }
            };
            if !ran {
                return Err(DeviceError::Other(format!(
                    "cuBLASLt refused its own FP8 GEMM for a [{n}, {k}] weight, {m} rows"
                )));
            }
        }
        let out_kind = kind(out_ty);
        let (mi, ni) = (m as i32, n as i32);
        let wsp = w_scales.device_ptr(&self.stream).0;
        let _t = self.span("fp8_scale_sums", (0, 0), m);
        // SAFETY: raw holds m · n floats (out itself where in place), the scales m and n,
        // out m · n values of its kind; n % 4 == 0, a thread 4 of them.
        unsafe {
            self.stream
                .launch_builder(self.f("fp8_scale_sums"))
                .arg(&raw)
                .arg(&sp)
                .arg(&wsp)
                .arg(&out)
                .arg(&out_kind)
                .arg(&mi)
                .arg(&ni)
                .arg(&beta)
                .launch(Self::grid(m * n / 4))
        }
        .map_err(cuda("fp8_scale_sums launch"))?;
        Ok(true)
    }
}

/// Where the device keeps x's FP8 values for these GEMMs: grown as needed, like the
/// 16-bit scratch (the profiling step's largest batch comes before any graph).
pub(super) type Fp8Scratch = RefCell<Option<CudaSlice<u8>>>;
