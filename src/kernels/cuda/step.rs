//! A step's inputs on the device: attention metadata uploaded once for all layers, RoPE
//! positions, index lists, each into buffers kept from earlier steps; and how a step's
//! query rows split between the tensor-core prefill kernel and the split decode kernel.

use std::cell::RefCell;
use std::collections::HashMap;

use cudarc::driver::CudaSlice;

use super::{CudaDevice, DevResult, DeviceError, GraphMode, cuda};
use crate::models::attn::AttnMetadata;

/// One set of a step's inputs on the device, kept from step to step.
#[derive(Default)]
pub(super) struct Inputs {
    /// This step's attention metadata, uploaded once for all layers.
    pub(super) step: RefCell<Option<StepBufs>>,
    /// The step's token positions for RoPE, uploaded once for all layers. A copy from
    /// pageable host memory waits for the stream to drain: once per layer it would stall
    /// the host behind the GPU every layer.
    pub(super) rope_positions: RefCell<Option<(Vec<u32>, CudaSlice<u32>)>>,
    /// The step's LoRA slot per row, uploaded once for all layers.
    pub(super) lora_slots: RefCell<Option<(Vec<i32>, CudaSlice<i32>)>>,
    /// Per-step index lists (token ids, sampled rows, sampling parameters and results) by use.
    pub(super) staging: RefCell<HashMap<&'static str, CudaSlice<u32>>>,
}

/// Attention metadata of one step on the device, with the host copy it came from.
pub(super) struct StepBufs {
    pub(super) host: AttnMetadata,
    /// Whether `rows` and `tiles` split the rows between flash_prefill and the others.
    pub(super) flash: bool,
    /// Query rows for the split (or one-block-per-head) kernel, and how many.
    pub(super) rows: CudaSlice<u32>,
    pub(super) num_rows: usize,
    /// (first row, rows) of each flash_prefill tile, and how many tiles.
    pub(super) tiles: CudaSlice<u32>,
    pub(super) num_tiles: usize,
    pub(super) positions: CudaSlice<u32>,
    pub(super) slots: CudaSlice<i64>,
    pub(super) token_seq: CudaSlice<u32>,
    pub(super) tables: CudaSlice<u32>,
    pub(super) table_offsets: CudaSlice<u32>,
    pub(super) ctx_max: usize,
}

impl CudaDevice {
    /// Uploads `meta` unless the cached step buffers already hold it (every layer of a
    /// forward passes the same metadata: one upload per step).
    pub(super) fn step_bufs(&self, meta: &AttnMetadata, flash: bool) -> DevResult<()> {
        if self.capturing() {
            return Ok(()); // staged before the capture began
        }
        let inputs = self.inputs();
        let fresh = inputs.step.borrow().as_ref().is_some_and(|b| {
            b.flash == flash
                && b.host.positions == meta.positions
                && b.host.slot_mapping == meta.slot_mapping
                && b.host.token_seq == meta.token_seq
                && b.host.block_tables == meta.block_tables
        });
        if fresh {
            return Ok(());
        }
        let mut flat = Vec::new();
        let mut offs = Vec::with_capacity(meta.block_tables.len());
        for t in &meta.block_tables {
            offs.push(flat.len() as u32);
            flat.extend_from_slice(t);
        }
        let slots = if meta.slot_mapping.is_empty() { vec![-1] } else { meta.slot_mapping.clone() };
        let (rows, tiles) = split_rows(meta, flash);
        // Last step's buffers take this step's metadata when it fits.
        let old = inputs.step.borrow_mut().take();
        let (
            mut positions,
            mut slot_buf,
            mut token_seq,
            mut tables,
            mut table_offsets,
            mut rows_buf,
            mut tiles_buf,
        ) = match old {
            Some(b) => (
                Some(b.positions),
                Some(b.slots),
                Some(b.token_seq),
                Some(b.tables),
                Some(b.table_offsets),
                Some(b.rows),
                Some(b.tiles),
            ),
            None => (None, None, None, None, None, None, None),
        };
        let bufs = StepBufs {
            flash,
            rows: self.refill(rows_buf.take(), &rows)?,
            num_rows: rows.len(),
            tiles: self.refill(tiles_buf.take(), &tiles)?,
            num_tiles: tiles.len() / 2,
            positions: self.refill(positions.take(), &meta.positions)?,
            slots: self.refill(slot_buf.take(), &slots)?,
            token_seq: self.refill(token_seq.take(), &meta.token_seq)?,
            tables: self.refill(tables.take(), &flat)?,
            table_offsets: self.refill(table_offsets.take(), &offs)?,
            ctx_max: meta.positions.iter().copied().max().unwrap_or(0) as usize + 1,
            host: AttnMetadata { last_token_rows: Vec::new(), lora_slots: Vec::new(), ..meta.clone() },
        };
        *inputs.step.borrow_mut() = Some(bufs);
        Ok(())
    }

    pub(super) fn rope_positions(&self, positions: &[u32]) -> DevResult<()> {
        self.upload_unless_there(&self.inputs().rope_positions, positions)
    }

