//! 4-bit integer weights in groups, kept packed: GPTQ, AWQ and compressed-tensors
//! checkpoints whose groups are consecutive input columns (no activation order). A GPU
//! multiplies them as they are (cuda/gemv.cu's `Int4` weights, and a dequantizing kernel
//! ahead of cuBLAS for prompts); the CPU widens them to their 16-bit type at upload.
//!
//! A row of `k` elements (k a multiple of 32) takes [`Int4Format::row_bytes`]:
//! - `k / 2` bytes of values, a 32-bit word for each 8 consecutive elements: elements 0, 2,
//!   4 and 6 in bits 0..16 (4 bits each, from bit 0) and 1, 3, 5 and 7 in bits 16..32, so
//!   that `(word >> 4j) & 0x000f000f` holds elements 2j and 2j + 1 in its two halves;
//! - then, for each group, its scale and `MAGIC + zero` in the 16-bit type (`MAGIC` is 128
//!   for bf16 and 1024 for f16: the number whose last mantissa bit is worth 1, so that
//!   `MAGIC | q` read as that type is `MAGIC + q`);
//! - then zeros up to a multiple of 16 bytes.
//!
//! Element `(q − zero) × scale`, rounded once to the 16-bit type: the checkpoint's own
//! dequantization, since `q − zero` and its product with a 16-bit scale are exact in f32.

use half::{bf16, f16};

/// How a kept 4-bit weight is laid out: its row length, its group size (0: one group a
/// row) and its scales' type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Int4Format {
    pub cols: u32,
    pub group: u32,
    pub f16: bool,
}

impl std::fmt::Display for Int4Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let half = if self.f16 { "f16" } else { "bf16" };
        match self.group {
            0 => write!(f, "4-bit weights (one {half} scale a row)"),
            g => write!(f, "4-bit weights (groups of {g}, {half} scales)"),
        }
    }
}

impl Int4Format {
    /// The format of rows of `cols` elements in groups of `group` (None: one a row), if
    /// the kernels take it: rows a multiple of 32 elements, groups too.
    pub fn new(cols: usize, group: Option<usize>, f16: bool) -> Option<Self> {
        let group = group.filter(|&g| g != cols).unwrap_or(0);
        let fits = cols > 0
            && cols.is_multiple_of(32)
            && (group == 0 || group.is_multiple_of(32) && cols.is_multiple_of(group));
        fits.then_some(Self { cols: cols as u32, group: group as u32, f16 })
    }

    /// Groups in a row.
    pub fn groups(self) -> usize {
        match self.group {
            0 => 1,
            g => self.cols as usize / g as usize,
        }
    }

    /// Bytes of one row.
    pub fn row_bytes(self) -> usize {
        (self.cols as usize / 2 + 4 * self.groups()).next_multiple_of(16)
    }

    /// The 16-bit value whose last mantissa bit is worth 1.
    fn magic(self) -> f32 {
        if self.f16 { 1024.0 } else { 128.0 }
    }

    /// `v` rounded to the scales' 16-bit type.
    pub fn round(self, v: f32) -> f32 {
        self.half_value(self.half_bits(v))
    }

    fn half_bits(self, v: f32) -> u16 {
        match self.f16 {
            true => f16::from_f32(v).to_bits(),
            false => bf16::from_f32(v).to_bits(),
        }
    }

    fn half_value(self, bits: u16) -> f32 {
        match self.f16 {
            true => f16::from_bits(bits).to_f32(),
            false => bf16::from_bits(bits).to_f32(),
        }
    }

    /// Appends one row: `q` its `cols` values (0..16), `zeros` and `scales` one a group
    /// (zeros 0..=16, scales exact in the 16-bit type).
    pub fn push_row(self, q: &[u8], zeros: &[i32], scales: &[f32], out: &mut Vec<u8>) {
        let start = out.len();
        for w in q.chunks_exact(8) {
            let word = (0..4).fold(0u32, |acc, j| {
                acc | (u32::from(w[2 * j]) << (4 * j)) | (u32::from(w[2 * j + 1]) << (16 + 4 * j))
            });
            out.extend_from_slice(&word.to_le_bytes());
        }
        for (&z, &s) in zeros.iter().zip(scales) {
            out.extend_from_slice(&self.half_bits(s).to_le_bytes());
            out.extend_from_slice(&self.half_bits(self.magic() + z as f32).to_le_bytes());
        }
        out.resize(start + self.row_bytes(), 0);
    }

