//! GEMMs through cuBLAS: `out = x @ wᵀ` for f32 weights (sgemm) and 16-bit weights
//! (f32 accumulation and output, by the algorithm tuned for the shape (tune.rs); up to 8
//! rows our own GEMV on tensor cores),
//! and cublasGemmEx on raw operands, plain and strided-batched, for LoRA's GEMMs (lora.rs).

use cudarc::cublas::sys::cublasOperation_t as Op;
use cudarc::cublas::sys::cudaDataType as DataType;
use cudarc::cublas::{Gemm, GemmConfig};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::lora::GemmOut;
use super::{
    CudaDevice, CudaLora, CudaTensor, CudaWeight, DevResult, DeviceError, RowScale, WeightBuf, cuda,
};
use crate::kernels::rows::{RowFormat, RowKind};
use crate::kernels::{Activation, LoraRows};

/// How `Device::gate_up_act` ran: the projection written in f32 then act_mul, written in
/// the weights' 16-bit type then act_mul, or one GEMV with act·mul in its epilogue.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum GateUpPath {
    F32,
    In16Bits,
    Gemv,
}

/// Rows of x up to which 16-bit GEMMs take the tensor-core GEMV (gemv.cu) instead of cuBLAS:
/// decode steps of a few sequences, which only stream the weights.
pub(super) const GEMV_ROWS: usize = 8;

/// gemv.cu's kernels by (wide, rows (16-bit, 4-bit, FP8), f16) as `gemv_cfg` picks them.
const GEMV_KERNELS: [GemvKernels; 12] = [
    GemvKernels {
        plain: "gemv_bf16",
        act: "gemv_act_bf16",
        res_norm: "gemv_res_norm_bf16",
        qkv_rope: "gemv_qkv_rope_bf16",
    },
    GemvKernels {
        plain: "gemv_f16",
        act: "gemv_act_f16",
        res_norm: "gemv_res_norm_f16",
        qkv_rope: "gemv_qkv_rope_f16",
    },
    GemvKernels {
        plain: "gemv_int4_bf16",
        act: "gemv_act_int4_bf16",
        res_norm: "gemv_res_norm_int4_bf16",
        qkv_rope: "gemv_qkv_rope_int4_bf16",
    },
    GemvKernels {
        plain: "gemv_int4_f16",
        act: "gemv_act_int4_f16",
        res_norm: "gemv_res_norm_int4_f16",
        qkv_rope: "gemv_qkv_rope_int4_f16",
    },
    GemvKernels {
        plain: "gemv_fp8_bf16",
        act: "gemv_act_fp8_bf16",
        res_norm: "gemv_res_norm_fp8_bf16",
        qkv_rope: "gemv_qkv_rope_fp8_bf16",
    },
    GemvKernels {
        plain: "gemv_fp8_f16",
        act: "gemv_act_fp8_f16",
        res_norm: "gemv_res_norm_fp8_f16",
        qkv_rope: "gemv_qkv_rope_fp8_f16",
    },
    GemvKernels {
        plain: "gemv_wide_bf16",
        act: "gemv_act_wide_bf16",
        res_norm: "gemv_res_norm_wide_bf16",
        qkv_rope: "gemv_qkv_rope_wide_bf16",
    },
    GemvKernels {
        plain: "gemv_wide_f16",
        act: "gemv_act_wide_f16",
        res_norm: "gemv_res_norm_wide_f16",
        qkv_rope: "gemv_qkv_rope_wide_f16",
    },
    GemvKernels {
        plain: "gemv_wide_int4_bf16",
        act: "gemv_act_wide_int4_bf16",
        res_norm: "gemv_res_norm_wide_int4_bf16",
        qkv_rope: "gemv_qkv_rope_wide_int4_bf16",
    },
    GemvKernels {
        plain: "gemv_wide_int4_f16",
        act: "gemv_act_wide_int4_f16",
        res_norm: "gemv_res_norm_wide_int4_f16",
        qkv_rope: "gemv_qkv_rope_wide_int4_f16",
    },
    GemvKernels {
        plain: "gemv_wide_fp8_bf16",
        act: "gemv_act_wide_fp8_bf16",
        res_norm: "gemv_res_norm_wide_fp8_bf16",
        qkv_rope: "gemv_qkv_rope_wide_fp8_bf16",
    },
    GemvKernels {
        plain: "gemv_wide_fp8_f16",
        act: "gemv_act_wide_fp8_f16",
        res_norm: "gemv_res_norm_wide_fp8_f16",
        qkv_rope: "gemv_qkv_rope_wide_fp8_f16",
    },
];

