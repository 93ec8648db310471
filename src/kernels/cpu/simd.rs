//! One vector abstraction for the CPU kernel families: a kernel body is written once,
//! generic over [`Lanes`], and each family instantiates it with its vector inside a function
//! compiled for its instructions (AVX-512F: 16 lanes, AVX2+FMA+F16C: 8, NEON: 4). The
//! portable family runs plain Rust instead. Callers only reach a family's entry points for
//! a family this CPU supports ([`super::Family::supported`]).

use half::f16;

use super::Family;
use crate::kernels::Fp8Format;

/// A vector of f32 lanes. Its methods are inlined into `#[target_feature]` entry points,
/// which are only called where the CPU has the instructions.
///
/// # Safety
/// Every method needs the vector's instructions; loads and stores need N elements.
pub trait Lanes: Copy {
    const N: usize;
    unsafe fn zero() -> Self;
    unsafe fn splat(x: f32) -> Self;
    unsafe fn load(p: *const f32) -> Self;
    /// N bf16 values (raw bits) widened to f32 in registers.
    unsafe fn load_bf16(p: *const u16) -> Self;
    unsafe fn load_f16(p: *const f16) -> Self;
    /// N FP8 (e4m3) bytes as the f32 of each one's value / 256: its bits moved into an
    /// f16's place, `(b & 0x80) << 8 | (b & 0x7f) << 7` (subnormals included; 0x7f, NaN,
    /// made an f16 NaN), converted in registers.
    unsafe fn load_e4m3_256th(p: *const u8) -> Self;
    /// N FP8 (e5m2) bytes as the f32 of each one's value: each the high byte of an f16,
    /// converted in registers.
    unsafe fn load_e5m2(p: *const u8) -> Self;
    unsafe fn store(self, p: *mut f32);
    /// `a · b + c`.
    unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self;
    unsafe fn mul(a: Self, b: Self) -> Self;
    unsafe fn sum(self) -> f32;
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use half::f16;

    use super::Lanes;

