//! Paged attention on the CPU. K/V of the batch's tokens are first written into their cache
//! slots; then every query token attends over its sequence's cached positions `0..=pos`
//! through the block table. One path serves prefill (causal over the prompt, including any
//! already-cached prefix) and decode (one query over the whole context).
//!
//! Decode tokens (and short runs of prompt tokens) are split per (token, KV head), whose
//! query heads run one after another over the keys and values the first left in cache:
//! scores are a first pass over K, softmax in place, then a second pass accumulates V;
//! both inner loops run the device's SIMD family. Where a step has fewer such tasks than
//! the threads want (a decode of few sequences), each context is cut into parts of at
//! least [`PART_MIN`] positions, joined by their softmax maxima and sums. A run of at least
//! [`TILE_MIN`] consecutive prompt tokens of one sequence is computed in tiles instead: per
//! KV head and block of [`TILE_ROWS`] queries, the block's keys and values are gathered once
//! from the paged cache and the scores and the output are two small GEMMs, so that a long
//! prompt reads each key once a block rather than once a query.
//!
//! An FP8 cache (`--kv-cache-dtype fp8`) is read through the same kernels: a (token, KV
//! head) and part first widens its visible rows to f32, once for the query heads of its
//! group, and a tile its gathered ones.

use rayon::prelude::*;

use super::{CpuCache, CpuTensor, Family, KvCells};
use crate::kernels::AttnShape;
use crate::kernels::attn::AttnMetadata;

/// Copies each token's k and v rows into `slot_mapping[token]` (negative slots are skipped:
/// padding tokens).
pub fn write_kv(cache: &mut CpuCache, k: &CpuTensor, v: &CpuTensor, slot_mapping: &[i64]) {
    let width = cache.shape.num_kv_heads * cache.shape.head_dim;
    assert_eq!(k.cols, width, "write_kv: k has {} features, cache holds {width}", k.cols);
    let slots = cache.shape.num_blocks * cache.shape.block_size;
    // Under --calculate-kv-scales the first rows written set an FP8 cache's scales.
    cache.k.calibrate(written_rows(k, slot_mapping, width));
    cache.v.calibrate(written_rows(v, slot_mapping, width));
    for (t, &slot) in slot_mapping.iter().enumerate() {
        if slot < 0 {
            continue;
        }
        let s = slot as usize;
        assert!(s < slots, "write_kv: slot {s} beyond the {slots}-slot cache");
        cache.k.write(s * width, &k.data[t * width..(t + 1) * width]);
        cache.v.write(s * width, &v.data[t * width..(t + 1) * width]);
    }
}

/// The rows of `x` that `slot_mapping` writes (not the padding's).
fn written_rows<'a>(
    x: &'a CpuTensor,
    slot_mapping: &'a [i64],
    width: usize,
) -> impl Iterator<Item = &'a [f32]> {
    slot_mapping.iter().zip(x.data.chunks_exact(width)).filter(|(s, _)| **s >= 0).map(|(_, row)| row)
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
    /// The offsets of every visible position, a block at a time. Each block the table names
    /// is checked to lie in the cache's `num_blocks`, so that every offset starts a row of
    /// the cache (`attend` checks the cache's length against its shape).
    fn offsets(&self, num_blocks: usize, out: &mut Vec<usize>) {
        out.clear();
        let (bs, end) = (self.block_size, self.start + self.len);
        let mut p = self.start;
        while p < end {
            let block = self.table[p / bs] as usize;
            assert!(block < num_blocks, "attention: block {block} is past the {num_blocks}-block cache");
            let base = block * bs;
            let stop = end.min((p / bs + 1) * bs);
            out.extend((p..stop).map(|q| (base + q % bs) * self.width + self.head_off));
            p = stop;
        }
    }
}

/// A worker's buffers: one (token, head)'s scores and its positions' cache offsets; over an
/// FP8 cache, the rows of a (token, KV head) widened to f32, their offsets there, and which
/// (token, KV head) they are (the query heads of a GQA group come one after another).
#[derive(Default)]
struct Scratch {
    scores: Vec<f32>,
    offsets: Vec<usize>,
    k: Vec<f32>,
    v: Vec<f32>,
    widened: Vec<usize>,
    widened_for: Option<(usize, usize, usize)>,
}

