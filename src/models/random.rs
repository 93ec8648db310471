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
use crate::kernels::rows::{RowFormat, RowKind};

/// Llama-shaped presets (the tests' tiny model among them), as [`Shape`]s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// A 2-layer model for fast tests (vocab 320).
    Tiny,
    Smollm2_135m,
    Llama3_8b,
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
        DType::Quant(_) | DType::Rows(_) => unreachable!("random weights are floats, never {dtype:?}"),
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
    write_checkpoint(&preset_checkpoint(shape), out, dtype, seed, scale, true)
}

/// A Llama-shaped preset's config and tensors.
fn preset_checkpoint(shape: Shape) -> Checkpoint {
    let hd = shape.hidden / shape.heads;
    let config = json!({
        "architectures": [if shape.qkv_bias { "Qwen2ForCausalLM" } else { "LlamaForCausalLM" }],
        "model_type": if shape.qkv_bias { "qwen2" } else { "llama" },
        "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads, "head_dim": hd,
        "max_position_embeddings": shape.max_pos, "rms_norm_eps": 1e-5, "rope_theta": shape.rope_theta,
        "vocab_size": shape.vocab, "tie_word_embeddings": shape.tied, "hidden_act": "silu",
    });
    let l = LayerDims { hidden: shape.hidden, q: shape.heads * hd, kv: shape.kv_heads * hd, head_dim: hd };
    let mut tensors = embed_and_head(shape.vocab, shape.hidden, shape.tied);
    for i in 0..shape.layers {
        tensors.extend(llama_layer(
            i,
            l,
            shape.intermediate,
            LayerExtras { qkv_bias: shape.qkv_bias, ..Default::default() },
        ));
    }
    Checkpoint { config, vocab: shape.vocab, tensors }
}

/// How a random tensor is filled.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Init {
    /// Uniform in ±scale/√fan_in (the last dimension).
    Weight,
    /// 1 ± 0.1 (a norm's weight).
    Norm,
    /// ±0.02 (a bias).
    Bias,
}

/// A random checkpoint to write: config.json's own fields, and every tensor.
struct Checkpoint {
    config: serde_json::Value,
    vocab: usize,
    tensors: Vec<(String, Vec<usize>, Init)>,
}

/// The widths of one attention layer.
#[derive(Debug, Clone, Copy)]
struct LayerDims {
    hidden: usize,
    q: usize,
    kv: usize,
    head_dim: usize,
}

/// What a Llama-shaped layer adds to Llama's tensors.
#[derive(Debug, Clone, Copy, Default)]
struct LayerExtras {
    qkv_bias: bool,
    qk_norm: bool,
    /// Gemma 2's norms around the MLP.
    feedforward_norms: bool,
    /// Phi-3's fused qkv and gate/up.
    fused: bool,
    /// An expert block in place of the MLP.
    experts: Option<Experts>,
}

