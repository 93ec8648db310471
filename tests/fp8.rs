//! FP8 checkpoints, written here in the layouts of vLLM's `fp8` format (per-tensor scales;
//! `weight_block_size` blocks) and compressed-tensors' `float-quantized` one (per-channel
//! scales in bf16) from the tiny Llama of tests/fixtures/models/llama.json: each serves the
//! greedy tokens and logprobs of the same model with its weights dequantized (each byte's
//! e4m3 value times its scale, in f32) and stored in f32. Then the `--quantization` flags
//! vLLM takes for them, and the refusal of FP8 arithmetic this engine does not do.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use actorllm::Engine;
use actorllm::config::EngineArgs;
use actorllm::kernels::DType;
use actorllm::models::loader::Checkpoint;
use common::quantized::{Golden, Tensors, assert_serves_reference, golden_llama, rounded, write_model};
use safetensors::Dtype;
use serde_json::{Value, json};

/// e4m3's value of byte `b` (OCP FP8 E4M3: 4 exponent bits of bias 7, 3 mantissa bits),
/// computed apart from the engine's decoder.
fn value(b: u8) -> f32 {
    let (e, m) = (((b & 0x7f) >> 3) as i32, (b & 7) as f32);
    let v = if e == 0 { m * 2f32.powi(-9) } else { (8.0 + m) * 2f32.powi(e - 10) };
    if b & 0x80 != 0 { -v } else { v }
}

/// The nearest e4m3 byte to x (ties to the even code, as PyTorch rounds), saturating at 448.
fn encode(x: f32) -> u8 {
    let a = x.abs().min(448.0);
    let hi = (0..=0x7eu8).find(|&c| value(c) >= a).expect("448 is the last finite value");
    let code = match hi {
        0 => 0,
        _ => {
            let lo = hi - 1;
            let (below, above) = (a - value(lo), value(hi) - a);
            if below < above || (below == above && lo % 2 == 0) { lo } else { hi }
        }
    };
    if x < 0.0 && code != 0 { code | 0x80 } else { code }
}

/// How a layout scales its weights.
#[derive(Clone, Copy)]
enum Layout {
    /// compressed-tensors, one bf16 scale an output channel (`weight_scale` [rows, 1]).
    Channel,
    /// vLLM's fp8 with `weight_block_size` [32, 32] (`weight_scale_inv`).
    Blocks,
    /// vLLM's fp8, one scale a tensor (`weight_scale` []), static activation scales beside.
    Tensor,
}

impl Layout {
    fn quantization_config(self) -> Value {
        match self {
            Layout::Channel => json!({
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {"group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": true, "dynamic": false},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": true},
                }},
                "ignore": ["lm_head"],
            }),
            Layout::Blocks => json!({
                "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [32, 32],
            }),
            Layout::Tensor => json!({"quant_method": "fp8", "activation_scheme": "static"}),
        }
    }

    /// Each weight element's group (the elements one scale covers) of a [rows, cols] weight,
    /// and the scale tensor's shape.
    fn groups(self, rows: usize, cols: usize) -> (Vec<usize>, Vec<usize>) {
        let (g, shape) = match self {
            Layout::Channel => ((0..rows * cols).map(|i| i / cols).collect(), vec![rows, 1]),
            Layout::Blocks => {
                let per_row = cols.div_ceil(32);
                let g = (0..rows * cols).map(|i| (i / cols / 32) * per_row + (i % cols) / 32).collect();
                (g, vec![rows.div_ceil(32), per_row])
            }
            Layout::Tensor => (vec![0; rows * cols], vec![]),
        };
        (g, shape)
    }
}

struct Written {
    fp8: Tensors,
    dequantized: Tensors,
}

/// The golden model's projections in `layout`, and the same model dequantized in f32.
fn quantize(weights: &[u8], layout: Layout) -> Written {
    let st = safetensors::SafeTensors::deserialize(weights).unwrap();
    let (mut fp8, mut dequantized) = (BTreeMap::new(), BTreeMap::new());
    for (name, t) in st.tensors() {
        let shape = t.shape().to_vec();
        assert_eq!(t.dtype(), Dtype::F32, "the golden model is f32");
        let w: Vec<f32> = bytemuck::pod_collect_to_vec(t.data());
        if !name.ends_with("proj.weight") {
            fp8.insert(name.clone(), (Dtype::F32, shape.clone(), t.data().to_vec()));
            dequantized.insert(name, (Dtype::F32, shape, t.data().to_vec()));
            continue;
        }
        let (rows, cols) = (shape[0], shape[1]);
        let (group, scale_shape) = layout.groups(rows, cols);
        let mut amax = vec![0f32; group.iter().max().unwrap() + 1];
        for (v, &g) in w.iter().zip(&group) {
            amax[g] = amax[g].max(v.abs());
        }
        let mut scales: Vec<f32> = amax.iter().map(|&a| if a > 0.0 { a / 448.0 } else { 1.0 }).collect();
        if let Layout::Channel = layout {
            scales.iter_mut().for_each(|s| *s = half::bf16::from_f32(*s).to_f32());
        }
        let bytes: Vec<u8> = w.iter().zip(&group).map(|(v, &g)| encode(v / scales[g])).collect();
        let values: Vec<f32> = bytes.iter().zip(&group).map(|(&b, &g)| value(b) * scales[g]).collect();
        dequantized.insert(name.clone(), (Dtype::F32, shape.clone(), bytemuck::cast_slice(&values).to_vec()));
        let (scale_name, scale_dtype, scale_bytes) = match layout {
            Layout::Channel => (
                "weight_scale",
                Dtype::BF16,
                scales.iter().flat_map(|s| half::bf16::from_f32(*s).to_le_bytes()).collect::<Vec<u8>>(),
            ),
            Layout::Blocks => ("weight_scale_inv", Dtype::F32, bytemuck::cast_slice(&scales).to_vec()),
            Layout::Tensor => ("weight_scale", Dtype::F32, bytemuck::cast_slice(&scales).to_vec()),
        };
        let base = name.strip_suffix("weight").unwrap();
        fp8.insert(format!("{base}{scale_name}"), (scale_dtype, scale_shape, scale_bytes));
        if let Layout::Tensor = layout {
            fp8.insert(format!("{base}input_scale"), (Dtype::F32, vec![], 0.02f32.to_le_bytes().to_vec()));
        }
        fp8.insert(name, (Dtype::F8_E4M3, shape, bytes));
    }
    Written { fp8, dequantized }
}

