//! RoPE launches: the split-and-rotate kernel over a fused qkv projection (elementwise.cu's
//! split_qkv_rope, into tensors or with k and v straight into the KV cache), and the qkv
//! GEMV that projects, rotates and writes the cache at once (gemv.cu's gemv_qkv_rope).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{CudaCache, CudaDevice, CudaTensor, CudaWeight, cuda};
use crate::kernels::attn::AttnMetadata;
use crate::kernels::{AttnShape, DevResult, DeviceError, RopeSpec};

/// Where split_qkv_rope puts a step's q, k and v: three tensors, or q and the KV cache (at
/// the step's slots, uploaded by `CudaDevice::attention_inputs`).
pub(super) enum RopeOut<'a> {
    Tensors(&'a mut CudaTensor, &'a mut CudaTensor, &'a mut CudaTensor),
    Cache(&'a mut CudaTensor, &'a mut CudaCache),
}

/// The device buffers a RoPE launch reads: the step's positions, the rotary frequencies (one
/// row for all tokens, or a row a token `freq_stride` apart where they vary), and the step's
/// slots where its attention inputs were uploaded.
struct RopeInputs<'a> {
    positions: &'a CudaSlice<u32>,
    inv_freq: &'a CudaSlice<f32>,
    freq_stride: i32,
    slots: Option<&'a CudaSlice<i64>>,
}

impl RopeInputs<'_> {
    fn slots(&self) -> DevResult<&CudaSlice<i64>> {
        self.slots.ok_or_else(|| {
            DeviceError::Other("RoPE into the cache before the step's slots were uploaded".into())
        })
    }
}