/// A random model's expert blocks: its block's name, its experts' projections' names, how
/// many, and each one's intermediate size.
#[derive(Debug, Clone, Copy)]
struct Experts {
    block: &'static str,
    names: [&'static str; 3],
    count: usize,
    inter: usize,
}

const MIXTRAL_EXPERTS: Experts =
    Experts { block: "block_sparse_moe", names: ["w1", "w3", "w2"], count: 8, inter: 14336 };
const QWEN3_MOE_EXPERTS: Experts =
    Experts { block: "mlp", names: ["gate_proj", "up_proj", "down_proj"], count: 128, inter: 768 };

fn embed_and_head(vocab: usize, hidden: usize, tied: bool) -> Vec<(String, Vec<usize>, Init)> {
    let mut t = vec![
        ("model.embed_tokens.weight".into(), vec![vocab, hidden], Init::Weight),
        ("model.norm.weight".into(), vec![hidden], Init::Norm),
    ];
    if !tied {
        t.push(("lm_head.weight".into(), vec![vocab, hidden], Init::Weight));
    }
    t
}

fn llama_layer(i: usize, d: LayerDims, inter: usize, x: LayerExtras) -> Vec<(String, Vec<usize>, Init)> {
    let p = format!("model.layers.{i}");
    let h = d.hidden;
    let mut t = vec![
        (format!("{p}.input_layernorm.weight"), vec![h], Init::Norm),
        (format!("{p}.post_attention_layernorm.weight"), vec![h], Init::Norm),
        (format!("{p}.self_attn.o_proj.weight"), vec![h, d.q], Init::Weight),
    ];
    if let Some(e) = x.experts {
        let b = format!("{p}.{}", e.block);
        t.push((format!("{b}.gate.weight"), vec![e.count, h], Init::Weight));
        for i in 0..e.count {
            let [gate, up, down] = e.names;
            t.push((format!("{b}.experts.{i}.{gate}.weight"), vec![e.inter, h], Init::Weight));
            t.push((format!("{b}.experts.{i}.{up}.weight"), vec![e.inter, h], Init::Weight));
            t.push((format!("{b}.experts.{i}.{down}.weight"), vec![h, e.inter], Init::Weight));
        }
    } else {
        t.push((format!("{p}.mlp.down_proj.weight"), vec![h, inter], Init::Weight));
    }
    if x.fused {
        t.push((format!("{p}.self_attn.qkv_proj.weight"), vec![d.q + 2 * d.kv, h], Init::Weight));
        t.push((format!("{p}.mlp.gate_up_proj.weight"), vec![2 * inter, h], Init::Weight));
    } else {
        for (name, rows) in [("q_proj", d.q), ("k_proj", d.kv), ("v_proj", d.kv)] {
            t.push((format!("{p}.self_attn.{name}.weight"), vec![rows, h], Init::Weight));
            if x.qkv_bias {
                t.push((format!("{p}.self_attn.{name}.bias"), vec![rows], Init::Bias));
            }
        }
        if x.experts.is_none() {
            t.push((format!("{p}.mlp.gate_proj.weight"), vec![inter, h], Init::Weight));
            t.push((format!("{p}.mlp.up_proj.weight"), vec![inter, h], Init::Weight));
        }
    }
    if x.qk_norm {
        t.push((format!("{p}.self_attn.q_norm.weight"), vec![d.head_dim], Init::Norm));
        t.push((format!("{p}.self_attn.k_norm.weight"), vec![d.head_dim], Init::Norm));
    }
    if x.feedforward_norms {
        t.push((format!("{p}.pre_feedforward_layernorm.weight"), vec![h], Init::Norm));
        t.push((format!("{p}.post_feedforward_layernorm.weight"), vec![h], Init::Norm));
    }
    t
}

/// Writes `c` to `out`: config.json (with its vocabulary's BOS and EOS and the dtype),
/// generation_config.json, the byte-level tokenizer and, with `weights`, model.safetensors
/// (without, the directory serves with `--load-format dummy`).
fn write_checkpoint(
    c: &Checkpoint,
    out: &Path,
    dtype: DType,
    seed: u64,
    scale: f32,
    weights: bool,
) -> Result<(), ModelError> {
    std::fs::create_dir_all(out).map_err(io(out))?;
    let (bos, eos) = (c.vocab - 2, c.vocab - 1);
    let dtype_name = match dtype {
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::Quant(_) | DType::Rows(_) => unreachable!("random models are floats, never {dtype:?}"),
    };
    let mut config = c.config.clone();
    config["bos_token_id"] = json!(bos);
    config["eos_token_id"] = json!(eos);
    config["torch_dtype"] = json!(dtype_name);
    let write = |name: &str, v: &serde_json::Value| {
        let p = out.join(name);
        std::fs::write(&p, serde_json::to_string_pretty(v).expect("JSON serializes")).map_err(io(&p))
    };
    write("config.json", &config)?;
    write("generation_config.json", &json!({"bos_token_id": bos, "eos_token_id": eos}))?;
    write_tokenizer(c.vocab, out)?;
    if !weights {
        return Ok(());
    }
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let tensors: Vec<(&String, &Vec<usize>, Vec<u8>)> = c
        .tensors
        .iter()
        .map(|(name, shape, init)| {
            let n: usize = shape.iter().product();
            let fan_in = *shape.last().unwrap_or(&1) as f32;
            let bytes = match init {
                Init::Norm => encode((0..n).map(|_| 1.0 + rng.next(0.1)), dtype),
                Init::Bias => encode((0..n).map(|_| rng.next(0.02)), dtype),
                Init::Weight => {
                    let s = scale / fan_in.sqrt();
                    encode((0..n).map(|_| rng.next(s)), dtype)
                }
            };
            (name, shape, bytes)
        })
        .collect();
    let st_dtype = match dtype {
        DType::F32 => safetensors::Dtype::F32,
        DType::BF16 => safetensors::Dtype::BF16,
        DType::F16 => safetensors::Dtype::F16,
        DType::Quant(_) | DType::Rows(_) => unreachable!("random models are floats, never {dtype:?}"),
    };
    let views = tensors
        .iter()
        .map(|(n, s, b)| {
            safetensors::tensor::TensorView::new(st_dtype, s.to_vec(), b).map(|v| (n.to_string(), v))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ModelError::Weights(e.to_string()))?;
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    safetensors::tensor::serialize_to_file(views, &Some(meta), &out.join("model.safetensors"))
        .map_err(|e| ModelError::Weights(e.to_string()))
}

/// The real shapes of the families beyond Llama's presets (random weights).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama3_1_8b,
    Mistral7b,
    Qwen3_8b,
    Gemma2_9b,
    Gemma3_4b,
    Phi3Mini,
    Opt1_3b,
    Mixtral8x7b,
    Qwen3_30bA3b,
}

/// `make-random-model --like`: every shape a random model can take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Like {
    Tiny,
    #[value(name = "smollm2-135m")]
    Smollm2_135m,
    #[value(name = "llama-3-8b")]
    Llama3_8b,
    #[value(name = "qwen2-0.5b")]
    Qwen2_0_5b,
    #[value(name = "llama-3.1-8b")]
    Llama3_1_8b,
    #[value(name = "mistral-7b")]
    Mistral7b,
    #[value(name = "qwen3-8b")]
    Qwen3_8b,
    #[value(name = "gemma-2-9b")]
    Gemma2_9b,
    #[value(name = "gemma-3-4b")]
    Gemma3_4b,
    #[value(name = "phi-3-mini")]
    Phi3Mini,
    #[value(name = "opt-1.3b")]
    Opt1_3b,
    #[value(name = "mixtral-8x7b")]
    Mixtral8x7b,
    #[value(name = "qwen3-30b-a3b")]
    Qwen3_30bA3b,
}

