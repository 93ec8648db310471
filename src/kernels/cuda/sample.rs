//! Sampling on the GPU (sampling.cu): the rows' parameters and penalty entries go up, one
//! block per row picks its token, and only the tokens (and logprobs where asked) come back.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{CudaDevice, CudaTensor, cuda};
use crate::kernels::{DevResult, Sampled};
use crate::sampling::{DeviceRows, LOGPROB_WORDS, SampleInput};

impl CudaDevice {
    pub(super) fn sample(&self, mut logits: CudaTensor, inputs: &[SampleInput]) -> DevResult<Vec<Sampled>> {
        let (rows, cols) = (logits.rows, logits.cols);
        assert_eq!(rows, inputs.len(), "one sampling input per row of logits");
        if rows == 0 {
            return Ok(Vec::new());
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
        let copy_len = if enc.logprobs { out_len } else { rows };
        let words = self.stream.clone_dtoh(&out.slice(0..copy_len)).map_err(cuda("device to host copy"))?;
        self.restage("sample params", params);
        self.restage("sample entries", entries);
        self.restage("sample out", out);
        let (tokens, logprobs) = words.split_at(rows);
        Ok(DeviceRows::decode(inputs, tokens, logprobs, cols))
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
    use super::{SPLIT_THREADS, split_slices};
    use crate::sampling::{ENTRY_WORDS, LOGPROB_WORDS, PARAM_WORDS};

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
