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
//! - compressed-tensors (llm-compressor's output), read by [`unpack_compressed`]: its
//!   `pack-quantized` format keeps `X.weight_packed` `[out, ⌈in · bits / 32⌉]`, each row's
//!   elements `bits` apiece from the lowest bit up, stored plus `2^(bits - 1)`, beside
//!   `X.weight_shape`, `X.weight_scale` `[out, groups]`, and for asymmetric schemes
//!   `X.weight_zero_point` packed the same way down the output dimension; its
//!   `int-quantized` format keeps `X.weight` as int8. Activation-ordered groups come in
//!   `X.weight_g_idx`.

use serde_json::Value as Json;

use crate::kernels::rows::RowFormat;

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
    /// compressed-tensors' integer formats; each tensor's bits follow from its shapes.
    CompressedInt,
}

/// Bits an integer weight of compressed-tensors may have: those whose elements never
/// straddle an int32 word, so that every version of its packing agrees.
const COMPRESSED_BITS: [u64; 3] = [2, 4, 8];

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
            "compressed-tensors" => {
                let Some(groups) = q.get("config_groups").and_then(Json::as_object) else { return Ok(None) };
                let ints = groups.values().filter(|g| g["weights"]["type"] == "int").count();
                if ints == 0 {
                    return Ok(None);
                }
                if ints != groups.len() {
                    return Err("compressed-tensors with integer and float weight groups mixed".into());
                }
                for g in groups.values() {
                    let bits = g["weights"]["num_bits"].as_u64().unwrap_or(0);
                    if !COMPRESSED_BITS.contains(&bits) {
                        return Err(format!(
                            "compressed-tensors with {bits}-bit integer weights (2, 4 and 8 are read)"
                        ));
                    }
                    let format = g.get("format").or_else(|| q.get("format")).and_then(Json::as_str);
                    match format {
                        Some("pack-quantized" | "int-quantized" | "naive-quantized") => {}
                        other => {
                            return Err(format!(
                                "compressed-tensors' {} format for integer weights (pack-quantized and \
                                 int-quantized are read)",
                                other.unwrap_or("unnamed")
                            ));
                        }
                    }
                }
                let sparsity = q.get("sparsity_config").and_then(|s| s.get("format")).and_then(Json::as_str);
                if let Some(f) = sparsity.filter(|f| *f != "dense") {
                    return Err(format!("compressed-tensors' {f} sparsity"));
                }
                Ok(Some(Self::CompressedInt))
            }
            _ => Ok(None),
        }
    }

    /// The group size of a 4-bit packing whose groups are consecutive input rows (None
    /// inside: one group a row); None for other packings. What a checkpoint-less load of
    /// its config makes (`WeightStore::dummy`).
    pub fn int4_group(self) -> Option<Option<usize>> {
        match self {
            Self::Gptq { bits: 4, group_size, .. } | Self::Awq { group_size } => Some(group_size),
            _ => None,
        }
    }

    /// The weight `[out, in]` of `p` as its integers, zero points and scales.
    pub fn unpack(&self, p: &Packed) -> Result<IntWeight, String> {
        // (bits, AWQ's column-packed layout, zero offset, group size without g_idx)
        let (bits, awq, zero_offset, group_size) = match *self {
            Self::Gptq { bits, group_size, zero_offset } => (bits, false, zero_offset, group_size),
            Self::Awq { group_size } => (4, true, 0, group_size),
            Self::CompressedInt => return Err("a compressed-tensors weight is not a qweight".into()),
        };
        let per = (32 / bits) as usize;
        let mask = (1u32 << bits) - 1;
        let q = words(p.qweight.1);
        let z = words(p.qzeros.1);
        let (qa, qb) = shape2("qweight", p.qweight.0)?;
        let (za, zb) = shape2("qzeros", p.qzeros.0)?;
        let (sa, sb) = shape2("scales", p.scales.0)?;
        let (rows_in, out) = if awq { (qa, qb * per) } else { (qa * per, qb) };
        let groups = sa;
        if sb != out || za != groups || zb * per != out {
            return Err(format!(
                "qweight {:?}, qzeros {:?} and scales {:?} do not fit one [{out}, {rows_in}] weight",
                p.qweight.0, p.qzeros.0, p.scales.0
            ));
        }
        let group_of: Vec<usize> = match p.g_idx.filter(|_| !awq) {
            Some((shape, bytes)) => {
                if shape != [rows_in] {
                    return Err(format!("g_idx has shape {shape:?}, not [{rows_in}]"));
                }
                words(bytes).into_iter().map(|g| g as usize).collect()
            }
            None => {
                let size = group_size.unwrap_or(rows_in).max(1);
                (0..rows_in).map(|i| i / size).collect()
            }
        };
        if let Some(g) = group_of.iter().find(|&&g| g >= groups) {
            return Err(format!("an input row is in group {g} of {groups}"));
        }
        // The stored value at packed word `word`, slot `slot`.
        let at = |words: &[u32], word: usize, slot: u32| (words[word] >> (slot * bits)) & mask;
        let column_slot = |n: usize| if awq { AWQ_NIBBLE[n % 8] } else { (n % per) as u32 };
        // Zero points and scales `[out, groups]`.
        let zeros = (0..out * groups)
            .map(|i| {
                let (n, g) = (i / groups, i % groups);
                (at(&z, g * zb + n / per, column_slot(n)) + zero_offset) as i32
            })
            .collect();
        let scales = (0..out * groups).map(|i| p.scales.1[(i % groups) * out + i / groups]).collect();
        let values = (0..out * rows_in)
            .map(|k| {
                let (n, i) = (k / rows_in, k % rows_in);
                let v = match awq {
                    true => at(&q, i * qb + n / per, column_slot(n)),
                    false => at(&q, (i / per) * qb + n, (i % per) as u32),
                };
                v as u8
            })
            .collect();
        Ok(IntWeight { out, cols: rows_in, bits, q: values, groups, group_of, zeros, scales })
    }
}

