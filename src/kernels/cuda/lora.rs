//! Batched LoRA. Up to [`BGMV_ROWS`] rows, Punica's BGMV (lora.cu): each row reads only its
//! own slot's A and B, two launches per group of modules that read the same x. Beyond,
//! GEMMs: every slot's A side by side shrinks all rows at once (`x · [A_0; A_1; …]ᵀ`), a
//! mask keeps each row's own slot, and one GEMM against every slot's Bᵀ expands the rows
//! into the projection's output; they run on tensor cores for 16-bit adapters, and the work
//! spent on other slots' columns (slots · R of them) is small beside the projection itself.
//! Either way a mixed batch is one pass with fixed shapes, which CUDA graphs replay.

use std::sync::Arc;

use cudarc::cublas::sys::cublasOperation_t as Op;
use cudarc::cublas::sys::cudaDataType as DataType;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{CudaDevice, CudaTensor, cuda};
use crate::kernels::{DevResult, LoraShape, LoraSlotWeights};

/// One module's adapter weights for every slot: A `[slots · R, in]` and Bᵀ `[slots · R,
/// out]` with the scale folded in, ranks under R padded with zeros; f32, or bf16 bits
/// (`LoraShape::bf16`).
pub struct CudaLora {
    pub shape: LoraShape,
    a: LoraBuf,
    bt: LoraBuf,
}

enum LoraMem {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
}

impl LoraMem {
    fn len(&self) -> usize {
        match self {
            LoraMem::F32(b) => b.len(),
            LoraMem::Bf16(b) => b.len(),
        }
    }
}

/// A module's A or Bᵀ: `len` values from `start` in a chunk of the device's LoRA arena.
struct LoraBuf {
    mem: Arc<LoraMem>,
    start: usize,
    len: usize,
}

impl LoraBuf {
    fn elem(&self) -> usize {
        match *self.mem {
            LoraMem::F32(_) => 4,
            LoraMem::Bf16(_) => 2,
        }
    }

    fn ptr(&self, dev: &CudaDevice) -> cudarc::driver::sys::CUdeviceptr {
        let base = match &*self.mem {
            LoraMem::F32(b) => b.device_ptr(&dev.stream).0,
            LoraMem::Bf16(b) => b.device_ptr(&dev.stream).0,
        };
        base + (self.start * self.elem()) as u64
    }

    /// Whether this buffer starts where `prev` ends, in the same chunk.
    fn follows(&self, prev: &LoraBuf) -> bool {
        Arc::ptr_eq(&self.mem, &prev.mem) && self.start == prev.start + prev.len
    }

    /// Writes `values` at element `at` of this buffer.
    fn write(&self, dev: &CudaDevice, at: usize, values: &[f32]) -> DevResult<()> {
        if at + values.len() > self.len {
            return Err(crate::kernels::DeviceError::Other(format!(
                "LoRA weights of {} values at {at} do not fit a buffer of {}",
                values.len(),
                self.len
            )));
        }
        let dst = self.ptr(dev) + (at * self.elem()) as u64;
        let copy = cuda("host to device copy");
        // SAFETY: dst..dst + the values' bytes lies inside this buffer (checked above) of a
        // live chunk; a copy from pageable memory has read `values` when it returns.
        match *self.mem {
            LoraMem::F32(_) => unsafe {
                cudarc::driver::result::memcpy_htod_async(dst, values, dev.stream.cu_stream())
            },
            LoraMem::Bf16(_) => {
                let bits: Vec<u16> = values.iter().map(|v| half::bf16::from_f32(*v).to_bits()).collect();
                unsafe { cudarc::driver::result::memcpy_htod_async(dst, &bits, dev.stream.cu_stream()) }
            }
        }
        .map_err(copy)
    }
}

/// Where adapter weights come from: large chunks carved in allocation order, A matrices
/// from one and Bᵀ matrices from another. A group's A matrices (q, k and v; gate and up)
/// are carved in one piece, back to back, so that one GEMM shrinks the whole group.
#[derive(Default)]
pub(super) struct LoraArena {
    a: Option<(Arc<LoraMem>, usize)>,
    bt: Option<(Arc<LoraMem>, usize)>,
}

