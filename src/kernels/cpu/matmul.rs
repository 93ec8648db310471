//! `y = x · Wᵀ` on the CPU, for weights in f32, bf16 or f16 with f32 accumulation.
//!
//! Two regimes. Few rows (decode) are bound by reading W once: a streaming kernel walks
//! each weight row once and dots it with every input row while it is in registers
//! (AVX-512 when the CPU has it). Many rows (prefill) are bound by arithmetic: the `gemm`
//! crate's blocked kernel does it, with bf16/f16 weights widened to f32 one panel of rows
//! at a time so that the widened copy stays in cache.

use gemm::Parallelism;
use half::f16;
use rayon::prelude::*;

/// Weight storage; row-major `[out, in]`.
pub enum WeightData {
    F32(Vec<f32>),
    /// Raw bf16 bits.
    Bf16(Vec<u16>),
    F16(Vec<f16>),
}

/// Rows at or above which the blocked GEMM beats the streaming kernel.
const GEMM_MIN_ROWS: usize = 6;
/// Weight rows widened to f32 per GEMM panel (bf16/f16 weights).
const PANEL_ROWS: usize = 512;

/// `out[m, n] = x[m, k] · w[n, k]ᵀ`.
pub fn matmul(x: &[f32], m: usize, k: usize, w: &WeightData, n: usize, out: &mut [f32]) {
    debug_assert_eq!(x.len(), m * k);
    debug_assert_eq!(out.len(), m * n);
    if m >= GEMM_MIN_ROWS {
        blocked(x, m, k, w, n, out);
    } else {
        streaming(x, m, k, w, n, out);
    }
}

fn threads() -> usize {
    rayon::current_num_threads()
}

/// Columns `col0..col0 + cols` of a row-major `[m, ld]` output.
struct Dst<'a> {
    out: &'a mut [f32],
    ld: usize,
    col0: usize,
}

/// `dst = x · panelᵀ` with the f32 panel `[cols, k]`.
fn gemm_f32(x: &[f32], m: usize, k: usize, panel: &[f32], cols: usize, dst: Dst) {
    assert!(x.len() >= m * k && panel.len() >= cols * k && dst.col0 + cols <= dst.ld);
    assert!(dst.out.len() >= m * dst.ld);
    // SAFETY: all pointers are in bounds (asserted above): x is [m, k] (row stride k), panel
    // is [cols, k] read as the k×cols right-hand side (column stride k, row stride 1), and
    // the output is [m, ld] with cols columns written from col0; gemm writes only dst.
    unsafe {
        gemm::gemm(
            m,
            cols,
            k,
            dst.out.as_mut_ptr().add(dst.col0),
            1,
            dst.ld as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            panel.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            Parallelism::Rayon(threads()),
        );
    }
}

fn blocked(x: &[f32], m: usize, k: usize, w: &WeightData, n: usize, out: &mut [f32]) {
    match w {
        WeightData::F32(w) => gemm_f32(x, m, k, w, n, Dst { out, ld: n, col0: 0 }),
        WeightData::Bf16(_) | WeightData::F16(_) => {
            let mut panel = vec![0f32; PANEL_ROWS.min(n) * k];
            let mut r0 = 0;
            while r0 < n {
                let rows = PANEL_ROWS.min(n - r0);
                let dst = &mut panel[..rows * k];
                dst.par_chunks_mut(k).enumerate().for_each(|(i, row)| widen_row(w, (r0 + i) * k, row));
                gemm_f32(x, m, k, dst, rows, Dst { out: &mut *out, ld: n, col0: r0 });
                r0 += rows;
            }
        }
    }
}

fn widen_row(w: &WeightData, start: usize, row: &mut [f32]) {
    let n = row.len();
    match w {
        WeightData::F32(w) => row.copy_from_slice(&w[start..start + n]),
        WeightData::Bf16(w) => {
            for (o, &b) in row.iter_mut().zip(&w[start..start + n]) {
                *o = f32::from_bits((b as u32) << 16);
            }
        }
        WeightData::F16(w) => {
            for (o, &h) in row.iter_mut().zip(&w[start..start + n]) {
                *o = h.to_f32();
            }
        }
    }
}

/// Streams W once: output columns are split across threads, each weight row is dotted with
/// all `m` input rows while it is in registers.
fn streaming(x: &[f32], m: usize, k: usize, w: &WeightData, n: usize, out: &mut [f32]) {
    let chunk = n.div_ceil(threads() * 8).max(16);
    // Transposed result [n, m] so that each thread writes one contiguous range.
    let mut t = vec![0f32; n * m];
    t.par_chunks_mut(chunk * m).enumerate().for_each(|(ci, dst)| {
        let r0 = ci * chunk;
        for (i, o) in dst.chunks_mut(m).enumerate() {
            dot_row(x, m, k, w, r0 + i, o);
        }
    });
    for j in 0..n {
        for i in 0..m {
            out[i * n + j] = t[j * m + i];
        }
    }
}