/// An integer weight `[out, cols]` unpacked: unsigned values `q` of `bits` bits, row-major,
/// and per output row and group a zero point (in q's terms) and a scale; element (n, i) is
/// `(q − zero) × scale` of its row and of group `group_of[i]`.
#[derive(Debug)]
pub struct IntWeight {
    pub out: usize,
    pub cols: usize,
    pub bits: u32,
    pub q: Vec<u8>,
    pub groups: usize,
    pub group_of: Vec<usize>,
    /// `[out, groups]`.
    pub zeros: Vec<i32>,
    /// `[out, groups]`, exact in the checkpoint's scale type.
    pub scales: Vec<f32>,
}

impl IntWeight {
    /// The elements, row-major f32.
    pub fn values(&self) -> Vec<f32> {
        (0..self.out * self.cols)
            .map(|k| {
                let (n, i) = (k / self.cols, k % self.cols);
                let g = n * self.groups + self.group_of[i];
                (i32::from(self.q[k]) - self.zeros[g]) as f32 * self.scales[g]
            })
            .collect()
    }

    /// The weight kept packed as 4-bit rows with `f16` (else bf16) scales, where the
    /// kernels take it: 4-bit values, groups of consecutive columns (a g_idx in order),
    /// rows and groups multiples of 32.
    pub fn int4(&self, f16: bool) -> Option<(RowFormat, Vec<u8>)> {
        if self.bits != 4 || self.zeros.iter().any(|z| !(0..=16).contains(z)) {
            return None;
        }
        let size = self.cols / self.groups.max(1);
        let in_order = self.cols.is_multiple_of(self.groups.max(1))
            && self.group_of.iter().enumerate().all(|(i, &g)| g == i / size);
        let f = RowFormat::int4(self.cols, Some(size), f16).filter(|_| in_order)?;
        let mut bytes = Vec::with_capacity(self.out * f.row_bytes());
        for n in 0..self.out {
            let g = n * self.groups..(n + 1) * self.groups;
            f.push_int4_row(
                &self.q[n * self.cols..(n + 1) * self.cols],
                &self.zeros[g.clone()],
                &self.scales[g],
                &mut bytes,
            );
        }
        Some((f, bytes))
    }
}

/// Integers as stored: int32 words, or int8 bytes.
#[derive(Clone, Copy)]
pub enum Ints<'a> {
    Words(&'a [usize], &'a [u8]),
    Bytes(&'a [usize], &'a [u8]),
}

/// The tensors of one compressed-tensors integer weight, as stored.
pub struct Compressed<'a> {
    /// `weight_packed` (int32 words) or, as int-quantized stores it, `weight` (int8).
    pub weight: Ints<'a>,
    /// `weight_shape`: `[out, in]` before packing.
    pub shape: Option<(usize, usize)>,
    /// `weight_scale`, widened to f32, and its shape.
    pub scales: (&'a [usize], Vec<f32>),
    pub zero_point: Option<Ints<'a>>,
    pub g_idx: Option<(&'a [usize], &'a [u8])>,
}

/// Element `i` of a stream of `bits`-bit unsigned values packed into `words` from the
/// lowest bit up (no element straddles a word for 2, 4 and 8 bits).
fn element(words: &[u32], bits: usize, i: usize) -> u32 {
    (words[i * bits / 32] >> ((i * bits) % 32)) & ((1u32 << bits) - 1)
}