/// Values per arena chunk (more for a single larger matrix).
const ARENA_CHUNK: usize = 32 << 20;

impl CudaDevice {
    /// `n` zeroed values of the arena's A (`bt` false) or Bᵀ side.
    fn lora_carve(&self, bt: bool, n: usize, bf16: bool) -> DevResult<LoraBuf> {
        let mut arena = self.lora_arena.borrow_mut();
        let side = if bt { &mut arena.bt } else { &mut arena.a };
        let (mem, used) = match side.take() {
            Some((mem, used)) if matches!(*mem, LoraMem::Bf16(_)) == bf16 && used + n <= mem.len() => {
                (mem, used)
            }
            _ => {
                let len = n.max(ARENA_CHUNK);
                let mem = if bf16 { LoraMem::Bf16(self.zeros(len)?) } else { LoraMem::F32(self.zeros(len)?) };
                (Arc::new(mem), 0)
            }
        };
        let buf = LoraBuf { mem: mem.clone(), start: used, len: n };
        *side = Some((mem, used + n));
        Ok(buf)
    }

    /// The modules of one group (they read the same x), their A matrices back to back.
    pub(super) fn lora_alloc(&self, shapes: &[LoraShape]) -> DevResult<Vec<CudaLora>> {
        let sizes: Vec<(usize, usize)> = shapes
            .iter()
            .map(|s| (s.slots * s.max_rank * s.in_features, s.slots * s.max_rank * s.out_features))
            .collect();
        let total: usize = sizes.iter().map(|&(a, _)| a).sum();
        let Some(first) = shapes.first() else { return Ok(Vec::new()) };
        if shapes.iter().any(|s| s.bf16 != first.bf16) {
            return Err(crate::kernels::DeviceError::Other("a LoRA group mixes f32 and bf16 modules".into()));
        }
        let a = self.lora_carve(false, total.max(1), first.bf16)?;
        let mut start = a.start;
        shapes
            .iter()
            .zip(sizes)
            .map(|(&shape, (na, nb))| {
                let module_a = LoraBuf { mem: a.mem.clone(), start, len: na.max(1) };
                start += na.max(1);
                Ok(CudaLora { shape, a: module_a, bt: self.lora_carve(true, nb.max(1), shape.bf16)? })
            })
            .collect()
    }

    pub(super) fn lora_set(
        &self,
        l: &mut CudaLora,
        slot: usize,
        w: Option<LoraSlotWeights>,
    ) -> DevResult<()> {
        let LoraShape { max_rank: rm, in_features: fin, out_features: fout, .. } = l.shape;
        let mut a = vec![0f32; rm * fin];
        let mut bt = vec![0f32; rm * fout];
        if let Some(w) = w {
            a[..w.rank * fin].copy_from_slice(w.a);
            for o in 0..fout {
                for r in 0..w.rank {
                    bt[r * fout + o] = w.b[o * w.rank + r] * w.scale;
                }
            }
        }
        l.a.write(self, slot * rm * fin, &a)?;
        l.bt.write(self, slot * rm * fout, &bt)
    }

    /// `y[t, off..off + out] += B_s A_s x[t]` for every module and every row t whose slot
    /// s (in the step's uploaded slots) is not negative; the modules read the same `x`.
    pub(super) fn lora_add(
        &self,
        y: &mut CudaTensor,
        x: &CudaTensor,
        modules: &[(&CudaLora, usize)],
    ) -> DevResult<()> {
        if Self::lora_by_gemms(y.rows, modules.len()) {
            self.lora_gemms(GemmOut::f32(self, y), x, modules, 1.0)
        } else {
            self.lora_bgmv(y, x, modules)
        }
    }

    /// Whether `linear_lora` writes the deltas of `modules` first and lets the projection
    /// of `n` outputs add itself to them: for GEMMs over every slot, when the modules cover
    /// every output column in order (q, k and v; gate and up; o; down).
    pub(super) fn lora_first(rows: usize, modules: &[(&CudaLora, usize)], n: usize) -> bool {
        let covered =
            modules.iter().try_fold(0, |at, (l, off)| (*off == at).then_some(at + l.shape.out_features));
        Self::lora_by_gemms(rows, modules.len()) && covered == Some(n)
    }

