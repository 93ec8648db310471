//! Paged attention on the CPU. K/V of the batch's tokens are first written into their cache
//! slots; then every query token attends over its sequence's cached positions `0..=pos`
//! through the block table. One path serves prefill (causal over the prompt, including any
//! already-cached prefix) and decode (one query over the whole context).

use rayon::prelude::*;

use super::matmul::dot_f32;
use super::{CpuCache, CpuTensor};
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

/// `softmax(q·Kᵀ · scale) · V` per (token, head) over the token's causal context.
pub fn attend(q: &CpuTensor, cache: &CpuCache, s: AttnShape, meta: &AttnMetadata) -> CpuTensor {
    let (hd, nh) = (s.head_dim, s.num_heads);
    let group = nh / s.num_kv_heads;
    let width = s.num_kv_heads * hd;
    let bs = cache.shape.block_size;
    let mut out = vec![0f32; q.rows * nh * hd];
    out.par_chunks_mut(hd).enumerate().for_each_init(Vec::<f32>::new, |scores, (i, o)| {
        let (t, h) = (i / nh, i % nh);
        let kvh = h / group;
        let ctx = meta.positions[t] as usize + 1;
        let table = &meta.block_tables[meta.token_seq[t] as usize];
        let qv = &q.data[t * nh * hd + h * hd..t * nh * hd + (h + 1) * hd];
        let slot = |p: usize| (table[p / bs] as usize * bs + p % bs) * width + kvh * hd;
        scores.clear();
        let mut max = f32::NEG_INFINITY;
        for p in 0..ctx {
            let at = slot(p);
            let sc = dot_f32(qv, &cache.k[at..at + hd]) * s.scale;
            max = max.max(sc);
            scores.push(sc);
        }
        let mut sum = 0f32;
        for sc in scores.iter_mut() {
            *sc = (*sc - max).exp();
            sum += *sc;
        }
        let inv = 1.0 / sum;
        for (p, &w) in scores.iter().enumerate() {
            let at = slot(p);
            let w = w * inv;
            for (oi, vi) in o.iter_mut().zip(&cache.v[at..at + hd]) {
                *oi += w * vi;
            }
        }
    });
    CpuTensor::new(out, q.rows, nh * hd)
}
