//! The CUDA device against its CPU twin: every kernel on random inputs (odd sizes, GQA,
//! block boundaries, mixed prefill and decode), then the engine on a GPU giving the same
//! greedy tokens as on the CPU, with and without preemption. Every test here needs a CUDA
//! GPU (two need two) and is `#[ignore]`d, so that `cargo test` shows them as ignored
//! rather than passed on a machine without one; on a GPU host run them with
//! `cargo test --release --test cuda -- --ignored` (add `--skip two_gpu` on one GPU).
//! Asked to run without a GPU, they fail.

mod common;

use actorllm::Engine;
use actorllm::actors::model_runner::{BatchSeq, ExecuteBatch, ModelRunner, NewSeq, RunnerConfig};
use actorllm::config::{DTypeArg, DeviceArg, EngineArgs};
use actorllm::kernels::attn::AttnMetadata;
use actorllm::kernels::cpu::{CpuDevice, CpuTensor, KvCells};
use actorllm::kernels::cuda::CudaDevice;
use actorllm::kernels::{
    Activation, AttnShape, CacheShape, DType, Device, HostTensor, KvDtype, KvScales, LoraShape,
    LoraSlotWeights, RopeByLen, RopeSpec,
};
use actorllm::models::LoadOptions;
use actorllm::models::registry::ModelRegistry;
use actorllm::request::SamplingParams;
use actorllm::sampling::{self, SampleInput};
use common::{greedy, run, tiny_model};

/// Waits (up to 30 s) until the engine before has released its device: a KV cache still
/// held would leave the next engine's profiling little memory.
async fn runners_released() {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while actorllm::actors::model_runner::live_runners() > 0 && std::time::Instant::now() < deadline {
        actix_rt::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// A test's turn on the GPU, held to its end. `cargo test` runs a binary's tests in
/// parallel, but an engine sizes its KV cache by the GPU memory it finds free (the
/// KV-budget test's takes 90 % of it): run in parallel on the H200, the seeded-sampling
/// test's engine failed to start. One at a time, every test passes.
struct GpuTurn {
    _held: std::sync::MutexGuard<'static, ()>,
}

/// This test's turn on the GPUs; at least `gpus` of them must be there.
fn gpu_turn_of(gpus: usize) -> GpuTurn {
    static GPU: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let found = if CudaDevice::available() { CudaDevice::count() } else { 0 };
    assert!(found >= gpus, "this test needs {gpus} CUDA GPU(s), this machine has {found}");
    // A test that failed in its turn leaves the lock poisoned; the next still gets its turn.
    GpuTurn { _held: GPU.lock().unwrap_or_else(|e| e.into_inner()) }
}

/// This test's turn on the GPU.
fn gpu_turn() -> GpuTurn {
    gpu_turn_of(1)
}

/// The GPU with this test's turn on it (see [`gpu_turn`]).
fn gpu() -> (CudaDevice, GpuTurn) {
    let turn = gpu_turn();
    (CudaDevice::new(0).expect("CUDA device opens"), turn)
}

/// The default model where it is (or ACTORLLM_TEST_MODEL), else a random model of its
/// shapes written into a directory of the test's own: a GPU host running binaries built
/// elsewhere has no models/.
fn smollm2_model() -> common::ScratchDir {
    let imported =
        std::env::var_os("ACTORLLM_TEST_MODEL").map(std::path::PathBuf::from).unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct")
        });
    let dir = common::scratch("smollm2");
    if imported.join("model.safetensors").exists() {
        for f in std::fs::read_dir(&imported).unwrap() {
            let f = f.unwrap();
            std::os::unix::fs::symlink(f.path(), dir.join(f.file_name())).unwrap();
        }
    } else {
        let shape = actorllm::models::random::Preset::Smollm2_135m.shape();
        actorllm::models::random::make_random_model(shape, &dir, DType::F32, 3, 1.0).expect("random SmolLM2");
    }
    dir
}

/// A step's attention metadata: rows at the positions `seq_pos` gives for each sequence, in
/// that order, their slots in the sequences' blocks of `bs` tokens (block tables `tables`).
fn step_meta(tables: &[Vec<u32>], bs: usize, seq_pos: &[(u32, std::ops::Range<u32>)]) -> AttnMetadata {
    let mut meta = AttnMetadata { block_tables: tables.to_vec(), ..Default::default() };
    for (seq, range) in seq_pos {
        for p in range.clone() {
            meta.positions.push(p);
            meta.token_seq.push(*seq);
            let slot = tables[*seq as usize][p as usize / bs] as i64 * bs as i64 + (p as usize % bs) as i64;
            meta.slot_mapping.push(slot);
        }
    }
    meta
}

fn rand(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

fn host(data: &[f32], shape: &[usize]) -> HostTensor<'static> {
    HostTensor { dtype: DType::F32, shape: shape.to_vec(), data: bytemuck::cast_slice(data).to_vec().into() }
}

fn close(what: &str, gpu: &[f32], cpu: &[f32], tol: f32) {
    close_in(what, gpu, cpu, tol, 1.0)
}

/// [`close`] for values of amplitude `unit`: each may be off by `tol · (unit + |value|)`.
fn close_in(what: &str, gpu: &[f32], cpu: &[f32], tol: f32, unit: f32) {
    assert_eq!(gpu.len(), cpu.len(), "{what}: length");
    let off = |i: usize| (gpu[i] - cpu[i]).abs() / (unit + cpu[i].abs());
    let bad: Vec<usize> = (0..gpu.len()).filter(|&i| off(i).is_nan() || off(i) > tol).collect();
    if let (Some(&first), Some(&worst)) =
        (bad.first(), bad.iter().max_by(|&&a, &&b| off(a).total_cmp(&off(b))))
    {
        panic!(
            "{what}[{first}]: gpu {} vs cpu {}; {} of {} values differ, the most at [{worst}]: gpu {} vs cpu {}",
            gpu[first],
            cpu[first],
            bad.len(),
            gpu.len(),
            gpu[worst],
            cpu[worst]
        );
    }
}

/// `gpu` against silu(gate) · up of a `[rows, gate | up]` projection computed on the CPU,
/// where the projection's values may each be off by `tol · (1 + |value|)`: that error
/// carried through silu·mul (silu's slope is at most 1.1).
fn close_silu_mul(what: &str, gpu: &[f32], proj: &[f32], inter: usize, tol: f32) {
    close_act_mul(what, Activation::Silu, gpu, proj, inter, tol)
}

/// `act(gate) · up` of the CPU's f32 projection `[rows, 2·inter]` against the GPU's result.
fn close_act_mul(what: &str, act: Activation, gpu: &[f32], proj: &[f32], inter: usize, tol: f32) {
    assert_eq!(2 * gpu.len(), proj.len(), "{what}: length");
    for (i, a) in gpu.iter().enumerate() {
        let (row, j) = (i / inter, i % inter);
        let (g, u) = (proj[row * 2 * inter + j], proj[row * 2 * inter + inter + j]);
        let want = activation(act, g as f64) as f32 * u;
        // |Δ(act(g)·u)| ≤ |act(g)|·Δu + 1.2·|u|·Δg, with |act(g)| ≤ |g|, a slope of at most
        // 1.2 for each activation, and each Δ at most tol · (1 + |value|).
        let bound = tol * (g.abs() * (1.0 + u.abs()) + 1.2 * u.abs() * (1.0 + g.abs()) + 1e-3);
        assert!((a - want).abs() <= bound, "{what}[{i}]: gpu {a} vs cpu {want} (gate {g}, up {u})");
    }
}

fn activation(act: Activation, g: f64) -> f64 {
    match act {
        Activation::Silu => g / (1.0 + (-g).exp()),
        Activation::GeluTanh => 0.5 * g * (1.0 + (0.797_884_6 * (g + 0.044715 * g * g * g)).tanh()),
        Activation::Relu => g.max(0.0),
    }
}

/// A bf16 model's mixture-of-experts block as the tensor-core path computes it, in f64 on the
/// host: softmax over the router logits, the top k (ties to the lower index), renormalized
/// if asked; each chosen expert's act(gate) · up rounded to bf16, its down projection, and the
/// route-weighted sum. `gate_up` [experts, 2·inter, h] and `down` [experts, h, inter] hold
/// the weights as the GPU has them. Also each output's slack: what it moves if every gated
/// product lands one bf16 step away (a product near a rounding midpoint may round either
/// way after the GPU's f32 sums), 2⁻⁸ · Σ weight · |down · product|.
fn moe_bf16_reference(
    x: &[f32],
    logits: &[f32],
    gate_up: &[f32],
    down: &[f32],
    (h, inter): (usize, usize),
    spec: actorllm::kernels::MoeSpec,
) -> (Vec<f32>, Vec<f32>) {
    let experts = spec.experts;
    let dot = |w: &[f32], v: &[f64]| w.iter().zip(v).map(|(a, b)| *a as f64 * b).sum::<f64>();
    let (mut out, mut slack) = (vec![0.0f32; x.len()], vec![0.0f32; x.len()]);
    for (r, xr) in x.chunks(h).enumerate() {
        let l = &logits[r * experts..(r + 1) * experts];
        let max = l.iter().fold(f32::MIN, |m, v| m.max(*v)) as f64;
        let p: Vec<f64> = l.iter().map(|v| (*v as f64 - max).exp()).collect();
        let sum: f64 = p.iter().sum();
        let mut order: Vec<usize> = (0..experts).collect();
        order.sort_by(|a, b| p[*b].total_cmp(&p[*a]).then(a.cmp(b)));
        let chosen = &order[..spec.top_k];
        let norm = if spec.renormalize { chosen.iter().map(|e| p[*e]).sum::<f64>() } else { sum };
        let xr: Vec<f64> = xr.iter().map(|v| *v as f64).collect();
        let (mut acc, mut mag) = (vec![0.0f64; h], vec![0.0f64; h]);
        for &e in chosen {
            let gu = &gate_up[e * 2 * inter * h..(e + 1) * 2 * inter * h];
            let mid: Vec<f64> = (0..inter)
                .map(|j| {
                    let (g, u) = (
                        dot(&gu[j * h..(j + 1) * h], &xr),
                        dot(&gu[(inter + j) * h..(inter + j + 1) * h], &xr),
                    );
                    half::bf16::from_f64(activation(spec.act, g) * u).to_f64()
                })
                .collect();
            let d = &down[e * h * inter..(e + 1) * h * inter];
            let abs_mid: Vec<f64> = mid.iter().map(|m| m.abs()).collect();
            for c in 0..h {
                let row = &d[c * inter..(c + 1) * inter];
                acc[c] += p[e] / norm * dot(row, &mid);
                mag[c] +=
                    p[e] / norm * row.iter().zip(&abs_mid).map(|(w, m)| (*w as f64).abs() * m).sum::<f64>();
            }
        }
        for c in 0..h {
            out[r * h + c] = acc[c] as f32;
            slack[r * h + c] = (mag[c] / 256.0) as f32;
        }
    }
    (out, slack)
}

/// The GPU sampler against the host's on a vocabulary-sized batch of `cols` columns: every
/// rule (greedy with planted ties, temperature, top-k, top-p, min-p, penalties, min_tokens
/// masking, logprobs), on the full per-row kernel and on the split one (rows without
/// logprobs or top-k/top-p cuts), and many seeds pick the same tokens.
fn sampling_matches_the_host(g: &CudaDevice, c: &CpuDevice, cols: usize) {
    let base = |temperature| SamplingParams { temperature, ..Default::default() };
    let penalties = SamplingParams {
        repetition_penalty: 1.3,
        presence_penalty: 0.5,
        frequency_penalty: 0.4,
        ..base(0.0)
    };
    let mut params = vec![
        base(0.0),
        SamplingParams { logprobs: Some(5), ..base(0.0) },
        base(0.8),
        SamplingParams { top_k: 40, ..base(1.0) },
        SamplingParams { top_p: 0.9, ..base(0.7) },
        SamplingParams { top_k: 100, top_p: 0.8, min_p: 0.05, ..base(1.0) },
        SamplingParams { logprobs: Some(3), ..penalties.clone() },
        SamplingParams { min_tokens: 4, logprobs: Some(2), ..base(1.0) },
        base(0.0),
        // Rows 9 – 13 take the split sampler: penalties, min_tokens masking, min-p, a low
        // temperature, and a row with every token masked.
        penalties,
        SamplingParams { min_tokens: 4, ..base(1.0) },
        SamplingParams { min_p: 0.05, ..base(1.0) },
        base(0.5),
        base(1.0),
    ];
    let planted = params.len();
    params.extend((0..64).map(|i| match i % 4 {
        0 | 1 => SamplingParams { top_p: 0.95, top_k: [0, 50][i % 2], ..base(0.9) },
        2 => base(0.9),
        _ => SamplingParams { min_p: 0.02, ..base(1.3) },
    }));
    // logit_bias: row 4 gets a token raised past every other, and every fifth sampled row
    // a few raised and lowered (the split sampler's rows among them).
    params[4].logit_bias = vec![(11, 60.0), (12, -100.0)];
    for (i, p) in params.iter_mut().enumerate().skip(planted).filter(|(i, _)| i % 5 == 1) {
        let t = (i * 7919 % cols) as u32;
        p.logit_bias = vec![(t, 8.0), (t + 1, -50.0), (cols as u32 + 5, 1.0)];
    }
    let rows = params.len();
    let mut logits: Vec<f32> = rand(rows * cols, 20).iter().map(|x| x * 24.0).collect();
    logits[40_000] = 30.0; // row 0: a tie, the lowest index wins
    logits[123] = 30.0;
    logits[8 * cols..9 * cols].fill(-1.0); // row 8: all equal
    logits[13 * cols..14 * cols].fill(f32::NEG_INFINITY); // row 13: nothing to draw
    // Rows 6, 7, 9 and 10: their top token is one the rules touch (penalized, masked as
    // EOS; row 10's stands far above the rest, so that only the mask keeps it out).
    let top = |logits: &[f32], r: usize| sampling::argmax(&logits[r * cols..(r + 1) * cols]);
    let (top6, top7, top9) = (top(&logits, 6), top(&logits, 7), top(&logits, 9));
    logits[10 * cols + top7 as usize] = 90.0;
    let tokens6 = vec![1, 2, top6, 9, top6, top6, 17];
    let tokens9 = vec![1, 2, top9, 9, top9, top9, 17];
    let tokens7 = vec![5, 6, 7];
    let eos = [top7];
    // Grammar masks (structured output) on rows 1 (logprobs of the masked row), 2 and every
    // third sampled row: about one token in eleven allowed, the row's best one never.
    let masks: Vec<Option<Vec<u32>>> = (0..rows)
        .map(|i| {
            (i == 1 || i == 2 || (i >= planted && i % 3 == 0)).then(|| {
                let best = top(&logits, i);
                let mut m = vec![0u32; cols.div_ceil(32)];
                for t in
                    (0..cols as u32).filter(|&t| (t as u64 * 7919 + i as u64).is_multiple_of(11) && t != best)
                {
                    m[t as usize / 32] |= 1 << (t % 32);
                }
                m
            })
        })
        .collect();
    let inputs: Vec<SampleInput> = params
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let (tokens, prompt_len): (&[u32], usize) = match i {
                6 => (&tokens6, 3),
                9 => (&tokens9, 3),
                7 | 10 => (&tokens7, 3),
                _ => (&tokens7, 2),
            };
            SampleInput {
                params: p,
                seed: 1000 + i as u64,
                index: i % 3,
                tokens,
                prompt_len,
                eos_ids: &eos,
                history: None,
                allowed: masks[i].as_deref(),
            }
        })
        .collect();
    let want = c.sample_rows(CpuTensor::new(logits.clone(), rows, cols), &inputs).unwrap();
    let got = g.sample_rows(g.from_host(&logits, rows, cols).unwrap(), &inputs).unwrap();
    // The sampler keeps its device buffers: the same batch again allocates nothing and,
    // with the same seeds, picks the same tokens.
    let again = g.from_host(&logits, rows, cols).unwrap();
    let before = g.allocations();
    let second = g.sample_rows(again, &inputs).unwrap();
    assert_eq!(g.allocations(), before, "a repeated sampling step allocated device memory");
    assert_eq!(second, got, "the same seeds sample the same tokens");
    assert_eq!(want[0].0, 123, "the host breaks ties by the lowest id");
    assert_ne!(want[6].0, top6, "penalties moved row 6 off its top token");
    assert_ne!(want[9].0, top9, "penalties moved row 9 off its top token");
    assert_ne!(want[7].0, top7, "min_tokens masked row 7's EOS");
    assert_ne!(want[10].0, top7, "min_tokens masked row 10's EOS");
    assert_eq!(want[13].0, 0, "a row with every token masked gives token 0");
    assert_eq!(want[4].0, 11, "logit_bias raised row 4's token 11 above all");
    for (i, m) in masks.iter().enumerate() {
        if let Some(m) = m {
            let t = want[i].0;
            assert!(
                m[t as usize / 32] >> (t % 32) & 1 == 1,
                "row {i}: token {t} is outside its grammar mask"
            );
        }
    }
    let distinct: std::collections::HashSet<u32> = want[planted..].iter().map(|w| w.0).collect();
    assert!(distinct.len() > 8, "sampled rows vary with the seed: {distinct:?}");
    for (i, ((gt, glp), (ct, clp))) in got.iter().zip(&want).enumerate() {
        assert_eq!(gt, ct, "row {i}: gpu token vs host token");
        assert_eq!(glp.is_some(), clp.is_some(), "row {i}: logprobs");
        if let (Some(a), Some(b)) = (glp, clp) {
            assert!((a.logprob - b.logprob).abs() < 1e-4, "row {i}: logprob {} vs {}", a.logprob, b.logprob);
            assert_eq!(a.top.len(), b.top.len(), "row {i}: top logprobs");
            for (x, y) in a.top.iter().zip(&b.top) {
                assert_eq!(x.0, y.0, "row {i}: top logprob ids");
                assert!((x.1 - y.1).abs() < 1e-4, "row {i}: top logprob {} vs {}", x.1, y.1);
            }
        }
    }
}

