//! OCP FP8 E4M3 (`float8_e4m3fn` in PyTorch, `F8_E4M3` in safetensors): sign, 4 exponent
//! bits of bias 7, 3 mantissa bits; no infinities, and 0x7f / 0xff are NaN. The values of
//! FP8 checkpoints and of an FP8 KV cache (`--kv-cache-dtype fp8`).

/// The value of every byte, by byte.
pub fn values() -> &'static [f32; 256] {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        std::array::from_fn(|b| {
            let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
            let (e, m) = ((b >> 3) & 0x0f, b & 0x07);
            sign * match (e, m) {
                (0x0f, 0x07) => f32::NAN,
                (0, _) => m as f32 / 512.0,
                _ => (8 + m) as f32 * 2f32.powi(e as i32 - 10),
            }
        })
    })
}

/// One byte's value.
#[inline]
pub fn decode(b: u8) -> f32 {
    values()[b as usize]
}

/// Each byte of `src`'s value in `table` into `dst` ([`values`], or those times a scale): the
/// table's 1 KiB stays in L1, and a lookup a byte took half the time of the bit arithmetic
/// (exponent and mantissa moved into f32's place, subnormals apart) on the build machine,
/// vectorized or not.
#[inline]
pub fn widen(table: &[f32; 256], src: &[u8], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    dst.iter_mut().zip(src).for_each(|(d, &b)| *d = table[b as usize]);
}

/// The byte nearest to `v` (ties to the even byte), saturating at ±448; NaN gives the NaN
/// byte. CUDA's `__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3)` rounds the same way,
/// so that both devices store the same cache.
#[inline]
pub fn encode(v: f32) -> u8 {
    let bits = v.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let a = f32::from_bits(bits & 0x7fff_ffff);
    if a.is_nan() {
        return sign | 0x7f;
    }
    if a >= 448.0 {
        return sign | 0x7e;
    }
    if a < 1.0 / 64.0 {
        // Subnormal: multiples of 2^-9 (8 of them make 2^-6, byte 8, the first normal).
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    // Normal: 3 of f32's 23 mantissa bits kept, nearest even, then the exponent rebiased
    // from 127 to 7. Below 448 the rounding never passes it (byte 0x7e).
    let b = a.to_bits();
    let rounded = (b + 0x7_ffff + ((b >> 20) & 1)) >> 20;
    sign | (rounded - ((127 - 7) << 3)) as u8
}

/// The byte of the value nearest `v` (ties to the even byte) by a search of `finite`, the
/// ascending values of bytes 0, 1, ..: the FP8 encoders' reference.
#[cfg(test)]
pub(crate) fn nearest_byte(finite: &[f32], v: f32) -> u8 {
    let a = v.abs();
    let i = finite.partition_point(|&e| e < a).min(finite.len() - 1);
    let i = match i {
        0 => 0,
        _ if a - finite[i - 1] < finite[i] - a => i - 1,
        _ if a - finite[i - 1] == finite[i] - a && i % 2 == 1 => i - 1,
        _ => i,
    };
    i as u8 | if v.is_sign_negative() { 0x80 } else { 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_have_the_formats_values() {
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
            assert_eq!(decode(b), v, "{b:#04x}");
        }
        assert!(decode(0x7f).is_nan() && decode(0xff).is_nan());
        assert!((0..=255u8).filter(|b| b & 0x7f != 0x7f).all(|b| decode(b).is_finite()));
    }

    /// Every byte encodes to itself, and values between two neighbours go to the nearer
    /// (ties to the even byte), checked against a search of the sorted values.
    #[test]
    fn values_round_to_the_nearest_byte() {
        for b in (0..=255u8).filter(|b| b & 0x7f != 0x7f) {
            assert_eq!(encode(decode(b)), b, "{b:#04x}");
        }
        let finite: Vec<f32> = (0..0x7fu8).map(decode).collect();
        let nearest = |v: f32| nearest_byte(&finite, v);
        let mut x = 0x1234_5678u32;
        for i in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            // Magnitudes from 2^-12 to 2^10 (past 448), both signs; every 16th exactly
            // halfway between two bytes.
            let mut v = 2f32.powf((x % 22_000) as f32 / 1000.0 - 12.0);
            if i % 16 == 0 {
                let lo = (x % 0x7e) as u8;
                v = (decode(lo) + decode(lo + 1)) / 2.0;
            }
            if x & 1 == 1 {
                v = -v;
            }
            assert_eq!(encode(v), nearest(v), "{v:e}");
        }
        for (v, b) in [(1.0625, 0x38), (1.1875, 0x3a), (500.0, 0x7e), (f32::INFINITY, 0x7e), (1e-4, 0x00)] {
            assert_eq!(encode(v), b, "{v}");
        }
        assert_eq!(encode(f32::NAN) & 0x7f, 0x7f);
    }
}
