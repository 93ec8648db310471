//! Pooled activation buffers: a step takes its tensors' buffers from those earlier steps
//! gave back, so that in steady state it allocates no device memory.

use std::sync::Arc;

use cudarc::driver::CudaSlice;

/// Activation buffers no longer in use, by power-of-two length, for the next tensors of
/// that size: in steady state a step allocates no device memory. At most `limit` bytes
/// (`POOL_LIMIT` for the device's pool) wait here; beyond that a buffer is freed.
pub struct BufPool {
    /// Bytes waiting, and the buffers by length.
    free: std::sync::Mutex<(usize, FreeLists)>,
    limit: usize,
}

impl Default for BufPool {
    fn default() -> Self {
        Self { free: Default::default(), limit: POOL_LIMIT }
    }
}

type FreeLists = std::collections::HashMap<usize, Vec<CudaSlice<f32>>>;

const POOL_LIMIT: usize = 4 << 30;

impl BufPool {
    /// A pool that keeps every buffer given back (a CUDA graph's: the graph holds their
    /// addresses, so none may be freed while it lives).
    pub(super) fn unbounded() -> Self {
        Self { free: Default::default(), limit: usize::MAX }
    }

    pub(super) fn take(&self, len: usize) -> Option<CudaSlice<f32>> {
        let mut g = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let buf = g.1.get_mut(&len)?.pop()?;
        g.0 -= len * 4;
        Some(buf)
    }
    fn put(&self, buf: CudaSlice<f32>) {
        let mut g = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let bytes = buf.len() * 4;
        if g.0.saturating_add(bytes) <= self.limit {
            g.0 += bytes;
            g.1.entry(buf.len()).or_default().push(buf);
        }
    }
}

/// A device buffer that goes back to its pool when dropped.
pub struct PooledBuf {
    pub(super) slice: std::mem::ManuallyDrop<CudaSlice<f32>>,
    pub(super) pool: Option<Arc<BufPool>>,
}

impl std::ops::Deref for PooledBuf {
    type Target = CudaSlice<f32>;
    fn deref(&self) -> &CudaSlice<f32> {
        &self.slice
    }
}

impl std::ops::DerefMut for PooledBuf {
    fn deref_mut(&mut self) -> &mut CudaSlice<f32> {
        &mut self.slice
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        // SAFETY: the slice is taken once, here, and never touched again.
        let slice = unsafe { std::mem::ManuallyDrop::take(&mut self.slice) };
        if let Some(pool) = &self.pool {
            // Stream order makes reuse safe: later kernels run after earlier readers.
            pool.put(slice);
        }
    }
}
