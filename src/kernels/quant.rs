//! llama.cpp's block formats that weights may keep on the CPU (`--keep-quantized`): their
//! layout, as ggml defines it, and their exact dequantization. A GGUF file's other formats
//! are dequantized at import (`gguf::dequantize`).
//!
//! A block holds 32 consecutive elements of a row:
//! - `Q4_0`: f16 scale d, then 16 bytes whose low nibbles are elements 0..16 and high
//!   nibbles 16..32; w = d·(q − 8).
//! - `Q4_1`: f16 d, f16 m, then the nibbles as in Q4_0; w = d·q + m.
//! - `Q5_0`: f16 d, 32 bits of fifth bits (bit j for element j), then nibbles as in Q4_0;
//!   w = d·(q − 16).
//! - `Q5_1`: f16 d, f16 m, then Q5_0's fifth bits and nibbles; w = d·q + m.
//! - `Q8_0`: f16 d, then 32 signed bytes; w = d·q.
//!
//! or a super-block of 256 (K-quants), as 8 sub-blocks of 32:
//! - `Q4_K`: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins ([`scale_min_k4`]), then
//!   128 bytes of nibbles, each 32 bytes two sub-blocks (low nibbles the first);
//!   w = d·scale·q − dmin·min.
//! - `Q5_K`: as Q4_K, with 32 bytes `qh` before the nibbles: bit j of qh[l] is the fifth
//!   bit of element l of sub-block j.
//! - `Q6_K`: 128 bytes of low nibbles `ql`, 64 of high bit pairs `qh`, 16 signed 8-bit
//!   scales (one a 16 elements), then f16 d; w = d·scale·(q − 32). Each half of 128
//!   elements takes 64 bytes of ql and 32 of qh ([`q6_k_quarter`]).

use half::f16;

/// Elements per sub-block: the unit of a block's scale, and of the inputs' 8-bit rounding.
pub const QK: usize = 32;

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[allow(non_camel_case_types)]
pub enum QuantFormat {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4_K,
    Q5_K,
    Q6_K,
}

impl QuantFormat {
    pub const ALL: [QuantFormat; 8] = [
        QuantFormat::Q4_0,
        QuantFormat::Q4_1,
        QuantFormat::Q5_0,
        QuantFormat::Q5_1,
        QuantFormat::Q8_0,
        QuantFormat::Q4_K,
        QuantFormat::Q5_K,
        QuantFormat::Q6_K,
    ];

