//! Weights repacked at load time for the SIMD kernel families (AVX-512 and AVX2), and the
//! matmul over them.
//!
//! Layout: `[n / 16 panels][k][16 lanes]` (n padded with zero rows to a multiple of 16), so
//! that one 64-byte load holds one k-step of 16 output columns. The microkernel keeps an
//! MR × (NV·16) block of outputs in zmm accumulators: per k-step it loads NV weight vectors
//! (widening bf16/f16 in registers), broadcasts MR inputs and issues MR·NV FMAs. Outputs
//! need no horizontal reduction, and each weight byte leaves memory once per call; decode
//! batches are memory bound, prefill is compute bound, and both run here on AVX-512 CPUs.
//! On AVX2 CPUs (16 ymm registers) the same layout is read as two 8-lane halves per k-step,
//! one panel at a time, with MR up to 4 rows: 8 accumulators, 2 weight vectors and a
//! broadcast.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use half::f16;
use rayon::prelude::*;

pub const LANES: usize = 16;

/// A weight element type widened to f32 in registers.
pub trait Elem: Copy + Default + Send + Sync + 'static {
    /// # Safety
    /// `p..p+16` must be readable and AVX-512F available.
    unsafe fn load16(p: *const Self) -> __m512;
    /// # Safety
    /// `p..p+8` must be readable and AVX2 and F16C available.
    unsafe fn load8(p: *const Self) -> __m256;
    fn to_f32(self) -> f32;
}

impl Elem for f32 {
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> __m512 {
        // SAFETY: the caller guarantees 16 readable elements.
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        // SAFETY: the caller guarantees 8 readable elements.
        unsafe { _mm256_loadu_ps(p) }
    }
    fn to_f32(self) -> f32 {
        self
    }
}

/// bf16 as raw bits.
impl Elem for u16 {
    #[inline(always)]
    unsafe fn load16(p: *const u16) -> __m512 {
        // SAFETY: the caller guarantees 16 readable elements; bf16 → f32 is a 16-bit shift.
        unsafe {
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast())), 16))
        }
    }
    #[inline(always)]
    unsafe fn load8(p: *const u16) -> __m256 {
        // SAFETY: the caller guarantees 8 readable elements; widened and shifted in registers.
        unsafe {
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast())), 16))
        }
    }
    fn to_f32(self) -> f32 {
        f32::from_bits((self as u32) << 16)
    }
}

impl Elem for f16 {
    #[inline(always)]
    unsafe fn load16(p: *const f16) -> __m512 {
        // SAFETY: the caller guarantees 16 readable elements.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> __m256 {
        // SAFETY: the caller guarantees 8 readable elements.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

/// A `[n, k]` weight in panel layout.
pub struct Packed<E> {
    pub n: usize,
    pub k: usize,
    pub data: Vec<E>,
}

impl<E: Elem> Packed<E> {
    /// Packs row-major `[n, k]` elements.
    pub fn pack(rows: &[E], n: usize, k: usize) -> Self {
        let panels = n.div_ceil(LANES);
        let mut data = vec![E::default(); panels * k * LANES];
        data.par_chunks_mut(k * LANES).enumerate().for_each(|(p, panel)| {
            for lane in 0..LANES {
                let row = p * LANES + lane;
                if row >= n {
                    break;
                }
                for (kk, &v) in rows[row * k..(row + 1) * k].iter().enumerate() {
                    panel[kk * LANES + lane] = v;
                }
            }
        });
        Self { n, k, data }
    }

    /// Row `r` (one output feature) widened to f32: the embedding lookup of a tied table.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        let (p, lane) = (r / LANES, r % LANES);
        let panel = &self.data[p * self.k * LANES..(p + 1) * self.k * LANES];
        for (kk, o) in out.iter_mut().enumerate().take(self.k) {
            *o = panel[kk * LANES + lane].to_f32();
        }
    }
}

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: threads write disjoint output columns (disjoint panels).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// `out[i, p·16 + l]` for MR rows and NV panels starting at panel `p0` (whose data starts
/// at `wbase`).
///
/// # Safety
/// x holds MR rows of k at stride k; `wbase` holds NV panels of k·16; out rows are
/// writable for the columns below `n`; AVX-512F is available.
#[target_feature(enable = "avx512f")]
unsafe fn block<E: Elem, const MR: usize, const NV: usize>(
    x: *const f32,
    wbase: *const E,
    k: usize,
    p0: usize,
    out: *mut f32,
    n: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); NV]; MR];
    // SAFETY (whole body): see the function's contract.
    unsafe {
        for kk in 0..k {
            let mut wv = [_mm512_setzero_ps(); NV];
            for (v, wr) in wv.iter_mut().enumerate() {
                *wr = E::load16(wbase.add(v * k * LANES + kk * LANES));
            }
            for (i, row) in acc.iter_mut().enumerate() {
                let xb = _mm512_set1_ps(*x.add(i * k + kk));
                for (a, wr) in row.iter_mut().zip(&wv) {
                    *a = _mm512_fmadd_ps(xb, *wr, *a);
                }
            }
        }
        for (i, row) in acc.iter().enumerate() {
            for (v, a) in row.iter().enumerate() {
                let col = (p0 + v) * LANES;
                let dst = out.add(i * n + col);
                if col + LANES <= n {
                    _mm512_storeu_ps(dst, *a);
                } else {
                    let mask: __mmask16 = (1u32 << (n - col)).wrapping_sub(1) as u16;
                    _mm512_mask_storeu_ps(dst, mask, *a);
                }
            }
        }
    }
}

