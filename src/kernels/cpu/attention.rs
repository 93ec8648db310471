//! Paged attention on the CPU. K/V of the batch's tokens are first written into their cache
//! slots; then every query token attends over its sequence's cached positions `0..=pos`
//! through the block table. One path serves prefill (causal over the prompt, including any
//! already-cached prefix) and decode (one query over the whole context).
//!
//! Work is split per (token, head). Scores are a first pass over K, softmax in place, then a
//! second pass accumulates V; both inner loops run the device's SIMD family.

use rayon::prelude::*;

use super::{CpuCache, CpuTensor, Family};
use crate::kernels::AttnShape;
use crate::kernels::attn::AttnMetadata;

/// Copies each token's k and v rows into `slot_mapping[token]` (negative slots are skipped:
/// padding tokens).
pub fn write_kv(cache: &mut CpuCache, k: &CpuTensor, v: &CpuTensor, slot_mapping: &[i64]) {
    let width = cache.shape.num_kv_heads * cache.shape.head_dim;
    assert_eq!(k.cols, width, "write_kv: k has {} features, cache holds {width}", k.cols);
    let slots = cache.shape.num_blocks * cache.shape.block_size;
    for (t, &slot) in slot_mapping.iter().enumerate() {
        if slot < 0 {
            continue;
        }
        let s = slot as usize;
        assert!(s < slots, "write_kv: slot {s} beyond the {slots}-slot cache");
        cache.k[s * width..(s + 1) * width].copy_from_slice(&k.data[t * width..(t + 1) * width]);
        cache.v[s * width..(s + 1) * width].copy_from_slice(&v.data[t * width..(t + 1) * width]);
    }
}

/// Where one (token, head) reads: cache offsets of its visible context positions
/// `start..start + len`, in order.
struct Context<'a> {
    table: &'a [u32],
    block_size: usize,
    width: usize,
    head_off: usize,
    start: usize,
    len: usize,
}

impl Context<'_> {
    /// Offset of the `i`-th visible position.
    #[inline]
    fn offset(&self, i: usize) -> usize {
        let p = self.start + i;
        (self.table[p / self.block_size] as usize * self.block_size + p % self.block_size) * self.width
            + self.head_off
    }
}

/// Soft-caps raw scores (`cap · tanh(s / cap)`) when the shape asks for it; a no-op else.
fn cap_scores(scores: &mut [f32], cap: f32) {
    if cap > 0.0 {
        scores.iter_mut().for_each(|s| *s = cap * (*s / cap).tanh());
    }
}

/// `softmax(q·Kᵀ · scale) · V` per (token, head) over the token's causal context (the last
/// `window` positions of it with a sliding window), the scores soft-capped when asked.
pub fn attend(
    q: &CpuTensor,
    cache: &CpuCache,
    s: AttnShape,
    meta: &AttnMetadata,
    family: Family,
) -> CpuTensor {
    let (hd, nh) = (s.head_dim, s.num_heads);
    let group = nh / s.num_kv_heads;
    let width = s.num_kv_heads * hd;
    let bs = cache.shape.block_size;
    let mut out = vec![0f32; q.rows * nh * hd];
    // SIMD lanes of the family's head, where head_dim is a multiple of them (0: portable).
    let lanes = match family {
        Family::Avx512 if hd % 16 == 0 => 16,
        Family::Avx2 if hd % 8 == 0 => 8,
        Family::Neon if hd % 4 == 0 => 4,
        _ => 0,
    };
    out.par_chunks_mut(hd).enumerate().for_each_init(Vec::<f32>::new, |scores, (i, o)| {
        let (t, h) = (i / nh, i % nh);
        let pos = meta.positions[t] as usize;
        let start = s.first_visible(pos);
        let ctx = Context {
            table: &meta.block_tables[meta.token_seq[t] as usize],
            block_size: bs,
            width,
            head_off: (h / group) * hd,
            start,
            len: pos + 1 - start,
        };
        let qv = &q.data[t * nh * hd + h * hd..t * nh * hd + (h + 1) * hd];
        scores.clear();
        scores.resize(ctx.len, 0.0);
        // SAFETY: a device runs a family only where the CPU has it, and head_dim is a
        // multiple of the lanes (checked above).
        match lanes {
            #[cfg(target_arch = "x86_64")]
            16 => return unsafe { simd::head16(qv, cache, &ctx, s, scores, o) },
            #[cfg(target_arch = "x86_64")]
            8 => return unsafe { simd::head8(qv, cache, &ctx, s, scores, o) },
            #[cfg(target_arch = "aarch64")]
            4 => return unsafe { simd::head4(qv, cache, &ctx, s, scores, o) },
            _ => {}
        }
        portable_head(qv, cache, &ctx, s, scores, o);
    });
    CpuTensor::new(out, q.rows, nh * hd)
}