    /// Whether a LoRA pass over `rows` rows and `modules` modules runs as GEMMs over every
    /// slot rather than as BGMV.
    pub(super) fn lora_by_gemms(rows: usize, modules: usize) -> bool {
        rows > BGMV_ROWS || modules > 3
    }

    /// [`Self::lora_add`] for a few rows: each reads its own slot's weights only.
    fn lora_bgmv(&self, y: &mut CudaTensor, x: &CudaTensor, modules: &[(&CudaLora, usize)]) -> DevResult<()> {
        let Some((first, _)) = modules.first() else { return Ok(()) };
        x.f32_values("a LoRA pass over a few rows")?;
        let LoraShape { max_rank, bf16, in_features: fin, .. } = first.shape;
        let (rows, nm) = (y.rows, modules.len());
        let parts = split_k(fin);
        let mut part = self.tensor(rows * parts, nm * max_rank)?;
        let inputs = self.inputs();
        let staged = inputs.lora_slots.borrow();
        let (_, slots) = staged.as_ref().ok_or_else(not_uploaded)?;
        let (shrink, expand) = if bf16 {
            ("lora_shrink_bf16", "lora_expand_bf16")
        } else {
            ("lora_shrink_f32", "lora_expand_f32")
        };
        // Absent modules (groups of fewer than 3) repeat the first: their blocks never run.
        let module = |m: usize| modules.get(m).unwrap_or(&modules[0]);
        let ptrs = |f: fn(&CudaLora) -> &LoraBuf| -> [u64; 3] { [0, 1, 2].map(|m| f(module(m).0).ptr(self)) };
        let (a, bt) = (ptrs(|l| &l.a), ptrs(|l| &l.bt));
        let ints = [rows, fin, fin / parts, max_rank, parts].map(|v| v as i32);
        {
            let _t = self.span("lora bgmv shrink", (nm * max_rank, fin), rows);
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, nm as u32, parts as u32),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = self.stream.launch_builder(self.f(shrink));
            b.arg(&mut *part.buf).arg(&*x.buf).arg(&a[0]).arg(&a[1]).arg(&a[2]).arg(slots);
            b.arg(&ints[0]).arg(&ints[1]).arg(&ints[2]).arg(&ints[3]);
            // SAFETY: x is [rows, fin]; each A holds slots·R rows of fin; part holds parts
            // blocks of [rows, nm·R]; the slots are one per row.
            unsafe { b.launch(cfg) }.map_err(cuda("LoRA shrink launch"))?;
        }
        let fouts = [0, 1, 2].map(|m| module(m).0.shape.out_features as i32);
        let offs = [0, 1, 2].map(|m| module(m).1 as i32);
        let widest = modules.iter().map(|(l, _)| l.shape.out_features).max().unwrap_or(0);
        let ycols = y.cols as i32;
        let _t = self.span("lora bgmv expand", (widest, nm * max_rank), rows);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, widest.div_ceil(1024) as u32, nm as u32),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(self.f(expand));
        b.arg(&mut *y.buf).arg(&*part.buf).arg(&bt[0]).arg(&bt[1]).arg(&bt[2]).arg(slots);
        b.arg(&ints[0]).arg(&ints[4]).arg(&ints[3]);
        b.arg(&fouts[0]).arg(&fouts[1]).arg(&fouts[2]).arg(&offs[0]).arg(&offs[1]).arg(&offs[2]).arg(&ycols);
        // SAFETY: y is [rows, ycols] and each module's columns off..off + out lie within a
        // row; each Bᵀ holds slots·R rows of out; part is the shrink's.
        unsafe { b.launch(cfg) }.map_err(cuda("LoRA expand launch"))?;
        Ok(())
    }

    /// [`Self::lora_add`] as GEMMs over every slot, masked to each row's own: `y[:, off..off +
    /// out] = delta + beta · y[:, off..off + out]` for each module (beta 1 adds the deltas,
    /// 0 writes them over y's columns).
    pub(super) fn lora_gemms(
        &self,
        y: GemmOut,
        x: &CudaTensor,
        modules: &[(&CudaLora, usize)],
        beta: f32,
    ) -> DevResult<()> {
        let Some((first, _)) = modules.first() else { return Ok(()) };
        let LoraShape { slots, max_rank, bf16, .. } = first.shape;
        let (rows, per) = (y.rows, slots * max_rank);
        let width = per * modules.len();
        let ty = if bf16 { DataType::CUDA_R_16BF } else { DataType::CUDA_R_32F };
        let fin = first.shape.in_features;
        // Modules whose A matrices lie back to back (allocated one after another) shrink
        // as one GEMM of all their columns.
        let stacked = modules.windows(2).all(|w| w[1].0.a.follows(&w[0].0.a));
        let gemms: Vec<(usize, usize)> =
            if stacked { vec![(0, modules.len())] } else { (0..modules.len()).map(|m| (m, 1)).collect() };
        let parts = gemm_split_k(fin, rows, gemms[0].1 * per);
        let mut v = self.tensor(rows * parts, width)?;
        // Raw addresses: the stream orders every use (one stream, no event tracking needed).
        let vp = v.buf.device_ptr(&self.stream).0;
        // Shrink: part p of v[:, m·per..(m+n)·per] = x · [A_m; …; A_(m+n−1)]ᵀ over input
        // features p·kc..(p+1)·kc, every slot of modules m.. m + n − 1. The parts are the
        // GEMMs of one batched call, so that the few output tiles of a long K still fill
        // the GPU.
        let kc = fin / parts;
        let shrink = |xp, ldx| -> DevResult<()> {
            for &(m, n) in &gemms {
                let _t = self.span("lora shrink", (n * per, fin), rows);
                let out = vp + (m * per * 4) as u64;
                // SAFETY: the n modules' A are [n·per, fin] row-major (fin × n·per
                // column-major, transposed; back to back when n > 1), x is [rows, fin]
                // (fin × rows); part p reads both from column p·kc and writes its [rows,
                // width] block (the modules' columns from m·per) p·rows·width values into
                // v, which holds `parts` such blocks.
                unsafe {
                    self.gemm_raw_batched(
                        ty,
                        Op::CUBLAS_OP_T,
                        (n * per, rows, kc),
                        (modules[m].0.a.ptr(self), fin, kc),
                        (xp, ldx, kc),
                        0.0,
                        (out, width, rows * width),
                        parts,
                    )
                }?;
            }
            Ok(())
        };
        if bf16 {
            self.with_x16(x, 1, |xp| shrink(xp, x.cols))?;
        } else {
            x.f32_values("an f32 LoRA shrink")?;
            shrink(x.buf.device_ptr(&self.stream).0, x.cols)?;
        }
        // Mask: each row keeps its own slot's R columns of every module (rounded to bf16
        // into a second buffer for the 16-bit expand).
        let v16 = if bf16 { Some(self.tensor(rows, width.div_ceil(2))?) } else { None };
        {
            let inputs = self.inputs();
            let staged = inputs.lora_slots.borrow();
            let (_, s) = staged.as_ref().ok_or_else(not_uploaded)?;
            let total = (rows * width) as i64;
            let args = [width as i32, per as i32, max_rank as i32, parts as i32];
            let kind = i32::from(bf16);
            let _t = self.span("lora mask", (0, 0), rows);
            // The 16-bit output as an address (unused when kind is 0).
            let v16p = v16.as_ref().map_or(vp, |h| h.buf.device_ptr(&self.stream).0);
            let mut b = self.stream.launch_builder(self.f("lora_mask_f32"));
            b.arg(&mut *v.buf)
                .arg(&v16p)
                .arg(s)
                .arg(&args[0])
                .arg(&args[1])
                .arg(&args[2])
                .arg(&total)
                .arg(&kind)
                .arg(&args[3]);
            // SAFETY: v holds `parts` blocks of rows·width values (v16 one), the slots one
            // per row.
            unsafe { b.launch(Self::grid(total as usize)) }.map_err(cuda("LoRA mask launch"))?;
        }
        let mp = v16.as_ref().unwrap_or(&v).buf.device_ptr(&self.stream).0;
        // Expand: y[:, off..off + out] = v_m · Bᵀ_m over every slot + beta · y.
        let elem = if bf16 { 2 } else { 4 };
        for (m, (l, off)) in modules.iter().enumerate() {
            let fout = l.shape.out_features;
            let _t = self.span("lora expand", (fout, per), rows);
            let vin = mp + (m * per * elem) as u64;
            let out = y.ptr + (off * y.elem()) as u64;
            // SAFETY: Bᵀ is [per, fout] row-major (fout × per column-major), the module's
            // v block [rows, per] within rows of `width`, y's columns off..off + fout within
            // rows of y.cols.
            unsafe {
                self.gemm_raw(
                    ty,
                    Op::CUBLAS_OP_N,
                    (fout, rows, per),
                    (l.bt.ptr(self), fout),
                    (vin, width),
                    beta,
                    (out, y.cols, y.ty),
                )
            }?;
        }
        Ok(())
    }
}

