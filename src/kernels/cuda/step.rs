//! A step's inputs on the device: attention metadata uploaded once for all layers, RoPE
//! positions, index lists, each into buffers kept from earlier steps; and how a step's
//! query rows split between the tensor-core prefill kernel and the split decode kernel.

use std::cell::RefCell;
use std::collections::HashMap;

use cudarc::driver::CudaSlice;

use super::attend::DECODE_JOIN_CTX;
use super::{CudaDevice, DevResult, DeviceError, GraphMode, cuda};
use crate::kernels::attn::AttnMetadata;
use crate::kernels::{AttnShape, FED_TOKEN, RopeSpec};

/// One set of a step's inputs on the device, kept from step to step.
#[derive(Default)]
pub(super) struct Inputs {
    /// This step's attention metadata, uploaded once for all layers.
    pub(super) step: RefCell<Option<StepBufs>>,
    /// The step's token positions for RoPE, uploaded once for all layers. A copy from
    /// pageable host memory waits for the stream to drain: once per layer it would stall
    /// the host behind the GPU every layer.
    pub(super) rope_positions: RefCell<Option<(Vec<u32>, CudaSlice<u32>)>>,
    /// Per-token frequencies of the step's rotary embeddings that vary with the length a
    /// token is computed at, uploaded once for all layers.
    pub(super) rope_rows: RefCell<Vec<RopeRows>>,
    /// The step's LoRA slot per row, uploaded once for all layers.
    pub(super) lora_slots: RefCell<Option<(Vec<i32>, CudaSlice<i32>)>>,
    /// Per-step index lists (token ids, sampled rows, sampling parameters and results) by use.
    pub(super) staging: RefCell<HashMap<&'static str, CudaSlice<u32>>>,
}

/// One length-dependent rotary embedding's frequencies for each token of a step
/// ([`RopeSpec::rows`]), with the spec and the tokens' lengths they were made for.
pub(super) struct RopeRows {
    pub(super) spec: RopeSpec,
    pub(super) lens: Vec<u32>,
    pub(super) rows: CudaSlice<f32>,
}