#[actix_rt::test]
async fn fp8_checkpoints_serve_their_dequantized_model() {
    let Golden { dir: golden, weights, prompts } = golden_llama("fp8-golden");
    for (what, layout) in [
        ("compressed-tensors, per channel", Layout::Channel),
        ("fp8, blocks of 32 × 32", Layout::Blocks),
        ("fp8, per tensor", Layout::Tensor),
    ] {
        let written = quantize(&weights, layout);
        let (fp8, reference) = (common::scratch("fp8-model"), common::scratch("fp8-reference"));
        write_model(golden.path(), fp8.path(), &written.fp8, Some(layout.quantization_config()));
        write_model(golden.path(), reference.path(), &written.dequantized, None);
        assert_serves_reference(what, fp8.path(), reference.path(), &prompts).await;
        assert!(rounded(&written.dequantized, &weights), "{what}: no weight moved");
        if let Layout::Tensor = layout {
            // vLLM's flag for such a checkpoint is taken; another method's, or one other
            // than fp8 on a 16-bit checkpoint (which fp8 quantizes at load), refused.
            let with = |dir: &Path, q: &str| EngineArgs { quantization: Some(q.into()), ..common::args(dir) };
            let refused =
                |args: EngineArgs| async { Engine::start(args).await.err().expect("refused").to_string() };
            Engine::start(with(fp8.path(), "fp8"))
                .await
                .expect("--quantization fp8 serves an fp8 checkpoint");
            let e = refused(with(fp8.path(), "compressed-tensors")).await;
            assert!(
                e.contains("quantized with fp8") && e.contains("not --quantization compressed-tensors"),
                "{e}"
            );
            let e = refused(with(reference.path(), "awq")).await;
            assert!(e.contains("quantizes at load for --quantization fp8 only, not awq"), "{e}");
        }
    }
}

/// The GPU tests' FP8 writer (`common::quantized::fp8_blocks`, blocks of 32 and bf16
/// elsewhere) writes a checkpoint whose projections load kept as FP8 rows, and which the
/// CPU serves as its dequantized copy.
#[actix_rt::test]
async fn the_fp8_writer_of_the_gpu_tests_round_trips() {
    let Golden { dir: golden, weights, prompts } = golden_llama("fp8-blocks-golden");
    let (packed, dequantized, q) = common::quantized::fp8_blocks(&weights, (32, 32));
    let (model, reference) = (common::scratch("fp8-blocks-model"), common::scratch("fp8-blocks-reference"));
    write_model(golden.path(), model.path(), &packed, Some(q));
    write_model(golden.path(), reference.path(), &dequantized, None);
    assert_serves_reference("fp8 blocks writer", model.path(), reference.path(), &prompts).await;
    let config: Value =
        serde_json::from_slice(&std::fs::read(model.path().join("config.json")).unwrap()).unwrap();
    let ckpt = Checkpoint::open(model.path(), actorllm::quantization::packing(&config)).unwrap();
    let kept = ckpt.tensors().filter(|(_, t)| matches!(t.dtype, DType::Rows(_))).count();
    assert_eq!(kept, 21, "projections kept as FP8 rows");
}

/// `--quantization fp8` on a checkpoint that is not quantized (vLLM's online FP8): each
/// projection row is scaled by its largest magnitude over 448 and rounded to e4m3 as the
/// model loads. Served in bf16, the tiny model gives what the test's own writer gives for
/// the same rows quantized (one block a row) and dequantized.
#[actix_rt::test]
async fn fp8_at_load_quantizes_each_projection_row() {
    use actorllm::config::DTypeArg;
    let Golden { dir: golden, weights, prompts } = golden_llama("fp8-online-golden");
    let (_, dequantized, _) = common::quantized::fp8_blocks(&weights, (1, usize::MAX));
    let reference = common::scratch("fp8-online-reference");
    write_model(golden.path(), reference.path(), &dequantized, None);
    assert!(rounded(&dequantized, &weights), "no weight moved");
    let bf16 = |dir: &Path, q: Option<&str>| EngineArgs {
        dtype: DTypeArg::Bfloat16,
        quantization: q.map(Into::into),
        ..common::args(dir)
    };
    common::quantized::assert_args_serve_reference(
        "fp8 at load",
        bf16(golden.path(), Some("fp8")),
        bf16(reference.path(), None),
        &prompts,
    )
    .await;
}
