//! Tensor parallelism on the CPU: the ranks are threads of one process, and the collectives
//! meet at a barrier over shared buffers. Every rank sums or joins the buffers in rank
//! order, so all ranks end with bit-identical results.

use std::sync::{Barrier, RwLock};

/// The shared state of one group of `world` rank threads.
pub struct CpuGroup {
    world: usize,
    barrier: Barrier,
    /// Each rank's contribution to the collective in progress.
    bufs: Vec<RwLock<Vec<f32>>>,
}

impl CpuGroup {
    pub fn new(world: usize) -> Self {
        Self { world, barrier: Barrier::new(world), bufs: (0..world).map(|_| RwLock::default()).collect() }
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// Publishes `data` as `rank`'s part, waits for every rank, then runs `combine` over all
    /// parts (in rank order); returns once every rank has read them.
    fn exchange<R>(&self, rank: usize, data: &[f32], combine: impl FnOnce(&[&[f32]]) -> R) -> R {
        {
            let mut mine = self.bufs[rank].write().unwrap_or_else(|e| e.into_inner());
            mine.clear();
            mine.extend_from_slice(data);
        }
        self.barrier.wait();
        let guards: Vec<_> = self.bufs.iter().map(|b| b.read().unwrap_or_else(|e| e.into_inner())).collect();
        let parts: Vec<&[f32]> = guards.iter().map(|g| g.as_slice()).collect();
        let out = combine(&parts);
        drop(guards);
        // Nobody may overwrite its part before every rank has read all of them.
        self.barrier.wait();
        out
    }

    /// `x ← Σ_ranks x`, summed in rank order.
    pub fn all_reduce(&self, rank: usize, x: &mut [f32]) {
        let snapshot = x.to_vec();
        self.exchange(rank, &snapshot, |parts| {
            x.copy_from_slice(parts[0]);
            for p in &parts[1..] {
                for (a, b) in x.iter_mut().zip(p.iter()) {
                    *a += b;
                }
            }
        });
    }

    /// Each rank's `[rows, cols]` part → `[rows, total]`: the first `keep` columns of each
    /// part side by side in rank order, cut at `total`.
    pub fn all_gather_cols(
        &self,
        rank: usize,
        x: &[f32],
        rows: usize,
        keep: usize,
        total: usize,
    ) -> Vec<f32> {
        let cols = x.len().checked_div(rows).unwrap_or(0);
        self.exchange(rank, x, |parts| {
            let mut out = Vec::with_capacity(rows * total);
            for r in 0..rows {
                let mut left = total;
                for p in parts {
                    let take = keep.min(left);
                    out.extend_from_slice(&p[r * cols..r * cols + take]);
                    left -= take;
                }
            }
            out
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn all_reduce_and_gather_agree_on_every_rank() {
        let g = Arc::new(CpuGroup::new(3));
        let results: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..3)
                .map(|rank| {
                    let g = g.clone();
                    s.spawn(move || {
                        let mut x: Vec<f32> = (0..4).map(|i| (rank * 10 + i) as f32).collect();
                        g.all_reduce(rank, &mut x);
                        // 2 rows of 3 columns, of which 2 are kept; 5 columns in all.
                        let part: Vec<f32> = (0..6).map(|i| (rank * 100 + i) as f32).collect();
                        let gathered = g.all_gather_cols(rank, &part, 2, 2, 5);
                        (x, gathered)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (sum, gathered) in &results {
            assert_eq!(sum, &[30.0, 33.0, 36.0, 39.0]);
            assert_eq!(gathered, &[0.0, 1.0, 100.0, 101.0, 200.0, 3.0, 4.0, 103.0, 104.0, 203.0]);
        }
    }
}
