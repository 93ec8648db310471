//! GPTQ, AWQ and compressed-tensors integer checkpoints, written here from the tiny Llama
//! of tests/fixtures/models/llama.json and packed as AutoGPTQ / GPTQModel, AutoAWQ and
//! compressed-tensors (llm-compressor) pack them: each serves the greedy tokens and logprobs of the same model with its weights
//! dequantized by this file (`(q - zero) × scale` of each group, rounded to the scales'
//! f16) and stored in f32. The packing is written from the formats' own definitions, apart
//! from the engine's unpacking.

mod common;

use std::path::Path;

use actorllm::Engine;
use actorllm::config::EngineArgs;
use actorllm::kernels::DType;
use actorllm::models::loader::Checkpoint;
use common::quantized::{Golden, Tensors, assert_serves_reference, golden_llama, rounded, write_model};
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
    /// GPTQ 4-bit, symmetric, groups of 32 in order (`desc_act: false`, `g_idx` written all
    /// the same), as most GPTQ checkpoints are.
    GptqInOrder,
    /// GPTQ 8-bit, asymmetric, one group a column, zero points as they are (`gptq_v2`).
    GptqV2,
    /// AWQ 4-bit (gemm), asymmetric, groups of 32.
    Awq,
    /// compressed-tensors `pack-quantized`, 4-bit symmetric, groups of 32 in activation
    /// order (`weight_g_idx`).
    CtPacked4,
    /// compressed-tensors `pack-quantized`, 8-bit asymmetric per channel (packed zero points).
    CtPacked8Asym,
    /// compressed-tensors `int-quantized`: int8 weights, symmetric per channel.
    CtInt8,
}

impl Format {
    fn bits(self) -> u32 {
        match self {
            Format::GptqV2 | Format::CtPacked8Asym | Format::CtInt8 => 8,
            _ => 4,
        }
    }

    fn symmetric(self) -> bool {
        matches!(self, Format::GptqActOrder | Format::GptqInOrder | Format::CtPacked4 | Format::CtInt8)
    }

    fn quantization_config(self) -> Value {
        match self {
            Format::GptqActOrder => json!({
                "quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": true, "sym": true,
                "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": true,
            }),
            Format::GptqInOrder => json!({
                "quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": false, "sym": true,
                "checkpoint_format": "gptq",
            }),
            Format::GptqV2 => json!({
                "quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": false, "sym": false,
                "checkpoint_format": "gptq_v2",
            }),
            Format::Awq => json!({
                "quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": true, "version": "gemm",
                "modules_to_not_convert": null,
            }),
            Format::CtPacked4 | Format::CtPacked8Asym | Format::CtInt8 => {
                let (format, weights) = match self {
                    Format::CtPacked4 => (
                        "pack-quantized",
                        json!({"num_bits": 4, "type": "int", "symmetric": true,
                        "strategy": "group", "group_size": 32, "actorder": "group", "dynamic": false}),
                    ),
                    Format::CtPacked8Asym => (
                        "pack-quantized",
                        json!({"num_bits": 8, "type": "int", "symmetric": false,
                        "strategy": "channel", "group_size": null, "dynamic": false}),
                    ),
                    _ => (
                        "int-quantized",
                        json!({"num_bits": 8, "type": "int", "symmetric": true,
                        "strategy": "channel", "dynamic": false}),
                    ),
                };
                json!({
                    "quant_method": "compressed-tensors", "format": format, "quantization_status": "compressed",
                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": null}},
                    "ignore": ["lm_head"], "sparsity_config": {},
                })
            }
        }
    }

