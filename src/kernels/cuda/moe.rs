//! Mixture-of-experts on the GPU (moe.cu): a router kernel, the routed rows sorted by expert
//! (one kernel for both at small batches), one launch for the gate/up projections of every
//! active expert and one for their down projections, each reading only the chosen experts'
//! rows, and a weighted sum per token. Many rows an expert take tensor-core grouped GEMMs
//! over tiles of sorted rows instead. Every grid and the choice between the two depend on
//! the row count alone, so CUDA graphs capture the block whole.

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};

use super::gemm::act_code;
use super::{CudaDevice, CudaTensor, CudaWeight, DevResult, DeviceError, WeightBuf, cuda};
use crate::kernels::MoeSpec;

/// The most experts a token takes, and the most a block holds (moe.cu's router).
const MAX_TOP_K: usize = 8;
const MAX_EXPERTS: usize = 512;
/// Sorted rows and output columns of one tensor-core tile (moe.cu's MOE_BM, MOE_BN).
const MMA_ROWS: usize = 64;
const MMA_COLS: usize = 64;
/// Batches of up to this many rows are routed inside the sort's block (one launch fewer).
const ROUTE_IN_THE_SORT_ROWS: usize = 64;
/// 16-bit experts take the tensor-core GEMMs once the routed pairs average this many rows
/// an expert: past the 8 tokens a warp of the GEMV kernels carries through one pass over
/// its weight rows, those kernels read the weights again for every further 8.
const MMA_MIN_ROWS_PER_EXPERT: usize = 8;

/// Whether a batch of `rows` takes the tensor-core grouped GEMMs (16-bit experts only; f32
/// experts always take the GEMVs).
pub fn moe_on_tensor_cores(rows: usize, spec: MoeSpec) -> bool {
    rows * spec.top_k >= MMA_MIN_ROWS_PER_EXPERT * spec.experts
}

impl CudaDevice {
    fn ptr(&self, t: &CudaTensor) -> CUdeviceptr {
        t.buf.device_ptr(&self.stream).0
    }

