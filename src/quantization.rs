//! `--quantization` with vLLM's method names, and checkpoints that say how they were
//! quantized (config.json's `quantization_config`): what the engine serves, and a refusal
//! that names the method for what it does not. GGUF files (llama.cpp's quantized formats)
//! are served by dequantizing them once at import (`gguf::import::imported`), or on the CPU
//! with their Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K blocks kept (`--keep-quantized`). FP8
//! (e4m3) checkpoints, vLLM's `fp8` and compressed-tensors' `float-quantized`, load with each
//! weight times its scales (per tensor, per output channel or per block), in the dtype of
//! the checkpoint's other weights (`models::loader`). GPTQ, AWQ and compressed-tensors
//! integer checkpoints load with their integer weights unpacked, `(q - zero) × scale` of
//! each group (`models::packed`).
//! Other quantized checkpoints are refused before any weight is read.

use serde_json::Value as Json;

use crate::kernels::rows::RowKind;
use crate::models::packed::Packing;

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
const SERVED: &str = "float32, float16 and bfloat16 checkpoints, FP8 (e4m3) checkpoints (fp8 and \
                      compressed-tensors float-quantized, their weights scaled back at load), GPTQ (2, 4 and \
                      8 bits), AWQ (4 bits, gemm) and compressed-tensors pack-quantized and int-quantized (2, 4 \
                      and 8 bits) checkpoints (their weights unpacked at load), and GGUF files \
                      (--quantization gguf, dequantized once at import, or on the CPU kept in their Q4_0, Q4_1, \
                      Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K blocks with --keep-quantized)";

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
    #[error(
        "the checkpoint is not quantized (its config.json has no quantization_config), and actorllm \
         quantizes at load for --quantization fp8 only, not {method}: leave the flag out, give fp8, or \
         serve a checkpoint quantized with {method}"
    )]
    NotQuantized { method: String },
    #[error(
        "the checkpoint is quantized with {method} (its config.json's quantization_config), not \
         --quantization {given}: leave the flag out, or give {method}"
    )]
    Mismatch { method: String, given: String },
    #[error("{file}: the checkpoint's quantization_config asks for {what}, which actorllm does not load")]
    Packing { file: String, what: String },
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

/// The `--quantization` names of the checkpoints the loader reads: FP8 ones, and the
/// integer ones with the names vLLM also takes for them (its Marlin kernels).
const CHECKPOINT_METHODS: [&str; 6] =
    ["fp8", "compressed-tensors", "gptq", "gptq_marlin", "awq", "awq_marlin"];

/// The method a checkpoint's config names, as `--quantization` may give it: vLLM takes
/// `gptq_marlin` for a GPTQ checkpoint and `awq_marlin` for an AWQ one.
fn same_method(config: &str, given: &str) -> bool {
    config == given || given.strip_suffix("_marlin") == Some(config)
}

/// Checks `--quantization` against the model given: a GGUF file takes `gguf` or nothing;
/// a checkpoint takes nothing, or the FP8 method its config.json names (checked against the
/// config by [`check_config`]).
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
        (false, false) if CHECKPOINT_METHODS.contains(&given.as_str()) => Ok(()),
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

/// Whether a `quantization_config` describes e4m3 weights the loader scales back: vLLM's
/// `fp8` (per-tensor `weight_scale`, or `weight_block_size` blocks with `weight_scale_inv`),
/// or compressed-tensors' `float-quantized` whose every weight group is 8-bit float.
fn is_fp8_weights(q: &Json, method: &str) -> bool {
    match method {
        "fp8" => q.get("fmt").and_then(Json::as_str).is_none_or(|f| f == "e4m3"),
        "compressed-tensors" => {
            let groups = q.get("config_groups").and_then(Json::as_object);
            q.get("format").and_then(Json::as_str) == Some("float-quantized")
                && groups.is_some_and(|g| {
                    !g.is_empty()
                        && g.values().all(|group| {
                            let w = &group["weights"];
                            w["type"] == "float" && w["num_bits"] == 8
                        })
                })
        }
        _ => false,
    }
}

/// Refuses a checkpoint whose config.json says it is quantized in a way the loader does
/// not read, naming the method (or the part of it). FP8, GPTQ, AWQ and compressed-tensors
/// integer checkpoints pass.
pub fn check_config(hf: &Json, source: &str) -> Result<(), QuantError> {
    let Some(method) = config_method(hf) else { return Ok(()) };
    let q = &hf["quantization_config"];
    let packing = |what| QuantError::Packing { file: source.to_string(), what };
    let kv_only = kv_cache_only(q, &method).map_err(packing)?;
    match Packing::of(q, &method) {
        Err(what) => Err(packing(what)),
        Ok(Some(_)) => Ok(()),
        Ok(None) if is_fp8_weights(q, &method) || kv_only => Ok(()),
        Ok(None) => Err(QuantError::Checkpoint { file: source.to_string(), method }),
    }
}