/// Every input row against panels `p0..p0+NV`.
///
/// # Safety
/// As [`block`]; AVX-512F is available.
#[target_feature(enable = "avx512f")]
unsafe fn panels<E: Elem, const NV: usize>(
    x: &[f32],
    m: usize,
    w: &Packed<E>,
    p0: usize,
    out: OutPtr,
    n: usize,
    scratch: &mut Vec<f32>,
) {
    let k = w.k;
    let wbase = w.data[p0 * k * LANES..(p0 + NV) * k * LANES].as_ptr();
    // SAFETY: the panels exist (caller); AVX-512F is available.
    unsafe {
        match widened(w, m, p0, NV, scratch) {
            Some(wide) => row_groups::<f32, NV>(x, m, wide, k, p0, out, n),
            None => row_groups::<E, NV>(x, m, wbase, k, p0, out, n),
        }
    }
}

/// Panels `p0..p0 + count` widened to f32 in `scratch`, when `m` rows (many row groups)
/// will read them and they are 16-bit; None otherwise.
fn widened<E: Elem>(
    w: &Packed<E>,
    m: usize,
    p0: usize,
    count: usize,
    scratch: &mut Vec<f32>,
) -> Option<*const f32> {
    if m <= WIDEN_MIN_ROWS || std::any::TypeId::of::<E>() == std::any::TypeId::of::<f32>() {
        return None;
    }
    scratch.clear();
    scratch.extend(w.data[p0 * w.k * LANES..(p0 + count) * w.k * LANES].iter().map(|e| e.to_f32()));
    Some(scratch.as_ptr())
}

/// Input rows with more than this many rows widen bf16/f16 panels to f32 first.
const WIDEN_MIN_ROWS: usize = 16;

