//! Paged attention on the CPU. K/V of the batch's tokens are first written into their cache
//! slots; then every query token attends over its sequence's cached positions `0..=pos`
//! through the block table. One path serves prefill (causal over the prompt, including any
//! already-cached prefix) and decode (one query over the whole context).
//!
//! Work is split per (token, head). Scores are a first pass over K, softmax in place, then a
//! second pass accumulates V; both inner loops use AVX-512 when the CPU has it.

use rayon::prelude::*;

use super::{CpuCache, CpuTensor, Family};
use crate::kernels::AttnShape;
use crate::models::attn::AttnMetadata;

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
    #[cfg(target_arch = "x86_64")]
    let simd = family == Family::Avx512 && hd % 16 == 0;
    #[cfg(target_arch = "x86_64")]
    let simd2 = family == Family::Avx2 && hd % 8 == 0;
    #[cfg(not(target_arch = "x86_64"))]
    let _ = family;
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
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: AVX-512F is present and head_dim is a multiple of 16 (checked above).
            unsafe { avx512::head(qv, cache, &ctx, s, scores, o) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if simd2 {
            // SAFETY: the AVX2 family runs only where AVX2 and FMA are; head_dim is a
            // multiple of 8 (checked above).
            unsafe { avx2::head(qv, cache, &ctx, s, scores, o) };
            return;
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

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{AttnShape, Context, CpuCache, cap_scores, softmax_in_place};

    /// One (token, head) with head_dim a multiple of 16.
    ///
    /// # Safety
    /// AVX-512F is available and `q.len()` is a multiple of 16.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn head(
        q: &[f32],
        cache: &CpuCache,
        ctx: &Context,
        s: AttnShape,
        scores: &mut [f32],
        o: &mut [f32],
    ) {
        let hd = q.len();
        let chunks = hd / 16;
        assert!(o.len() == hd && scores.len() == ctx.len);
        for (p, sc) in scores.iter_mut().enumerate() {
            let at = ctx.offset(p);
            let k = &cache.k[at..at + hd];
            let mut acc = _mm512_setzero_ps();
            for c in 0..chunks {
                // SAFETY: c·16 + 16 <= hd for both slices.
                unsafe {
                    let qv = _mm512_loadu_ps(q.as_ptr().add(c * 16));
                    acc = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k.as_ptr().add(c * 16)), acc);
                }
            }
            *sc = _mm512_reduce_add_ps(acc) * s.scale;
        }
        cap_scores(scores, s.softcap);
        softmax_in_place(scores);
        for c in 0..chunks {
            let mut acc = _mm512_setzero_ps();
            for (p, &w) in scores.iter().enumerate() {
                let at = ctx.offset(p) + c * 16;
                let v = &cache.v[at..at + 16];
                // SAFETY: the slice holds 16 elements.
                acc = _mm512_fmadd_ps(_mm512_set1_ps(w), unsafe { _mm512_loadu_ps(v.as_ptr()) }, acc);
            }
            // SAFETY: c·16 + 16 <= hd = o.len().
            unsafe { _mm512_storeu_ps(o.as_mut_ptr().add(c * 16), acc) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{AttnShape, Context, CpuCache, cap_scores, softmax_in_place};

    /// One (token, head) with head_dim a multiple of 8, as `avx512::head` in 8-lane steps.
    ///
    /// # Safety
    /// AVX2 and FMA are available and `q.len()` is a multiple of 8.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn head(
        q: &[f32],
        cache: &CpuCache,
        ctx: &Context,
        s: AttnShape,
        scores: &mut [f32],
        o: &mut [f32],
    ) {
        let hd = q.len();
        let chunks = hd / 8;
        assert!(o.len() == hd && scores.len() == ctx.len);
        for (p, sc) in scores.iter_mut().enumerate() {
            let at = ctx.offset(p);
            let k = &cache.k[at..at + hd];
            let mut acc = _mm256_setzero_ps();
            for c in 0..chunks {
                // SAFETY: c·8 + 8 <= hd for both slices.
                unsafe {
                    let qv = _mm256_loadu_ps(q.as_ptr().add(c * 8));
                    acc = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k.as_ptr().add(c * 8)), acc);
                }
            }
            // The eight lanes summed: halves, then pairs, then the last two.
            let half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
            let pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
            let sum = _mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1));
            *sc = _mm_cvtss_f32(sum) * s.scale;
        }
        cap_scores(scores, s.softcap);
        softmax_in_place(scores);
        for c in 0..chunks {
            let mut acc = _mm256_setzero_ps();
            for (p, &w) in scores.iter().enumerate() {
                let at = ctx.offset(p) + c * 8;
                let v = &cache.v[at..at + 8];
                // SAFETY: the slice holds 8 elements.
                acc = _mm256_fmadd_ps(_mm256_set1_ps(w), unsafe { _mm256_loadu_ps(v.as_ptr()) }, acc);
            }
            // SAFETY: c·8 + 8 <= hd = o.len().
            unsafe { _mm256_storeu_ps(o.as_mut_ptr().add(c * 8), acc) };
        }
    }
}