/// The weight `[out, in]` of `c` as its integers (unsigned: stored values as they are,
/// int8 ones plus 128), zero points (a symmetric scheme's is the offset) and scales.
pub fn unpack_compressed(c: &Compressed) -> Result<IntWeight, String> {
    let (rows, cols, bits, q): (usize, usize, usize, Vec<u8>) = match c.weight {
        Ints::Words(shape, bytes) => {
            let (rows, per_row) = shape2("weight_packed", shape)?;
            let (out, cols) = c.shape.ok_or("weight_packed has no weight_shape beside it")?;
            let bits = COMPRESSED_BITS
                .iter()
                .map(|&b| b as usize)
                .find(|&b| (cols * b).div_ceil(32) == per_row)
                .filter(|_| out == rows)
                .ok_or_else(|| {
                    format!("weight_packed {shape:?} packs no [{out}, {cols}] weight in 2, 4 or 8 bits")
                })?;
            let words = words(bytes);
            let q = (0..rows * cols)
                .map(|k| element(&words[(k / cols) * per_row..], bits, k % cols) as u8)
                .collect();
            (rows, cols, bits, q)
        }
        Ints::Bytes(shape, bytes) => {
            let (rows, cols) = shape2("weight", shape)?;
            (rows, cols, 8, bytes.iter().map(|&b| b ^ 0x80).collect())
        }
    };
    let offset = 1i32 << (bits - 1);
    let (scale_shape, scales) = (c.scales.0, &c.scales.1);
    let groups = match scale_shape {
        _ if scales.len() == 1 => 0,
        [r, g] if *r == rows => *g,
        [r] if *r == rows => 1,
        _ => return Err(format!("weight_scale {scale_shape:?} fits no [{rows}, {cols}] weight")),
    };
    let group_of: Vec<usize> = match c.g_idx {
        Some((shape, bytes)) if shape == [cols] => words(bytes).into_iter().map(|g| g as usize).collect(),
        Some((shape, _)) => return Err(format!("weight_g_idx has shape {shape:?}, not [{cols}]")),
        None => {
            let size = cols.div_ceil(groups.max(1));
            (0..cols).map(|i| i / size).collect()
        }
    };
    if let Some(g) = group_of.iter().find(|&&g| g >= groups.max(1)) {
        return Err(format!("an input column is in group {g} of {groups}"));
    }
    let g = groups.max(1);
    let scales = (0..rows * g).map(|i| if groups == 0 { scales[0] } else { scales[i] }).collect();
    // Zero points `[rows, groups]`, in q's unsigned terms.
    let zeros: Vec<i32> = match c.zero_point {
        None => vec![offset; rows * g],
        Some(Ints::Bytes(shape, bytes)) => {
            if shape.iter().product::<usize>() != rows * g {
                return Err(format!("weight_zero_point {shape:?} fits no [{rows}, {g}] scales"));
            }
            bytes.iter().map(|&b| b as i8 as i32 + offset).collect()
        }
        Some(Ints::Words(shape, bytes)) => {
            // Packed down the output: column `gi`'s words are rows `0..⌈rows · bits / 32⌉`.
            let word_rows = (rows * bits).div_ceil(32);
            if shape2("weight_zero_point", shape)? != (word_rows, g) {
                return Err(format!("weight_zero_point {shape:?} packs no [{rows}, {g}] zero points"));
            }
            let w = words(bytes);
            let columns: Vec<Vec<u32>> =
                (0..g).map(|gi| (0..word_rows).map(|r| w[r * g + gi]).collect()).collect();
            (0..rows * g).map(|k| element(&columns[k % g], bits, k / g) as i32).collect()
        }
    };
    Ok(IntWeight { out: rows, cols, bits: bits as u32, q, groups: g, group_of, zeros, scales })
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
        let w = gptq.unpack(&p).unwrap();
        assert_eq!((w.out, w.cols), (8, 8));
        assert_eq!(w.values()[..8], [-2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5]);
        let v2 = Packing::Gptq { bits: 4, group_size: None, zero_offset: 0 };
        assert_eq!(v2.unpack(&p).unwrap().values()[..2], [-1.5, -1.0]);
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
        let w = Packing::Awq { group_size: Some(128) }.unpack(&p).unwrap();
        assert_eq!((w.out, w.cols), (8, 1));
        assert_eq!(w.values(), [2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0]);
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
        let ct = |format: &str, ty: &str, bits: u32| serde_json::json!({"format": format, "config_groups": {"g": {"weights": {"type": ty, "num_bits": bits}}}});
        assert_eq!(
            of(ct("pack-quantized", "int", 4), "compressed-tensors"),
            Ok(Some(Packing::CompressedInt))
        );
        assert_eq!(of(ct("int-quantized", "int", 8), "compressed-tensors"), Ok(Some(Packing::CompressedInt)));
        // FP8 groups are the FP8 loader's; other bits and formats are named.
        assert_eq!(of(ct("float-quantized", "float", 8), "compressed-tensors"), Ok(None));
        assert!(of(ct("pack-quantized", "int", 3), "compressed-tensors").unwrap_err().contains("3-bit"));
        assert!(
            of(ct("marlin-24", "int", 4), "compressed-tensors").unwrap_err().contains("marlin-24 format")
        );
    }
}