/// # Safety
/// As [`block`] for every group of rows below m; AVX-512F is available.
#[target_feature(enable = "avx512f")]
unsafe fn row_groups<E: Elem, const NV: usize>(
    x: &[f32],
    m: usize,
    wbase: *const E,
    k: usize,
    p0: usize,
    out: OutPtr,
    n: usize,
) {
    const MR: usize = 8;
    let mut i = 0;
    // SAFETY: row groups stay below m; the rest is the caller's contract.
    unsafe {
        while i + MR <= m {
            block::<E, MR, NV>(x.as_ptr().add(i * k), wbase, k, p0, out.0.add(i * n), n);
            i += MR;
        }
        let (xp, op) = (x.as_ptr().add(i * k), out.0.add(i * n));
        match m - i {
            7 => block::<E, 7, NV>(xp, wbase, k, p0, op, n),
            6 => block::<E, 6, NV>(xp, wbase, k, p0, op, n),
            5 => block::<E, 5, NV>(xp, wbase, k, p0, op, n),
            4 => block::<E, 4, NV>(xp, wbase, k, p0, op, n),
            3 => block::<E, 3, NV>(xp, wbase, k, p0, op, n),
            2 => block::<E, 2, NV>(xp, wbase, k, p0, op, n),
            1 => block::<E, 1, NV>(xp, wbase, k, p0, op, n),
            _ => {}
        }
    }
}

/// `out[m, n] = x[m, k] · Wᵀ` on AVX-512 (`avx512`) or AVX2. Panics unless the CPU has the
/// family.
pub fn matmul<E: Elem>(avx512: bool, x: &[f32], m: usize, w: &Packed<E>, out: &mut [f32]) {
    use super::family::Family;
    let (n, k) = (w.n, w.k);
    assert!(x.len() >= m * k && out.len() >= m * n);
    let family = if avx512 { Family::Avx512 } else { Family::Avx2 };
    assert!(family.supported(), "packed weights need {}", family.name());
    // AVX-512 takes two panels at a time (fewer passes over x), AVX2 one (register file).
    let nv = if avx512 { 2 } else { 1 };
    let total = n.div_ceil(LANES);
    // Enough chunks to balance both cores, each a whole number of NV-panel blocks.
    let chunk = total.div_ceil(rayon::current_num_threads() * 8).div_ceil(nv).max(1) * nv;
    let out_ptr = OutPtr(out.as_mut_ptr());
    (0..total.div_ceil(chunk)).into_par_iter().for_each_init(Vec::new, |scratch, c| {
        let (p0, p1) = (c * chunk, ((c + 1) * chunk).min(total));
        let mut p = p0;
        // SAFETY: the family's features were asserted above; this chunk writes only its own
        // panels' columns.
        unsafe {
            if avx512 {
                while p + 2 <= p1 {
                    panels::<E, 2>(x, m, w, p, out_ptr, n, scratch);
                    p += 2;
                }
                if p < p1 {
                    panels::<E, 1>(x, m, w, p, out_ptr, n, scratch);
                }
            } else {
                while p < p1 {
                    avx2::panel(x, m, w, p, out_ptr, n, scratch);
                    p += 1;
                }
            }
        }
    });
}

