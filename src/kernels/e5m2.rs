//! OCP FP8 E5M2 (`float8_e5m2` in PyTorch): sign, 5 exponent bits of bias 15, 2 mantissa
//! bits: the top byte of an IEEE half, infinities and NaNs included. The elements of
//! `--kv-cache-dtype fp8_e5m2`: a quarter of f32's range of exponents kept, at a quarter of
//! e4m3's precision.

/// The value of every byte, by byte.
pub fn values() -> &'static [f32; 256] {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|b| decode(b as u8)))
}

/// One byte's value: the half whose high byte it is.
#[inline]
pub fn decode(b: u8) -> f32 {
    half::f16::from_bits((b as u16) << 8).to_f32()
}

/// The largest finite value, 1.75 · 2^15.
pub const MAX: f32 = 57344.0;

/// The byte nearest to `v` (ties to the even byte), saturating at ±57344 (infinities
/// included); NaN gives a NaN byte. CUDA's `__nv_cvt_float_to_fp8(v, __NV_SATFINITE,
/// __NV_E5M2)` rounds the same way. Rounded from f32 directly: through a half first, a
/// value a hair off a tie would round twice.
#[inline]
pub fn encode(v: f32) -> u8 {
    let bits = v.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let a = f32::from_bits(bits & 0x7fff_ffff);
    if a.is_nan() {
        return sign | 0x7f;
    }
    if a >= MAX {
        // Past 57344 a value rounds to 57344 or to infinity, which saturates to it.
        return sign | 0x7b;
    }
    if a < 2f32.powi(-14) {
        // Subnormal: multiples of 2^-16 (4 of them make 2^-14, byte 4, the first normal).
        return sign | (a * 65536.0).round_ties_even() as u8;
    }
    // Normal: 2 of f32's 23 mantissa bits kept, nearest even, then the exponent rebiased
    // from 127 to 15. Below 57344 the rounding never passes byte 0x7b.
    let b = a.to_bits();
    let rounded = (b + 0xf_ffff + ((b >> 21) & 1)) >> 21;
    sign | (rounded - ((127 - 15) << 2)) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_have_the_formats_values() {
        for (b, v) in [
            (0x00, 0.0),
            (0x80, -0.0),
            (0x3c, 1.0),
            (0xbc, -1.0),
            (0x3d, 1.25),
            (0x40, 2.0),
            (0x7b, 57344.0),
            (0x04, 2f32.powi(-14)),
            (0x01, 2f32.powi(-16)),
            (0x03, 3.0 * 2f32.powi(-16)),
        ] {
            assert_eq!(decode(b), v, "{b:#04x}");
        }
        assert_eq!(decode(0x7c), f32::INFINITY);
        assert!((0x7d..=0x7f).all(|b| decode(b).is_nan()));
    }

    /// Every finite byte encodes to itself, and values between two neighbours go to the
    /// nearer (ties to the even byte), checked against a search of the sorted values.
    #[test]
    fn values_round_to_the_nearest_byte() {
        for b in (0..=255u8).filter(|b| decode(*b).is_finite()) {
            assert_eq!(encode(decode(b)), b, "{b:#04x}");
        }
        let finite: Vec<f32> = (0..0x7cu8).map(decode).collect();
        let nearest = |v: f32| crate::kernels::e4m3::nearest_byte(&finite, v);
        let mut x = 0x2468_ace1u32;
        for i in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            // Magnitudes from 2^-18 to 2^15.7 (past 57344), both signs; every 16th exactly
            // halfway between two bytes, every 16th but one a hair off such a tie.
            let mut v = 2f32.powf((x % 33_700) as f32 / 1000.0 - 18.0);
            if i % 16 < 2 {
                let lo = (x % 0x7b) as u8;
                v = (decode(lo) + decode(lo + 1)) / 2.0;
                if i % 16 == 1 {
                    v = f32::from_bits(v.to_bits() + 1);
                }
            }
            if x & 1 == 1 {
                v = -v;
            }
            let want = if v.abs() >= MAX { 0x7b | if v < 0.0 { 0x80 } else { 0 } } else { nearest(v) };
            assert_eq!(encode(v), want, "{v:e}");
        }
        for (v, b) in [(1.125, 0x3c), (1.375, 0x3e), (60000.0, 0x7b), (f32::INFINITY, 0x7b), (1e-6, 0x00)] {
            assert_eq!(encode(v), b, "{v}");
        }
        assert_eq!(encode(f32::NEG_INFINITY), 0xfb);
        assert!(decode(encode(f32::NAN)).is_nan());
    }
}