/// A weight of packed rows (`t`) multiplied on the GPU as the CPU multiplies it widened: 40
/// rows (widened for cuBLAS) within `tol`, and 1 to 16 of them (up to 8 the GEMV reads the
/// rows as they are) as they come inside the 40.
fn packed_rows_match_the_cpu(g: &CudaDevice, c: &CpuDevice, t: HostTensor<'static>, tol: f32) {
    let (n, k) = (t.shape[0], t.shape[1]);
    let what = format!("{:?}", t.dtype);
    let w8a8 = w8a8_reference(g, &t);
    let copy = HostTensor { dtype: t.dtype, shape: t.shape.clone(), data: t.data.clone() };
    let (wc, wg) = (c.upload(copy).unwrap(), g.upload(t).unwrap());
    let x = rand(40 * k, 9);
    let all = g.to_host(&g.linear(&g.from_host(&x, 40, k).unwrap(), &wg, None).unwrap()).unwrap();
    let cpu = c.to_host(&c.linear(&CpuTensor::new(x.clone(), 40, k), &wc, None).unwrap()).unwrap();
    let label = |m: usize| format!("{what} linear of {m} rows, n {n}, k {k}");
    match &w8a8 {
        // Past the GEMV's 8 rows, FP8 rows with one scale a row multiply x quantized to FP8.
        // Hopper's FP8 tensor cores keep about 14 bits of their running sums (DeepSeek-V3's
        // report), so an output may be off by some 2^-12 of its terms' magnitudes.
        Some(reference) => {
            for (i, (&a, &(b, l1))) in all.iter().zip(&reference(&x)).enumerate() {
                let tol = 1e-4 * (1.0 + b.abs()) + l1 / 4096.0;
                assert!((a - b).abs() <= tol, "{} (W8A8)[{i}]: gpu {a} vs {b} (terms {l1})", label(40));
            }
        }
        None => close(&label(40), &all, &cpu, tol),
    }
    // As a gate/up projection, whose prompts' W8A8 GEMM writes the weights' 16-bit type
    // for act·mul to read.
    if let Some(reference) = &w8a8 {
        let xg = g.from_host(&x, 40, k).unwrap();
        let act = g.to_host(&g.gate_up_act(&xg, &wg, None, Activation::Silu, false).unwrap()).unwrap();
        let proj: Vec<f32> = reference(&x).into_iter().map(|(v, _)| v).collect();
        close_silu_mul(&format!("{} gate/up (W8A8)", label(40)), &act, &proj, n / 2, 1e-2);
    }
    for m in [1, 5, 8, 9, 16] {
        let xm = g.from_host(&x[..m * k], m, k).unwrap();
        let part = g.to_host(&g.linear(&xm, &wg, None).unwrap()).unwrap();
        // W8A8 rows alone give what they give among others, up to the FP8 tensor cores'
        // accumulation, which may differ between the algorithms for 16 and 40 rows.
        match (&w8a8, m <= 8) {
            (Some(_), true) => close(&label(m), &part, &cpu[..m * n], tol),
            (Some(reference), false) => {
                let want = reference(&x[..m * k]);
                for (i, (&a, (&b, &(_, l1)))) in part.iter().zip(all.iter().zip(&want)).enumerate() {
                    assert!((a - b).abs() <= 1e-4 + l1 / 4096.0, "{} [{i}]: {a} vs {b} among 40", label(m));
                }
            }
            (None, _) => close(&label(m), &part, &all[..m * n], 1e-4),
        }
    }
}

/// For FP8 rows with one scale a row and outputs in fours on a GPU with FP8 tensor cores
/// (sm_89 on), the W8A8 GEMM's result for rows of x: each row rounded to the weights' 16-bit type, scaled by its
/// largest magnitude over 448 and rounded to e4m3 (nearest, ties to even), multiplied by
/// the weights' e4m3 values in f32, then by both scales. None for other weights or GPUs.
fn w8a8_reference(g: &CudaDevice, t: &HostTensor<'_>) -> Option<impl Fn(&[f32]) -> Vec<(f32, f32)> + use<>> {
    use actorllm::kernels::e4m3;
    use actorllm::kernels::rows::RowKind;
    let DType::Rows(f) = t.dtype else { return None };
    let sm: u32 = g.arch().trim_start_matches("sm_").parse().unwrap();
    if f.kind != RowKind::Fp8 || f.group != 0 || sm < 89 || !t.shape[0].is_multiple_of(4) {
        return None;
    }
    let (n, k) = (t.shape[0], t.shape[1]);
    let values =
        t.data.chunks_exact(f.row_bytes()).map(|r| r[..k].iter().map(|&b| e4m3::decode(b)).collect());
    let rows: Vec<(Vec<f32>, f32)> = values.zip(f.scales(&t.data)).collect();
    assert_eq!(rows.len(), n);
    Some(move |x: &[f32]| {
        // Each output and the sum of its terms' magnitudes.
        let mut out = Vec::new();
        for xr in x.chunks_exact(k) {
            let x16: Vec<f32> = xr.iter().map(|&v| f.round(v)).collect();
            let amax = x16.iter().fold(0f32, |a, v| a.max(v.abs()));
            let sx = if amax > 0.0 { amax / 448.0 } else { 1.0 };
            let q: Vec<f32> = x16.iter().map(|&v| e4m3::decode(e4m3::encode(v / sx))).collect();
            for (w, sw) in &rows {
                let dot: f32 = q.iter().zip(w).map(|(a, b)| a * b).sum();
                let l1: f32 = q.iter().zip(w).map(|(a, b)| (a * b).abs()).sum();
                out.push((dot * sx * sw, l1 * sx * sw));
            }
        }
        out
    })
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --release --test cuda -- --ignored"]
fn every_kernel_matches_its_cpu_twin() {
    let (g, _turn) = gpu();
    let c = CpuDevice::default();
    let both = |data: &[f32], rows, cols| {
        (CpuTensor::new(data.to_vec(), rows, cols), g.from_host(data, rows, cols).unwrap())
    };
    // embedding, linear (+bias), norms, silu·mul, gather
    let (vocab, hidden, n) = (301, 72, 13);
    let table = rand(vocab * hidden, 1);
    let ids: Vec<u32> = (0..n as u32).map(|i| (i * 37) % vocab as u32).collect();
    let (te_c, te_g) = (
        c.upload(host(&table, &[vocab, hidden])).unwrap(),
        g.upload(host(&table, &[vocab, hidden])).unwrap(),
    );
    close(
        "embedding",
        &g.to_host(&g.embedding(&te_g, &ids).unwrap()).unwrap(),
        &c.to_host(&c.embedding(&te_c, &ids).unwrap()).unwrap(),
        0.0,
    );
    // An odd vocabulary, and one whose rows the split sampler reads in 16-byte vectors.
    sampling_matches_the_host(&g, &c, 50_257);
    sampling_matches_the_host(&g, &c, 50_256);
    let x = rand(n * hidden, 2);
    let (xc, xg) = both(&x, n, hidden);
    let w = rand(97 * hidden, 3);
    let b = rand(97, 4);
    let (wc, wg) = (c.upload(host(&w, &[97, hidden])).unwrap(), g.upload(host(&w, &[97, hidden])).unwrap());
    let (bc, bg) = (c.upload(host(&b, &[97])).unwrap(), g.upload(host(&b, &[97])).unwrap());
    close(
        "linear",
        &g.to_host(&g.linear(&xg, &wg, Some(&bg)).unwrap()).unwrap(),
        &c.to_host(&c.linear(&xc, &wc, Some(&bc)).unwrap()).unwrap(),
        1e-4,
    );
    // bf16 and f16 weights: the GPU rounds activations to the weight type before the GEMM.
    for dt in [DType::BF16, DType::F16] {
        let mut bytes = Vec::new();
        dt.convert_from(DType::F32, bytemuck::cast_slice(&w), &mut bytes);
        let t = || HostTensor { dtype: dt, shape: vec![97, hidden], data: bytes.clone().into() };
        let (wc16, wg16) = (c.upload(t()).unwrap(), g.upload(t()).unwrap());
        close(
            "linear 16-bit",
            &g.to_host(&g.linear(&xg, &wg16, None).unwrap()).unwrap(),
            &c.to_host(&c.linear(&xc, &wc16, None).unwrap()).unwrap(),
            2e-2,
        );
        let ids: Vec<u32> = vec![0, 5, 96];
        close(
            "embedding 16-bit",
            &g.to_host(&g.embedding(&wg16, &ids).unwrap()).unwrap(),
            &c.to_host(&c.embedding(&wc16, &ids).unwrap()).unwrap(),
            0.0,
        );
    }
    // 16-bit weights: up to 8 rows take the tensor-core GEMV, more take cuBLAS. A 40-row
    // product matches the CPU, and rows alone give what they give inside it. k = 72 ends in a
    // partial 32-element chunk, 1032 spreads its chunks over a block's warps; 97 outputs end
    // in a partial tile of 16. 97 outputs are 7 GEMV blocks, which take the 16-warp kernel
    // (gemv_wide); 6403 are 401, more than any GPU of under 200 SMs holds at two a
    // multiprocessor, which take the 8-warp one. k = 3584 (Gemma-2-9B's hidden size) leaves
    // each warp of either kernel whole chunks past its unrolled loop (3 and 2). The CPU keeps
    // x in f32 where the GPU rounds it, an error that grows as √k as the values do.
    for dt in [DType::BF16, DType::F16] {
        for (n, k) in [(97, 72), (97, 1032), (97, 2048), (6403, 72), (97, 3584), (6403, 3584)] {
            let w = rand(n * k, 7);
            let mut bytes = Vec::new();
            dt.convert_from(DType::F32, bytemuck::cast_slice(&w), &mut bytes);
            let t = || HostTensor { dtype: dt, shape: vec![n, k], data: bytes.clone().into() };
            let (wc16, wg16) = (c.upload(t()).unwrap(), g.upload(t()).unwrap());
            let x = rand(40 * k, 8);
            let all = g.to_host(&g.linear(&g.from_host(&x, 40, k).unwrap(), &wg16, None).unwrap()).unwrap();
            let cpu = c.to_host(&c.linear(&CpuTensor::new(x.clone(), 40, k), &wc16, None).unwrap()).unwrap();
            let amp = ((k as f32).sqrt() / 12.0).max(1.0);
            close_in(&format!("{dt:?} linear of 40 rows, n {n}, k {k}"), &all, &cpu, 2e-2, amp);
            for m in [1, 5, 8, 9, 16] {
                let xm = g.from_host(&x[..m * k], m, k).unwrap();
                let part = g.to_host(&g.linear(&xm, &wg16, None).unwrap()).unwrap();
                close(&format!("{dt:?} linear of {m} rows, n {n}, k {k}"), &part, &all[..m * n], 1e-4);
            }
        }
    }
    // 4-bit weights in groups (kernels/rows.rs): the GEMV reads them as they are up to 8
    // rows, prompts widen them for cuBLAS; the CPU widens them at upload. k = 64 leaves half
    // of a 128-element superchunk empty, 2048 in groups of 128 spreads superchunks over the
    // warps, 160 in groups of 32 ends in a partial one; one group a row too.
    for f16 in [false, true] {
        for (n, k, group) in
            [(97, 64, Some(32)), (97, 2048, Some(128)), (6403, 160, Some(32)), (40, 256, None)]
        {
            let format = actorllm::kernels::rows::RowFormat::int4(k, group, f16).unwrap();
            let groups = format.groups();
            let mut bytes = Vec::new();
            for r in 0..n {
                let q: Vec<u8> = (0..k).map(|i| ((r * 7 + i * 5 + i / 9) % 16) as u8).collect();
                let zeros: Vec<i32> = (0..groups).map(|g| ((r + 3 * g) % 17) as i32).collect();
                let scales: Vec<f32> =
                    (0..groups).map(|g| format.round(0.01 + 0.003 * ((r + g) % 11) as f32)).collect();
                format.push_int4_row(&q, &zeros, &scales, &mut bytes);
            }
            let t = HostTensor { dtype: DType::Rows(format), shape: vec![n, k], data: bytes.into() };
            packed_rows_match_the_cpu(&g, &c, t, 2e-2);
        }
    }
    // FP8 rows: k = 48 leaves a 64-element superchunk partly empty, 2048 in blocks of 128
    // spreads them over the warps; one scale a row too, whose rows past 8 run W8A8 where
    // the outputs come in fours (n = 96) and widen for cuBLAS where they do not (6403).
    for f16 in [false, true] {
        for (n, k, group) in [(97, 48, Some(16)), (97, 2048, Some(128)), (6403, 160, None), (96, 2048, None)]
        {
            let format = actorllm::kernels::rows::RowFormat::fp8(k, group, f16).unwrap();
            let mut bytes = Vec::new();
            for r in 0..n {
                // Every finite e4m3 byte (0x7f and 0xff are NaN), both signs, scaled to at
                // most ±0.5 (as `rand`'s values, so that rounding x to 16 bits on the GPU
                // stays inside the tolerance).
                let values: Vec<u8> =
                    (0..k).map(|i| ((r * 13 + i * 7) % 0x7f) as u8 | ((i % 2) << 7) as u8).collect();
                let scales: Vec<f32> =
                    (0..format.groups()).map(|g| 0.5 / 448.0 * (1 + (r + g) % 9) as f32 / 9.0).collect();
                format.push_fp8_row(&values, &scales, &mut bytes);
            }
            let t = HostTensor { dtype: DType::Rows(format), shape: vec![n, k], data: bytes.into() };
            packed_rows_match_the_cpu(&g, &c, t, 2e-2);
        }
    }
    let nw = rand(hidden, 5);
    let (nc, ng) = (c.upload(host(&nw, &[hidden])).unwrap(), g.upload(host(&nw, &[hidden])).unwrap());
    close(
        "rms_norm",
        &g.to_host(&g.rms_norm(&xg, &ng, 1e-5).unwrap()).unwrap(),
        &c.to_host(&c.rms_norm(&xc, &nc, 1e-5).unwrap()).unwrap(),
        1e-5,
    );
    let r = rand(n * hidden, 6);
    let (mut rc, mut rg) = both(&r, n, hidden);
    let oc = c.add_rms_norm(&xc, &mut rc, &nc, 1e-5).unwrap();
    let og = g.add_rms_norm(&xg, &mut rg, &ng, 1e-5).unwrap();
    close("add_rms_norm", &g.to_host(&og).unwrap(), &c.to_host(&oc).unwrap(), 1e-5);
    close("add_rms_norm residual", &g.to_host(&rg).unwrap(), &c.to_host(&rc).unwrap(), 1e-6);
    // x normed before it joins the residual, then the sum normed (one kernel on the GPU).
    let pw = rand(hidden, 9);
    let (pc, pg) = (c.upload(host(&pw, &[hidden])).unwrap(), g.upload(host(&pw, &[hidden])).unwrap());
    let oc = c.rms_norm_add_rms_norm(&xc, (&pc, 1e-6), &mut rc, (&nc, 1e-5)).unwrap();
    let og = g.rms_norm_add_rms_norm(&xg, (&pg, 1e-6), &mut rg, (&ng, 1e-5)).unwrap();
    close("rms_norm_add_rms_norm", &g.to_host(&og).unwrap(), &c.to_host(&oc).unwrap(), 1e-5);
    close("rms_norm_add_rms_norm residual", &g.to_host(&rg).unwrap(), &c.to_host(&rc).unwrap(), 1e-6);
    // For a projection's GEMM as a bf16 model runs: the norm (and the residual sum) kept
    // in bf16 alone, read back as the f32 norm rounded.
    g.set_activation_dtype(DType::BF16);
    let (mut r1, mut r2) = (g.from_host(&r, n, hidden).unwrap(), g.from_host(&r, n, hidden).unwrap());
    let alone = g.rms_norm_for_gemm(&xg, Some(&mut r1), &ng, 1e-5).unwrap();
    let full = g.add_rms_norm(&xg, &mut r2, &ng, 1e-5).unwrap();
    assert!(alone.in_16_bits_only() && !full.in_16_bits_only(), "rms_norm_for_gemm keeps bf16 only");
    let rounded: Vec<f32> =
        g.to_host(&full).unwrap().iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
    assert_eq!(g.to_host(&alone).unwrap(), rounded, "rms_norm_for_gemm read back");
    assert_eq!(g.to_host(&r1).unwrap(), g.to_host(&r2).unwrap(), "rms_norm_for_gemm residual");
    g.set_activation_dtype(DType::F32);
    let gu = rand(n * 2 * 50, 7);
    let (guc, gug) = both(&gu, n, 100);
    close(
        "silu_mul",
        &g.to_host(&g.act_mul(&gug, Activation::Silu).unwrap()).unwrap(),
        &c.to_host(&c.act_mul(&guc, Activation::Silu).unwrap()).unwrap(),
        1e-5,
    );
    let rows = [3usize, 0, 12, 7];
    close(
        "gather_rows",
        &g.to_host(&g.gather_rows(&xg, &rows).unwrap()).unwrap(),
        &c.to_host(&c.gather_rows(&xc, &rows).unwrap()).unwrap(),
        0.0,
    );

    // Uploading 16-bit weights above switched the device to a 16-bit model's activations and
    // cache; this part checks the f32 ones exactly.
    g.set_activation_dtype(DType::F32);
    // RoPE + paged attention: GQA 6:2, head_dim 32, block size 4; sequence 0 prefills
    // 9 tokens, sequence 1 decodes its 14th token over blocks out of order. LongRoPE's
    // factors switch past 10 tokens: sequence 0 takes the short ones, sequence 1 (a prompt
    // of 13) the long ones, in the same step.
    let s = AttnShape::causal(6, 2, 32);
    let plain: Vec<f32> = (0..16).map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / 32.0)).collect();
    let rope = RopeSpec {
        inv_freq: plain.iter().map(|f| f / 1.5).collect(),
        head_dim: 32,
        attention_scaling: 1.1,
        by_len: RopeByLen::Long { original: 10, long: plain.iter().map(|f| f / 4.0).collect() },
    };
    let cache_shape = CacheShape { num_blocks: 12, block_size: 4, num_kv_heads: 2, head_dim: 32 };
    let (mut cc, mut cg) = (
        c.alloc_cache(cache_shape, KvDtype::Auto).unwrap(),
        g.alloc_cache(cache_shape, KvDtype::Auto).unwrap(),
    );
    // A second GPU cache, filled by qkv_attention (RoPE writing K and V into the cache).
    let mut cg2 = g.alloc_cache(cache_shape, KvDtype::Auto).unwrap();
    let tables = vec![vec![5, 2, 9], vec![7, 1, 11, 0]];
    // First a 13-token prefill of sequence 1 so that its cache holds a context.
    let mut step = |positions: Vec<u32>, token_seq: Vec<u32>, seed| {
        let slot = |t: usize| {
            let (seq, p) = (token_seq[t] as usize, positions[t] as usize);
            (tables[seq][p / 4] * 4 + (p % 4) as u32) as i64
        };
        let meta = AttnMetadata {
            slot_mapping: (0..positions.len()).map(slot).collect(),
            positions: positions.clone(),
            token_seq,
            block_tables: tables.clone(),
            last_token_rows: vec![],
            lora_slots: vec![],
            prompt_lens: vec![9, 13],
        };
        let nt = positions.len();
        let qkv = rand(nt * (6 + 4) * 32, seed);
        let (qc, qg) = both(&qkv, nt, 320);
        let (q1, k1, v1) = c.split_qkv_rope(&qc, s, &rope, &meta).unwrap();
        let (q2, k2, v2) = g.split_qkv_rope(&qg, s, &rope, &meta).unwrap();
        close("rope q", &g.to_host(&q2).unwrap(), &c.to_host(&q1).unwrap(), 1e-4);
        close("rope k", &g.to_host(&k2).unwrap(), &c.to_host(&k1).unwrap(), 1e-4);
        close("split v", &g.to_host(&v2).unwrap(), &c.to_host(&v1).unwrap(), 0.0);
        let oc = c.paged_attention(&q1, &k1, &v1, &mut cc, s, &meta).unwrap();
        let og = g.paged_attention(&q2, &k2, &v2, &mut cg, s, &meta).unwrap();
        close("paged_attention", &g.to_host(&og).unwrap(), &c.to_host(&oc).unwrap(), 1e-4);
        let og2 = g.qkv_attention(&qg, s, &rope, &mut cg2, &meta).unwrap();
        close("qkv_attention", &g.to_host(&og2).unwrap(), &c.to_host(&oc).unwrap(), 1e-4);
    };
    step((0..13).collect(), vec![1; 13], 8);
    let mut positions: Vec<u32> = (0..9).collect();
    positions.push(13);
    let mut seqs = vec![0u32; 9];
    seqs.push(1);
    step(positions, seqs, 9);

    // Batched LoRA over mixed slots: two modules that read the same x (as q and k do)
    // into one output at their offsets (one of them an odd width), three slots (ranks 5
    // and 8, the middle one empty), rows on each slot and on none; adapters kept in f32 and
    // in bf16; a few rows (each reads its own slot) and many (GEMMs over every slot), short
    // inputs and long ones (the shrink split over input features).
    // The two modules are allocated as one group (one GEMM shrinks both), or each alone,
    // the second first (a GEMM each).
    for (rows, fin, bf16, grouped) in [13, 300].into_iter().flat_map(|r| {
        [72, 1536].into_iter().flat_map(move |f| {
            [(false, true), (false, false), (true, true), (true, false)].map(|(b, gr)| (r, f, b, gr))
        })
    }) {
        let shape = |out| LoraShape { slots: 3, max_rank: 8, in_features: fin, out_features: out, bf16 };
        let (outs, offs, cols) = ([40, 22], [0, 44], 70);
        let shapes = outs.map(shape);
        let mut lc = c.alloc_lora(&shapes).unwrap();
        let mut lg = if grouped {
            g.alloc_lora(&shapes).unwrap()
        } else {
            let second = g.alloc_lora(&shapes[1..]).unwrap();
            g.alloc_lora(&shapes[..1]).unwrap().into_iter().chain(second).collect()
        };
        for (m, &out) in outs.iter().enumerate() {
            for (slot, rank) in [(0, 5), (2, 8)] {
                let seed = 10 + 2 * (m * 3 + slot) as u64;
                let (a, b) = (rand(rank * fin, seed), rand(out * rank, seed + 1));
                let w = || Some(LoraSlotWeights { a: &a, b: &b, rank, scale: 1.5 });
                c.set_lora_slot(&mut lc[m], slot, w()).unwrap();
                g.set_lora_slot(&mut lg[m], slot, w()).unwrap();
            }
        }
        let slots: Vec<i32> = (0..rows as i32).map(|i| [0, -1, 2, 1][i as usize % 4]).collect();
        let x = rand(rows * fin, 13);
        let (xc, xg) = both(&x, rows, fin);
        let y = rand(rows * cols, 12);
        let (mut yc, mut yg) = both(&y, rows, cols);
        let (mc, mg): (Vec<_>, Vec<_>) = (lc.iter().zip(offs).collect(), lg.iter().zip(offs).collect());
        c.add_lora(&mut yc, &xc, &mc, &slots).unwrap();
        g.add_lora(&mut yg, &xg, &mg, &slots).unwrap();
        let (got, want) = (g.to_host(&yg).unwrap(), c.to_host(&yc).unwrap());
        // On the GPU's GEMM path a bf16 adapter also rounds x and the shrunk values to bf16
        // (as PEFT does in bf16; the CPU keeps them f32): over 1536 inputs that moves deltas
        // of a few units by up to about 0.04. A wrong slot or rank moves them by units.
        let what = format!("lora ({rows} rows, {fin} inputs, bf16 {bf16}, grouped {grouped})");
        close(&what, &got, &want, if bf16 { 6e-2 } else { 1e-4 });
        let untouched = |row: usize| got[row * cols..(row + 1) * cols] == y[row * cols..(row + 1) * cols];
        assert!(
            (0..rows).filter(|r| slots[*r] < 0).all(untouched),
            "{what}: rows without an adapter are unchanged"
        );
        assert!(!untouched(0), "{what}: an adapter changes its rows");
        // The projection with these adapters as its modules at 0 and 40 of a 62-wide
        // output, covering every column: past BGMV's rows the GPU writes the deltas first
        // and the projection's GEMM (weights in the adapters' type, plus a bias) adds
        // itself to them.
        let (wv, bv) = (rand(62 * fin, 14), rand(62, 15));
        let dt = if bf16 { DType::BF16 } else { DType::F32 };
        let mut bytes = Vec::new();
        dt.convert_from(DType::F32, bytemuck::cast_slice(&wv), &mut bytes);
        let t = || HostTensor { dtype: dt, shape: vec![62, fin], data: bytes.clone().into() };
        let (wc, wg) = (c.upload(t()).unwrap(), g.upload(t()).unwrap());
        let (bc, bg) = (c.upload(host(&bv, &[62])).unwrap(), g.upload(host(&bv, &[62])).unwrap());
        let (pc, pg): (Vec<_>, Vec<_>) = (lc.iter().zip([0, 40]).collect(), lg.iter().zip([0, 40]).collect());
        close(
            &format!("{what} with its projection"),
            &g.to_host(&g.linear_lora(&xg, &wg, Some(&bg), &pg, &slots).unwrap()).unwrap(),
            &c.to_host(&c.linear_lora(&xc, &wc, Some(&bc), &pc, &slots).unwrap()).unwrap(),
            if bf16 { 6e-2 } else { 1e-4 },
        );
        assert_eq!(g.lora_deltas_first(), rows > 32, "{what}: deltas first past BGMV's 32 rows");
        // The same projection as a fused gate/up one (gate its first 31 outputs, up the
        // last 31) under silu·mul, with these adapters and without: past the GEMV's 8 rows
        // the GPU writes a bf16 projection in bf16 (rounded as transformers rounds it),
        // with adapters only where their deltas come first.
        // Checked against silu·mul of the CPU's projection, within the projection's own
        // tolerance carried through silu·mul.
        let tol = if bf16 { 6e-2 } else { 1e-4 };
        let proj = c.to_host(&c.linear_lora(&xc, &wc, None, &pc, &slots).unwrap()).unwrap();
        close_silu_mul(
            &format!("{what}: silu_mul of its projection"),
            &g.to_host(&g.gate_up_act(&xg, &wg, Some((&pg, &slots)), Activation::Silu, false).unwrap())
                .unwrap(),
            &proj,
            31,
            tol,
        );
        assert_eq!(g.gate_up_in_16_bits(), bf16 && rows > 32, "{what}: silu_mul of a 16-bit projection");
        let proj = c.to_host(&c.linear(&xc, &wc, None).unwrap()).unwrap();
        close_silu_mul(
            &format!("{what}: silu_mul of its projection without adapters"),
            &g.to_host(&g.gate_up_act(&xg, &wg, None, Activation::Silu, true).unwrap()).unwrap(),
            &proj,
            31,
            tol,
        );
        assert_eq!(g.gate_up_in_16_bits(), bf16, "{what}: silu_mul of a 16-bit projection, no adapters");
        if bf16 {
            // As a bf16 model runs (activations for GEMMs rounded to bf16): where the down
            // projection applies no adapters, the result is kept in bf16 only; read back,
            // it is the f32 result rounded, and a GEMM over it gives exactly what it gives
            // over the result kept in both.
            g.set_activation_dtype(DType::BF16);
            let alone = g.gate_up_act(&xg, &wg, None, Activation::Silu, true).unwrap();
            let both_kept = g.gate_up_act(&xg, &wg, None, Activation::Silu, false).unwrap();
            assert!(alone.in_16_bits_only() && !both_kept.in_16_bits_only(), "{what}: kept in bf16 only");
            let (got, full) = (g.to_host(&alone).unwrap(), g.to_host(&both_kept).unwrap());
            let rounded: Vec<f32> = full.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
            assert_eq!(got, rounded, "{what}: the bf16-only result read back");
            let wd = rand(24 * 31, 16);
            let mut wbytes = Vec::new();
            DType::BF16.convert_from(DType::F32, bytemuck::cast_slice(&wd), &mut wbytes);
            let down = g
                .upload(HostTensor { dtype: DType::BF16, shape: vec![24, 31], data: wbytes.into() })
                .unwrap();
            let (y_alone, y_both) =
                (g.linear(&alone, &down, None).unwrap(), g.linear(&both_kept, &down, None).unwrap());
            assert_eq!(g.to_host(&y_alone).unwrap(), g.to_host(&y_both).unwrap(), "{what}: down projection");
            g.set_activation_dtype(DType::F32);
        }
    }
}