    impl Lanes for __m512 {
        const N: usize = 16;
        #[inline(always)]
        unsafe fn zero() -> Self {
            // SAFETY: the instructions are there (the trait's contract).
            unsafe { _mm512_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            // SAFETY: as above.
            unsafe { _mm512_set1_ps(x) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            // SAFETY: the caller guarantees 16 readable elements.
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn load_bf16(p: *const u16) -> Self {
            // SAFETY: 16 readable elements; bf16 → f32 is a 16-bit shift of the widened bits.
            unsafe {
                _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast())),
                    16,
                ))
            }
        }
        #[inline(always)]
        unsafe fn load_f16(p: *const f16) -> Self {
            // SAFETY: 16 readable elements.
            unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
        }
        #[inline(always)]
        unsafe fn load_e4m3_256th(p: *const u8) -> Self {
            // SAFETY: 16 readable bytes; the f16 bits are made in 32-bit lanes, then narrowed
            // (AVX-512F only).
            unsafe {
                let b = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast()));
                let low = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
                let h = _mm512_or_si512(
                    _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 8),
                    _mm512_slli_epi32(low, 7),
                );
                let nan = _mm512_cmpeq_epi32_mask(low, _mm512_set1_epi32(0x7f));
                let h = _mm512_mask_or_epi32(h, nan, h, _mm512_set1_epi32(0x7e00));
                _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h))
            }
        }
        #[inline(always)]
        unsafe fn load_e5m2(p: *const u8) -> Self {
            // SAFETY: 16 readable bytes (AVX-512F only: 16-bit lanes through 32-bit ones).
            unsafe {
                let b = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast()));
                _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_slli_epi32(b, 8)))
            }
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            // SAFETY: the caller guarantees 16 writable elements.
            unsafe { _mm512_storeu_ps(p, self) }
        }
        #[inline(always)]
        unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self {
            // SAFETY: the instructions are there.
            unsafe { _mm512_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        unsafe fn mul(a: Self, b: Self) -> Self {
            // SAFETY: the instructions are there.
            unsafe { _mm512_mul_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn sum(self) -> f32 {
            // SAFETY: the instructions are there.
            unsafe { _mm512_reduce_add_ps(self) }
        }
    }

    impl Lanes for __m256 {
        const N: usize = 8;
        #[inline(always)]
        unsafe fn zero() -> Self {
            // SAFETY: the instructions are there (the trait's contract).
            unsafe { _mm256_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            // SAFETY: as above.
            unsafe { _mm256_set1_ps(x) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            // SAFETY: the caller guarantees 8 readable elements.
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn load_bf16(p: *const u16) -> Self {
            // SAFETY: 8 readable elements; widened and shifted in registers.
            unsafe {
                _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast())), 16))
            }
        }
        #[inline(always)]
        unsafe fn load_f16(p: *const f16) -> Self {
            // SAFETY: 8 readable elements; F16C is part of the family.
            unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
        }
        #[inline(always)]
        unsafe fn load_e4m3_256th(p: *const u8) -> Self {
            // SAFETY: 8 readable bytes; the f16 bits are made in 16-bit lanes.
            unsafe {
                let b = _mm_cvtepu8_epi16(_mm_loadl_epi64(p.cast()));
                let low = _mm_and_si128(b, _mm_set1_epi16(0x7f));
                let h = _mm_or_si128(
                    _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                    _mm_slli_epi16(low, 7),
                );
                let nan = _mm_and_si128(_mm_cmpeq_epi16(low, _mm_set1_epi16(0x7f)), _mm_set1_epi16(0x7e00));
                _mm256_cvtph_ps(_mm_or_si128(h, nan))
            }
        }
        #[inline(always)]
        unsafe fn load_e5m2(p: *const u8) -> Self {
            // SAFETY: 8 readable bytes.
            unsafe { _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(p.cast())), 8)) }
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            // SAFETY: the caller guarantees 8 writable elements.
            unsafe { _mm256_storeu_ps(p, self) }
        }
        #[inline(always)]
        unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self {
            // SAFETY: the instructions are there.
            unsafe { _mm256_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        unsafe fn mul(a: Self, b: Self) -> Self {
            // SAFETY: the instructions are there.
            unsafe { _mm256_mul_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn sum(self) -> f32 {
            // Halves, then pairs, then the last two.
            // SAFETY: the instructions are there.
            unsafe {
                let half = _mm_add_ps(_mm256_castps256_ps128(self), _mm256_extractf128_ps(self, 1));
                let pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
                _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)))
            }
        }
    }
}

#[cfg(target_arch = "aarch64")]
mod arm {
    use std::arch::aarch64::*;

    use half::f16;

    use super::Lanes;