/// Attention metadata of one step on the device, with the host copy it came from.
pub(super) struct StepBufs {
    pub(super) host: AttnMetadata,
    /// Whether `rows` and `tiles` split the rows between flash_prefill and the others.
    pub(super) flash: bool,
    /// Query rows for the split (or one-block-per-head) kernel, and how many.
    pub(super) rows: CudaSlice<u32>,
    pub(super) num_rows: usize,
    /// Per entry i of `rows`: its context length at 3i, its sequence's block table offset
    /// in `tables` at 3i + 1 (so that decode attention starts from one load) and the keys
    /// of each of its flash_decode partitions at 3i + 2.
    pub(super) row_meta: CudaSlice<u32>,
    /// flash_decode's warps per (row, KV head), the grid's bound on the rows' partitions;
    /// 0 where the decode rows do not go to flash_decode.
    pub(super) parts_max: usize,
    /// (first row, rows) of each flash_prefill tile, and how many tiles.
    pub(super) tiles: CudaSlice<u32>,
    pub(super) num_tiles: usize,
    pub(super) positions: CudaSlice<u32>,
    pub(super) slots: CudaSlice<i64>,
    pub(super) token_seq: CudaSlice<u32>,
    pub(super) tables: CudaSlice<u32>,
    pub(super) table_offsets: CudaSlice<u32>,
    pub(super) ctx_max: usize,
    /// The graph context bound the buffers were shaped for (None outside graphs).
    pub(super) bound: Option<usize>,
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
                && b.bound == self.graph.get().ctx_bound()
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
        let ctxs: Vec<u32> = rows.iter().map(|&t| meta.positions[t as usize] + 1).collect();
        let ctx_max = meta.positions.iter().copied().max().unwrap_or(0) as usize + 1;
        let bound = self.graph.get().ctx_bound();
        let (parts_max, parts) = match self.attn_shape.get().filter(|&s| self.decode_on_flash(s, rows.len()))
        {
            Some(s) => {
                let ctx = bound.unwrap_or(ctx_max);
                let mut parts_max = decode_warps(rows.len(), s, ctx);
                // Short contexts of a few rows over a 16-bit cache: as many partitions as
                // one block takes and joins.
                if self.act16.get() != 0 && ctx <= DECODE_JOIN_CTX && self.decode_joins(rows.len(), s) {
                    parts_max = parts_max.min(self.decode_join_warps);
                }
                (parts_max, partitions(&ctxs, s.num_kv_heads, parts_max))
            }
            None => (0, vec![0; rows.len()]),
        };
        let row_meta: Vec<u32> = rows
            .iter()
            .zip(ctxs.iter().zip(&parts))
            .flat_map(|(&t, (&ctx, &part))| [ctx, offs[meta.token_seq[t as usize] as usize], part])
            .collect();
        // Last step's buffers take this step's metadata when it fits.
        let old = inputs.step.borrow_mut().take();
        let (
            mut positions,
            mut slot_buf,
            mut token_seq,
            mut tables,
            mut table_offsets,
            mut rows_buf,
            mut row_meta_buf,
            mut tiles_buf,
        ) = match old {
            Some(b) => (
                Some(b.positions),
                Some(b.slots),
                Some(b.token_seq),
                Some(b.tables),
                Some(b.table_offsets),
                Some(b.rows),
                Some(b.row_meta),
                Some(b.tiles),
            ),
            None => (None, None, None, None, None, None, None, None),
        };
        let bufs = StepBufs {
            flash,
            rows: self.refill(rows_buf.take(), &rows)?,
            num_rows: rows.len(),
            row_meta: self.refill(row_meta_buf.take(), &row_meta)?,
            tiles: self.refill(tiles_buf.take(), &tiles)?,
            num_tiles: tiles.len() / 2,
            positions: self.refill(positions.take(), &meta.positions)?,
            slots: self.refill(slot_buf.take(), &slots)?,
            token_seq: self.refill(token_seq.take(), &meta.token_seq)?,
            tables: self.refill(tables.take(), &flat)?,
            table_offsets: self.refill(table_offsets.take(), &offs)?,
            ctx_max,
            parts_max,
            bound,
            host: AttnMetadata { last_token_rows: Vec::new(), lora_slots: Vec::new(), ..meta.clone() },
        };
        *inputs.step.borrow_mut() = Some(bufs);
        Ok(())
    }

    pub(super) fn rope_positions(&self, positions: &[u32]) -> DevResult<()> {
        self.upload_unless_there(&self.inputs().rope_positions, positions)
    }

    /// Uploads `rope`'s per-token frequencies for `meta` unless they are there; returns
    /// their index in the input set's `rope_rows`. In place where the buffer holds them, so
    /// that a graph's staged inputs keep their address.
    pub(super) fn rope_rows(&self, rope: &RopeSpec, meta: &AttnMetadata) -> DevResult<usize> {
        let lens = rope.lens(meta);
        let mut all = self.inputs().rope_rows.borrow_mut();
        let at = all.iter().position(|r| r.spec == *rope);
        if let Some(i) = at
            && (self.capturing() || all[i].lens == lens)
        {
            return Ok(i);
        }
        let rows = rope.rows(&lens);
        Ok(match at {
            Some(i) => {
                let old = all.remove(i);
                let rows = self.refill(Some(old.rows), &rows)?;
                all.insert(i, RopeRows { spec: old.spec, lens, rows });
                i
            }
            None => {
                let rows = self.refill(None, &rows)?;
                all.push(RopeRows { spec: rope.clone(), lens, rows });
                all.len() - 1
            }
        })
    }

    /// Stages the per-token frequencies of every length-dependent rotary embedding a graph
    /// read at its capture, for `meta`.
    pub(super) fn restage_rope_rows(&self, meta: &AttnMetadata) -> DevResult<()> {
        let specs: Vec<RopeSpec> = self.inputs().rope_rows.borrow().iter().map(|r| r.spec.clone()).collect();
        for spec in &specs {
            self.rope_rows(spec, meta)?;
        }
        Ok(())
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

    /// Uploads a forward's token ids (staging buffer "embedding ids"), with those that name
    /// a row of the last sampling issued (`FED_TOKEN`) put in place from its output.
    pub(super) fn stage_ids(&self, ids: &[u32]) -> DevResult<CudaSlice<u32>> {
        let mut buf = self.stage("embedding ids", ids)?;
        if !self.capturing()
            && ids.iter().any(|&t| t >= FED_TOKEN)
            && let Err(e) = self.feed_tokens(&mut buf, ids)
        {
            self.restage("embedding ids", buf);
            return Err(e);
        }
        Ok(buf)
    }

    pub(super) fn restage(&self, name: &'static str, buf: CudaSlice<u32>) {
        self.inputs().staging.borrow_mut().insert(name, buf);
    }
}

/// Warps per (row, KV head) in flash_decode's grid, the bound on a row's partitions (their
/// lengths are [`partitions`]'), a power of two up to 64: as many as keep the grid near
/// 8192 warps, each with at least 64 keys of the context bound, since a warp's partial
/// result (written, then read by the reduction) costs about half the traffic of a chunk of
/// 16 keys. While the grid would hold fewer than 1024 warps, a few short rows, warps take
/// chunks down to 16 keys so that they still spread over the GPU.
pub(super) fn decode_warps(rows: usize, s: AttnShape, ctx_max: usize) -> usize {
    let per_part = (rows * s.num_kv_heads).max(1);
    let spread = (8192 / per_part).min(ctx_max.div_ceil(64));
    let floor = (1024 / per_part).min(ctx_max.div_ceil(16));
    let n = spread.max(floor).clamp(1, 64);
    1 << n.ilog2()
}

