//! Quantized weights kept packed, a row at a time, for the GPU's kernels to multiply as
//! they are (cuda/gemv.cu's `Int4` and `Fp8` weights, and a widening kernel ahead of
//! cuBLAS for prompts); the CPU widens them to their 16-bit type at upload.
//!
//! A row of `k` elements takes [`RowFormat::row_bytes`]: its values, then 4 bytes a group
//! (of `group` consecutive columns, or one a row), then zeros up to a multiple of 16 bytes.
//! Two encodings:
//! - `Int4`: GPTQ, AWQ and compressed-tensors 4-bit weights whose groups are consecutive
//!   input columns (no activation order). `k / 2` bytes of values, a 32-bit word for each 8
//!   consecutive elements: elements 0, 2, 4 and 6 in bits 0..16 (4 bits each, from bit 0)
//!   and 1, 3, 5 and 7 in bits 16..32, so that `(word >> 4j) & 0x000f000f` holds elements
//!   2j and 2j + 1 in its two halves. A group's 4 bytes: its scale and `MAGIC + zero` in the
//!   16-bit type (`MAGIC` is 128 for bf16 and 1024 for f16: the number whose last mantissa
//!   bit is worth 1, so that `MAGIC | q` read as that type is `MAGIC + q`). Element
//!   `(q − zero) × scale`, rounded once to the 16-bit type.
//! - `Fp8`: FP8 (e4m3) checkpoints' weights, per tensor, per channel or in blocks along a
//!   row. `k` bytes of values, then each group's scale as f32. Element `value × scale` in
//!   f32, rounded to the 16-bit type.
//!
//! Either way an element is what the checkpoint's own dequantization gives in that type.

use half::{bf16, f16};

/// Which encoding a row holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum RowKind {
    Int4,
    Fp8,
}

/// How a kept weight's rows are laid out: the encoding, the row length, the group size (0:
/// one group a row) and the 16-bit type the values widen to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct RowFormat {
    pub kind: RowKind,
    pub cols: u32,
    pub group: u32,
    pub f16: bool,
}

impl std::fmt::Display for RowFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let half = if self.f16 { "f16" } else { "bf16" };
        let what = match self.kind {
            RowKind::Int4 => "4-bit weights",
            RowKind::Fp8 => "FP8 weights",
        };
        match self.group {
            0 => write!(f, "{what} (one scale a row, widening to {half})"),
            g => write!(f, "{what} (groups of {g}, widening to {half})"),
        }
    }
}

/// `v` rounded to bf16 or f16, and its bits.
fn half_bits(v: f32, f16: bool) -> u16 {
    match f16 {
        true => f16::from_f32(v).to_bits(),
        false => bf16::from_f32(v).to_bits(),
    }
}

fn half_value(bits: u16, f16: bool) -> f32 {
    match f16 {
        true => f16::from_bits(bits).to_f32(),
        false => bf16::from_bits(bits).to_f32(),
    }
}

impl RowFormat {
    /// 4-bit rows of `cols` in groups of `group` (None: one a row), if the kernels take
    /// them: rows a multiple of 32 elements, groups too.
    pub fn int4(cols: usize, group: Option<usize>, f16: bool) -> Option<Self> {
        Self::new(RowKind::Int4, 32, cols, group, f16)
    }

    /// FP8 rows of `cols` in groups of `group` (None: one a row), if the kernels take
    /// them: rows and groups multiples of 16 elements.
    pub fn fp8(cols: usize, group: Option<usize>, f16: bool) -> Option<Self> {
        Self::new(RowKind::Fp8, 16, cols, group, f16)
    }

    fn new(kind: RowKind, unit: usize, cols: usize, group: Option<usize>, f16: bool) -> Option<Self> {
        let group = group.filter(|&g| g != cols).unwrap_or(0);
        let fits = cols > 0
            && cols.is_multiple_of(unit)
            && (group == 0 || group.is_multiple_of(unit) && cols.is_multiple_of(group));
        fits.then_some(Self { kind, cols: cols as u32, group: group as u32, f16 })
    }

    /// Groups in a row.
    pub fn groups(self) -> usize {
        match self.group {
            0 => 1,
            g => self.cols as usize / g as usize,
        }
    }

    /// Bytes of a row's values.
    fn value_bytes(self) -> usize {
        match self.kind {
            RowKind::Int4 => self.cols as usize / 2,
            RowKind::Fp8 => self.cols as usize,
        }
    }

    /// Bytes of one row.
    pub fn row_bytes(self) -> usize {
        (self.value_bytes() + 4 * self.groups()).next_multiple_of(16)
    }