    impl Lanes for float32x4_t {
        const N: usize = 4;
        #[inline(always)]
        unsafe fn zero() -> Self {
            // SAFETY: NEON is there (the trait's contract).
            unsafe { vdupq_n_f32(0.0) }
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            // SAFETY: as above.
            unsafe { vdupq_n_f32(x) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            // SAFETY: the caller guarantees 4 readable elements.
            unsafe { vld1q_f32(p) }
        }
        #[inline(always)]
        unsafe fn load_bf16(p: *const u16) -> Self {
            // SAFETY: 4 readable elements; widened by a 16-bit shift left.
            unsafe { vreinterpretq_f32_u32(vshll_n_u16::<16>(vld1_u16(p))) }
        }
        #[inline(always)]
        unsafe fn load_f16(p: *const f16) -> Self {
            // Stable Rust has no NEON f16 conversion: one value at a time.
            // SAFETY: 4 readable elements.
            unsafe {
                let v = [(*p).to_f32(), (*p.add(1)).to_f32(), (*p.add(2)).to_f32(), (*p.add(3)).to_f32()];
                vld1q_f32(v.as_ptr())
            }
        }
        #[inline(always)]
        unsafe fn load_e4m3_256th(p: *const u8) -> Self {
            // Stable Rust has no NEON f16 conversion (the family widens by table instead).
            // SAFETY: 4 readable bytes.
            unsafe {
                let v: [f32; 4] = std::array::from_fn(|i| crate::kernels::e4m3::decode(*p.add(i)) / 256.0);
                vld1q_f32(v.as_ptr())
            }
        }
        #[inline(always)]
        unsafe fn load_e5m2(p: *const u8) -> Self {
            // As load_e4m3_256th: by value (the family widens by table instead).
            // SAFETY: 4 readable bytes.
            unsafe {
                let v: [f32; 4] = std::array::from_fn(|i| crate::kernels::e5m2::decode(*p.add(i)));
                vld1q_f32(v.as_ptr())
            }
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            // SAFETY: the caller guarantees 4 writable elements.
            unsafe { vst1q_f32(p, self) }
        }
        #[inline(always)]
        unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self {
            // SAFETY: NEON is there.
            unsafe { vfmaq_f32(c, a, b) }
        }
        #[inline(always)]
        unsafe fn mul(a: Self, b: Self) -> Self {
            // SAFETY: NEON is there.
            unsafe { vmulq_f32(a, b) }
        }
        #[inline(always)]
        unsafe fn sum(self) -> f32 {
            // SAFETY: NEON is there.
            unsafe { vaddvq_f32(self) }
        }
    }
}

/// A row of f32 or of bf16 (raw bits), as LoRA keeps its weights.
#[derive(Clone, Copy)]
pub enum Row<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

impl Row<'_> {
    pub fn len(&self) -> usize {
        match self {
            Row::F32(a) => a.len(),
            Row::Bf16(a) => a.len(),
        }
    }
    fn at(&self, i: usize) -> f32 {
        match self {
            Row::F32(a) => a[i],
            Row::Bf16(a) => f32::from_bits((a[i] as u32) << 16),
        }
    }
    /// # Safety
    /// `i + V::N <= self.len()` and the CPU has V's instructions.
    #[inline(always)]
    unsafe fn load<V: Lanes>(&self, i: usize) -> V {
        // SAFETY: the caller's contract.
        unsafe {
            match self {
                Row::F32(a) => V::load(a.as_ptr().add(i)),
                Row::Bf16(a) => V::load_bf16(a.as_ptr().add(i)),
            }
        }
    }
}

/// `a · x` over their common length.
///
/// # Safety
/// The CPU has V's instructions.
#[inline(always)]
pub unsafe fn dot<V: Lanes>(a: Row, x: &[f32]) -> f32 {
    let n = a.len().min(x.len());
    let full = n / V::N * V::N;
    // SAFETY: every load covers i..i + N <= full <= n of both.
    let s = unsafe {
        let mut acc = V::zero();
        for i in (0..full).step_by(V::N) {
            acc = V::fmadd(a.load::<V>(i), V::load(x.as_ptr().add(i)), acc);
        }
        acc.sum()
    };
    s + (full..n).map(|j| a.at(j) * x[j]).sum::<f32>()
}

/// `y += alpha · x` over their common length.
///
/// # Safety
/// The CPU has V's instructions.
#[inline(always)]
pub unsafe fn axpy<V: Lanes>(y: &mut [f32], alpha: f32, x: Row) {
    let n = y.len().min(x.len());
    let full = n / V::N * V::N;
    // SAFETY: every load and store covers i..i + N <= full <= n of both.
    unsafe {
        let a = V::splat(alpha);
        for i in (0..full).step_by(V::N) {
            let p = y.as_mut_ptr().add(i);
            V::fmadd(a, x.load::<V>(i), V::load(p)).store(p);
        }
    }
    for (j, yj) in y.iter_mut().enumerate().take(n).skip(full) {
        *yj += alpha * x.at(j);
    }
}