    /// Appends the f32 values of whole rows, each rounded to the 16-bit type as the
    /// checkpoint's dequantization rounds it.
    pub fn dequantize(self, bytes: &[u8], out: &mut Vec<f32>) {
        let (cols, groups) = (self.cols as usize, self.groups());
        out.reserve(bytes.len() / self.row_bytes() * cols);
        for row in bytes.chunks_exact(self.row_bytes()) {
            let pair = |g: usize| {
                let at = cols / 2 + 4 * g;
                let h = |i: usize| u16::from_le_bytes([row[i], row[i + 1]]);
                (self.half_value(h(at)), self.half_value(h(at + 2)) - self.magic())
            };
            let pairs: Vec<(f32, f32)> = (0..groups).map(pair).collect();
            for (i, w) in row[..cols / 2].chunks_exact(4).enumerate() {
                let word = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
                for e in 0..8 {
                    let shift = if e % 2 == 0 { 2 * e } else { 16 + 2 * (e - 1) };
                    let q = ((word >> shift) & 0xf) as f32;
                    let (scale, zero) = pairs[(8 * i + e) * groups / cols];
                    out.push(self.round((q - zero) * scale));
                }
            }
        }
    }

    /// The index of the first element whose group's scale is not finite, if one is not.
    pub fn bad_scale(self, bytes: &[u8]) -> Option<usize> {
        let (cols, groups) = (self.cols as usize, self.groups());
        bytes.chunks_exact(self.row_bytes()).enumerate().find_map(|(r, row)| {
            (0..groups)
                .find(|g| {
                    let at = cols / 2 + 4 * g;
                    !self.half_value(u16::from_le_bytes([row[at], row[at + 1]])).is_finite()
                })
                .map(|g| r * cols + g * cols / groups)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_hold_the_values_of_their_groups() {
        // Two rows of 64 in groups of 32: every value, zero point and scale comes back.
        for f16 in [false, true] {
            let f = Int4Format::new(64, Some(32), f16).unwrap();
            assert_eq!((f.groups(), f.row_bytes()), (2, 48));
            let q: Vec<u8> = (0..128).map(|i| (i * 7 % 16) as u8).collect();
            let (zeros, scales) = ([0, 16, 8, 3], [0.5, -0.25, 2.0, 0.125]);
            let mut bytes = Vec::new();
            for r in 0..2 {
                f.push_row(
                    &q[64 * r..64 * (r + 1)],
                    &zeros[2 * r..2 * r + 2],
                    &scales[2 * r..2 * r + 2],
                    &mut bytes,
                );
            }
            assert_eq!(bytes.len(), 96);
            let mut got = Vec::new();
            f.dequantize(&bytes, &mut got);
            let want: Vec<f32> =
                (0..128).map(|i| (q[i] as f32 - zeros[i / 32] as f32) * scales[i / 32]).collect();
            assert_eq!(got, want, "f16 {f16}");
            assert_eq!(f.bad_scale(&bytes), None);
        }
        // The words' halves: element 1 is bit 16, element 2 bit 4.
        let f = Int4Format::new(32, None, false).unwrap();
        let mut q = [0u8; 32];
        q[1] = 1;
        q[2] = 1;
        let mut bytes = Vec::new();
        f.push_row(&q, &[0], &[1.0], &mut bytes);
        assert_eq!(u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]), (1 << 16) | (1 << 4));
    }

    #[test]
    fn only_whole_groups_of_32_are_kept() {
        assert_eq!(Int4Format::new(4096, Some(128), false).map(|f| f.row_bytes()), Some(2048 + 128));
        assert_eq!(Int4Format::new(3584, Some(128), false).map(|f| f.row_bytes()), Some(1792 + 112));
        assert_eq!(Int4Format::new(256, None, true).map(|f| (f.group, f.row_bytes())), Some((0, 144)));
        assert_eq!(Int4Format::new(256, Some(256), true).map(|f| f.group), Some(0));
        assert_eq!(Int4Format::new(96, Some(48), false), None);
        assert_eq!(Int4Format::new(80, None, false), None);
        assert_eq!(Int4Format::new(192, Some(128), false), None);
    }
}