    /// Each input row's group.
    fn groups(self, cols: usize) -> Vec<usize> {
        match self {
            Format::GptqActOrder | Format::CtPacked4 => {
                // Rows taken in a fixed shuffled order, 32 at a time (a permutation by a
                // stride coprime to the row count).
                let order: Vec<usize> = (0..cols).map(|j| (j * 37 + 5) % cols).collect();
                let mut g = vec![0; cols];
                for (j, &row) in order.iter().enumerate() {
                    g[row] = j / 32;
                }
                g
            }
            Format::GptqV2 | Format::CtPacked8Asym | Format::CtInt8 => vec![0; cols],
            Format::Awq | Format::GptqInOrder => (0..cols).map(|i| i / 32).collect(),
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
        let Quantized { groups, scales, zeros, q } =
            quantize_weight(&w, (rows, cols), &group, bits, format.symmetric());
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
        if let Format::CtPacked4 | Format::CtPacked8Asym | Format::CtInt8 = format {
            compressed_tensors(
                &mut packed,
                &name,
                format,
                (rows, cols),
                &group,
                Quantized { groups, scales, zeros, q },
            );
            continue;
        }
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
            _ => {
                let mut qweight = vec![0u32; cols / per * rows];
                for i in 0..cols {
                    for n in 0..rows {
                        qweight[(i / per) * rows + n] |= q[n * cols + i] << (bits as usize * (i % per));
                    }
                }
                // The original format stores each zero point minus one.
                let stored = |z: u32| if matches!(format, Format::GptqV2) { z } else { z - 1 };
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

/// One weight in compressed-tensors' layout: values signed (`q - 2^(bits - 1)`), packed
/// into int32 words along each row from the lowest bit up after adding `2^(bits - 1)` back
/// (`pack-quantized`), or kept as int8 (`int-quantized`); an asymmetric scheme's signed zero
/// points packed the same way down the output dimension; scales `[out, groups]`.
fn compressed_tensors(
    out: &mut Tensors,
    name: &str,
    format: Format,
    (rows, cols): (usize, usize),
    group: &[usize],
    Quantized { groups, scales, zeros, q }: Quantized,
) {
    let bits = format.bits() as usize;
    let offset = 1i32 << (bits - 1);
    let signed: Vec<i32> = q.iter().map(|&u| u as i32 - offset).collect();
    // `scales`/`zeros` are indexed [group, row]; compressed-tensors stores [row, group].
    let by_row = |v: &dyn Fn(usize) -> f16| {
        (0..rows * groups).map(|k| v((k % groups) * rows + k / groups)).collect::<Vec<f16>>()
    };
    let scale_bytes = by_row(&|i| scales[i]).iter().flat_map(|s| s.to_le_bytes()).collect();
    out.insert(format!("{name}_scale"), (Dtype::F16, vec![rows, groups], scale_bytes));
    // Dense packing of `values` (each already unsigned) into words, lowest bit first.
    let pack = |values: &[u32]| {
        let mut words = vec![0u32; (values.len() * bits).div_ceil(32)];
        for (i, &v) in values.iter().enumerate() {
            words[i * bits / 32] |= v << ((i * bits) % 32);
        }
        words
    };
    match format {
        Format::CtInt8 => {
            let bytes = signed.iter().map(|&v| v as i8 as u8).collect();
            out.insert(name.to_string(), (Dtype::I8, vec![rows, cols], bytes));
        }
        _ => {
            let words: Vec<u32> = (0..rows)
                .flat_map(|n| {
                    pack(
                        &signed[n * cols..(n + 1) * cols]
                            .iter()
                            .map(|&v| (v + offset) as u32)
                            .collect::<Vec<_>>(),
                    )
                })
                .collect();
            out.insert(
                format!("{name}_packed"),
                (Dtype::I32, vec![rows, (cols * bits).div_ceil(32)], le(&words)),
            );
            let shape: Vec<u8> = [rows as i64, cols as i64].iter().flat_map(|d| d.to_le_bytes()).collect();
            out.insert(format!("{name}_shape"), (Dtype::I64, vec![2], shape));
        }
    }
    if !format.symmetric() {
        // Each group's column of zero points, packed down the rows: [⌈rows · bits / 32⌉, groups].
        let columns: Vec<Vec<u32>> = (0..groups).map(|g| pack(&zeros[g * rows..(g + 1) * rows])).collect();
        let word_rows = columns[0].len();
        let words: Vec<u32> = (0..word_rows * groups).map(|k| columns[k % groups][k / groups]).collect();
        out.insert(format!("{name}_zero_point"), (Dtype::I32, vec![word_rows, groups], le(&words)));
    }
    if let Format::CtPacked4 = format {
        let g_idx: Vec<u32> = group.iter().map(|&g| g as u32).collect();
        out.insert(format!("{name}_g_idx"), (Dtype::I32, vec![cols], le(&g_idx)));
    }
}

#[actix_rt::test]
async fn integer_checkpoints_serve_their_dequantized_model() {
    let Golden { dir: golden, weights, prompts } = golden_llama("int-golden");
    for (what, format) in [
        ("GPTQ 4-bit, act order, groups of 32", Format::GptqActOrder),
        ("GPTQ 4-bit, groups of 32 in order", Format::GptqInOrder),
        ("GPTQ v2 8-bit, asymmetric, per column", Format::GptqV2),
        ("AWQ 4-bit, groups of 32", Format::Awq),
        ("compressed-tensors pack-quantized 4-bit, act order", Format::CtPacked4),
        ("compressed-tensors pack-quantized 8-bit asymmetric", Format::CtPacked8Asym),
        ("compressed-tensors int-quantized 8-bit", Format::CtInt8),
    ] {
        let (packed, dequantized) = pack(&weights, format);
        let (model, reference) = (common::scratch("int-model"), common::scratch("int-reference"));
        write_model(golden.path(), model.path(), &packed, Some(format.quantization_config()));
        write_model(golden.path(), reference.path(), &dequantized, None);
        assert_serves_reference(what, model.path(), reference.path(), &prompts).await;
        assert!(rounded(&dequantized, &weights), "{what}: no weight moved");
        // 4-bit groups in order stay packed for the GPU's kernels (the CPU widens them at
        // upload, so the comparison above went through that path); others load widened.
        let config: Value =
            serde_json::from_slice(&std::fs::read(model.path().join("config.json")).unwrap()).unwrap();
        let ckpt = Checkpoint::open(model.path(), actorllm::quantization::packing(&config)).unwrap();
        let kept = ckpt.tensors().filter(|(_, t)| matches!(t.dtype, DType::Rows(_))).count();
        let in_order = matches!(format, Format::Awq | Format::GptqInOrder);
        assert_eq!(kept, if in_order { 21 } else { 0 }, "{what}: projections kept as 4-bit rows");
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
                assert!(e.contains("not quantized") && e.contains("fp8 only, not awq"), "{e}");
            }
            Format::GptqActOrder => {
                Engine::start(with(model.path(), "gptq_marlin")).await.expect("--quantization gptq_marlin");
                // Without config.json's quantization_config the int32 words are refused by name.
                let bare = common::scratch("int-bare");
                write_model(golden.path(), bare.path(), &packed, None);
                let e = refused(common::args(bare.path())).await;
                assert!(e.contains("qweight is I32") && e.contains("GPTQ, AWQ or compressed-tensors"), "{e}");
            }
            _ => {}
        }
    }
}

/// A PEFT adapter of rank 4 on q, v and down of the tiny Llama (hidden 64, kv 32,
/// intermediate 128, 3 layers), with the shared xorshift values scaled up to move outputs.
fn tiny_adapter(root: &Path) -> std::path::PathBuf {
    let dir = root.join("tiny-adapter");
    std::fs::create_dir_all(&dir).unwrap();
    let config = json!({
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"],
        "fan_in_fan_out": false, "bias": "none", "lora_dropout": 0.0, "task_type": "CAUSAL_LM",
    });
    std::fs::write(dir.join("adapter_config.json"), config.to_string()).unwrap();
    let mut tensors = Tensors::new();
    for layer in 0..3 {
        for (i, (module, part, fin, fout)) in
            [("q_proj", "self_attn", 64, 64), ("v_proj", "self_attn", 64, 32), ("down_proj", "mlp", 128, 64)]
                .into_iter()
                .enumerate()
        {
            let base = format!("base_model.model.model.layers.{layer}.{part}.{module}");
            let seed = (layer * 3 + i) as u64 * 2;
            for (which, shape, seed) in [("lora_A", vec![4, fin], seed), ("lora_B", vec![fout, 4], seed + 1)]
            {
                let values: Vec<f32> = common::lora::xorshift_values(seed + 1, shape[0] * shape[1])
                    .into_iter()
                    .map(|v| v * 64.0)
                    .collect();
                tensors.insert(
                    format!("{base}.{which}.weight"),
                    (Dtype::F32, shape, bytemuck::cast_slice(&values).to_vec()),
                );
            }
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, (dt, s, b))| (n.clone(), safetensors::tensor::TensorView::new(*dt, s.clone(), b).unwrap()))
        .collect();
    std::fs::write(dir.join("adapter_model.safetensors"), safetensors::serialize(views, &None).unwrap())
        .unwrap();
    dir
}

/// Each prompt's greedy tokens, each with its top-5 logprobs.
type Greedy = Vec<Vec<(u32, Vec<(u32, f32)>)>>;

/// 12 greedy tokens with top-5 logprobs of each prompt on `adapter` (None: the base model).
async fn adapted(engine: &Engine, prompts: &[Vec<u32>], adapter: Option<&str>) -> Greedy {
    let runs = prompts.iter().map(|p| common::greedy_top5_on(engine, p.clone(), 12, adapter));
    futures::future::join_all(runs).await
}

/// An adapter stays 16-bit over a quantized base: on a GPTQ model it gives what it gives
/// on the same model dequantized, and it does change the base model's output.
#[actix_rt::test]
async fn an_adapter_applies_over_a_gptq_base() {
    let Golden { dir: golden, weights, prompts } = golden_llama("int-lora-golden");
    let (packed, dequantized) = pack(&weights, Format::GptqActOrder);
    let (model, reference) = (common::scratch("int-lora-model"), common::scratch("int-lora-reference"));
    write_model(golden.path(), model.path(), &packed, Some(Format::GptqActOrder.quantization_config()));
    write_model(golden.path(), reference.path(), &dequantized, None);
    let root = common::scratch("int-lora-adapter");
    let adapter = tiny_adapter(root.path());
    let start = |dir: &Path| {
        let args = EngineArgs {
            lora: actorllm::config::LoraArgs {
                enable_lora: true,
                lora_modules: vec![("tiny".into(), adapter.clone())],
                max_loras: 1,
                max_lora_rank: 8,
                ..Default::default()
            },
            ..common::args(dir)
        };
        async move { Engine::start(args).await.unwrap() }
    };
    let (on_model, on_reference) = (start(model.path()).await, start(reference.path()).await);
    let got = adapted(&on_model, &prompts, Some("tiny")).await;
    let want = adapted(&on_reference, &prompts, Some("tiny")).await;
    let base = adapted(&on_model, &prompts, None).await;
    let ids = |r: &Greedy| r.iter().map(|s| s.iter().map(|t| t.0).collect::<Vec<_>>()).collect::<Vec<_>>();
    assert_eq!(ids(&got), ids(&want), "the adapter over GPTQ and over its dequantized model");
    for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
        for ((gt, glp), (wt, wlp)) in g.1.iter().zip(&w.1) {
            assert!(gt == wt && (glp - wlp).abs() <= 1e-6, "{g:?} vs {w:?}");
        }
    }
    assert_ne!(ids(&got), ids(&base), "the adapter changes the output");
}

/// The GPU test's GPTQ writer (`common::quantized::gptq4`, bf16 scales and groups of 64
/// here) writes a checkpoint that the CPU serves as its dequantized copy.
#[actix_rt::test]
async fn the_gptq_writer_of_the_gpu_tests_round_trips() {
    let Golden { dir: golden, weights, prompts } = golden_llama("gptq4-golden");
    let (packed, dequantized, q) = common::quantized::gptq4(&weights, 64, false);
    let (model, reference) = (common::scratch("gptq4-model"), common::scratch("gptq4-reference"));
    write_model(golden.path(), model.path(), &packed, Some(q));
    write_model(golden.path(), reference.path(), &dequantized, None);
    assert_serves_reference("gptq4 writer", model.path(), reference.path(), &prompts).await;
}