/// [`dot`] under `family`'s vectors (plain Rust for the portable family). `family` is one
/// this CPU supports, as every device's is.
pub fn family_dot(family: Family, a: Row, x: &[f32]) -> f32 {
    // SAFETY (each arm): the family's instructions are there (the contract above).
    match family {
        #[cfg(target_arch = "x86_64")]
        Family::Avx512 => unsafe { entries::dot_avx512(a, x) },
        #[cfg(target_arch = "x86_64")]
        Family::Avx2 => unsafe { entries::dot_avx2(a, x) },
        #[cfg(target_arch = "aarch64")]
        Family::Neon => unsafe { entries::dot_neon(a, x) },
        _ => (0..a.len().min(x.len())).map(|i| a.at(i) * x[i]).sum(),
    }
}

/// [`axpy`] under `family`'s vectors, as [`family_dot`].
pub fn family_axpy(family: Family, y: &mut [f32], alpha: f32, x: Row) {
    // SAFETY (each arm): as in `family_dot`.
    match family {
        #[cfg(target_arch = "x86_64")]
        Family::Avx512 => unsafe { entries::axpy_avx512(y, alpha, x) },
        #[cfg(target_arch = "x86_64")]
        Family::Avx2 => unsafe { entries::axpy_avx2(y, alpha, x) },
        #[cfg(target_arch = "aarch64")]
        Family::Neon => unsafe { entries::axpy_neon(y, alpha, x) },
        _ => y.iter_mut().enumerate().take(x.len()).for_each(|(i, yi)| *yi += alpha * x.at(i)),
    }
}

/// FP8 bytes of `format` widened to f32 and multiplied by `scale` (an FP8 KV cache's reads):
/// N at a time as [`Lanes::load_e4m3_256th`] makes them, times 256 · scale, or as
/// [`Lanes::load_e5m2`] does, times the scale. That is each value times the scale rounded
/// once, the same f32 as `table[b]` (each byte's value times the scale) gives the tail.
///
/// # Safety
/// The CPU has V's instructions.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub unsafe fn widen_fp8<V: Lanes>(
    format: Fp8Format,
    table: &[f32; 256],
    scale: f32,
    src: &[u8],
    dst: &mut [f32],
) {
    assert_eq!(src.len(), dst.len());
    let full = src.len() / V::N * V::N;
    // SAFETY: every load and store covers i..i + N <= full of src and dst.
    unsafe {
        match format {
            Fp8Format::E4m3 => {
                let k = V::splat(256.0 * scale);
                for i in (0..full).step_by(V::N) {
                    V::mul(V::load_e4m3_256th(src.as_ptr().add(i)), k).store(dst.as_mut_ptr().add(i));
                }
            }
            Fp8Format::E5m2 => {
                let k = V::splat(scale);
                for i in (0..full).step_by(V::N) {
                    V::mul(V::load_e5m2(src.as_ptr().add(i)), k).store(dst.as_mut_ptr().add(i));
                }
            }
        }
    }
    dst[full..].iter_mut().zip(&src[full..]).for_each(|(d, &b)| *d = table[b as usize]);
}

/// [`widen_fp8`] under `family`'s vectors where they convert f16 in registers (AVX-512,
/// AVX2+F16C); by the table else.
pub fn family_widen_fp8(
    family: Family,
    format: Fp8Format,
    table: &[f32; 256],
    scale: f32,
    src: &[u8],
    dst: &mut [f32],
) {
    // SAFETY (each arm): the family's instructions are there, as in `family_dot`.
    match family {
        #[cfg(target_arch = "x86_64")]
        Family::Avx512 => unsafe { entries::widen_fp8_avx512(format, table, scale, src, dst) },
        #[cfg(target_arch = "x86_64")]
        Family::Avx2 => unsafe { entries::widen_fp8_avx2(format, table, scale, src, dst) },
        // The table holds each byte's value of `format` times `scale` already.
        _ => {
            let _ = (format, scale);
            crate::kernels::e4m3::widen(table, src, dst)
        }
    }
}