/// Where GEMMs write: a row-major `[rows, cols]` matrix at a device address, of f32 or of
/// the weights' 16-bit type.
#[derive(Clone, Copy)]
pub(super) struct GemmOut {
    pub ptr: CUdeviceptr,
    pub rows: usize,
    pub cols: usize,
    pub ty: DataType,
}

impl GemmOut {
    /// A tensor's f32 values.
    pub fn f32(dev: &CudaDevice, y: &mut CudaTensor) -> Self {
        let ptr = y.buf.device_ptr_mut(&dev.stream).0;
        Self { ptr, rows: y.rows, cols: y.cols, ty: DataType::CUDA_R_32F }
    }

    fn elem(&self) -> usize {
        if self.ty == DataType::CUDA_R_32F { 4 } else { 2 }
    }
}

/// Rows up to which LoRA runs as BGMV (each row reads its own slot's weights) rather than
/// GEMMs over every slot.
const BGMV_ROWS: usize = 32;

fn not_uploaded() -> crate::kernels::DeviceError {
    crate::kernels::DeviceError::Other("LoRA slots were not uploaded for this step".into())
}

/// How many parts the shrink's input features split into: chunks of about 512 (a multiple
/// of 8, so that each part's operands stay 16-byte aligned), one part for short inputs.
fn split_k(fin: usize) -> usize {
    split_k_at_most(fin, fin / 512)
}

