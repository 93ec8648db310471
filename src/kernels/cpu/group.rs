//! Tensor parallelism on the CPU: the ranks are threads of one process, and the collectives
//! meet at a barrier over shared buffers. Every rank sums or joins the buffers in rank
//! order, so all ranks end with bit-identical results. A rank that goes away (its device
//! dropped, as when its thread panics) breaks the group: the others stop waiting for it
//! and fail instead of hanging.

use std::sync::{Condvar, Mutex, RwLock};

use crate::kernels::{DevResult, DeviceError};

/// How the ranks of a CPU group meet for their collectives: threads of one process
/// ([`CpuGroup`]) or processes on other nodes joined by a network channel. Every rank ends
/// with the same, bit-identical result: parts are combined in rank order.
pub trait Collective: Send + Sync {
    fn world(&self) -> usize;
    /// `x ← Σ_ranks x`, summed in rank order.
    fn all_reduce(&self, rank: usize, x: &mut [f32]) -> DevResult<()>;
    /// Each rank's `[rows, cols]` part → `[rows, total]`: the first `keep` columns of each
    /// part side by side in rank order, cut at `total`.
    fn all_gather_cols(
        &self,
        rank: usize,
        x: &[f32],
        rows: usize,
        keep: usize,
        total: usize,
    ) -> DevResult<Vec<f32>>;
    /// Marks the group broken: this rank has gone and no collective can complete.
    fn abandon(&self);
}

/// `x ← Σ parts`, in rank order (rank 0's part first).
pub fn sum_in_rank_order(x: &mut [f32], parts: &[&[f32]]) -> DevResult<()> {
    x.copy_from_slice(parts[0]);
    for p in &parts[1..] {
        if p.len() != x.len() {
            return Err(DeviceError::Other(format!(
                "all-reduce: a rank sent {} values, {} expected",
                p.len(),
                x.len()
            )));
        }
        for (a, b) in x.iter_mut().zip(p.iter()) {
            *a += b;
        }
    }
    Ok(())
}

/// The parts of an all-gather (each `[rows, cols]`, in rank order) joined as
/// [`Collective::all_gather_cols`] says.
pub fn gather_cols(parts: &[&[f32]], rows: usize, keep: usize, total: usize) -> DevResult<Vec<f32>> {
    let cols = parts[0].len().checked_div(rows).unwrap_or(0);
    if keep > cols || parts.iter().any(|p| p.len() != rows * cols) {
        return Err(DeviceError::Other(format!(
            "all-gather: parts of {:?} values, {rows} rows of {cols} expected",
            parts.iter().map(|p| p.len()).collect::<Vec<_>>()
        )));
    }
    let mut out = Vec::with_capacity(rows * total);
    for r in 0..rows {
        let mut left = total;
        for p in parts {
            let take = keep.min(left);
            out.extend_from_slice(&p[r * cols..r * cols + take]);
            left -= take;
        }
    }
    Ok(out)
}

/// The shared state of one group of `world` rank threads.
pub struct CpuGroup {
    world: usize,
    barrier: Mutex<BarrierState>,
    arrivals: Condvar,
    /// Each rank's contribution to the collective in progress.
    bufs: Vec<RwLock<Vec<f32>>>,
}

#[derive(Default)]
struct BarrierState {
    arrived: usize,
    generation: u64,
    broken: bool,
}

impl CpuGroup {
    pub fn new(world: usize) -> Self {
        Self {
            world,
            barrier: Mutex::default(),
            arrivals: Condvar::new(),
            bufs: (0..world).map(|_| RwLock::default()).collect(),
        }
    }

    /// Waits until every rank has arrived. Panics when the group is broken: the rank's
    /// runner fails (and with rank 0, every request in flight) rather than wait forever.
    fn wait(&self) {
        let mut s = self.barrier.lock().unwrap_or_else(|e| e.into_inner());
        let generation = s.generation;
        s.arrived += 1;
        if s.arrived == self.world {
            s.arrived = 0;
            s.generation += 1;
            self.arrivals.notify_all();
        }
        while s.generation == generation && !s.broken {
            s = self.arrivals.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        assert!(s.generation != generation, "tensor-parallel group broken: a peer rank has stopped");
    }

    /// Publishes `data` as `rank`'s part of the collective in progress.
    fn publish(&self, rank: usize, data: &[f32]) {
        let mut mine = self.bufs[rank].write().unwrap_or_else(|e| e.into_inner());
        mine.clear();
        mine.extend_from_slice(data);
    }

    /// Waits for every rank's part, then runs `combine` over all parts (in rank order);
    /// returns once every rank has read them.
    fn combine<R>(&self, combine: impl FnOnce(&[&[f32]]) -> R) -> R {
        self.wait();
        let guards: Vec<_> = self.bufs.iter().map(|b| b.read().unwrap_or_else(|e| e.into_inner())).collect();
        let parts: Vec<&[f32]> = guards.iter().map(|g| g.as_slice()).collect();
        let out = combine(&parts);
        drop(guards);
        // Nobody may overwrite its part before every rank has read all of them.
        self.wait();
        out
    }
}

impl Collective for CpuGroup {
    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce(&self, rank: usize, x: &mut [f32]) -> DevResult<()> {
        self.publish(rank, x);
        self.combine(|parts| sum_in_rank_order(x, parts))
    }

    fn all_gather_cols(
        &self,
        rank: usize,
        x: &[f32],
        rows: usize,
        keep: usize,
        total: usize,
    ) -> DevResult<Vec<f32>> {
        self.publish(rank, x);
        self.combine(|parts| gather_cols(parts, rows, keep, total))
    }

    fn abandon(&self) {
        let mut s = self.barrier.lock().unwrap_or_else(|e| e.into_inner());
        s.broken = true;
        self.arrivals.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_rank_that_goes_away_fails_the_others_instead_of_hanging() {
        let g = Arc::new(CpuGroup::new(2));
        let waiting = {
            let g = g.clone();
            std::thread::spawn(move || {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    g.all_reduce(0, &mut [1.0]).unwrap()
                }))
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        g.abandon();
        let outcome = waiting.join().unwrap();
        assert!(outcome.is_err(), "rank 0 gave up on the collective");
    }

    #[test]
    fn all_reduce_and_gather_agree_on_every_rank() {
        let g = Arc::new(CpuGroup::new(3));
        let results: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..3)
                .map(|rank| {
                    let g = g.clone();
                    s.spawn(move || {
                        let mut x: Vec<f32> = (0..4).map(|i| (rank * 10 + i) as f32).collect();
                        g.all_reduce(rank, &mut x).unwrap();
                        // 2 rows of 3 columns, of which 2 are kept; 5 columns in all.
                        let part: Vec<f32> = (0..6).map(|i| (rank * 100 + i) as f32).collect();
                        let gathered = g.all_gather_cols(rank, &part, 2, 2, 5).unwrap();
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
