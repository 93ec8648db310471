//! Sampling on the GPU (sampling.cu): the rows' parameters and penalty entries go up, one
//! block per row picks its token, and only the tokens (and logprobs where asked) come back,
//! copied in stream order into page-locked memory that the host reads once an event says
//! they are there. Until then the next step's token ids may name them (`FED_TOKEN`):
//! `feed_tokens` puts them in place on the device.

use cudarc::driver::{CudaEvent, CudaSlice, LaunchConfig, PinnedHostSlice, PushKernelArg};

use super::wire::{DeviceRows, LOGPROB_WORDS};
use super::{CudaDevice, CudaTensor, DeviceError, cuda};
use crate::kernels::{DevResult, FED_TOKEN, SampleTicket, Sampled};
use crate::sampling::SampleInput;

/// Samplings issued and not yet collected: their results go to two page-locked buffers in
/// turn, so that one step's can be read while the next step's are on their way.
#[derive(Default)]
pub(super) struct SampledHost {
    bufs: [Option<PinnedHostSlice<u32>>; 2],
    /// Recorded behind each buffer's copy.
    copied: [Option<CudaEvent>; 2],
    issued: Vec<IssuedSample>,
    next: u64,
}

/// What collecting an issued sampling needs: its buffer is `bufs[id % 2]`.
struct IssuedSample {
    id: u64,
    rows: usize,
    cols: usize,
    /// Words copied: the tokens, then each row's logprob words where any row asked.
    words: usize,
    logprobs: Vec<Option<usize>>,
}

impl CudaDevice {
    pub(super) fn sample(&self, logits: CudaTensor, inputs: &[SampleInput]) -> DevResult<Vec<Sampled>> {
        let ticket = self.sample_issue(logits, inputs)?;
        self.sample_collect(ticket)
    }

