//! GGUF files: the header, metadata, tensor table and offsets, then dequantization of every
//! tensor the file claims to hold.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(f) = actorllm::gguf::GgufFile::from_bytes(data.to_vec()) {
        for t in &f.tensors {
            let values = f.dequantize(t);
            assert_eq!(values.len() as u64, t.numel());
        }
    }
});