    /// `v` rounded to the 16-bit type the values widen to.
    pub fn round(self, v: f32) -> f32 {
        half_value(half_bits(v, self.f16), self.f16)
    }

    /// The 16-bit value whose last mantissa bit is worth 1.
    fn magic(self) -> f32 {
        if self.f16 { 1024.0 } else { 128.0 }
    }

    /// Appends one 4-bit row: `q` its `cols` values (0..16), `zeros` and `scales` one a
    /// group (zeros 0..=16, scales exact in the 16-bit type).
    pub fn push_int4_row(self, q: &[u8], zeros: &[i32], scales: &[f32], out: &mut Vec<u8>) {
        assert_eq!(self.kind, RowKind::Int4);
        let start = out.len();
        for w in q.chunks_exact(8) {
            let word = (0..4).fold(0u32, |acc, j| {
                acc | (u32::from(w[2 * j]) << (4 * j)) | (u32::from(w[2 * j + 1]) << (16 + 4 * j))
            });
            out.extend_from_slice(&word.to_le_bytes());
        }
        for (&z, &s) in zeros.iter().zip(scales) {
            out.extend_from_slice(&half_bits(s, self.f16).to_le_bytes());
            out.extend_from_slice(&half_bits(self.magic() + z as f32, self.f16).to_le_bytes());
        }
        out.resize(start + self.row_bytes(), 0);
    }

    /// Appends one FP8 row: its `cols` e4m3 bytes and its groups' scales.
    pub fn push_fp8_row(self, values: &[u8], scales: &[f32], out: &mut Vec<u8>) {
        assert_eq!(self.kind, RowKind::Fp8);
        let start = out.len();
        out.extend_from_slice(values);
        for s in scales {
            out.extend_from_slice(&s.to_le_bytes());
        }
        out.resize(start + self.row_bytes(), 0);
    }

    /// Group `g`'s 4 bytes in `row`.
    fn group_word(self, row: &[u8], g: usize) -> [u8; 4] {
        let at = self.value_bytes() + 4 * g;
        [row[at], row[at + 1], row[at + 2], row[at + 3]]
    }

    /// Group `g`'s scale in `row`.
    fn scale(self, row: &[u8], g: usize) -> f32 {
        let w = self.group_word(row, g);
        match self.kind {
            RowKind::Int4 => half_value(u16::from_le_bytes([w[0], w[1]]), self.f16),
            RowKind::Fp8 => f32::from_le_bytes(w),
        }
    }

    /// The groups' scales of whole rows, row by row.
    pub fn scales(self, bytes: &[u8]) -> Vec<f32> {
        let groups = self.groups();
        bytes
            .chunks_exact(self.row_bytes())
            .flat_map(|row| (0..groups).map(move |g| self.scale(row, g)))
            .collect()
    }

    /// Appends the f32 values of whole rows, each rounded to the 16-bit type as the
    /// checkpoint's dequantization rounds it.
    pub fn dequantize(self, bytes: &[u8], out: &mut Vec<f32>) {
        let (cols, groups) = (self.cols as usize, self.groups());
        out.reserve(bytes.len() / self.row_bytes() * cols);
        let fp8 = super::e4m3::values();
        for row in bytes.chunks_exact(self.row_bytes()) {
            let scales: Vec<f32> = (0..groups).map(|g| self.scale(row, g)).collect();
            let group_of = |i: usize| i * groups / cols;
            match self.kind {
                RowKind::Int4 => {
                    let zeros: Vec<f32> = (0..groups)
                        .map(|g| {
                            let w = self.group_word(row, g);
                            half_value(u16::from_le_bytes([w[2], w[3]]), self.f16) - self.magic()
                        })
                        .collect();
                    for (i, w) in row[..cols / 2].chunks_exact(4).enumerate() {
                        let word = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
                        for e in 0..8 {
                            let shift = if e % 2 == 0 { 2 * e } else { 16 + 2 * (e - 1) };
                            let q = ((word >> shift) & 0xf) as f32;
                            let g = group_of(8 * i + e);
                            out.push(self.round((q - zeros[g]) * scales[g]));
                        }
                    }
                }
                RowKind::Fp8 => {
                    out.extend(
                        row[..cols]
                            .iter()
                            .enumerate()
                            .map(|(i, &b)| self.round(fp8[b as usize] * scales[group_of(i)])),
                    );
                }
            }
        }
    }