impl Like {
    /// Writes the model to `out`: with `weights`, its checkpoint too (else it serves with
    /// `--load-format dummy`).
    pub fn write(self, out: &Path, dtype: DType, seed: u64, weights: bool) -> Result<(), ModelError> {
        let llama =
            |p: Preset| write_checkpoint(&preset_checkpoint(p.shape()), out, dtype, seed, 1.0, weights);
        let family = |f: Family| write_checkpoint(&f.checkpoint(), out, dtype, seed, 1.0, weights);
        match self {
            Like::Tiny => llama(Preset::Tiny),
            Like::Smollm2_135m => llama(Preset::Smollm2_135m),
            Like::Llama3_8b => llama(Preset::Llama3_8b),
            Like::Qwen2_0_5b => llama(Preset::Qwen2_0_5b),
            Like::Llama3_1_8b => family(Family::Llama3_1_8b),
            Like::Mistral7b => family(Family::Mistral7b),
            Like::Qwen3_8b => family(Family::Qwen3_8b),
            Like::Gemma2_9b => family(Family::Gemma2_9b),
            Like::Gemma3_4b => family(Family::Gemma3_4b),
            Like::Phi3Mini => family(Family::Phi3Mini),
            Like::Opt1_3b => family(Family::Opt1_3b),
            Like::Mixtral8x7b => family(Family::Mixtral8x7b),
            Like::Qwen3_30bA3b => family(Family::Qwen3_30bA3b),
        }
    }
}

impl Family {
    fn checkpoint(self) -> Checkpoint {
        match self {
            Family::Opt1_3b => opt_checkpoint(),
            _ => self.llama_shaped(),
        }
    }