/// The GEMV kernels of one width and weight type: plain, gate/up with act(gate)·up, the
/// projection added to the residual with the next norm left to the GEMV after it, and the
/// qkv projection with RoPE into the cache.
pub(super) struct GemvKernels {
    plain: &'static str,
    act: &'static str,
    res_norm: &'static str,
    pub(super) qkv_rope: &'static str,
}

/// A weight as the GEMV kernels take it (gemv.cu's `GEMV_W`): its address, its 16-bit
/// type (1 bf16, 2 f16), and for packed rows (kernels/rows.rs) their format.
pub(super) struct GemvWeight {
    pub(super) ptr: CUdeviceptr,
    pub(super) kind: i32,
    pub(super) rows: Option<RowFormat>,
}

impl GemvWeight {
    /// The kernels' three weight arguments: address, row bytes, group (0, 0 for 16-bit rows).
    pub(super) fn args(&self) -> (CUdeviceptr, i64, i32) {
        match self.rows {
            Some(f) => (self.ptr, f.row_bytes() as i64, f.group as i32),
            None => (self.ptr, 0, 0),
        }
    }

    /// The kernels' family in [`GEMV_KERNELS`]: 16-bit rows, 4-bit, FP8.
    fn family(&self) -> usize {
        match self.rows.map(|f| f.kind) {
            None => 0,
            Some(RowKind::Int4) => 1,
            Some(RowKind::Fp8) => 2,
        }
    }
}

/// A GEMV's last three arguments (gemv.cu's `NormScale`): where x's norm left its sums of
/// squares, how many a row, and its epsilon; a null address where x is final.
pub(super) type ScaleArgs = (CUdeviceptr, i32, f32);

impl CudaDevice {
    /// `out = x @ wᵀ (+ bias) + beta · out` for `[n, k]` weights w.
    pub(super) fn linear_into(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        bias: Option<&CudaWeight>,
        out: &mut CudaTensor,
        beta: f32,
    ) -> DevResult<()> {
        let (n, k) = (w.shape[0], w.shape[1]);
        assert_eq!(x.cols, k, "linear: input has {} features, weight expects {k}", x.cols);
        assert_eq!((out.rows, out.cols), (x.rows, n), "linear: output shape");
        match &w.buf {
            WeightBuf::F32(wb) => self.gemm(x, wb, n, &mut out.buf, beta)?,
            WeightBuf::Bf16(wb) => self.gemm_16(x, wb, n, &mut out.buf, false, beta)?,
            WeightBuf::F16(wb) => self.gemm_16(x, wb, n, &mut out.buf, true, beta)?,
            WeightBuf::Rows { .. } => self.gemm_rows(x, w, &mut out.buf, beta)?,
        }
        if let Some(b) = bias {
            let _t = self.span("add_bias", (0, 0), x.rows);
            let total = (x.rows * n) as i64;
            let cols = n as i32;
            // SAFETY: out is [rows, n] and b holds n values.
            unsafe {
                self.stream
                    .launch_builder(self.f("add_bias_f32"))
                    .arg(&mut *out.buf)
                    .arg(b.f32())
                    .arg(&cols)
                    .arg(&total)
                    .launch(Self::grid(total as usize))
            }
            .map_err(cuda("bias launch"))?;
        }
        Ok(())
    }

    /// `out = x @ wᵀ + beta · out` via cuBLAS (column-major: outᵀ[n, m] = w[n, k] · xᵀ[k, m]).
    pub(super) fn gemm(
        &self,
        x: &CudaTensor,
        w: &CudaSlice<f32>,
        n: usize,
        out: &mut CudaSlice<f32>,
        beta: f32,
    ) -> DevResult<()> {
        x.f32_values("an f32 GEMM")?;
        let (m, k) = (x.rows as i32, x.cols as i32);
        let cfg = GemmConfig {
            transa: Op::CUBLAS_OP_T,
            transb: Op::CUBLAS_OP_N,
            m: n as i32,
            n: m,
            k,
            alpha: 1.0f32,
            lda: k,
            ldb: k,
            beta,
            ldc: n as i32,
        };
        let _t = self.span("gemm_f32", (n, k as usize), m as usize);
        // SAFETY: w is [n, k] row-major (= k×n column-major, transposed to n×k), x is
        // [m, k] row-major (= k×m column-major), out holds m·n floats.
        unsafe { self.blas.gemm(cfg, w, &*x.buf, out) }.map_err(cuda("cuBLAS sgemm"))
    }

