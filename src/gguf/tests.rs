//! GGUF parsing and dequantization on files built in memory.

use super::*;
use std::io::Write;

/// A minimal GGUF v3 writer for tests: metadata strings/u32s and raw tensors.
fn build(meta: &[(&str, Value)], tensors: &[(&str, Vec<u64>, u32, Vec<u8>)]) -> Vec<u8> {
    let mut b = Vec::new();
    let s = |b: &mut Vec<u8>, t: &str| {
        b.extend((t.len() as u64).to_le_bytes());
        b.extend(t.as_bytes());
    };
    b.extend(0x4655_4747u32.to_le_bytes());
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((meta.len() as u64).to_le_bytes());
    for (k, v) in meta {
        s(&mut b, k);
        match v {
            Value::U32(x) => {
                b.extend(4u32.to_le_bytes());
                b.extend(x.to_le_bytes());
            }
            Value::Str(x) => {
                b.extend(8u32.to_le_bytes());
                s(&mut b, x);
            }
            _ => unimplemented!("test writer"),
        }
    }
    let mut offset = 0u64;
    for (name, dims, ty, data) in tensors {
        s(&mut b, name);
        b.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(ty.to_le_bytes());
        b.extend(offset.to_le_bytes());
        offset += (data.len() as u64).div_ceil(32) * 32;
    }
    while b.len() % 32 != 0 {
        b.push(0);
    }
    for (_, _, _, data) in tensors {
        b.extend(data);
        while b.len() % 32 != 0 {
            b.push(0);
        }
    }
    b
}

fn open(bytes: &[u8]) -> Result<GgufFile, GgufError> {
    let dir = crate::scratch::ScratchDir::new("gguf").unwrap();
    let path = dir.path().join("t.gguf");
    std::fs::File::create(&path).unwrap().write_all(bytes).unwrap();
    GgufFile::open(&path)
}

fn q4_1_block(d: f32, m: f32, q: &[u8; 32]) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend(f16::from_f32(d).to_le_bytes());
    v.extend(f16::from_f32(m).to_le_bytes());
    for j in 0..16 {
        v.push(q[j] | (q[j + 16] << 4));
    }
    v
}

#[test]
fn q4_1_and_q8_0_dequantize_exactly() {
    // The two halves of the block differ (0..16, then 15 down to 0), so that reading a
    // byte's nibbles the wrong way round, or the halves interleaved, changes the values.
    let q: [u8; 32] = std::array::from_fn(|i| if i < 16 { i as u8 } else { 31 - i as u8 });
    let q4 = q4_1_block(0.5, -1.0, &q);
    let mut q8 = Vec::new();
    q8.extend(f16::from_f32(0.25).to_le_bytes());
    q8.extend((0..32).map(|i| (i as i8 - 16) as u8));
    let bytes = build(
        &[("general.architecture", Value::Str("llama".into())), ("x.count", Value::U32(7))],
        &[("a", vec![32], 3, q4), ("b", vec![32], 8, q8)],
    );
    let g = open(&bytes).unwrap();
    assert_eq!(g.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(g.get_u64("x.count").unwrap(), 7);
    let a = g.dequantize(g.tensor("a").unwrap());
    let want: Vec<f32> = q.iter().map(|&x| 0.5 * x as f32 - 1.0).collect();
    assert_eq!(a, want);
    let b = g.dequantize(g.tensor("b").unwrap());
    assert_eq!(b, (0..32).map(|i| 0.25 * (i as f32 - 16.0)).collect::<Vec<_>>());
}

/// 512 elements of each format of llama.cpp's K-quant files (Q4_K, Q5_K, Q6_K, and the
/// Q5_0 and Q5_1 it falls back to), read from a GGUF file as a `[256, 2]` tensor, give bit
/// for bit the values llama.cpp's gguf-py dequantizes from the same bytes
/// (tests/fixtures/kquants.json, written by scripts/make_kquant_golden.py).
#[test]
fn k_quant_files_dequantize_as_gguf_py_does() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/kquants.json");
    let golden: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let formats = golden["formats"].as_array().unwrap();
    assert_eq!(formats.len(), 5);
    for f in formats {
        let name = f["type"].as_str().unwrap();
        let ty = match name {
            "Q4_K" => 12,
            "Q5_K" => 13,
            "Q6_K" => 14,
            "Q5_0" => 6,
            "Q5_1" => 7,
            other => panic!("unexpected format {other}"),
        };
        let hex = f["bytes"].as_str().unwrap();
        let bytes: Vec<u8> =
            (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
        let want: Vec<f32> =
            f["values"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        assert_eq!(want.len(), 512, "{name}");
        let g = open(&build(&[], &[("w", vec![256, 2], ty, bytes)])).unwrap();
        let got = g.dequantize(g.tensor("w").unwrap());
        assert_eq!(got.len(), want.len(), "{name}");
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "{name}[{i}]: {a} vs gguf-py's {b}");
        }
    }
}