/// The families' entry points of [`dot`], [`axpy`] and [`widen_fp8`], compiled for their
/// instructions.
/// # Safety (each)
/// The CPU has the family's instructions.
mod entries {
    #[cfg(target_arch = "aarch64")]
    use std::arch::aarch64::float32x4_t;
    #[cfg(target_arch = "x86_64")]
    use std::arch::x86_64::{__m256, __m512};

    #[cfg(target_arch = "x86_64")]
    use super::{Fp8Format, widen_fp8};
    use super::{Row, axpy, dot};

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_avx512(a: Row, x: &[f32]) -> f32 {
        // SAFETY: the caller's contract.
        unsafe { dot::<__m512>(a, x) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_avx2(a: Row, x: &[f32]) -> f32 {
        // SAFETY: the caller's contract.
        unsafe { dot::<__m256>(a, x) }
    }
    #[cfg(target_arch = "aarch64")]
    #[target_feature(enable = "neon")]
    pub unsafe fn dot_neon(a: Row, x: &[f32]) -> f32 {
        // SAFETY: the caller's contract.
        unsafe { dot::<float32x4_t>(a, x) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn axpy_avx512(y: &mut [f32], alpha: f32, x: Row) {
        // SAFETY: the caller's contract.
        unsafe { axpy::<__m512>(y, alpha, x) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy_avx2(y: &mut [f32], alpha: f32, x: Row) {
        // SAFETY: the caller's contract.
        unsafe { axpy::<__m256>(y, alpha, x) }
    }
    #[cfg(target_arch = "aarch64")]
    #[target_feature(enable = "neon")]
    pub unsafe fn axpy_neon(y: &mut [f32], alpha: f32, x: Row) {
        // SAFETY: the caller's contract.
        unsafe { axpy::<float32x4_t>(y, alpha, x) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn widen_fp8_avx512(
        f: Fp8Format,
        table: &[f32; 256],
        scale: f32,
        src: &[u8],
        dst: &mut [f32],
    ) {
        // SAFETY: the caller's contract.
        unsafe { widen_fp8::<__m512>(f, table, scale, src, dst) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn widen_fp8_avx2(f: Fp8Format, table: &[f32; 256], scale: f32, src: &[u8], dst: &mut [f32]) {
        // SAFETY: the caller's contract.
        unsafe { widen_fp8::<__m256>(f, table, scale, src, dst) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every byte of both formats, at every offset of a vector and in the tail, widens to
    /// the bits of its table value times the scale (NaN to a NaN) in each family this CPU
    /// has.
    #[test]
    fn fp8_bytes_widen_to_their_scaled_values_in_every_family() {
        let bytes: Vec<u8> =
            (0..=255u8).chain((0..=255u8).rev()).chain([0x7f, 0x80, 0x01, 0xfe, 0x08]).collect();
        for (format, scale) in [Fp8Format::E4m3, Fp8Format::E5m2]
            .into_iter()
            .flat_map(|f| [1.0f32, 0.0123, 3.7, 1.0 / 448.0].map(|s| (f, s)))
        {
            let table = format.values().map(|v| v * scale);
            for family in Family::all_supported() {
                for start in [0, 3] {
                    let src = &bytes[start..];
                    let mut dst = vec![0f32; src.len()];
                    family_widen_fp8(family, format, &table, scale, src, &mut dst);
                    for (&b, &got) in src.iter().zip(&dst) {
                        let want = table[b as usize];
                        assert!(
                            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                            "{} {format:?} byte {b:#04x} at scale {scale}: {got} vs {want}",
                            family.name()
                        );
                    }
                }
            }
        }
    }
}
