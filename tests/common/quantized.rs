//! Quantized checkpoints written by the tests from a tiny model's f32 weights: the model
//! directory with its tensors replaced and a `quantization_config`, and the comparison of
//! its greedy output with the same model's weights dequantized by the test.

use std::collections::BTreeMap;
use std::path::Path;

use actorllm::Engine;
use actorllm::config::EngineArgs;
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use serde_json::Value;

/// The tiny Llama of tests/fixtures/models/llama.json written into a directory of the
/// caller's own: the directory, its f32 `model.safetensors` and the fixture's prompts.
pub struct Golden {
    pub dir: super::ScratchDir,
    pub weights: Vec<u8>,
    pub prompts: Vec<Vec<u32>>,
}

pub fn golden_llama(tag: &str) -> Golden {
    let g = super::model_golden("llama");
    let dir = super::scratch(tag);
    actorllm::models::random::write_golden_model(&g, dir.path()).unwrap();
    let weights = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    Golden { dir, weights, prompts: super::golden_prompts(&g) }
}

/// Tensors to write: name → (dtype, shape, bytes).
pub type Tensors = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

/// `golden` (a model directory) again in `dir`, with `tensors` and `quantization_config`.
pub fn write_model(golden: &Path, dir: &Path, tensors: &Tensors, q: Option<Value>) {
    for e in std::fs::read_dir(golden).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, (dt, shape, data))| (n.clone(), TensorView::new(*dt, shape.clone(), data).unwrap()))
        .collect();
    std::fs::write(dir.join("model.safetensors"), safetensors::serialize(views, &None).unwrap()).unwrap();
    if let Some(q) = q {
        let path = dir.join("config.json");
        let mut config: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        config["quantization_config"] = q;
        std::fs::write(&path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
    }
}

/// Each prompt's greedy tokens with their top-5 logprobs, from the engine `args` start.
pub async fn greedy(args: EngineArgs, prompts: &[Vec<u32>]) -> Vec<Vec<(u32, Vec<(u32, f32)>)>> {
    let dir = args.model.clone();
    let engine = Engine::start(args).await.unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    futures::future::join_all(prompts.iter().map(|p| super::greedy_top5(&engine, p.clone(), 16))).await
}

/// The quantized model in `quantized` gives the tokens and top-5 logprobs (within 1e-6) of
/// the dequantized one in `reference`, for every prompt.
pub async fn assert_serves_reference(what: &str, quantized: &Path, reference: &Path, prompts: &[Vec<u32>]) {
    assert_args_serve_reference(what, super::args(quantized), super::args(reference), prompts).await
}

/// [`assert_serves_reference`] for engines started with `quantized` and `reference`.
pub async fn assert_args_serve_reference(
    what: &str,
    quantized: EngineArgs,
    reference: EngineArgs,
    prompts: &[Vec<u32>],
) {
    let (got, want) = (greedy(quantized, prompts).await, greedy(reference, prompts).await);
    assert_eq!(got.len(), prompts.len());
    for (i, (got, want)) in got.iter().zip(&want).enumerate() {
        let ids = |r: &[(u32, Vec<(u32, f32)>)]| r.iter().map(|s| s.0).collect::<Vec<_>>();
        assert_eq!(ids(got), ids(want), "{what}: prompt {i}");
        for (step, ((_, got), (_, want))) in got.iter().zip(want).enumerate() {
            for ((gt, glp), (wt, wlp)) in got.iter().zip(want) {
                assert!(
                    gt == wt && (glp - wlp).abs() <= 1e-6,
                    "{what}: prompt {i} step {step}: {got:?} vs {want:?}"
                );
            }
        }
    }
}

/// Whether some projection weight of `written` differs from the f32 model's `original`:
/// the format rounded the weights, so the model served is not the original unchanged.
pub fn rounded(written: &Tensors, original: &[u8]) -> bool {
    let original = safetensors::SafeTensors::deserialize(original).unwrap();
    written.iter().any(|(n, t)| n.ends_with("proj.weight") && t.2 != original.tensor(n).unwrap().data())
}

