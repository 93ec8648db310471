//! `y = x · Wᵀ` on the CPU, for weights in f32, bf16 or f16 with f32 accumulation.
//!
//! The portable path for row-major weights (CPUs without AVX-512; AVX-512 CPUs use the
//! packed layout of `packed.rs`): the `gemm` crate's blocked kernel, with bf16/f16 weights
//! widened to f32 one panel of rows at a time so that the widened copy stays in cache.

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

/// Weight rows widened to f32 per GEMM panel (bf16/f16 weights).
const PANEL_ROWS: usize = 512;

/// `out[m, n] = x[m, k] · w[n, k]ᵀ`.
pub fn matmul(x: &[f32], m: usize, k: usize, w: &WeightData, n: usize, out: &mut [f32]) {
    debug_assert_eq!(x.len(), m * k);
    debug_assert_eq!(out.len(), m * n);
    blocked(x, m, k, w, n, out);
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
            widened(x, (m, k, n), out, |r, row| widen_row(w, r * k, row))
        }
    }
}

/// `out[m, n] = x[m, k] · Wᵀ` for a weight whose row r `widen(r, row)` writes in f32: rows
/// widened a panel at a time (so that the copy stays in cache), each panel one GEMM.
pub fn widened(
    x: &[f32],
    (m, k, n): (usize, usize, usize),
    out: &mut [f32],
    widen: impl Fn(usize, &mut [f32]) + Sync,
) {
    let mut panel = vec![0f32; PANEL_ROWS.min(n) * k];
    let mut r0 = 0;
    while r0 < n {
        let rows = PANEL_ROWS.min(n - r0);
        let dst = &mut panel[..rows * k];
        dst.par_chunks_mut(k).enumerate().for_each(|(i, row)| widen(r0 + i, row));
        gemm_f32(x, m, k, dst, rows, Dst { out: &mut *out, ld: n, col0: r0 });
        r0 += rows;
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

    use super::super::test_values as rand_vec;

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