/// GEMMs tuned by timing (cublasGemmEx against cuBLASLt's candidates, tune.rs) give the
/// values untuned ones give, whichever algorithm wins: the fastest, or cuBLASLt's last
/// candidate forced at every point. Row counts between the tuned ones take the next one
/// up's choice; past the largest, cublasGemmEx's. Both a projection with f32 output and a
/// gate/up one written in its 16-bit type. Forced, cuBLASLt runs at the tuned row counts
/// (where tuning ran it) and cublasGemmEx past them.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --release --test cuda -- --ignored"]
fn tuned_gemms_give_the_untuned_values() {
    let (g, _turn) = gpu();
    // gate/up at a tuned row count, so that the forced cuBLASLt algorithm runs it.
    let (n, k, most, gu_rows) = (384, 1032, 300, 256);
    let rows = [9, 40, 64, 200, 256, 300];
    let x = rand(most * k, 12);
    let fastest = |t: &[f64]| (0..t.len()).min_by(|&a, &b| t[a].total_cmp(&t[b])).unwrap();
    let last_lt = |t: &[f64]| t.len() - 1;
    for dt in [DType::BF16, DType::F16] {
        let mut bytes = Vec::new();
        dt.convert_from(DType::F32, bytemuck::cast_slice(&rand(n * k, 11)), &mut bytes);
        let w = g.upload(HostTensor { dtype: dt, shape: vec![n, k], data: bytes.into() }).unwrap();
        // Each product's values, and whether cuBLASLt ran it.
        let run = || {
            let lin: Vec<(Vec<f32>, bool)> = rows
                .iter()
                .map(|&m| {
                    let y = g.linear(&g.from_host(&x[..m * k], m, k).unwrap(), &w, None).unwrap();
                    (g.to_host(&y).unwrap(), g.last_gemm_on_cublaslt())
                })
                .collect();
            let xg = g.from_host(&x[..gu_rows * k], gu_rows, k).unwrap();
            let gate_up = g.gate_up_act(&xg, &w, None, Activation::Silu, false).unwrap();
            assert!(g.gate_up_in_16_bits(), "{dt:?}: gate/up written in 16 bits");
            (lin, (g.to_host(&gate_up).unwrap(), g.last_gemm_on_cublaslt()))
        };
        let (untuned, untuned_gu) = run();
        assert!(untuned.iter().all(|(_, lt)| !lt) && !untuned_gu.1, "{dt:?}: cublasGemmEx before tuning");
        for (name, pick) in [("fastest", &fastest as &dyn Fn(&[f64]) -> usize), ("cuBLASLt's last", &last_lt)]
        {
            let report = g.tune_gemms_by(&[16, 64, 256], pick).unwrap();
            // Two shapes (f32 and 16-bit output) of each type tuned so far, at 3 row counts.
            let shapes = if dt == DType::BF16 { 2 } else { 4 };
            assert_eq!(report.points, 3 * shapes, "{dt:?}, {name}: points tuned");
            assert!(report.candidates >= report.points, "{dt:?}, {name}: cuBLASLt offered candidates");
            assert_eq!(report.rejected, 0, "{dt:?}, {name}: every candidate agreed with cublasGemmEx");
            if name != "fastest" {
                assert_eq!(report.lt_chosen, report.points, "{dt:?}: cuBLASLt's last candidate everywhere");
            }
            let (tuned, tuned_gu) = run();
            for ((m, a), b) in rows.iter().zip(&tuned).zip(&untuned) {
                close(&format!("{dt:?} linear of {m} rows, tuned by {name}"), &a.0, &b.0, 1e-4);
                if name != "fastest" && [64, 256, most].contains(m) {
                    assert_eq!(a.1, *m != most, "{dt:?} linear of {m} rows on cuBLASLt, forced");
                }
            }
            // silu·mul of 16-bit gate/up values that may round to a neighbouring value.
            close(
                &format!("{dt:?} gate/up of {gu_rows} rows, tuned by {name}"),
                &tuned_gu.0,
                &untuned_gu.0,
                2e-2,
            );
            if name != "fastest" {
                assert!(tuned_gu.1, "{dt:?} gate/up of {gu_rows} rows on cuBLASLt, forced");
            }
        }
    }
}

