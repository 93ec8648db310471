//! Batched LoRA on the CPU (Punica's BGMV idea): every token gathers its own adapter's A
//! and B by slot index, shrinks `x` to `rank` values, then expands into its output row.
//! Mixed batches (several adapters and the base model) run in one pass, rows in parallel.

use rayon::prelude::*;

use super::CpuTensor;
use crate::kernels::{LoraShape, LoraSlotWeights};

/// A: `[slots, max_rank, in]`, B: `[slots, out, max_rank]` (scale folded into B).
pub struct CpuLora {
    pub shape: LoraShape,
    a: Vec<f32>,
    b: Vec<f32>,
    ranks: Vec<usize>,
}

impl CpuLora {
    pub fn new(shape: LoraShape) -> Self {
        let (s, r) = (shape.slots, shape.max_rank);
        Self {
            shape,
            a: vec![0.0; s * r * shape.in_features],
            b: vec![0.0; s * shape.out_features * r],
            ranks: vec![0; s],
        }
    }

    pub fn set(&mut self, slot: usize, w: Option<LoraSlotWeights>) {
        let LoraShape { max_rank: rm, in_features: fin, out_features: fout, .. } = self.shape;
        let a = &mut self.a[slot * rm * fin..(slot + 1) * rm * fin];
        let b = &mut self.b[slot * fout * rm..(slot + 1) * fout * rm];
        a.fill(0.0);
        b.fill(0.0);
        self.ranks[slot] = 0;
        let Some(w) = w else { return };
        assert!(w.rank <= rm && w.a.len() == w.rank * fin && w.b.len() == fout * w.rank, "LoRA slot shape");
        a[..w.rank * fin].copy_from_slice(w.a);
        for o in 0..fout {
            for r in 0..w.rank {
                b[o * rm + r] = w.b[o * w.rank + r] * w.scale;
            }
        }
        self.ranks[slot] = w.rank;
    }

    pub fn apply(&self, y: &mut CpuTensor, x: &CpuTensor, offset: usize, slots: &[i32]) {
        let LoraShape { max_rank: rm, in_features: fin, out_features: fout, .. } = self.shape;
        assert_eq!(x.cols, fin, "LoRA input features");
        assert!(offset + fout <= y.cols, "LoRA output slice beyond the tensor");
        let ycols = y.cols;
        y.data.par_chunks_mut(ycols).zip(x.data.par_chunks(fin)).zip(slots).for_each(|((yr, xr), &s)| {
            if s < 0 {
                return;
            }
            let s = s as usize;
            let rank = self.ranks[s];
            let mut v = [0f32; 256];
            for (r, vr) in v.iter_mut().enumerate().take(rank) {
                let a = &self.a[(s * rm + r) * fin..(s * rm + r + 1) * fin];
                *vr = a.iter().zip(xr).map(|(p, q)| p * q).sum();
            }
            let b = &self.b[s * fout * rm..(s + 1) * fout * rm];
            for (o, yo) in yr[offset..offset + fout].iter_mut().enumerate() {
                let row = &b[o * rm..o * rm + rank];
                *yo += row.iter().zip(&v[..rank]).map(|(p, q)| p * q).sum::<f32>();
            }
        });
    }
}