#[test]
fn malformed_files_are_refused_with_a_clear_error() {
    let good = build(&[("k", Value::Str("v".into()))], &[("t", vec![32], 0, vec![0; 128])]);
    assert!(open(&good).is_ok());
    for cut in [3, 10, 30, good.len() - 1] {
        let e = open(&good[..cut]).err().expect("truncated file refused");
        assert!(matches!(e, GgufError::Truncated { .. } | GgufError::BadMagic(_)), "cut at {cut}: {e}");
        assert!(e.to_string().contains("truncated") || e.to_string().contains("magic"), "{e}");
    }
    let mut bad = good.clone();
    bad[0] = b'X';
    assert!(matches!(open(&bad), Err(GgufError::BadMagic(_))));
    let mut bad = good.clone();
    bad[4] = 9;
    assert!(matches!(open(&bad), Err(GgufError::BadVersion(9))));
    // A huge element count in the header must not allocate or panic.
    let mut bad = good.clone();
    bad[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(open(&bad).is_err());
    // Q2_K (type 10) is not read.
    let unsupported = build(&[], &[("t", vec![256], 10, vec![0; 84])]);
    let e = open(&unsupported).err().expect("Q2_K refused");
    assert!(matches!(e, GgufError::UnsupportedType { ty: 10, .. }), "{e}");
    assert!(e.to_string().contains("Q4_K, Q5_K, Q6_K"), "{e}");
    // A K-quant tensor must fill whole 256-element super-blocks.
    let partial = build(&[], &[("t", vec![128], 12, vec![0; 144])]);
    let e = open(&partial).err().expect("a partial super-block refused").to_string();
    assert!(e.contains("256-element block"), "{e}");
    // Duplicate names, a tensor that runs into the next (its dims say more than its
    // bytes), and an offset that wraps past 2^64.
    let dup = build(&[], &[("t", vec![32], 0, vec![0; 128]), ("t", vec![32], 0, vec![0; 128])]);
    assert!(open(&dup).err().expect("duplicate refused").to_string().contains("listed twice"));
    let overlap = build(&[], &[("a", vec![64], 0, vec![0; 128]), ("b", vec![32], 0, vec![0; 128])]);
    assert!(open(&overlap).err().expect("overlap refused").to_string().contains("overlaps"));
    // A block count whose byte size overflows (found by the gguf fuzz target).
    let huge = build(&[], &[("q", vec![32, (1 << 59) - 1], 8, vec![0; 34])]);
    let e = open(&huge).err().expect("overflow refused").to_string();
    assert!(e.contains("overflows"), "{e}");
    let mut wrap = good.clone();
    // The tensor info's offset is the last 8 bytes before the data alignment padding:
    // name (8 + 1), n_dims (4), dim (8), type (4), offset (8) after the metadata.
    let at = wrap.windows(1 + 4 + 8 + 4).position(|w| w[0] == b't' && w[1..5] == 1u32.to_le_bytes()).unwrap()
        + 1
        + 4
        + 8
        + 4;
    wrap[at..at + 8].copy_from_slice(&(u64::MAX - 16).to_le_bytes());
    assert!(matches!(open(&wrap), Err(GgufError::Truncated { .. })), "{:?}", open(&wrap).err());
}

#[test]
fn q_and_k_rows_are_unpermuted_back_to_rotate_half() {
    // One head of dim 4: GGUF rows [r0, r2, r1, r3] (interleaved) → HF rows [r0, r1, r2, r3].
    let w: Vec<f32> = vec![0., 0., 2., 2., 1., 1., 3., 3.];
    assert_eq!(import::unpermute_rows_for_test(&w, 4, 1), vec![0., 0., 1., 1., 2., 2., 3., 3.]);
}