/// Up to the GEMV's 8 rows of 16-bit weights, the gate/up projection applies act·mul (SiLU,
/// GELU's tanh approximation, ReLU) in its own epilogue (gemv.cu's gemv_act): exactly what
/// the GEMV and act_mul give apart on the GPU, kept in f32 and in 16 bits or in 16 bits only, and what the CPU gives; at 9
/// rows the other path runs. 203 gate rows end in a partial tile; they take the 16-warp
/// kernels (gemv.cu's `_wide`), as does the GEMV they are checked against, and 3203 (401
/// blocks, more than a GPU of under 200 SMs holds at two a multiprocessor) the 8-warp ones.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --release --test cuda -- --ignored"]
fn gate_up_gemv_applies_the_activation_as_the_separate_kernel_does() {
    let (g, _turn) = gpu();
    let c = CpuDevice::default();
    let up16 = |dt: DType, w: &[f32], shape: [usize; 2]| {
        let mut bytes = Vec::new();
        dt.convert_from(DType::F32, bytemuck::cast_slice(w), &mut bytes);
        let t = || HostTensor { dtype: dt, shape: shape.to_vec(), data: bytes.clone().into() };
        (c.upload(t()).unwrap(), g.upload(t()).unwrap())
    };
    let rounded = |dt: DType, v: &[f32]| -> Vec<f32> {
        match dt {
            DType::BF16 => v.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect(),
            _ => v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect(),
        }
    };
    let acts = [Activation::Silu, Activation::GeluTanh, Activation::Relu];
    for (dt, (hidden, inter), act) in [DType::BF16, DType::F16]
        .into_iter()
        .flat_map(|d| [(d, (264, 203)), (d, (72, 3203))])
        .flat_map(|(d, s)| acts.map(|a| (d, s, a)))
    {
        g.set_activation_dtype(dt);
        let (wgu_c, wgu_g) = up16(dt, &rand(2 * inter * hidden, 21), [2 * inter, hidden]);
        for rows in [1, 3, 8, 9] {
            let what = format!("{dt:?} {act:?}, {inter} gate rows, {rows} rows");
            let x = rand(rows * hidden, 22);
            let (xc, xg) = (CpuTensor::new(x.clone(), rows, hidden), g.from_host(&x, rows, hidden).unwrap());
            let fused = g.to_host(&g.gate_up_act(&xg, &wgu_g, None, act, false).unwrap()).unwrap();
            assert_eq!(g.gate_up_on_gemv(), rows <= 8, "{what}: gate/up on the GEMV");
            let apart = g.to_host(&g.act_mul(&g.linear(&xg, &wgu_g, None).unwrap(), act).unwrap()).unwrap();
            // Past 8 rows a 16-bit projection is written in 16 bits (`gate_up_in_16_bits`).
            if rows <= 8 {
                assert_eq!(fused, apart, "{what}: gate/up with act·mul against the two kernels");
            }
            let alone = g.gate_up_act(&xg, &wgu_g, None, act, true).unwrap();
            assert!(alone.in_16_bits_only(), "{what}: gate/up kept in 16 bits only");
            assert_eq!(g.to_host(&alone).unwrap(), rounded(dt, &fused), "{what}: gate/up in 16 bits only");
            let proj = c.to_host(&c.linear(&xc, &wgu_c, None).unwrap()).unwrap();
            close_act_mul(&format!("{what}: gate/up against the CPU"), act, &fused, &proj, inter, 2e-2);
        }
    }
    g.set_activation_dtype(DType::F32);
}

/// A projection added to the residual with the next norm, for a projection without adapters
/// (`Device::linear_add_rms_norm` with `gemm_only`): up to 8 rows over 16-bit weights one
/// GEMV does it and leaves each row's 1/rms to the next projection's GEMV. The residual
/// comes out as the projection and the add kernel make it, and the norm and the two GEMVs
/// that read it (plain, as qkv; gate/up with SiLU·mul) match the CPU's norm, projection and
/// SiLU·mul. Hidden sizes of 264 and 4,400 take both GEMV widths on the H200 (17 and 275
/// blocks of 16 outputs).
#[test]
#[ignore = "needs a CUDA GPU: cargo test --release --test cuda -- --ignored"]
fn a_projection_into_the_residual_leaves_its_norm_to_the_next_gemv() {
    let (g, _turn) = gpu();
    let c = CpuDevice::default();
    let up = |dt: DType, w: &[f32], shape: &[usize]| {
        let mut bytes = Vec::new();
        dt.convert_from(DType::F32, bytemuck::cast_slice(w), &mut bytes);
        let t = || HostTensor { dtype: dt, shape: shape.to_vec(), data: bytes.clone().into() };
        (c.upload(t()).unwrap(), g.upload(t()).unwrap())
    };
    let (eps, inputs, outs, inter) = (1e-5, 136, 40, 24);
    for (dt, hidden) in [DType::BF16, DType::F16].into_iter().flat_map(|d| [(d, 264), (d, 4400)]) {
        g.set_activation_dtype(dt);
        // The weights as rounded to dt, so that the CPU multiplies the GPU's weights.
        let rounded = |v: Vec<f32>| -> Vec<f32> {
            match dt {
                DType::BF16 => v.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect(),
                _ => v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect(),
            }
        };
        let (w, w2) = (rounded(rand(hidden * inputs, 31)), rounded(rand(outs * hidden, 33)));
        let (wc, wg) = up(dt, &w, &[hidden, inputs]);
        let (nc, ng) =
            up(DType::F32, &rand(hidden, 32).iter().map(|v| v + 1.0).collect::<Vec<_>>(), &[hidden]);
        let (w2c, w2g) = up(dt, &w2, &[outs, hidden]);
        let (_, w3g) = up(dt, &rand(2 * inter * hidden, 34), &[2 * inter, hidden]);
        for rows in [1, 3, 8, 9] {
            let what = format!("{dt:?}, hidden {hidden}, {rows} rows");
            let (x, r) = (rand(rows * inputs, 35), rand(rows * hidden, 36));
            let xg = g.from_host(&x, rows, inputs).unwrap();
            let mut rg = g.from_host(&r, rows, hidden).unwrap();
            let h = g.linear_add_rms_norm(&xg, &wg, &mut rg, &ng, eps, true).unwrap();
            assert_eq!(g.norm_left_to_gemv(), rows <= 8, "{what}: the norm left to the next GEMV");
            assert!(h.in_16_bits_only(), "{what}: the norm kept in 16 bits only");
            // The residual as the projection and the norm kernel's add leave it.
            let mut r2 = g.from_host(&r, rows, hidden).unwrap();
            let apart = g.add_rms_norm(&g.linear(&xg, &wg, None).unwrap(), &mut r2, &ng, eps).unwrap();
            assert_eq!(g.to_host(&rg).unwrap(), g.to_host(&r2).unwrap(), "{what}: residual");
            // Against the CPU: the norm, and a projection that reads it (x and the norm are
            // rounded to 16 bits on the GPU: each product off by up to 2⁻⁸ of its size).
            let mut rc = CpuTensor::new(r.clone(), rows, hidden);
            let xc = CpuTensor::new(x.clone(), rows, inputs);
            let hc = c.add_rms_norm(&c.linear(&xc, &wc, None).unwrap(), &mut rc, &nc, eps).unwrap();
            let products = |x: &CpuTensor, w: &[f32], n: usize| {
                let ax = CpuTensor::new(x.data.iter().map(|v| v.abs()).collect(), x.rows, x.cols);
                let aw =
                    c.upload(host(&w.iter().map(|v| v.abs()).collect::<Vec<_>>(), &[n, x.cols])).unwrap();
                c.to_host(&c.linear(&ax, &aw, None).unwrap()).unwrap()
            };
            let within = |what: &str, gpu: &[f32], cpu: &[f32], sizes: &[f32]| {
                for (i, ((a, b), s)) in gpu.iter().zip(cpu).zip(sizes).enumerate() {
                    assert!(
                        (a - b).abs() <= s / 128.0 + 1e-4,
                        "{what}[{i}]: gpu {a} vs cpu {b}, products' size {s}"
                    );
                }
            };
            let rcv = c.to_host(&rc).unwrap();
            within(&format!("{what}: residual"), &g.to_host(&rg).unwrap(), &rcv, &products(&xc, &w, hidden));
            close(&format!("{what}: norm"), &g.to_host(&h).unwrap(), &c.to_host(&hc).unwrap(), 2e-2);
            let y2 = g.to_host(&g.linear(&h, &w2g, None).unwrap()).unwrap();
            let want = c.to_host(&c.linear(&hc, &w2c, None).unwrap()).unwrap();
            within(&format!("{what}: next GEMV"), &y2, &want, &products(&hc, &w2, outs));
            // The gate/up GEMV applies the same scale: SiLU·mul of the plain GEMV's values
            // (past 8 rows the projection is written in 16 bits first).
            let y3 = g.to_host(&g.gate_up_act(&h, &w3g, None, Activation::Silu, false).unwrap()).unwrap();
            let apart3 =
                g.to_host(&g.act_mul(&g.linear(&h, &w3g, None).unwrap(), Activation::Silu).unwrap()).unwrap();
            if rows <= 8 {
                assert_eq!(y3, apart3, "{what}: next gate/up GEMV against the plain GEMV and silu_mul");
            }
            // Hidden states (not only a GEMM's input): the norm kernel's, in full.
            let mut r3 = g.from_host(&r, rows, hidden).unwrap();
            let full = g.linear_add_rms_norm(&xg, &wg, &mut r3, &ng, eps, false).unwrap();
            assert!(!g.norm_left_to_gemv() && !full.in_16_bits_only(), "{what}: hidden states");
            assert_eq!(
                g.to_host(&full).unwrap(),
                g.to_host(&apart).unwrap(),
                "{what}: hidden states' values"
            );
        }
    }
    g.set_activation_dtype(DType::F32);
}

/// The qkv projection without adapters (`Device::project_qkv_attention`): up to 8 rows over
/// 16-bit weights and cache, one GEMV applies RoPE and writes k and v into the cache. The
/// attention it leads to matches the projection, RoPE kernel and attention run apart, over
/// a prefill, a decode step with a padding row (no slot: no cache write), an input whose
/// norm's scale the GEMV applies (`linear_add_rms_norm`), and past 8 rows (not fused).
/// Head dims 128 and 64 (384 and 60 blocks: both GEMV widths on the H200); frequencies
/// fixed, or following each token's length (LongRoPE's switch with scaled cos and sin,
/// dynamic NTK's growing base), each past 7 tokens.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --release --test cuda -- --ignored"]
fn the_qkv_gemv_applies_rope_into_the_cache_as_the_rope_kernel_does() {
    let (g, _turn) = gpu();
    let (hidden, bs) = (256, 16);
    let kinds = [(DType::BF16, 0), (DType::F16, 0), (DType::BF16, 1), (DType::BF16, 2)];
    for ((dt, kind), (heads, kv_heads, hd)) in
        kinds.into_iter().flat_map(|k| [(k, (32, 8, 128)), (k, (9, 3, 64))])
    {
        g.set_activation_dtype(dt);
        let what = format!("{dt:?}, rope kind {kind}, {heads}:{kv_heads}x{hd}");
        let s = AttnShape::causal(heads, kv_heads, hd);
        let plain: Vec<f32> = (0..hd / 2).map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / hd as f32)).collect();
        let (attention_scaling, by_len) = match kind {
            0 => (1.0, RopeByLen::Fixed),
            1 => (1.1, RopeByLen::Long { original: 7, long: plain.iter().map(|f| f / 4.0).collect() }),
            _ => (1.0, RopeByLen::Ntk { original: 7, theta: 10000.0, factor: 2.0 }),
        };
        let rope = RopeSpec { inv_freq: plain, head_dim: hd, attention_scaling, by_len };
        let n = (heads + 2 * kv_heads) * hd;
        let up = |w: &[f32], shape: &[usize], dt: DType| {
            let mut bytes = Vec::new();
            dt.convert_from(DType::F32, bytemuck::cast_slice(w), &mut bytes);
            g.upload(HostTensor { dtype: dt, shape: shape.to_vec(), data: bytes.into() }).unwrap()
        };
        let wg = up(&rand(n * hidden, 51), &[n, hidden], dt);
        let (w0, nw) =
            (up(&rand(hidden * 64, 52), &[hidden, 64], dt), up(&vec![1.0; hidden], &[hidden], DType::F32));
        let shape = CacheShape { num_blocks: 12, block_size: bs, num_kv_heads: kv_heads, head_dim: hd };
        let (mut fused, mut apart) =
            (g.alloc_cache(shape, KvDtype::Auto).unwrap(), g.alloc_cache(shape, KvDtype::Auto).unwrap());
        let tables: Vec<Vec<u32>> = (0..3).map(|i| (0..4).map(|b| b * 3 + i).collect()).collect();
        type Step<'a> = (&'a [(u32, std::ops::Range<u32>)], bool);
        let steps: [Step; 4] = [
            (&[(0, 0..6)], false),
            (&[(0, 6..7), (1, 0..1), (2, 0..1)], false),
            (&[(0, 7..8), (1, 1..2), (2, 1..2)], true),
            (&[(0, 8..9), (1, 2..10)], false),
        ];
        for (i, (seq_pos, scaled)) in steps.into_iter().enumerate() {
            let mut meta = step_meta(&tables, bs, seq_pos);
            if i == 1 {
                // A graph's padding row: position 0 of sequence 0's first block, no slot.
                meta.positions.push(0);
                meta.token_seq.push(0);
                meta.slot_mapping.push(-1);
            }
            let m = meta.positions.len();
            let x = match scaled {
                false => g.from_host(&rand(m * hidden, 53 + i as u64), m, hidden).unwrap(),
                true => {
                    let x0 = g.from_host(&rand(m * 64, 54), m, 64).unwrap();
                    let mut r = g.from_host(&rand(m * hidden, 55), m, hidden).unwrap();
                    let h = g.linear_add_rms_norm(&x0, &w0, &mut r, &nw, 1e-5, true).unwrap();
                    assert!(g.norm_left_to_gemv(), "{what}: step {i}'s input carries its norm's scale");
                    h
                }
            };
            let a = g.project_qkv_attention(&x, &wg, None, (s, &rope), &mut fused, &meta).unwrap();
            assert_eq!(g.qkv_rope_on_gemv(), m <= 8, "{what}, step {i}: RoPE in the GEMV");
            let qkv = g.linear(&x, &wg, None).unwrap();
            let b = g.qkv_attention(&qkv, s, &rope, &mut apart, &meta).unwrap();
            close(&format!("{what}, step {i}"), &g.to_host(&a).unwrap(), &g.to_host(&b).unwrap(), 2e-3);
        }
    }
    g.set_activation_dtype(DType::F32);
}

/// The rows of an attention step: a sequence and the positions of its rows, per sequence.
type StepRows = Vec<(u32, std::ops::Range<u32>)>;

/// Attention steps over one cache of three sequences whose blocks interleave (sequence i
/// owns blocks i, i + 3, i + 6, ...), each step's rows at the positions its list gives (with
/// fresh random q, k and v of its seed), each step's output checked against the CPU's within
/// `tol`; `after` sees the GPU after each step, for the kernels it took. Both caches are of
/// `kv`'s dtype, and k and v are scaled by its factor `amp`, to which the outputs' errors
/// are then measured (an output is a weighted sum of values of that size, and where they
/// cancel, tensor cores' 16-bit rounding of q and of the weights leaves an error of their
/// size, not the output's); FP8 caches must hold the same bytes after each step.
fn attention_steps(
    g: &CudaDevice,
    c: &CpuDevice,
    (s, act, bs, tol): (AttnShape, DType, usize, f32),
    (kv, amp, scales): (KvDtype, f32, KvScales),
    steps: &[(StepRows, u64)],
    mut after: impl FnMut(&CudaDevice, u64, &[(u32, std::ops::Range<u32>)]),
) {
    let (heads, kv_heads, head_dim) = (s.num_heads, s.num_kv_heads, s.head_dim);
    let per_seq = 1280 / bs as u32;
    let shape =
        CacheShape { num_blocks: 3 * per_seq as usize, block_size: bs, num_kv_heads: kv_heads, head_dim };
    let (mut cc, mut cg) = (c.alloc_cache(shape, kv).unwrap(), g.alloc_cache(shape, kv).unwrap());
    if kv == KvDtype::Fp8E4m3 {
        c.set_kv_scales(&mut cc, scales).unwrap();
        g.set_kv_scales(&mut cg, scales).unwrap();
    }
    let tables: Vec<Vec<u32>> = (0..3).map(|i| (0..per_seq).map(|b| b * 3 + i).collect()).collect();
    for (seq_pos, seed) in steps {
        let meta = step_meta(&tables, bs, seq_pos);
        let n = meta.positions.len();
        let (q, k, v) = (
            rand(n * heads * head_dim, *seed),
            rand(n * kv_heads * head_dim, seed + 1).into_iter().map(|x| x * amp).collect::<Vec<_>>(),
            rand(n * kv_heads * head_dim, seed + 2).into_iter().map(|x| x * amp).collect::<Vec<_>>(),
        );
        let t = |d: &[f32], cols| (CpuTensor::new(d.to_vec(), n, cols), g.from_host(d, n, cols).unwrap());
        let ((qc, qg), (kc, kg), (vc, vg)) =
            (t(&q, heads * head_dim), t(&k, kv_heads * head_dim), t(&v, kv_heads * head_dim));
        let oc = c.paged_attention(&qc, &kc, &vc, &mut cc, s, &meta).unwrap();
        let og = g.paged_attention(&qg, &kg, &vg, &mut cg, s, &meta).unwrap();
        after(g, *seed, seq_pos);
        if kv == KvDtype::Fp8E4m3 {
            let kc = same_fp8_bytes(g, &cg, &cc, "attention steps");
            assert!(kc.iter().any(|&b| b & 0x7f == 0x7e), "some values saturated");
        }
        close_in(
            &format!(
                "attention {heads}:{kv_heads}x{head_dim}, window {}, softcap {}, {n} tokens, {act:?}, blocks of {bs}, {kv:?} cache, {scales:?}",
                s.window, s.softcap
            ),
            &g.to_host(&og).unwrap(),
            &c.to_host(&oc).unwrap(),
            tol,
            amp,
        );
    }
}