/// The projections of an f32 checkpoint (`weights`, safetensors bytes) as GPTQ writes
/// 4-bit symmetric groups of `group` in order (`desc_act: false`): `qweight` `[in / 8,
/// out]` (8 consecutive input rows a word, lowest bits first), `qzeros` `[groups, out /
/// 8]` (each zero point 8 stored minus one), `scales` `[groups, out]` in f16 or bf16, and
/// an in-order `g_idx`. Each group's scale maps its largest magnitude to ±7. With it, the
/// same model dequantized (`(q − 8) × scale`, in the scales' type), and the config's
/// `quantization_config`.
pub fn gptq4(weights: &[u8], group: usize, f16: bool) -> (Tensors, Tensors, Value) {
    let st = safetensors::SafeTensors::deserialize(weights).unwrap();
    // A value rounded to the scales' type, and its bytes.
    type Round = fn(f32) -> (f32, [u8; 2]);
    let (half_dtype, round): (Dtype, Round) = match f16 {
        true => (Dtype::F16, |v| {
            let h = half::f16::from_f32(v);
            (h.to_f32(), h.to_le_bytes())
        }),
        false => (Dtype::BF16, |v| {
            let h = half::bf16::from_f32(v);
            (h.to_f32(), h.to_le_bytes())
        }),
    };
    let le = |words: &[u32]| words.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<u8>>();
    let (mut packed, mut dequantized) = (Tensors::new(), Tensors::new());
    for (name, t) in st.tensors() {
        let shape = t.shape().to_vec();
        if !name.ends_with("proj.weight") {
            packed.insert(name.clone(), (Dtype::F32, shape.clone(), t.data().to_vec()));
            dequantized.insert(name, (Dtype::F32, shape, t.data().to_vec()));
            continue;
        }
        let w: Vec<f32> = bytemuck::pod_collect_to_vec(t.data());
        let (rows, cols) = (shape[0], shape[1]);
        let groups = cols / group;
        // Scales [groups, rows].
        let scales: Vec<f32> = (0..groups * rows)
            .map(|i| {
                let (g, n) = (i / rows, i % rows);
                let amax = (0..group).map(|j| w[n * cols + g * group + j].abs()).fold(0f32, f32::max);
                round(amax / 7.0).0
            })
            .collect();
        let q: Vec<u32> = (0..rows * cols)
            .map(|k| {
                let s = scales[(k % cols / group) * rows + k / cols];
                if s == 0.0 { 8 } else { ((w[k] / s).round() + 8.0).clamp(0.0, 15.0) as u32 }
            })
            .collect();
        let values: Vec<u8> = (0..rows * cols)
            .flat_map(|k| round((q[k] as f32 - 8.0) * scales[(k % cols / group) * rows + k / cols]).1)
            .collect();
        dequantized.insert(name.clone(), (half_dtype, shape, values));
        let mut qweight = vec![0u32; cols / 8 * rows];
        for i in 0..cols {
            for n in 0..rows {
                qweight[(i / 8) * rows + n] |= q[n * cols + i] << (4 * (i % 8));
            }
        }
        let base = name.strip_suffix("weight").unwrap();
        let g_idx: Vec<u32> = (0..cols).map(|i| (i / group) as u32).collect();
        packed.insert(format!("{base}qweight"), (Dtype::I32, vec![cols / 8, rows], le(&qweight)));
        packed.insert(
            format!("{base}qzeros"),
            (Dtype::I32, vec![groups, rows / 8], le(&vec![0x7777_7777; groups * rows / 8])),
        );
        let scale_bytes = scales.iter().flat_map(|&s| round(s).1).collect();
        packed.insert(format!("{base}scales"), (half_dtype, vec![groups, rows], scale_bytes));
        packed.insert(format!("{base}g_idx"), (Dtype::I32, vec![cols], le(&g_idx)));
    }
    let config = serde_json::json!({
        "quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": false, "sym": true,
        "checkpoint_format": "gptq",
    });
    (packed, dequantized, config)
}

/// The projections of an f32 checkpoint (`weights`, safetensors bytes), rounded to bf16, as
/// vLLM's `fp8` format writes them: e4m3 bytes (each the nearest to its value over its
/// scale, ties to even) beside `weight_scale_inv` `[⌈out / block_rows⌉, ⌈in / block_cols⌉]`
/// in f32, each block's largest magnitude at 448; every other tensor in bf16. With it, the same model dequantized (each
/// byte's value times its scale, rounded to bf16), and the config's `quantization_config`.
pub fn fp8_blocks(weights: &[u8], (block_rows, block_cols): (usize, usize)) -> (Tensors, Tensors, Value) {
    let st = safetensors::SafeTensors::deserialize(weights).unwrap();
    let e4m3: Vec<f32> = (0..0x7fu8).map(actorllm::kernels::e4m3::decode).collect();
    let encode = |v: f32| {
        let a = v.abs();
        let i = e4m3.partition_point(|&e| e < a).min(e4m3.len() - 1);
        // The nearer value, ties to the even byte.
        let (below, above) = (if i > 0 { a - e4m3[i - 1] } else { f32::INFINITY }, e4m3[i] - a);
        let i = if below < above || below == above && i % 2 == 1 { i - 1 } else { i };
        i as u8 | if v < 0.0 { 0x80 } else { 0 }
    };
    let bf16 = |v: &[f32]| v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect::<Vec<u8>>();
    let (mut packed, mut dequantized) = (Tensors::new(), Tensors::new());
    for (name, t) in st.tensors() {
        let shape = t.shape().to_vec();
        // The bf16 model quantized: its values rounded to bf16 first.
        let w: Vec<f32> = bytemuck::pod_collect_to_vec::<u8, f32>(t.data())
            .into_iter()
            .map(|v| half::bf16::from_f32(v).to_f32())
            .collect();
        if !name.ends_with("proj.weight") {
            packed.insert(name.clone(), (Dtype::BF16, shape.clone(), bf16(&w)));
            dequantized.insert(name, (Dtype::BF16, shape, bf16(&w)));
            continue;
        }
        let (rows, cols) = (shape[0], shape[1]);
        let (br, bc) = (rows.div_ceil(block_rows), cols.div_ceil(block_cols));
        let block_of = |k: usize| (k / cols / block_rows) * bc + (k % cols) / block_cols;
        let mut scales = vec![0f32; br * bc];
        for (k, v) in w.iter().enumerate() {
            scales[block_of(k)] = scales[block_of(k)].max(v.abs() / 448.0);
        }
        let scale = |k: usize| scales[block_of(k)];
        let bytes: Vec<u8> = w
            .iter()
            .enumerate()
            .map(|(k, &v)| if scale(k) == 0.0 { 0 } else { encode(v / scale(k)) })
            .collect();
        let values: Vec<f32> =
            bytes.iter().enumerate().map(|(k, &b)| actorllm::kernels::e4m3::decode(b) * scale(k)).collect();
        dequantized.insert(name.clone(), (Dtype::BF16, shape.clone(), bf16(&values)));
        let base = name.strip_suffix("weight").unwrap();
        packed.insert(
            format!("{base}weight_scale_inv"),
            (Dtype::F32, vec![br, bc], bytemuck::cast_slice(&scales).to_vec()),
        );
        packed.insert(name, (Dtype::F8_E4M3, shape, bytes));
    }
    let config = serde_json::json!({
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [block_rows, block_cols],
    });
    (packed, dequantized, config)
}
