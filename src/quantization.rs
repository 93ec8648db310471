//! `--quantization` with vLLM's method names, and checkpoints that say how they were
//! quantized (config.json's `quantization_config`): what the engine serves, and a refusal
//! that names the method for what it does not. GGUF files (llama.cpp's quantized formats)
//! are served by dequantizing them once at import (`gguf::import::imported`), or on the CPU
//! with their Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K blocks kept (`--keep-quantized`); other quantized
//! checkpoints are refused before any weight is read.

use serde_json::Value as Json;

/// vLLM's `--quantization` choices (its `QuantizationMethods`).
pub const VLLM_METHODS: &[&str] = &[
    "awq",
    "deepspeedfp",
    "tpu_int8",
    "fp8",
    "ptpc_fp8",
    "fbgemm_fp8",
    "modelopt",
    "modelopt_fp4",
    "bitblas",
    "gguf",
    "gptq_marlin_24",
    "gptq_marlin",
    "gptq_bitblas",
    "awq_marlin",
    "gptq",
    "compressed-tensors",
    "bitsandbytes",
    "hqq",
    "experts_int8",
    "ipex",
    "quark",
    "moe_wna16",
    "torchao",
    "auto-round",
    "rtn",
    "inc",
    "mxfp4",
];

/// What the engine serves.
const SERVED: &str = "float32, float16 and bfloat16 checkpoints, and GGUF files (--quantization gguf, \
                      dequantized once at import, or on the CPU kept in their Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K blocks \
                      with --keep-quantized)";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error("--quantization {given:?} is not a quantization method (vLLM's are: {})", VLLM_METHODS.join(", "))]
    Unknown { given: String },
    #[error("--quantization {method} is not supported: actorllm serves {SERVED}")]
    UnsupportedArg { method: String },
    #[error("--keep-quantized keeps a .gguf file's blocks: --model must be one, got {model}")]
    KeepNeedsGguf { model: String },
    #[error(
        "--keep-quantized runs llama.cpp's blocks on the CPU's kernels only: leave it out on a GPU (the GGUF \
         file is then dequantized at import), or serve with --device cpu"
    )]
    KeepOnGpu,
    #[error("--quantization gguf takes a .gguf file as --model, got {model}")]
    GgufNeedsFile { model: String },
    #[error(
        "a .gguf --model is llama.cpp's format: --quantization {given} does not apply to it (leave it out, or give gguf)"
    )]
    NotGguf { given: String },
    #[error(
        "{file}: the checkpoint is quantized with {method} (quantization_config), which actorllm does not \
         load; it serves {SERVED}. Serve the checkpoint it was quantized from, or a GGUF file"
    )]
    Checkpoint { file: String, method: String },
}

/// Checks `--quantization` against the model given: a GGUF file takes `gguf` or nothing, and
/// anything else takes nothing (16-bit and f32 checkpoints).
pub fn check_arg(given: Option<&str>, model: &std::path::Path, is_gguf: bool) -> Result<(), QuantError> {
    let Some(given) = given else { return Ok(()) };
    let given = given.to_ascii_lowercase();
    if !VLLM_METHODS.contains(&given.as_str()) {
        return Err(QuantError::Unknown { given });
    }
    match (given == "gguf", is_gguf) {
        (true, true) => Ok(()),
        (true, false) => Err(QuantError::GgufNeedsFile { model: model.display().to_string() }),
        (false, true) => Err(QuantError::NotGguf { given }),
        (false, false) => Err(QuantError::UnsupportedArg { method: given }),
    }
}

/// The method a config.json's `quantization_config` names (`quant_method`; compressed-tensors
/// configs carry it too), if it has one.
pub fn config_method(hf: &Json) -> Option<String> {
    let q = hf.get("quantization_config")?;
    let method = q.get("quant_method").and_then(Json::as_str).unwrap_or("an unnamed method");
    Some(method.to_string())
}

/// Refuses a checkpoint whose config.json says it is quantized, naming the method.
/// (`check_arg` has refused every `--quantization` but gguf for a GGUF file by then, so
/// there is no flag left to disagree with the config.)
pub fn check_config(hf: &Json, source: &str) -> Result<(), QuantError> {
    match config_method(hf) {
        Some(method) => Err(QuantError::Checkpoint { file: source.to_string(), method }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn the_flag_takes_vllm_names_and_gguf_only_for_a_gguf_file() {
        let dir = Path::new("models/x");
        assert_eq!(check_arg(None, dir, false), Ok(()));
        assert_eq!(check_arg(Some("gguf"), Path::new("m.gguf"), true), Ok(()));
        assert_eq!(check_arg(Some("GGUF"), Path::new("m.gguf"), true), Ok(()));
        let e = check_arg(Some("int3"), dir, false).unwrap_err().to_string();
        assert!(e.contains("\"int3\" is not a quantization method") && e.contains("awq, deepspeedfp"), "{e}");
        let e = check_arg(Some("awq"), dir, false).unwrap_err().to_string();
        assert!(e.starts_with("--quantization awq is not supported: actorllm serves float32"), "{e}");
        let e = check_arg(Some("gguf"), dir, false).unwrap_err().to_string();
        assert_eq!(e, "--quantization gguf takes a .gguf file as --model, got models/x");
        let e = check_arg(Some("fp8"), Path::new("m.gguf"), true).unwrap_err().to_string();
        assert!(e.contains("--quantization fp8 does not apply"), "{e}");
    }

    #[test]
    fn a_quantized_checkpoint_is_refused_by_its_method() {
        let plain = serde_json::json!({"architectures": ["LlamaForCausalLM"]});
        assert_eq!(check_config(&plain, "m/config.json"), Ok(()));
        let awq =
            serde_json::json!({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}});
        let e = check_config(&awq, "m/config.json").unwrap_err().to_string();
        assert!(
            e.starts_with("m/config.json: the checkpoint is quantized with awq (quantization_config)"),
            "{e}"
        );
        let ct = serde_json::json!({"quantization_config": {"format": "float-quantized"}});
        assert!(check_config(&ct, "c").unwrap_err().to_string().contains("quantized with an unnamed method"));
    }
}
