//! GPTQ and AWQ checkpoints: integer weights packed into int32 words beside per-group
//! scales and zero points, as AutoGPTQ / GPTQModel and AutoAWQ write them and vLLM reads
//! them. The loader turns each `X.qweight` (with `X.qzeros`, `X.scales` and GPTQ's
//! `X.g_idx`) into `X.weight`, `[out, in]`, every element `(q - zero) × scale` of its group,
//! in the dtype of the checkpoint's scales.
//!
//! The two layouts:
//! - GPTQ: `qweight` is `[in / p, out]`, `p = 32 / bits` consecutive input rows a word,
//!   the lowest bits first; `qzeros` is `[groups, out / p]`, packed the same way along the
//!   output; `scales` `[groups, out]`; `g_idx` `[in]` gives each input row's group (rows
//!   quantized in activation order, `desc_act`, have groups out of order). The original
//!   format (`checkpoint_format: gptq`) stores each zero point minus one; `gptq_v2` stores
//!   it as it is.
//! - AWQ (its `gemm` version): `qweight` is `[in, out / 8]`, eight output columns a word
//!   in the order 0, 2, 4, 6, 1, 3, 5, 7 of the word's nibbles; `qzeros` `[groups, out / 8]`
//!   packed the same way; `scales` `[groups, out]`; groups are consecutive input rows.

use serde_json::Value as Json;

/// AWQ's nibble of output column `c % 8` in its word.
const AWQ_NIBBLE: [u32; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

/// How a checkpoint packs its integer weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Packing {
    Gptq {
        bits: u32,
        /// Input rows a group when there is no `g_idx`; `None`: one group a column.
        group_size: Option<usize>,
        /// Added to each stored zero point: 1 in the original format, 0 in `gptq_v2`.
        zero_offset: u32,
    },
    Awq {
        group_size: Option<usize>,
    },
}

/// The tensors of one packed weight, as stored.
pub struct Packed<'a> {
    pub qweight: (&'a [usize], &'a [u8]),
    pub qzeros: (&'a [usize], &'a [u8]),
    /// Scales, widened to f32, and their shape.
    pub scales: (&'a [usize], Vec<f32>),
    pub g_idx: Option<(&'a [usize], &'a [u8])>,
}

fn words(bytes: &[u8]) -> Vec<u32> {
    bytes.chunks_exact(4).map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]])).collect()
}

fn shape2(what: &str, shape: &[usize]) -> Result<(usize, usize), String> {
    match *shape {
        [a, b] => Ok((a, b)),
        _ => Err(format!("{what} has shape {shape:?}, not two dimensions")),
    }
}

impl Packing {
    /// The packing a `quantization_config` of method `method` describes; `Ok(None)` for a
    /// method that packs no integer weights, an error naming what the loader does not read.
    pub fn of(q: &Json, method: &str) -> Result<Option<Self>, String> {
        // AutoAWQ's own quant_config.json names them `q_group_size` and `w_bit`.
        let group_size =
            |q: &Json| match q.get("group_size").or_else(|| q.get("q_group_size")).and_then(Json::as_i64) {
                None | Some(-1) => Ok(None),
                Some(g) if g > 0 => Ok(Some(g as usize)),
                Some(g) => Err(format!("group_size {g}")),
            };
        match method {
            "gptq" => {
                let bits = q.get("bits").and_then(Json::as_u64).unwrap_or(0) as u32;
                if ![2, 4, 8].contains(&bits) {
                    return Err(format!("GPTQ with {bits}-bit weights (2, 4 and 8 are read)"));
                }
                if q.get("is_marlin_format").and_then(Json::as_bool) == Some(true) {
                    return Err("GPTQ in Marlin's repacked format (the loader reads GPTQ's own)".into());
                }
                let zero_offset = match q.get("checkpoint_format").and_then(Json::as_str).unwrap_or("gptq") {
                    "gptq" => 1,
                    "gptq_v2" => 0,
                    other => {
                        return Err(format!("GPTQ checkpoint_format {other:?} (gptq and gptq_v2 are read)"));
                    }
                };
                let group_size = group_size(q).map_err(|e| format!("GPTQ with {e}"))?;
                Ok(Some(Self::Gptq { bits, group_size, zero_offset }))
            }
            "awq" => {
                let bits = q.get("bits").or_else(|| q.get("w_bit")).and_then(Json::as_u64).unwrap_or(0);
                if bits != 4 {
                    return Err(format!("AWQ with {bits}-bit weights (4 is read)"));
                }
                let version = q.get("version").and_then(Json::as_str).unwrap_or("gemm").to_ascii_lowercase();
                if version != "gemm" {
                    return Err(format!("AWQ's {version} packing (its gemm packing is read)"));
                }
                if q.get("zero_point").and_then(Json::as_bool) == Some(false) {
                    return Err("AWQ without zero points (zero_point: false)".into());
                }
                let group_size = group_size(q).map_err(|e| format!("AWQ with {e}"))?;
                Ok(Some(Self::Awq { group_size }))
            }
            _ => Ok(None),
        }
    }

