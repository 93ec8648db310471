//! Weights repacked at load time for the SIMD kernel families (AVX-512, AVX2, NEON), and
//! the matmul over them.
//!
//! Layout: `[n / 16 panels][k][16 lanes]` (n padded with zero rows to a multiple of 16), so
//! that one k-step of 16 output columns is 64 contiguous bytes. The microkernel keeps an
//! MR × NW block of output vectors in registers: per k-step it loads NW weight vectors
//! (widening bf16/f16 in registers), broadcasts MR inputs and issues MR·NW FMAs. Outputs need
//! no horizontal reduction, and each weight byte leaves memory once per call; decode batches
//! are memory bound, prefill is compute bound. One body serves every family
//! ([`super::simd::Lanes`]): AVX-512 (32 zmm registers) takes two panels (NW = 2 vectors of
//! 16) for 8 rows at a time, AVX2 (16 ymm) one panel as two vectors of 8 for 4 rows, NEON
//! (32 q registers) one panel as four vectors of 4 for 4 rows.

#![cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]

use half::f16;
use rayon::prelude::*;

use super::family::Family;
use super::simd::Lanes;

pub const LANES: usize = 16;

/// A weight element type widened to f32 in registers.
pub trait Elem: Copy + Default + Send + Sync + 'static {
    /// # Safety
    /// `p..p + V::N` must be readable and the CPU have V's instructions.
    unsafe fn load<V: Lanes>(p: *const Self) -> V;
    fn to_f32(self) -> f32;
}

impl Elem for f32 {
    #[inline(always)]
    unsafe fn load<V: Lanes>(p: *const f32) -> V {
        // SAFETY: the caller's contract.
        unsafe { V::load(p) }
    }
    fn to_f32(self) -> f32 {
        self
    }
}

/// bf16 as raw bits.
impl Elem for u16 {
    #[inline(always)]
    unsafe fn load<V: Lanes>(p: *const u16) -> V {
        // SAFETY: the caller's contract.
        unsafe { V::load_bf16(p) }
    }
    fn to_f32(self) -> f32 {
        f32::from_bits((self as u32) << 16)
    }
}

