//! A checkpoint's FP8 KV cache scales (vLLM's `k_scale` and `v_scale`), one pair a layer:
//! the cache stores each key divided by its layer's `k_scale` and reads it back multiplied,
//! values likewise (`--kv-cache-dtype fp8`). Checkpoint writers name them in several ways,
//! all read here:
//! - `….layers.N.self_attn.k_scale` / `v_scale` (compressed-tensors' `kv_cache_scheme`,
//!   llm-compressor; `self_attn.attn.k_scale` as vLLM names its own parameters),
//! - `….layers.N.self_attn.k_proj.k_scale` / `v_proj.v_scale` (NVIDIA ModelOpt),
//! - `….layers.N.self_attn.k_proj.output_scale` / `v_proj.output_scale` (AutoFP8),
//! - `….layers.N.self_attn.kv_scale`, one scale for both (older checkpoints).
//!
//! Each is one value (a tensor of shape `[]` or `[1]`); per-head scales are refused.

use super::ModelError;
use super::loader::TensorRef;
use crate::kernels::{DType, KvScales};

/// Which of a layer's scales a tensor holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    K,
    V,
    /// The older single `kv_scale`, for keys and values alike.
    Both,
}

/// The layer and the scale that checkpoint tensor `name` holds, if it is a KV cache scale.
pub fn scale_of(name: &str) -> Option<(usize, Which)> {
    let at = name.rfind("layers.")?;
    let rest = &name[at + "layers.".len()..];
    let (layer, rest) = rest.split_once('.')?;
    let layer = layer.parse().ok()?;
    let rest = rest.strip_prefix("self_attn.")?;
    let rest = rest.strip_prefix("attn.").unwrap_or(rest);
    let which = match rest {
        "k_scale" | "k_proj.k_scale" | "k_proj.output_scale" => Which::K,
        "v_scale" | "v_proj.v_scale" | "v_proj.output_scale" => Which::V,
        "kv_scale" => Which::Both,
        _ => return None,
    };
    Some((layer, which))
}

/// The scales of a model of `layers` layers among `tensors` (a checkpoint's, as stored):
/// None where it has none; else each layer's, 1 where the checkpoint leaves one out (as
/// vLLM does), with how many it gave. A scale that is not one positive finite value, or of
/// a layer the model does not have, is an error that names its tensor.
pub fn read<'a>(
    tensors: impl Iterator<Item = (&'a str, TensorRef<'a>)>,
    layers: usize,
) -> Result<Option<(Vec<KvScales>, usize)>, ModelError> {
    let mut scales = vec![KvScales::default(); layers];
    let mut found = 0;
    for (name, t) in tensors {
        let Some((layer, which)) = scale_of(name) else { continue };
        let bad = |what: String| ModelError::Weights(format!("KV cache scale {name}: {what}"));
        let n: usize = t.shape.iter().product();
        if n != 1 {
            return Err(bad(format!(
                "holds {n} values (shape {:?}); only one scale a tensor is supported (per-head KV \
                 cache scales are not)",
                t.shape
            )));
        }
        if layer >= layers {
            return Err(bad(format!("the model has {layers} layers")));
        }
        let mut value = Vec::new();
        DType::F32.convert_from(t.dtype, t.bytes, &mut value);
        let x: f32 = bytemuck::pod_read_unaligned(&value[..4]);
        if !(x.is_finite() && x > 0.0) {
            return Err(bad(format!("{x} is not a positive scale")));
        }
        let s = &mut scales[layer];
        match which {
            Which::K => s.k = x,
            Which::V => s.v = x,
            Which::Both => *s = KvScales { k: x, v: x },
        }
        found += if which == Which::Both { 2 } else { 1 };
    }
    Ok((found > 0).then_some((scales, found)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_writers_names_are_read() {
        for (name, want) in [
            ("model.layers.0.self_attn.k_scale", Some((0, Which::K))),
            ("model.layers.12.self_attn.v_scale", Some((12, Which::V))),
            ("model.layers.3.self_attn.attn.k_scale", Some((3, Which::K))),
            ("model.layers.3.self_attn.k_proj.k_scale", Some((3, Which::K))),
            ("model.layers.3.self_attn.v_proj.v_scale", Some((3, Which::V))),
            ("model.layers.7.self_attn.k_proj.output_scale", Some((7, Which::K))),
            ("model.layers.7.self_attn.v_proj.output_scale", Some((7, Which::V))),
            ("model.decoder.layers.1.self_attn.kv_scale", Some((1, Which::Both))),
            // Weights' and activations' scales are not the cache's.
            ("model.layers.0.self_attn.k_proj.weight_scale", None),
            ("model.layers.0.self_attn.k_proj.input_scale", None),
            ("model.layers.0.self_attn.q_proj.output_scale", None),
            ("model.layers.0.mlp.down_proj.output_scale", None),
            ("model.layers.x.self_attn.k_scale", None),
        ] {
            assert_eq!(scale_of(name), want, "{name}");
        }
    }

    fn scalar(x: f32) -> Vec<u8> {
        x.to_le_bytes().to_vec()
    }

    #[test]
    fn scales_are_read_by_layer_and_bad_ones_are_named() {
        let (a, b, c, bf) =
            (scalar(0.5), scalar(0.25), scalar(2.0), half::bf16::from_f32(0.125).to_le_bytes());
        let t = |bytes: &'static [u8], shape: &'static [usize], dtype| TensorRef { dtype, shape, bytes };
        let leak = |v: Vec<u8>| -> &'static [u8] { v.leak() };
        let (a, b, c) = (leak(a), leak(b), leak(c));
        let bf: &'static [u8] = leak(bf.to_vec());
        let tensors = vec![
            ("model.layers.0.self_attn.k_scale", t(a, &[], DType::F32)),
            ("model.layers.0.self_attn.v_scale", t(b, &[1], DType::F32)),
            ("model.layers.2.self_attn.kv_scale", t(c, &[], DType::F32)),
            ("model.layers.1.self_attn.k_proj.k_scale", t(bf, &[], DType::BF16)),
            ("model.layers.1.self_attn.k_proj.weight", t(a, &[1], DType::F32)),
        ];
        let (scales, found) = read(tensors.clone().into_iter(), 3).unwrap().unwrap();
        assert_eq!(found, 5);
        let s = |k, v| KvScales { k, v };
        assert_eq!(scales, vec![s(0.5, 0.25), s(0.125, 1.0), s(2.0, 2.0)]);
        // None at all: no scales.
        assert!(read(tensors[4..].iter().cloned(), 3).unwrap().is_none());
        // A layer past the model's, per-head scales and a zero scale are named.
        let err = |tensors: Vec<(&'static str, TensorRef<'static>)>, layers| {
            read(tensors.into_iter(), layers).unwrap_err().to_string()
        };
        let e = err(tensors.clone(), 2);
        assert!(e.contains("model.layers.2.self_attn.kv_scale") && e.contains("2 layers"), "{e}");
        let per_head = leak([0.5f32, 0.5].iter().flat_map(|x| x.to_le_bytes()).collect());
        let e = err(vec![("model.layers.0.self_attn.k_scale", t(per_head, &[2], DType::F32))], 1);
        assert!(e.contains("holds 2 values") && e.contains("per-head"), "{e}");
        let e = err(vec![("model.layers.0.self_attn.v_scale", t(leak(scalar(0.0)), &[], DType::F32))], 1);
        assert!(e.contains("self_attn.v_scale") && e.contains("not a positive scale"), "{e}");
    }
}