impl Scratch {
    /// The K and V values the offsets' rows of `hd` values read, for token, KV head and
    /// part `of`, and the offsets to read them at: the cache's own over an f32 cache, else
    /// the rows widened into this scratch (once for the heads of a group).
    fn rows<'a>(
        &'a mut self,
        cache: &'a CpuCache,
        hd: usize,
        of: (usize, usize, usize),
        family: Family,
    ) -> (&'a [f32], &'a [f32], &'a [usize]) {
        match (&cache.k, &cache.v) {
            (KvCells::F32(k), KvCells::F32(v)) => (k, v, &self.offsets),
            _ if self.widened_for == Some(of) => (&self.k, &self.v, &self.widened),
            _ => {
                self.widened_for = Some(of);
                let n = self.offsets.len();
                self.k.resize(n * hd, 0.0);
                self.v.resize(n * hd, 0.0);
                for (j, &at) in self.offsets.iter().enumerate() {
                    cache.k.read(at, &mut self.k[j * hd..(j + 1) * hd], family);
                    cache.v.read(at, &mut self.v[j * hd..(j + 1) * hd], family);
                }
                self.widened.clear();
                self.widened.extend((0..n).map(|j| j * hd));
                (&self.k, &self.v, &self.widened)
            }
        }
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
    // Every offset `Context::offsets` gives is a row of the cache of this shape.
    let cells = cache.shape.num_blocks * bs * width;
    assert!(
        cache.k.len() >= cells && cache.v.len() >= cells,
        "attention: the cache is smaller than its shape"
    );
    let runs = tiled_runs(meta);
    let mut tiled = vec![false; q.rows];
    for r in &runs {
        tiled[r.clone()].iter_mut().for_each(|t| *t = true);
    }
    let nkv = s.num_kv_heads;
    let pairs = q.rows * nkv;
    // A decode step of few sequences cuts each (token, KV head)'s context into parts, so
    // that every thread has work and a part's keys and values stay in cache for the
    // group's query heads; the parts' outputs are joined by their softmax sums below.
    let longest = (0..q.rows)
        .filter(|&t| !tiled[t])
        .map(|t| {
            let pos = meta.positions[t] as usize;
            pos + 1 - s.first_visible(pos)
        })
        .max()
        .unwrap_or(0);
    let want = PARTS_PER_THREAD * rayon::current_num_threads();
    let parts = if pairs >= want { 1 } else { want.div_ceil(pairs).min(longest / PART_MIN).max(1) };
    // Part `part` of (token, KV head) `pair`: each query head of the group's output over
    // the part's positions (`o`, group × head_dim) and its softmax's maximum and sum.
    let task =
        |scratch: &mut Scratch, (pair, part): (usize, usize), o: &mut [f32], stats: &mut [(f32, f32)]| {
            let (t, kvh) = (pair / nkv, pair % nkv);
            if tiled[t] {
                return;
            }
            let pos = meta.positions[t] as usize;
            let start = s.first_visible(pos);
            let len = pos + 1 - start;
            let chunk = len.div_ceil(parts);
            let (lo, hi) = ((part * chunk).min(len), ((part + 1) * chunk).min(len));
            if lo == hi {
                stats.fill((f32::NEG_INFINITY, 0.0));
                return;
            }
            let ctx = Context {
                table: &meta.block_tables[meta.token_seq[t] as usize],
                block_size: bs,
                width,
                head_off: kvh * hd,
                start: start + lo,
                len: hi - lo,
            };
            // Every row the heads read lies inside the cache (checked a block at a time, so
            // that the SIMD loops read without bounds checks).
            ctx.offsets(cache.shape.num_blocks, &mut scratch.offsets);
            let mut scores = std::mem::take(&mut scratch.scores);
            scores.clear();
            scores.resize(ctx.len, 0.0);
            let (k, v, offsets) = scratch.rows(cache, hd, (t, kvh, part), family);
            for (j, (o, stats)) in o.chunks_mut(hd).zip(stats).enumerate() {
                let h = kvh * group + j;
                let qv = &q.data[t * nh * hd + h * hd..t * nh * hd + (h + 1) * hd];
                // SAFETY: a device runs a family only where the CPU has it, head_dim is a
                // multiple of the lanes (checked above) and every offset's row is in k and v (in
                // the cache: its block is below num_blocks, head_off + hd <= width, and the
                // cache holds its shape's cells; widened: one row of hd values an offset).
                *stats = match lanes {
                    #[cfg(target_arch = "x86_64")]
                    16 => unsafe { simd::head16(qv, (k, v), offsets, s, &mut scores, o) },
                    #[cfg(target_arch = "x86_64")]
                    8 => unsafe { simd::head8(qv, (k, v), offsets, s, &mut scores, o) },
                    #[cfg(target_arch = "aarch64")]
                    4 => unsafe { simd::head4(qv, (k, v), offsets, s, &mut scores, o) },
                    _ => portable_head(qv, (k, v), offsets, s, &mut scores, o),
                };
            }
            scratch.scores = scores;
        };
    // A task a (token, KV head) and part: its query heads' rows are next to each other in
    // the output (heads of a group are consecutive).
    if parts == 1 {
        out.par_chunks_mut(group * hd).enumerate().for_each_init(
            || (Scratch::default(), vec![(0.0, 0.0); group]),
            |(scratch, stats), (pair, o)| task(scratch, (pair, 0), o, stats),
        );
    } else {
        let mut part_out = vec![0f32; pairs * parts * group * hd];
        let mut part_stats = vec![(f32::NEG_INFINITY, 0f32); pairs * parts * group];
        part_out
            .par_chunks_mut(group * hd)
            .zip(part_stats.par_chunks_mut(group))
            .enumerate()
            .for_each_init(Scratch::default, |scratch, (i, (o, stats))| {
                task(scratch, (i / parts, i % parts), o, stats)
            });
        join_parts((&part_out, &part_stats), (parts, group, hd), &tiled, &mut out);
    }
    if !runs.is_empty() {
        attend_tiled(q, cache, s, meta, &runs, family, &mut out);
    }
    CpuTensor::new(out, q.rows, nh * hd)
}