/// Whether a compressed-tensors config quantizes only the KV cache (a `kv_cache_scheme`
/// and no weight groups: llm-compressor's KV-cache-only output, whose `k_scale` and
/// `v_scale` the loader reads beside unquantized weights, `models::kv_scales`). A scheme
/// other than FP8 with one scale a tensor is refused by name, weights or not.
fn kv_cache_only(q: &Json, method: &str) -> Result<bool, String> {
    let Some(scheme) = q.get("kv_cache_scheme").filter(|s| !s.is_null()) else { return Ok(false) };
    if method != "compressed-tensors" {
        return Ok(false);
    }
    let (ty, bits) = (scheme["type"].as_str().unwrap_or("unnamed"), scheme["num_bits"].as_u64().unwrap_or(0));
    if (ty, bits) != ("float", 8) {
        return Err(format!("a {bits}-bit {ty} KV cache (kv_cache_scheme; FP8 is read)"));
    }
    match scheme["strategy"].as_str().unwrap_or("tensor") {
        "tensor" => {}
        other => {
            return Err(format!(
                "KV cache scales of strategy {other} (kv_cache_scheme; one a tensor is read)"
            ));
        }
    }
    Ok(q.get("config_groups").and_then(Json::as_object).is_none_or(|g| g.is_empty()))
}

/// How the checkpoint of config.json `hf` packs integer weights (GPTQ, AWQ,
/// compressed-tensors), if it does
/// (its config passed [`check_config`]).
pub fn packing(hf: &Json) -> Option<Packing> {
    Packing::of(&hf["quantization_config"], &config_method(hf)?).ok().flatten()
}

/// What a checkpoint-less load (`--load-format dummy`) of config.json `hf` makes its
/// projections of, as the checkpoint would hold them kept packed: 4-bit rows for a 4-bit
/// GPTQ or AWQ config (its group size), FP8 rows for an FP8 one (its blocks' width, or one
/// scale a row); None for others.
pub fn dummy_rows(hf: &Json) -> Option<(RowKind, Option<usize>)> {
    let method = config_method(hf)?;
    let q = &hf["quantization_config"];
    if let Some(group) = packing(hf).and_then(Packing::int4_group) {
        return Some((RowKind::Int4, group));
    }
    let block = q.get("weight_block_size").and_then(|b| b.get(1)).and_then(Json::as_u64).map(|b| b as usize);
    is_fp8_weights(q, &method).then_some((RowKind::Fp8, block))
}

/// Whether `--quantization` `given` asks for a checkpoint of config.json `hf` to be
/// quantized at load: fp8 on a checkpoint that is not quantized (vLLM's online FP8).
pub fn online_fp8(hf: &Json, given: Option<&str>) -> bool {
    given.is_some_and(|g| g.eq_ignore_ascii_case("fp8")) && config_method(hf).is_none()
}

