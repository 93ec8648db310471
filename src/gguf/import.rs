//! `actorllm import-gguf`: turns a llama.cpp GGUF file of a Llama (Mistral), Qwen2 or Gemma
//! model into a standard Hugging Face model directory (config.json, model.safetensors,
//! tokenizer.json, tokenizer_config.json, generation_config.json).
//!
//! What llama.cpp's converter changes on the way in is undone here: tensor names
//! (`blk.N.attn_q` → `model.layers.N.self_attn.q_proj`), the row permutation of a Llama's
//! q/k projections for its interleaved RoPE (HF uses rotate-half; Qwen2 and Gemma are not
//! permuted), and Gemma's RMSNorm weights, which it stores plus one.
//!
//! With `--keep-quantized`, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K matrices are written as they are: safetensors
//! bytes `[rows, row bytes]`, their format named in the file's metadata
//! (`models::loader::quant_key`), for the CPU's quantized kernels.

use std::collections::BTreeMap;
use std::path::Path;

use half::bf16;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Value as Json, json};

use super::{GgufError, GgufFile};

#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("architecture {0:?} is not supported by import-gguf (supported: llama, qwen2, gemma)")]
    Architecture(String),
    #[error(
        "tokenizer model {0:?} is not supported (supported: gpt2's byte-level BPE, llama's SentencePiece)"
    )]
    TokenizerModel(String),
    #[error(
        "pre-tokenizer {0:?} is unknown (known: smollm, starcoder, refact, gpt2, default, llama-bpe, qwen2)"
    )]
    PreTokenizer(String),
    #[error("tensor {name} has shape {got:?}, expected {expected:?}")]
    Shape { name: String, expected: Vec<usize>, got: Vec<usize> },
    #[error("cannot write {path}: {source}")]
    Write { path: String, source: std::io::Error },
    #[error("writing safetensors: {0}")]
    Safetensors(#[from] safetensors::SafeTensorError),
    #[error("the tokenizer built from the GGUF vocabulary does not load: {0}")]
    Tokenizer(String),
}

/// How `import-gguf` writes the weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImportOptions {
    /// The dtype of dequantized weights.
    pub dtype: ImportDtype,
    /// Linear weights in the formats the CPU multiplies directly (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) stay in
    /// their blocks (safetensors bytes, their format in the file's metadata).
    pub keep_quantized: bool,
}

/// Output dtype of the dequantized weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ImportDtype {
    #[value(name = "f32", alias = "float32")]
    F32,
    #[value(name = "bf16", alias = "bfloat16")]
    Bf16,
}

/// An architecture import-gguf reads: its GGUF name (the prefix of its metadata keys), its
/// transformers class, and what llama.cpp's converter did to its tensors.
pub(super) struct Arch {
    gguf: &'static str,
    class: &'static str,
    model_type: &'static str,
    hidden_act: &'static str,
    /// q/k rows permuted for interleaved RoPE.
    permuted_qk: bool,
    /// RMSNorm weights stored plus one (Gemma's `1 + w`).
    norm_plus_one: bool,
}

const ARCHS: [Arch; 3] = [
    Arch {
        gguf: "llama",
        class: "LlamaForCausalLM",
        model_type: "llama",
        hidden_act: "silu",
        permuted_qk: true,
        norm_plus_one: false,
    },
    Arch {
        gguf: "qwen2",
        class: "Qwen2ForCausalLM",
        model_type: "qwen2",
        hidden_act: "silu",
        permuted_qk: false,
        norm_plus_one: false,
    },
    Arch {
        gguf: "gemma",
        class: "GemmaForCausalLM",
        model_type: "gemma",
        hidden_act: "gelu_pytorch_tanh",
        permuted_qk: false,
        norm_plus_one: true,
    },
];

/// Hyper-parameters read from the `ARCH.*` metadata keys.
struct LlamaMeta {
    arch: &'static Arch,
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    ffn: usize,
    vocab: usize,
    ctx: usize,
    theta: f64,
    eps: f32,
    /// `ARCH.attention.key_length`, where the file gives it (Gemma's 256 with 3,072 / 16).
    head_dim: Option<usize>,
}