    /// `out = x @ wᵀ + beta · out` for 16-bit weights: x is rounded to the weight's type,
    /// cuBLAS accumulates in f32 and writes f32 (the GEMV only overwrites, beta 0).
    pub(super) fn gemm_16(
        &self,
        x: &CudaTensor,
        w: &CudaSlice<u16>,
        n: usize,
        out: &mut CudaSlice<f32>,
        f16: bool,
        beta: f32,
    ) -> DevResult<()> {
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        let (m, k) = (x.rows, x.cols);
        let ty = if f16 { DataType::CUDA_R_16F } else { DataType::CUDA_R_16BF };
        let (wp, _w) = w.device_ptr(&self.stream);
        let (op, _o) = out.device_ptr_mut(&self.stream);
        let scale = self.scale_args(x);
        self.with_x16(x, if f16 { 2 } else { 1 }, |xp| {
            if self.gemv_fits(m, k) && beta == 0.0 {
                let w = GemvWeight { ptr: wp, kind: if f16 { 2 } else { 1 }, rows: None };
                return self.gemv(&w, (xp, op), (m, n, k), &scale);
            }
            x.final_values("a GEMM")?;
            let _t = self.span(if f16 { "gemm_f16" } else { "gemm_bf16" }, (n, k), m);
            // SAFETY: w is [n, k], x [m, k], out [m, n]; pointers live for the call.
            unsafe { self.gemm_tuned((ty, DataType::CUDA_R_32F), (wp, xp, op), (n, m, k), beta) }
        })
    }

    /// `out = x @ wᵀ + beta · out` for packed rows (4-bit, FP8): up to [`GEMV_ROWS`] rows
    /// the GEMV reads them as they are; past them (prompts), FP8 rows with one scale a row
    /// run W8A8 (`fp8_gemm`) and others are widened to their 16-bit type for cuBLAS
    /// (`widen_rows`).
    fn gemm_rows(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        out: &mut CudaSlice<f32>,
        beta: f32,
    ) -> DevResult<()> {
        use cudarc::driver::DevicePtrMut;
        let (m, n, k) = (x.rows, w.shape[0], w.shape[1]);
        let gw = self.gemv_weight(w).expect("packed rows");
        let op = out.device_ptr_mut(&self.stream).0;
        let scale = self.scale_args(x);
        if self.gemv_fits(m, k) && beta == 0.0 {
            return self.with_x16(x, gw.kind, |xp| self.gemv(&gw, (xp, op), (m, n, k), &scale));
        }
        x.final_values("a GEMM")?;
        if self.with_x16(x, gw.kind, |xp| self.fp8_gemm(xp, m, w, (op, DataType::CUDA_R_32F), beta))? {
            return Ok(());
        }
        let (wp, kind) = self.widen_rows(w)?;
        let ty = if kind == 2 { DataType::CUDA_R_16F } else { DataType::CUDA_R_16BF };
        self.with_x16(x, kind, |xp| {
            let _t = self.span(if kind == 2 { "gemm_f16" } else { "gemm_bf16" }, (n, k), m);
            // SAFETY: the widened w is [n, k], x [m, k], out [m, n]; pointers live for the call.
            unsafe { self.gemm_tuned((ty, DataType::CUDA_R_32F), (wp, xp, op), (n, m, k), beta) }
        })
    }