/// Decode tasks a thread wants before a (token, KV head)'s context is cut into parts.
const PARTS_PER_THREAD: usize = 8;
/// The fewest positions a part of a context holds (the parts' join costs a few vectors of
/// head_dim a query head).
const PART_MIN: usize = 64;

/// Joins the parts of each (token, head)'s context into its row of `out`: each part's
/// output (normalized by its own softmax sum) weighs by that sum, rescaled to the largest
/// part maximum. Rows of tiled tokens are left to the tiles. `part_out` holds, for each
/// (token, KV head) pair and part, the group's `group × hd` outputs; `part_stats` their
/// softmax maxima and sums.
fn join_parts(
    (part_out, part_stats): (&[f32], &[(f32, f32)]),
    (parts, group, hd): (usize, usize, usize),
    tiled: &[bool],
    out: &mut [f32],
) {
    let pairs = part_stats.len() / (parts * group);
    let nkv = pairs / tiled.len();
    for (row, o) in out.chunks_mut(hd).enumerate() {
        let (pair, j) = (row / group, row % group);
        if tiled[pair / nkv] {
            continue;
        }
        let at = |p: usize| (pair * parts + p) * group + j;
        let top = (0..parts)
            .map(|p| part_stats[at(p)])
            .filter(|&(_, sum)| sum > 0.0)
            .fold(f32::NEG_INFINITY, |m, (max, _)| m.max(max));
        let weight = |p: usize| {
            let (max, sum) = part_stats[at(p)];
            if sum > 0.0 { sum * (max - top).exp() } else { 0.0 }
        };
        let total: f32 = (0..parts).map(weight).sum();
        o.fill(0.0);
        for p in (0..parts).filter(|&p| weight(p) > 0.0) {
            let w = weight(p) / total;
            let part = &part_out[at(p) * hd..(at(p) + 1) * hd];
            o.iter_mut().zip(part).for_each(|(o, x)| *o += w * x);
        }
    }
}

/// Prompt runs shorter than this go per (token, head).
const TILE_MIN: usize = 16;
/// Queries of one tile.
const TILE_ROWS: usize = 64;

/// The runs of at least [`TILE_MIN`] consecutive tokens of one sequence at consecutive
/// positions (prompt chunks), as token ranges.
fn tiled_runs(meta: &AttnMetadata) -> Vec<std::ops::Range<usize>> {
    let mut runs = Vec::new();
    let n = meta.positions.len();
    let mut start = 0;
    for t in 1..=n {
        let goes_on = t < n
            && meta.token_seq[t] == meta.token_seq[t - 1]
            && meta.positions[t] == meta.positions[t - 1] + 1;
        if !goes_on {
            if t - start >= TILE_MIN {
                runs.push(start..t);
            }
            start = t;
        }
    }
    runs
}