/// Asserts that an FP8 cache on the GPU holds the bytes of its CPU twin (rounded alike, at
/// the same slots); the CPU's K bytes.
fn same_fp8_bytes<'c>(
    g: &CudaDevice,
    gpu: &actorllm::kernels::cuda::CudaCache,
    cpu: &'c actorllm::kernels::cpu::CpuCache,
    what: &str,
) -> &'c [u8] {
    let (k, v) = g.cache_bytes(gpu).unwrap();
    let (KvCells::Fp8(kc), KvCells::Fp8(vc)) = (&cpu.k, &cpu.v) else { panic!("{what}: an FP8 CPU cache") };
    let (kc, vc) = (&kc.bytes, &vc.bytes);
    let differ = k.iter().zip(kc).chain(v.iter().zip(vc)).filter(|(a, b)| a != b).count();
    assert_eq!((k.len(), v.len()), (kc.len(), vc.len()), "{what}: cache sizes");
    assert_eq!(differ, 0, "{what}: FP8 cache bytes the GPU rounded otherwise than the CPU");
    kc
}

/// Decode rows at scattered positions of the three sequences (none consecutive, so none is
/// a prefill run): 537 of them.
fn scattered_decode_rows() -> StepRows {
    [(0, 1..1101, 3), (1, 0..301, 2), (2, 0..38, 2)]
        .into_iter()
        .flat_map(|(seq, r, by)| r.step_by(by).map(move |p| (seq, p..p + 1)))
        .collect()
}

/// Paged attention over long contexts (many partitions of the split kernel) and GQA groups
/// of 1, 2, 4, 7 and 12 query heads per KV head (12 takes the one-block-per-head kernel; a
/// prefill block over a 16-bit cache takes 1, 2 or 4 heads of a group): a
/// 1,100-token prefill in one step, then a decode batch of three sequences of different
/// lengths whose block tables interleave. Then again, within 16-bit rounding, with
/// attention on tensor cores (16-bit inputs, f32 accumulation: head_dim 64 and 128, decode
/// for GQA groups up to 8) over the f32 cache, and as bf16 and f16 models run (16-bit cache),
/// also over cache blocks of 8 and 32 keys; then a decode batch of 537 rows, and last, one
/// of contexts up to 301 keys (over a 16-bit cache, partitions joined by flash_decode's
/// blocks), then of contexts of at most 16 keys.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --release --test cuda -- --ignored"]
fn long_contexts_and_gqa_groups_match_the_cpu() {
    let (g, _turn) = gpu();
    let c = CpuDevice::default();
    let f32_cache = [(32, 8, 128), (14, 2, 64), (12, 1, 32), (4, 4, 32)].map(|s| (s, false, DType::F32, 16));
    let tensor_cores = [(32, 8, 128), (14, 2, 64), (12, 1, 128)].map(|s| (s, true, DType::F32, 16));
    let bf16 = [(32, 8, 128), (14, 2, 64), (12, 1, 128), (4, 4, 32), (16, 8, 64)]
        .map(|s| (s, true, DType::BF16, 16));
    let f16 = [(32, 8, 128), (9, 3, 64)].map(|s| (s, true, DType::F16, 16));
    // Cache blocks smaller and larger than flash_decode's chunk of 16 keys.
    let block_sizes = [8, 32].map(|bs| ((32, 8, 128), true, DType::BF16, bs));
    let shapes = f32_cache.into_iter().chain(tensor_cores).chain(bf16).chain(f16).chain(block_sizes);
    for ((heads, kv_heads, head_dim), flash, act, bs) in shapes {
        g.set_tensor_core_attention(flash);
        g.set_activation_dtype(act);
        let tol = if flash || act != DType::F32 { 1e-2 } else { 1e-4 };
        let s = AttnShape::causal(heads, kv_heads, head_dim);
        let steps = [
            (vec![(0, 0..1100)], 40),
            (vec![(1, 0..300), (2, 0..37)], 41),
            (vec![(0, 1100..1101), (1, 300..301), (2, 37..38)], 42),
            (scattered_decode_rows(), 44),
            // Three rows of contexts up to 301 keys: over a 16-bit cache, partitions of 32
            // or 48 keys that flash_decode's blocks join themselves.
            (vec![(0, 200..201), (1, 300..301), (2, 37..38)], 45),
            // Contexts of at most 16 keys: flash_decode gives each row one warp, which
            // writes the output without the reduction.
            (vec![(0, 5..6), (1, 12..13), (2, 15..16)], 43),
        ];
        let tc_shape = flash && matches!(head_dim, 64 | 128);
        let kv = (KvDtype::Auto, 1.0, KvScales::default());
        attention_steps(&g, &c, (s, act, bs, tol), kv, &steps, |g, seed, seq_pos| {
            // Prefill runs (more than one position of a sequence) take the tensor-core
            // kernel whenever it applies; decode rows never do.
            let prefill = seq_pos.iter().any(|(_, r)| r.len() > 1);
            assert_eq!(g.tensor_core_tiles() > 0, tc_shape && prefill);
            if seq_pos.iter().any(|(_, r)| r.len() == 1) {
                assert_eq!(g.tensor_core_decode(), tc_shape && heads / kv_heads <= 8, "decode kernel");
            }
            if seed == 45 {
                let joins = tc_shape && act != DType::F32 && heads / kv_heads <= 8;
                assert_eq!(
                    g.decode_joined(),
                    joins,
                    "{heads}:{kv_heads}x{head_dim} {act:?}: joined in the block"
                );
            }
        });
    }
}

/// Sliding windows and soft caps (Mistral, Gemma 2 and 3) stay on the tensor-core kernels
/// and match the CPU: a 700-token prefill that crosses the window, a later chunk of the
/// same prompt beside another prompt, decode rows whose windows start mid-chunk (joined in
/// the block, and reduced), and contexts shorter than the window; over 16-bit caches with
/// blocks of 8, 16 and 32 keys, and over an f32 cache. Head size 256 (Gemma 2 and 3) over a
/// 16-bit cache runs every row, prefill too, on flash_decode.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --release --test cuda -- --ignored"]
fn windows_and_soft_caps_run_on_tensor_cores_and_match_the_cpu() {
    let (g, _turn) = gpu();
    let c = CpuDevice::default();
    let cases = [
        ((32, 8, 128), DType::BF16, 16, 100, 0.0),
        ((16, 8, 64), DType::BF16, 8, 0, 0.25),
        ((8, 4, 128), DType::F16, 32, 37, 0.5),
        ((14, 2, 64), DType::F32, 16, 64, 0.25),
        ((16, 8, 256), DType::BF16, 16, 0, 0.0),
        ((8, 4, 256), DType::F16, 16, 100, 0.5),
    ];
    for ((heads, kv_heads, head_dim), act, bs, window, softcap) in cases {
        g.set_tensor_core_attention(true);
        g.set_activation_dtype(act);
        let s = AttnShape { window, softcap, scale: 0.5, ..AttnShape::causal(heads, kv_heads, head_dim) };
        let steps = [
            (vec![(0, 0..700)], 50),
            (vec![(0, 700..760), (1, 0..300)], 51),
            (vec![(0, 760..761), (1, 300..301), (2, 0..1)], 52),
            (scattered_decode_rows(), 53),
            (vec![(0, 200..201), (1, 301..302), (2, 1..2)], 54),
            (vec![(0, 5..6), (1, 12..13), (2, 15..16)], 55),
        ];
        let kv = (KvDtype::Auto, 1.0, KvScales::default());
        attention_steps(&g, &c, (s, act, bs, 1e-2), kv, &steps, |g, seed, seq_pos| {
            let prefill = seq_pos.iter().any(|(_, r)| r.len() > 1);
            assert_eq!(g.tensor_core_tiles() > 0, prefill && head_dim != 256, "prefill on tensor cores");
            if !prefill || head_dim == 256 {
                assert!(g.tensor_core_decode(), "decode on tensor cores");
            }
            // Three decode rows of up to 302 keys over a 16-bit cache: joined in the block
            // for head sizes up to 128; 256 is reduced (a join of its four 32 KiB warps ran
            // slower in graphs).
            if seed == 54 {
                let what = format!("{heads}:{kv_heads}x{head_dim} {act:?}: joined in the block");
                assert_eq!(g.decode_joined(), act != DType::F32 && head_dim <= 128, "{what}");
            }
        });
    }
    g.set_activation_dtype(DType::F32);
}

/// An FP8 KV cache (--kv-cache-dtype fp8) on every attention kernel that reads one: the GPU
/// writes the CPU's bytes (nearest even, saturated at ±448: k and v reach ±500) and attends
/// as the CPU does over them. An f32 model takes the split and one-block-per-head kernels;
/// on tensor cores (an f32 or a 16-bit model) prefill takes flash_prefill and decode
/// flash_decode (64 and 128 dims), with windows and soft caps and with cache blocks of 8
/// and 32 keys; head size 256 takes the one-block-per-head kernel (flash_decode's 256 reads
/// 16-bit caches only). Every case also with per-layer k and v scales.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --release --test cuda -- --ignored"]
fn fp8_caches_match_the_cpu_on_every_kernel() {
    let (g, _turn) = gpu();
    let c = CpuDevice::default();
    let cases = [
        ((32, 8, 128), false, DType::F32, 16, 0, 0.0),
        ((12, 1, 64), false, DType::F32, 16, 0, 0.0),
        ((32, 8, 128), true, DType::F32, 16, 0, 0.0),
        ((14, 2, 64), true, DType::BF16, 16, 0, 0.0),
        ((32, 8, 128), true, DType::BF16, 8, 100, 0.0),
        ((16, 8, 64), true, DType::F16, 32, 0, 0.25),
        ((8, 4, 256), true, DType::BF16, 16, 100, 0.5),
    ];
    const AMP: f32 = 1000.0;
    // Each case with a scale of 1, then with a checkpoint's per-layer scales (K divided by
    // 0.8 still saturates in places).
    let scales = [KvScales::default(), KvScales { k: 0.8, v: 2.5 }];
    for (((heads, kv_heads, head_dim), flash, act, bs, window, softcap), scales) in
        cases.into_iter().flat_map(|case| scales.map(|s| (case, s)))
    {
        g.set_tensor_core_attention(flash);
        g.set_activation_dtype(act);
        let s =
            AttnShape { window, softcap, scale: 0.5 / AMP, ..AttnShape::causal(heads, kv_heads, head_dim) };
        let steps = [
            (vec![(0, 0..700)], 60),
            (vec![(0, 700..760), (1, 0..300)], 61),
            (vec![(0, 760..761), (1, 300..301), (2, 0..1)], 62),
            (scattered_decode_rows(), 63),
            (vec![(0, 5..6), (1, 12..13), (2, 15..16)], 64),
        ];
        let tc_shape = flash && matches!(head_dim, 64 | 128);
        let tol = if flash { 2e-2 } else { 1e-4 };
        let kv = (KvDtype::Fp8E4m3, AMP, scales);
        attention_steps(&g, &c, (s, act, bs, tol), kv, &steps, |g, _, seq_pos| {
            let prefill = seq_pos.iter().any(|(_, r)| r.len() > 1);
            assert_eq!(g.tensor_core_tiles() > 0, tc_shape && prefill, "prefill on tensor cores");
            if !prefill {
                assert_eq!(g.tensor_core_decode(), tc_shape, "decode on tensor cores");
            }
        });
    }
    g.set_activation_dtype(DType::F32);
}

/// A runner on the GPU, driven step by step: once a step's shapes have been seen, it
/// allocates no device memory, and seeded sampling repeats exactly.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --release --test cuda -- --ignored"]
fn steps_allocate_nothing_once_their_shapes_were_seen() {
    let (g, _turn) = gpu();
    let model = tiny_model(37);
    let loaded = ModelRegistry::<CudaDevice>::default()
        .load(&g, &model, DType::F32, &LoadOptions::default())
        .expect("tiny model loads");
    let cfg = RunnerConfig {
        num_blocks: 64,
        block_size: 16,
        kv_dtype: KvDtype::Auto,
        kv_scales: None,
        calculate_kv_scales: false,
    };
    let mut runner = ModelRunner::new(g, loaded.model, cfg, vec![0].into()).expect("runner");
    let params = [
        SamplingParams { temperature: 0.0, ..Default::default() },
        SamplingParams { temperature: 0.8, top_p: 0.9, logprobs: Some(3), ..Default::default() },
        SamplingParams { temperature: 1.0, top_k: 20, repetition_penalty: 1.2, ..Default::default() },
        SamplingParams { temperature: 0.7, frequency_penalty: 0.5, min_tokens: 4, ..Default::default() },
    ]
    .map(std::sync::Arc::new);
    let (prompt_len, decode_steps) = (20, 30);
    // One round: four sequences prefill together, then decode together.
    let mut round = |first_id: u64| -> (Vec<Vec<u32>>, Vec<u64>) {
        let mut tokens = vec![Vec::new(); params.len()];
        let mut allocs = Vec::new();
        for step in 0..=decode_steps {
            let seqs = (0..params.len())
                .map(|i| {
                    let prompt: Vec<u32> =
                        (0..prompt_len as u32).map(|j| (i as u32 * 31 + j * 7) % 250 + 3).collect();
                    let (start, len) = if step == 0 { (0, prompt_len) } else { (prompt_len + step - 1, 1) };
                    BatchSeq {
                        seq: first_id + i as u64,
                        new: (step == 0).then(|| NewSeq {
                            tokens: prompt,
                            prompt_len,
                            params: params[i].clone(),
                            seed: 7 + i as u64,
                            index: 0,
                        }),
                        start,
                        len,
                        sample: true,
                        block_table: (0..4).map(|b| (i * 4 + b) as u32).collect(),
                        lora_slot: -1,
                    }
                })
                .collect();
            let dropped = if step == 0 { (0..first_id).collect() } else { Vec::new() };
            let out = runner
                .execute(ExecuteBatch { seqs, dropped, follows: step > 0, ..Default::default() })
                .expect("step runs");
            for s in &out.sampled {
                tokens[(s.seq - first_id) as usize].push(s.token);
            }
            allocs.push(out.timing.device_allocs);
        }
        (tokens, allocs)
    };
    let (first_tokens, first_allocs) = round(0);
    let (tokens, allocs) = round(100);
    assert!(first_allocs[0] > 0, "the first prefill allocates its buffers (the counter counts)");
    assert_eq!(allocs, vec![0; decode_steps + 1], "steps of shapes already seen allocated device memory");
    assert_eq!(tokens, first_tokens, "the same seeds sample the same tokens");
    assert!(tokens.iter().all(|t| t.len() == decode_steps + 1));
}

/// Structured output on the GPU: the masks go up with the sampling rows and the device
/// applies them, so every output follows its schema (greedy and sampled, a random model
/// of the default model's shapes and vocabulary), and a free request beside them gets the
/// tokens it gets alone.
#[actix_rt::test]
#[ignore = "needs a CUDA GPU: cargo test --release --test cuda -- --ignored"]
async fn structured_output_on_the_gpu_follows_every_schema() {
    use serde_json::{Value, json};
    let _turn = gpu_turn();
    let model = smollm2_model();
    let s = common::server::start(&model, |a| a.engine.device = DeviceArg::Cuda).await;
    let free = json!({"prompt": [5, 6, 7, 8], "max_tokens": 24, "temperature": 0, "ignore_eos": true});
    let (_, alone) = s.post("/v1/completions", &free).await;
    let schemas = common::structured::schemas();
    let mut bodies = Vec::new();
    for (i, schema) in schemas.iter().enumerate() {
        for sampling in [json!({"temperature": 0}), json!({"temperature": 1.0, "seed": i, "n": 2})] {
            let mut body =
                json!({"prompt": [11, 12, 13, i as u32 + 20], "max_tokens": 300, "guided_json": schema});
            body.as_object_mut().unwrap().extend(sampling.as_object().unwrap().clone());
            bodies.push((i, body));
        }
    }
    let frees = futures::future::join_all((0..4).map(|_| s.post("/v1/completions", &free)));
    let guided = futures::future::join_all(bodies.iter().map(|(_, b)| s.post("/v1/completions", b)));
    let (frees, outs) = futures::join!(frees, guided);
    for (_, v) in frees {
        assert_eq!(v["choices"][0]["text"], alone["choices"][0]["text"], "a free request beside guided ones");
    }
    for ((i, body), (status, out)) in bodies.iter().zip(outs) {
        assert_eq!(status, 200, "{out}");
        let check = common::structured::validator(&schemas[*i]);
        for c in out["choices"].as_array().unwrap() {
            let text = c["text"].as_str().unwrap();
            assert_eq!(c["finish_reason"], "stop", "schema {i} ({body}) did not finish: {text:?}");
            let value: Value =
                serde_json::from_str(text).unwrap_or_else(|e| panic!("schema {i}: {e}: {text:?}"));
            assert!(check.is_valid(&value), "schema {i}: {text} breaks it");
        }
    }
}