impl LlamaMeta {
    fn read(g: &GgufFile, arch: &'static Arch, vocab: usize) -> Result<Self, GgufError> {
        let p = arch.gguf;
        let u = |k: &str| g.get_u64(&format!("{p}.{k}")).map(|v| v as usize);
        let heads = u("attention.head_count")?;
        let m = Self {
            arch,
            hidden: u("embedding_length")?,
            layers: u("block_count")?,
            heads,
            kv_heads: u("attention.head_count_kv").unwrap_or(heads),
            ffn: u("feed_forward_length")?,
            vocab: u("vocab_size").unwrap_or(vocab),
            ctx: u("context_length")?,
            theta: g.get_f64(&format!("{p}.rope.freq_base")).unwrap_or(10000.0),
            eps: g.get_f64(&format!("{p}.attention.layer_norm_rms_epsilon"))? as f32,
            head_dim: u("attention.key_length").ok().filter(|&d| d > 0),
        };
        let bad = |m: String| Err(GgufError::Malformed(m));
        for (key, v) in [
            ("embedding_length", m.hidden),
            ("block_count", m.layers),
            ("attention.head_count", m.heads),
            ("attention.head_count_kv", m.kv_heads),
            ("feed_forward_length", m.ffn),
            ("vocab_size", m.vocab),
            ("context_length", m.ctx),
        ] {
            if v == 0 {
                return bad(format!("{p}.{key} is 0"));
            }
        }
        if (m.head_dim.is_none() && !m.hidden.is_multiple_of(m.heads)) || !m.heads.is_multiple_of(m.kv_heads)
        {
            return bad(format!(
                "{p}.embedding_length {} and the head counts {} / {} do not divide",
                m.hidden, m.heads, m.kv_heads
            ));
        }
        if !(m.theta.is_finite() && m.theta > 0.0 && m.eps.is_finite() && m.eps > 0.0) {
            return bad(format!(
                "{p}.rope.freq_base {} and {p}.attention.layer_norm_rms_epsilon {} must be positive",
                m.theta, m.eps
            ));
        }
        Ok(m)
    }
    fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden / self.heads)
    }
}

/// Maps a GGUF tensor name to its HF name and, for q/k, the head count of the permutation.
fn hf_name(name: &str, m: &LlamaMeta) -> Option<(String, Option<usize>)> {
    let fixed = match name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some((f.to_string(), None));
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, leaf) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let heads = |n: usize| Some(n).filter(|_| m.arch.permuted_qk);
    let (hf, permute) = match leaf {
        "attn_norm.weight" => ("input_layernorm.weight", None),
        "ffn_norm.weight" => ("post_attention_layernorm.weight", None),
        "attn_q.weight" => ("self_attn.q_proj.weight", heads(m.heads)),
        "attn_k.weight" => ("self_attn.k_proj.weight", heads(m.kv_heads)),
        "attn_v.weight" => ("self_attn.v_proj.weight", None),
        "attn_output.weight" => ("self_attn.o_proj.weight", None),
        "attn_q.bias" => ("self_attn.q_proj.bias", heads(m.heads)),
        "attn_k.bias" => ("self_attn.k_proj.bias", heads(m.kv_heads)),
        "attn_v.bias" => ("self_attn.v_proj.bias", None),
        "ffn_gate.weight" => ("mlp.gate_proj.weight", None),
        "ffn_up.weight" => ("mlp.up_proj.weight", None),
        "ffn_down.weight" => ("mlp.down_proj.weight", None),
        _ => return None,
    };
    Some((format!("model.layers.{layer}.{hf}"), permute))
}