    /// The index of the first element that is not finite (a NaN value, or a group whose
    /// scale is not), if one is not.
    pub fn bad_value(self, bytes: &[u8]) -> Option<usize> {
        let (cols, groups) = (self.cols as usize, self.groups());
        bytes.chunks_exact(self.row_bytes()).enumerate().find_map(|(r, row)| {
            let nan = match self.kind {
                RowKind::Fp8 => row[..cols].iter().position(|b| b & 0x7f == 0x7f),
                RowKind::Int4 => None,
            };
            nan.or_else(|| (0..groups).find(|&g| !self.scale(row, g).is_finite()).map(|g| g * cols / groups))
                .map(|i| r * cols + i)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int4_rows_hold_the_values_of_their_groups() {
        // Two rows of 64 in groups of 32: every value, zero point and scale comes back.
        for f16 in [false, true] {
            let f = RowFormat::int4(64, Some(32), f16).unwrap();
            assert_eq!((f.groups(), f.row_bytes()), (2, 48));
            let q: Vec<u8> = (0..128).map(|i| (i * 7 % 16) as u8).collect();
            let (zeros, scales) = ([0, 16, 8, 3], [0.5, -0.25, 2.0, 0.125]);
            let mut bytes = Vec::new();
            for r in 0..2 {
                let g = 2 * r..2 * r + 2;
                f.push_int4_row(&q[64 * r..64 * (r + 1)], &zeros[g.clone()], &scales[g], &mut bytes);
            }
            assert_eq!(bytes.len(), 96);
            let mut got = Vec::new();
            f.dequantize(&bytes, &mut got);
            let want: Vec<f32> =
                (0..128).map(|i| (q[i] as f32 - zeros[i / 32] as f32) * scales[i / 32]).collect();
            assert_eq!(got, want, "f16 {f16}");
            assert_eq!(f.bad_value(&bytes), None);
        }
        // The words' halves: element 1 is bit 16, element 2 bit 4.
        let f = RowFormat::int4(32, None, false).unwrap();
        let mut q = [0u8; 32];
        q[1] = 1;
        q[2] = 1;
        let mut bytes = Vec::new();
        f.push_int4_row(&q, &[0], &[1.0], &mut bytes);
        assert_eq!(u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]), (1 << 16) | (1 << 4));
    }

    #[test]
    fn fp8_rows_are_each_byte_times_its_groups_scale_rounded_once() {
        let f = RowFormat::fp8(32, Some(16), false).unwrap();
        assert_eq!(f.row_bytes(), 48);
        // 1.125 (0x39) × 1.0009765625 is 1.1260986328125 in f32, 1.125 in bf16; 2 (0x40) ×
        // -3.
        let values: Vec<u8> = (0..32).map(|i| if i < 16 { 0x39 } else { 0x40 }).collect();
        let mut bytes = Vec::new();
        f.push_fp8_row(&values, &[1.0 + 2f32.powi(-10), -3.0], &mut bytes);
        let mut got = Vec::new();
        f.dequantize(&bytes, &mut got);
        assert_eq!(got[..16], [1.125; 16]);
        assert_eq!(got[16..], [-6.0; 16]);
        assert_eq!(f.scales(&bytes), [1.0 + 2f32.powi(-10), -3.0]);
        assert_eq!(f.bad_value(&bytes), None);
        let mut nan = bytes.clone();
        nan[20] = 0x7f;
        assert_eq!(f.bad_value(&nan), Some(20));
        let mut inf = bytes;
        inf[32 + 4..32 + 8].copy_from_slice(&f32::INFINITY.to_le_bytes());
        assert_eq!(f.bad_value(&inf), Some(16));
    }

    #[test]
    fn only_whole_groups_the_kernels_take_are_kept() {
        assert_eq!(RowFormat::int4(4096, Some(128), false).map(|f| f.row_bytes()), Some(2048 + 128));
        assert_eq!(RowFormat::int4(3584, Some(128), false).map(|f| f.row_bytes()), Some(1792 + 112));
        assert_eq!(RowFormat::int4(256, None, true).map(|f| (f.group, f.row_bytes())), Some((0, 144)));
        assert_eq!(RowFormat::int4(256, Some(256), true).map(|f| f.group), Some(0));
        assert_eq!(RowFormat::int4(96, Some(48), false), None);
        assert_eq!(RowFormat::int4(80, None, false), None);
        assert_eq!(RowFormat::int4(192, Some(128), false), None);
        assert_eq!(RowFormat::fp8(4096, Some(128), false).map(|f| f.row_bytes()), Some(4096 + 128));
        assert_eq!(RowFormat::fp8(80, None, false).map(|f| f.row_bytes()), Some(96));
        assert_eq!(RowFormat::fp8(200, Some(128), false), None);
    }
}
