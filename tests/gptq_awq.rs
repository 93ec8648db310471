//! GPTQ and AWQ checkpoints, written here from the tiny Llama of
//! tests/fixtures/models/llama.json and packed as AutoGPTQ / GPTQModel and AutoAWQ pack
//! them: each serves the greedy tokens and logprobs of the same model with its weights
//! dequantized by this file (`(q - zero) × scale` of each group, rounded to the scales'
//! f16) and stored in f32. The packing is written from the formats' own definitions, apart
//! from the engine's unpacking.

mod common;

use std::path::Path;

use actorllm::Engine;
use actorllm::config::EngineArgs;
use common::quantized::{Tensors, assert_serves_reference, rounded, write_model};
use half::f16;
use safetensors::Dtype;
use serde_json::{Value, json};

/// AutoAWQ's packing order: nibble k of a word holds output column `ORDER[k]` of its eight.
const AWQ_ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];

#[derive(Clone, Copy)]
enum Format {
    /// GPTQ 4-bit, symmetric, groups of 32 in activation order (`desc_act`, a shuffled
    /// `g_idx`), zero points stored minus one (`checkpoint_format: gptq`).
    GptqActOrder,
    /// GPTQ 8-bit, asymmetric, one group a column, zero points as they are (`gptq_v2`).
    GptqV2,
    /// AWQ 4-bit (gemm), asymmetric, groups of 32.
    Awq,
}

impl Format {
    fn bits(self) -> u32 {
        match self {
            Format::GptqV2 => 8,
            _ => 4,
        }
    }

    fn quantization_config(self) -> Value {
        match self {
            Format::GptqActOrder => json!({
                "quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": true, "sym": true,
                "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": true,
            }),
            Format::GptqV2 => json!({
                "quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": false, "sym": false,
                "checkpoint_format": "gptq_v2",
            }),
            Format::Awq => json!({
                "quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": true, "version": "gemm",
                "modules_to_not_convert": null,
            }),
        }
    }

    /// Each input row's group.
    fn groups(self, cols: usize) -> Vec<usize> {
        match self {
            Format::GptqActOrder => {
                // Rows taken in a fixed shuffled order, 32 at a time (a permutation by a
                // stride coprime to the row count).
                let order: Vec<usize> = (0..cols).map(|j| (j * 37 + 5) % cols).collect();
                let mut g = vec![0; cols];
                for (j, &row) in order.iter().enumerate() {
                    g[row] = j / 32;
                }
                g
            }
            Format::GptqV2 => vec![0; cols],
            Format::Awq => (0..cols).map(|i| i / 32).collect(),
        }
    }
}

/// One weight quantized: per (group, output) scale (f16) and zero point, and each
/// element's integer `[out, in]`.
struct Quantized {
    groups: usize,
    scales: Vec<f16>,
    zeros: Vec<u32>,
    q: Vec<u32>,
}

fn quantize_weight(
    w: &[f32],
    (rows, cols): (usize, usize),
    group: &[usize],
    bits: u32,
    sym: bool,
) -> Quantized {
    let maxq = ((1u32 << bits) - 1) as f32;
    let groups = group.iter().max().unwrap() + 1;
    let (mut scales, mut zeros) = (vec![f16::ZERO; groups * rows], vec![0u32; groups * rows]);
    for g in 0..groups {
        for n in 0..rows {
            let values = (0..cols).filter(|&i| group[i] == g).map(|i| w[n * cols + i]);
            let (lo, hi) = values.fold((0f32, 0f32), |(lo, hi), v| (lo.min(v), hi.max(v)));
            let (scale, zero) = if sym {
                let m = lo.abs().max(hi);
                (2.0 * m / maxq, (maxq + 1.0) / 2.0)
            } else {
                let s = (hi - lo) / maxq;
                (s, (-lo / s).round())
            };
            scales[g * rows + n] = f16::from_f32(scale);
            zeros[g * rows + n] = zero as u32;
        }
    }
    let q = (0..rows * cols)
        .map(|k| {
            let (n, i) = (k / cols, k % cols);
            let at = group[i] * rows + n;
            ((w[k] / scales[at].to_f32()).round() + zeros[at] as f32).clamp(0.0, maxq) as u32
        })
        .collect();
    Quantized { groups, scales, zeros, q }
}