    pub(super) fn fused_moe_impl(
        &self,
        x: &CudaTensor,
        logits: &CudaTensor,
        gate_up: &CudaWeight,
        down: &CudaWeight,
        spec: MoeSpec,
    ) -> DevResult<CudaTensor> {
        x.f32_values("fused_moe")?;
        x.final_values("fused_moe")?;
        logits.f32_values("fused_moe's router logits")?;
        let (rows, hidden) = (x.rows, x.cols);
        let (experts, k) = (spec.experts, spec.top_k);
        let inter = down.shape[2];
        if k > MAX_TOP_K || experts > MAX_EXPERTS || k > experts {
            return Err(DeviceError::Other(format!(
                "fused_moe takes up to {MAX_EXPERTS} experts and {MAX_TOP_K} a token: got {experts} and {k}"
            )));
        }
        if !hidden.is_multiple_of(8) || !inter.is_multiple_of(8) {
            return Err(DeviceError::Other(format!(
                "fused_moe needs hidden ({hidden}) and expert intermediate ({inter}) sizes that are multiples of 8"
            )));
        }
        let pairs = rows * k;
        let sfx = weight_suffix(gate_up)?;
        let tensor_cores = sfx != "f32" && weight_suffix(down)? == sfx && moe_on_tensor_cores(rows, spec);
        // Integer buffers live in f32-sized pooled slots; 16-bit ones in half as many.
        let ids = self.tensor(pairs, 1)?;
        let weights = self.tensor(pairs, 1)?;
        let offsets = self.tensor(experts + 1, 1)?;
        let pos = self.tensor(pairs, 1)?;
        let sorted = self.tensor(pairs, 1)?;
        let active = self.tensor(experts, 1)?;
        // Tiles of the tensor-core path: at most one partial tile per expert beyond the full ones.
        let max_tiles = pairs.div_ceil(MMA_ROWS) + experts.min(pairs);
        // The tile table, and the gathered rows in 16 bits: the tensor-core path's alone
        // (the GEMVs read x through `sorted`).
        let (tiles, num_tiles, xs, mid) = match tensor_cores {
            true => (
                Some(self.tensor(2 * max_tiles, 1)?),
                Some(self.tensor(1, 1)?),
                Some(self.tensor(pairs, hidden / 2)?),
                self.tensor(pairs, inter / 2)?,
            ),
            false => (None, None, None, self.tensor(pairs, inter)?),
        };
        let y = self.tensor(pairs, hidden)?;
        let out = self.tensor(rows, hidden)?;
        let [ids_p, w_p, off_p, pos_p, sorted_p, active_p, mid_p, y_p, out_p] =
            [&ids, &weights, &offsets, &pos, &sorted, &active, &mid, &y, &out].map(|t| self.ptr(t));
        // Null where the path has no such buffer (the sort then writes no tiles).
        let [tiles_p, nt_p, xs_p] = [&tiles, &num_tiles, &xs].map(|t| t.as_ref().map_or(0, |t| self.ptr(t)));
        let (x_p, logits_p) = (self.ptr(x), self.ptr(logits));
        let (r, e, kk, h, i) = (rows as i32, experts as i32, k as i32, hidden as i32, inter as i32);
        let (renorm, act, np) = (spec.renormalize as i32, act_code(spec.act), pairs as i32);
        let _t = self.span(if tensor_cores { "fused_moe_mma" } else { "fused_moe" }, (hidden, inter), rows);
        let one = |grid: (u32, u32), block: u32, shared: u32| LaunchConfig {
            grid_dim: (grid.0.max(1), grid.1.max(1), 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: shared,
        };
        let (gate_up_p, down_p) = (weight_ptr(self, gate_up), weight_ptr(self, down));
        // SAFETY (every launch): the buffers above hold what each kernel indexes: ids,
        // weights, pos and sorted `pairs` values, offsets experts + 1, active experts, tiles
        // 2 · max_tiles (what the sort can make of `pairs` places); xs and y [pairs, hidden]
        // and mid [pairs, inter] (in 16 bits on the tensor-core path), out [rows, hidden];
        // the weights [experts, 2·inter, hidden] and [experts, hidden, inter] as checked at load.
        unsafe {
            let sort_shared = (2 * experts * 4) as u32;
            let sort_ptrs = [ids_p, off_p, pos_p, sorted_p, active_p, tiles_p, nt_p];
            let sort_ints = [np, e];
            if rows <= ROUTE_IN_THE_SORT_ROWS {
                let mut l = self.stream.launch_builder(self.f("moe_route_sort"));
                l.arg(&logits_p).arg(&w_p).arg(&r).arg(&kk).arg(&renorm);
                sort_args(&mut l, &sort_ptrs, &sort_ints);
                l.launch(one((1, 1), 1024, sort_shared)).map_err(cuda("moe_route_sort launch"))?;
            } else {
                let mut l = self.stream.launch_builder(self.f("moe_route"));
                l.arg(&logits_p).arg(&ids_p).arg(&w_p).arg(&r).arg(&e).arg(&kk).arg(&renorm);
                l.launch(one((rows as u32, 1), 32, 0)).map_err(cuda("moe_route launch"))?;

                let mut l = self.stream.launch_builder(self.f("moe_sort"));
                sort_args(&mut l, &sort_ptrs, &sort_ints);
                l.launch(one((1, 1), 1024, sort_shared)).map_err(cuda("moe_sort launch"))?;
            }

            if tensor_cores {
                let mut l = self.stream.launch_builder(self.f(&format!("moe_gather_{sfx}")));
                l.arg(&x_p).arg(&sorted_p).arg(&xs_p).arg(&np).arg(&kk).arg(&h);
                l.launch(one((pairs as u32, 1), 256, 0)).map_err(cuda("moe_gather launch"))?;

                let mut l = self.stream.launch_builder(self.f(&format!("moe_gate_up_mma_{sfx}")));
                l.arg(&gate_up_p).arg(&xs_p).arg(&mid_p).arg(&tiles_p).arg(&nt_p).arg(&off_p);
                l.arg(&i).arg(&h).arg(&act);
                l.launch(one((max_tiles as u32, inter.div_ceil(MMA_COLS) as u32), 128, 0))
                    .map_err(cuda("moe_gate_up_mma launch"))?;

                let mut l = self.stream.launch_builder(self.f(&format!("moe_down_mma_{sfx}")));
                l.arg(&down_p).arg(&mid_p).arg(&y_p).arg(&tiles_p).arg(&nt_p).arg(&off_p).arg(&h).arg(&i);
                l.launch(one((max_tiles as u32, hidden.div_ceil(MMA_COLS) as u32), 128, 0))
                    .map_err(cuda("moe_down_mma launch"))?;
            } else {
                // Blocks for every expert that could be active; the others leave at once.
                let slots = experts.min(pairs) as u32;
                let down_sfx = weight_suffix(down)?;
                let mut l = self.stream.launch_builder(self.f(&format!("moe_gate_up_{sfx}")));
                l.arg(&gate_up_p).arg(&x_p).arg(&sorted_p).arg(&kk).arg(&mid_p).arg(&off_p).arg(&active_p);
                l.arg(&i).arg(&h).arg(&act);
                l.launch(one((inter.div_ceil(8) as u32, slots), 256, 0))
                    .map_err(cuda("moe_gate_up launch"))?;

                let mut l = self.stream.launch_builder(self.f(&format!("moe_down_{down_sfx}")));
                l.arg(&down_p).arg(&mid_p).arg(&y_p).arg(&off_p).arg(&active_p).arg(&h).arg(&i);
                l.launch(one((hidden.div_ceil(8 * down_rows(down_sfx)) as u32, slots), 256, 0))
                    .map_err(cuda("moe_down launch"))?;
            }

            let mut l = self.stream.launch_builder(self.f("moe_combine"));
            l.arg(&y_p).arg(&ids_p).arg(&pos_p).arg(&w_p).arg(&out_p).arg(&r).arg(&kk).arg(&h);
            l.launch(one((hidden.div_ceil(256) as u32, rows as u32), 256, 0))
                .map_err(cuda("moe_combine launch"))?;
        }
        Ok(out)
    }

    pub(super) fn add_sigmoid_gated_impl(
        &self,
        acc: &mut CudaTensor,
        x: &CudaTensor,
        gate: &CudaTensor,
    ) -> DevResult<()> {
        x.f32_values("add_sigmoid_gated")?;
        x.final_values("add_sigmoid_gated")?;
        gate.f32_values("add_sigmoid_gated's gate")?;
        let (rows, cols) = (acc.rows as i32, acc.cols as i32);
        let cfg = LaunchConfig {
            grid_dim: (acc.cols.div_ceil(256) as u32, acc.rows.max(1) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (a, xp, g) = (self.ptr(acc), self.ptr(x), self.ptr(gate));
        // SAFETY: acc and x hold [rows, cols], gate [rows, 1].
        unsafe {
            let mut l = self.stream.launch_builder(self.f("add_sigmoid_gated"));
            l.arg(&a).arg(&xp).arg(&g).arg(&rows).arg(&cols);
            l.launch(cfg)
        }
        .map_err(cuda("add_sigmoid_gated launch"))?;
        Ok(())
    }
}

/// moe.cu's MOE_SORT_ARGS: ids, pairs, experts, offsets, pos, sorted, active, tiles,
/// num_tiles (`ptrs` in that order without the two counts, `ints` the two counts).
fn sort_args<'a>(l: &mut cudarc::driver::LaunchArgs<'a>, ptrs: &'a [CUdeviceptr; 7], ints: &'a [i32; 2]) {
    let [ids, offsets, pos, sorted, active, tiles, num_tiles] = ptrs;
    l.arg(ids).arg(&ints[0]).arg(&ints[1]).arg(offsets).arg(pos).arg(sorted);
    l.arg(active).arg(tiles).arg(num_tiles);
}

/// Output rows a warp of moe.cu's down kernel takes, by the weights' suffix (its
/// MOE_DOWN_ENTRY lines).
fn down_rows(suffix: &str) -> usize {
    if suffix == "f32" { 1 } else { 4 }
}

fn weight_suffix(w: &CudaWeight) -> DevResult<&'static str> {
    match (&w.buf, w.shape.len()) {
        (WeightBuf::F32(_), 3) => Ok("f32"),
        (WeightBuf::Bf16(_), 3) => Ok("bf16"),
        (WeightBuf::F16(_), 3) => Ok("f16"),
        _ => Err(DeviceError::Other(format!("fused_moe needs 3-D expert weights, got shape {:?}", w.shape))),
    }
}

fn weight_ptr(dev: &CudaDevice, w: &CudaWeight) -> CUdeviceptr {
    match &w.buf {
        WeightBuf::F32(b) => b.device_ptr(&dev.stream).0,
        WeightBuf::Bf16(b) | WeightBuf::F16(b) => b.device_ptr(&dev.stream).0,
        WeightBuf::Rows { buf, .. } => buf.device_ptr(&dev.stream).0,
    }
}