/// [`split_k`] for a GEMM whose output is `rows` × `cols`: only as many parts as it takes
/// for its 128 × 128 output tiles to make about 264 blocks (two waves of the H200's 132
/// SMs); one part for many rows.
fn gemm_split_k(fin: usize, rows: usize, cols: usize) -> usize {
    let tiles = rows.div_ceil(128) * cols.div_ceil(128);
    split_k_at_most(fin, (fin / 512).min(264 / tiles))
}

/// The most parts, up to `most`, that cut `fin` into equal chunks of a multiple of 8.
fn split_k_at_most(fin: usize, most: usize) -> usize {
    let mut parts = most.max(1);
    while parts > 1 && !(fin.is_multiple_of(parts) && (fin / parts).is_multiple_of(8)) {
        parts -= 1;
    }
    parts
}

#[cfg(test)]
mod tests {
    #[test]
    fn split_k_divides_evenly_into_aligned_chunks() {
        for (fin, parts) in [(64, 1), (576, 1), (1536, 3), (4096, 8), (14336, 28), (3584, 7), (4100, 1)] {
            assert_eq!(super::split_k(fin), parts, "in_features {fin}");
        }
    }

    #[test]
    fn split_k_stops_once_the_output_tiles_fill_the_gpu() {
        // (rows, cols, parts) for 14336 input features: 28 parts of 512 at most.
        for (rows, cols, parts) in
            [(32, 128, 28), (256, 384, 28), (1024, 384, 8), (4096, 128, 8), (16384, 384, 1)]
        {
            assert_eq!(super::gemm_split_k(14336, rows, cols), parts, "{rows} × {cols}");
        }
    }
}