    /// A weight of packed rows widened to its 16-bit type (gemv.cu's int4_widen and
    /// fp8_widen) in the device's scratch for widened weights, sized at upload for the
    /// largest: its address and kind. The scratch is reused by the next widening, which
    /// the stream orders after this weight's GEMM.
    pub(super) fn widen_rows(&self, w: &CudaWeight) -> DevResult<(CUdeviceptr, i32)> {
        use cudarc::driver::DevicePtrMut;
        let (n, k) = (w.shape[0], w.shape[1]);
        let gw = self.gemv_weight(w).expect("packed rows");
        let (wp, row_bytes, group) = gw.args();
        let mut scratch = self.widened.borrow_mut();
        let buf = scratch.as_mut().filter(|b| b.len() >= n * k).ok_or_else(|| {
            DeviceError::Other(format!(
                "no scratch for widening a [{n}, {k}] packed weight (not uploaded here)"
            ))
        })?;
        let out = buf.device_ptr_mut(&self.stream).0;
        let name = match (gw.family(), gw.kind) {
            (1, 2) => "int4_widen_f16",
            (1, _) => "int4_widen_bf16",
            (_, 2) => "fp8_widen_f16",
            _ => "fp8_widen_bf16",
        };
        let (ni, ki) = (n as i32, k as i32);
        let _t = self.span(name, (n, k), 0);
        // SAFETY: w holds n rows of row_bytes (rows.rs's layout for k columns in groups of
        // `group`), the scratch n · k 16-bit values; a thread 8 of them.
        unsafe {
            self.stream
                .launch_builder(self.f(name))
                .arg(&wp)
                .arg(&row_bytes)
                .arg(&group)
                .arg(&out)
                .arg(&ni)
                .arg(&ki)
                .launch(Self::grid(n * k / 8))
        }
        .map_err(cuda("widen launch"))?;
        Ok((out, gw.kind))
    }

    /// `Device::gate_up_act` for 16-bit weights: without adapters up to [`GEMV_ROWS`] rows,
    /// one GEMV that applies act·mul itself (`gate_up_act_gemv`); past them, with no adapters or
    /// with bf16 adapters whose deltas come first (`CudaDevice::lora_first`): the deltas and
    /// then the projection are written in the weights' 16-bit type, and silu_mul reads
    /// that, so the projection's values cross memory in half the bytes each way; with
    /// `half_only`, silu_mul's result too is written in 16 bits only. None where this does
    /// not apply.
    pub(super) fn gate_up_act_16(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        lora: LoraRows<CudaLora>,
        act_fn: Activation,
        half_only: bool,
    ) -> DevResult<Option<CudaTensor>> {
        use cudarc::driver::DevicePtr;
        let (n, k) = (w.shape[0], w.shape[1]);
        self.gate_up_path.set(GateUpPath::F32);
        if lora.is_none()
            && let Some(act) = self.gate_up_act_gemv(x, w, act_fn, half_only)?
        {
            self.gate_up_path.set(GateUpPath::Gemv);
            return Ok(Some(act));
        }
        let Some(kind) = self.gemv_weight(w).map(|g| g.kind) else { return Ok(None) };
        let rows = x.rows;
        let adapters_fit = lora.is_none_or(|(modules, _)| {
            kind == 1 && modules.iter().all(|(l, _)| l.shape.bf16) && Self::lora_first(rows, modules, n)
        });
        if rows <= GEMV_ROWS || x.cols != k || !adapters_fit {
            return Ok(None);
        }
        self.gate_up_path.set(GateUpPath::In16Bits);
        let ty = if kind == 2 { DataType::CUDA_R_16F } else { DataType::CUDA_R_16BF };
        // rows · n 16-bit values.
        let gate_up = self.tensor((rows * n).div_ceil(2), 1)?;
        let gp = gate_up.buf.device_ptr(&self.stream).0;
        let mut beta = 0.0;
        if let Some((modules, slots)) = lora {
            self.upload_lora_slots(slots)?;
            self.lora_deltas_first.set(true);
            self.lora_gemms(GemmOut { ptr: gp, rows, cols: n, ty }, x, modules, 0.0)?;
            beta = 1.0;
        }
        self.with_x16(x, kind, |xp| {
            // FP8 rows with one scale a row: W8A8 on the tensor cores, else widened.
            if self.fp8_gemm(xp, rows, w, (gp, ty), beta)? {
                return Ok(());
            }
            let wp = match &w.buf {
                WeightBuf::Rows { .. } => self.widen_rows(w)?.0,
                _ => self.gemv_weight(w).expect("16-bit").ptr,
            };
            let _t = self.span(if kind == 2 { "gemm_f16" } else { "gemm_bf16" }, (n, k), rows);
            // SAFETY: w is [n, k] and x [rows, k] of type ty; gate_up holds rows · n values
            // of it.
            unsafe { self.gemm_tuned((ty, ty), (wp, xp, gp), (n, rows, k), beta) }
        })?;
        // SAFETY: gate_up holds rows · n values of the weights' type. With `half_only` (the
        // down projection applies no adapters) its GEMM reads the 16-bit copy alone, past
        // the GEMV's rows as here, so no f32 is written.
        unsafe { self.act_mul_at(gp, kind, rows, n / 2, !half_only, act_fn) }.map(Some)
    }