fn softmax_in_place(scores: &mut [f32]) {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for sc in scores.iter_mut() {
        *sc = (*sc - max).exp();
        sum += *sc;
    }
    let inv = 1.0 / sum;
    scores.iter_mut().for_each(|s| *s *= inv);
}

fn portable_head(
    q: &[f32],
    cache: &CpuCache,
    ctx: &Context,
    s: AttnShape,
    scores: &mut [f32],
    o: &mut [f32],
) {
    let hd = q.len();
    for (p, sc) in scores.iter_mut().enumerate() {
        let at = ctx.offset(p);
        *sc = q.iter().zip(&cache.k[at..at + hd]).map(|(a, b)| a * b).sum::<f32>() * s.scale;
    }
    cap_scores(scores, s.softcap);
    softmax_in_place(scores);
    for (p, &w) in scores.iter().enumerate() {
        let at = ctx.offset(p);
        for (oi, vi) in o.iter_mut().zip(&cache.v[at..at + hd]) {
            *oi += w * vi;
        }
    }
}

/// The SIMD heads: one body, run 16 lanes at a time under AVX-512, 8 under AVX2 and 4
/// under NEON.
mod simd {
    #[cfg(target_arch = "aarch64")]
    use std::arch::aarch64::float32x4_t;
    #[cfg(target_arch = "x86_64")]
    use std::arch::x86_64::{__m256, __m512};

    use super::super::simd::Lanes;
    use super::{AttnShape, Context, CpuCache, cap_scores, softmax_in_place};

    /// One (token, head), `V::N` dims at a time.
    ///
    /// # Safety
    /// The CPU has `V`'s instructions and `q.len()` is a multiple of `V::N`.
    #[inline(always)]
    unsafe fn head<V: Lanes>(
        q: &[f32],
        cache: &CpuCache,
        ctx: &Context,
        s: AttnShape,
        scores: &mut [f32],
        o: &mut [f32],
    ) {
        let hd = q.len();
        let chunks = hd / V::N;
        assert!(o.len() == hd && scores.len() == ctx.len);
        // SAFETY (whole body): every load and store covers c·N .. c·N + N <= hd elements of
        // a slice of hd; the instructions are there (the caller's contract).
        unsafe {
            for (p, sc) in scores.iter_mut().enumerate() {
                let at = ctx.offset(p);
                let k = &cache.k[at..at + hd];
                let mut acc = V::zero();
                for c in 0..chunks {
                    acc = V::fmadd(V::load(q.as_ptr().add(c * V::N)), V::load(k.as_ptr().add(c * V::N)), acc);
                }
                *sc = acc.sum() * s.scale;
            }
            cap_scores(scores, s.softcap);
            softmax_in_place(scores);
            for c in 0..chunks {
                let mut acc = V::zero();
                for (p, &w) in scores.iter().enumerate() {
                    let v = &cache.v[ctx.offset(p) + c * V::N..][..V::N];
                    acc = V::fmadd(V::splat(w), V::load(v.as_ptr()), acc);
                }
                acc.store(o.as_mut_ptr().add(c * V::N));
            }
        }
    }

    /// [`head`] on AVX-512.
    ///
    /// # Safety
    /// AVX-512F is available and `q.len()` is a multiple of 16.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn head16(
        q: &[f32],
        cache: &CpuCache,
        ctx: &Context,
        s: AttnShape,
        scores: &mut [f32],
        o: &mut [f32],
    ) {
        // SAFETY: the caller's contract.
        unsafe { head::<__m512>(q, cache, ctx, s, scores, o) }
    }

    /// [`head`] on AVX2.
    ///
    /// # Safety
    /// AVX2 and FMA are available and `q.len()` is a multiple of 8.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn head8(
        q: &[f32],
        cache: &CpuCache,
        ctx: &Context,
        s: AttnShape,
        scores: &mut [f32],
        o: &mut [f32],
    ) {
        // SAFETY: the caller's contract.
        unsafe { head::<__m256>(q, cache, ctx, s, scores, o) }
    }

    /// [`head`] on NEON.
    ///
    /// # Safety
    /// NEON is available and `q.len()` is a multiple of 4.
    #[cfg(target_arch = "aarch64")]
    #[target_feature(enable = "neon")]
    pub unsafe fn head4(
        q: &[f32],
        cache: &CpuCache,
        ctx: &Context,
        s: AttnShape,
        scores: &mut [f32],
        o: &mut [f32],
    ) {
        // SAFETY: the caller's contract.
        unsafe { head::<float32x4_t>(q, cache, ctx, s, scores, o) }
    }
}