    /// Uploads the step's LoRA slot per row unless they are already there.
    pub(super) fn upload_lora_slots(&self, slots: &[i32]) -> DevResult<()> {
        self.upload_unless_there(&self.inputs().lora_slots, slots)
    }

    /// Copies `v` into the buffer `cached` keeps with its host copy, unless that copy is
    /// `v` already (every layer of a forward asks for the same values) or a capture is
    /// recording (the values were staged before it began).
    fn upload_unless_there<T>(
        &self,
        cached: &RefCell<Option<(Vec<T>, CudaSlice<T>)>>,
        v: &[T],
    ) -> DevResult<()>
    where
        T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + PartialEq + Clone,
    {
        if self.capturing() || cached.borrow().as_ref().is_some_and(|(h, _)| h == v) {
            return Ok(());
        }
        let old = cached.borrow_mut().take().map(|(_, d)| d);
        let dev = self.refill(old, v)?;
        *cached.borrow_mut() = Some((v.to_vec(), dev));
        Ok(())
    }

    /// The input set in use: the graphs' while graph inputs are staged or captured.
    pub(super) fn inputs(&self) -> &Inputs {
        &self.inputs[usize::from(self.graph.get() != GraphMode::Off)]
    }

    fn capturing(&self) -> bool {
        matches!(self.graph.get(), GraphMode::Capturing { .. })
    }

    /// Copies `v` into `buf` when it fits, else into a new buffer of the next power-of-two
    /// length: per-step inputs reuse the device buffers of earlier steps. Stream order
    /// keeps the copy behind the kernels still reading the old contents.
    fn refill<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        buf: Option<CudaSlice<T>>,
        v: &[T],
    ) -> DevResult<CudaSlice<T>> {
        let need = v.len().max(1);
        let mut buf = match buf {
            Some(b) if b.len() >= need => b,
            // The graphs read the buffers they were captured with.
            _ if self.graph.get() != GraphMode::Off && self.graph_inputs_fixed.get() => {
                return Err(DeviceError::Other(format!(
                    "a graph step's input of {need} values outgrew the buffer its graphs were captured with"
                )));
            }
            _ => self.zeros::<T>(need.next_power_of_two())?,
        };
        if !v.is_empty() {
            self.stream
                .memcpy_htod(v, &mut buf.slice_mut(0..v.len()))
                .map_err(cuda("host to device copy"))?;
        }
        Ok(buf)
    }

    /// Uploads a per-step index list into the named staging buffer (see [`Self::refill`]);
    /// hand it back with [`Self::restage`] once the launches that read it are issued.
    pub(super) fn stage(&self, name: &'static str, v: &[u32]) -> DevResult<CudaSlice<u32>> {
        let old = self.inputs().staging.borrow_mut().remove(name);
        match (old, self.capturing()) {
            // Staged before the capture began: a capture records no copies.
            (Some(b), true) => Ok(b),
            (old, _) => self.refill(old, v),
        }
    }

    pub(super) fn restage(&self, name: &'static str, buf: CudaSlice<u32>) {
        self.inputs().staging.borrow_mut().insert(name, buf);
    }
}

/// Splits a step's query rows between the attention kernels: with `flash`, runs of two or
/// more rows of one sequence at consecutive positions (prefill chunks) become flash_prefill
/// tiles of up to 64 rows, `[first row, rows]` pairs; every other row (decodes) goes to the
/// split kernel's row list.
fn split_rows(meta: &AttnMetadata, flash: bool) -> (Vec<u32>, Vec<u32>) {
    const TILE: usize = 64;
    let n = meta.positions.len();
    if !flash {
        return ((0..n as u32).collect(), Vec::new());
    }
    let (mut rows, mut tiles) = (Vec::new(), Vec::new());
    let mut i = 0;
    while i < n {
        let mut j = i + 1;
        while j < n
            && meta.token_seq[j] == meta.token_seq[i]
            && meta.positions[j] == meta.positions[j - 1] + 1
        {
            j += 1;
        }
        if j - i >= 2 {
            for start in (i..j).step_by(TILE) {
                tiles.extend([start as u32, (j - start).min(TILE) as u32]);
            }
        } else {
            rows.push(i as u32);
        }
        i = j;
    }
    (rows, tiles)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_runs_become_tiles_and_decodes_stay_rows() {
        // Sequence 0 decodes one token; sequence 1 prefills 130; sequence 2 decodes one.
        let mut meta = AttnMetadata::default();
        let mut push = |seq: u32, pos: std::ops::Range<u32>| {
            for p in pos {
                meta.token_seq.push(seq);
                meta.positions.push(p);
            }
        };
        push(0, 17..18);
        push(1, 5..135);
        push(2, 40..41);
        let (rows, tiles) = split_rows(&meta, true);
        assert_eq!(rows, vec![0, 131]);
        assert_eq!(tiles, vec![1, 64, 65, 64, 129, 2]);
        let (rows, tiles) = split_rows(&meta, false);
        assert_eq!(rows, (0..132).collect::<Vec<u32>>());
        assert!(tiles.is_empty());
    }
}
