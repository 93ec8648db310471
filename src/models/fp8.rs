//! FP8 checkpoints: weights stored as e4m3 bytes beside their scales, as vLLM's `fp8`
//! format (a per-tensor `weight_scale`, or `weight_scale_inv` over blocks of
//! `weight_block_size`) and compressed-tensors' `float-quantized` one (`weight_scale` per
//! tensor, per output channel or per block) write them. The loader turns each into its
//! values, byte times scale in f32, in the dtype of the checkpoint's other weights; the
//! activation scales (`input_scale`) and KV cache scales are for FP8 arithmetic, which the
//! kernels do not do, and are not read.

use crate::kernels::DType;
use crate::kernels::rows::RowFormat;

/// One e4m3 byte's value (OCP FP8 E4M3, the `float8_e4m3fn` of PyTorch and safetensors'
/// `F8_E4M3`): sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities, and
/// 0x7f / 0xff are NaN.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = ((b >> 3) & 0x0f, b & 0x07);
    let v = match (e, m) {
        (0x0f, 0x07) => f32::NAN,
        (0, _) => m as f32 / 8.0 * 2f32.powi(-6),
        _ => (1.0 + m as f32 / 8.0) * 2f32.powi(e as i32 - 7),
    };
    sign * v
}

/// The e4m3 byte nearest to `v` (ties to the even byte, as PyTorch's conversion rounds),
/// saturating at ±448; `table` holds [`e4m3_to_f32`] of bytes 0 ..= 0x7e.
pub fn e4m3_nearest(table: &[f32], v: f32) -> u8 {
    let a = v.abs();
    let i = table.partition_point(|&e| e < a).min(table.len() - 1);
    let i = match i {
        0 => 0,
        _ if a - table[i - 1] < table[i] - a => i - 1,
        _ if a - table[i - 1] == table[i] - a && i % 2 == 1 => i - 1,
        _ => i,
    };
    i as u8 | if v.is_sign_negative() && a > 0.0 { 0x80 } else { 0 }
}

/// [`e4m3_to_f32`] of the finite non-negative bytes, 0 ..= 0x7e, ascending.
pub fn e4m3_table() -> Vec<f32> {
    (0..0x7fu8).map(e4m3_to_f32).collect()
}

/// A 2-D weight of `dtype` (a float dtype; `bytes` its elements) quantized at load
/// (`--quantization fp8` on a checkpoint that is not quantized): each row its own scale,
/// its largest magnitude over 448, each value the nearest e4m3 byte. As FP8 rows widening
/// to `dtype` where it is 16-bit and the kernels take the row length, else the rounded
/// values in `dtype`. Rows are quantized in parallel.
pub fn quantize_rows(bytes: &[u8], (rows, cols): (usize, usize), dtype: DType) -> (DType, Vec<u8>) {
    use rayon::prelude::*;
    let table = e4m3_table();
    let kept =
        RowFormat::fp8(cols, None, dtype == DType::F16).filter(|_| matches!(dtype, DType::BF16 | DType::F16));
    let out_row = kept.map_or(dtype.row_bytes(cols), |f| f.row_bytes());
    let mut out = vec![0u8; rows * out_row];
    let in_row = dtype.row_bytes(cols);
    out.par_chunks_mut(out_row).zip(bytes.par_chunks(in_row)).for_each(|(out, row)| {
        let mut values = Vec::with_capacity(4 * cols);
        DType::F32.convert_from(dtype, row, &mut values);
        let values: &[f32] = bytemuck::cast_slice(&values);
        let scale = values.iter().fold(0f32, |m, v| m.max(v.abs())) / 448.0;
        let q: Vec<u8> =
            values.iter().map(|&v| if scale == 0.0 { 0 } else { e4m3_nearest(&table, v / scale) }).collect();
        let mut encoded = Vec::with_capacity(out.len());
        match kept {
            Some(f) => f.push_fp8_row(&q, &[scale], &mut encoded),
            None => {
                let rounded: Vec<f32> = q.iter().map(|&b| e4m3_to_f32(b) * scale).collect();
                encoded = dtype.encode_f32(&rounded);
            }
        }
        out.copy_from_slice(&encoded);
    });
    (kept.map_or(dtype, DType::Rows), out)
}

/// Block edges a block-scaled checkpoint may use, most common first: a scale tensor of
/// `[⌈rows / b⌉, ⌈cols / b'⌉]` names its block by its own shape only.
const BLOCKS: [usize; 6] = [128, 64, 32, 256, 16, 512];