    /// ggml's name for the format.
    pub fn name(self) -> &'static str {
        match self {
            QuantFormat::Q4_0 => "Q4_0",
            QuantFormat::Q4_1 => "Q4_1",
            QuantFormat::Q5_0 => "Q5_0",
            QuantFormat::Q5_1 => "Q5_1",
            QuantFormat::Q8_0 => "Q8_0",
            QuantFormat::Q4_K => "Q4_K",
            QuantFormat::Q5_K => "Q5_K",
            QuantFormat::Q6_K => "Q6_K",
        }
    }

    /// Elements per block (a K-quant's super-block).
    pub fn block_elems(self) -> usize {
        match self {
            QuantFormat::Q4_K | QuantFormat::Q5_K | QuantFormat::Q6_K => QK_K,
            _ => QK,
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.name() == name)
    }

    /// Bytes of one block.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantFormat::Q4_0 => 18,
            QuantFormat::Q4_1 => 20,
            QuantFormat::Q5_0 => 22,
            QuantFormat::Q5_1 => 24,
            QuantFormat::Q8_0 => 34,
            QuantFormat::Q4_K => 144,
            QuantFormat::Q5_K => 176,
            QuantFormat::Q6_K => 210,
        }
    }

    /// Where a block's f16 scales are (d, and m for Q4_1 and Q5_1; d and dmin for Q4_K and
    /// Q5_K).
    pub fn scale_offsets(self) -> &'static [usize] {
        match self {
            QuantFormat::Q4_1 | QuantFormat::Q5_1 | QuantFormat::Q4_K | QuantFormat::Q5_K => &[0, 2],
            QuantFormat::Q4_0 | QuantFormat::Q5_0 | QuantFormat::Q8_0 => &[0],
            QuantFormat::Q6_K => &[208],
        }
    }

    /// Bytes of `cols` elements (whole blocks).
    pub fn row_bytes(self, cols: usize) -> usize {
        cols / self.block_elems() * self.block_bytes()
    }

    /// Appends the f32 values of whole blocks.
    pub fn dequantize(self, bytes: &[u8], out: &mut Vec<f32>) {
        let h = |b: &[u8], i: usize| f16::from_le_bytes([b[i], b[i + 1]]).to_f32();
        out.reserve(bytes.len() / self.block_bytes() * self.block_elems());
        for blk in bytes.chunks_exact(self.block_bytes()) {
            match self {
                QuantFormat::Q4_0 => {
                    let (d, qs) = (h(blk, 0), &blk[2..18]);
                    out.extend(qs.iter().map(|&q| d * ((q & 0x0f) as f32 - 8.0)));
                    out.extend(qs.iter().map(|&q| d * ((q >> 4) as f32 - 8.0)));
                }
                QuantFormat::Q4_1 => {
                    let (d, m, qs) = (h(blk, 0), h(blk, 2), &blk[4..20]);
                    out.extend(qs.iter().map(|&q| d * (q & 0x0f) as f32 + m));
                    out.extend(qs.iter().map(|&q| d * (q >> 4) as f32 + m));
                }
                QuantFormat::Q5_0 => {
                    let (d, qh) = (h(blk, 0), u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]));
                    out.extend(five_bits(&blk[6..22], qh).map(|q| d * (q as f32 - 16.0)));
                }
                QuantFormat::Q5_1 => {
                    let (d, m, qh) =
                        (h(blk, 0), h(blk, 2), u32::from_le_bytes([blk[4], blk[5], blk[6], blk[7]]));
                    out.extend(five_bits(&blk[8..24], qh).map(|q| d * q as f32 + m));
                }
                QuantFormat::Q8_0 => {
                    let d = h(blk, 0);
                    out.extend(blk[2..34].iter().map(|&q| d * (q as i8) as f32));
                }
                QuantFormat::Q4_K => k_quant_4_5(blk, None, &blk[16..144], out),
                QuantFormat::Q5_K => k_quant_4_5(blk, Some(&blk[16..48]), &blk[48..176], out),
                QuantFormat::Q6_K => {
                    let d = h(blk, 208);
                    for quarter in 0..8 {
                        let q = q6_k_quarter(blk, quarter);
                        let sc = |l: usize| (blk[192 + 2 * quarter + l / 16] as i8) as f32;
                        out.extend((0..QK).map(|l| d * sc(l) * (q[l] as i32 - 32) as f32));
                    }
                }
            }
        }
    }

    /// The index of the first block whose scales are not finite, if one is not.
    pub fn bad_scale(self, bytes: &[u8]) -> Option<usize> {
        bytes.chunks_exact(self.block_bytes()).position(|blk| {
            self.scale_offsets().iter().any(|&o| !f16::from_le_bytes([blk[o], blk[o + 1]]).is_finite())
        })
    }

    /// Quantizes whole 32-element blocks of `x` as llama.cpp's reference quantizer does
    /// (round to nearest; the largest magnitude of a block maps to ±127, or to −8 for Q4_0
    /// and to 15 from the minimum for Q4_1). For tests; a K-quant's blocks are made of
    /// random bytes there instead.
    #[cfg(test)]
    pub(crate) fn quantize(self, x: &[f32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.row_bytes(x.len()));
        for b in x.chunks_exact(QK) {
            match self {
                QuantFormat::Q8_0 => {
                    let amax = b.iter().fold(0f32, |a, v| a.max(v.abs()));
                    let d = amax / 127.0;
                    let inv = if d == 0.0 { 0.0 } else { 1.0 / d };
                    out.extend(f16::from_f32(d).to_le_bytes());
                    out.extend(b.iter().map(|v| (v * inv).round() as i8 as u8));
                }
                QuantFormat::Q4_0 => {
                    let max = b.iter().fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
                    let d = max / -8.0;
                    let inv = if d == 0.0 { 0.0 } else { 1.0 / d };
                    let q = |v: f32| ((v * inv + 8.5) as i32).clamp(0, 15) as u8;
                    out.extend(f16::from_f32(d).to_le_bytes());
                    out.extend((0..16).map(|j| q(b[j]) | (q(b[j + 16]) << 4)));
                }
                QuantFormat::Q4_1 => {
                    let min = b.iter().copied().fold(f32::INFINITY, f32::min);
                    let max = b.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let d = (max - min) / 15.0;
                    let inv = if d == 0.0 { 0.0 } else { 1.0 / d };
                    let q = |v: f32| (((v - min) * inv + 0.5) as i32).clamp(0, 15) as u8;
                    out.extend(f16::from_f32(d).to_le_bytes());
                    out.extend(f16::from_f32(min).to_le_bytes());
                    out.extend((0..16).map(|j| q(b[j]) | (q(b[j + 16]) << 4)));
                }
                QuantFormat::Q5_0
                | QuantFormat::Q5_1
                | QuantFormat::Q4_K
                | QuantFormat::Q5_K
                | QuantFormat::Q6_K => {
                    unreachable!("tests make {self} blocks of random bytes")
                }
            }
        }
        out
    }
}

