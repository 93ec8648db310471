//! The weights of scripts/make_model_goldens.py's tiny models, rebuilt bit for bit: each
//! parameter's values come from splitmix64 of (FNV-1a of its name + index · golden ratio),
//! 24 bits each, scaled by the parameter's kind. With the golden file's config and
//! parameter list, a test writes the model transformers ran, without committed weights.
#![allow(dead_code)]

use std::path::Path;

use serde_json::Value;

fn fnv1a64(s: &str) -> u64 {
    s.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3))
}

/// Value i of `name` in [0, 1), 24 bits.
fn uniform(seed: u64, i: u64) -> f32 {
    let mut z = seed.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 40) as f32 / (1u32 << 24) as f32
}

/// A parameter's values by its kind, as the script computes them in float32.
pub fn values(name: &str, shape: &[usize], embed_scale: f64) -> Vec<f32> {
    let n: usize = shape.iter().product();
    let seed = fnv1a64(name);
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
    (0..n as u64)
        .map(|i| {
            let u = uniform(seed, i) - 0.5;
            if offset == 0.0 { u * scale } else { offset + u * scale }
        })
        .collect()
}

/// Writes the golden's model into `dir`: config.json, model.safetensors (f32) and a
/// byte-level tokenizer for its vocabulary.
pub fn write_model(golden: &Value, dir: &Path) {
    std::fs::write(dir.join("config.json"), golden["config"].to_string()).unwrap();
    let embed_scale = golden["embed_scale"].as_f64().unwrap_or(1.0);
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = golden["params"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let name = p[0].as_str().unwrap().to_string();
            let shape: Vec<usize> =
                p[1].as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).collect();
            let bytes = bytemuck::cast_slice(&values(&name, &shape, embed_scale)).to_vec();
            (name, shape, bytes)
        })
        .collect();
    let views = tensors.iter().map(|(n, s, b)| {
        (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap())
    });
    safetensors::tensor::serialize_to_file(views, &None, &dir.join("model.safetensors")).unwrap();
    let vocab = golden["config"]["vocab_size"].as_u64().unwrap() as usize;
    actorllm::models::random::write_tokenizer(vocab, dir).unwrap();
}
