//! config.json: every registered architecture's reader, then RoPE resolution over the head
//! size the config gives (the numbers that size tables and divide).
#![no_main]

use std::sync::OnceLock;

use actorllm::kernels::cpu::CpuDevice;
use actorllm::models::registry::ModelRegistry;

fn registry() -> &'static ModelRegistry<CpuDevice> {
    static R: OnceLock<ModelRegistry<CpuDevice>> = OnceLock::new();
    R.get_or_init(ModelRegistry::default)
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let head_dim = match registry().config_from_json(data, "config.json") {
        Ok(cfg) => cfg.head_dim.min(1 << 12),
        Err(_) => 64,
    };
    if let Ok(rope) = serde_json::from_slice::<actorllm::models::config::RopeConfig>(data)
        && let Ok(r) = rope.resolve("Fuzz", head_dim, "full_attention", 10_000.0)
    {
        let spec = r.spec(head_dim);
        assert!(spec.inv_freq.len() <= head_dim / 2);
    }
});