impl CudaDevice {
    /// Uploads the step's positions and `rope`'s frequencies unless they are there, then
    /// runs `f` on the buffers a RoPE launch reads.
    fn with_rope_inputs<R>(
        &self,
        rope: &RopeSpec,
        meta: &AttnMetadata,
        f: impl FnOnce(RopeInputs<'_>) -> DevResult<R>,
    ) -> DevResult<R> {
        self.rope_positions(&meta.positions)?;
        let missing =
            || DeviceError::Other("RoPE's positions or frequencies missing after their upload".into());
        let pos = self.inputs().rope_positions.borrow();
        let positions = pos.as_ref().map(|(_, p)| p).ok_or_else(missing)?;
        let step = self.inputs().step.borrow();
        let slots = step.as_ref().map(|b| &b.slots);
        if rope.varies() {
            let at = self.rope_rows(rope, meta)?;
            let rows = self.inputs().rope_rows.borrow();
            let inv_freq = &rows.get(at).ok_or_else(missing)?.rows;
            return f(RopeInputs { positions, inv_freq, freq_stride: rope.inv_freq.len() as i32, slots });
        }
        let at = self.inv_freq(rope)?;
        let inv = self.inv_freq.borrow();
        let inv_freq = &inv.get(at).ok_or_else(missing)?.1;
        f(RopeInputs { positions, inv_freq, freq_stride: 0, slots })
    }

    /// Splits the fused qkv projection and applies RoPE at the step's positions, into `out`.
    pub(super) fn rope_launch(
        &self,
        qkv: &CudaTensor,
        s: AttnShape,
        rope: &RopeSpec,
        meta: &AttnMetadata,
        out: RopeOut,
    ) -> DevResult<()> {
        let n = qkv.rows;
        let (h, kvh, hd, half) =
            (s.num_heads as i32, s.num_kv_heads as i32, s.head_dim as i32, rope.inv_freq.len() as i32);
        // Threads over a head (four pairs each where elementwise.cu's split_qkv_rope takes
        // them by four), and head slots to fill about 256 threads.
        let by4 = s.head_dim == 2 * rope.inv_freq.len() && rope.inv_freq.len().is_multiple_of(4);
        let threads = match by4 {
            true => (s.head_dim / 8).clamp(1, 256),
            false => (s.head_dim.div_ceil(2).div_ceil(32) * 32).min(256),
        };
        let slots = (256 / threads).max(1);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, (s.num_heads + 2 * s.num_kv_heads).div_ceil(slots) as u32, 1),
            block_dim: (threads as u32, slots as u32, 1),
            shared_mem_bytes: 0,
        };
        self.with_rope_inputs(rope, meta, |inputs| {
            let _t = self.span("split_qkv_rope", (0, 0), n);
            let func = match &out {
                RopeOut::Tensors(..) => self.f("split_qkv_rope_f32").clone(),
                RopeOut::Cache(_, cache) => cache.kernels.split_rope_kv.clone(),
            };
            let mut scales = None;
            let mut launch = self.stream.launch_builder(&func);
            launch.arg(&*qkv.buf);
            match out {
                RopeOut::Tensors(q, k, v) => {
                    launch.arg(&mut *q.buf).arg(&mut *k.buf).arg(&mut *v.buf);
                }
                RopeOut::Cache(q, cache) => {
                    launch.arg(&mut *q.buf);
                    cache.k.arg().push(&mut launch);
                    cache.v.arg().push(&mut launch);
                    launch.arg(inputs.slots()?);
                    scales = Some((cache.scales.k, cache.scales.v));
                }
            }
            launch.arg(inputs.positions).arg(inputs.inv_freq).arg(&inputs.freq_stride);
            launch.arg(&h).arg(&kvh).arg(&hd).arg(&half);
            launch.arg(&rope.attention_scaling);
            if let Some((ks, vs)) = &scales {
                launch.arg(ks).arg(vs);
            }
            // SAFETY: qkv is [n, (h + 2·kvh)·hd]; q is [n, h·hd], k and v [n, kvh·hd]; a
            // cache's slots index inside it (checked by the scheduler), its rows kvh·hd wide.
            unsafe { launch.launch(cfg) }.map_err(cuda("rope launch"))?;
            Ok(())
        })
    }

    /// `Device::project_qkv_attention`'s projection for up to [`super::gemm::GEMV_ROWS`]
    /// rows of 16-bit weights without a bias, over a cache of their type, where the
    /// rotation covers whole heads of a multiple of 16 dims: one GEMV (gemv.cu's
    /// gemv_qkv_rope) that applies RoPE, writes q and puts k and v into the cache; no
    /// projection and no RoPE kernel. The step's attention inputs are uploaded as for
    /// [`Self::rope_launch`]. q, or None where this does not apply.
    pub(super) fn qkv_rope_gemv(
        &self,
        (x, w): (&CudaTensor, &CudaWeight),
        s: AttnShape,
        rope: &RopeSpec,
        cache: &mut CudaCache,
        meta: &AttnMetadata,
    ) -> DevResult<Option<CudaTensor>> {
        let (n, k, m) = (w.shape[0], w.shape[1], x.rows);
        let Some(gw) = self.gemv_weight(w) else { return Ok(None) };
        let kind = gw.kind;
        let (heads, kv_heads, hd) = (s.num_heads, s.num_kv_heads, s.head_dim);
        let whole_heads = hd.is_multiple_of(16) && rope.inv_freq.len() * 2 == hd;
        let fits = self.gemv_fits(m, k) && x.cols == k && n == (heads + 2 * kv_heads) * hd;
        if !fits || !whole_heads || !cache.k.is_half() || self.act16.get() != kind {
            return Ok(None);
        }
        self.attention_inputs(s, meta)?;
        let mut q = self.tensor(m, heads * hd)?;
        let (kernels, cfg) = self.gemv_cfg(n / 16, &gw);
        let name = kernels.qkv_rope;
        let scale = self.scale_args(x);
        let (wp, row_bytes, group) = gw.args();
        let dims = [heads as i32, kv_heads as i32, hd as i32, m as i32, k as i32];
        self.with_rope_inputs(rope, meta, |inputs| {
            self.with_x16(x, kind, |xp| {
                let _t = self.span(name, (n, k), m);
                let mut launch = self.stream.launch_builder(self.f(name));
                launch.arg(&wp).arg(&row_bytes).arg(&group).arg(&xp).arg(&mut *q.buf);
                cache.k.arg().push(&mut launch);
                cache.v.arg().push(&mut launch);
                launch.arg(inputs.slots()?).arg(inputs.positions).arg(inputs.inv_freq);
                launch.arg(&inputs.freq_stride).arg(&rope.attention_scaling);
                for d in &dims {
                    launch.arg(d);
                }
                launch.arg(&scale.0).arg(&scale.1).arg(&scale.2);
                // SAFETY: w holds n = (heads + 2 · kv_heads) · hd rows of k 16-bit values, x
                // m·k of them (k % 8 == 0); q is [m, heads · hd]; the cache's rows are
                // kv_heads · hd wide and the slots (one per row) index inside it or are
                // negative; positions hold m values and inv_freq hd / 2 (m rows of them
                // freq_stride apart where it is not 0); a scale's sums
                // m · parts. hd / 16 blocks a head slot.
                unsafe { launch.launch(cfg) }.map_err(cuda("gemv_qkv_rope launch"))
            })
        })?;
        Ok(Some(q))
    }
}