/// `dst[m, n] = a[m, k] · b[k, n]`, each operand given by its row and column strides, on
/// this thread.
#[allow(clippy::too_many_arguments)]
fn small_gemm(
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    dst_rs: usize,
    a: &[f32],
    (a_rs, a_cs): (usize, usize),
    b: &[f32],
    (b_rs, b_cs): (usize, usize),
) {
    let last = |rs: usize, cs: usize, rows: usize, cols: usize| (rows - 1) * rs + (cols - 1) * cs;
    assert!(m > 0 && n > 0 && k > 0);
    assert!(last(dst_rs, 1, m, n) < dst.len() && last(a_rs, a_cs, m, k) < a.len());
    assert!(last(b_rs, b_cs, k, n) < b.len());
    // SAFETY: every element each operand's strides reach is inside its slice (asserted
    // above), and gemm writes only dst's m × n elements.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            false,
            a.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.as_ptr(),
            b_cs as isize,
            b_rs as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// The tiles of `runs`: for each (run, KV head, block of queries), the keys and values the
/// block sees gathered once, then per query head of the group `S = q·Kᵀ`, the scale, soft
/// cap and causal (and window) mask, a softmax per row and `O = S·V`.
fn attend_tiled(
    q: &CpuTensor,
    cache: &CpuCache,
    s: AttnShape,
    meta: &AttnMetadata,
    runs: &[std::ops::Range<usize>],
    family: Family,
    out: &mut [f32],
) {
    let (hd, nh, nkv) = (s.head_dim, s.num_heads, s.num_kv_heads);
    let group = nh / nkv;
    let width = nkv * hd;
    let bs = cache.shape.block_size;
    let tiles: Vec<(usize, usize, usize)> = runs
        .iter()
        .flat_map(|r| (r.start..r.end).step_by(TILE_ROWS).map(move |t0| (t0, TILE_ROWS.min(r.end - t0))))
        .flat_map(|(t0, rows)| (0..nkv).map(move |g| (t0, rows, g)))
        .collect();
    // Each tile's output, [head of the group][row][dim].
    let results: Vec<Vec<f32>> = tiles
        .par_iter()
        .map(|&(t0, rows, g)| {
            let table = &meta.block_tables[meta.token_seq[t0] as usize];
            let p0 = meta.positions[t0] as usize;
            let kstart = s.first_visible(p0);
            let nk = p0 + rows - kstart;
            let mut kc = vec![0f32; nk * hd];
            let mut vc = vec![0f32; nk * hd];
            for j in 0..nk {
                let p = kstart + j;
                let at = (table[p / bs] as usize * bs + p % bs) * width + g * hd;
                cache.k.read(at, &mut kc[j * hd..(j + 1) * hd], family);
                cache.v.read(at, &mut vc[j * hd..(j + 1) * hd], family);
            }
            let mut scores = vec![0f32; rows * nk];
            let mut o = vec![0f32; group * rows * hd];
            for (j, oh) in o.chunks_mut(rows * hd).enumerate() {
                let h = g * group + j;
                let qh = &q.data[t0 * nh * hd + h * hd..];
                small_gemm((rows, nk, hd), &mut scores, nk, qh, (nh * hd, 1), &kc, (1, hd));
                for (r, row) in scores.chunks_mut(nk).enumerate() {
                    let p = p0 + r;
                    let (lo, hi) = (s.first_visible(p) - kstart, p + 1 - kstart);
                    row[..lo].fill(0.0);
                    row[hi..].fill(0.0);
                    let seen = &mut row[lo..hi];
                    seen.iter_mut().for_each(|x| *x *= s.scale);
                    cap_scores(seen, s.softcap);
                    softmax(seen, family);
                }
                small_gemm((rows, hd, nk), oh, hd, &scores, (nk, 1), &vc, (hd, 1));
            }
            o
        })
        .collect();
    for (&(t0, rows, g), o) in tiles.iter().zip(&results) {
        for (j, oh) in o.chunks(rows * hd).enumerate() {
            let h = g * group + j;
            for r in 0..rows {
                let at = (t0 + r) * nh * hd + h * hd;
                out[at..at + hd].copy_from_slice(&oh[r * hd..(r + 1) * hd]);
            }
        }
    }
}

/// `e^x` for the softmax's shifted scores (`x ≤ 0`), within about one ulp: `2^n · p(r)` for
/// `x = n·ln 2 + r`, `|r| ≤ ln 2 / 2`, with Cephes' expf polynomial. Plain arithmetic (the
/// rounding is the 1.5·2²³ shift), so that a loop of it vectorizes at the width of the
/// function it is inlined into, where libm's `expf` is a call per element.
#[inline(always)]
fn exp_shifted(x: f32) -> f32 {
    const SHIFT: f32 = 12_582_912.0;
    let x = x.max(-87.0);
    let n = (x * std::f32::consts::LOG2_E + SHIFT) - SHIFT;
    // ln 2 in two parts, so that n · ln 2 is exact enough to leave r's low bits.
    let r = x - n * 0.693_359_4 + n * 2.121_944_4e-4;
    let p = ((((1.987_569_2e-4 * r + 1.398_2e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 0.166_666_65)
        * r
        + 0.5;
    f32::from_bits(((n as i32 + 127) << 23) as u32) * (p * r * r + r + 1.0)
}

/// Softmax of one row in place; returns the row's maximum and the sum of its exponentials
/// shifted by it. The maximum and the sum are kept in 16 lanes (each in a fixed order), so
/// that neither is a chain of dependent adds.
#[inline(always)]
fn softmax_in_place(scores: &mut [f32]) -> (f32, f32) {
    const L: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; L];
    let (chunks, rest) = scores.as_chunks::<L>();
    for c in chunks {
        for i in 0..L {
            lanes[i] = lanes[i].max(c[i]);
        }
    }
    let max = rest.iter().chain(&lanes).copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sums = [0f32; L];
    let (chunks, rest) = scores.as_chunks_mut::<L>();
    for c in chunks {
        for i in 0..L {
            c[i] = exp_shifted(c[i] - max);
            sums[i] += c[i];
        }
    }
    let mut sum = 0f32;
    for x in rest {
        *x = exp_shifted(*x - max);
        sum += *x;
    }
    let total = sums.iter().sum::<f32>() + sum;
    let inv = 1.0 / total;
    scores.iter_mut().for_each(|s| *s *= inv);
    (max, total)
}

/// [`softmax_in_place`] at the family's width, for callers outside its SIMD heads.
fn softmax(scores: &mut [f32], family: Family) -> (f32, f32) {
    match family {
        // SAFETY: a device runs a family only where the CPU has it.
        #[cfg(target_arch = "x86_64")]
        Family::Avx512 => unsafe { simd::softmax16(scores) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Family::Avx2 => unsafe { simd::softmax8(scores) },
        _ => softmax_in_place(scores),
    }
}

fn portable_head(
    q: &[f32],
    (k, v): (&[f32], &[f32]),
    offsets: &[usize],
    s: AttnShape,
    scores: &mut [f32],
    o: &mut [f32],
) -> (f32, f32) {
    let hd = q.len();
    for (sc, &at) in scores.iter_mut().zip(offsets) {
        *sc = q.iter().zip(&k[at..at + hd]).map(|(a, b)| a * b).sum::<f32>() * s.scale;
    }
    cap_scores(scores, s.softcap);
    let stats = softmax_in_place(scores);
    o.fill(0.0);
    for (&w, &at) in scores.iter().zip(offsets) {
        for (oi, vi) in o.iter_mut().zip(&v[at..at + hd]) {
            *oi += w * vi;
        }
    }
    stats
}

/// The SIMD heads: one body, run 16 lanes at a time under AVX-512, 8 under AVX2 and 4
/// under NEON.
mod simd {
    #[cfg(target_arch = "aarch64")]
    use std::arch::aarch64::float32x4_t;
    #[cfg(target_arch = "x86_64")]
    use std::arch::x86_64::{__m256, __m512};

    use super::super::simd::Lanes;
    use super::{AttnShape, cap_scores, softmax_in_place};

    /// Positions whose scores are computed together: as many independent FMA chains as
    /// two FMA units need to hide their latency.
    const SCORE_ROWS: usize = 8;

    /// One (token, head), `V::N` dims at a time: the scores [`SCORE_ROWS`] positions at a
    /// time, then the weighted sum of V with up to eight output vectors held in registers
    /// while the positions stream past.
    ///
    /// # Safety
    /// The CPU has `V`'s instructions, `q.len()` is a multiple of `V::N`, and every offset
    /// starts a row of `q.len()` values inside `k` and `v`.
    #[inline(always)]
    unsafe fn head<V: Lanes>(
        q: &[f32],
        (k, v): (&[f32], &[f32]),
        offsets: &[usize],
        s: AttnShape,
        scores: &mut [f32],
        o: &mut [f32],
    ) -> (f32, f32) {
        let hd = q.len();
        let chunks = hd / V::N;
        assert!(o.len() == hd && scores.len() == offsets.len());
        // SAFETY (whole body): q and o hold hd values and every cache row read is one of
        // the offsets' rows of hd values (the contract); the instructions are there.
        unsafe {
            let (k, qp) = (k.as_ptr(), q.as_ptr());
            let mut sc = scores.chunks_exact_mut(SCORE_ROWS);
            let mut at = offsets.chunks_exact(SCORE_ROWS);
            for (sc, at) in (&mut sc).zip(&mut at) {
                let mut acc = [V::zero(); SCORE_ROWS];
                for c in 0..chunks {
                    let qc = V::load(qp.add(c * V::N));
                    for (a, &row) in acc.iter_mut().zip(at) {
                        *a = V::fmadd(qc, V::load(k.add(row + c * V::N)), *a);
                    }
                }
                for (x, a) in sc.iter_mut().zip(acc) {
                    *x = a.sum() * s.scale;
                }
            }
            for (x, &row) in sc.into_remainder().iter_mut().zip(at.remainder()) {
                let mut acc = V::zero();
                for c in 0..chunks {
                    acc = V::fmadd(V::load(qp.add(c * V::N)), V::load(k.add(row + c * V::N)), acc);
                }
                *x = acc.sum() * s.scale;
            }
            cap_scores(scores, s.softcap);
            let stats = softmax_in_place(scores);
            let mut c0 = 0;
            while c0 < chunks {
                c0 += match chunks - c0 {
                    8.. => weighted::<V, 8>(v, offsets, scores, c0, o),
                    4.. => weighted::<V, 4>(v, offsets, scores, c0, o),
                    2.. => weighted::<V, 2>(v, offsets, scores, c0, o),
                    _ => weighted::<V, 1>(v, offsets, scores, c0, o),
                };
            }
            stats
        }
    }

    /// `o[c0·N .. (c0 + B)·N] = Σ_p scores[p] · V[p]` over those dims; returns B.
    ///
    /// # Safety
    /// As [`head`], with `(c0 + B)·N <= o.len()`.
    #[inline(always)]
    unsafe fn weighted<V: Lanes, const B: usize>(
        v: &[f32],
        offsets: &[usize],
        scores: &[f32],
        c0: usize,
        o: &mut [f32],
    ) -> usize {
        // SAFETY: the contract; every row holds (c0 + B)·N values and o as many.
        unsafe {
            let v = v.as_ptr().add(c0 * V::N);
            let mut acc = [V::zero(); B];
            for (&w, &row) in scores.iter().zip(offsets) {
                let (wv, r) = (V::splat(w), v.add(row));
                for (b, a) in acc.iter_mut().enumerate() {
                    *a = V::fmadd(wv, V::load(r.add(b * V::N)), *a);
                }
            }
            for (b, a) in acc.iter().enumerate() {
                a.store(o.as_mut_ptr().add((c0 + b) * V::N));
            }
        }
        B
    }

    /// [`head`] on AVX-512.
    ///
    /// # Safety
    /// As [`head`]: AVX-512F is available, `q.len()` is a multiple of 16.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn head16(
        q: &[f32],
        kv: (&[f32], &[f32]),
        offsets: &[usize],
        s: AttnShape,
        scores: &mut [f32],
        o: &mut [f32],
    ) -> (f32, f32) {
        // SAFETY: the caller's contract.
        unsafe { head::<__m512>(q, kv, offsets, s, scores, o) }
    }

    /// [`head`] on AVX2.
    ///
    /// # Safety
    /// As [`head`]: AVX2 and FMA are available, `q.len()` is a multiple of 8.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn head8(
        q: &[f32],
        kv: (&[f32], &[f32]),
        offsets: &[usize],
        s: AttnShape,
        scores: &mut [f32],
        o: &mut [f32],
    ) -> (f32, f32) {
        // SAFETY: the caller's contract.
        unsafe { head::<__m256>(q, kv, offsets, s, scores, o) }
    }

    /// [`softmax_in_place`] on AVX-512.
    ///
    /// # Safety
    /// AVX-512F is available.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn softmax16(scores: &mut [f32]) -> (f32, f32) {
        softmax_in_place(scores)
    }

    /// [`softmax_in_place`] on AVX2.
    ///
    /// # Safety
    /// AVX2 and FMA are available.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn softmax8(scores: &mut [f32]) -> (f32, f32) {
        softmax_in_place(scores)
    }

    /// [`head`] on NEON.
    ///
    /// # Safety
    /// As [`head`]: NEON is available, `q.len()` is a multiple of 4.
    #[cfg(target_arch = "aarch64")]
    #[target_feature(enable = "neon")]
    pub unsafe fn head4(
        q: &[f32],
        kv: (&[f32], &[f32]),
        offsets: &[usize],
        s: AttnShape,
        scores: &mut [f32],
        o: &mut [f32],
    ) -> (f32, f32) {
        // SAFETY: the caller's contract.
        unsafe { head::<float32x4_t>(q, kv, offsets, s, scores, o) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{CacheShape, KvDtype};

    /// Test values in [-1, 1).
    fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
        super::super::test_values(n, seed).into_iter().map(|x| x * 2.0).collect()
    }

    /// softmax(q·Kᵀ) · V in f64 over each token's visible positions, read through the table
    /// (the values the cache holds: an FP8 byte's value times the cache's scale).
    fn reference(q: &CpuTensor, cache: &CpuCache, s: AttnShape, meta: &AttnMetadata) -> Vec<f32> {
        let (hd, nh) = (s.head_dim, s.num_heads);
        let (group, width, bs) = (nh / s.num_kv_heads, s.num_kv_heads * hd, cache.shape.block_size);
        let value = |cells: &KvCells, at: usize| match cells {
            KvCells::F32(c) => c[at] as f64,
            KvCells::Fp8(c) => c.format.values()[c.bytes[at] as usize] as f64 * c.scale as f64,
        };
        let mut out = vec![0f32; q.rows * nh * hd];
        for t in 0..q.rows {
            let pos = meta.positions[t] as usize;
            let table = &meta.block_tables[meta.token_seq[t] as usize];
            for h in 0..nh {
                let qv = &q.data[(t * nh + h) * hd..][..hd];
                let at = |p: usize| (table[p / bs] as usize * bs + p % bs) * width + (h / group) * hd;
                let visible = s.first_visible(pos)..pos + 1;
                let scores: Vec<f64> = visible
                    .clone()
                    .map(|p| {
                        let d: f64 = (0..hd).map(|d| qv[d] as f64 * value(&cache.k, at(p) + d)).sum();
                        let d = d * s.scale as f64;
                        if s.softcap > 0.0 { s.softcap as f64 * (d / s.softcap as f64).tanh() } else { d }
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
                let sum: f64 = w.iter().sum();
                for d in 0..hd {
                    let o: f64 = visible.clone().zip(&w).map(|(p, w)| w * value(&cache.v, at(p) + d)).sum();
                    out[(t * nh + h) * hd + d] = (o / sum) as f32;
                }
            }
        }
        out
    }

    /// A step as chunked prefill and decoding make them: a prompt chunk after a cached
    /// prefix, a decode token, a whole prompt, a run too short to tile and a second decode
    /// token; tables that are not in order. Over an f32 cache and FP8 ones of scale 1 and
    /// of a checkpoint's kind of scales (whose references read the same rounded values).
    #[test]
    fn tiles_and_single_queries_match_the_reference() {
        let seqs = [(37, 100), (80, 1), (0, 150), (5, 7), (300, 1)];
        matches_the_reference(&seqs, &[0..100, 101..251], &[(0, 0.0), (50, 0.0), (0, 5.0), (70, 3.0)]);
    }

    /// Decode tokens of three sequences, two at long contexts: few (token, KV head) tasks
    /// for two threads, so each context is cut into parts (3, or 2 under a window of 600),
    /// joined by their softmax sums; the 2-position context leaves a part empty.
    #[test]
    fn long_contexts_cut_into_parts_match_the_reference() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let windows = [(0, 0.0), (600, 0.0), (0, 5.0), (2, 3.0)];
        pool.install(|| matches_the_reference(&[(1500, 1), (700, 1), (1, 1)], &[], &windows));
    }

    /// Attention over `seqs` (each a first position and a number of new tokens) against
    /// [`reference`], over an f32 cache and three FP8 ones, under every window and soft cap
    /// given and every family the CPU has; `runs` are the tokens expected in tiles.
    fn matches_the_reference(seqs: &[(u32, u32)], runs: &[std::ops::Range<usize>], shapes: &[(usize, f32)]) {
        let (bs, nkv, hd, nh) = (16usize, 2usize, 64usize, 6usize);
        let mut block_tables = Vec::new();
        let mut next = 0u32;
        let (mut positions, mut token_seq, mut slots) = (Vec::new(), Vec::new(), Vec::new());
        for (i, &(start, n)) in seqs.iter().enumerate() {
            let blocks = (start + n).div_ceil(bs as u32);
            // Every other sequence's table runs backwards, so that blocks are not in order.
            let mut table: Vec<u32> = (next..next + blocks).collect();
            if i % 2 == 1 {
                table.reverse();
            }
            next += blocks;
            for p in start..start + n {
                positions.push(p);
                token_seq.push(i as u32);
                slots.push((table[p as usize / bs] as usize * bs + p as usize % bs) as i64);
            }
            block_tables.push(table);
        }
        let rows = positions.len();
        let shape = CacheShape { num_blocks: next as usize, block_size: bs, num_kv_heads: nkv, head_dim: hd };
        let cells = shape.num_blocks * bs * nkv * hd;
        let (k, v) = (rand_vec(cells, 1), rand_vec(cells, 2));
        let f32_cache = CpuCache { shape, k: KvCells::F32(k.clone()), v: KvCells::F32(v.clone()) };
        // `x` written at `scale`, where it spans ±300 of e4m3's ±448 (at scale 1, ±1).
        let fp8_of = |dtype: KvDtype, x: &[f32], scale: f32| {
            let mut c = KvCells::new(dtype, x.len());
            if let KvCells::Fp8(c) = &mut c {
                c.set_scale(scale);
            }
            let spread = if scale == 1.0 { 1.0 } else { 300.0 * scale };
            c.write(0, &x.iter().map(|x| x * spread).collect::<Vec<_>>());
            c
        };
        let fp8 = |x: &[f32], scale: f32| fp8_of(KvDtype::Fp8E4m3, x, scale);
        let fp8_cache = CpuCache { shape, k: fp8(&k, 1.0), v: fp8(&v, 1.0) };
        let scaled = CpuCache { shape, k: fp8(&k, 0.0123), v: fp8(&v, 0.0041) };
        let e5m2 =
            CpuCache { shape, k: fp8_of(KvDtype::Fp8E5m2, &k, 1.0), v: fp8_of(KvDtype::Fp8E5m2, &v, 0.0041) };
        let q = CpuTensor::new(rand_vec(rows * nh * hd, 3), rows, nh * hd);
        let meta = AttnMetadata {
            positions,
            slot_mapping: slots,
            token_seq,
            block_tables,
            last_token_rows: Vec::new(),
            lora_slots: Vec::new(),
            prompt_lens: Vec::new(),
        };
        assert_eq!(tiled_runs(&meta), runs);
        let caches = [(&f32_cache, "f32"), (&fp8_cache, "fp8"), (&scaled, "scaled fp8"), (&e5m2, "e5m2")];
        for (cache, dtype) in caches {
            for &(window, softcap) in shapes {
                let s = AttnShape { window, softcap, ..AttnShape::causal(nh, nkv, hd) };
                let want = reference(&q, cache, s, &meta);
                for family in Family::all_supported() {
                    let got = attend(&q, cache, s, &meta, family);
                    let worst = got.data.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                    let what = format!("{dtype} {} window {window} cap {softcap}", family.name());
                    assert!(worst < 2e-6, "{what}: off by {worst}");
                }
            }
        }
        // The FP8 caches hold values other than the f32 one's: the test tells them apart.
        let s = AttnShape::causal(nh, nkv, hd);
        let a = reference(&q, &f32_cache, s, &meta);
        for c in [&fp8_cache, &scaled, &e5m2] {
            assert!(a.iter().zip(&reference(&q, c, s, &meta)).any(|(a, b)| (a - b).abs() > 1e-3));
        }
    }

    /// --calculate-kv-scales: the first rows written set the scales (max |k| / 200, max |v|
    /// / 100), padding rows (negative slots) not counted; later writes keep them.
    #[test]
    fn the_first_rows_written_set_calculated_scales() {
        let shape = CacheShape { num_blocks: 2, block_size: 4, num_kv_heads: 1, head_dim: 4 };
        let dev = super::super::CpuDevice::default();
        let mut cache = crate::kernels::Device::alloc_cache(&dev, shape, KvDtype::Fp8E4m3).unwrap();
        crate::kernels::Device::calculate_kv_scales(&dev, &mut cache).unwrap();
        let rows = |x: [f32; 12]| CpuTensor::new(x.to_vec(), 3, 4);
        let k = rows([1.0, -3.0, 0.5, 0.0, 2.0, 0.25, -1.0, 1.5, 900.0, 0.0, 0.0, 0.0]);
        let v = rows([0.5, 0.5, -2.5, 0.0, 1.0, 1.0, 1.0, 1.0, -900.0, 0.0, 0.0, 0.0]);
        write_kv(&mut cache, &k, &v, &[0, 5, -1]);
        let read = |c: &KvCells, at: usize| {
            let mut out = [0f32; 4];
            c.read(at, &mut out, Family::Portable);
            out
        };
        // -3 is the largest key: stored as -200 (midway between 192 and 208, to the even
        // byte's 192), read back as -192 · 3 / 200; -2.5 the largest value, as -100 (between
        // 96 and 104): -96 · 2.5 / 100.
        assert_eq!(read(&cache.k, 0)[1], -192.0 * (3.0f32 / 200.0));
        assert_eq!(read(&cache.v, 0)[2], -96.0 * (2.5f32 / 100.0));
        let (k2, v2) = (rows([7.0; 12]), rows([7.0; 12]));
        write_kv(&mut cache, &k2, &v2, &[1, 2, 3]);
        assert_eq!(
            read(&cache.k, 4)[0],
            448.0 * (3.0f32 / 200.0),
            "a later key of 7 saturates at the first scale"
        );
    }
}