/// Undoes llama.cpp's q/k row permutation: GGUF row `h·d + 2i + j` holds HF row
/// `h·d + j·d/2 + i` (d = head_dim, i < d/2, j ∈ {0, 1}).
fn unpermute_rows<T: Copy + Default>(w: &[T], rows: usize, n_head: usize) -> Vec<T> {
    let cols = w.len() / rows;
    let hd = rows / n_head;
    let mut out = vec![T::default(); w.len()];
    for h in 0..n_head {
        for i in 0..hd / 2 {
            for j in 0..2 {
                let src = h * hd + 2 * i + j;
                let dst = h * hd + j * (hd / 2) + i;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

#[cfg(test)]
pub(super) fn unpermute_rows_for_test(w: &[f32], rows: usize, n_head: usize) -> Vec<f32> {
    unpermute_rows(w, rows, n_head)
}

pub(super) fn write_json(dir: &Path, name: &str, v: &Json) -> Result<(), ImportError> {
    let path = dir.join(name);
    let text = serde_json::to_string_pretty(v).expect("JSON values always serialize");
    std::fs::write(&path, text + "\n")
        .map_err(|source| ImportError::Write { path: path.display().to_string(), source })
}

/// Imports `gguf` into the directory `out` (created if missing).
pub fn import_gguf(gguf: &Path, out: &Path, options: ImportOptions) -> Result<(), ImportError> {
    let dtype = options.dtype;
    let g = GgufFile::open(gguf)?;
    let name = g.get_str("general.architecture")?;
    let arch =
        ARCHS.iter().find(|a| a.gguf == name).ok_or_else(|| ImportError::Architecture(name.to_string()))?;
    std::fs::create_dir_all(out)
        .map_err(|source| ImportError::Write { path: out.display().to_string(), source })?;
    let tokens = string_array(&g, "tokenizer.ggml.tokens")?;
    let meta = LlamaMeta::read(&g, arch, tokens.len())?;
    let tied = g.tensor("output.weight").is_none();

    super::tokenizer::write_tokenizer(&g, &tokens, out)?;
    let special = |k: &str| g.get_u64(k).ok();
    let (bos, eos) = (special("tokenizer.ggml.bos_token_id"), special("tokenizer.ggml.eos_token_id"));
    let pad = special("tokenizer.ggml.padding_token_id");
    let config = json!({
        "architectures": [arch.class],
        "model_type": arch.model_type,
        "hidden_size": meta.hidden,
        "intermediate_size": meta.ffn,
        "num_hidden_layers": meta.layers,
        "num_attention_heads": meta.heads,
        "num_key_value_heads": meta.kv_heads,
        "head_dim": meta.head_dim(),
        "max_position_embeddings": meta.ctx,
        "rms_norm_eps": meta.eps,
        "rope_theta": meta.theta,
        "vocab_size": meta.vocab,
        "hidden_act": arch.hidden_act,
        "tie_word_embeddings": tied,
        "attention_bias": g.tensor("blk.0.attn_q.bias").is_some(),
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": match dtype { ImportDtype::F32 => "float32", ImportDtype::Bf16 => "bfloat16" },
    });
    write_json(out, "config.json", &config)?;
    write_json(
        out,
        "generation_config.json",
        &json!({ "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad }),
    )?;
    write_weights(&g, &meta, out, options)
}

/// Whether `--model` names a GGUF file (served by importing it, `imported`).
pub fn is_gguf_file(model: &Path) -> bool {
    model.is_file() && model.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// The model directory a GGUF file imports to, importing it the first time: under `root`
/// (`hub::import_cache`), one directory per file path, size, modification time, dtype and
/// the formats kept, so that a changed file is imported again and an unchanged one never
/// is. The import goes to a directory of this process's own, renamed into place when whole:
/// a server started beside this one either finds the finished directory or imports its own.
pub fn imported(gguf: &Path, root: &Path, options: ImportOptions) -> Result<std::path::PathBuf, ImportError> {
    use std::hash::{Hash, Hasher};
    let meta = std::fs::metadata(gguf)
        .map_err(|source| ImportError::Gguf(GgufError::Io { path: gguf.display().to_string(), source }))?;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::fs::canonicalize(gguf).unwrap_or_else(|_| gguf.to_path_buf()).hash(&mut h);
    meta.len().hash(&mut h);
    meta.modified().ok().hash(&mut h);
    (options.dtype as u8).hash(&mut h);
    options.keep_quantized.hash(&mut h);
    if options.keep_quantized {
        // A build that keeps more formats imports again rather than serve them dequantized.
        crate::kernels::quant::QuantFormat::ALL.hash(&mut h);
    }
    let stem = gguf.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let dir = root.join(format!("{stem}-{:016x}", h.finish()));
    if dir.join("config.json").is_file() {
        tracing::info!(gguf = %gguf.display(), dir = %dir.display(), "serving the GGUF file's earlier import");
        return Ok(dir);
    }
    let part = root.join(format!(".{stem}.partial-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&part);
    tracing::info!(gguf = %gguf.display(), dir = %dir.display(), "importing the GGUF file (once: later starts reuse it)");
    let done = import_gguf(gguf, &part, options).and_then(|()| {
        std::fs::rename(&part, &dir).or_else(|e| match dir.join("config.json").is_file() {
            // Another process finished the same import first.
            true => Ok(()),
            false => Err(ImportError::Write { path: dir.display().to_string(), source: e }),
        })
    });
    let _ = std::fs::remove_dir_all(&part);
    done.map(|()| dir)
}

pub(super) fn string_array(g: &GgufFile, key: &str) -> Result<Vec<String>, GgufError> {
    let arr = g.get(key)?.as_array().ok_or_else(|| GgufError::Malformed(format!("{key} is not an array")))?;
    arr.iter()
        .map(|v| {
            v.as_str()
                .map(str::to_string)
                .ok_or_else(|| GgufError::Malformed(format!("{key} holds a non-string")))
        })
        .collect()
}

fn write_weights(
    g: &GgufFile,
    meta: &LlamaMeta,
    out: &Path,
    options: ImportOptions,
) -> Result<(), ImportError> {
    let bar = ProgressBar::new(g.tensors.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("importing {bar:40} {pos}/{len} tensors {msg}")
            .expect("static progress template is valid"),
    );
    let mut tensors: BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)> = BTreeMap::new();
    let mut info = std::collections::HashMap::new();
    info.insert("format".to_string(), "pt".to_string());
    let mut dequantized = BTreeMap::<String, usize>::new();
    for t in &g.tensors {
        bar.set_message(t.name.clone());
        bar.inc(1);
        let Some((name, permute)) = hf_name(&t.name, meta) else {
            tracing::warn!(tensor = %t.name, "skipping tensor with no Hugging Face counterpart");
            continue;
        };
        let shape = t.shape();
        let kept = t.ty.kept().filter(|_| options.keep_quantized && shape.len() == 2);
        if let Some(format) = kept {
            // Whole rows of blocks: llama.cpp's q/k row order is undone row by row.
            let mut bytes = g.raw(t).to_vec();
            if let Some(n_head) = permute {
                bytes = unpermute_rows(&bytes, shape[0], n_head);
            }
            let stored = vec![shape[0], format.row_bytes(shape[1])];
            info.insert(crate::models::loader::quant_key(&name), format.name().to_string());
            tensors.insert(name, (safetensors::Dtype::U8, stored, bytes));
            continue;
        }
        if options.keep_quantized && shape.len() == 2 {
            *dequantized.entry(format!("{:?}", t.ty)).or_default() += 1;
        }
        let mut w = g.dequantize(t);
        if let Some(n_head) = permute {
            w = unpermute_rows(&w, shape[0], n_head);
        }
        if meta.arch.norm_plus_one && name.ends_with("norm.weight") {
            w.iter_mut().for_each(|x| *x -= 1.0);
        }
        let (st_dtype, bytes) = match options.dtype {
            ImportDtype::F32 => (safetensors::Dtype::F32, bytemuck::cast_slice::<f32, u8>(&w).to_vec()),
            ImportDtype::Bf16 => {
                (safetensors::Dtype::BF16, w.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect())
            }
        };
        tensors.insert(name, (st_dtype, shape, bytes));
    }
    bar.finish_with_message("done");
    if !dequantized.is_empty() {
        tracing::info!(
            ?dequantized,
            "--keep-quantized keeps Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K blocks; these matrices' types are dequantized"
        );
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (dtype, shape, bytes))| {
            safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes).map(|v| (n.clone(), v))
        })
        .collect::<Result<_, _>>()?;
    safetensors::tensor::serialize_to_file(views, &Some(info), &out.join("model.safetensors"))?;
    Ok(())
}
