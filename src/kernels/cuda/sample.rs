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
        let cfg =
            LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        let t = self.span("sample", (0, 0), rows);
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

#[cfg(test)]
mod tests {
    use crate::sampling::{ENTRY_WORDS, LOGPROB_WORDS, PARAM_WORDS};

    #[test]
    fn the_sampling_kernel_reads_the_layout_the_host_writes() {
        let src = include_str!("sampling.cu");
        for (name, words) in
            [("PARAM_WORDS", PARAM_WORDS), ("ENTRY_WORDS", ENTRY_WORDS), ("LOGPROB_WORDS", LOGPROB_WORDS)]
        {
            assert!(
                src.contains(&format!("#define {name} {words}\n")),
                "sampling.cu's {name} is not {words}"
            );
        }
    }
}