/// Refuses a `--quantization` (checked by [`check_arg`]) that the checkpoint's config.json
/// does not bear out: vLLM quantizes a 16-bit checkpoint at load for `fp8`, which this
/// engine does not, and a checkpoint quantized one way is not served as another.
pub fn check_flag(hf: &Json, given: Option<&str>) -> Result<(), QuantError> {
    let Some(given) = given.map(str::to_ascii_lowercase).filter(|g| g != "gguf") else { return Ok(()) };
    match config_method(hf) {
        None if given == "fp8" => Ok(()),
        None => Err(QuantError::NotQuantized { method: given }),
        Some(method) if !same_method(&method, &given) => Err(QuantError::Mismatch { method, given }),
        Some(_) => Ok(()),
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
        for served in ["awq", "awq_marlin", "gptq", "gptq_marlin", "fp8", "compressed-tensors"] {
            assert_eq!(check_arg(Some(served), dir, false), Ok(()), "{served}");
        }
        let e = check_arg(Some("bitsandbytes"), dir, false).unwrap_err().to_string();
        assert!(
            e.starts_with("--quantization bitsandbytes is not supported: actorllm serves float32"),
            "{e}"
        );
        let e = check_arg(Some("gguf"), dir, false).unwrap_err().to_string();
        assert_eq!(e, "--quantization gguf takes a .gguf file as --model, got models/x");
        let e = check_arg(Some("fp8"), Path::new("m.gguf"), true).unwrap_err().to_string();
        assert!(e.contains("--quantization fp8 does not apply"), "{e}");
    }

    #[test]
    fn a_quantized_checkpoint_is_refused_by_its_method() {
        let plain = serde_json::json!({"architectures": ["LlamaForCausalLM"]});
        assert_eq!(check_config(&plain, "m/config.json"), Ok(()));
        let bnb = serde_json::json!({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": true}});
        let e = check_config(&bnb, "m/config.json").unwrap_err().to_string();
        assert!(
            e.starts_with(
                "m/config.json: the checkpoint is quantized with bitsandbytes (quantization_config)"
            ),
            "{e}"
        );
        // GPTQ and AWQ load as their packings are read; a part of them that is not, by name.
        let q = |q: serde_json::Value| serde_json::json!({ "quantization_config": q });
        let awq =
            q(serde_json::json!({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}));
        assert_eq!(check_config(&awq, "m"), Ok(()));
        assert_eq!(packing(&awq), Some(Packing::Awq { group_size: Some(128) }));
        let gptq3 = q(serde_json::json!({"quant_method": "gptq", "bits": 3, "group_size": 128}));
        let e = check_config(&gptq3, "m/config.json").unwrap_err().to_string();
        assert_eq!(
            e,
            "m/config.json: the checkpoint's quantization_config asks for GPTQ with 3-bit weights (2, 4 and 8 \
             are read), which actorllm does not load"
        );
        assert_eq!(packing(&plain), None);
        let ct = serde_json::json!({"quantization_config": {"format": "float-quantized"}});
        assert!(check_config(&ct, "c").unwrap_err().to_string().contains("quantized with an unnamed method"));
        // FP8 weights load; integer or 4-bit compressed-tensors groups, and e5m2, do not.
        let fp8 = serde_json::json!({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}});
        assert_eq!(check_config(&fp8, "m"), Ok(()));
        let e5m2 = serde_json::json!({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}});
        assert!(check_config(&e5m2, "m").is_err());
        let group = |format: &str, ty: &str, bits: u32| {
            serde_json::json!({"quantization_config": {"quant_method": "compressed-tensors", "format": format,
                "config_groups": {"g": {"weights": {"type": ty, "num_bits": bits}}}}})
        };
        assert_eq!(check_config(&group("float-quantized", "float", 8), "m"), Ok(()));
        assert_eq!(check_config(&group("pack-quantized", "int", 4), "m"), Ok(()));
        for (format, ty, bits, why) in [
            ("pack-quantized", "int", 6, "6-bit integer weights"),
            ("float-quantized", "int", 4, "float-quantized format for integer weights"),
        ] {
            let e = check_config(&group(format, ty, bits), "m").unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
        }
        assert!(
            check_config(&group("float-quantized", "float", 4), "m")
                .unwrap_err()
                .to_string()
                .contains("with compressed-tensors")
        );
        // llm-compressor's KV-cache-only output loads (its scales beside the weights); KV
        // schemes it does not read are named.
        let kv = |scheme: serde_json::Value| {
            serde_json::json!({"quantization_config": {"quant_method": "compressed-tensors", "format": "dense",
                "config_groups": {}, "kv_cache_scheme": scheme}})
        };
        let fp8_tensor =
            serde_json::json!({"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": false});
        assert_eq!(check_config(&kv(fp8_tensor), "m"), Ok(()));
        let e = check_config(
            &kv(serde_json::json!({"type": "float", "num_bits": 8, "strategy": "attn_head"})),
            "m",
        );
        assert!(e.unwrap_err().to_string().contains("strategy attn_head"));
        let e = check_config(&kv(serde_json::json!({"type": "int", "num_bits": 8})), "m");
        assert!(e.unwrap_err().to_string().contains("8-bit int KV cache"));
    }

    #[test]
    fn the_flag_must_name_the_checkpoints_own_method() {
        let plain = serde_json::json!({"architectures": ["LlamaForCausalLM"]});
        let fp8 = serde_json::json!({"quantization_config": {"quant_method": "fp8"}});
        assert_eq!(check_flag(&plain, None), Ok(()));
        assert_eq!(check_flag(&plain, Some("gguf")), Ok(()));
        assert_eq!(check_flag(&fp8, Some("FP8")), Ok(()));
        // fp8 on a 16-bit checkpoint quantizes it at load; another method is refused.
        assert_eq!(check_flag(&plain, Some("fp8")), Ok(()));
        assert!(
            online_fp8(&plain, Some("FP8")) && !online_fp8(&fp8, Some("fp8")) && !online_fp8(&plain, None)
        );
        let e = check_flag(&plain, Some("awq")).unwrap_err().to_string();
        assert!(e.contains("quantizes at load for --quantization fp8 only, not awq"), "{e}");
        let e = check_flag(&fp8, Some("compressed-tensors")).unwrap_err().to_string();
        assert!(e.contains("quantized with fp8") && e.contains("give fp8"), "{e}");
        assert_eq!(check_arg(Some("fp8"), std::path::Path::new("m"), false), Ok(()));
        // vLLM's Marlin names serve their format's checkpoints.
        let gptq = serde_json::json!({"quantization_config": {"quant_method": "gptq", "bits": 4}});
        assert_eq!(check_flag(&gptq, Some("gptq_marlin")), Ok(()));
        assert_eq!(check_flag(&gptq, Some("gptq")), Ok(()));
        let e = check_flag(&gptq, Some("awq_marlin")).unwrap_err().to_string();
        assert!(e.contains("quantized with gptq") && e.contains("not --quantization awq_marlin"), "{e}");
    }
}
