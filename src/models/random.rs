//! `actorllm make-random-model`: writes a Hugging Face directory (config.json,
//! model.safetensors, tokenizer.json, tokenizer_config.json) of a known architecture's exact
//! shapes with small random weights, so that tests and GPU benchmarks need no real weights.
//! The tokenizer is byte-level BPE over the 256 bytes (no merges), padded to the vocabulary
//! with plain filler tokens, plus BOS/EOS.

use std::collections::HashMap;
use std::path::Path;

use half::{bf16, f16};
use serde_json::json;

use super::ModelError;
use crate::kernels::DType;

/// Architecture shapes a random model can take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Preset {
    /// A 2-layer model for fast tests (vocab 320).
    Tiny,
    #[value(name = "smollm2-135m")]
    Smollm2_135m,
    #[value(name = "llama-3-8b")]
    Llama3_8b,
    #[value(name = "qwen2-0.5b")]
    Qwen2_0_5b,
}

/// The hyper-parameters that shape the checkpoint.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub vocab: usize,
    pub max_pos: usize,
    pub rope_theta: f64,
    pub tied: bool,
    pub qkv_bias: bool,
}

impl Preset {
    pub fn shape(self) -> Shape {
        let base = Shape {
            hidden: 64,
            intermediate: 128,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            vocab: 320,
            max_pos: 2048,
            rope_theta: 10000.0,
            tied: false,
            qkv_bias: false,
        };
        match self {
            Preset::Tiny => base,
            Preset::Smollm2_135m => Shape {
                hidden: 576,
                intermediate: 1536,
                layers: 30,
                heads: 9,
                kv_heads: 3,
                vocab: 49152,
                max_pos: 8192,
                rope_theta: 100000.0,
                tied: true,
                qkv_bias: false,
            },
            Preset::Llama3_8b => Shape {
                hidden: 4096,
                intermediate: 14336,
                layers: 32,
                heads: 32,
                kv_heads: 8,
                vocab: 128256,
                max_pos: 8192,
                rope_theta: 500000.0,
                tied: false,
                qkv_bias: false,
            },
            Preset::Qwen2_0_5b => Shape {
                hidden: 896,
                intermediate: 4864,
                layers: 24,
                heads: 14,
                kv_heads: 2,
                vocab: 151936,
                max_pos: 32768,
                rope_theta: 1000000.0,
                tied: true,
                qkv_bias: true,
            },
        }
    }
}

/// GPT-2's byte → printable character table used by byte-level BPE.
pub fn bytes_to_unicode() -> Vec<char> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut table = vec!['\0'; 256];
    let mut extra = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            printable.push(b);
            table[b as usize] = char::from_u32(256 + extra).expect("valid code point");
            extra += 1;
        } else {
            table[b as usize] = char::from_u32(b).expect("valid code point");
        }
    }
    table
}

/// Deterministic small random numbers (xorshift), uniform in [-scale, scale].
struct Rng(u64);
impl Rng {
    fn next(&mut self, scale: f32) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
    }
}

fn encode(values: impl Iterator<Item = f32>, dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => values.flat_map(f32::to_le_bytes).collect(),
        DType::BF16 => values.flat_map(|v| bf16::from_f32(v).to_le_bytes()).collect(),
        DType::F16 => values.flat_map(|v| f16::from_f32(v).to_le_bytes()).collect(),
    }
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> ModelError + '_ {
    move |e| ModelError::io(path, e)
}