    fn bits(&self) -> u32 {
        match self {
            Self::Gptq { bits, .. } => *bits,
            Self::Awq { .. } => 4,
        }
    }

    /// The weight `[out, in]` of `p`, each element `(q - zero) × scale`, row-major f32.
    pub fn unpack(&self, p: &Packed) -> Result<(usize, usize, Vec<f32>), String> {
        let bits = self.bits();
        let per = (32 / bits) as usize;
        let mask = (1u32 << bits) - 1;
        let q = words(p.qweight.1);
        let z = words(p.qzeros.1);
        let (qa, qb) = shape2("qweight", p.qweight.0)?;
        let (za, zb) = shape2("qzeros", p.qzeros.0)?;
        let (sa, sb) = shape2("scales", p.scales.0)?;
        let (rows_in, out) = match self {
            Self::Gptq { .. } => (qa * per, qb),
            Self::Awq { .. } => (qa, qb * per),
        };
        let groups = sa;
        if sb != out || za != groups || zb * per != out {
            return Err(format!(
                "qweight {:?}, qzeros {:?} and scales {:?} do not fit one [{out}, {rows_in}] weight",
                p.qweight.0, p.qzeros.0, p.scales.0
            ));
        }
        let group_of: Vec<usize> = match (self, p.g_idx) {
            (Self::Gptq { .. }, Some((shape, bytes))) => {
                if shape != [rows_in] {
                    return Err(format!("g_idx has shape {shape:?}, not [{rows_in}]"));
                }
                words(bytes).into_iter().map(|g| g as usize).collect()
            }
            (Self::Gptq { group_size, .. } | Self::Awq { group_size }, _) => {
                let size = group_size.unwrap_or(rows_in).max(1);
                (0..rows_in).map(|i| i / size).collect()
            }
        };
        if let Some(g) = group_of.iter().find(|&&g| g >= groups) {
            return Err(format!("an input row is in group {g} of {groups}"));
        }
        // The stored value at packed word `word`, slot `slot`.
        let at = |words: &[u32], word: usize, slot: u32| (words[word] >> (slot * bits)) & mask;
        let (zero_offset, awq) = match self {
            Self::Gptq { zero_offset, .. } => (*zero_offset, false),
            Self::Awq { .. } => (0, true),
        };
        // Zero points unpacked along the output: `[groups, out]`.
        let column_slot = |n: usize| if awq { AWQ_NIBBLE[n % 8] } else { (n % per) as u32 };
        let zeros: Vec<f32> = (0..groups * out)
            .map(|i| {
                let (g, n) = (i / out, i % out);
                (at(&z, g * zb + n / per, column_slot(n)) + zero_offset) as f32
            })
            .collect();
        let mut w = vec![0f32; out * rows_in];
        for i in 0..rows_in {
            let g = group_of[i];
            for n in 0..out {
                let v = match awq {
                    true => at(&q, i * qb + n / per, column_slot(n)),
                    false => at(&q, (i / per) * qb + n, (i % per) as u32),
                };
                w[n * rows_in + i] = (v as f32 - zeros[g * out + n]) * p.scales.1[g * out + n];
            }
        }
        Ok((out, rows_in, w))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn le(words: &[u32]) -> Vec<u8> {
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    #[test]
    fn gptq_words_hold_consecutive_input_rows_and_zeros_minus_one() {
        // 8 input rows × 1 output column in one word: rows 0..8 hold 0..8; one group whose
        // stored zero 3 means 4; scale 0.5.
        let q = le(&[0x7654_3210]);
        let zeros = le(&[3]);
        let gptq = Packing::Gptq { bits: 4, group_size: None, zero_offset: 1 };
        let p = Packed {
            qweight: (&[1, 1], &q),
            qzeros: (&[1, 1], &zeros),
            scales: (&[1, 1], vec![0.5]),
            g_idx: None,
        };
        // `qzeros` `[1, 1]` packs 8 output columns; one column is too few.
        assert!(gptq.unpack(&p).unwrap_err().contains("do not fit"));
        let q8 = le(&[0x7654_3210; 8]);
        let p = Packed {
            qweight: (&[1, 8], &q8),
            qzeros: (&[1, 1], &le(&[0x3333_3333])),
            scales: (&[1, 8], vec![0.5; 8]),
            g_idx: None,
        };
        let (out, rows_in, w) = gptq.unpack(&p).unwrap();
        assert_eq!((out, rows_in), (8, 8));
        assert_eq!(&w[..8], [-2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5]);
        let v2 = Packing::Gptq { bits: 4, group_size: None, zero_offset: 0 };
        assert_eq!(v2.unpack(&p).unwrap().2[..2], [-1.5, -1.0]);
    }

    #[test]
    fn awq_words_hold_output_columns_in_its_interleaved_order() {
        // One input row, 8 output columns: nibble k holds column [0, 2, 4, 6, 1, 3, 5, 7][k].
        let mut word = 0u32;
        for (nibble, column) in [0, 2, 4, 6, 1, 3, 5, 7].into_iter().enumerate() {
            word |= (column as u32 + 1) << (4 * nibble);
        }
        let (q, zeros) = (le(&[word]), le(&[0]));
        let p = Packed {
            qweight: (&[1, 1], &q),
            qzeros: (&[1, 1], &zeros),
            scales: (&[1, 8], vec![2.0; 8]),
            g_idx: None,
        };
        let (out, rows_in, w) = Packing::Awq { group_size: Some(128) }.unpack(&p).unwrap();
        assert_eq!((out, rows_in), (8, 1));
        assert_eq!(w, [2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0]);
    }

    #[test]
    fn configs_name_what_is_not_read() {
        let of = |v: Json, m: &str| Packing::of(&v, m);
        assert_eq!(
            of(serde_json::json!({"bits": 4, "group_size": 128, "desc_act": true}), "gptq"),
            Ok(Some(Packing::Gptq { bits: 4, group_size: Some(128), zero_offset: 1 }))
        );
        assert_eq!(
            of(serde_json::json!({"bits": 8, "group_size": -1, "checkpoint_format": "gptq_v2"}), "gptq"),
            Ok(Some(Packing::Gptq { bits: 8, group_size: None, zero_offset: 0 }))
        );
        assert!(of(serde_json::json!({"bits": 3, "group_size": 128}), "gptq").unwrap_err().contains("3-bit"));
        assert_eq!(
            of(
                serde_json::json!({"bits": 4, "group_size": 128, "zero_point": true, "version": "GEMM"}),
                "awq"
            ),
            Ok(Some(Packing::Awq { group_size: Some(128) }))
        );
        assert!(of(serde_json::json!({"bits": 4, "version": "gemv"}), "awq").unwrap_err().contains("gemv"));
        assert_eq!(of(serde_json::json!({}), "fp8"), Ok(None));
    }
}