    /// (config, layers, heads, kv heads, head_dim, hidden, intermediate, vocab, tied, extras).
    fn llama_shaped(self) -> Checkpoint {
        let (arch, layers, heads, kv, hd, h, inter, vocab, tied, x) = match self {
            Family::Llama3_1_8b => {
                ("LlamaForCausalLM", 32, 32, 8, 128, 4096, 14336, 128256, false, LayerExtras::default())
            }
            Family::Mistral7b => {
                ("MistralForCausalLM", 32, 32, 8, 128, 4096, 14336, 32000, false, LayerExtras::default())
            }
            Family::Qwen3_8b => {
                let x = LayerExtras { qk_norm: true, ..Default::default() };
                ("Qwen3ForCausalLM", 36, 32, 8, 128, 4096, 12288, 151936, false, x)
            }
            Family::Gemma2_9b => {
                let x = LayerExtras { feedforward_norms: true, ..Default::default() };
                ("Gemma2ForCausalLM", 42, 16, 8, 256, 3584, 14336, 256000, true, x)
            }
            Family::Gemma3_4b => {
                let x = LayerExtras { feedforward_norms: true, qk_norm: true, ..Default::default() };
                ("Gemma3ForCausalLM", 34, 8, 4, 256, 2560, 10240, 262208, true, x)
            }
            Family::Phi3Mini => {
                let x = LayerExtras { fused: true, ..Default::default() };
                ("Phi3ForCausalLM", 32, 32, 32, 96, 3072, 8192, 32064, false, x)
            }
            Family::Mixtral8x7b => {
                let x = LayerExtras { experts: Some(MIXTRAL_EXPERTS), ..Default::default() };
                ("MixtralForCausalLM", 32, 32, 8, 128, 4096, 14336, 32000, false, x)
            }
            Family::Qwen3_30bA3b => {
                let x = LayerExtras { qk_norm: true, experts: Some(QWEN3_MOE_EXPERTS), ..Default::default() };
                ("Qwen3MoeForCausalLM", 48, 32, 4, 128, 2048, 6144, 151936, false, x)
            }
            Family::Opt1_3b => unreachable!("OPT is not Llama-shaped"),
        };
        let mut config = json!({
            "architectures": [arch], "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd, "vocab_size": vocab,
            "tie_word_embeddings": tied, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        });
        let extra = match self {
            Family::Llama3_1_8b => json!({"max_position_embeddings": 131072, "rope_theta": 500000.0,
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}),
            Family::Mistral7b => {
                json!({"max_position_embeddings": 32768, "rope_theta": 10000.0, "sliding_window": 4096})
            }
            Family::Qwen3_8b => json!({"max_position_embeddings": 40960, "rope_theta": 1000000.0}),
            Family::Gemma2_9b => json!({"max_position_embeddings": 8192, "rope_theta": 10000.0,
                "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 4096, "query_pre_attn_scalar": 256,
                "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
            Family::Gemma3_4b => json!({"max_position_embeddings": 131072, "rope_theta": 1000000.0,
                "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 1024, "sliding_window_pattern": 6,
                "query_pre_attn_scalar": 256}),
            Family::Phi3Mini => {
                json!({"max_position_embeddings": 4096, "rope_theta": 10000.0, "sliding_window": 2047})
            }
            Family::Mixtral8x7b => json!({"max_position_embeddings": 32768, "rope_theta": 1000000.0,
                "num_local_experts": 8, "num_experts_per_tok": 2}),
            Family::Qwen3_30bA3b => json!({"max_position_embeddings": 40960, "rope_theta": 1000000.0,
                "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": []}),
            Family::Opt1_3b => json!({}),
        };
        for (k, v) in extra.as_object().into_iter().flatten() {
            config[k] = v.clone();
        }
        let d = LayerDims { hidden: h, q: heads * hd, kv: kv * hd, head_dim: hd };
        let mut tensors = embed_and_head(vocab, h, tied);
        for i in 0..layers {
            tensors.extend(llama_layer(i, d, inter, x));
        }
        Checkpoint { config, vocab, tensors }
    }
}

/// OPT-1.3b: LayerNorms with bias, learned positions, a ReLU MLP, all projections biased.
fn opt_checkpoint() -> Checkpoint {
    let (layers, h, ffn, vocab, max_pos) = (24, 2048, 8192, 50272, 2048);
    let config = json!({
        "architectures": ["OPTForCausalLM"], "hidden_size": h, "ffn_dim": ffn, "num_hidden_layers": layers,
        "num_attention_heads": 32, "vocab_size": vocab, "max_position_embeddings": max_pos,
        "word_embed_proj_dim": h, "do_layer_norm_before": true, "activation_function": "relu",
        "enable_bias": true, "tie_word_embeddings": true,
    });
    let p = "model.decoder";
    let mut t = vec![
        (format!("{p}.embed_tokens.weight"), vec![vocab, h], Init::Weight),
        (format!("{p}.embed_positions.weight"), vec![max_pos + 2, h], Init::Weight),
        (format!("{p}.final_layer_norm.weight"), vec![h], Init::Norm),
        (format!("{p}.final_layer_norm.bias"), vec![h], Init::Bias),
    ];
    for i in 0..layers {
        let l = format!("{p}.layers.{i}");
        for (name, shape) in [
            ("self_attn.q_proj", vec![h, h]),
            ("self_attn.k_proj", vec![h, h]),
            ("self_attn.v_proj", vec![h, h]),
            ("self_attn.out_proj", vec![h, h]),
            ("fc1", vec![ffn, h]),
            ("fc2", vec![h, ffn]),
        ] {
            t.push((format!("{l}.{name}.bias"), vec![shape[0]], Init::Bias));
            t.push((format!("{l}.{name}.weight"), shape, Init::Weight));
        }
        for norm in ["self_attn_layer_norm", "final_layer_norm"] {
            t.push((format!("{l}.{norm}.weight"), vec![h], Init::Norm));
            t.push((format!("{l}.{norm}.bias"), vec![h], Init::Bias));
        }
    }
    Checkpoint { config, vocab, tensors: t }
}

/// Writes a random model of `family`'s real shapes to `out`.
pub fn make_random_family(family: Family, out: &Path, dtype: DType, seed: u64) -> Result<(), ModelError> {
    write_checkpoint(&family.checkpoint(), out, dtype, seed, 1.0, true)
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

/// The weights of scripts/make_model_goldens.py's tiny models, rebuilt bit for bit: each
/// parameter's values come from splitmix64 of (FNV-1a of its name + index · golden ratio),
/// 24 bits each, scaled by the parameter's kind. With a golden file (its config, parameter
/// list and embedding scale), tests write the model transformers ran, without committed
/// weights: config.json, model.safetensors (f32, with the FP8 KV cache scales the file
/// names, if any) and a byte tokenizer.
pub fn write_golden_model(golden: &serde_json::Value, dir: &Path) -> Result<(), ModelError> {
    let bad = |what: &str| ModelError::Config(format!("golden file: {what}"));
    let p = dir.join("config.json");
    std::fs::write(&p, golden["config"].to_string()).map_err(io(&p))?;
    let embed_scale = golden["embed_scale"].as_f64().unwrap_or(1.0);
    let mut tensors = Vec::new();
    for param in golden["params"].as_array().ok_or_else(|| bad("no params"))? {
        let name = param[0].as_str().ok_or_else(|| bad("a parameter without a name"))?.to_string();
        let shape: Vec<usize> = param[1]
            .as_array()
            .ok_or_else(|| bad("a parameter without a shape"))?
            .iter()
            .map(|d| d.as_u64().map(|d| d as usize).ok_or_else(|| bad("a shape of non-integers")))
            .collect::<Result<_, _>>()?;
        let bytes = encode(golden_values(&name, &shape, embed_scale).into_iter(), DType::F32);
        tensors.push((name, shape, bytes));
    }
    // An FP8 KV cache's scales, where the file gives them: one value a tensor.
    for (name, x) in golden["kv_scales"].as_object().into_iter().flatten() {
        let x = x.as_f64().ok_or_else(|| bad("a KV cache scale that is not a number"))? as f32;
        tensors.push((name.clone(), Vec::new(), x.to_le_bytes().to_vec()));
    }
    let views = tensors
        .iter()
        .map(|(n, s, b)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                .map(|v| (n.clone(), v))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ModelError::Weights(e.to_string()))?;
    safetensors::tensor::serialize_to_file(views, &None, &dir.join("model.safetensors"))
        .map_err(|e| ModelError::Weights(e.to_string()))?;
    let vocab = golden["config"]["vocab_size"].as_u64().ok_or_else(|| bad("no vocab_size"))? as usize;
    write_tokenizer(vocab, dir)
}

/// A parameter of a checkpoint-less load (`--load-format dummy`), in `dtype`: the golden
/// generator's values for its name, kind and shape (embeddings in ±1), made in parallel.
pub fn param_bytes(name: &str, shape: &[usize], dtype: DType) -> Vec<u8> {
    use rayon::prelude::*;
    let n: usize = shape.iter().product();
    let size = dtype.size();
    let mut out = vec![0u8; n * size];
    const CHUNK: usize = 1 << 16;
    out.par_chunks_mut(CHUNK * size).enumerate().for_each(|(c, bytes)| {
        let first = (c * CHUNK) as u64;
        let values = golden_range(name, shape, 1.0, first..first + (bytes.len() / size) as u64);
        bytes.copy_from_slice(&encode(values.into_iter(), dtype));
    });
    out
}

/// A projection of a checkpoint-less load of a quantized checkpoint's config:
/// [`param_bytes`]' values quantized in `format`'s rows (4-bit: zero point 8, each group's
/// largest magnitude at ±7; FP8: each group's largest magnitude at 448, the nearest e4m3
/// value), rows made in parallel.
pub fn rows_param_bytes(name: &str, shape: &[usize], format: RowFormat) -> Vec<u8> {
    use rayon::prelude::*;
    let k = shape[1];
    let (groups, row_bytes) = (format.groups(), format.row_bytes());
    let mut out = vec![0u8; shape[0] * row_bytes];
    out.par_chunks_mut(row_bytes).enumerate().for_each(|(r, row)| {
        let first = (r * k) as u64;
        let values = golden_range(name, shape, 1.0, first..first + k as u64);
        let size = k / groups;
        let top = match format.kind {
            RowKind::Int4 => 7.0,
            RowKind::Fp8 => 448.0,
        };
        let scales: Vec<f32> = values
            .chunks(size)
            .map(|g| {
                let s = g.iter().fold(0f32, |a, v| a.max(v.abs())) / top;
                if format.kind == RowKind::Int4 { format.round(s) } else { s }
            })
            .collect();
        let scaled = |i: usize| if scales[i / size] == 0.0 { 0.0 } else { values[i] / scales[i / size] };
        let mut bytes = Vec::with_capacity(row_bytes);
        match format.kind {
            RowKind::Int4 => {
                let q: Vec<u8> = (0..k).map(|i| (scaled(i).round() + 8.0).clamp(0.0, 15.0) as u8).collect();
                format.push_int4_row(&q, &vec![8; groups], &scales, &mut bytes);
            }
            RowKind::Fp8 => {
                let q: Vec<u8> = (0..k).map(|i| crate::kernels::e4m3::encode(scaled(i))).collect();
                format.push_fp8_row(&q, &scales, &mut bytes);
            }
        }
        row.copy_from_slice(&bytes);
    });
    out
}

/// One golden parameter's values by its kind, as the script computes them in float32.
fn golden_values(name: &str, shape: &[usize], embed_scale: f64) -> Vec<f32> {
    let n: usize = shape.iter().product();
    golden_range(name, shape, embed_scale, 0..n as u64)
}

/// Values `range` of [`golden_values`].
fn golden_range(name: &str, shape: &[usize], embed_scale: f64, range: std::ops::Range<u64>) -> Vec<f32> {
    let fnv = name
        .bytes()
        .fold(0xCBF2_9CE4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3));
    let uniform = |i: u64| {
        let mut z = fnv.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u32 << 24) as f32
    };
    let leaf = name.rsplit_once('.').map_or(name, |p| p.0);
    let leaf = leaf.rsplit_once('.').map_or(leaf, |p| p.1);
    let (offset, scale) = if name.ends_with(".bias") {
        (0.0, 0.2f32)
    } else if leaf.contains("norm") {
        (1.0, 0.2)
    } else if leaf.contains("embed") {
        (0.0, (2.0 * embed_scale) as f32)
    } else {
        (0.0, (2.0 * (3.0 / shape[shape.len() - 1] as f64).sqrt()) as f32)
    };
    range
        .map(|i| {
            let u = uniform(i) - 0.5;
            if offset == 0.0 { u * scale } else { offset + u * scale }
        })
        .collect()
}