/// One Q4_K or Q5_K super-block: d, dmin, 12 bytes of 6-bit scales and mins for 8
/// sub-blocks of 32, then `qs`, 128 bytes of nibbles (each 32 bytes hold two sub-blocks, low
/// nibbles first). Q5_K's `qh` gives a fifth bit: bit j of qh[l] for element l of sub-block j.
pub(crate) fn k_quant_4_5(blk: &[u8], qh: Option<&[u8]>, qs: &[u8], out: &mut Vec<f32>) {
    let h = |i: usize| f16::from_le_bytes([blk[i], blk[i + 1]]).to_f32();
    let (d, dmin, scales) = (h(0), h(2), &blk[4..16]);
    for (pair, qs) in qs.chunks_exact(32).enumerate() {
        for (half, shift) in [(0, 0), (1, 4)] {
            let j = 2 * pair + half;
            let (sc, m) = scale_min_k4(j, scales);
            let (scale, min) = (d * sc as f32, dmin * m as f32);
            out.extend(qs.iter().enumerate().map(|(l, &q)| {
                let high = qh.map_or(0, |qh| ((qh[l] >> j) & 1) << 4);
                scale * (((q >> shift) & 0x0f) | high) as f32 - min
            }));
        }
    }
}

/// The 32 five-bit values of a Q5_0/Q5_1 block, in order: nibbles of `qs` (low ones for
/// elements 0..16, high ones for 16..32) with bit j of `qh` as element j's fifth bit.
pub fn five_bits(qs: &[u8], qh: u32) -> impl Iterator<Item = u8> + '_ {
    let low = qs.iter().enumerate().map(move |(j, &q)| (q & 0x0f) | ((((qh >> j) & 1) as u8) << 4));
    let high = qs.iter().enumerate().map(move |(j, &q)| (q >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4));
    low.chain(high)
}

/// The 6-bit quants of elements `32·quarter..32·quarter + 32` of a Q6_K super-block
/// (quarters 0–3 in the first half of 128 elements, 4–7 in the second): within a half,
/// quarters 0 and 1 are the low nibbles of ql's two 32-byte runs and 2 and 3 their high
/// nibbles, each with bit pair `quarter % 4` of qh above them.
pub fn q6_k_quarter(blk: &[u8], quarter: usize) -> [u8; QK] {
    let (half, t) = (quarter / 4, quarter % 4);
    let (ql, qh) = (&blk[64 * half + 32 * (t % 2)..], &blk[128 + 32 * half..]);
    std::array::from_fn(|l| ((ql[l] >> (4 * (t / 2))) & 0x0f) | (((qh[l] >> (2 * t)) & 3) << 4))
}

/// Sub-block `j`'s 6-bit scale and min of a Q4_K/Q5_K super-block: sub-blocks 0–3 in the
/// low six bits of bytes j and j + 4; 4–7 in the nibbles of bytes j + 4 with their top two
/// bits in the top bits of bytes j − 4 and j.
pub fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    match j < 4 {
        true => (s[j] & 63, s[j + 4] & 63),
        false => ((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)),
    }
}

impl std::fmt::Display for QuantFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantizing_then_dequantizing_stays_within_half_a_step() {
        let x: Vec<f32> = (0..96).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
        for f in [QuantFormat::Q4_0, QuantFormat::Q4_1, QuantFormat::Q8_0] {
            let q = f.quantize(&x);
            assert_eq!(q.len(), f.row_bytes(x.len()));
            let mut back = Vec::new();
            f.dequantize(&q, &mut back);
            for (blk, (xb, yb)) in x.chunks(QK).zip(back.chunks(QK)).enumerate() {
                let range = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
                // Half a step; Q4_0's one extra level above +range clamps to a whole one.
                let tol = match f {
                    QuantFormat::Q8_0 => range / 127.0 * 0.5,
                    QuantFormat::Q4_1 => range * 2.0 / 15.0 * 0.5,
                    QuantFormat::Q4_0 => range / 8.0,
                    QuantFormat::Q5_0
                    | QuantFormat::Q5_1
                    | QuantFormat::Q4_K
                    | QuantFormat::Q5_K
                    | QuantFormat::Q6_K => unreachable!("filtered out"),
                };
                for (a, b) in xb.iter().zip(yb) {
                    assert!((a - b).abs() <= tol * 1.01 + 1e-3, "{f} block {blk}: {a} vs {b}");
                }
            }
            assert_eq!(f.bad_scale(&q), None);
            assert_eq!(QuantFormat::from_name(f.name()), Some(f));
        }
    }
}