/// Keys per flash_decode partition for decode rows of contexts `ctxs`: about the same for
/// every warp, so that the rows' keys spread evenly over about `DECODE_WARPS` warps (a
/// long row gets more partitions, a short one fewer or one), but no fewer than
/// `MIN_CHUNKS` chunks of 16 keys (a warp's start-up costs about as much as a chunk) and
/// no more partitions than the grid's `parts_max`.
fn partitions(ctxs: &[u32], kv_heads: usize, parts_max: usize) -> Vec<u32> {
    let chunks = |c: u32| (c as usize).div_ceil(16);
    let all: usize = ctxs.iter().map(|&c| chunks(c)).sum::<usize>() * kv_heads;
    let per_warp = all.div_ceil(DECODE_WARPS).max(MIN_CHUNKS);
    ctxs.iter().map(|&c| (per_warp.max(chunks(c).div_ceil(parts_max)) * 16) as u32).collect()
}

/// See [`partitions`]: about two waves of the H200's 132 SMs at 12 flash_decode warps each
/// (on the H200, 1,536 and 6,144 gave the same throughput within the machine's noise).
const DECODE_WARPS: usize = 3072;
const MIN_CHUNKS: usize = 2;

/// Splits a step's query rows between the attention kernels: with `flash`, runs of two or
/// more rows of one sequence at consecutive positions (prefill chunks) become flash_prefill
/// tiles of up to 64 rows, `[first row, rows]` pairs; every other row (decodes) goes to the
/// split kernel's row list.
fn split_rows(meta: &AttnMetadata, flash: bool) -> (Vec<u32>, Vec<u32>) {
    const TILE: usize = 64;
    let n = meta.positions.len();
    if !flash {
        let mut rows: Vec<u32> = (0..n as u32).collect();
        longest_first(&mut rows, meta);
        return (rows, Vec::new());
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
    longest_first(&mut rows, meta);
    (rows, tiles)
}

/// Orders rows by context, longest first (ties in row order): the attention kernels take
/// them in that order, so the longest start first and the short ones fill the last wave.
fn longest_first(rows: &mut [u32], meta: &AttnMetadata) {
    rows.sort_by_key(|&t| std::cmp::Reverse(meta.positions[t as usize]));
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
        // Decode rows come longest context first (row 131 at position 40, then row 0).
        let (rows, tiles) = split_rows(&meta, true);
        assert_eq!(rows, vec![131, 0]);
        assert_eq!(tiles, vec![1, 64, 65, 64, 129, 2]);
        let (rows, tiles) = split_rows(&meta, false);
        let mut want: Vec<u32> = (0..132).collect();
        want.sort_by_key(|&t| std::cmp::Reverse(meta.positions[t as usize]));
        assert_eq!(rows.len(), 132);
        assert_eq!(rows, want);
        assert_eq!(rows[..3], [130, 129, 128]);
        assert!(tiles.is_empty());
    }

    #[test]
    fn decode_partitions_even_out_the_warps_within_the_grid() {
        // 16 rows of 1,000 keys and 16 of 40 over 8 KV heads: about (16 · 63 + 16 · 3) · 8
        // = 8,448 chunks for DECODE_WARPS warps, 3 chunks (48 keys) each; the short rows
        // take one partition.
        let ctxs: Vec<u32> = [1000; 16].into_iter().chain([40; 16]).collect();
        let parts = partitions(&ctxs, 8, 32);
        assert_eq!(parts[0], 48);
        assert_eq!(parts[16], 48);
        // A grid of 8 partitions a row makes the long rows' partitions longer instead.
        let parts = partitions(&ctxs, 8, 8);
        assert_eq!(parts[0], 128);
        assert_eq!(parts[16], 48);
        // One row: it still spreads, but no warp takes fewer than MIN_CHUNKS chunks.
        assert_eq!(partitions(&[1000], 8, 64), vec![MIN_CHUNKS as u32 * 16]);
        for (ctxs, parts_max) in [(vec![1u32, 17, 4000, 300], 4), (vec![5000; 3], 64)] {
            for (c, p) in ctxs.iter().zip(partitions(&ctxs, 8, parts_max)) {
                assert!(p % 16 == 0 && c.div_ceil(p) as usize <= parts_max, "{c} keys in parts of {p}");
            }
        }
    }
}