/// The AVX2 kernels over the same panels.
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Elem, LANES, OutPtr, Packed, widened};

    /// `out[i, p·16 + l]` for MR rows of panel `p` (whose data starts at `wbase`).
    ///
    /// # Safety
    /// x holds MR rows of k at stride k; `wbase` holds a panel of k·16; out rows are
    /// writable for the columns below `n`; AVX2, FMA and F16C are available.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn block<E: Elem, const MR: usize>(
        x: *const f32,
        wbase: *const E,
        k: usize,
        p: usize,
        out: *mut f32,
        n: usize,
    ) {
        let mut acc = [[_mm256_setzero_ps(); 2]; MR];
        // SAFETY (whole body): see the function's contract.
        unsafe {
            for kk in 0..k {
                let w0 = E::load8(wbase.add(kk * LANES));
                let w1 = E::load8(wbase.add(kk * LANES + 8));
                for (i, a) in acc.iter_mut().enumerate() {
                    let xb = _mm256_set1_ps(*x.add(i * k + kk));
                    a[0] = _mm256_fmadd_ps(xb, w0, a[0]);
                    a[1] = _mm256_fmadd_ps(xb, w1, a[1]);
                }
            }
            let col = p * LANES;
            for (i, a) in acc.iter().enumerate() {
                let dst = out.add(i * n + col);
                if col + LANES <= n {
                    _mm256_storeu_ps(dst, a[0]);
                    _mm256_storeu_ps(dst.add(8), a[1]);
                } else {
                    let mut tmp = [0f32; LANES];
                    _mm256_storeu_ps(tmp.as_mut_ptr(), a[0]);
                    _mm256_storeu_ps(tmp.as_mut_ptr().add(8), a[1]);
                    std::ptr::copy_nonoverlapping(tmp.as_ptr(), dst, n - col);
                }
            }
        }
    }

    /// # Safety
    /// As [`block`] for every group of rows below m.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn row_groups<E: Elem>(
        x: &[f32],
        m: usize,
        wbase: *const E,
        k: usize,
        p: usize,
        out: OutPtr,
        n: usize,
    ) {
        const MR: usize = 4;
        let mut i = 0;
        // SAFETY: row groups stay below m; the rest is the caller's contract.
        unsafe {
            while i + MR <= m {
                block::<E, MR>(x.as_ptr().add(i * k), wbase, k, p, out.0.add(i * n), n);
                i += MR;
            }
            let (xp, op) = (x.as_ptr().add(i * k), out.0.add(i * n));
            match m - i {
                3 => block::<E, 3>(xp, wbase, k, p, op, n),
                2 => block::<E, 2>(xp, wbase, k, p, op, n),
                1 => block::<E, 1>(xp, wbase, k, p, op, n),
                _ => {}
            }
        }
    }

    /// Every input row against panel `p`.
    ///
    /// # Safety
    /// The panel exists; out is `[m, n]`; AVX2, FMA and F16C are available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn panel<E: Elem>(
        x: &[f32],
        m: usize,
        w: &Packed<E>,
        p: usize,
        out: OutPtr,
        n: usize,
        scratch: &mut Vec<f32>,
    ) {
        let k = w.k;
        // SAFETY: see the function's contract.
        unsafe {
            match widened(w, m, p, 1, scratch) {
                Some(wide) => row_groups::<f32>(x, m, wide, k, p, out, n),
                None => row_groups::<E>(x, m, w.data[p * k * LANES..].as_ptr(), k, p, out, n),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    fn check<E: Elem>(avx512: bool, rows: &[E], x: &[f32], m: usize, n: usize, k: usize) {
        let p = Packed::pack(rows, n, k);
        let mut out = vec![f32::NAN; m * n];
        matmul(avx512, x, m, &p, &mut out);
        for i in 0..m {
            for j in 0..n {
                let want: f64 = (0..k).map(|t| x[i * k + t] as f64 * rows[j * k + t].to_f32() as f64).sum();
                let got = out[i * n + j];
                assert!(
                    (got as f64 - want).abs() < 1e-4 * (k as f64).sqrt(),
                    "m={m} n={n} k={k} [{i},{j}]: {got} vs {want}"
                );
            }
        }
        let mut row = vec![0f32; k];
        p.row_f32(n - 1, &mut row);
        assert!(row.iter().zip(&rows[(n - 1) * k..]).all(|(a, b)| *a == b.to_f32()));
    }

    /// Under every SIMD family this CPU has (CI's machines have AVX2 at least).
    #[test]
    fn packed_matmul_matches_reference_for_odd_shapes_and_every_dtype() {
        use crate::kernels::cpu::family::Family;
        let families: Vec<bool> = [(true, Family::Avx512), (false, Family::Avx2)]
            .into_iter()
            .filter(|(_, f)| f.supported())
            .map(|(a, _)| a)
            .collect();
        assert!(!families.is_empty(), "this CPU has neither AVX-512 nor AVX2");
        for avx512 in families {
            for &(m, n, k) in
                &[(1, 17, 64), (3, 100, 37), (8, 48, 576), (13, 1000, 96), (33, 31, 5), (5, 64, 8)]
            {
                let x = rand_vec(m * k, 1);
                let w = rand_vec(n * k, 2);
                check(avx512, &w, &x, m, n, k);
                let b: Vec<u16> = w.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
                check(avx512, &b, &x, m, n, k);
                let h: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
                check(avx512, &h, &x, m, n, k);
            }
        }
    }
}