/// Writes the random model to `out`. `scale` sets the weights' magnitude (larger gives
/// peakier, more decisive next-token distributions).
pub fn make_random_model(
    shape: Shape,
    out: &Path,
    dtype: DType,
    seed: u64,
    scale: f32,
) -> Result<(), ModelError> {
    std::fs::create_dir_all(out).map_err(io(out))?;
    let hd = shape.hidden / shape.heads;
    let (bos, eos) = (shape.vocab - 2, shape.vocab - 1);
    let dtype_name = match dtype {
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
    };
    let config = json!({
        "architectures": [if shape.qkv_bias { "Qwen2ForCausalLM" } else { "LlamaForCausalLM" }],
        "model_type": if shape.qkv_bias { "qwen2" } else { "llama" },
        "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads, "head_dim": hd,
        "max_position_embeddings": shape.max_pos, "rms_norm_eps": 1e-5, "rope_theta": shape.rope_theta,
        "vocab_size": shape.vocab, "tie_word_embeddings": shape.tied, "hidden_act": "silu",
        "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": dtype_name,
    });
    let write = |name: &str, v: &serde_json::Value| {
        let p = out.join(name);
        std::fs::write(&p, serde_json::to_string_pretty(v).expect("JSON serializes")).map_err(io(&p))
    };
    write("config.json", &config)?;
    write("generation_config.json", &json!({"bos_token_id": bos, "eos_token_id": eos}))?;
    write_tokenizer(shape.vocab, out)?;

    let mut names: Vec<(String, Vec<usize>, bool)> = vec![
        ("model.embed_tokens.weight".into(), vec![shape.vocab, shape.hidden], false),
        ("model.norm.weight".into(), vec![shape.hidden], true),
    ];
    if !shape.tied {
        names.push(("lm_head.weight".into(), vec![shape.vocab, shape.hidden], false));
    }
    for l in 0..shape.layers {
        let p = format!("model.layers.{l}");
        let (q, kv) = (shape.heads * hd, shape.kv_heads * hd);
        names.push((format!("{p}.input_layernorm.weight"), vec![shape.hidden], true));
        names.push((format!("{p}.post_attention_layernorm.weight"), vec![shape.hidden], true));
        names.push((format!("{p}.self_attn.q_proj.weight"), vec![q, shape.hidden], false));
        names.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, shape.hidden], false));
        names.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, shape.hidden], false));
        names.push((format!("{p}.self_attn.o_proj.weight"), vec![shape.hidden, q], false));
        if shape.qkv_bias {
            names.push((format!("{p}.self_attn.q_proj.bias"), vec![q], false));
            names.push((format!("{p}.self_attn.k_proj.bias"), vec![kv], false));
            names.push((format!("{p}.self_attn.v_proj.bias"), vec![kv], false));
        }
        names.push((format!("{p}.mlp.gate_proj.weight"), vec![shape.intermediate, shape.hidden], false));
        names.push((format!("{p}.mlp.up_proj.weight"), vec![shape.intermediate, shape.hidden], false));
        names.push((format!("{p}.mlp.down_proj.weight"), vec![shape.hidden, shape.intermediate], false));
    }
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = names
        .into_iter()
        .map(|(name, shape, is_norm)| {
            let n: usize = shape.iter().product();
            let fan_in = *shape.last().unwrap_or(&1) as f32;
            let bytes = if is_norm {
                encode((0..n).map(|_| 1.0 + rng.next(0.1)), dtype)
            } else {
                let s = scale / fan_in.sqrt();
                encode((0..n).map(|_| rng.next(s)), dtype)
            };
            (name, shape, bytes)
        })
        .collect();
    let st_dtype = match dtype {
        DType::F32 => safetensors::Dtype::F32,
        DType::BF16 => safetensors::Dtype::BF16,
        DType::F16 => safetensors::Dtype::F16,
    };
    let views = tensors
        .iter()
        .map(|(n, s, b)| safetensors::tensor::TensorView::new(st_dtype, s.clone(), b).map(|v| (n.clone(), v)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ModelError::Weights(e.to_string()))?;
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    safetensors::tensor::serialize_to_file(views, &Some(meta), &out.join("model.safetensors"))
        .map_err(|e| ModelError::Weights(e.to_string()))
}

pub fn write_tokenizer(vocab_size: usize, out: &Path) -> Result<(), ModelError> {
    let table = bytes_to_unicode();
    let mut vocab = serde_json::Map::new();
    for (b, c) in table.iter().enumerate() {
        vocab.insert(c.to_string(), json!(b));
    }
    for id in 256..vocab_size - 2 {
        vocab.insert(format!("<t{id}>"), json!(id));
    }
    let (bos, eos) = ("<s>", "</s>");
    vocab.insert(bos.into(), json!(vocab_size - 2));
    vocab.insert(eos.into(), json!(vocab_size - 1));
    let special = |id: usize, content: &str| json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true});
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(vocab_size - 2, bos), special(vocab_size - 1, eos)],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []}
    });
    let template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
    let cfg = json!({"bos_token": bos, "eos_token": eos, "chat_template": template, "add_bos_token": false});
    for (name, v) in [("tokenizer.json", tokenizer), ("tokenizer_config.json", cfg)] {
        let p = out.join(name);
        std::fs::write(&p, serde_json::to_string(&v).expect("JSON serializes")).map_err(io(&p))?;
    }
    Ok(())
}

/// Writes a random PEFT LoRA adapter (every module the architecture declares, rank
/// `rank`) for a model of `cfg`'s shapes into `dir`: benchmarks of mixed-adapter batches
/// need nothing carried.
pub fn make_random_lora(
    cfg: &super::config::ModelConfig,
    dir: &Path,
    rank: usize,
    seed: u64,
) -> Result<(), ModelError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let names: Vec<&str> = cfg.lora_targets.iter().map(|t| t.name).collect();
    let config = json!({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": names,
        "use_rslora": false, "fan_in_fan_out": false, "bias": "none", "task_type": "CAUSAL_LM"});
    let p = dir.join("adapter_config.json");
    std::fs::write(&p, config.to_string()).map_err(io(&p))?;
    let mut rng = Rng(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1);
    let mut tensors = Vec::new();
    for layer in 0..cfg.num_layers {
        for t in &cfg.lora_targets {
            let (fin, fout) = (t.in_features, t.out_features);
            let base = format!("base_model.model.model.layers.{layer}.{}", t.path);
            let a = encode((0..rank * fin).map(|_| rng.next(0.05)), DType::F32);
            let b = encode((0..fout * rank).map(|_| rng.next(0.05)), DType::F32);
            tensors.push((format!("{base}.lora_A.weight"), vec![rank, fin], a));
            tensors.push((format!("{base}.lora_B.weight"), vec![fout, rank], b));
        }
    }
    let views = tensors
        .iter()
        .map(|(n, s, b)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                .map(|v| (n.clone(), v))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ModelError::Weights(e.to_string()))?;
    safetensors::tensor::serialize_to_file(views, &None, &dir.join("adapter_model.safetensors"))
        .map_err(|e| ModelError::Weights(e.to_string()))
}
