//! llama.cpp's 32-element block formats that weights may keep on the CPU
//! (`--keep-quantized`): their layout, as ggml defines it, and their exact dequantization.
//! A GGUF file's other formats are dequantized at import (`gguf::dequantize`).
//!
//! Every block holds 32 consecutive elements of a row:
//! - `Q4_0`: f16 scale d, then 16 bytes whose low nibbles are elements 0..16 and high
//!   nibbles 16..32; w = d·(q − 8).
//! - `Q4_1`: f16 d, f16 m, then the nibbles as in Q4_0; w = d·q + m.
//! - `Q8_0`: f16 d, then 32 signed bytes; w = d·q.

use half::f16;

/// Elements per block.
pub const QK: usize = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[allow(non_camel_case_types)]
pub enum QuantFormat {
    Q4_0,
    Q4_1,
    Q8_0,
}

impl QuantFormat {
    pub const ALL: [QuantFormat; 3] = [QuantFormat::Q4_0, QuantFormat::Q4_1, QuantFormat::Q8_0];

    /// ggml's name for the format.
    pub fn name(self) -> &'static str {
        match self {
            QuantFormat::Q4_0 => "Q4_0",
            QuantFormat::Q4_1 => "Q4_1",
            QuantFormat::Q8_0 => "Q8_0",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.name() == name)
    }

    /// Bytes of one block of [`QK`] elements.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantFormat::Q4_0 => 18,
            QuantFormat::Q4_1 => 20,
            QuantFormat::Q8_0 => 34,
        }
    }

    /// Bytes of the f16 scales that open a block (d, and m for Q4_1).
    pub fn scale_bytes(self) -> usize {
        match self {
            QuantFormat::Q4_1 => 4,
            QuantFormat::Q4_0 | QuantFormat::Q8_0 => 2,
        }
    }

    /// Bytes of `cols` elements (a multiple of [`QK`]).
    pub fn row_bytes(self, cols: usize) -> usize {
        cols / QK * self.block_bytes()
    }

    /// Appends the f32 values of whole blocks.
    pub fn dequantize(self, bytes: &[u8], out: &mut Vec<f32>) {
        let h = |b: &[u8], i: usize| f16::from_le_bytes([b[i], b[i + 1]]).to_f32();
        out.reserve(bytes.len() / self.block_bytes() * QK);
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
                QuantFormat::Q8_0 => {
                    let d = h(blk, 0);
                    out.extend(blk[2..34].iter().map(|&q| d * (q as i8) as f32));
                }
            }
        }
    }

    /// The index of the first block whose scales are not finite, if one is not.
    pub fn bad_scale(self, bytes: &[u8]) -> Option<usize> {
        bytes.chunks_exact(self.block_bytes()).position(|blk| {
            blk[..self.scale_bytes()].chunks_exact(2).any(|s| !f16::from_le_bytes([s[0], s[1]]).is_finite())
        })
    }

    /// Quantizes whole blocks of `x` as llama.cpp's reference quantizer does (round to
    /// nearest; the largest magnitude of a block maps to ±127, or to −8 for Q4_0 and to 15
    /// from the minimum for Q4_1). For tests and fixtures.
    pub fn quantize(self, x: &[f32]) -> Vec<u8> {
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
            }
        }
        out
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
        for f in QuantFormat::ALL {
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
