//! The kernel sources and their entry points, compiled by NVRTC for the GPU's architecture
//! and cached on disk by source hash (`$ACTORLLM_KERNEL_CACHE`, default the temp dir).

use super::DeviceError;

/// Prepended to every source (16-bit types and the rounding store the kernels share).
pub(super) const COMMON: &str = include_str!("common.cuh");

pub(super) const SOURCES: [(&str, &str); 6] = [
    ("elementwise", include_str!("elementwise.cu")),
    ("attention", include_str!("attention.cu")),
    ("flash", include_str!("flash.cu")),
    ("sampling", include_str!("sampling.cu")),
    ("lora", include_str!("lora.cu")),
    ("gemv", include_str!("gemv.cu")),
];

const KERNELS: [&str; 68] = [
    "embedding_f32",
    "embedding_bf16",
    "embedding_f16",
    "f32_to_bf16",
    "f32_to_f16",
    "rms_norm_f32",
    "silu_mul_f32",
    "silu_mul_bf16",
    "silu_mul_f16",
    "add_f32",
    "add_bias_f32",
    "gather_rows_f32",
    "join_shards_f32",
    "sample_f32",
    "sample_max",
    "sample_race",
    "sample_pick",
    "feed_tokens",
    "split_qkv_rope_f32",
    "split_qkv_rope_kv_f32",
    "split_qkv_rope_kv_bf16",
    "split_qkv_rope_kv_f16",
    "write_kv_f32",
    "write_kv_bf16",
    "write_kv_f16",
    "paged_attention_f32",
    "paged_attention_bf16",
    "paged_attention_f16",
    "paged_attention_reduce_f32",
    "paged_attention_reduce_warp_f32",
    "lora_mask_f32",
    "lora_shrink_f32",
    "lora_shrink_bf16",
    "lora_expand_f32",
    "lora_expand_bf16",
    "flash_prefill_h64_f32",
    "flash_prefill_h128_f32",
    "flash_prefill_h64_bf16",
    "flash_prefill_h128_bf16",
    "flash_prefill_h64_f16",
    "flash_prefill_h128_f16",
    "flash_decode_h64_f32",
    "flash_decode_h128_f32",
    "flash_decode_h64_bf16",
    "flash_decode_h128_bf16",
    "flash_decode_h64_f16",
    "flash_decode_h128_f16",
    "flash_decode_join_h64_bf16",
    "flash_decode_join_h128_bf16",
    "flash_decode_join_h64_f16",
    "flash_decode_join_h128_f16",
    "gemv_bf16",
    "gemv_f16",
    "gemv_wide_bf16",
    "gemv_wide_f16",
    "gemv_silu_bf16",
    "gemv_silu_f16",
    "gemv_silu_wide_bf16",
    "gemv_silu_wide_f16",
    "gemv_res_norm_bf16",
    "gemv_res_norm_f16",
    "gemv_res_norm_wide_bf16",
    "gemv_res_norm_wide_f16",
    "gemv_qkv_rope_bf16",
    "gemv_qkv_rope_f16",
    "gemv_qkv_rope_wide_bf16",
    "gemv_qkv_rope_wide_f16",
    "fill_random_16",
];

/// The split attention kernel's instantiations for one KV cache type, in [`KvKernels`]'
/// `split` order: group bound G, then dims-per-lane bound D.
pub(super) fn split_names(sfx: &str) -> impl Iterator<Item = String> + '_ {
    [1, 2, 4, 8].into_iter().flat_map(move |g| {
        [2, 4, 8].into_iter().map(move |d| format!("paged_attention_split_g{g}_d{d}_{sfx}"))
    })
}

/// Every entry point: [`KERNELS`] and the split attention kernel's instantiations.
pub(super) fn kernel_names() -> Vec<String> {
    let mut names: Vec<String> = KERNELS.iter().map(|k| k.to_string()).collect();
    for sfx in ["f32", "bf16", "f16"] {
        names.extend(split_names(sfx));
    }
    names
}

fn cache_dir() -> std::path::PathBuf {
    std::env::var_os("ACTORLLM_KERNEL_CACHE")
        .map(Into::into)
        .unwrap_or_else(|| std::env::temp_dir().join("actorllm-kernels"))
}

/// PTX of one source for `arch`: from the cache, else compiled by NVRTC and cached.
pub(super) fn compile(name: &str, src: &str, arch: &str) -> Result<cudarc::nvrtc::Ptx, DeviceError> {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    src.hash(&mut h);
    let path = cache_dir().join(format!("{name}-{:016x}-{arch}.ptx", h.finish()));
    if let Ok(text) = std::fs::read_to_string(&path) {
        return Ok(cudarc::nvrtc::Ptx::from_src(text));
    }
    let arch_static: &'static str = Box::leak(arch.to_string().into_boxed_str());
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(arch_static),
        include_paths: vec!["/usr/local/cuda/include".into()],
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(src, opts)
        .map_err(|e| DeviceError::Other(format!("NVRTC compiling {name}.cu for {arch}: {e:?}")))?;
    let _ = std::fs::create_dir_all(cache_dir());
    let _ = std::fs::write(&path, ptx.to_src());
    Ok(ptx)
}