/// `o[i] = dot(x[i, :], w[row, :])` for every input row i.
fn dot_row(x: &[f32], m: usize, k: usize, w: &WeightData, row: usize, o: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F (checked above); slices are bounds-checked inside.
        unsafe { avx512::dot_row(x, m, k, w, row, o) };
        return;
    }
    let start = row * k;
    for (i, oi) in o.iter_mut().enumerate() {
        let xi = &x[i * k..(i + 1) * k];
        *oi = match w {
            WeightData::F32(w) => dot_f32(xi, &w[start..start + k]),
            WeightData::Bf16(w) => {
                xi.iter().zip(&w[start..start + k]).map(|(a, &b)| a * f32::from_bits((b as u32) << 16)).sum()
            }
            WeightData::F16(w) => xi.iter().zip(&w[start..start + k]).map(|(a, b)| a * b.to_f32()).sum(),
        };
    }
}

/// Portable dot product with eight independent accumulators (vectorizes without AVX-512).
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F (checked above).
        return unsafe { avx512::dot(a, b) };
    }
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::WeightData;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    unsafe fn load_w(w: &WeightData, at: usize) -> __m512 {
        // SAFETY: callers pass `at + 16 <= len` of the weight buffer.
        unsafe {
            match w {
                WeightData::F32(v) => _mm512_loadu_ps(v.as_ptr().add(at)),
                WeightData::Bf16(v) => {
                    let h = _mm256_loadu_si256(v.as_ptr().add(at) as *const __m256i);
                    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                }
                WeightData::F16(v) => {
                    _mm512_cvtph_ps(_mm256_loadu_si256(v.as_ptr().add(at) as *const __m256i))
                }
            }
        }
    }

    fn w_at(w: &WeightData, at: usize) -> f32 {
        match w {
            WeightData::F32(v) => v[at],
            WeightData::Bf16(v) => f32::from_bits((v[at] as u32) << 16),
            WeightData::F16(v) => v[at].to_f32(),
        }
    }

    /// Up to `M` input rows against one weight row.
    #[target_feature(enable = "avx512f")]
    unsafe fn rows<const M: usize>(
        x: &[f32],
        x0: usize,
        k: usize,
        w: &WeightData,
        start: usize,
        o: &mut [f32],
    ) {
        let mut acc = [_mm512_setzero_ps(); M];
        let full = k / 16 * 16;
        let mut kk = 0;
        while kk < full {
            // SAFETY: kk + 16 <= k, so both the weight row and each x row are in bounds.
            unsafe {
                let wv = load_w(w, start + kk);
                for (i, a) in acc.iter_mut().enumerate() {
                    let xv = _mm512_loadu_ps(x.as_ptr().add((x0 + i) * k + kk));
                    *a = _mm512_fmadd_ps(xv, wv, *a);
                }
            }
            kk += 16;
        }
        for (i, a) in acc.iter().enumerate() {
            let mut s = _mm512_reduce_add_ps(*a);
            for j in full..k {
                s += x[(x0 + i) * k + j] * w_at(w, start + j);
            }
            o[x0 + i] = s;
        }
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_row(x: &[f32], m: usize, k: usize, w: &WeightData, row: usize, o: &mut [f32]) {
        let start = row * k;
        let len = match w {
            WeightData::F32(v) => v.len(),
            WeightData::Bf16(v) => v.len(),
            WeightData::F16(v) => v.len(),
        };
        assert!(start + k <= len && x.len() >= m * k && o.len() >= m);
        let mut i = 0;
        // SAFETY (all calls): bounds asserted above; AVX-512F enabled on this function.
        unsafe {
            while i + 4 <= m {
                rows::<4>(x, i, k, w, start, o);
                i += 4;
            }
            while i + 2 <= m {
                rows::<2>(x, i, k, w, start, o);
                i += 2;
            }
            if i < m {
                rows::<1>(x, i, k, w, start, o);
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let full = n / 16 * 16;
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        while i < full {
            // SAFETY: i + 16 <= n for both slices.
            unsafe {
                acc = _mm512_fmadd_ps(
                    _mm512_loadu_ps(a.as_ptr().add(i)),
                    _mm512_loadu_ps(b.as_ptr().add(i)),
                    acc,
                );
            }
            i += 16;
        }
        let mut s = _mm512_reduce_add_ps(acc);
        for j in full..n {
            s += a[j] * b[j];
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] =
                    (0..k).map(|t| x[i * k + t] as f64 * w[j * k + t] as f64).sum::<f64>() as f32;
            }
        }
        out
    }

    fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    #[test]
    fn every_regime_and_dtype_matches_reference() {
        for &(m, k, n) in &[(1, 576, 100), (3, 37, 1000), (5, 64, 17), (7, 576, 600), (33, 100, 1100)] {
            let x = rand_vec(m * k, 1);
            let wf = rand_vec(n * k, 2);
            let bf: Vec<u16> = wf.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
            let wb: Vec<f32> = bf.iter().map(|&b| f32::from_bits((b as u32) << 16)).collect();
            let hf: Vec<f16> = wf.iter().map(|&v| f16::from_f32(v)).collect();
            let wh: Vec<f32> = hf.iter().map(|h| h.to_f32()).collect();
            for (w, dense) in
                [(WeightData::F32(wf.clone()), &wf), (WeightData::Bf16(bf), &wb), (WeightData::F16(hf), &wh)]
            {
                let mut out = vec![0f32; m * n];
                matmul(&x, m, k, &w, n, &mut out);
                let want = reference(&x, m, k, dense, n);
                for (a, b) in out.iter().zip(&want) {
                    assert!((a - b).abs() < 1e-4 * (k as f32).sqrt(), "m={m} k={k} n={n}: {a} vs {b}");
                }
            }
        }
    }
}
