//! Batched LoRA on the CPU (Punica's BGMV idea): every token gathers its own adapter's A
//! and B by slot index, shrinks `x` to `rank` values, then expands into its output row.
//! Mixed batches (several adapters and the base model) run in one pass over the rows, and
//! the modules that read the same input (q/k/v, gate/up) share that pass.

use rayon::prelude::*;

use super::simd::{Row, family_axpy, family_dot};
use super::{CpuTensor, Family};
use crate::kernels::{LoraShape, LoraSlotWeights};

/// LoRA weights in f32, or in bf16 (`--lora-dtype bfloat16`: half the bytes to read).
enum Store {
    F32(Vec<f32>),
    /// Raw bf16 bits.
    Bf16(Vec<u16>),
}

impl Store {
    fn new(n: usize, bf16: bool) -> Self {
        if bf16 { Store::Bf16(vec![0; n]) } else { Store::F32(vec![0.0; n]) }
    }
    fn write(&mut self, start: usize, values: &[f32]) {
        match self {
            Store::F32(v) => v[start..start + values.len()].copy_from_slice(values),
            Store::Bf16(v) => {
                for (o, x) in v[start..start + values.len()].iter_mut().zip(values) {
                    *o = half::bf16::from_f32(*x).to_bits();
                }
            }
        }
    }
    fn row(&self, start: usize, len: usize) -> Row<'_> {
        match self {
            Store::F32(v) => Row::F32(&v[start..start + len]),
            Store::Bf16(v) => Row::Bf16(&v[start..start + len]),
        }
    }
}

/// A: `[slots, max_rank, in]`, Bᵀ: `[slots, max_rank, out]` with the scale folded in, so
/// that the expand step is a row of contiguous axpys.
pub struct CpuLora {
    pub shape: LoraShape,
    a: Store,
    bt: Store,
    ranks: Vec<usize>,
}

impl CpuLora {
    pub fn new(shape: LoraShape) -> Self {
        let (s, r) = (shape.slots, shape.max_rank);
        Self {
            shape,
            a: Store::new(s * r * shape.in_features, shape.bf16),
            bt: Store::new(s * r * shape.out_features, shape.bf16),
            ranks: vec![0; s],
        }
    }

    pub fn set(&mut self, slot: usize, w: Option<LoraSlotWeights>) {
        let LoraShape { max_rank: rm, in_features: fin, out_features: fout, .. } = self.shape;
        let mut a = vec![0f32; rm * fin];
        let mut bt = vec![0f32; rm * fout];
        self.ranks[slot] = 0;
        if let Some(w) = w {
            assert!(
                w.rank <= rm && w.a.len() == w.rank * fin && w.b.len() == fout * w.rank,
                "LoRA slot shape"
            );
            a[..w.rank * fin].copy_from_slice(w.a);
            for o in 0..fout {
                for r in 0..w.rank {
                    bt[r * fout + o] = w.b[o * w.rank + r] * w.scale;
                }
            }
            self.ranks[slot] = w.rank;
        }
        self.a.write(slot * rm * fin, &a);
        self.bt.write(slot * rm * fout, &bt);
    }

    /// `y[t][offset..] += B (A x[t])` for rows `rows` that all use slot `s`: each row of A
    /// and Bᵀ is read once for the group.
    fn apply_group(
        &self,
        family: Family,
        y: RowsPtr,
        x: &CpuTensor,
        offset: usize,
        s: usize,
        rows: &[usize],
    ) {
        let LoraShape { max_rank: rm, in_features: fin, out_features: fout, .. } = self.shape;
        for r in 0..self.ranks[s] {
            let a = self.a.row((s * rm + r) * fin, fin);
            let bt = self.bt.row((s * rm + r) * fout, fout);
            for &t in rows {
                let v = family_dot(family, a, &x.data[t * fin..(t + 1) * fin]);
                // SAFETY: row t belongs to this group alone (see `apply`), so no other
                // thread touches it; the slice lies inside y's row t.
                let yr = unsafe { std::slice::from_raw_parts_mut(y.0.add(t * y.1 + offset), fout) };
                family_axpy(family, yr, v, bt);
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
/// Dots and axpys run `family`'s vectors.
pub fn apply(family: Family, y: &mut CpuTensor, x: &CpuTensor, modules: &[(&CpuLora, usize)], slots: &[i32]) {
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
            l.apply_group(family, ptr, x, *off, s, rows);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`apply`] under every family this CPU has: all give the same rows (within float
    /// reassociation), and `y` gets the first's.
    fn apply(y: &mut CpuTensor, x: &CpuTensor, modules: &[(&CpuLora, usize)], slots: &[i32]) {
        let mut first: Option<Vec<f32>> = None;
        for family in Family::all_supported() {
            let mut out = y.clone();
            super::apply(family, &mut out, x, modules, slots);
            match &first {
                None => first = Some(out.data),
                Some(f) => {
                    for (a, b) in out.data.iter().zip(f) {
                        assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{}: {a} vs {b}", family.name());
                    }
                }
            }
        }
        y.data = first.expect("the portable family at least");
    }

    #[test]
    #[allow(clippy::needless_range_loop)]
    fn mixed_slots_match_the_per_token_formula() {
        let (fin, fout, rm) = (40, 24, 8);
        let shape = LoraShape { slots: 2, max_rank: rm, in_features: fin, out_features: fout, bf16: false };
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

    #[test]
    fn bf16_storage_matches_f32_within_bf16_rounding() {
        let (fin, fout) = (48, 32);
        let mk = |bf16| {
            CpuLora::new(LoraShape { slots: 1, max_rank: 4, in_features: fin, out_features: fout, bf16 })
        };
        let (mut f, mut h) = (mk(false), mk(true));
        let a: Vec<f32> = (0..4 * fin).map(|i| ((i * 31 % 17) as f32 - 8.0) * 0.01).collect();
        let b: Vec<f32> = (0..fout * 4).map(|i| ((i * 13 % 11) as f32 - 5.0) * 0.02).collect();
        for l in [&mut f, &mut h] {
            l.set(0, Some(LoraSlotWeights { a: &a, b: &b, rank: 4, scale: 1.0 }));
        }
        let x = CpuTensor::new((0..3 * fin).map(|i| (i % 7) as f32 * 0.1).collect(), 3, fin);
        let (mut yf, mut yh) =
            (CpuTensor::new(vec![0.0; 3 * fout], 3, fout), CpuTensor::new(vec![0.0; 3 * fout], 3, fout));
        apply(&mut yf, &x, &[(&f, 0)], &[0, 0, 0]);
        apply(&mut yh, &x, &[(&h, 0)], &[0, 0, 0]);
        assert!(yf.data.iter().any(|v| *v != 0.0));
        for (p, q) in yf.data.iter().zip(&yh.data) {
            assert!((p - q).abs() <= 0.02 * (1.0 + p.abs()), "{p} vs {q}");
        }
    }
}
