//! safetensors files: the header, each tensor's dtype, shape and offsets; every accepted
//! tensor's bytes are exactly its shape's.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(c) = actorllm::models::loader::Checkpoint::from_bytes("fuzz.safetensors", data.to_vec()) {
        for (_, t) in c.tensors() {
            let n: usize = t.shape.iter().product();
            assert_eq!(t.bytes.len(), n * t.dtype.size());
        }
    }
});