/// How one weight's scales cover it.
#[derive(Debug, Clone, PartialEq)]
pub enum Scales {
    Tensor(f32),
    /// One a row (output channel).
    Channel(Vec<f32>),
    /// One a `rows × cols` block, `per_row` blocks a row of blocks.
    Block {
        rows: usize,
        cols: usize,
        per_row: usize,
        values: Vec<f32>,
    },
}

impl Scales {
    /// The scales of a `[rows, cols]` weight from its scale tensor's shape and values, or
    /// why they do not fit it.
    pub fn of((rows, cols): (usize, usize), shape: &[usize], values: Vec<f32>) -> Result<Self, String> {
        let n = values.len();
        if n == 1 {
            return Ok(Self::Tensor(values[0]));
        }
        if n == rows && shape.iter().filter(|&&d| d != 1).count() <= 1 {
            return Ok(Self::Channel(values));
        }
        if let &[a, b] = shape {
            let edge = |count: usize, len: usize| BLOCKS.into_iter().find(|&e| len.div_ceil(e) == count);
            if let (Some(br), Some(bc)) = (edge(a, rows), edge(b, cols)) {
                return Ok(Self::Block { rows: br, cols: bc, per_row: b, values });
            }
        }
        Err(format!(
            "scales of shape {shape:?} fit a [{rows}, {cols}] weight neither per tensor, per channel nor in \
             blocks of {BLOCKS:?}"
        ))
    }

    fn at(&self, r: usize, c: usize) -> f32 {
        match self {
            Self::Tensor(s) => *s,
            Self::Channel(v) => v[r],
            Self::Block { rows, cols, per_row, values } => values[(r / rows) * per_row + c / cols],
        }
    }
}

/// A `[rows, cols]` weight's e4m3 bytes as values, each byte's value times its scale (in
/// f32), encoded in `dtype` (a float dtype).
pub fn dequantize(bytes: &[u8], (rows, cols): (usize, usize), scales: &Scales, dtype: DType) -> Vec<u8> {
    assert_eq!(bytes.len(), rows * cols, "one byte an element");
    let table: Vec<f32> = (0..=255u8).map(e4m3_to_f32).collect();
    let values: Vec<f32> = bytes
        .chunks_exact(cols.max(1))
        .enumerate()
        .flat_map(|(r, row)| row.iter().enumerate().map(move |(c, &b)| (r, c, b)))
        .map(|(r, c, b)| table[b as usize] * scales.at(r, c))
        .collect();
    dtype.encode_f32(&values)
}

