//! GPU time per operation, measured with CUDA events around each launch when
//! `ACTORLLM_PROFILE_KERNELS=1`: the table (by operation, shape and row count) is printed
//! to stderr when the device is dropped. Events record on the stream without stopping the
//! host, so the figures are the kernels' own time, not the host's issue time.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, sys::CUevent_flags};

/// One timed operation: its name, `[n, k]` shape where it has one, and row count bucket.
type Key = (&'static str, usize, usize, usize);

pub struct Profiler {
    ctx: Arc<CudaContext>,
    free: RefCell<Vec<CudaEvent>>,
    /// Started and ended, not yet read back.
    pending: RefCell<Vec<(Key, CudaEvent, CudaEvent)>>,
    /// Total milliseconds and count by key.
    totals: RefCell<HashMap<Key, (f64, u64)>>,
}

/// Records the end event of an operation when dropped.
pub struct Span<'a> {
    prof: &'a Profiler,
    stream: &'a CudaStream,
    key: Key,
    start: Option<CudaEvent>,
}

impl Profiler {
    /// A profiler when `ACTORLLM_PROFILE_KERNELS` is set (to anything but 0).
    pub fn from_env(ctx: &Arc<CudaContext>) -> Option<Self> {
        let on = std::env::var("ACTORLLM_PROFILE_KERNELS").is_ok_and(|v| v != "0" && !v.is_empty());
        on.then(|| Self {
            ctx: ctx.clone(),
            free: RefCell::default(),
            pending: RefCell::default(),
            totals: RefCell::default(),
        })
    }

    /// An event recorded on `stream` now (None when CUDA refuses one: the span is skipped).
    fn event(&self, stream: &CudaStream) -> Option<CudaEvent> {
        let e = match self.free.borrow_mut().pop() {
            Some(e) => e,
            None => self.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).ok()?,
        };
        e.record(stream).ok()?;
        Some(e)
    }

    /// Starts timing `name` (shape `[n, k]`, `rows` rows) on `stream`.
    pub fn span<'a>(
        &'a self,
        stream: &'a CudaStream,
        name: &'static str,
        nk: (usize, usize),
        rows: usize,
    ) -> Option<Span<'a>> {
        let start = self.event(stream)?;
        let bucket = match rows {
            0..=1 => 1,
            2..=16 => 16,
            17..=256 => 256,
            257..=1024 => 1024,
            _ => usize::MAX,
        };
        Some(Span { prof: self, stream, key: (name, nk.0, nk.1, bucket), start: Some(start) })
    }

    /// Reads back every finished span (waits for the stream to reach the last one).
    pub fn flush(&self) {
        let pending = std::mem::take(&mut *self.pending.borrow_mut());
        let mut totals = self.totals.borrow_mut();
        let mut free = self.free.borrow_mut();
        for (key, start, end) in pending {
            let Ok(ms) = start.elapsed_ms(&end) else { continue };
            let e = totals.entry(key).or_default();
            e.0 += ms as f64;
            e.1 += 1;
            free.push(start);
            free.push(end);
        }
    }

    fn report(&self) -> String {
        self.flush();
        let totals = self.totals.borrow();
        let sum: f64 = totals.values().map(|v| v.0).sum();
        let mut rows: Vec<_> = totals.iter().collect();
        rows.sort_by(|a, b| b.1.0.total_cmp(&a.1.0));
        let mut out = format!("GPU time by operation ({sum:.1} ms in all):\n");
        out += "      ms      %     calls   µs/call  operation\n";
        for ((name, n, k, bucket), (ms, calls)) in rows {
            let rows = match *bucket {
                usize::MAX => ">1024".to_string(),
                b => format!("≤{b}"),
            };
            let shape = if *n > 0 { format!(" [{n}×{k}]") } else { String::new() };
            out += &format!(
                "{ms:9.1} {:6.1} {calls:9} {:9.1}  {name}{shape} rows {rows}\n",
                100.0 * ms / sum.max(1e-9),
                1000.0 * ms / *calls as f64
            );
        }
        out
    }
}

impl Drop for Profiler {
    fn drop(&mut self) {
        self.flush();
        if !self.totals.borrow().is_empty() {
            eprint!("{}", self.report());
        }
    }
}

impl Drop for Span<'_> {
    fn drop(&mut self) {
        let (Some(end), Some(start)) = (self.prof.event(self.stream), self.start.take()) else { return };
        let mut pending = self.prof.pending.borrow_mut();
        pending.push((self.key, start, end));
        let full = pending.len() >= 20_000;
        drop(pending);
        if full {
            self.prof.flush();
        }
    }
}