impl Elem for f16 {
    #[inline(always)]
    unsafe fn load<V: Lanes>(p: *const f16) -> V {
        // SAFETY: the caller's contract.
        unsafe { V::load_f16(p) }
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

/// `out[i, p0·16 + c]` for MR rows and the NW · V::N columns of the panels from `p0` (whose
/// data starts at `wbase`).
///
/// # Safety
/// x holds MR rows of k at stride k; `wbase` holds the panels the NW vectors cover, of k·16
/// each; out rows are writable for the columns below `n`; the CPU has V's instructions.
#[inline(always)]
unsafe fn block<E: Elem, V: Lanes, const MR: usize, const NW: usize>(
    x: *const f32,
    wbase: *const E,
    k: usize,
    p0: usize,
    out: *mut f32,
    n: usize,
) {
    let per = LANES / V::N;
    // SAFETY (whole body): see the function's contract.
    unsafe {
        let mut acc = [[V::zero(); NW]; MR];
        for kk in 0..k {
            let mut wv = [V::zero(); NW];
            for (j, wr) in wv.iter_mut().enumerate() {
                *wr = E::load::<V>(wbase.add((j / per) * k * LANES + kk * LANES + (j % per) * V::N));
            }
            for (i, row) in acc.iter_mut().enumerate() {
                let xb = V::splat(*x.add(i * k + kk));
                for (a, wr) in row.iter_mut().zip(&wv) {
                    *a = V::fmadd(xb, *wr, *a);
                }
            }
        }
        for (i, row) in acc.iter().enumerate() {
            for (j, a) in row.iter().enumerate() {
                let col = p0 * LANES + j * V::N;
                let dst = out.add(i * n + col);
                if col + V::N <= n {
                    a.store(dst);
                } else if col < n {
                    let mut tmp = [0f32; LANES];
                    a.store(tmp.as_mut_ptr());
                    std::ptr::copy_nonoverlapping(tmp.as_ptr(), dst, n - col);
                }
            }
        }
    }
}

/// [`block`] for every group of MR rows below m, then the rest.
///
/// # Safety
/// As [`block`] for every group of rows below m.
#[inline(always)]
unsafe fn row_groups<E: Elem, V: Lanes, const MR: usize, const NW: usize>(
    x: &[f32],
    m: usize,
    wbase: *const E,
    (k, p0): (usize, usize),
    out: OutPtr,
    n: usize,
) {
    let mut i = 0;
    // SAFETY: row groups stay below m; the rest is the caller's contract.
    unsafe {
        while i + MR <= m {
            block::<E, V, MR, NW>(x.as_ptr().add(i * k), wbase, k, p0, out.0.add(i * n), n);
            i += MR;
        }
        let (xp, op) = (x.as_ptr().add(i * k), out.0.add(i * n));
        match m - i {
            7 => block::<E, V, 7, NW>(xp, wbase, k, p0, op, n),
            6 => block::<E, V, 6, NW>(xp, wbase, k, p0, op, n),
            5 => block::<E, V, 5, NW>(xp, wbase, k, p0, op, n),
            4 => block::<E, V, 4, NW>(xp, wbase, k, p0, op, n),
            3 => block::<E, V, 3, NW>(xp, wbase, k, p0, op, n),
            2 => block::<E, V, 2, NW>(xp, wbase, k, p0, op, n),
            1 => block::<E, V, 1, NW>(xp, wbase, k, p0, op, n),
            _ => {}
        }
    }
}

/// Every input row against the panels the NW vectors cover from `p0` (widened to f32 first
/// where many rows read them).
///
/// # Safety
/// The panels exist; out is `[m, n]`; the CPU has V's instructions.
#[inline(always)]
unsafe fn panels<E: Elem, V: Lanes, const MR: usize, const NW: usize>(
    x: &[f32],
    m: usize,
    w: &Packed<E>,
    p0: usize,
    out: OutPtr,
    scratch: &mut Vec<f32>,
) {
    let (k, count) = (w.k, (NW * V::N).div_ceil(LANES));
    // SAFETY: the caller's contract.
    unsafe {
        match widened(w, m, p0, count, scratch) {
            Some(wide) => row_groups::<f32, V, MR, NW>(x, m, wide, (k, p0), out, w.n),
            None => row_groups::<E, V, MR, NW>(x, m, w.data[p0 * k * LANES..].as_ptr(), (k, p0), out, w.n),
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

/// Panels `p0..p1`: blocks of NW vectors, then single panels of NW1 vectors.
///
/// # Safety
/// The panels exist; out is `[m, n]`; the CPU has V's instructions.
#[inline(always)]
unsafe fn chunk<E: Elem, V: Lanes, const MR: usize, const NW: usize, const NW1: usize>(
    x: &[f32],
    m: usize,
    w: &Packed<E>,
    (p0, p1): (usize, usize),
    out: OutPtr,
    scratch: &mut Vec<f32>,
) {
    let step = (NW * V::N).div_ceil(LANES);
    let mut p = p0;
    // SAFETY: every panel below p1 exists; the rest is the caller's contract.
    unsafe {
        while p + step <= p1 {
            panels::<E, V, MR, NW>(x, m, w, p, out, scratch);
            p += step;
        }
        while p < p1 {
            panels::<E, V, MR, NW1>(x, m, w, p, out, scratch);
            p += 1;
        }
    }
}

/// The families' entry points of [`chunk`], compiled for their instructions.
/// # Safety (each)
/// As [`chunk`], on a CPU with the family's instructions.
mod entries {
    #[cfg(target_arch = "aarch64")]
    use std::arch::aarch64::float32x4_t;
    #[cfg(target_arch = "x86_64")]
    use std::arch::x86_64::{__m256, __m512};

    use super::{Elem, OutPtr, Packed, chunk};

    /// Two panels (2 × 16 lanes) for 8 rows at a time.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn avx512<E: Elem>(
        x: &[f32],
        m: usize,
        w: &Packed<E>,
        ps: (usize, usize),
        out: OutPtr,
        s: &mut Vec<f32>,
    ) {
        // SAFETY: the caller's contract.
        unsafe { chunk::<E, __m512, 8, 2, 1>(x, m, w, ps, out, s) }
    }
    /// One panel (2 × 8 lanes) for 4 rows at a time.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn avx2<E: Elem>(
        x: &[f32],
        m: usize,
        w: &Packed<E>,
        ps: (usize, usize),
        out: OutPtr,
        s: &mut Vec<f32>,
    ) {
        // SAFETY: the caller's contract.
        unsafe { chunk::<E, __m256, 4, 2, 2>(x, m, w, ps, out, s) }
    }
    /// One panel (4 × 4 lanes) for 4 rows at a time.
    #[cfg(target_arch = "aarch64")]
    #[target_feature(enable = "neon")]
    pub unsafe fn neon<E: Elem>(
        x: &[f32],
        m: usize,
        w: &Packed<E>,
        ps: (usize, usize),
        out: OutPtr,
        s: &mut Vec<f32>,
    ) {
        // SAFETY: the caller's contract.
        unsafe { chunk::<E, float32x4_t, 4, 4, 4>(x, m, w, ps, out, s) }
    }
}

/// `out[m, n] = x[m, k] · Wᵀ` under `family`. Panics unless the family is a SIMD one this
/// CPU has.
pub fn matmul<E: Elem>(family: Family, x: &[f32], m: usize, w: &Packed<E>, out: &mut [f32]) {
    let (n, k) = (w.n, w.k);
    assert!(x.len() >= m * k && out.len() >= m * n);
    assert!(family != Family::Portable && family.supported(), "packed weights need {}", family.name());
    // Panels a block takes (AVX-512 two: fewer passes over x).
    let step = if family == Family::Avx512 { 2 } else { 1 };
    let total = n.div_ceil(LANES);
    // Enough chunks to balance both cores, each a whole number of blocks.
    let chunk = total.div_ceil(rayon::current_num_threads() * 8).div_ceil(step).max(1) * step;
    let out_ptr = OutPtr(out.as_mut_ptr());
    (0..total.div_ceil(chunk)).into_par_iter().for_each_init(Vec::new, |scratch, c| {
        let ps = (c * chunk, ((c + 1) * chunk).min(total));
        // SAFETY: the family's features were asserted above; this chunk writes only its own
        // panels' columns.
        unsafe {
            match family {
                #[cfg(target_arch = "x86_64")]
                Family::Avx512 => entries::avx512(x, m, w, ps, out_ptr, scratch),
                #[cfg(target_arch = "x86_64")]
                Family::Avx2 => entries::avx2(x, m, w, ps, out_ptr, scratch),
                #[cfg(target_arch = "aarch64")]
                Family::Neon => entries::neon(x, m, w, ps, out_ptr, scratch),
                _ => unreachable!("asserted above"),
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::super::test_values as rand_vec;

    fn check<E: Elem>(family: Family, rows: &[E], x: &[f32], m: usize, n: usize, k: usize) {
        let p = Packed::pack(rows, n, k);
        let mut out = vec![f32::NAN; m * n];
        matmul(family, x, m, &p, &mut out);
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
        let families: Vec<Family> =
            Family::all_supported().into_iter().filter(|f| *f != Family::Portable).collect();
        assert!(!families.is_empty(), "this CPU has no SIMD family");
        for family in families {
            for &(m, n, k) in
                &[(1, 17, 64), (3, 100, 37), (8, 48, 576), (13, 1000, 96), (33, 31, 5), (5, 64, 8)]
            {
                let x = rand_vec(m * k, 1);
                let w = rand_vec(n * k, 2);
                check(family, &w, &x, m, n, k);
                let b: Vec<u16> = w.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
                check(family, &b, &x, m, n, k);
                let h: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
                check(family, &h, &x, m, n, k);
            }
        }
    }
}