/// A `[rows, cols]` weight's e4m3 bytes kept as FP8 rows widening to `dtype` (bf16 or
/// f16; [`RowFormat`]), where its scales are one a row or in blocks along whole groups of
/// its columns that the kernels take; None otherwise.
pub fn kept(
    bytes: &[u8],
    (rows, cols): (usize, usize),
    scales: &Scales,
    dtype: DType,
) -> Option<(RowFormat, Vec<u8>)> {
    let f16 = match dtype {
        DType::BF16 => false,
        DType::F16 => true,
        _ => return None,
    };
    let group = match scales {
        Scales::Tensor(_) | Scales::Channel(_) => None,
        Scales::Block { cols: bc, .. } => Some(*bc),
    };
    let format = RowFormat::fp8(cols, group, f16)?;
    let groups = format.groups();
    let mut out = Vec::with_capacity(rows * format.row_bytes());
    for (r, row) in bytes.chunks_exact(cols).enumerate() {
        let row_scales: Vec<f32> = (0..groups).map(|g| scales.at(r, g * cols / groups)).collect();
        format.push_fp8_row(row, &row_scales, &mut out);
    }
    Some((format, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_bytes_have_the_formats_values() {
        // The OCP FP8 specification's landmarks.
        for (b, v) in [
            (0x00, 0.0),
            (0x80, -0.0),
            (0x38, 1.0),
            (0xb8, -1.0),
            (0x40, 2.0),
            (0x39, 1.125),
            (0x7e, 448.0),
            (0xfe, -448.0),
            (0x08, 2f32.powi(-6)),
            (0x01, 2f32.powi(-9)),
            (0x07, 7.0 * 2f32.powi(-9)),
        ] {
            assert_eq!(e4m3_to_f32(b), v, "{b:#04x}");
        }
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        assert!((0..=255u8).filter(|b| b & 0x7f != 0x7f).all(|b| e4m3_to_f32(b).is_finite()));
    }

    #[test]
    fn scales_are_told_apart_by_their_shape() {
        assert_eq!(Scales::of((4, 8), &[], vec![0.5]), Ok(Scales::Tensor(0.5)));
        assert_eq!(Scales::of((4, 8), &[1], vec![0.5]), Ok(Scales::Tensor(0.5)));
        assert_eq!(
            Scales::of((3, 8), &[3, 1], vec![1.0, 2.0, 3.0]),
            Ok(Scales::Channel(vec![1.0, 2.0, 3.0]))
        );
        // 300 × 200 in blocks of 128: 3 × 2 scales.
        let b = Scales::of((300, 200), &[3, 2], (0..6).map(|i| i as f32).collect()).unwrap();
        assert_eq!(b.at(0, 0), 0.0);
        assert_eq!(b.at(127, 128), 1.0);
        assert_eq!(b.at(128, 0), 2.0);
        assert_eq!(b.at(299, 199), 5.0);
        assert!(Scales::of((300, 200), &[4, 3], vec![1.0; 12]).unwrap_err().contains("[300, 200]"));
    }

    #[test]
    fn values_round_to_the_nearest_byte_and_rows_take_their_own_scale() {
        let t = e4m3_table();
        for (v, b) in [(1.0, 0x38), (1.06, 0x38), (1.07, 0x39), (-2.0, 0xc0), (500.0, 0x7e), (0.0, 0x00)] {
            assert_eq!(e4m3_nearest(&t, v), b, "{v}");
        }
        // 1.0625 is halfway between 1.0 (0x38, even) and 1.125 (0x39): to the even byte.
        assert_eq!(e4m3_nearest(&t, 1.0625), 0x38);
        assert_eq!(e4m3_nearest(&t, 1.1875), 0x3a);
        // Two rows of 16 whose largest magnitudes (7 and 28) become ±448 times their row's
        // scale (1/64 and 1/16); every value within e4m3's 1/16.
        let values: Vec<f32> = (0..32)
            .map(|i| if i < 16 { (i as f32 - 8.0) * 0.875 } else { (i as f32 - 15.0) * 1.75 })
            .collect();
        let f32_bytes: &[u8] = bytemuck::cast_slice(&values);
        let mut bf16 = Vec::new();
        DType::BF16.convert_from(DType::F32, f32_bytes, &mut bf16);
        let (dtype, bytes) = quantize_rows(&bf16, (2, 16), DType::BF16);
        let DType::Rows(f) = dtype else { panic!("kept as rows: {dtype:?}") };
        let mut got = Vec::new();
        f.dequantize(&bytes, &mut got);
        assert_eq!((got[0], got[31]), (-7.0, 28.0));
        assert!(got.iter().zip(&values).all(|(g, v)| (g - v).abs() <= v.abs() / 16.0));
        let (dtype, bytes) = quantize_rows(f32_bytes, (2, 16), DType::F32);
        assert_eq!(dtype, DType::F32);
        assert_eq!(bytemuck::cast_slice::<u8, f32>(&bytes)[31], 28.0);
    }

    #[test]
    fn kept_rows_widen_to_the_dequantized_values() {
        // 2 × 32 bytes in blocks of 1 × 16, and per channel; f32 has no 16-bit rows.
        let bytes: Vec<u8> = (0..64u8).map(|i| (i * 5) % 0x7e).collect();
        let blocks = Scales::Block { rows: 1, cols: 16, per_row: 2, values: vec![0.5, 2.0, -1.0, 0.25] };
        for scales in [blocks, Scales::Channel(vec![3.0, 0.125])] {
            for dtype in [DType::BF16, DType::F16] {
                let (format, rows) = kept(&bytes, (2, 32), &scales, dtype).unwrap();
                let mut got = Vec::new();
                format.dequantize(&rows, &mut got);
                let mut want = Vec::new();
                DType::F32.convert_from(dtype, &dequantize(&bytes, (2, 32), &scales, dtype), &mut want);
                assert_eq!(bytemuck::cast_slice::<u8, f32>(&want), got, "{scales:?} {dtype:?}");
            }
        }
        assert!(kept(&bytes, (2, 32), &Scales::Tensor(1.0), DType::F32).is_none());
    }

    #[test]
    fn a_weight_is_each_byte_times_its_scale() {
        let bytes = [0x38, 0x40, 0xb8, 0x39];
        let out = dequantize(&bytes, (2, 2), &Scales::Channel(vec![0.5, 3.0]), DType::F32);
        let got: &[f32] = bytemuck::cast_slice(&out);
        assert_eq!(got, [0.5, 1.0, -3.0, 3.375]);
    }
}