fn le(words: &[u32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// The golden model's projections packed in `format`, and the same model dequantized.
fn pack(weights: &[u8], format: Format) -> (Tensors, Tensors) {
    let st = safetensors::SafeTensors::deserialize(weights).unwrap();
    let (mut packed, mut dequantized) = (Tensors::new(), Tensors::new());
    let bits = format.bits();
    let per = (32 / bits) as usize;
    for (name, t) in st.tensors() {
        let shape = t.shape().to_vec();
        if !name.ends_with("proj.weight") {
            packed.insert(name.clone(), (Dtype::F32, shape.clone(), t.data().to_vec()));
            dequantized.insert(name, (Dtype::F32, shape, t.data().to_vec()));
            continue;
        }
        let w: Vec<f32> = bytemuck::pod_collect_to_vec(t.data());
        let (rows, cols) = (shape[0], shape[1]);
        let group = format.groups(cols);
        let sym = matches!(format, Format::GptqActOrder);
        let Quantized { groups, scales, zeros, q } = quantize_weight(&w, (rows, cols), &group, bits, sym);
        let values: Vec<f32> = (0..rows * cols)
            .map(|k| {
                let (n, i) = (k / cols, k % cols);
                let at = group[i] * rows + n;
                let v = (q[k] as f32 - zeros[at] as f32) * scales[at].to_f32();
                f16::from_f32(v).to_f32()
            })
            .collect();
        dequantized.insert(name.clone(), (Dtype::F32, shape, bytemuck::cast_slice(&values).to_vec()));
        let base = name.strip_suffix("weight").unwrap();
        let (qweight, qweight_shape, qzeros) = match format {
            Format::Awq => {
                let mut qweight = vec![0u32; cols * rows / 8];
                for i in 0..cols {
                    for word in 0..rows / 8 {
                        for (k, &c) in AWQ_ORDER.iter().enumerate() {
                            qweight[i * rows / 8 + word] |= q[(word * 8 + c) * cols + i] << (4 * k);
                        }
                    }
                }
                let mut qzeros = vec![0u32; groups * rows / 8];
                for g in 0..groups {
                    for word in 0..rows / 8 {
                        for (k, &c) in AWQ_ORDER.iter().enumerate() {
                            qzeros[g * rows / 8 + word] |= zeros[g * rows + word * 8 + c] << (4 * k);
                        }
                    }
                }
                (qweight, vec![cols, rows / 8], qzeros)
            }
            Format::GptqActOrder | Format::GptqV2 => {
                let mut qweight = vec![0u32; cols / per * rows];
                for i in 0..cols {
                    for n in 0..rows {
                        qweight[(i / per) * rows + n] |= q[n * cols + i] << (bits as usize * (i % per));
                    }
                }
                // The original format stores each zero point minus one.
                let stored = |z: u32| if matches!(format, Format::GptqActOrder) { z - 1 } else { z };
                let mut qzeros = vec![0u32; groups * rows / per];
                for g in 0..groups {
                    for n in 0..rows {
                        qzeros[g * rows / per + n / per] |=
                            stored(zeros[g * rows + n]) << (bits as usize * (n % per));
                    }
                }
                let g_idx: Vec<u32> = group.iter().map(|&g| g as u32).collect();
                packed.insert(format!("{base}g_idx"), (Dtype::I32, vec![cols], le(&g_idx)));
                (qweight, vec![cols / per, rows], qzeros)
            }
        };
        packed.insert(format!("{base}qweight"), (Dtype::I32, qweight_shape, le(&qweight)));
        packed.insert(format!("{base}qzeros"), (Dtype::I32, vec![groups, rows / per], le(&qzeros)));
        let scale_bytes = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
        packed.insert(format!("{base}scales"), (Dtype::F16, vec![groups, rows], scale_bytes));
    }
    (packed, dequantized)
}

#[actix_rt::test]
async fn gptq_and_awq_checkpoints_serve_their_dequantized_model() {
    let g = common::model_golden("llama");
    let golden = common::scratch("int-golden");
    actorllm::models::random::write_golden_model(&g, golden.path()).unwrap();
    let weights = std::fs::read(golden.path().join("model.safetensors")).unwrap();
    let prompts = common::golden_prompts(&g);
    for (what, format) in [
        ("GPTQ 4-bit, act order, groups of 32", Format::GptqActOrder),
        ("GPTQ v2 8-bit, asymmetric, per column", Format::GptqV2),
        ("AWQ 4-bit, groups of 32", Format::Awq),
    ] {
        let (packed, dequantized) = pack(&weights, format);
        let (model, reference) = (common::scratch("int-model"), common::scratch("int-reference"));
        write_model(golden.path(), model.path(), &packed, Some(format.quantization_config()));
        write_model(golden.path(), reference.path(), &dequantized, None);
        assert_serves_reference(what, model.path(), reference.path(), &prompts).await;
        assert!(rounded(&dequantized, &weights), "{what}: no weight moved");
        let with = |dir: &Path, q: &str| EngineArgs { quantization: Some(q.into()), ..common::args(dir) };
        let refused =
            |args: EngineArgs| async { Engine::start(args).await.err().expect("refused").to_string() };
        match format {
            Format::Awq => {
                // vLLM's names for the format (its Marlin kernels' included) are taken;
                // another format's is refused, naming both.
                Engine::start(with(model.path(), "awq_marlin")).await.expect("--quantization awq_marlin");
                let e = refused(with(model.path(), "gptq")).await;
                assert!(e.contains("quantized with awq") && e.contains("not --quantization gptq"), "{e}");
                let e = refused(with(reference.path(), "awq")).await;
                assert!(e.contains("not quantized") && e.contains("does not quantize at load"), "{e}");
            }
            Format::GptqActOrder => {
                Engine::start(with(model.path(), "gptq_marlin")).await.expect("--quantization gptq_marlin");
                // Without config.json's quantization_config the int32 words are refused by name.
                let bare = common::scratch("int-bare");
                write_model(golden.path(), bare.path(), &packed, None);
                let e = refused(common::args(bare.path())).await;
                assert!(e.contains("qweight is I32") && e.contains("GPTQ or AWQ"), "{e}");
            }
            Format::GptqV2 => {}
        }
    }
}