#[actix_rt::test]
#[ignore = "needs a CUDA GPU: cargo test --release --test cuda -- --ignored"]
async fn the_engine_on_the_gpu_gives_the_cpu_tokens() {
    let _turn = gpu_turn();
    let model = tiny_model(31);
    let prompts: Vec<Vec<u32>> =
        (0..6u32).map(|i| (0..(4 + 9 * i)).map(|j| (i * 13 + j * 7) % 250 + 3).collect()).collect();
    let params = actorllm::SamplingParams { ignore_eos: true, ..greedy(40) };
    // Penalties count the tokens themselves: the runner then waits for a step's tokens
    // before it issues the next, instead of letting the device feed them.
    let penalized = actorllm::SamplingParams { repetition_penalty: 1.3, ..params.clone() };
    let cpu = Engine::start(EngineArgs { device: DeviceArg::Cpu, ..common::args(&model) }).await.unwrap();
    let want = futures::future::join_all(prompts.iter().map(|p| run(&cpu, p.clone(), params.clone()))).await;
    let want_penalized =
        futures::future::join_all(prompts.iter().map(|p| run(&cpu, p.clone(), penalized.clone()))).await;
    drop(cpu);
    for (label, args) in [
        (
            "gpu, CUDA graphs, one step at a time",
            EngineArgs { device: DeviceArg::Cuda, async_scheduling: false, ..common::args(&model) },
        ),
        ("gpu, eager", EngineArgs { device: DeviceArg::Cuda, enforce_eager: true, ..common::args(&model) }),
        (
            "gpu, small pool",
            EngineArgs {
                device: DeviceArg::Cuda,
                num_gpu_blocks_override: Some(12),
                max_model_len: Some(128),
                ..common::args(&model)
            },
        ),
        (
            "gpu, CUDA graphs, async scheduling",
            EngineArgs { device: DeviceArg::Cuda, ..common::args(&model) },
        ),
    ] {
        let (eager, pipelined) = (args.enforce_eager, args.async_scheduling);
        // The engine before this one releases its device first: a KV cache still held
        // would leave this one's profiling little memory.
        runners_released().await;
        let gpu = Engine::start(args).await.unwrap();
        let got =
            futures::future::join_all(prompts.iter().map(|p| run(&gpu, p.clone(), params.clone()))).await;
        for (w, g) in want.iter().zip(&got) {
            assert_eq!(g.tokens, w.tokens, "{label}");
        }
        // Decode steps replay graphs unless --enforce-eager says otherwise.
        let replayed = gpu.metrics().profile.graph_steps.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(replayed > 0, !eager, "{label}: {replayed} steps replayed from graphs");
        // Replayed decode steps that followed another report the device's wait for them.
        let idle = gpu.metrics().profile.graph_idle_steps.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(idle > 0, !eager, "{label}: {idle} replayed steps with the device's idle time");
        // With async scheduling a decode step is issued before the last one's tokens are
        // back, and the device feeds them (graphs and eager alike); one step at a time, never.
        let fed = gpu.metrics().profile.fed_steps.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(fed > 0, pipelined, "{label}: {fed} steps fed their tokens on the device");
        if pipelined && !eager {
            let got =
                futures::future::join_all(prompts.iter().map(|p| run(&gpu, p.clone(), penalized.clone())))
                    .await;
            for (w, g) in want_penalized.iter().zip(&got) {
                assert_eq!(g.tokens, w.tokens, "{label}, repetition penalty");
            }
        }
        let (free, total) = common::wait_all_blocks_free(&gpu).await;
        assert_eq!(free, total, "{label}");
        eprintln!(
            "{label}: {} preemptions",
            gpu.metrics().preemptions.load(std::sync::atomic::Ordering::Relaxed)
        );
    }
}

/// Beam search on the GPU gives the CPU's hypotheses in the CPU's order: a forked beam's
/// copy of its parent's partly filled block is made on the device before the step that
/// reads it, with decode steps replayed from graphs, and in a pool so small that beams are
/// preempted and computed again.
#[actix_rt::test]
#[ignore = "needs a CUDA GPU: cargo test --release --test cuda -- --ignored"]
async fn beam_search_on_the_gpu_gives_the_cpu_hypotheses() {
    use actorllm::request::{BeamParams, EarlyStopping};
    let _turn = gpu_turn();
    let model = tiny_model(31);
    let prompts: Vec<Vec<u32>> =
        (0..4u32).map(|i| (0..(5 + 11 * i)).map(|j| (i * 17 + j * 5) % 250 + 3).collect()).collect();
    let beam = BeamParams { width: 4, length_penalty: 1.0, early_stopping: EarlyStopping::Heuristic };
    let params = actorllm::SamplingParams {
        n: 3,
        max_tokens: Some(24),
        ignore_eos: true,
        beam: Some(beam),
        ..actorllm::SamplingParams::default()
    };
    let cpu = Engine::start(EngineArgs { device: DeviceArg::Cpu, ..common::args(&model) }).await.unwrap();
    let want = futures::future::join_all(prompts.iter().map(|p| run(&cpu, p.clone(), params.clone()))).await;
    drop(cpu);
    for (label, args) in [
        ("gpu, CUDA graphs", EngineArgs { device: DeviceArg::Cuda, ..common::args(&model) }),
        (
            "gpu, small pool",
            EngineArgs {
                device: DeviceArg::Cuda,
                num_gpu_blocks_override: Some(10),
                max_model_len: Some(128),
                ..common::args(&model)
            },
        ),
    ] {
        runners_released().await;
        let gpu = Engine::start(args).await.unwrap();
        let got =
            futures::future::join_all(prompts.iter().map(|p| run(&gpu, p.clone(), params.clone()))).await;
        for (w, g) in want.iter().zip(&got) {
            assert_eq!(g.tokens.len(), 3, "{label}");
            assert_eq!(g.tokens, w.tokens, "{label}");
        }
        let (free, total) = common::wait_all_blocks_free(&gpu).await;
        assert_eq!(free, total, "{label}");
        let preempted = gpu.metrics().preemptions.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(preempted > 0, label.ends_with("small pool"), "{label}: {preempted} preemptions");
    }
}

/// `prompt_logprobs` on the GPU give the CPU's (within float noise): the logits of every
/// prompt row are computed after the forward, a few hundred rows at a time, and read back;
/// with the prompts whole and prefilled in chunks.
#[actix_rt::test]
#[ignore = "needs a CUDA GPU: cargo test --release --test cuda -- --ignored"]
async fn prompt_logprobs_on_the_gpu_give_the_cpu_ones() {
    let _turn = gpu_turn();
    let model = tiny_model(31);
    let prompts: Vec<Vec<u32>> =
        (0..3u32).map(|i| (0..(7 + 300 * i)).map(|j| (i * 11 + j * 13) % 250 + 3).collect()).collect();
    let params = actorllm::SamplingParams { prompt_logprobs: Some(4), ..greedy(2) };
    let cpu = Engine::start(EngineArgs { device: DeviceArg::Cpu, ..common::args(&model) }).await.unwrap();
    let want = futures::future::join_all(prompts.iter().map(|p| run(&cpu, p.clone(), params.clone()))).await;
    drop(cpu);
    for (label, args) in [
        ("gpu", EngineArgs { device: DeviceArg::Cuda, ..common::args(&model) }),
        (
            "gpu, chunks of 128",
            EngineArgs {
                device: DeviceArg::Cuda,
                max_num_batched_tokens: Some(128),
                max_num_seqs: Some(8),
                ..common::args(&model)
            },
        ),
    ] {
        runners_released().await;
        let gpu = Engine::start(args).await.unwrap();
        let got =
            futures::future::join_all(prompts.iter().map(|p| run(&gpu, p.clone(), params.clone()))).await;
        for ((w, g), p) in want.iter().zip(&got).zip(&prompts) {
            assert_eq!(g.tokens, w.tokens, "{label}");
            let (w, g) = (w.prompt_logprobs.as_ref().unwrap(), g.prompt_logprobs.as_ref().unwrap());
            assert_eq!((w.len(), g.len()), (p.len(), p.len()), "{label}");
            for (pos, (w, g)) in w.iter().zip(g).enumerate().skip(1) {
                let (w, g) = (w.as_ref().unwrap(), g.as_ref().unwrap());
                assert_eq!(g.token_id, p[pos], "{label}");
                assert!(
                    (g.logprob - w.logprob).abs() <= 1e-3,
                    "{label}, position {pos}: {} against {}",
                    g.logprob,
                    w.logprob
                );
                for (&(_, gl), &(_, wl)) in g.top.iter().zip(&w.top) {
                    assert!((gl - wl).abs() <= 1e-3, "{label}, position {pos}: top {gl} against {wl}");
                }
            }
        }
    }
}

/// LoRA on the GPU gives the CPU's greedy tokens (the CPU's adapters match PEFT, see
/// tests/lora.rs): one batch mixes two adapters of ranks 8 and 4 with the base model, with
/// decode steps replayed from graphs (the graph set that applies adapters) and eager.
#[actix_rt::test]
#[ignore = "needs a CUDA GPU: cargo test --release --test cuda -- --ignored"]
async fn adapters_on_the_gpu_give_the_cpu_tokens() {
    let _turn = gpu_turn();
    let model = tiny_model(33);
    let cfg = ModelRegistry::<CpuDevice>::default().read_config(&model).unwrap();
    let scratch = common::scratch("gpu-loras");
    let root = scratch.path();
    let mut modules = Vec::new();
    for (i, rank) in [8, 4].into_iter().enumerate() {
        let dir = root.join(format!("a{i}"));
        actorllm::models::random::make_random_lora(&cfg, &dir, rank, 40 + i as u64).unwrap();
        modules.push((format!("a{i}"), dir));
    }
    let lora = actorllm::config::LoraArgs {
        enable_lora: true,
        lora_modules: modules,
        max_loras: 2,
        max_lora_rank: 8,
        ..Default::default()
    };
    let args = |device, enforce_eager| EngineArgs {
        device,
        enforce_eager,
        lora: lora.clone(),
        ..common::args(&model)
    };
    let runs: Vec<(Vec<u32>, Option<&str>)> = (0..6u32)
        .map(|i| {
            let prompt = (0..(5 + 7 * i)).map(|j| (i * 11 + j * 5) % 250 + 3).collect();
            (prompt, [None, Some("a0"), Some("a1")][i as usize % 3])
        })
        .collect();
    let params = actorllm::SamplingParams { ignore_eos: true, ..greedy(32) };
    let all = |engine: Engine| {
        let runs = runs.clone();
        let params = params.clone();
        async move {
            let reqs = runs.iter().map(|(p, l)| {
                let (engine, params) = (&engine, params.clone());
                async move {
                    let id = engine.next_request_id("t");
                    let s = engine.add_request_with_lora(id, p.clone(), params, *l).await.unwrap();
                    common::collect(s, 1).await.tokens.remove(0)
                }
            });
            let tokens = futures::future::join_all(reqs).await;
            let replayed = engine.metrics().profile.graph_steps.load(std::sync::atomic::Ordering::Relaxed);
            (tokens, replayed)
        }
    };
    let (want, _) = all(Engine::start(args(DeviceArg::Cpu, false)).await.unwrap()).await;
    // The adapters change the output: the base model's tokens differ on the same prompt.
    let base = Engine::start(EngineArgs { device: DeviceArg::Cpu, ..common::args(&model) }).await.unwrap();
    let plain = run(&base, runs[1].0.clone(), params.clone()).await;
    drop(base);
    assert_ne!(plain.tokens[0], want[1], "adapter a0 leaves the output as the base model's");
    for eager in [false, true] {
        // A cache of fixed size: the engine before may still hold its device's memory.
        let args = EngineArgs {
            num_gpu_blocks_override: Some(256),
            max_model_len: Some(512),
            ..args(DeviceArg::Cuda, eager)
        };
        let (got, replayed) = all(Engine::start(args).await.unwrap()).await;
        for ((w, g), (_, l)) in want.iter().zip(&got).zip(&runs) {
            assert_eq!(g, w, "eager {eager}, adapter {l:?}");
        }
        assert_eq!(replayed > 0, !eager, "eager {eager}: {replayed} steps replayed from graphs");
    }
}

/// Tensor parallelism over NCCL (needs two GPUs): split over 2 ranks, the engine gives the
/// tokens of one GPU, for the tiny model and a Qwen2-0.5B-shaped one (q/k/v bias, 14 heads
/// over 2 KV heads, a tied vocabulary of 151936).
#[actix_rt::test]
#[ignore = "needs 2 CUDA GPUs: cargo test --release --test cuda -- --ignored two_gpus"]
async fn two_gpus_give_the_one_gpu_tokens() {
    let _turn = gpu_turn_of(2);
    let qwen = common::scratch("qwen-shape");
    let mut shape = actorllm::models::random::Preset::Qwen2_0_5b.shape();
    shape.layers = 4;
    actorllm::models::random::make_random_model(shape, qwen.path(), DType::F32, 5, 4.0).unwrap();
    for model in [tiny_model(41), qwen] {
        let prompts: Vec<Vec<u32>> =
            (0..5u32).map(|i| (0..(3 + 11 * i)).map(|j| (i * 17 + j * 5) % 250 + 3).collect()).collect();
        let params = actorllm::SamplingParams { ignore_eos: true, ..greedy(32) };
        let mut outs = Vec::new();
        for tp in [1, 2] {
            // Both engines stay up until the test ends: neither may take the GPUs' memory.
            let args = EngineArgs {
                device: DeviceArg::Cuda,
                tensor_parallel_size: tp,
                num_gpu_blocks_override: Some(1024),
                max_model_len: Some(2048),
                ..common::args(&model)
            };
            let engine = Engine::start(args).await.unwrap();
            let got =
                futures::future::join_all(prompts.iter().map(|p| run(&engine, p.clone(), params.clone())))
                    .await;
            outs.push(got.into_iter().map(|o| o.tokens).collect::<Vec<_>>());
        }
        assert_eq!(outs[1], outs[0], "TP=2 against TP=1 on {}", model.path().display());
    }
}

/// The tiny model's engine flags on the GPU for the tests of groups that span nodes.
fn group_test_args(model: &common::ScratchDir) -> EngineArgs {
    EngineArgs {
        device: DeviceArg::Cuda,
        num_gpu_blocks_override: Some(512),
        max_model_len: Some(1024),
        ..common::args(model)
    }
}

/// Four prompts' 24 greedy tokens from `engine`.
async fn group_test_tokens(engine: &Engine) -> Vec<Vec<Vec<u32>>> {
    let prompts: Vec<Vec<u32>> =
        (0..4u32).map(|i| (0..(3 + 13 * i)).map(|j| (i * 19 + j * 7) % 250 + 3).collect()).collect();
    let params = actorllm::SamplingParams { ignore_eos: true, ..greedy(24) };
    let runs = prompts.iter().map(|p| run(engine, p.clone(), params.clone()));
    futures::future::join_all(runs).await.into_iter().map(|o| o.tokens).collect()
}

/// A group's health as a node link reports it, set by the test.
#[derive(Default)]
struct TestHealth(std::sync::Mutex<Option<String>>);

impl actorllm::kernels::GroupHealth for TestHealth {
    fn failure(&self) -> Option<String> {
        self.0.lock().unwrap().clone()
    }
    fn fail(&self, why: String) {
        *self.0.lock().unwrap() = Some(why);
    }
}

/// The ranks of a group that spans nodes join NCCL by node 0's unique id and wait on the
/// device by polling the group's health. A group of one such rank gives the plain GPU's
/// tokens, with graphs, and the engine reports the group's failure as its own.
#[actix_rt::test]
#[ignore = "needs a CUDA GPU: cargo test --release --test cuda -- --ignored"]
async fn a_rank_joined_by_an_nccl_id_gives_the_plain_gpu_tokens() {
    use actorllm::error::EngineError;
    let _turn = gpu_turn();
    let model = tiny_model(41);
    let args = group_test_args(&model);
    runners_released().await;
    let want = group_test_tokens(&Engine::start(args.clone()).await.unwrap()).await;
    runners_released().await;
    let health = std::sync::Arc::new(TestHealth::default());
    let link = health.clone();
    let engine = Engine::start_on(args, ModelRegistry::<CudaDevice>::default(), move |_| {
        let device = |e: actorllm::kernels::DeviceError| EngineError::Device(e.to_string());
        let id = CudaDevice::nccl_id().map_err(device)?;
        assert_eq!(id.len(), 128);
        let ranks = CudaDevice::node_group(0, 1, 1, &id).map_err(device)?;
        Ok(ranks.into_iter().map(|d| d.in_node_group(link.clone(), None)).collect())
    })
    .await
    .unwrap();
    assert_eq!(group_test_tokens(&engine).await, want);
    assert_eq!(engine.failure(), None);
    actorllm::kernels::GroupHealth::fail(health.as_ref(), "node 1 closed the connection".into());
    assert_eq!(engine.failure().as_deref(), Some("node 1 closed the connection"));
}

