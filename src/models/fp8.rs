//! FP8 checkpoints: weights stored as e4m3 bytes beside their scales, as vLLM's `fp8`
//! format (a per-tensor `weight_scale`, or `weight_scale_inv` over blocks of
//! `weight_block_size`) and compressed-tensors' `float-quantized` one (`weight_scale` per
//! tensor, per output channel or per block) write them. The loader turns each into its
//! values, byte times scale in f32, in the dtype of the checkpoint's other weights; the
//! activation scales (`input_scale`) and KV cache scales are for FP8 arithmetic, which the
//! kernels do not do, and are not read.

use crate::kernels::DType;
use crate::kernels::e4m3;
use crate::kernels::rows::RowFormat;

/// A 2-D weight of `dtype` (a float dtype; `bytes` its elements) quantized at load
/// (`--quantization fp8` on a checkpoint that is not quantized): each row its own scale,
/// its largest magnitude over 448, each value the nearest e4m3 byte. As FP8 rows widening
/// to `dtype` where it is 16-bit and the kernels take the row length, else the rounded
/// values in `dtype`. Rows are quantized in parallel.
pub fn quantize_rows(bytes: &[u8], (rows, cols): (usize, usize), dtype: DType) -> (DType, Vec<u8>) {
    use rayon::prelude::*;
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
            values.iter().map(|&v| if scale == 0.0 { 0 } else { e4m3::encode(v / scale) }).collect();
        let mut encoded = Vec::with_capacity(out.len());
        match kept {
            Some(f) => f.push_fp8_row(&q, &[scale], &mut encoded),
            None => {
                let rounded: Vec<f32> = q.iter().map(|&b| e4m3::decode(b) * scale).collect();
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
    let table = e4m3::values();
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
        let bytes: Vec<u8> = (0..64u32).map(|i| ((i * 5) % 0x7e) as u8).collect();
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