    /// `act(gate) · up` of `[rows, 2 · inter]` values at `src`, of f32 (`kind` 0) or of
    /// bf16 (1) or f16 (2); the result in f32, with the 16-bit copy the next GEMM reads,
    /// or (without `f32`, where there is a 16-bit copy) in that copy only.
    ///
    /// # Safety
    /// `src` must hold rows · 2 · inter values of its kind until the stream has run the call.
    pub(super) unsafe fn act_mul_at(
        &self,
        src: CUdeviceptr,
        kind: i32,
        rows: usize,
        inter: usize,
        f32: bool,
        act: Activation,
    ) -> DevResult<CudaTensor> {
        let mut out = self.tensor(rows, inter)?;
        let (mut half, half_kind) = self.half(rows, inter)?;
        let half_only = !f32 && half.is_some();
        let (i, r) = (inter as i32, rows as i32);
        // Columns a thread: elementwise.cu's silu_width.
        let width = if kind != 0 && inter.is_multiple_of(8) { 8 } else { 4 };
        let cfg = LaunchConfig {
            grid_dim: (inter.div_ceil(width * 256) as u32, rows.clamp(1, 65535) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let _t = self.span("act_mul", (0, 0), rows);
        let name = ["act_mul_f32", "act_mul_bf16", "act_mul_f16"][kind as usize];
        let code = act_code(act);
        let mut launch = self.stream.launch_builder(self.f(name));
        launch.arg(&src);
        push_outputs(&mut launch, &mut out, &mut half, &half_kind, half_only);
        // SAFETY: the caller's src; out (unless null) is [rows, inter], half (kind ≠ 0)
        // rows·inter 16-bit.
        unsafe { launch.arg(&i).arg(&r).arg(&code).launch(cfg) }.map_err(cuda("act_mul launch"))?;
        out.half = half;
        out.half_only = half_only;
        Ok(out)
    }

    /// Whether `m` rows of x with `k` features take the GEMV (gemv.cu) for 16-bit weights.
    pub(super) fn gemv_fits(&self, m: usize, k: usize) -> bool {
        (1..=GEMV_ROWS).contains(&m) && k.is_multiple_of(8) && self.sm80
    }

    /// A GEMV grid of `blocks` over weights `w`: its kernels (the `_wide` ones,
    /// 16 warps a block, for grids the GPU holds at two blocks an SM; gemv.cu), and its
    /// launch.
    pub(super) fn gemv_cfg(&self, blocks: usize, w: &GemvWeight) -> (&'static GemvKernels, LaunchConfig) {
        let wide = blocks <= 2 * self.sms;
        let threads = if wide { 512 } else { 256 };
        (
            &GEMV_KERNELS[usize::from(wide) * 6 + w.family() * 2 + usize::from(w.kind == 2)],
            LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 },
        )
    }

    /// `out = x @ wᵀ` for up to [`GEMV_ROWS`] rows of 16-bit x and w (gemv.cu): w `[n, k]`,
    /// x `[m, k]`, out `[m, n]` f32, as device addresses; k a multiple of 8; x's pending
    /// norm scale, if any, as `scale`.
    fn gemv(
        &self,
        w: &GemvWeight,
        (x, out): (CUdeviceptr, CUdeviceptr),
        (m, n, k): (usize, usize, usize),
        scale: &ScaleArgs,
    ) -> DevResult<()> {
        let (kernels, cfg) = self.gemv_cfg(n.div_ceil(16), w);
        let name = kernels.plain;
        let _t = self.span(name, (n, k), m);
        let (m, n, k) = (m as i32, n as i32, k as i32);
        let (w, row_bytes, group) = w.args();
        // SAFETY: the caller's shapes: w holds n rows of k values (16-bit, or packed rows of
        // row_bytes), x m·k 16-bit values, out m·n floats; k % 8 == 0 (k % 32 for 4-bit
        // rows, % 16 for FP8 ones) keeps the kernel's 16-byte loads aligned and inside each
        // row. 16 rows of w a block.
        unsafe {
            self.stream
                .launch_builder(self.f(name))
                .arg(&w)
                .arg(&row_bytes)
                .arg(&group)
                .arg(&x)
                .arg(&out)
                .arg(&m)
                .arg(&n)
                .arg(&k)
                .arg(&scale.0)
                .arg(&scale.1)
                .arg(&scale.2)
                .launch(cfg)
        }
        .map_err(cuda("gemv launch"))?;
        Ok(())
    }

    /// A 16-bit weight or one of packed rows as the GEMV kernels take it; None for f32.
    pub(super) fn gemv_weight(&self, w: &CudaWeight) -> Option<GemvWeight> {
        use cudarc::driver::DevicePtr;
        let ptr = |b: &dyn DevicePtr<u16>| b.device_ptr(&self.stream).0;
        match &w.buf {
            WeightBuf::Bf16(b) => Some(GemvWeight { ptr: ptr(b), kind: 1, rows: None }),
            WeightBuf::F16(b) => Some(GemvWeight { ptr: ptr(b), kind: 2, rows: None }),
            WeightBuf::Rows { buf, format, .. } => Some(GemvWeight {
                ptr: buf.device_ptr(&self.stream).0,
                kind: if format.f16 { 2 } else { 1 },
                rows: Some(*format),
            }),
            WeightBuf::F32(_) => None,
        }
    }

    /// `Device::gate_up_act` without adapters for up to [`GEMV_ROWS`] rows of 16-bit
    /// weights: one GEMV whose epilogue applies act·mul (gemv.cu's gemv_act), so the
    /// projection is never written; with `half_only`, the result in its 16-bit copy alone
    /// as `silu_mul_at` keeps it. None where this does not apply.
    pub(super) fn gate_up_act_gemv(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        act: Activation,
        half_only: bool,
    ) -> DevResult<Option<CudaTensor>> {
        let (n, k) = (w.shape[0], w.shape[1]);
        let Some(gw) = self.gemv_weight(w) else { return Ok(None) };
        let kind = gw.kind;
        let rows = x.rows;
        if !self.gemv_fits(rows, k) || x.cols != k || !n.is_multiple_of(2) {
            return Ok(None);
        }
        let inter = n / 2;
        let mut out = self.tensor(rows, inter)?;
        let (mut half, half_kind) = self.half(rows, inter)?;
        let half_only = half_only && half.is_some();
        let (kernels, cfg) = self.gemv_cfg(inter.div_ceil(8), &gw);
        let (name, code) = (kernels.act, act_code(act));
        let scale = self.scale_args(x);
        let (wp, row_bytes, group) = gw.args();
        self.with_x16(x, kind, |xp| {
            let _t = self.span(name, (n, k), rows);
            let (m, i, k) = (rows as i32, inter as i32, k as i32);
            let mut launch = self.stream.launch_builder(self.f(name));
            launch.arg(&wp).arg(&row_bytes).arg(&group).arg(&xp);
            push_outputs(&mut launch, &mut out, &mut half, &half_kind, half_only);
            launch.arg(&code).arg(&m).arg(&i).arg(&k).arg(&scale.0).arg(&scale.1).arg(&scale.2);
            // SAFETY: w holds 2·inter rows of k 16-bit values, x rows·k of them; out (unless
            // null) is [rows, inter], half (kind ≠ 0) rows·inter 16-bit values; k % 8 == 0;
            // a scale's sums hold rows · parts values. 8 gate rows (and their 8 up rows) a
            // block.
            unsafe { launch.launch(cfg) }.map_err(cuda("gemv_act launch"))
        })?;
        out.half = half;
        out.half_only = half_only;
        Ok(Some(out))
    }

    /// `Device::linear_add_rms_norm` of up to [`GEMV_ROWS`] rows over 16-bit weights, for a
    /// norm that only the next projection's GEMM reads where that GEMM is the GEMV too: one
    /// GEMV (gemv.cu's gemv_res_norm) adds the projection to the residual and writes the
    /// norm's weights times the sum, in 16 bits, leaving each row's 1/rms to the next GEMV
    /// (`RowScale`). No norm kernel runs. None where this does not apply.
    pub(super) fn linear_res_norm(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        residual: &mut CudaTensor,
        nw: &CudaWeight,
        eps: f32,
    ) -> DevResult<Option<CudaTensor>> {
        let (n, k) = (w.shape[0], w.shape[1]);
        let m = x.rows;
        let Some(gw) = self.gemv_weight(w) else { return Ok(None) };
        let kind = gw.kind;
        // The next projection reads n values a row: fits the GEMV too, so it applies the scale.
        let fits = self.gemv_fits(m, k) && self.gemv_fits(m, n) && x.cols == k && x.scale.is_none();
        if !fits || self.act16.get() != kind || (residual.rows, residual.cols) != (m, n) {
            return Ok(None);
        }
        let (Some(mut half), _) = self.half(m, n)? else { return Ok(None) };
        let parts = n.div_ceil(16);
        let mut sums = self.tensor(m, parts)?.buf;
        let out = self.tensor(m, n)?;
        let (kernels, cfg) = self.gemv_cfg(parts, &gw);
        let (wp, row_bytes, group) = gw.args();
        self.with_x16(x, kind, |xp| {
            let _t = self.span(kernels.res_norm, (n, k), m);
            let (mi, ni, ki) = (m as i32, n as i32, k as i32);
            let mut launch = self.stream.launch_builder(self.f(kernels.res_norm));
            launch
                .arg(&wp)
                .arg(&row_bytes)
                .arg(&group)
                .arg(&xp)
                .arg(&mut *residual.buf)
                .arg(nw.f32())
                .arg(&mut *half.buf)
                .arg(&kind);
            launch.arg(&mut *sums).arg(&mi).arg(&ni).arg(&ki);
            // SAFETY: w holds n rows of k 16-bit values, x m·k of them; the residual is
            // [m, n] f32 and nw n values; half holds m·n 16-bit values and sums m · parts
            // floats (one per row and block of 16 outputs); k % 8 == 0.
            unsafe { launch.launch(cfg) }.map_err(cuda("gemv_res_norm launch"))
        })?;
        Ok(Some(CudaTensor {
            half: Some(half),
            half_only: true,
            scale: Some(RowScale { sums, parts, eps }),
            ..out
        }))
    }

    /// The GEMV arguments for x's pending norm scale (see [`ScaleArgs`]).
    pub(super) fn scale_args(&self, x: &CudaTensor) -> ScaleArgs {
        use cudarc::driver::DevicePtr;
        match &x.scale {
            // The address stays valid while x (which owns the sums) lives: through the launch.
            Some(s) => (s.sums.device_ptr(&self.stream).0, s.parts as i32, s.eps),
            None => (0, 0, 0.0),
        }
    }

    /// Runs `f` with the device address of x's values rounded to 16-bit `kind` (1 bf16,
    /// 2 f16): the tensor's own 16-bit copy when it has one of that kind, else a conversion
    /// into scratch space (valid until the next conversion, in stream order).
    pub(super) fn with_x16<R>(
        &self,
        x: &CudaTensor,
        kind: i32,
        f: impl FnOnce(CUdeviceptr) -> DevResult<R>,
    ) -> DevResult<R> {
        use cudarc::driver::DevicePtr;
        if let Some(h) = x.half.as_ref().filter(|h| h.kind == kind) {
            let (xp, _x) = h.buf.device_ptr(&self.stream);
            return f(xp);
        }
        x.f32_values("a GEMM of another 16-bit type")?;
        let (m, k) = (x.rows, x.cols);
        let total = (m * k) as i64;
        let mut scratch = self.scratch16.borrow_mut();
        if scratch.as_ref().is_none_or(|b| b.len() < m * k) {
            // SAFETY: the conversion below writes the m·k values the GEMM reads.
            *scratch = Some(unsafe { self.uninit::<u16>((m * k).next_power_of_two()) }?);
        }
        let xh = scratch.as_mut().expect("allocated above");
        let conv = if kind == 2 { "f32_to_f16" } else { "f32_to_bf16" };
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
        .map_err(cuda("conversion launch"))?;
        drop(t);
        let (xp, _x) = xh.device_ptr(&self.stream);
        f(xp)
    }

    /// `batch` GEMMs as [`Self::gemm_raw`] in one call: GEMM i reads A, B and C each
    /// `stride` elements further than GEMM i − 1 (operands as (address, leading dimension,
    /// stride)).
    ///
    /// # Safety
    /// As [`Self::gemm_raw`], for every one of the `batch` GEMMs.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn gemm_raw_batched(
        &self,
        ty: DataType,
        op_a: Op,
        (m, n, k): (usize, usize, usize),
        (a, lda, stride_a): (CUdeviceptr, usize, usize),
        (b, ldb, stride_b): (CUdeviceptr, usize, usize),
        beta: f32,
        (c, ldc, stride_c): (CUdeviceptr, usize, usize),
        batch: usize,
    ) -> DevResult<()> {
        use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t};
        let alpha = 1.0f32;
        // SAFETY: the caller's contract.
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *self.blas.handle(),
                op_a,
                Op::CUBLAS_OP_N,
                m as i32,
                n as i32,
                k as i32,
                (&alpha as *const f32).cast(),
                a as *const _,
                ty,
                lda as i32,
                stride_a as i64,
                b as *const _,
                ty,
                ldb as i32,
                stride_b as i64,
                (&beta as *const f32).cast(),
                c as *mut _,
                DataType::CUDA_R_32F,
                ldc as i32,
                stride_c as i64,
                batch as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(cuda("cuBLAS GemmStridedBatchedEx"))
    }

    /// cublasGemmEx in cuBLAS's column-major terms: `C[m, n] = op(A)[m, k] · B[k, n] +
    /// beta · C`, A and B of type `ty`, C of type `c_ty` (f32, or `ty` when that is 16-bit:
    /// the sums rounded to it), f32 accumulation. Each operand is a device address with its
    /// leading dimension; `op(A)` is A (`CUBLAS_OP_N`, `m × k` with `lda ≥ m`)
    /// or Aᵀ (`CUBLAS_OP_T`, A `k × m` with `lda ≥ k`). A row-major `[r, c]` matrix is a
    /// column-major `c × r` one.
    ///
    /// # Safety
    /// Every address must hold its operand at the given shape and leading dimension for
    /// as long as the stream runs the call.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn gemm_raw(
        &self,
        ty: DataType,
        op_a: Op,
        (m, n, k): (usize, usize, usize),
        (a, lda): (CUdeviceptr, usize),
        (b, ldb): (CUdeviceptr, usize),
        beta: f32,
        (c, ldc, c_ty): (CUdeviceptr, usize, DataType),
    ) -> DevResult<()> {
        use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t};
        let alpha = 1.0f32;
        // SAFETY: the caller's contract.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                op_a,
                Op::CUBLAS_OP_N,
                m as i32,
                n as i32,
                k as i32,
                (&alpha as *const f32).cast(),
                a as *const _,
                ty,
                lda as i32,
                b as *const _,
                ty,
                ldb as i32,
                (&beta as *const f32).cast(),
                c as *mut _,
                c_ty,
                ldc as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(cuda("cuBLAS GemmEx"))
    }
}

/// Pushes the outputs of a kernel that writes a GEMM's input (RMSNorm, SiLU·mul): its f32
/// values (`out`, or null with `half_only`: then only the 16-bit copy is written), the
/// 16-bit copy (null where there is none) and the copy's kind (0: none is written).
pub(super) fn push_outputs<'a>(
    launch: &mut cudarc::driver::LaunchArgs<'a>,
    out: &'a mut CudaTensor,
    half: &'a mut Option<super::Half>,
    kind: &'a i32,
    half_only: bool,
) {
    static NULL: CUdeviceptr = 0;
    match half_only {
        true => launch.arg(&NULL),
        false => launch.arg(&mut *out.buf),
    };
    match half {
        Some(h) => launch.arg(&mut *h.buf),
        None => launch.arg(&NULL),
    };
    launch.arg(kind);
}

/// An activation's code in common.cuh's `act_fn`.
pub(super) fn act_code(act: Activation) -> i32 {
    match act {
        Activation::Silu => 0,
        Activation::GeluTanh => 1,
        Activation::Relu => 2,
    }
}