/// Two nodes of one GPU each (needs two GPUs): node 0 in the test on GPU 0, node 1 an
/// `actorllm serve --node-rank 1` process on GPU 1, joined by NCCL. They give one GPU's
/// tokens; killed mid-stream, node 1 ends the stream with an error within 5 s and leaves
/// node 0 failed, not hung in the collective it waited in.
#[actix_rt::test]
#[ignore = "needs 2 CUDA GPUs: cargo test --release --test cuda -- --ignored two_gpu_nodes"]
async fn two_gpu_nodes_give_the_one_gpu_tokens() {
    use futures::StreamExt;
    let _turn = gpu_turn_of(2);
    let model = tiny_model(41);
    let args = group_test_args(&model);
    runners_released().await;
    let want = group_test_tokens(&Engine::start(args.clone()).await.unwrap()).await;
    runners_released().await;
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    // The server binary where cargo built it, else beside this test's binary (a GPU host
    // given both, with neither at its build path).
    let built = std::path::PathBuf::from(env!("CARGO_BIN_EXE_actorllm"));
    let bin =
        if built.exists() { built } else { std::env::current_exe().unwrap().with_file_name("actorllm") };
    let mut node = std::process::Command::new(bin)
        .args(["serve", "--model", model.path().to_str().unwrap(), "--device", "cuda"])
        .args(["--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1"])
        .args(["--master-port", &port.to_string(), "--rank-timeout", "20"])
        .args(["--num-gpu-blocks-override", "512", "--max-model-len", "1024"])
        .env("CUDA_VISIBLE_DEVICES", "1")
        .env("RUST_LOG", "warn")
        .spawn()
        .expect("actorllm runs");
    let lead = EngineArgs {
        tensor_parallel_size: 2,
        cluster: actorllm::cluster::ClusterArgs {
            nnodes: 2,
            master_port: port,
            rank_timeout: 20.0,
            ..Default::default()
        },
        ..args
    };
    let engine = Engine::start(lead).await.expect("the group of two GPU nodes starts");
    assert_eq!(group_test_tokens(&engine).await, want, "two GPU nodes against one GPU");
    let long = actorllm::SamplingParams { ignore_eos: true, ..greedy(900) };
    let mut s = engine.add_request(engine.next_request_id("t"), vec![5, 6, 7], long).await.unwrap();
    let (mut tokens, mut killed, mut error) = (0, None, None);
    while let Some(ev) =
        tokio::time::timeout(std::time::Duration::from_secs(30), s.next()).await.expect("an event in time")
    {
        match ev {
            actorllm::request::TokenEvent::Token { .. } => tokens += 1,
            actorllm::request::TokenEvent::Error { message } => error = Some(message),
            _ => {}
        }
        if tokens == 5 && killed.is_none() {
            node.kill().unwrap();
            killed = Some(std::time::Instant::now());
        }
    }
    let _ = node.wait();
    let took = killed.expect("tokens before the kill").elapsed();
    assert!(took < std::time::Duration::from_secs(5), "the stream ended {took:?} after the kill");
    let error = error.expect("the stream ends with an error");
    assert!(error.contains("node 1"), "{error}");
    assert!(engine.failure().is_some_and(|f| f.contains("node 1")));
}

/// Each prompt's greedy tokens, each with its top logprobs.
type Outputs = Vec<Vec<(u32, Vec<(u32, f32)>)>>;

/// Each prompt's `tokens` greedy tokens with their `top` best logprobs, from an engine
/// started with `args` once the runners before it have released their devices.
async fn top_outputs(tokens: usize, top: usize, args: EngineArgs, prompts: &[Vec<u32>]) -> Outputs {
    use futures::StreamExt;
    runners_released().await;
    let engine = Engine::start(args).await.unwrap();
    let params = actorllm::SamplingParams { ignore_eos: true, logprobs: Some(top), ..greedy(tokens) };
    let runs = prompts.iter().map(|p| {
        let (engine, params) = (engine.clone(), params.clone());
        async move {
            let mut s = engine.add_request(engine.next_request_id("t"), p.clone(), params).await.unwrap();
            let mut out = Vec::new();
            while let Some(ev) = s.next().await {
                match ev {
                    actorllm::request::TokenEvent::Token { token_id, logprobs, .. } => {
                        out.push((token_id, logprobs.expect("asked for logprobs").top));
                    }
                    actorllm::request::TokenEvent::Error { message } => panic!("request failed: {message}"),
                    _ => {}
                }
            }
            assert_eq!(out.len(), tokens, "every run gives its {tokens} tokens");
            out
        }
    });
    futures::future::join_all(runs).await
}

/// How many of `got`'s outputs part from `want`'s, asserting that each parts only to one
/// of `want`'s listed candidates whose logprob was within `margin` of the best.
fn parted_at_near_ties(what: &str, want: &Outputs, got: &Outputs, margin: f32) -> usize {
    assert_eq!(want.len(), got.len(), "{what}: outputs");
    let mut parted = 0;
    for (i, (want, got)) in want.iter().zip(got).enumerate() {
        let Some(at) = want.iter().zip(got).position(|(w, g)| w.0 != g.0) else { continue };
        parted += 1;
        let top = &want[at].1;
        let took = top.iter().find(|c| c.0 == got[at].0);
        let gap = took.map(|c| top[0].1 - c.1);
        assert!(
            gap.is_some_and(|g| g < margin),
            "{what}: prompt {i} parts at token {at}: candidates {top:?}, took {} (behind by {gap:?})",
            got[at].0
        );
    }
    parted
}

/// bf16 on the GPU against f32 on the CPU (the default model, ACTORLLM_TEST_MODEL or a
/// random model of its shapes: [`smollm2_model`]): the
/// greedy outputs may part only where the f32 run's two best candidates were within a
/// small logprob margin, and then for the f32 run's runner-up.
#[actix_rt::test]
#[ignore = "needs a CUDA GPU: cargo test --release --test cuda -- --ignored"]
async fn bf16_parts_from_f32_only_at_near_ties() {
    let _turn = gpu_turn();
    const MARGIN: f32 = 0.5;
    let model = smollm2_model();
    let prompts: Vec<Vec<u32>> =
        (0..8u32).map(|i| (0..(5 + 13 * i)).map(|j| (i * 31 + j * 11) % 4000 + 20).collect()).collect();
    let f32_cpu = top_outputs(
        48,
        2,
        EngineArgs { device: DeviceArg::Cpu, dtype: DTypeArg::Float32, ..common::args(&model) },
        &prompts,
    )
    .await;
    let bf16_gpu = top_outputs(
        48,
        2,
        EngineArgs {
            device: DeviceArg::Cuda,
            dtype: DTypeArg::Bfloat16,
            num_gpu_blocks_override: Some(2048),
            ..common::args(&model)
        },
        &prompts,
    )
    .await;
    assert_eq!((f32_cpu.len(), bf16_gpu.len()), (prompts.len(), prompts.len()));
    let parted = parted_at_near_ties("bf16 against f32", &f32_cpu, &bf16_gpu, MARGIN);
    eprintln!("{parted} of {} bf16 outputs parted from f32, each at a near tie", prompts.len());
}

/// Quantized checkpoints on the GPU keep their projections packed: a GPTQ one (4-bit,
/// groups of 32 in order, f16 scales), an FP8 one (vLLM's format, blocks of 64, bf16
/// elsewhere), and a 16-bit one quantized to FP8 at load (`--quantization fp8`). Decode
/// steps read them in the GEMVs (the fused gate/up, residual norm and qkv RoPE ones
/// included); prompts widen them for cuBLAS, except FP8 weights with one scale a row (all
/// of the one quantized at load, the 64-column ones of the blocks), whose prompts run W8A8
/// on GPUs with FP8 tensor cores. Each gives the tokens of the same model dequantized on
/// the GPU, with graphs and eager; outputs may part only where the dequantized model's two
/// best candidates were within a hair (the sums are taken in another order), or, where
/// prompts quantize x to FP8 too, within the margin that rounding moves logprobs by.
#[actix_rt::test]
#[ignore = "needs a CUDA GPU: cargo test --release --test cuda -- --ignored"]
async fn packed_checkpoints_on_the_gpu_give_their_dequantized_tokens() {
    let _turn = gpu_turn();
    const MARGIN: f32 = 0.02;
    // x rounded to e4m3 in the prompts' GEMMs (3 mantissa bits, some 4 % of each value)
    // moves this random model's logprobs, whose best five often lie within a nat, by up to
    // 0.85 nats at the first token (the GEMMs themselves match a W8A8 reference in
    // `every_kernel_matches_its_cpu_twin`).
    const W8A8_MARGIN: f32 = 1.0;
    let model = tiny_model(47);
    let weights = std::fs::read(model.path().join("model.safetensors")).unwrap();
    let prompts: Vec<Vec<u32>> =
        (0..6u32).map(|i| (0..(3 + 11 * i)).map(|j| (i * 17 + j * 5) % 250 + 3).collect()).collect();
    // (label, checkpoint, its dequantized copy, dtype, --quantization): the third is the
    // tiny model itself quantized at load (one FP8 scale a row).
    let (_, per_row, _) = common::quantized::fp8_blocks(&weights, (1, usize::MAX));
    let checkpoints = [
        ("GPTQ", Some(common::quantized::gptq4(&weights, 32, true)), None, DTypeArg::Float16, None, MARGIN),
        (
            "FP8",
            Some(common::quantized::fp8_blocks(&weights, (64, 64))),
            None,
            DTypeArg::Bfloat16,
            None,
            W8A8_MARGIN,
        ),
        ("FP8 at load", None, Some(per_row), DTypeArg::Bfloat16, Some("fp8"), W8A8_MARGIN),
    ];
    for (label, written, online, dtype, flag, margin) in checkpoints {
        let (quantized, reference) = (common::scratch("gpu-packed"), common::scratch("gpu-packed-reference"));
        let (model_dir, dequantized) = match (written, online) {
            (Some((packed, dequantized, q)), _) => {
                common::quantized::write_model(model.path(), quantized.path(), &packed, Some(q));
                (quantized.path(), dequantized)
            }
            (None, Some(dequantized)) => (model.path(), dequantized),
            (None, None) => unreachable!("each case has a checkpoint or a copy"),
        };
        common::quantized::write_model(model.path(), reference.path(), &dequantized, None);
        let on_gpu = |dir: &std::path::Path, eager: bool, q: Option<&str>| EngineArgs {
            device: DeviceArg::Cuda,
            dtype,
            enforce_eager: eager,
            quantization: q.map(Into::into),
            ..common::args(dir)
        };
        for eager in [false, true] {
            let want = top_outputs(32, 5, on_gpu(reference.path(), eager, None), &prompts).await;
            let got = top_outputs(32, 5, on_gpu(model_dir, eager, flag), &prompts).await;
            let parted = parted_at_near_ties(&format!("{label}, eager {eager}"), &want, &got, margin);
            let most = if margin == MARGIN { 1 } else { prompts.len() };
            assert!(parted <= most, "{label}, eager {eager}: {parted} of {} outputs parted", prompts.len());
            eprintln!("{label}, eager {eager}: {parted} of {} outputs parted at near ties", prompts.len());
        }
    }
}

/// `--gpu-memory-utilization` holds: after a profiling step at the largest batch, the KV
/// cache takes what is left, so a step at that batch neither runs out of memory nor leaves
/// the GPU's reserve short, and no memory the fraction allows sits unused. In bf16, so
/// that the GEMMs are tuned after the profiling step, in memory that is given back.
#[actix_rt::test]
#[ignore = "needs a CUDA GPU: cargo test --release --test cuda -- --ignored"]
async fn the_kv_cache_takes_what_gpu_memory_utilization_leaves() {
    let (probe, _turn) = gpu();
    // Engines of earlier tests release their devices first.
    actorllm::actors::model_runner::wait_for_runners(std::time::Duration::from_secs(30));
    let (_, total) = probe.memory_info().expect("a GPU reports its memory");
    let model = smollm2_model();
    let args = EngineArgs {
        device: DeviceArg::Cuda,
        max_num_seqs: Some(32),
        max_num_batched_tokens: Some(8192),
        max_model_len: Some(512),
        dtype: DTypeArg::Bfloat16,
        ..common::args(&model)
    };
    let keep = ((1.0 - args.gpu_memory_utilization) * total as f64) as i64;
    let engine = Engine::start(args).await.unwrap();
    let prompts: Vec<Vec<u32>> =
        (0..32u32).map(|i| (0..256).map(|j| (i * 7 + j) % 1000 + 20).collect()).collect();
    let params = actorllm::SamplingParams { ignore_eos: true, ..greedy(2) };
    let done =
        futures::future::join_all(prompts.iter().map(|p| run(&engine, p.clone(), params.clone()))).await;
    assert!(done.iter().all(|o| o.tokens[0].len() == 2), "the largest batch ran");
    let (free, _) = probe.memory_info().unwrap();
    let free = free as i64;
    eprintln!("reserve {} MiB, free after the largest batch {} MiB", keep >> 20, free >> 20);
    assert!(free >= keep - (64 << 20), "the engine went {} MiB into the reserve", (keep - free) >> 20);
    assert!(free <= keep + (512 << 20), "{} MiB beyond the reserve sat unused", (free - keep) >> 20);
}

/// Seeded sampling with penalties and logprobs, sampled on the GPU: the same tokens alone
/// or among other requests, and the same tokens as the host's sampler on the CPU engine.
#[actix_rt::test]
#[ignore = "needs a CUDA GPU: cargo test --release --test cuda -- --ignored"]
async fn seeded_sampling_on_the_gpu_is_batch_invariant_and_matches_the_host() {
    let _turn = gpu_turn();
    let model = tiny_model(41);
    let sampled = |seed| actorllm::SamplingParams {
        temperature: 0.9,
        top_k: 40,
        repetition_penalty: 1.2,
        frequency_penalty: 0.3,
        min_tokens: 4,
        logprobs: Some(2),
        seed: Some(seed),
        ignore_eos: true,
        max_tokens: Some(32),
        ..Default::default()
    };
    let prompts: Vec<Vec<u32>> =
        (0..5u32).map(|i| (0..(6 + 7 * i)).map(|j| (i * 17 + j * 5) % 250 + 3).collect()).collect();
    let gpu = Engine::start(EngineArgs { device: DeviceArg::Cuda, ..common::args(&model) }).await.unwrap();
    let alone = run(&gpu, prompts[0].clone(), sampled(7)).await;
    let crowd = prompts[1..].iter().map(|p| (p.clone(), sampled(99))).collect();
    let with_others = common::run_among(&gpu, prompts[0].clone(), sampled(7), crowd).await;
    assert_eq!(alone.tokens, with_others.tokens, "the same seed, whatever else is running");
    let cpu = Engine::start(EngineArgs { device: DeviceArg::Cpu, ..common::args(&model) }).await.unwrap();
    let host = run(&cpu, prompts[0].clone(), sampled(7)).await;
    assert_eq!(alone.tokens, host.tokens, "the GPU sampler picks the host sampler's tokens");
    let other_seed = run(&gpu, prompts[0].clone(), sampled(8)).await;
    assert_ne!(alone.tokens, other_seed.tokens, "a different seed samples differently");
}