    /// Issues the sampling of `logits` and the copy of its results to the host, without
    /// waiting: [`Self::sample_collect`] reads them.
    pub(super) fn sample_issue(
        &self,
        mut logits: CudaTensor,
        inputs: &[SampleInput],
    ) -> DevResult<SampleTicket> {
        let (rows, cols) = (logits.rows, logits.cols);
        assert_eq!(rows, inputs.len(), "one sampling input per row of logits");
        if rows == 0 {
            return Ok(SampleTicket::Done(Vec::new()));
        }
        let enc = DeviceRows::encode(inputs, cols);
        let params = self.stage("sample params", &enc.params)?;
        let mut entries = self.stage("sample entries", &enc.entries)?;
        let out_len = rows * (1 + LOGPROB_WORDS);
        let mut out = self.stage("sample out", &[])?;
        if out.len() < out_len {
            out = self.zeros::<u32>(out_len.next_power_of_two())?;
        }
        let (n, c) = (rows as i32, cols as i32);
        let t = self.span("sample", (0, 0), rows);
        self.apply_masks(&mut logits, inputs)?;
        if enc.full {
            let cfg =
                LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: logits is [rows, cols]; params holds PARAM_WORDS per row and entries the
            // ENTRY_WORDS-word entries they index, each token below cols; out has room for the
            // tokens and LOGPROB_WORDS per row.
            unsafe {
                self.stream
                    .launch_builder(self.f("sample_f32"))
                    .arg(&mut *logits.buf)
                    .arg(&params)
                    .arg(&mut entries)
                    .arg(&mut out)
                    .arg(&n)
                    .arg(&c)
                    .launch(cfg)
            }
            .map_err(cuda("sample launch"))?;
        }
        if enc.split {
            let (slices, chunk) = split_slices(rows, cols);
            let need = rows * slices * 6;
            let mut scratch = self.stage("sample scratch", &[])?;
            if scratch.len() < need {
                scratch = self.zeros::<u32>(need.next_power_of_two())?;
            }
            let (s, ch) = (slices as i32, chunk as i32);
            let grid = LaunchConfig {
                grid_dim: (slices as u32, rows as u32, 1),
                block_dim: (SPLIT_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let pick = LaunchConfig {
                grid_dim: (rows.div_ceil(8) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: as above; scratch holds 6 words for each (row, slice), and the slices
            // of `chunk` columns cover each row. sample_max and sample_race take the same
            // arguments.
            unsafe {
                for name in ["sample_max", "sample_race"] {
                    self.stream
                        .launch_builder(self.f(name))
                        .arg(&mut *logits.buf)
                        .arg(&params)
                        .arg(&mut entries)
                        .arg(&mut scratch)
                        .arg(&n)
                        .arg(&c)
                        .arg(&s)
                        .arg(&ch)
                        .launch(grid)
                        .map_err(cuda("sample launch"))?;
                }
                self.stream
                    .launch_builder(self.f("sample_pick"))
                    .arg(&params)
                    .arg(&scratch)
                    .arg(&mut out)
                    .arg(&n)
                    .arg(&s)
                    .launch(pick)
                    .map_err(cuda("sample launch"))?;
            }
            self.restage("sample scratch", scratch);
        }
        drop(t);
        let words = if enc.logprobs { out_len } else { rows };
        let id = self.copy_sampled(&out, words)?;
        self.restage("sample params", params);
        self.restage("sample entries", entries);
        self.restage("sample out", out);
        let logprobs = DeviceRows::logprob_counts(inputs);
        self.sampled.borrow_mut().issued.push(IssuedSample { id, rows, cols, words, logprobs });
        Ok(SampleTicket::Issued(id))
    }

    /// Masks the logits of the rows that limit their tokens (a grammar, `allowed_token_ids`,
    /// `bad_words`): their masks go up behind the rows' indexes, and one launch covers them
    /// all; then adds the rows' `logit_bias`.
    fn apply_masks(&self, logits: &mut CudaTensor, inputs: &[SampleInput]) -> DevResult<()> {
        let words = logits.cols.div_ceil(32);
        let masked: Vec<(usize, &[u32])> =
            inputs.iter().enumerate().filter_map(|(r, inp)| inp.allowed.map(|a| (r, a))).collect();
        if !masked.is_empty() {
            self.apply_token_masks(logits, &masked, words)?;
        }
        let bias: Vec<u32> = inputs
            .iter()
            .enumerate()
            .flat_map(|(r, inp)| inp.params.logit_bias.iter().map(move |&(t, b)| [r as u32, t, b.to_bits()]))
            .flatten()
            .collect();
        if bias.is_empty() {
            return Ok(());
        }
        let buf = self.stage("sample bias", &bias)?;
        let (n, c) = ((bias.len() / 3) as i32, logits.cols as i32);
        let cfg = LaunchConfig {
            grid_dim: ((n as u32).div_ceil(256), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: logits is [rows, cols]; buf holds n (row, token, bias) triples, each row
        // below rows (tokens past cols are skipped).
        unsafe {
            self.stream
                .launch_builder(self.f("apply_logit_bias"))
                .arg(&mut *logits.buf)
                .arg(&buf)
                .arg(&n)
                .arg(&c)
                .launch(cfg)
        }
        .map_err(cuda("apply_logit_bias launch"))?;
        self.restage("sample bias", buf);
        Ok(())
    }

    /// One launch masking the rows of `masked` (row, mask of `words` words).
    fn apply_token_masks(
        &self,
        logits: &mut CudaTensor,
        masked: &[(usize, &[u32])],
        words: usize,
    ) -> DevResult<()> {
        let mut data = Vec::with_capacity(masked.len() * (words + 1));
        data.extend(masked.iter().map(|(r, _)| *r as u32));
        for (_, a) in masked {
            data.extend((0..words).map(|w| a.get(w).copied().unwrap_or(0)));
        }
        let buf = self.stage("sample masks", &data)?;
        let (n, w, c) = (masked.len() as i32, words as i32, logits.cols as i32);
        let cfg = LaunchConfig {
            grid_dim: (words.div_ceil(256) as u32, masked.len() as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: logits is [rows, cols]; buf holds n row indexes below rows, then n masks
        // of `words` words, which cover the cols.
        unsafe {
            self.stream
                .launch_builder(self.f("apply_token_mask"))
                .arg(&mut *logits.buf)
                .arg(&buf)
                .arg(&n)
                .arg(&w)
                .arg(&c)
                .launch(cfg)
        }
        .map_err(cuda("apply_token_mask launch"))?;
        self.restage("sample masks", buf);
        Ok(())
    }

    /// Queues the copy of the first `words` of `out` into the next page-locked buffer and
    /// an event behind it; the number of the sampling they belong to.
    fn copy_sampled(&self, out: &CudaSlice<u32>, words: usize) -> DevResult<u64> {
        let mut host = self.sampled.borrow_mut();
        let id = host.next;
        let slot = (id % 2) as usize;
        if host.issued.iter().any(|s| s.id % 2 == id % 2) {
            return Err(DeviceError::Other("two samplings are already waiting to be collected".into()));
        }
        let mut buf = match host.bufs[slot].take() {
            Some(b) if b.len() >= words => b,
            // SAFETY: page-locked memory the copy below writes before anything reads it;
            // not write-combined, since the host reads it.
            _ => unsafe { self.ctx.alloc_pinned_with_flags::<u32>(words.next_power_of_two(), 0) }
                .map_err(cuda("page-locked allocation"))?,
        };
        self.stream.memcpy_dtoh(&out.slice(0..words), &mut buf).map_err(cuda("device to host copy"))?;
        let event = match host.copied[slot].take() {
            Some(e) => e,
            None => self.ctx.new_event(None).map_err(cuda("event"))?,
        };
        event.record(&self.stream).map_err(cuda("event record"))?;
        host.bufs[slot] = Some(buf);
        host.copied[slot] = Some(event);
        host.next += 1;
        Ok(id)
    }

    /// Waits for an issued sampling's results and reads them.
    pub(super) fn sample_collect(&self, ticket: SampleTicket) -> DevResult<Vec<Sampled>> {
        let id = match ticket {
            SampleTicket::Done(rows) => return Ok(rows),
            SampleTicket::Issued(id) => id,
        };
        let mut host = self.sampled.borrow_mut();
        let at = host.issued.iter().position(|s| s.id == id);
        let s = at.map(|i| host.issued.remove(i)).ok_or_else(|| {
            DeviceError::Other(format!("sampling {id} was never issued or was collected already"))
        })?;
        let slot = (id % 2) as usize;
        let (Some(event), Some(buf)) = (&host.copied[slot], &host.bufs[slot]) else {
            return Err(DeviceError::Other(format!("sampling {id} has no results buffer")));
        };
        self.wait_event(event, "waiting for the sampled tokens")?;
        let words = buf.as_slice().map_err(cuda("reading the sampled tokens"))?;
        let (tokens, logprobs) = words[..s.words].split_at(s.rows);
        Ok(DeviceRows::decode(&s.logprobs, tokens, logprobs, s.cols))
    }

    /// Puts in place the ids of `ids` (uploaded to `buf`) that name a row of the last
    /// sampling issued (`FED_TOKEN | row`), from that sampling's output on the device, in
    /// stream order before anything reads them.
    pub(super) fn feed_tokens(&self, buf: &mut CudaSlice<u32>, ids: &[u32]) -> DevResult<()> {
        let host = self.sampled.borrow();
        let rows = host.issued.iter().max_by_key(|s| s.id).map_or(0, |s| s.rows);
        if let Some(&bad) = ids.iter().find(|&&t| t >= FED_TOKEN && ((t - FED_TOKEN) as usize) >= rows) {
            return Err(DeviceError::Other(format!(
                "token id {bad:#x} names row {} of a sampling of {rows} rows waiting to be collected",
                bad - FED_TOKEN
            )));
        }
        let staging = self.inputs[0].staging.borrow();
        let out = staging
            .get("sample out")
            .ok_or_else(|| DeviceError::Other("no sampled tokens to feed a step from".into()))?;
        let n = ids.len() as i32;
        let cfg = LaunchConfig {
            grid_dim: (ids.len().div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: buf holds n ids; each fed one names a row below the sampling's rows, whose
        // tokens lead `out`.
        unsafe { self.stream.launch_builder(self.f("feed_tokens")).arg(buf).arg(out).arg(&n).launch(cfg) }
            .map_err(cuda("feed_tokens launch"))?;
        Ok(())
    }
}

/// Threads of a split-sampler block (sampling.cu's SPLIT_THREADS).
const SPLIT_THREADS: u32 = 256;

/// Slices a row is cut into for the split sampler, and their columns (a multiple of 4):
/// enough blocks to fill the GPU a few times over (about 512), each with at least 2048
/// columns, at most 64 a row.
fn split_slices(rows: usize, cols: usize) -> (usize, usize) {
    let slices = 512usize.div_ceil(rows).min(cols / 2048).clamp(1, 64);
    (slices, cols.div_ceil(slices).next_multiple_of(4))
}

#[cfg(test)]
mod tests {
    use super::super::wire::{ENTRY_WORDS, LOGPROB_WORDS, PARAM_WORDS};
    use super::{SPLIT_THREADS, split_slices};

    #[test]
    fn the_sampling_kernel_reads_the_layout_the_host_writes() {
        let src = include_str!("sampling.cu");
        for (name, words) in [
            ("PARAM_WORDS", PARAM_WORDS),
            ("ENTRY_WORDS", ENTRY_WORDS),
            ("LOGPROB_WORDS", LOGPROB_WORDS),
            ("SPLIT_THREADS", SPLIT_THREADS as usize),
        ] {
            assert!(
                src.contains(&format!("#define {name} {words}\n")),
                "sampling.cu's {name} is not {words}"
            );
        }
    }

    #[test]
    fn split_slices_cover_every_column_in_aligned_slices() {
        for rows in [1, 3, 132, 256, 1000] {
            for cols in [1, 100, 4096, 50_257, 128_256] {
                let (slices, chunk) = split_slices(rows, cols);
                assert!((1..=64).contains(&slices), "{slices} slices for {rows} x {cols}");
                assert_eq!(chunk % 4, 0, "slices of {chunk} columns break the float4 loads");
                assert!(slices * chunk >= cols, "{slices} slices of {chunk} miss columns of {cols}");
                assert!(slices == 1 || chunk >= 2048, "{slices} slices of only {chunk} columns");
            }
        }
        assert_eq!(split_slices(1, 128_256).0, 62, "one row spreads over the GPU");
    }
}
