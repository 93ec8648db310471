//! Tensor parallelism on the CPU: the ranks are threads of one process, and the collectives
//! meet at a barrier over shared buffers. Every rank sums or joins the buffers in rank
//! order, so all ranks end with bit-identical results. A rank that goes away (its device
//! dropped, as when its thread panics), fails a step part-way, or does not reach a
//! collective within the group's timeout breaks the group: the others stop waiting for it
//! and fail with the reason instead of hanging, and the group stays failed.

use std::sync::{Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::kernels::{DevResult, DeviceError, GroupHealth};

/// How the ranks of a CPU group meet for their collectives: threads of one process
/// ([`CpuGroup`]) or processes on other nodes joined by a network channel. Every rank ends
/// with the same, bit-identical result: parts are combined in rank order.
pub trait Collective: GroupHealth {
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
}

fn failed(why: &str) -> DeviceError {
    DeviceError::Other(format!("the tensor-parallel group has failed: {why}"))
}

/// `x ← Σ parts`, in rank order (rank 0's part first).
pub fn sum_in_rank_order(x: &mut [f32], parts: &[&[f32]]) -> DevResult<()> {
    x.copy_from_slice(parts[0]);
    add_in_rank_order(x, &parts[1..])
}

/// `x ← x + Σ parts`, in order: rank 0 adds the other ranks' parts to its own in place.
pub fn add_in_rank_order(x: &mut [f32], parts: &[&[f32]]) -> DevResult<()> {
    for p in parts {
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
    /// How long a rank waits at a collective for the others before it fails the group.
    timeout: Duration,
    barrier: Mutex<BarrierState>,
    arrivals: Condvar,
    /// Each rank's contribution to the collective in progress.
    bufs: Vec<RwLock<Vec<f32>>>,
}

struct BarrierState {
    /// Which ranks have arrived at the barrier in progress.
    arrived: Vec<bool>,
    generation: u64,
    broken: Option<String>,
}

impl CpuGroup {
    pub fn new(world: usize, timeout: Duration) -> Self {
        Self {
            world,
            timeout,
            barrier: Mutex::new(BarrierState { arrived: vec![false; world], generation: 0, broken: None }),
            arrivals: Condvar::new(),
            bufs: (0..world).map(|_| RwLock::default()).collect(),
        }
    }

    /// Waits until every rank has arrived: an error once the group has failed, or when a
    /// rank has not arrived within the timeout (which fails the group, naming the ranks).
    fn wait(&self, rank: usize) -> DevResult<()> {
        let mut s = self.barrier.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(why) = &s.broken {
            return Err(failed(why));
        }
        let generation = s.generation;
        s.arrived[rank] = true;
        if s.arrived.iter().all(|&a| a) {
            s.arrived.iter_mut().for_each(|a| *a = false);
            s.generation += 1;
            self.arrivals.notify_all();
            return Ok(());
        }
        let deadline = Instant::now() + self.timeout;
        while s.generation == generation && s.broken.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let missing: Vec<String> =
                    (0..self.world).filter(|&r| !s.arrived[r]).map(|r| r.to_string()).collect();
                s.broken = Some(format!(
                    "rank {} did not reach a collective within {:.1} s",
                    missing.join(", "),
                    self.timeout.as_secs_f64()
                ));
                tracing::error!(reason = s.broken.as_deref(), "the tensor-parallel group has failed");
                self.arrivals.notify_all();
                break;
            }
            s = self.arrivals.wait_timeout(s, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        match &s.broken {
            Some(why) if s.generation == generation => Err(failed(why)),
            _ => Ok(()),
        }
    }

    /// Publishes `data` as `rank`'s part of the collective in progress.
    fn publish(&self, rank: usize, data: &[f32]) {
        let mut mine = self.bufs[rank].write().unwrap_or_else(|e| e.into_inner());
        mine.clear();
        mine.extend_from_slice(data);
    }

    /// Waits for every rank's part, then runs `combine` over all parts (in rank order);
    /// returns once every rank has read them.
    fn combine<R>(&self, rank: usize, combine: impl FnOnce(&[&[f32]]) -> DevResult<R>) -> DevResult<R> {
        self.wait(rank)?;
        let guards: Vec<_> = self.bufs.iter().map(|b| b.read().unwrap_or_else(|e| e.into_inner())).collect();
        let parts: Vec<&[f32]> = guards.iter().map(|g| g.as_slice()).collect();
        let out = combine(&parts);
        drop(guards);
        // Nobody may overwrite its part before every rank has read all of them.
        self.wait(rank)?;
        out
    }
}

impl GroupHealth for CpuGroup {
    fn failure(&self) -> Option<String> {
        self.barrier.lock().unwrap_or_else(|e| e.into_inner()).broken.clone()
    }

    fn fail(&self, why: String) {
        let mut s = self.barrier.lock().unwrap_or_else(|e| e.into_inner());
        if s.broken.is_none() {
            tracing::error!(reason = %why, "the tensor-parallel group has failed");
            s.broken = Some(why);
        }
        self.arrivals.notify_all();
    }
}

impl Collective for CpuGroup {
    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce(&self, rank: usize, x: &mut [f32]) -> DevResult<()> {
        self.publish(rank, x);
        self.combine(rank, |parts| sum_in_rank_order(x, parts))
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
        self.combine(rank, |parts| gather_cols(parts, rows, keep, total))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    const LONG: Duration = Duration::from_secs(60);

    #[test]
    fn a_rank_that_goes_away_fails_the_others_instead_of_hanging() {
        let g = Arc::new(CpuGroup::new(2, LONG));
        let waiting = {
            let g = g.clone();
            std::thread::spawn(move || g.all_reduce(0, &mut [1.0]))
        };
        std::thread::sleep(Duration::from_millis(50));
        g.fail("rank 1 has stopped".into());
        let e = waiting.join().unwrap().unwrap_err().to_string();
        assert!(e.contains("rank 1 has stopped"), "{e}");
        // The group stays failed: the next collective fails at once, with the reason.
        let e = g.all_reduce(1, &mut [1.0]).unwrap_err().to_string();
        assert!(e.contains("rank 1 has stopped"), "{e}");
        assert_eq!(g.failure().as_deref(), Some("rank 1 has stopped"));
    }

    #[test]
    fn a_rank_that_does_not_arrive_in_time_fails_the_group_by_name() {
        let g = CpuGroup::new(3, Duration::from_millis(100));
        let start = Instant::now();
        let e = std::thread::scope(|s| {
            let one = s.spawn(|| g.all_reduce(1, &mut [2.0]));
            let zero = g.all_reduce(0, &mut [1.0]);
            one.join().unwrap().unwrap_err();
            zero.unwrap_err().to_string()
        });
        assert!(start.elapsed() < Duration::from_secs(10));
        assert!(e.contains("rank 2 did not reach a collective within 0.1 s"), "{e}");
        assert!(g.failure().unwrap().contains("rank 2"));
    }

    #[test]
    fn all_reduce_and_gather_agree_on_every_rank() {
        let g = Arc::new(CpuGroup::new(3, LONG));
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