/// The general operations the architectures beyond Llama use, on the GPU against the CPU:
/// LayerNorm with and without bias, GELU-tanh and ReLU gated and plain, scale, soft cap,
/// q/k norms, learned positions, and attention with a sliding window, a soft cap and partial
/// rotary embedding (through the kernel that honours them).
#[test]
#[ignore = "needs a CUDA GPU: cargo test --release --test cuda -- --ignored"]
fn the_general_ops_match_their_cpu_twins() {
    let (g, _turn) = gpu();
    let c = CpuDevice::default();
    let both = |data: &[f32], rows, cols| {
        (CpuTensor::new(data.to_vec(), rows, cols), g.from_host(data, rows, cols).unwrap())
    };
    let (n, h) = (11, 96);
    let x = rand(n * h, 50);
    let (xc, xg) = both(&x, n, h);
    let (w, b) = (rand(h, 51), rand(h, 52));
    let (wc, wg) = (c.upload(host(&w, &[h])).unwrap(), g.upload(host(&w, &[h])).unwrap());
    let (bc, bg) = (c.upload(host(&b, &[h])).unwrap(), g.upload(host(&b, &[h])).unwrap());
    for bias in [false, true] {
        close(
            &format!("layer_norm, bias {bias}"),
            &g.to_host(&g.layer_norm(&xg, &wg, bias.then_some(&bg), 1e-5).unwrap()).unwrap(),
            &c.to_host(&c.layer_norm(&xc, &wc, bias.then_some(&bc), 1e-5).unwrap()).unwrap(),
            1e-4,
        );
    }
    for act in [Activation::Silu, Activation::GeluTanh, Activation::Relu] {
        close(
            &format!("act_mul {act:?}"),
            &g.to_host(&g.act_mul(&xg, act).unwrap()).unwrap(),
            &c.to_host(&c.act_mul(&xc, act).unwrap()).unwrap(),
            1e-5,
        );
        let (mut yc, mut yg) = both(&x, n, h);
        c.activation(&mut yc, act).unwrap();
        g.activation(&mut yg, act).unwrap();
        close(&format!("activation {act:?}"), &g.to_host(&yg).unwrap(), &c.to_host(&yc).unwrap(), 1e-5);
    }
    let (mut yc, mut yg) = both(&x, n, h);
    c.scale(&mut yc, 8.0).unwrap();
    g.scale(&mut yg, 8.0).unwrap();
    c.softcap(&mut yc, 3.0).unwrap();
    g.softcap(&mut yg, 3.0).unwrap();
    close("scale then softcap", &g.to_host(&yg).unwrap(), &c.to_host(&yc).unwrap(), 1e-5);
    // q/k norms over 4 query and 2 KV heads of 16 dims.
    let s = AttnShape::causal(4, 2, 16);
    let qkv = rand(n * 128, 53);
    let (qw, kw) = (rand(16, 54), rand(16, 55));
    let (mut qc, mut qg) = both(&qkv, n, 128);
    let up = |d: &CpuDevice, v: &[f32]| d.upload(host(v, &[16])).unwrap();
    let upg = |v: &[f32]| g.upload(host(v, &[16])).unwrap();
    c.qk_norm(&mut qc, s, &up(&c, &qw), &up(&c, &kw), 1e-6).unwrap();
    g.qk_norm(&mut qg, s, &upg(&qw), &upg(&kw), 1e-6).unwrap();
    close("qk_norm", &g.to_host(&qg).unwrap(), &c.to_host(&qc).unwrap(), 1e-5);
    // Learned positions, offset 2.
    let table = rand(40 * h, 56);
    let positions: Vec<u32> = (0..n as u32).map(|i| (i * 3) % 38).collect();
    let (tc, tg) = (c.upload(host(&table, &[40, h])).unwrap(), g.upload(host(&table, &[40, h])).unwrap());
    close(
        "embed_positions",
        &g.to_host(&g.embed_positions(&tg, &positions, 2).unwrap()).unwrap(),
        &c.to_host(&c.embed_positions(&tc, &positions, 2).unwrap()).unwrap(),
        0.0,
    );
    // Attention over a context longer than a chunk of the kernel, with a window, a soft cap
    // and rotary embedding on half of each head scaled by 1.2.
    let ctx = 700;
    let tables = vec![(0..(ctx as u32).div_ceil(16)).rev().collect::<Vec<u32>>()];
    let meta = step_meta(&tables, 16, &[(0, 0..ctx as u32)]);
    let cache_shape =
        CacheShape { num_blocks: tables[0].len(), block_size: 16, num_kv_heads: 2, head_dim: 16 };
    let rope = RopeSpec {
        inv_freq: (0..4).map(|i| 1.0 / 10000f32.powf(i as f32 / 4.0)).collect(),
        head_dim: 16,
        attention_scaling: 1.2,
        by_len: RopeByLen::Fixed,
    };
    let qkv = rand(ctx * 128, 57);
    // Over FP8 caches too, which the split writes K and V into rounded as the CPU rounds
    // them: with the rotation above and with one over whole heads (taken four pairs at a
    // time).
    let whole =
        RopeSpec { inv_freq: (0..8).map(|i| 1.0 / 10000f32.powf(i as f32 / 8.0)).collect(), ..rope.clone() };
    // The last with a checkpoint's per-layer scales, which K and V are stored divided by.
    let scaled = KvScales { k: 0.0371, v: 0.0219 };
    let fp8 = KvDtype::Fp8E4m3;
    for (kv, rope, scales) in
        [(KvDtype::Auto, &rope, None), (fp8, &rope, None), (fp8, &whole, None), (fp8, &whole, Some(scaled))]
    {
        for (window, softcap) in [(0, 0.0), (64, 0.0), (0, 2.5), (100, 4.0)] {
            let s = AttnShape { window, softcap, scale: 0.3, ..AttnShape::causal(4, 2, 16) };
            let (mut cc, mut cg) =
                (c.alloc_cache(cache_shape, kv).unwrap(), g.alloc_cache(cache_shape, kv).unwrap());
            if let Some(scales) = scales {
                c.set_kv_scales(&mut cc, scales).unwrap();
                g.set_kv_scales(&mut cg, scales).unwrap();
            }
            let (qc, qg) = both(&qkv, ctx, 128);
            let what = format!(
                "attention, window {window}, softcap {softcap}, {kv:?} cache, rotary {}, scales {scales:?}",
                rope.inv_freq.len()
            );
            close(
                &what,
                &g.to_host(&g.qkv_attention(&qg, s, rope, &mut cg, &meta).unwrap()).unwrap(),
                &c.to_host(&c.qkv_attention(&qc, s, rope, &mut cc, &meta).unwrap()).unwrap(),
                1e-3,
            );
            if kv == KvDtype::Fp8E4m3 {
                same_fp8_bytes(&g, &cg, &cc, &what);
            }
        }
    }
}

/// The mixture-of-experts block on the GPU (router, sort, grouped expert GEMVs, weighted
/// sum) gives the CPU's, for f32 and bf16 experts, at decode and prefill row counts, with
/// and without renormalized routes; and a shared expert's sigmoid gate. bf16 experts with
/// many rows an expert take the tensor-core GEMMs, which round the rows and the gated
/// product to bf16 as a bf16 model does (the rows given here are bf16 values already):
/// those are held to `moe_bf16_reference`, among them several tiles of one expert, and
/// sizes that leave partial tiles of rows, columns and k.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --release --test cuda -- --ignored"]
fn fused_moe_matches_its_cpu_twin() {
    use actorllm::kernels::MoeSpec;
    use actorllm::kernels::cuda::moe_on_tensor_cores;
    let (g, _turn) = gpu();
    let c = CpuDevice::default();
    let to_bf16 = |v: &[f32]| -> Vec<f32> { v.iter().map(|x| half::bf16::from_f32(*x).to_f32()).collect() };
    // 160 experts: the sort's scan crosses warps, and the router keeps five logits a lane.
    for (experts, h, inter) in [(16, 256, 128), (8, 200, 72), (160, 64, 40)] {
        let gate_up = rand(experts * 2 * inter * h, 60);
        let down = rand(experts * h * inter, 61);
        for dt in [DType::F32, DType::BF16, DType::F16] {
            let weight = |v: &[f32], shape: &[usize]| match dt {
                DType::F32 => host(v, shape),
                _ => HostTensor {
                    dtype: dt,
                    shape: shape.to_vec(),
                    data: v
                        .iter()
                        .flat_map(|x| match dt {
                            DType::BF16 => half::bf16::from_f32(*x).to_le_bytes(),
                            _ => half::f16::from_f32(*x).to_le_bytes(),
                        })
                        .collect::<Vec<u8>>()
                        .into(),
                },
            };
            let gu_shape = [experts, 2 * inter, h];
            let d_shape = [experts, h, inter];
            let (guc, gug) = (
                c.upload(weight(&gate_up, &gu_shape)).unwrap(),
                g.upload(weight(&gate_up, &gu_shape)).unwrap(),
            );
            let (dc, dg) =
                (c.upload(weight(&down, &d_shape)).unwrap(), g.upload(weight(&down, &d_shape)).unwrap());
            for (rows, top_k, renormalize, act) in [
                (1, 2, true, Activation::Silu),
                (5, 4, false, Activation::Silu),
                (40, 8, true, Activation::GeluTanh),
                (600, 2, false, Activation::Silu),
            ] {
                let spec = MoeSpec { experts, top_k, renormalize, act };
                let mma = dt != DType::F32 && moe_on_tensor_cores(rows, spec);
                if mma && dt == DType::F16 {
                    // The reference below rounds as bf16 does; f16's GEMV rows are checked.
                    continue;
                }
                let x = to_bf16(&rand(rows * h, 62 + rows as u64));
                let logits: Vec<f32> = rand(rows * experts, 63).iter().map(|v| v * 8.0).collect();
                let (xc, xg) = (CpuTensor::new(x.clone(), rows, h), g.from_host(&x, rows, h).unwrap());
                let (lc, lg) = (
                    CpuTensor::new(logits.clone(), rows, experts),
                    g.from_host(&logits, rows, experts).unwrap(),
                );
                let what = format!("fused_moe {experts}×[{h}, {inter}], {dt:?}, rows {rows}, top {top_k}");
                let got = g.to_host(&g.fused_moe(&xg, &lg, &gug, &dg, spec).unwrap()).unwrap();
                if !mma {
                    let want = c.to_host(&c.fused_moe(&xc, &lc, &guc, &dc, spec).unwrap()).unwrap();
                    close(&what, &got, &want, 1e-3);
                    continue;
                }
                let (gu, d) = (to_bf16(&gate_up), to_bf16(&down));
                let (want, slack) = moe_bf16_reference(&x, &logits, &gu, &d, (h, inter), spec);
                for (i, ((a, b), s)) in got.iter().zip(&want).zip(&slack).enumerate() {
                    assert!(
                        (a - b).abs() <= 1e-3 * (1.0 + b.abs()) + s,
                        "{what}, mma[{i}]: gpu {a} vs {b} ± {s}"
                    );
                }
            }
        }
        if experts > 16 {
            // The integer rows below take the tensor cores only with few experts.
            continue;
        }
        // Exactly: ReLU over small integers, with at most four nonzero ±1 weights a gate/up
        // row, keeps every sum and gated product an integer that bf16 holds, so the tensor
        // cores' result must be the CPU's to float precision. A slip in a tile's rows,
        // columns or k steps cannot hide in the rounding slack here.
        let signs = |n: usize, per_row: usize, cols: usize, seed: u64| -> Vec<f32> {
            let r = rand(n * (per_row + 1), seed);
            let mut v = vec![0.0f32; n * cols];
            for row in 0..n {
                for j in 0..per_row {
                    let at = ((r[row * (per_row + 1) + j] + 0.5) * cols as f32) as usize % cols;
                    v[row * cols + at] = if r[row * (per_row + 1) + per_row] > 0.0 { 1.0 } else { -1.0 };
                }
            }
            v
        };
        let gate_up = signs(experts * 2 * inter, 4, h, 70);
        let down: Vec<f32> = rand(experts * h * inter, 71).iter().map(|v| (v * 4.0).round()).collect();
        let as_bf16 = |v: &[f32], shape: &[usize]| HostTensor {
            dtype: DType::BF16,
            shape: shape.to_vec(),
            data: v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect::<Vec<u8>>().into(),
        };
        let (gu_shape, d_shape) = ([experts, 2 * inter, h], [experts, h, inter]);
        let (guc, gug) = (
            c.upload(as_bf16(&gate_up, &gu_shape)).unwrap(),
            g.upload(as_bf16(&gate_up, &gu_shape)).unwrap(),
        );
        let (dc, dg) =
            (c.upload(as_bf16(&down, &d_shape)).unwrap(), g.upload(as_bf16(&down, &d_shape)).unwrap());
        for (rows, top_k) in [(40, 8), (600, 2)] {
            let spec = MoeSpec { experts, top_k, renormalize: true, act: Activation::Relu };
            assert!(moe_on_tensor_cores(rows, spec), "these rows take the tensor cores");
            let x: Vec<f32> = rand(rows * h, 72).iter().map(|v| (v * 3.0).round()).collect();
            let logits: Vec<f32> = rand(rows * experts, 73).iter().map(|v| v * 8.0).collect();
            let (xc, xg) = (CpuTensor::new(x.clone(), rows, h), g.from_host(&x, rows, h).unwrap());
            let (lc, lg) =
                (CpuTensor::new(logits.clone(), rows, experts), g.from_host(&logits, rows, experts).unwrap());
            close(
                &format!("fused_moe {experts}×[{h}, {inter}] over integers, rows {rows}, top {top_k}"),
                &g.to_host(&g.fused_moe(&xg, &lg, &gug, &dg, spec).unwrap()).unwrap(),
                &c.to_host(&c.fused_moe(&xc, &lc, &guc, &dc, spec).unwrap()).unwrap(),
                1e-5,
            );
        }
    }
    let h = 256;
    let (rows, x, y, gate) = (7, rand(7 * h, 64), rand(7 * h, 65), rand(7, 66));
    let (mut ac, mut ag) = (CpuTensor::new(x.clone(), rows, h), g.from_host(&x, rows, h).unwrap());
    let (yc, yg) = (CpuTensor::new(y.clone(), rows, h), g.from_host(&y, rows, h).unwrap());
    let (gc, gg) = (CpuTensor::new(gate.clone(), rows, 1), g.from_host(&gate, rows, 1).unwrap());
    c.add_sigmoid_gated(&mut ac, &yc, &gc).unwrap();
    g.add_sigmoid_gated(&mut ag, &yg, &gg).unwrap();
    close("add_sigmoid_gated", &g.to_host(&ag).unwrap(), &c.to_host(&ac).unwrap(), 1e-5);
}

/// Every architecture of tests/models.rs (tiny models, f32) on the GPU gives the CPU's
/// greedy tokens for its prompts, submitted together: with graphs and eager.
#[actix_rt::test]
#[ignore = "needs a CUDA GPU: cargo test --release --test cuda -- --ignored"]
async fn every_architecture_on_the_gpu_gives_the_cpu_tokens() {
    let _turn = gpu_turn();
    let dir = common::fixture("tests/fixtures/models");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().trim_end_matches(".json").to_string())
        .collect();
    names.sort();
    assert!(names.len() >= 10, "{names:?}");
    let params = actorllm::SamplingParams { ignore_eos: true, ..greedy(24) };
    for name in names {
        let g: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(format!("{name}.json"))).unwrap())
                .unwrap();
        let model = common::scratch(&name);
        actorllm::models::random::write_golden_model(&g, &model).unwrap();
        let prompts = common::golden_prompts(&g);
        let outputs = |engine: Engine| {
            let (prompts, params) = (prompts.clone(), params.clone());
            async move {
                let runs = prompts.iter().map(|p| run(&engine, p.clone(), params.clone()));
                futures::future::join_all(runs).await.into_iter().map(|o| o.tokens).collect::<Vec<_>>()
            }
        };
        let cpu = outputs(
            Engine::start(EngineArgs { device: DeviceArg::Cpu, ..common::args(&model) }).await.unwrap(),
        )
        .await;
        for eager in [false, true] {
            runners_released().await;
            let args = EngineArgs {
                device: DeviceArg::Cuda,
                enforce_eager: eager,
                num_gpu_blocks_override: Some(256),
                ..common::args(&model)
            };
            let gpu = Engine::start(args).await.unwrap_or_else(|e| panic!("{name}: {e}"));
            let got = outputs(gpu).await;
            assert_eq!(got, cpu, "{name}, eager {eager}");
        }
        eprintln!("{name}: the GPU gives the CPU's tokens, graphs and eager");
    }
}

/// `--kv-cache-dtype fp8` on the GPU gives transformers' tokens with its cache rounded to
/// e4m3 (tests/fixtures/kv-fp8/, which tests/models.rs holds the CPU to): the plain tiny
/// Llama, Gemma 2 with soft caps and alternating windows, and the Llama whose checkpoint
/// holds per-layer k_scale and v_scale; with graphs and eager.
#[actix_rt::test]
#[ignore = "needs a CUDA GPU: cargo test --release --test cuda -- --ignored"]
async fn fp8_kv_caches_on_the_gpu_give_transformers_tokens() {
    let _turn = gpu_turn();
    let params = actorllm::SamplingParams { ignore_eos: true, ..greedy(24) };
    for name in ["llama", "gemma2", "llama-scaled"] {
        let path = common::fixture(&format!("tests/fixtures/kv-fp8/{name}.json"));
        let g: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let model = common::scratch(&format!("{name}-kv-fp8"));
        actorllm::models::random::write_golden_model(&g, &model).unwrap();
        let want: Vec<Vec<u32>> = g["runs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["output_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect())
            .collect();
        for eager in [false, true] {
            runners_released().await;
            let args = EngineArgs {
                device: DeviceArg::Cuda,
                enforce_eager: eager,
                kv_cache_dtype: actorllm::kernels::KvDtype::Fp8E4m3,
                num_gpu_blocks_override: Some(256),
                ..common::args(&model)
            };
            let engine = Engine::start(args).await.unwrap_or_else(|e| panic!("{name}: {e}"));
            let runs = common::golden_prompts(&g).into_iter().map(|p| run(&engine, p, params.clone()));
            let got: Vec<Vec<u32>> =
                futures::future::join_all(runs).await.into_iter().map(|o| o.tokens[0].clone()).collect();
            assert_eq!(got, want, "{name}, eager {eager}");
        }
    }
}
