//! Batched LoRA on the CPU (Punica's BGMV idea): every token gathers its own adapter's A
//! and B by slot index, shrinks `x` to `rank` values, then expands into its output row.
//! Mixed batches (several adapters and the base model) run in one pass over the rows, and
//! the modules that read the same input (q/k/v, gate/up) share that pass.

use rayon::prelude::*;

use super::CpuTensor;
use crate::kernels::{LoraShape, LoraSlotWeights};

/// A: `[slots, max_rank, in]`, Bᵀ: `[slots, max_rank, out]` with the scale folded in, so
/// that the expand step is a row of contiguous axpys.
pub struct CpuLora {
    pub shape: LoraShape,
    a: Vec<f32>,
    bt: Vec<f32>,
    ranks: Vec<usize>,
}

impl CpuLora {
    pub fn new(shape: LoraShape) -> Self {
        let (s, r) = (shape.slots, shape.max_rank);
        Self {
            shape,
            a: vec![0.0; s * r * shape.in_features],
            bt: vec![0.0; s * r * shape.out_features],
            ranks: vec![0; s],
        }
    }

    pub fn set(&mut self, slot: usize, w: Option<LoraSlotWeights>) {
        let LoraShape { max_rank: rm, in_features: fin, out_features: fout, .. } = self.shape;
        let a = &mut self.a[slot * rm * fin..(slot + 1) * rm * fin];
        let bt = &mut self.bt[slot * rm * fout..(slot + 1) * rm * fout];
        a.fill(0.0);
        bt.fill(0.0);
        self.ranks[slot] = 0;
        let Some(w) = w else { return };
        assert!(w.rank <= rm && w.a.len() == w.rank * fin && w.b.len() == fout * w.rank, "LoRA slot shape");
        a[..w.rank * fin].copy_from_slice(w.a);
        for o in 0..fout {
            for r in 0..w.rank {
                bt[r * fout + o] = w.b[o * w.rank + r] * w.scale;
            }
        }
        self.ranks[slot] = w.rank;
    }

    /// `y[t][offset..] += B (A x[t])` for rows `rows` that all use slot `s`: each row of A
    /// and Bᵀ is read once for the group.
    fn apply_group(&self, y: RowsPtr, x: &CpuTensor, offset: usize, s: usize, rows: &[usize]) {
        let LoraShape { max_rank: rm, in_features: fin, out_features: fout, .. } = self.shape;
        for r in 0..self.ranks[s] {
            let a = &self.a[(s * rm + r) * fin..(s * rm + r + 1) * fin];
            let bt = &self.bt[(s * rm + r) * fout..(s * rm + r + 1) * fout];
            for &t in rows {
                let v = dot(a, &x.data[t * fin..(t + 1) * fin]);
                // SAFETY: row t belongs to this group alone (see `apply`), so no other
                // thread touches it; the slice lies inside y's row t.
                let yr = unsafe { std::slice::from_raw_parts_mut(y.0.add(t * y.1 + offset), fout) };
                axpy(yr, v, bt);
            }
        }
    }
}

/// y's data pointer and row length, shared by threads that write disjoint rows.
#[derive(Clone, Copy)]
struct RowsPtr(*mut f32, usize);
// SAFETY: every row is written by exactly one work item.
unsafe impl Send for RowsPtr {}
unsafe impl Sync for RowsPtr {}

/// Rows per work item: a group of rows on one adapter shares each weight read.
const GROUP_ROWS: usize = 4;

/// Applies several modules that read the same input `x` into one output `y`:
/// `(lora, column offset)` pairs, per-row adapter slots (negative = base model). Rows are
/// grouped by slot (the SGMV idea) so that each adapter's weights are read once per group.
pub fn apply(y: &mut CpuTensor, x: &CpuTensor, modules: &[(&CpuLora, usize)], slots: &[i32]) {
    for (l, off) in modules {
        assert_eq!(x.cols, l.shape.in_features, "LoRA input features");
        assert!(off + l.shape.out_features <= y.cols, "LoRA output slice beyond the tensor");
    }
    assert!(slots.len() == y.rows && y.rows == x.rows);
    let mut order: Vec<usize> = (0..slots.len()).filter(|&t| slots[t] >= 0).collect();
    order.sort_by_key(|&t| slots[t]);
    let items: Vec<&[usize]> =
        order.chunk_by(|a, b| slots[*a] == slots[*b]).flat_map(|g| g.chunks(GROUP_ROWS)).collect();
    let ptr = RowsPtr(y.data.as_mut_ptr(), y.cols);
    items.par_iter().for_each(|rows| {
        let s = slots[rows[0]] as usize;
        for (l, off) in modules {
            l.apply_group(ptr, x, *off, s, rows);
        }
    });
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present (checked above).
        return unsafe { simd::dot(a, b) };
    }
    a.iter().zip(b).map(|(p, q)| p * q).sum()
}

fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi;
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX-512F must be available.
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

    #[test]
    #[allow(clippy::needless_range_loop)]
    fn mixed_slots_match_the_per_token_formula() {
        let (fin, fout, rm) = (40, 24, 8);
        let shape = LoraShape { slots: 2, max_rank: rm, in_features: fin, out_features: fout };
        let mut l = CpuLora::new(shape);
        let val = |i: usize, s: f32| ((i * 7919 % 101) as f32 - 50.0) * s;
        let (a0, b0): (Vec<f32>, Vec<f32>) =
            ((0..3 * fin).map(|i| val(i, 0.01)).collect(), (0..fout * 3).map(|i| val(i + 5, 0.02)).collect());
        let (a1, b1): (Vec<f32>, Vec<f32>) = (
            (0..8 * fin).map(|i| val(i + 9, 0.01)).collect(),
            (0..fout * 8).map(|i| val(i + 1, 0.02)).collect(),
        );
        l.set(0, Some(LoraSlotWeights { a: &a0, b: &b0, rank: 3, scale: 2.0 }));
        l.set(1, Some(LoraSlotWeights { a: &a1, b: &b1, rank: 8, scale: 0.5 }));
        let rows = 11;
        let slots: Vec<i32> = (0..rows).map(|t| [1, -1, 0, 1, 1, 1, 1, 0, -1, 1, 1][t]).collect();
        let x = CpuTensor::new((0..rows * fin).map(|i| val(i + 3, 0.05)).collect(), rows, fin);
        let mut y = CpuTensor::new(vec![1.0; rows * (fout + 10)], rows, fout + 10);
        apply(&mut y, &x, &[(&l, 10)], &slots);
        for t in 0..rows {
            for o in 0..fout + 10 {
                let want = if o < 10 || slots[t] < 0 {
                    1.0
                } else {
                    let (a, b, r, sc) = if slots[t] == 0 { (&a0, &b0, 3, 2.0) } else { (&a1, &b1, 8, 0.5) };
                    let v: Vec<f32> = (0..r)
                        .map(|k| (0..fin).map(|i| a[k * fin + i] * x.data[t * fin + i]).sum())
                        .collect();
                    1.0 + sc * (0..r).map(|k| b[(o - 10) * r + k] * v[k]).sum::<f32>()
                };
                let got = y.data[t * (fout + 10) + o];
                assert!((got - want).abs() < 1e-4, "row {t} col {o}: {got} vs {want}");
            }
        }
        // Clearing a slot makes it a no-op.
        l.set(1, None);
        let mut z = CpuTensor::new(vec![0.0; rows * (fout + 10)], rows, fout + 10);
        apply(&mut z, &x, &[(&l, 10)], &vec![1; rows]);
        assert!(z.data.iter().all(|&v| v == 0.0));
    }
}
