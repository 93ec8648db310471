//! GEMMs through cuBLAS: `out = x @ wᵀ` for f32 weights (sgemm) and 16-bit weights
//! (cublasGemmEx, f32 accumulation and output).

use cudarc::cublas::{Gemm, GemmConfig, sys::cublasOperation_t};
use cudarc::driver::{CudaSlice, PushKernelArg};

use super::{CudaDevice, CudaTensor, DevResult, cuda};

impl CudaDevice {
    /// `out = x @ wᵀ` via cuBLAS (column-major: outᵀ[n, m] = w[n, k] · xᵀ[k, m]).
    pub(super) fn gemm(
        &self,
        x: &CudaTensor,
        w: &CudaSlice<f32>,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> DevResult<()> {
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
        unsafe { self.blas.gemm(cfg, w, &*x.buf, out) }.map_err(cuda("cuBLAS sgemm"))
    }

    /// `out = x @ wᵀ` for 16-bit weights: x is rounded to the weight's type, cuBLAS
    /// accumulates in f32 and writes f32.
    pub(super) fn gemm_16(
        &self,
        x: &CudaTensor,
        w: &CudaSlice<u16>,
        n: usize,
        out: &mut CudaSlice<f32>,
        f16: bool,
    ) -> DevResult<()> {
        use cudarc::cublas::sys::cudaDataType;
        use cudarc::driver::DevicePtr;
        let (m, k) = (x.rows, x.cols);
        let ty = if f16 { cudaDataType::CUDA_R_16F } else { cudaDataType::CUDA_R_16BF };
        if let Some(h) = x.half.as_ref().filter(|h| h.kind == if f16 { 2 } else { 1 }) {
            let _t = self.span(if f16 { "gemm_f16" } else { "gemm_bf16" }, (n, k), m);
            let (xp, _x) = h.buf.device_ptr(&self.stream);
            return self.gemm_16_raw(w, xp, ty, n, m, k, out);
        }
        let total = (m * k) as i64;
        let mut scratch = self.scratch16.borrow_mut();
        if scratch.as_ref().is_none_or(|b| b.len() < m * k) {
            // SAFETY: the conversion below writes the m·k values the GEMM reads.
            *scratch = Some(unsafe { self.uninit::<u16>((m * k).next_power_of_two()) }?);
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
        .map_err(cuda("conversion launch"))?;
        drop(t);
        let _t = self.span(if f16 { "gemm_f16" } else { "gemm_bf16" }, (n, k), m);
        let (xp, _x) = xh.device_ptr(&self.stream);
        self.gemm_16_raw(w, xp, ty, n, m, k, out)
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
    ) -> DevResult<()> {
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
        .map_err(cuda("cuBLAS GemmEx"))
    }
}
