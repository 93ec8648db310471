//! Matmuls over weights kept in llama.cpp's block formats (`--keep-quantized`; the formats
//! are in [`crate::kernels::quant`]), multiplied as llama.cpp multiplies them: each input
//! row is quantized to 8 bits per block of 32 (an f32 scale, and the scaled sum of its
//! quants), a sub-block's 32 products are an integer dot product, and its scales are
//! applied once to that sum. Offsets (Q4_1's m, Q4_0's −8·d, Q5_0's −16·d, Q4_K's
//! −dmin·min) multiply the input block's sum instead of every element. Above
//! [`WIDEN_ROWS`] input rows (a prompt) the blocks are widened to f32 for the GEMM instead,
//! unless the family's multi-row kernels take the format ([`widens`]).
//!
//! Weights are held as the file's blocks pulled apart, not changed: the quants of a row
//! end to end, and the scales beside them (Q4_K's 6-bit ones unpacked to a byte each), so
//! that a block's quants load as one vector. x86 CPUs with AVX2 (every AVX-512 one
//! included) run `vpmaddubsw` dot products, 32 products an instruction, or VNNI's
//! `vpdpbusd` where the AVX-512 family has it; Arm CPUs run NEON's widening multiplies
//! (`smull`, 8 products an instruction, summed pairwise into 32-bit lanes); other CPUs run
//! the portable loops.

use half::f16;
use rayon::prelude::*;

use super::family::Family;
#[cfg(target_arch = "x86_64")]
use crate::kernels::quant::QK_K;
use crate::kernels::quant::{QK, QuantFormat, five_bits, q6_k_quarter, scale_min_k4};

/// A `[n, k]` weight in a block format.
pub struct QuantWeight {
    pub format: QuantFormat,
    pub n: usize,
    pub k: usize,
    /// Quants, a row's blocks end to end: 32 signed bytes a block for Q8_0, 16 bytes of
    /// nibble pairs (as in the file) for Q4_0 and Q4_1, 128 for a Q4_K super-block, and
    /// for a Q5_K one its 128 bytes of nibbles then its 32 of fifth bits (`qh`).
    qs: Vec<u8>,
    /// Each block's d, `[n, k / block_elems]`.
    d: Vec<f16>,
    /// Each block's m (Q4_1) or dmin (Q4_K).
    m: Vec<f16>,
    /// Q4_K and Q5_K: each super-block's 6-bit scales, then its mins, one byte each (16
    /// bytes for the file's 12); Q6_K: its 16 scales; Q5_0: each block's 32 fifth bits.
    sub: Vec<u8>,
}

impl QuantWeight {
    /// The weight stored as `n` rows of the file's blocks (`format.row_bytes(k)` bytes each).
    pub fn from_blocks(format: QuantFormat, bytes: &[u8], n: usize, k: usize) -> Self {
        assert!(k.is_multiple_of(QK) && bytes.len() == n * format.row_bytes(k), "{format} weight [{n}, {k}]");
        let blocks = n * k / format.block_elems();
        let two_scales = format.scale_offsets().len() == 2;
        let mut w = Self {
            format,
            n,
            k,
            qs: Vec::with_capacity(n * k / QK * Self::qbytes(format)),
            d: Vec::with_capacity(blocks),
            m: Vec::with_capacity(if two_scales { blocks } else { 0 }),
            sub: Vec::with_capacity(match format {
                QuantFormat::Q5_0 | QuantFormat::Q5_1 => blocks * 4,
                QuantFormat::Q4_K | QuantFormat::Q5_K | QuantFormat::Q6_K => blocks * 16,
                _ => 0,
            }),
        };
        let h = |blk: &[u8], o: usize| f16::from_le_bytes([blk[o], blk[o + 1]]);
        for blk in bytes.chunks_exact(format.block_bytes()) {
            w.d.push(h(blk, format.scale_offsets()[0]));
            if two_scales {
                w.m.push(h(blk, 2));
            }
            match format {
                QuantFormat::Q4_K | QuantFormat::Q5_K => {
                    let (sc, mn): (Vec<u8>, Vec<u8>) = (0..8).map(|j| scale_min_k4(j, &blk[4..16])).unzip();
                    w.sub.extend(sc.into_iter().chain(mn));
                    match format {
                        QuantFormat::Q4_K => w.qs.extend_from_slice(&blk[16..]),
                        _ => {
                            w.qs.extend_from_slice(&blk[48..]);
                            w.qs.extend_from_slice(&blk[16..48]);
                        }
                    }
                }
                QuantFormat::Q6_K => {
                    w.sub.extend_from_slice(&blk[192..208]);
                    w.qs.extend_from_slice(&blk[..192]);
                }
                QuantFormat::Q5_0 | QuantFormat::Q5_1 => {
                    let at = 2 * format.scale_offsets().len();
                    w.sub.extend_from_slice(&blk[at..at + 4]);
                    w.qs.extend_from_slice(&blk[at + 4..]);
                }
                _ => w.qs.extend_from_slice(&blk[2 * format.scale_offsets().len()..]),
            }
        }
        w
    }

    /// Quant bytes a sub-block of 32.
    fn qbytes(format: QuantFormat) -> usize {
        match format {
            QuantFormat::Q8_0 => 32,
            QuantFormat::Q6_K => 24,
            QuantFormat::Q4_0
            | QuantFormat::Q4_1
            | QuantFormat::Q5_0
            | QuantFormat::Q5_1
            | QuantFormat::Q4_K => 16,
            QuantFormat::Q5_K => 20,
        }
    }

    /// Sub-block `i`'s scales (of its elements 0..16 and 16..32) and offset:
    /// `w = scale·q + offset` with q from [`QuantWeight::sub_quants`].
    fn sub_scales(&self, i: usize) -> ([f32; 2], f32) {
        let (b, j) = (i / 8, i % 8);
        let one = |d: f32, offset: f32| ([d, d], offset);
        match self.format {
            QuantFormat::Q8_0 => one(self.d[i].to_f32(), 0.0),
            QuantFormat::Q4_0 => one(self.d[i].to_f32(), -8.0 * self.d[i].to_f32()),
            QuantFormat::Q4_1 => one(self.d[i].to_f32(), self.m[i].to_f32()),
            QuantFormat::Q5_0 => one(self.d[i].to_f32(), -16.0 * self.d[i].to_f32()),
            QuantFormat::Q5_1 => one(self.d[i].to_f32(), self.m[i].to_f32()),
            QuantFormat::Q4_K | QuantFormat::Q5_K => {
                let sub = &self.sub[b * 16..];
                one(self.d[b].to_f32() * sub[j] as f32, -self.m[b].to_f32() * sub[8 + j] as f32)
            }
            QuantFormat::Q6_K => {
                let (d, sub) = (self.d[b].to_f32(), &self.sub[b * 16 + 2 * j..]);
                ([d * (sub[0] as i8) as f32, d * (sub[1] as i8) as f32], 0.0)
            }
        }
    }

    /// Sub-block `i`'s 32 quants in element order, signed where the format's are (Q8_0's,
    /// and Q6_K's less 32).
    fn sub_quants(&self, i: usize) -> [i32; QK] {
        let qb = Self::qbytes(self.format);
        match self.format {
            QuantFormat::Q8_0 => std::array::from_fn(|l| (self.qs[i * 32 + l] as i8) as i32),
            QuantFormat::Q4_0 | QuantFormat::Q4_1 => {
                let qs = &self.qs[i * qb..(i + 1) * qb];
                std::array::from_fn(|l| if l < 16 { qs[l] & 0x0f } else { qs[l - 16] >> 4 } as i32)
            }
            QuantFormat::Q5_0 | QuantFormat::Q5_1 => {
                let mut q = [0; QK];
                for (q, v) in q.iter_mut().zip(five_bits(&self.qs[i * qb..(i + 1) * qb], self.fifth_bits(i)))
                {
                    *q = v as i32;
                }
                q
            }
            // Pairs of sub-blocks share 32 bytes: low nibbles the even one's.
            QuantFormat::Q4_K => {
                let qs = &self.qs[(i / 2) * 32..(i / 2 + 1) * 32];
                let shift = 4 * (i % 2);
                std::array::from_fn(|l| ((qs[l] >> shift) & 0x0f) as i32)
            }
            QuantFormat::Q5_K => {
                let (b, j) = (i / 8, i % 8);
                let blk = &self.qs[b * 160..(b + 1) * 160];
                let (qs, qh) = (&blk[(j / 2) * 32..(j / 2 + 1) * 32], &blk[128..]);
                let shift = 4 * (j % 2);
                std::array::from_fn(|l| (((qs[l] >> shift) & 0x0f) | (((qh[l] >> j) & 1) << 4)) as i32)
            }
            QuantFormat::Q6_K => {
                let (b, j) = (i / 8, i % 8);
                q6_k_quarter(&self.qs[b * 192..(b + 1) * 192], j).map(|q| q as i32 - 32)
            }
        }
    }

    /// Q5_0 block `i`'s fifth bits (bit j for element j).
    fn fifth_bits(&self, i: usize) -> u32 {
        let b = &self.sub[4 * i..4 * i + 4];
        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }

    /// Bytes a matmul reads: the file's bytes.
    pub fn bytes(&self) -> usize {
        self.n * self.format.row_bytes(self.k)
    }

    /// Row `r` dequantized (an embedding lookup in a tied table).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        let nb = self.k / QK;
        for (b, o) in out[..self.k].chunks_exact_mut(QK).enumerate() {
            let i = r * nb + b;
            let (scale, offset) = self.sub_scales(i);
            for (l, (o, q)) in o.iter_mut().zip(self.sub_quants(i)).enumerate() {
                *o = scale[l / 16] * q as f32 + offset;
            }
        }
    }
}

/// Input rows quantized to 8 bits a block (llama.cpp's Q8_1 with an f32 scale): row `i`'s
/// quants at `q[i·k..]`, and per block its scale d and d·Σq.
struct QuantRows {
    k: usize,
    q: Vec<i8>,
    /// The same quants with each pair of blocks (2p, 2p + 1) as the nibbles of a Q4 pair
    /// split: the first 16 of each block, then the last 16 of each (an odd last block as
    /// it is). 32 bytes of Q4 quants widen to two such halves with one shift. Empty for the
    /// formats that do not read it.
    pairs: Vec<i8>,
    d: Vec<f32>,
    s: Vec<f32>,
    /// With `pairs`, each row's block scales in the lanes where [`groups`]' integer sums
    /// land, 16 floats a group: d by lane, then Σ-scaled s in one lane a block (0 in the
    /// other lanes). For the multi-row kernels, which then multiply without permutes.
    lanes: Vec<f32>,
}

/// The groups of a row of `nb` blocks that the pair kernels take: quads (4 blocks: their
/// sums land in lanes `[b, b, b+2, b+2, b+1, b+1, b+3, b+3]`), then a pair if two blocks
/// are left (`[b; 4], [b+1; 4]`); an odd last block is not in a group.
fn groups(nb: usize) -> usize {
    nb / 4 + usize::from(nb % 4 >= 2)
}

/// Which block of a group each lane's sum belongs to, and whether the lane carries the
/// block's offset (one lane a block).
const QUAD_LANES: [(usize, bool); 8] =
    [(0, true), (0, false), (2, true), (2, false), (1, true), (1, false), (3, true), (3, false)];
const PAIR_LANES: [(usize, bool); 8] =
    [(0, true), (0, false), (0, false), (0, false), (1, true), (1, false), (1, false), (1, false)];

/// `x`'s rows rounded to 8 bits a block; with `pairs`, also laid out for Q4 pairs, and
/// with `lanes` their scales for the multi-row kernels.
fn quantize_rows(x: &[f32], m: usize, k: usize, pairs: bool, lanes: bool) -> QuantRows {
    let nb = k / QK;
    let ng = if pairs && lanes { groups(nb) } else { 0 };
    let mut rows = QuantRows {
        k,
        q: vec![0; m * k],
        pairs: vec![0; if pairs { m * k } else { 0 }],
        d: vec![0.0; m * nb],
        s: vec![0.0; m * nb],
        lanes: vec![0.0; m * ng * 16],
    };
    // A prompt's rows are worth the pool's threads; a decode step's few rows (a few
    // microseconds of work) stay on the calling thread, in one piece.
    let min_len = if m > WIDEN_ROWS { 1 } else { m.max(1) };
    x[..m * k]
        .par_chunks_exact(k)
        .zip(rows.q.par_chunks_exact_mut(k))
        .zip(rows.d.par_chunks_exact_mut(nb))
        .zip(rows.s.par_chunks_exact_mut(nb))
        .with_min_len(min_len)
        .for_each(|(((x, q), d), s)| quantize_row(x, q, d, s));
    if pairs {
        rows.pairs
            .par_chunks_exact_mut(k)
            .zip(rows.q.par_chunks_exact(k))
            .with_min_len(min_len)
            .for_each(|(p, q)| pair_row(q, p));
    }
    if ng > 0 {
        rows.lanes
            .par_chunks_exact_mut(ng * 16)
            .zip(rows.d.par_chunks_exact(nb).zip(rows.s.par_chunks_exact(nb)))
            .with_min_len(min_len)
            .for_each(|(l, (d, s))| lane_row(d, s, l));
    }
    rows
}

/// One row's blocks rounded to 8 bits: quants, scales d and d·Σq.
fn quantize_row(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32]) {
    let blocks = q.chunks_exact_mut(QK).zip(d).zip(s);
    for (((q, d), s), x) in blocks.zip(x.chunks_exact(QK)) {
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        *d = amax / 127.0;
        let inv = if amax == 0.0 { 0.0 } else { 127.0 / amax };
        let mut sum = 0i32;
        for (q, &v) in q.iter_mut().zip(x) {
            // Half away from zero, as `round` (without its libm call).
            let r = v * inv;
            *q = (r + if r >= 0.0 { 0.5 } else { -0.5 }) as i8;
            sum += *q as i32;
        }
        *s = *d * sum as f32;
    }
}

/// One row's quants laid out for Q4 pairs (`QuantRows::pairs`).
fn pair_row(q: &[i8], pairs: &mut [i8]) {
    pairs.copy_from_slice(q);
    for (p, q) in pairs.chunks_exact_mut(2 * QK).zip(q.chunks_exact(2 * QK)) {
        p[..16].copy_from_slice(&q[..16]);
        p[16..32].copy_from_slice(&q[32..48]);
        p[32..48].copy_from_slice(&q[16..32]);
        p[48..].copy_from_slice(&q[48..]);
    }
}

/// One row's scales in the pair kernels' lanes (`QuantRows::lanes`).
fn lane_row(d: &[f32], s: &[f32], lanes: &mut [f32]) {
    let nb = d.len();
    for (g, out) in lanes.chunks_exact_mut(16).enumerate() {
        let (b, lanes) = (4 * g, if g < nb / 4 { &QUAD_LANES } else { &PAIR_LANES });
        for (l, &(i, first)) in lanes.iter().enumerate() {
            out[l] = d[b + i];
            out[8 + l] = if first { s[b + i] } else { 0.0 };
        }
    }
}

/// How far ahead of a weight row's loads the SIMD dot products ask for its bytes. One
/// thread streaming a matrix reads about half the copy bandwidth, held by how many cache
/// misses a core has in flight; 4 KB ahead (a few tiles: rows are end to end) the loads
/// find their lines in cache. On the default model's Q4_1 file the matmuls of a decode
/// step took 9.2–10.4 ms without it, 6.2–6.7 ms with it (two threads, AVX2).
#[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
const PREFETCH_BYTES: usize = 4096;

/// The dot products of weight rows `j0..j0 + NR` with `MR` input rows: `[NR][MR]`.
type DotFn<const NR: usize, const MR: usize> =
    unsafe fn(&QuantWeight, usize, &QuantRows, [usize; MR]) -> [[f32; MR]; NR];

/// The dot products of weight rows `j0..j1` with `MR` input rows, written to
/// `out[row · n + j]`.
type RowsFn<const MR: usize> =
    unsafe fn(&QuantWeight, (usize, usize), &QuantRows, [usize; MR], (*mut f32, usize));

/// The portable dot products: exact integer sums a block, scaled as the SIMD ones are.
fn dot_portable<const NR: usize, const MR: usize>(
    w: &QuantWeight,
    j0: usize,
    x: &QuantRows,
    rows: [usize; MR],
) -> [[f32; MR]; NR] {
    std::array::from_fn(|r| rows.map(|row| dot_row(w, j0 + r, x, row)))
}

fn dot_row(w: &QuantWeight, j: usize, x: &QuantRows, r: usize) -> f32 {
    let nb = w.k / QK;
    let mut out = 0f32;
    for b in 0..nb {
        let (scale, offset) = w.sub_scales(j * nb + b);
        let q = w.sub_quants(j * nb + b);
        let xq = &x.q[r * x.k + b * QK..r * x.k + (b + 1) * QK];
        let half = |h: usize| -> i32 { (16 * h..16 * h + 16).map(|l| q[l] * xq[l] as i32).sum() };
        let isum = scale[0] * half(0) as f32 + scale[1] * half(1) as f32;
        out += x.d[r * nb + b] * isum + offset * x.s[r * nb + b];
    }
    out
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{QK, QK_K, QuantFormat, QuantRows, QuantWeight};

    /// `[e(0), .., e(N - 1)]` for an expression of `i`, written out in the caller's body.
    /// Not `std::array::from_fn`: a closure is a function of its own, without the target
    /// features of `dot` and `dot_vnni` (the helpers below have none; they are inlined), so
    /// the intrinsics in it stay calls wherever LLVM leaves the closure out of line, as it
    /// did for the Q8_0 LM head, halving the batch-1 decode rate.
    macro_rules! each {
        ($n:expr, |$i:ident| $e:expr) => {{
            // SAFETY: the elements are SIMD vectors, floats or arrays of them, of which all
            // zeros is a value; every one is written below.
            #[allow(unused_unsafe)]
            let mut out: [_; $n] = unsafe { std::mem::zeroed() };
            for $i in 0..$n {
                out[$i] = $e;
            }
            out
        }};
    }

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        // SAFETY: AVX is there (the callers' target features).
        unsafe {
            let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let p = _mm_add_ps(h, _mm_movehl_ps(h, h));
            _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)))
        }
    }

    /// An f16 widened by F16C.
    #[inline(always)]
    unsafe fn h2f(h: half::f16) -> f32 {
        // SAFETY: F16C is there (the callers' target features).
        unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h.to_bits() as i32))) }
    }

    /// Eight f16 values widened.
    #[inline(always)]
    unsafe fn load_h8(p: *const half::f16) -> __m256 {
        // SAFETY: 8 readable values; F16C is there (the callers' target features).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }

    /// Block `b` of a weight row as 32 unsigned bytes for `vpmaddubsw` (Q4's nibbles; Q8_0's
    /// magnitudes, its signs then moved onto the inputs by [`block_dot`]), and the raw
    /// quants (Q8_0's signs).
    #[inline(always)]
    unsafe fn weight_block(w: &QuantWeight, qs: *const u8, b: usize, row_block: usize) -> (__m256i, __m256i) {
        let f = w.format;
        // SAFETY: the block is inside the row (the callers' contract); AVX2 is there.
        unsafe {
            match f {
                QuantFormat::Q8_0 => {
                    let w = _mm256_loadu_si256(qs.add(b * 32).cast());
                    (_mm256_sign_epi8(w, w), w)
                }
                // Q4_0, Q4_1, Q5_0 and Q5_1 (the K-quants go through `dot_q4k` and `dot_q6k`).
                _ => {
                    // The 16 bytes in both halves; the high half shifted down a nibble.
                    let raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(qs.add(b * 16).cast()));
                    let shifted = _mm256_srlv_epi32(raw, _mm256_set_epi32(4, 4, 4, 4, 0, 0, 0, 0));
                    let mut q = _mm256_and_si256(shifted, _mm256_set1_epi8(0x0f));
                    if matches!(f, QuantFormat::Q5_0 | QuantFormat::Q5_1) {
                        q = _mm256_or_si256(q, fifth_bits(w.fifth_bits(row_block)));
                    }
                    (q, q)
                }
            }
        }
    }

    /// 32 bytes of nibble pairs as their low nibbles and their high nibbles, 32 bytes each.
    #[inline(always)]
    unsafe fn nibbles(v: __m256i) -> (__m256i, __m256i) {
        // SAFETY: AVX2 is there (the callers' target features).
        unsafe {
            let low = _mm256_set1_epi8(0x0f);
            (_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16(v, 4), low))
        }
    }

    /// Q5_0's or Q5_1's fifth bits of `blocks` (2 or 4) blocks from `rb` put above the
    /// nibbles of their pairs (`[lo0, hi0, lo1, hi1]`, as [`nibbles`] splits two 32-byte
    /// loads): a pair's first 16 bits go with the low nibbles, the last 16 with the high ones.
    #[inline(always)]
    unsafe fn with_fifth_bits(w: &QuantWeight, rb: usize, blocks: usize, q: [__m256i; 4]) -> [__m256i; 4] {
        let bits: [u32; 4] = std::array::from_fn(|i| if i < blocks { w.fifth_bits(rb + i) } else { 0 });
        let split = |a: u32, c: u32| [(a & 0xffff) | (c << 16), (a >> 16) | (c & 0xffff_0000)];
        let ([l0, h0], [l1, h1]) = (split(bits[0], bits[1]), split(bits[2], bits[3]));
        // SAFETY: AVX2 is there (the callers' target features).
        unsafe {
            [
                _mm256_or_si256(q[0], fifth_bits(l0)),
                _mm256_or_si256(q[1], fifth_bits(h0)),
                _mm256_or_si256(q[2], fifth_bits(l1)),
                _mm256_or_si256(q[3], fifth_bits(h1)),
            ]
        }
    }

    /// 32 bits as 32 bytes: 0x10 where the bit is set (Q5_0's fifth bits, in place).
    #[inline(always)]
    unsafe fn fifth_bits(bits: u32) -> __m256i {
        // SAFETY: AVX2 is there (the callers' target features).
        unsafe {
            // Byte i takes byte i / 8 of the bits, then keeps bit i % 8 alone unset.
            let v = _mm256_shuffle_epi8(
                _mm256_set1_epi32(bits as i32),
                _mm256_setr_epi8(
                    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
                    3, 3,
                ),
            );
            let v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe));
            _mm256_and_si256(_mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10))
        }
    }

    /// One block's integer dot product, 8 lanes of partial sums: `vpdpbusd` with VNNI,
    /// else `vpmaddubsw` then `vpmaddwd`.
    #[inline(always)]
    unsafe fn block_dot<const VNNI: bool>(f: QuantFormat, wu: __m256i, w: __m256i, x: __m256i) -> __m256i {
        // SAFETY: AVX2 is there, and AVX512-VNNI/VL where VNNI (the callers' target features).
        unsafe {
            let x = match f {
                QuantFormat::Q8_0 | QuantFormat::Q6_K => _mm256_sign_epi8(x, w),
                _ => x,
            };
            if VNNI {
                _mm256_dpbusd_epi32(_mm256_setzero_si256(), wu, x)
            } else {
                _mm256_madd_epi16(_mm256_maddubs_epi16(wu, x), _mm256_set1_epi16(1))
            }
        }
    }

    /// Four consecutive blocks' integer dot products folded into one vector: block t's
    /// partial sums in lanes t and 4 + t (halves of 16 elements, for Q6_K's two scales).
    #[inline(always)]
    unsafe fn fold4<const VNNI: bool>(
        f: QuantFormat,
        wu: [__m256i; 4],
        wq: [__m256i; 4],
        x: *const i8,
    ) -> __m256i {
        // SAFETY: x holds four blocks (the callers' contract); AVX2 (and VNNI where VNNI)
        // are the callers' target features.
        unsafe {
            let p: [__m256i; 4] =
                each!(4, |t| block_dot::<VNNI>(f, wu[t], wq[t], _mm256_loadu_si256(x.add(t * QK).cast())));
            _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]))
        }
    }

    /// Two blocks' integer dot products from their nibbles split into halves (see
    /// `QuantRows::pairs`): block 2p's partial sums in lanes 0..4, 2p + 1's in 4..8.
    #[inline(always)]
    unsafe fn pair_dot<const VNNI: bool>(lo: __m256i, xlo: __m256i, hi: __m256i, xhi: __m256i) -> __m256i {
        // SAFETY: AVX2 is there, and AVX512-VNNI/VL where VNNI (the callers' target features).
        unsafe {
            if VNNI {
                _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xlo), hi, xhi)
            } else {
                let ones = _mm256_set1_epi16(1);
                _mm256_add_epi32(
                    _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xlo), ones),
                    _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xhi), ones),
                )
            }
        }
    }

    /// The dot products of weight rows `j0..j0 + NR` with input rows `rows`: `[NR][MR]`.
    /// Blocks go four at a time: their four integer sums are folded into the lanes of one
    /// vector (block i in lanes i and 4 + i), converted once and scaled by the four blocks'
    /// scale products in one FMA. The offsets (Q4_1's m, Q4_0's −8·d) meet the inputs'
    /// block sums in a second pass.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot<const NR: usize, const MR: usize>(
        w: &QuantWeight,
        j0: usize,
        x: &QuantRows,
        rows: [usize; MR],
    ) -> [[f32; MR]; NR] {
        // SAFETY: the caller's contract.
        unsafe { dot_body::<NR, MR, false>(w, j0, x, rows) }
    }

    /// [`dot`] with AVX512-VNNI's one-instruction dot products (on 256-bit vectors).
    ///
    /// # Safety
    /// The CPU has AVX2, FMA, F16C, AVX512-VNNI and AVX512-VL.
    #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
    pub unsafe fn dot_vnni<const NR: usize, const MR: usize>(
        w: &QuantWeight,
        j0: usize,
        x: &QuantRows,
        rows: [usize; MR],
    ) -> [[f32; MR]; NR] {
        // SAFETY: the caller's contract.
        unsafe { dot_body::<NR, MR, true>(w, j0, x, rows) }
    }

    /// Asks for the cache lines of `bytes` bytes at `PREFETCH_BYTES` past `p` (a hint: an
    /// address past the weight's end is not read).
    #[inline(always)]
    unsafe fn prefetch_ahead(p: *const u8, bytes: usize) {
        for line in (0..bytes).step_by(64) {
            // SAFETY: a prefetch reads nothing the program sees, wherever it points.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(super::PREFETCH_BYTES + line).cast()) }
        }
    }

    #[inline(always)]
    unsafe fn dot_body<const NR: usize, const MR: usize, const VNNI: bool>(
        w: &QuantWeight,
        j0: usize,
        x: &QuantRows,
        rows: [usize; MR],
    ) -> [[f32; MR]; NR] {
        let (nb, qb, f) = (w.k / QK, QuantWeight::qbytes(w.format), w.format);
        assert!(j0 + NR <= w.n && x.k == w.k && rows.iter().all(|&r| (r + 1) * x.k <= x.q.len()));
        // SAFETY: every block, scale and sum read is of rows j0..j0 + NR of w and rows
        // `rows` of x (asserted above); the instructions are the target features.
        unsafe {
            match f {
                QuantFormat::Q4_K | QuantFormat::Q5_K => return dot_q4k::<NR, MR, VNNI>(w, j0, x, rows),
                QuantFormat::Q6_K => return dot_q6k::<NR, MR, VNNI>(w, j0, x, rows),
                _ => {}
            }
            let mut acc = [[_mm256_setzero_ps(); MR]; NR];
            let qs: [*const u8; NR] = std::array::from_fn(|r| w.qs.as_ptr().add((j0 + r) * nb * qb));
            let wd: [*const half::f16; NR] = std::array::from_fn(|r| w.d.as_ptr().add((j0 + r) * nb));
            let xq: [*const i8; MR] = std::array::from_fn(|c| x.q.as_ptr().add(rows[c] * x.k));
            let xd: [*const f32; MR] = std::array::from_fn(|c| x.d.as_ptr().add(rows[c] * nb));
            let quads = nb / 4;
            if f != QuantFormat::Q8_0 && quads > 0 {
                assert!(rows.iter().all(|&r| (r + 1) * x.k <= x.pairs.len()), "inputs laid out in pairs");
            }
            for g in (0..quads).filter(|_| f != QuantFormat::Q8_0) {
                let b = g * 4;
                let xp: [*const i8; MR] = std::array::from_fn(|c| x.pairs.as_ptr().add(rows[c] * x.k));
                // Two pairs of blocks: their x halves, and their scale products in the
                // lanes the sums land in (below).
                let xv: [[__m256i; 4]; MR] =
                    each!(MR, |c| each!(4, |i| _mm256_loadu_si256(xp[c].add(b * QK + i * 32).cast())));
                let dx: [__m128; MR] = each!(MR, |c| _mm_loadu_ps(xd[c].add(b)));
                let lanes = _mm256_setr_epi32(0, 0, 2, 2, 1, 1, 3, 3);
                for r in 0..NR {
                    prefetch_ahead(qs[r].wrapping_add(b * 16), 64);
                    let (mut lo0, mut hi0) = nibbles(_mm256_loadu_si256(qs[r].add(b * 16).cast()));
                    let (mut lo1, mut hi1) = nibbles(_mm256_loadu_si256(qs[r].add(b * 16 + 32).cast()));
                    if matches!(f, QuantFormat::Q5_0 | QuantFormat::Q5_1) {
                        [lo0, hi0, lo1, hi1] = with_fifth_bits(w, (j0 + r) * nb + b, 4, [lo0, hi0, lo1, hi1]);
                    }
                    let dw = _mm_cvtph_ps(_mm_loadl_epi64(wd[r].add(b).cast()));
                    for c in 0..MR {
                        // Lanes 0..4 hold block b's partial sums and 4..8 block b + 1's; after
                        // the add of pairs, [b, b, b+2, b+2 | b+1, b+1, b+3, b+3].
                        let s0 = pair_dot::<VNNI>(lo0, xv[c][0], hi0, xv[c][1]);
                        let s1 = pair_dot::<VNNI>(lo1, xv[c][2], hi1, xv[c][3]);
                        let sums = _mm256_hadd_epi32(s0, s1);
                        let scale =
                            _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_mul_ps(dw, dx[c])), lanes);
                        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[r][c]);
                    }
                }
            }
            for g in (0..quads).filter(|_| f == QuantFormat::Q8_0) {
                let b = g * 4;
                let dx: [__m128; MR] = each!(MR, |c| _mm_loadu_ps(xd[c].add(b)));
                for r in 0..NR {
                    prefetch_ahead(qs[r].wrapping_add(b * 32), 128);
                    let wb: [(__m256i, __m256i); 4] =
                        each!(4, |i| weight_block(w, qs[r], b + i, (j0 + r) * nb + b + i));
                    let (wu, wq) = (each!(4, |i| wb[i].0), each!(4, |i| wb[i].1));
                    let dw = _mm_cvtph_ps(_mm_loadl_epi64(wd[r].add(b).cast()));
                    for c in 0..MR {
                        let sums = fold4::<VNNI>(f, wu, wq, xq[c].add(b * QK));
                        let s = _mm_mul_ps(dw, dx[c]);
                        let scale = _mm256_set_m128(s, s);
                        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[r][c]);
                    }
                }
            }
            // A pair of blocks left over (576 features: 18 blocks, most of the default model's
            // matrices) takes one 32-byte load as in the loop above, not two single blocks.
            let mut single = quads * 4;
            if matches!(f, QuantFormat::Q4_0 | QuantFormat::Q4_1) && nb - single >= 2 {
                let b = single;
                let xp: [*const i8; MR] = std::array::from_fn(|c| x.pairs.as_ptr().add(rows[c] * x.k));
                let xv: [[__m256i; 2]; MR] =
                    each!(MR, |c| each!(2, |i| _mm256_loadu_si256(xp[c].add(b * QK + i * 32).cast())));
                let dx: [__m128; MR] = each!(MR, |c| _mm_castpd_ps(_mm_load_sd(xd[c].add(b).cast())));
                let lanes = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
                for r in 0..NR {
                    let (lo, hi) = nibbles(_mm256_loadu_si256(qs[r].add(b * 16).cast()));
                    let dw = _mm_cvtph_ps(_mm_cvtsi32_si128(wd[r].add(b).cast::<i32>().read_unaligned()));
                    for c in 0..MR {
                        // Lanes 0..4 hold block b's partial sums, 4..8 block b + 1's.
                        let sums = pair_dot::<VNNI>(lo, xv[c][0], hi, xv[c][1]);
                        let scale =
                            _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_mul_ps(dw, dx[c])), lanes);
                        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[r][c]);
                    }
                }
                single += 2;
            }
            // Q8_0's pair: two blocks' sums folded into one vector, block b's in lanes
            // 0, 1, 4, 5 and b + 1's in 2, 3, 6, 7.
            if f == QuantFormat::Q8_0 && nb - single >= 2 {
                let b = single;
                let dx: [__m128; MR] = each!(MR, |c| _mm_castpd_ps(_mm_load_sd(xd[c].add(b).cast())));
                let lanes = _mm256_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1);
                for r in 0..NR {
                    let wb: [(__m256i, __m256i); 2] =
                        each!(2, |i| weight_block(w, qs[r], b + i, (j0 + r) * nb + b + i));
                    let dw = _mm_cvtph_ps(_mm_cvtsi32_si128(wd[r].add(b).cast::<i32>().read_unaligned()));
                    for c in 0..MR {
                        let p: [__m256i; 2] = each!(2, |i| {
                            let xv = _mm256_loadu_si256(xq[c].add((b + i) * QK).cast());
                            block_dot::<VNNI>(f, wb[i].0, wb[i].1, xv)
                        });
                        let sums = _mm256_hadd_epi32(p[0], p[1]);
                        let scale =
                            _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_mul_ps(dw, dx[c])), lanes);
                        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[r][c]);
                    }
                }
                single += 2;
            }
            for b in single..nb {
                for r in 0..NR {
                    let (wu, wq) = weight_block(w, qs[r], b, (j0 + r) * nb + b);
                    let dw = (*wd[r].add(b)).to_f32();
                    for c in 0..MR {
                        let xv = _mm256_loadu_si256(xq[c].add(b * QK).cast());
                        let p = _mm256_cvtepi32_ps(block_dot::<VNNI>(f, wu, wq, xv));
                        acc[r][c] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * *xd[c].add(b)), acc[r][c]);
                    }
                }
            }
            let mut out = [[0f32; MR]; NR];
            for r in 0..NR {
                for c in 0..MR {
                    out[r][c] = hsum(acc[r][c]) + offset(w, j0 + r, x, rows[c]);
                }
            }
            out
        }
    }

    /// The dot products of weight rows `j0..j1` with `MR` input rows (a step of several
    /// sequences) over Q4_0, Q4_1, Q5_0 and Q5_1, into `out[row · n + j]`. A row's blocks
    /// are unpacked once a group for every input row, and each group's integer sums are
    /// scaled by lanes precomputed on both sides (`QuantRows::lanes`; the weight's d and
    /// offsets permuted once a group): two FMAs an input row and group, no permute, and no
    /// pass of its own for the offsets. (`dot_body`'s two-by-four tiles kept 16 input
    /// vectors and eight accumulators in 16 registers, and spilled.) The loop over the
    /// weight rows is inside, since a call a row would spend on its setup about what 576
    /// features spend on their blocks. Without VNNI, a quad's products are summed in 16
    /// bits first (below).
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C (and AVX512-VNNI and AVX512-VL where VNNI); `out`
    /// holds `rows` rows of `n`, and only this call writes their columns `j0..j1`.
    #[inline(always)]
    unsafe fn rows_body<const MR: usize, const VNNI: bool>(
        w: &QuantWeight,
        (j0, j1): (usize, usize),
        x: &QuantRows,
        rows: [usize; MR],
        (out, n): (*mut f32, usize),
    ) {
        let (nb, f) = (w.k / QK, w.format);
        let ng = super::groups(nb);
        let q5 = matches!(f, QuantFormat::Q5_0 | QuantFormat::Q5_1);
        assert!(
            matches!(f, QuantFormat::Q4_0 | QuantFormat::Q4_1) | q5
                && j1 <= w.n
                && x.k == w.k
                && rows.iter().all(|&r| (r + 1) * x.k <= x.pairs.len() && (r + 1) * ng * 16 <= x.lanes.len())
        );
        // SAFETY: every block, scale and lane read is of rows j0..j1 of w and rows `rows` of
        // x (asserted above); the instructions are the target features; the writes are the
        // caller's contract.
        let factor = if f == QuantFormat::Q5_0 { -16.0 } else { -8.0 };
        let xp: [*const i8; MR] = std::array::from_fn(|c| x.pairs[rows[c] * x.k..].as_ptr());
        let xl: [*const f32; MR] = std::array::from_fn(|c| x.lanes[rows[c] * ng * 16..].as_ptr());
        for j in j0..j1 {
            unsafe {
                let qs = w.qs.as_ptr().add(j * nb * 16);
                let wd = w.d.as_ptr().add(j * nb);
                // Q4_1's and Q5_1's offsets are their m; Q4_0's and Q5_0's a multiple of d.
                let wm = (!w.m.is_empty()).then(|| w.m.as_ptr().add(j * nb));
                let mut acc = [_mm256_setzero_ps(); MR];
                for g in 0..ng {
                    let (b, pair) = (4 * g, g == nb / 4);
                    prefetch_ahead(qs.wrapping_add(b * 16), 64);
                    let (mut lo0, mut hi0) = nibbles(_mm256_loadu_si256(qs.add(b * 16).cast()));
                    let (mut lo1, mut hi1) = if pair {
                        (lo0, hi0)
                    } else {
                        nibbles(_mm256_loadu_si256(qs.add(b * 16 + 32).cast()))
                    };
                    if q5 {
                        let blocks = if pair { 2 } else { 4 };
                        [lo0, hi0, lo1, hi1] = with_fifth_bits(w, j * nb + b, blocks, [lo0, hi0, lo1, hi1]);
                    }
                    let dw = group_scales(wd.add(b), pair);
                    let off = match wm {
                        Some(m) => group_scales(m.add(b), pair),
                        None => _mm256_mul_ps(dw, _mm256_set1_ps(factor)),
                    };
                    for c in 0..MR {
                        let xv: *const __m256i = xp[c].add(b * QK).cast();
                        let x = |i: usize| _mm256_loadu_si256(xv.add(i));
                        let sums = if VNNI {
                            let s0 = pair_dot::<VNNI>(lo0, x(0), hi0, x(1));
                            if pair {
                                s0
                            } else {
                                _mm256_hadd_epi32(s0, pair_dot::<VNNI>(lo1, x(2), hi1, x(3)))
                            }
                        } else {
                            // Products of nibbles (31 at most with a fifth bit) and inputs
                            // (|q| ≤ 127) summed over eight bytes stay in 16 bits: 31496 at
                            // most, so one vpmaddwd a group where pair_dot takes two a pair.
                            let p = |lo, x0, hi, x1| {
                                _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1))
                            };
                            let p0 = p(lo0, x(0), hi0, x(1));
                            let p = if pair { p0 } else { _mm256_hadd_epi16(p0, p(lo1, x(2), hi1, x(3))) };
                            _mm256_madd_epi16(p, _mm256_set1_epi16(1))
                        };
                        let l = xl[c].add(g * 16);
                        acc[c] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(sums),
                            _mm256_mul_ps(dw, _mm256_loadu_ps(l)),
                            acc[c],
                        );
                        acc[c] = _mm256_fmadd_ps(off, _mm256_loadu_ps(l.add(8)), acc[c]);
                    }
                }
                // An odd last block, in the inputs' own order.
                let mut tail = [0f32; MR];
                if nb % 2 == 1 {
                    let b = nb - 1;
                    let (wq, _) = weight_block(w, qs, b, j * nb + b);
                    let dw = h2f(*wd.add(b));
                    let off = match wm {
                        Some(m) => h2f(*m.add(b)),
                        None => factor * dw,
                    };
                    for c in 0..MR {
                        let at = rows[c] * nb + b;
                        let xv = _mm256_loadu_si256(x.q.as_ptr().add(rows[c] * x.k + b * QK).cast());
                        let p = _mm256_cvtepi32_ps(block_dot::<VNNI>(f, wq, wq, xv));
                        acc[c] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * x.d[at]), acc[c]);
                        tail[c] = off * x.s[at];
                    }
                }
                for c in 0..MR {
                    *out.add(rows[c] * n + j) = hsum(acc[c]) + tail[c];
                }
            }
        }
    }

    /// A group's four (or a pair's two) f16 scales at `p`, in the lanes its sums land in.
    #[inline(always)]
    unsafe fn group_scales(p: *const half::f16, pair: bool) -> __m256 {
        // SAFETY: the group's scales are readable; F16C and AVX2 are there (the callers'
        // target features).
        unsafe {
            if pair {
                let v =
                    _mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(p.cast::<i32>().read_unaligned())));
                _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1))
            } else {
                let v = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64(p.cast())));
                _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 0, 2, 2, 1, 1, 3, 3))
            }
        }
    }

    /// [`rows_body`] under AVX2.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn rows<const MR: usize>(
        w: &QuantWeight,
        j: (usize, usize),
        x: &QuantRows,
        r: [usize; MR],
        out: (*mut f32, usize),
    ) {
        // SAFETY: the caller's contract.
        unsafe { rows_body::<MR, false>(w, j, x, r, out) }
    }

    /// [`rows_body`] with VNNI's dot products.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA, F16C, AVX512-VNNI and AVX512-VL.
    #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
    pub unsafe fn rows_vnni<const MR: usize>(
        w: &QuantWeight,
        j: (usize, usize),
        x: &QuantRows,
        r: [usize; MR],
        out: (*mut f32, usize),
    ) {
        // SAFETY: the caller's contract.
        unsafe { rows_body::<MR, true>(w, j, x, r, out) }
    }

    /// [`dot`] over Q4_K super-blocks: a 32-byte load holds two sub-blocks (low nibbles,
    /// high nibbles) in the inputs' own order; four sub-blocks' sums fold into one vector as
    /// in `dot_body`, scaled by d times their 6-bit scales; the mins (dmin times 6-bit
    /// mins) meet the inputs' block sums eight at a time. Q5_K's fifth bits (bit s of its
    /// 32 `qh` bytes for sub-block s) are put above the nibbles first.
    ///
    /// # Safety
    /// As `dot_body`'s, whose assertions it runs under.
    #[inline(always)]
    unsafe fn dot_q4k<const NR: usize, const MR: usize, const VNNI: bool>(
        w: &QuantWeight,
        j0: usize,
        x: &QuantRows,
        rows: [usize; MR],
    ) -> [[f32; MR]; NR] {
        let (nsb, nb) = (w.k / QK_K, w.k / QK);
        let five = w.format == QuantFormat::Q5_K;
        let stride = if five { 160 } else { 128 };
        // SAFETY: the caller asserted that the rows exist; every read is inside them.
        unsafe {
            let (low, one) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(1));
            let mut acc = [[_mm256_setzero_ps(); MR]; NR];
            let mut mins = [[_mm256_setzero_ps(); MR]; NR];
            for b in 0..nsb {
                let xs: [__m256; MR] = each!(MR, |c| _mm256_loadu_ps(x.s.as_ptr().add(rows[c] * nb + b * 8)));
                for r in 0..NR {
                    let i = (j0 + r) * nsb + b;
                    let (d, dmin) = (h2f(*w.d.get_unchecked(i)), h2f(*w.m.get_unchecked(i)));
                    let (sub, qs) = (w.sub.as_ptr().add(i * 16), w.qs.as_ptr().add(i * stride));
                    prefetch_ahead(qs, stride);
                    let qh =
                        if five { _mm256_loadu_si256(qs.add(128).cast()) } else { _mm256_setzero_si256() };
                    let mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(sub.add(8).cast())));
                    let mn = _mm256_mul_ps(mn, _mm256_set1_ps(dmin));
                    for c in 0..MR {
                        mins[r][c] = _mm256_fmadd_ps(mn, xs[c], mins[r][c]);
                    }
                    for q in 0..2 {
                        let v0 = _mm256_loadu_si256(qs.add(q * 64).cast());
                        let v1 = _mm256_loadu_si256(qs.add(q * 64 + 32).cast());
                        let mut ws = [
                            _mm256_and_si256(v0, low),
                            _mm256_and_si256(_mm256_srli_epi16(v0, 4), low),
                            _mm256_and_si256(v1, low),
                            _mm256_and_si256(_mm256_srli_epi16(v1, 4), low),
                        ];
                        if five {
                            // Sub-block 4q + t's bits, each byte's bit 0 moved to bit 4.
                            let shift = _mm_cvtsi32_si128(4 * q as i32);
                            let bits: [__m256i; 4] = each!(4, |t| _mm256_and_si256(
                                _mm256_srl_epi16(qh, _mm_add_epi64(shift, _mm_cvtsi32_si128(t as i32))),
                                one
                            ));
                            ws = each!(4, |t| _mm256_or_si256(ws[t], _mm256_slli_epi16(bits[t], 4)));
                        }
                        let sc = _mm_cvtsi32_si128(std::ptr::read_unaligned(sub.add(q * 4).cast::<i32>()));
                        let sc = _mm_mul_ps(_mm_cvtepi32_ps(_mm_cvtepu8_epi32(sc)), _mm_set1_ps(d));
                        for c in 0..MR {
                            let xb = rows[c] * nb + b * 8 + q * 4;
                            let sums = fold4::<VNNI>(QuantFormat::Q4_K, ws, ws, x.q.as_ptr().add(xb * QK));
                            let s4 = _mm_mul_ps(sc, _mm_loadu_ps(x.d.as_ptr().add(xb)));
                            acc[r][c] =
                                _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set_m128(s4, s4), acc[r][c]);
                        }
                    }
                }
            }
            each!(NR, |r| each!(MR, |c| hsum(acc[r][c]) - hsum(mins[r][c])))
        }
    }

    /// [`dot`] over Q6_K super-blocks, a half (four sub-blocks of 32) at a time: the quants
    /// of a half rebuilt from ql's two 32-byte runs and qh's one, less 32 (signed, as Q8_0's
    /// are taken), and each sub-block's two halves of 16 summed apart; the eight sums fold
    /// into one vector (block t's first 16 in lane t, its last 16 in lane 4 + t), scaled by
    /// d times the half's eight scales in that order.
    ///
    /// # Safety
    /// As `dot_body`'s, whose assertions it runs under.
    #[inline(always)]
    unsafe fn dot_q6k<const NR: usize, const MR: usize, const VNNI: bool>(
        w: &QuantWeight,
        j0: usize,
        x: &QuantRows,
        rows: [usize; MR],
    ) -> [[f32; MR]; NR] {
        let (nsb, nb) = (w.k / QK_K, w.k / QK);
        // SAFETY: the caller asserted that the rows exist; every read is inside them.
        unsafe {
            let (m4, m2, c32) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(3), _mm256_set1_epi8(32));
            let order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
            let mut acc = [[_mm256_setzero_ps(); MR]; NR];
            for b in 0..nsb {
                for (r, acc) in acc.iter_mut().enumerate() {
                    let i = (j0 + r) * nsb + b;
                    let d = h2f(*w.d.get_unchecked(i));
                    let (qs, sub) = (w.qs.as_ptr().add(i * 192), w.sub.as_ptr().add(i * 16));
                    prefetch_ahead(qs, 192);
                    for half in 0..2 {
                        let ql0 = _mm256_loadu_si256(qs.add(64 * half).cast());
                        let ql1 = _mm256_loadu_si256(qs.add(64 * half + 32).cast());
                        let qh = _mm256_loadu_si256(qs.add(128 + 32 * half).cast());
                        // The high 2 bits of each quarter, in place above its nibbles.
                        let high = [
                            qh,
                            _mm256_srli_epi16(qh, 2),
                            _mm256_srli_epi16(qh, 4),
                            _mm256_srli_epi16(qh, 6),
                        ];
                        let high: [__m256i; 4] =
                            each!(4, |i| _mm256_slli_epi16(_mm256_and_si256(high[i], m2), 4));
                        let q = [
                            _mm256_or_si256(_mm256_and_si256(ql0, m4), high[0]),
                            _mm256_or_si256(_mm256_and_si256(ql1, m4), high[1]),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), high[2]),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4), high[3]),
                        ];
                        let wq: [__m256i; 4] = each!(4, |i| _mm256_sub_epi8(q[i], c32));
                        let wu: [__m256i; 4] = each!(4, |i| _mm256_sign_epi8(wq[i], wq[i]));
                        let sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                            sub.add(8 * half).cast(),
                        )));
                        let sc = _mm256_mul_ps(_mm256_permutevar8x32_ps(sc, order), _mm256_set1_ps(d));
                        for c in 0..MR {
                            let xb = rows[c] * nb + b * 8 + half * 4;
                            let sums = fold4::<VNNI>(QuantFormat::Q6_K, wu, wq, x.q.as_ptr().add(xb * QK));
                            let xd = _mm_loadu_ps(x.d.as_ptr().add(xb));
                            let scale = _mm256_mul_ps(sc, _mm256_set_m128(xd, xd));
                            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[c]);
                        }
                    }
                }
            }
            each!(NR, |r| each!(MR, |c| hsum(acc[r][c])))
        }
    }

    /// Σ over the row's blocks of the weight offset times the input block's sum.
    #[inline(always)]
    unsafe fn offset(w: &QuantWeight, j: usize, x: &QuantRows, row: usize) -> f32 {
        let nb = w.k / QK;
        let (base, factor) = match w.format {
            // Q4_K's and Q5_K's mins are summed in `dot_q4k`; Q6_K's quants are signed.
            QuantFormat::Q8_0 | QuantFormat::Q4_K | QuantFormat::Q5_K | QuantFormat::Q6_K => return 0.0,
            QuantFormat::Q4_0 => (&w.d[j * nb..(j + 1) * nb], -8.0),
            QuantFormat::Q5_0 => (&w.d[j * nb..(j + 1) * nb], -16.0),
            QuantFormat::Q4_1 | QuantFormat::Q5_1 => (&w.m[j * nb..(j + 1) * nb], 1.0),
        };
        let s = &x.s[row * nb..(row + 1) * nb];
        // SAFETY: base and s hold nb values each; F16C, FMA and AVX are there.
        unsafe {
            let mut acc = _mm256_setzero_ps();
            for g in 0..nb / 8 {
                acc = _mm256_fmadd_ps(
                    load_h8(base.as_ptr().add(g * 8)),
                    _mm256_loadu_ps(s.as_ptr().add(g * 8)),
                    acc,
                );
            }
            let tail: f32 = (nb / 8 * 8..nb).map(|b| base[b].to_f32() * s[b]).sum();
            factor * (hsum(acc) + tail)
        }
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use std::arch::aarch64::*;

    use super::{QK, QuantFormat, QuantRows, QuantWeight};

    /// 16 bits as 16 bytes: 0x10 where the bit is set (Q5_0's fifth bits, in place).
    #[inline(always)]
    unsafe fn fifth_bits(bits: u32) -> uint8x16_t {
        const MASK: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
        // SAFETY: NEON is there (the callers' target features); MASK holds 16 bytes.
        unsafe {
            let v = vcombine_u8(vdup_n_u8(bits as u8), vdup_n_u8((bits >> 8) as u8));
            vandq_u8(vtstq_u8(v, vld1q_u8(MASK.as_ptr())), vdupq_n_u8(0x10))
        }
    }

    /// 16 of a Q6_K sub-block's quants less 32: the nibbles of `ql` (the high ones where
    /// `high_nibble`) under bits `2·t..2·t + 2` of `qh`.
    #[inline(always)]
    unsafe fn q6k_16(ql: *const u8, qh: *const u8, high_nibble: bool, t: usize) -> int8x16_t {
        // SAFETY: 16 bytes at each pointer (the caller's contract); NEON is there.
        unsafe {
            let l = vld1q_u8(ql);
            let l = if high_nibble { vshrq_n_u8::<4>(l) } else { vandq_u8(l, vdupq_n_u8(0x0f)) };
            let h = vandq_u8(vshlq_u8(vld1q_u8(qh), vdupq_n_s8(-2 * t as i8)), vdupq_n_u8(3));
            vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(l, vshlq_n_u8::<4>(h))), vdupq_n_s8(32))
        }
    }

    /// Sub-block `i`'s 32 quants as elements 0..16 and 16..32, signed as
    /// [`QuantWeight::sub_quants`] gives them.
    #[inline(always)]
    unsafe fn quants(w: &QuantWeight, i: usize) -> (int8x16_t, int8x16_t) {
        // SAFETY: sub-block i is inside the weight (the callers' contract); NEON is there.
        unsafe {
            let (qs, low) = (w.qs.as_ptr(), vdupq_n_u8(0x0f));
            let signed = vreinterpretq_s8_u8;
            match w.format {
                QuantFormat::Q8_0 => (vld1q_s8(qs.add(i * 32).cast()), vld1q_s8(qs.add(i * 32 + 16).cast())),
                QuantFormat::Q4_0 | QuantFormat::Q4_1 | QuantFormat::Q5_0 | QuantFormat::Q5_1 => {
                    let v = vld1q_u8(qs.add(i * 16));
                    let (mut lo, mut hi) = (vandq_u8(v, low), vshrq_n_u8::<4>(v));
                    if matches!(w.format, QuantFormat::Q5_0 | QuantFormat::Q5_1) {
                        let bits = w.fifth_bits(i);
                        lo = vorrq_u8(lo, fifth_bits(bits & 0xffff));
                        hi = vorrq_u8(hi, fifth_bits(bits >> 16));
                    }
                    (signed(lo), signed(hi))
                }
                // Pairs of sub-blocks share 32 bytes: low nibbles the even one's.
                QuantFormat::Q4_K | QuantFormat::Q5_K => {
                    let five = w.format == QuantFormat::Q5_K;
                    let (b, j) = (i / 8, i % 8);
                    let blk = qs.add(b * if five { 160 } else { 128 });
                    let p = blk.add((j / 2) * 32);
                    let (a, c) = (vld1q_u8(p), vld1q_u8(p.add(16)));
                    let (mut a, mut c) = match j % 2 {
                        0 => (vandq_u8(a, low), vandq_u8(c, low)),
                        _ => (vshrq_n_u8::<4>(a), vshrq_n_u8::<4>(c)),
                    };
                    if five {
                        // Bit j of each qh byte, moved to bit 4.
                        let shift = vdupq_n_s8(4 - j as i8);
                        let bit = vdupq_n_u8(0x10);
                        a = vorrq_u8(a, vandq_u8(vshlq_u8(vld1q_u8(blk.add(128)), shift), bit));
                        c = vorrq_u8(c, vandq_u8(vshlq_u8(vld1q_u8(blk.add(144)), shift), bit));
                    }
                    (signed(a), signed(c))
                }
                QuantFormat::Q6_K => {
                    let (b, j) = (i / 8, i % 8);
                    let (half, t) = (j / 4, j % 4);
                    let blk = qs.add(b * 192);
                    let (ql, qh) = (blk.add(64 * half + 32 * (t % 2)), blk.add(128 + 32 * half));
                    (q6k_16(ql, qh, t >= 2, t), q6k_16(ql.add(16), qh.add(16), t >= 2, t))
                }
            }
        }
    }

    /// The integer dot product of 16 weight quants with 16 input quants, in 4 lanes.
    #[inline(always)]
    unsafe fn sum16(w: int8x16_t, x: int8x16_t) -> int32x4_t {
        // SAFETY: NEON is there (the callers' target features).
        unsafe {
            let lo = vmull_s8(vget_low_s8(w), vget_low_s8(x));
            vpadalq_s16(vpaddlq_s16(lo), vmull_high_s8(w, x))
        }
    }

    /// Asks for the cache line at `p` (a hint: no address faults).
    #[inline(always)]
    unsafe fn prefetch(p: *const u8) {
        // SAFETY: PRFM reads nothing the program sees and never faults.
        unsafe {
            std::arch::asm!("prfm pldl1keep, [{0}]", in(reg) p, options(nostack, readonly, preserves_flags))
        }
    }

    /// The dot products of weight rows `j0..j0 + NR` with input rows `rows`: `[NR][MR]`,
    /// each sub-block's quants unpacked once for the `MR` inputs, its halves' integer sums
    /// scaled into vector accumulators (one horizontal sum a dot product, at the end).
    /// Each weight row's bytes are asked for [`super::PREFETCH_BYTES`] ahead of its loads,
    /// as the x86 kernels ask: one core streaming a matrix keeps too few misses in flight.
    ///
    /// # Safety
    /// The CPU has NEON.
    #[target_feature(enable = "neon")]
    pub unsafe fn dot<const NR: usize, const MR: usize>(
        w: &QuantWeight,
        j0: usize,
        x: &QuantRows,
        rows: [usize; MR],
    ) -> [[f32; MR]; NR] {
        let (nb, qb) = (w.k / QK, QuantWeight::qbytes(w.format));
        assert!(j0 + NR <= w.n && x.k == w.k && rows.iter().all(|&r| (r + 1) * x.k <= x.q.len()));
        // K-quants scale a sub-block's halves apart; the others by one scale.
        let halves = matches!(w.format, QuantFormat::Q4_K | QuantFormat::Q5_K | QuantFormat::Q6_K);
        let mut out = [[0f32; MR]; NR];
        // SAFETY: every block read is of rows j0..j0 + NR of w and rows `rows` of x
        // (asserted above); NEON is the target feature.
        unsafe {
            for (r, out) in out.iter_mut().enumerate() {
                let mut acc = [vdupq_n_f32(0.0); MR];
                let mut offsets = [0f32; MR];
                let row = (j0 + r) * nb;
                for b in 0..nb {
                    let i = row + b;
                    if (i * qb) % 64 < qb {
                        prefetch(w.qs.as_ptr().wrapping_add(i * qb + super::PREFETCH_BYTES));
                    }
                    let (w0, w1) = quants(w, i);
                    let (scale, offset) = w.sub_scales(i);
                    for c in 0..MR {
                        let xb = rows[c] * nb + b;
                        let xq = x.q.as_ptr().add(xb * QK);
                        let (s0, s1) = (sum16(w0, vld1q_s8(xq)), sum16(w1, vld1q_s8(xq.add(16))));
                        let d = x.d[xb];
                        acc[c] = if halves {
                            let a = vfmaq_n_f32(acc[c], vcvtq_f32_s32(s0), d * scale[0]);
                            vfmaq_n_f32(a, vcvtq_f32_s32(s1), d * scale[1])
                        } else {
                            vfmaq_n_f32(acc[c], vcvtq_f32_s32(vaddq_s32(s0, s1)), d * scale[0])
                        };
                        offsets[c] += offset * x.s[xb];
                    }
                }
                for c in 0..MR {
                    out[c] = vaddvq_f32(acc[c]) + offsets[c];
                }
            }
        }
        out
    }
}

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint output columns.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// A family's kernels: the dot products of weight rows `j0..j0 + NR` with `MR` input rows.
#[derive(Clone, Copy)]
struct Kernels {
    /// 4 weight rows by 1 input row (decode of one sequence), 2 by 4, and 1 by 1.
    w4x1: DotFn<4, 1>,
    w2x4: DotFn<2, 4>,
    w1x1: DotFn<1, 1>,
    /// Where the family has one: weight rows `j0..j1` by 4 input rows of Q4_0, Q4_1, Q5_0
    /// or Q5_1, written to the outputs (in place of `w2x4` for those).
    pairs_x4: Option<RowsFn<4>>,
}

fn kernels(family: Family) -> Kernels {
    #[cfg(target_arch = "x86_64")]
    if matches!(family, Family::Avx512 | Family::Avx2)
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
    {
        // AVX-512 CPUs with VNNI (Ice Lake, Zen 4 and later) take its dot products.
        if family == Family::Avx512
            && std::arch::is_x86_feature_detected!("avx512vnni")
            && std::arch::is_x86_feature_detected!("avx512vl")
        {
            return Kernels {
                w4x1: avx2::dot_vnni::<4, 1>,
                w2x4: avx2::dot_vnni::<2, 4>,
                w1x1: avx2::dot_vnni::<1, 1>,
                pairs_x4: Some(avx2::rows_vnni::<4>),
            };
        }
        return Kernels {
            w4x1: avx2::dot::<4, 1>,
            w2x4: avx2::dot::<2, 4>,
            w1x1: avx2::dot::<1, 1>,
            pairs_x4: Some(avx2::rows::<4>),
        };
    }
    #[cfg(target_arch = "aarch64")]
    if family == Family::Neon && std::arch::is_aarch64_feature_detected!("neon") {
        return Kernels {
            w4x1: neon::dot::<4, 1>,
            w2x4: neon::dot::<2, 4>,
            w1x1: neon::dot::<1, 1>,
            pairs_x4: None,
        };
    }
    let _ = family;
    Kernels {
        w4x1: dot_portable::<4, 1>,
        w2x4: dot_portable::<2, 4>,
        w1x1: dot_portable::<1, 1>,
        pairs_x4: None,
    }
}

/// Input rows above which the weight is widened to f32 and multiplied by the f32 GEMM,
/// where the family has no multi-row kernel for the format ([`widens`]): a prompt's rows,
/// where the arithmetic, not the bytes, sets the pace (measured on the default model before
/// those kernels, a 500-token prompt went 454–589 → 635 tok/s). Up to it, the rounded
/// inputs (48 KB at most for 1,536 features) stay in cache beside a task's weight rows.
const WIDEN_ROWS: usize = 32;

/// Whether the format's kernels read the inputs laid out in pairs (Q4's nibbles split).
fn in_pairs(format: QuantFormat) -> bool {
    matches!(format, QuantFormat::Q4_0 | QuantFormat::Q4_1 | QuantFormat::Q5_0 | QuantFormat::Q5_1)
}

/// Whether `m` input rows meet the weight widened to f32: above [`WIDEN_ROWS`], unless the
/// family has multi-row kernels for the format (AVX2's for Q4_0, Q4_1, Q5_0 and Q5_1, which
/// ran a 500-token prompt of the default model's Q4_1 file at 470–513 tok/s where widening
/// ran it at 421–445).
fn widens(ks: &Kernels, format: QuantFormat, m: usize) -> bool {
    m > WIDEN_ROWS && !(in_pairs(format) && ks.pairs_x4.is_some())
}

/// `out[m, n] = x[m, k] · Wᵀ`.
pub fn matmul(family: Family, x: &[f32], m: usize, w: &QuantWeight, out: &mut [f32]) {
    let (n, k) = (w.n, w.k);
    assert!(x.len() >= m * k && out.len() >= m * n);
    let ks = kernels(family);
    if widens(&ks, w.format, m) {
        return super::matmul::widened(x, (m, k, n), out, |r, row| w.row_f32(r, row));
    }
    let pairs = in_pairs(w.format);
    let xq = quantize_rows(x, m, k, pairs, pairs && m >= 4 && ks.pairs_x4.is_some());
    // Whole groups of 4 weight rows a task, enough tasks to balance the threads.
    let chunk = n.div_ceil(rayon::current_num_threads() * 8).next_multiple_of(4);
    let out = OutPtr(out.as_mut_ptr());
    (0..n.div_ceil(chunk)).into_par_iter().for_each(|c| {
        let (j0, j1) = (c * chunk, ((c + 1) * chunk).min(n));
        // SAFETY: every row below n and m exists (asserted above); the kernels' CPU
        // features were checked by `kernels`; this task alone writes columns j0..j1.
        unsafe { tile(&ks, w, &xq, (j0, j1), (0, m), out, n) };
    });
}

/// Columns `j0..j1` of input rows `i0..i1`.
///
/// # Safety
/// The rows exist, the kernels' features are there, and only this call writes those outputs.
unsafe fn tile(
    ks: &Kernels,
    w: &QuantWeight,
    xq: &QuantRows,
    (j0, j1): (usize, usize),
    (i0, i1): (usize, usize),
    out: OutPtr,
    n: usize,
) {
    let put = |i: usize, j: usize, v: f32| {
        // SAFETY: the caller's contract.
        unsafe { *out.0.add(i * n + j) = v }
    };
    // SAFETY (the kernel calls): the caller's contract.
    unsafe {
        let mut i = i0;
        while i + 4 <= i1 {
            let rows = [i, i + 1, i + 2, i + 3];
            if let Some(k) = ks.pairs_x4.filter(|_| !xq.lanes.is_empty()) {
                k(w, (j0, j1), xq, rows, (out.0, n));
                i += 4;
                continue;
            }
            let mut j = j0;
            while j + 2 <= j1 {
                let v = (ks.w2x4)(w, j, xq, rows);
                (0..2).for_each(|r| (0..4).for_each(|c| put(rows[c], j + r, v[r][c])));
                j += 2;
            }
            for j in j..j1 {
                rows.into_iter().for_each(|row| put(row, j, (ks.w1x1)(w, j, xq, [row])[0][0]));
            }
            i += 4;
        }
        for i in i..i1 {
            let mut j = j0;
            while j + 4 <= j1 {
                let v = (ks.w4x1)(w, j, xq, [i]);
                (0..4).for_each(|r| put(i, j + r, v[r][0]));
                j += 4;
            }
            for j in j..j1 {
                put(i, j, (ks.w1x1)(w, j, xq, [i])[0][0]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::super::test_values as rand_vec;

    /// Blocks of seeded random bytes with small positive f16 scales: every bit pattern of
    /// Q5_0's and the K-quants' quants (and sub-block scales) is valid.
    fn random_blocks(format: QuantFormat, blocks: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        let mut bytes: Vec<u8> = (0..blocks * format.block_bytes())
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (s >> 56) as u8
            })
            .collect();
        for (i, blk) in bytes.chunks_exact_mut(format.block_bytes()).enumerate() {
            for (t, &o) in format.scale_offsets().iter().enumerate() {
                let v = 0.001 * (t + 1) as f32 + 0.0001 * (i % 7) as f32;
                blk[o..o + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
            }
        }
        bytes
    }

    /// Against the dequantized weight times the quantized input (what the kernels compute,
    /// to float rounding; the f32 input above [`WIDEN_ROWS`] rows), and against the f32
    /// input within what the input's 8-bit rounding can reach.
    /// The largest quants (every nibble and fifth bit set: 15, or 31 with it) against the
    /// largest inputs (±127 once rounded), where the multi-row kernels' 16-bit sums of eight
    /// products are closest to overflowing: exact under every family.
    #[test]
    fn the_largest_quants_and_inputs_give_exact_sums() {
        for family in Family::all_supported() {
            for format in [QuantFormat::Q4_0, QuantFormat::Q4_1, QuantFormat::Q5_0, QuantFormat::Q5_1] {
                let (m, n, k) = (8, 6, 7 * QK);
                let mut blocks = vec![0xffu8; n * format.row_bytes(k)];
                for blk in blocks.chunks_exact_mut(format.block_bytes()) {
                    for &o in format.scale_offsets() {
                        blk[o..o + 2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
                    }
                }
                let w = QuantWeight::from_blocks(format, &blocks, n, k);
                let mut dense = Vec::new();
                format.dequantize(&blocks, &mut dense);
                // Rows of +1 and of -1: every input rounds to ±127 exactly.
                let x: Vec<f32> = (0..m * k).map(|t| if (t / k) % 2 == 0 { 1.0 } else { -1.0 }).collect();
                let mut out = vec![f32::NAN; m * n];
                matmul(family, &x, m, &w, &mut out);
                for i in 0..m {
                    for j in 0..n {
                        let want: f64 = (0..k).map(|t| x[i * k + t] as f64 * dense[j * k + t] as f64).sum();
                        let got = out[i * n + j] as f64;
                        assert!(
                            (got - want).abs() <= 1e-6 * want.abs(),
                            "{} {format} [{i},{j}]: {got} vs {want}",
                            family.name()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn quantized_matmul_matches_dequantize_then_multiply_under_every_family() {
        for family in Family::all_supported() {
            for format in QuantFormat::ALL {
                for &(m, n, k) in &[
                    (1usize, 17usize, 64usize),
                    (3, 100, 96),
                    (5, 64, 576),
                    (9, 33, 1536),
                    (32, 40, 96),
                    (33, 20, 64),
                    (70, 12, 32),
                    (1, 9, 256),
                    (6, 21, 512),
                    (2, 8, 2304),
                    (41, 9, 576),
                ] {
                    if !k.is_multiple_of(format.block_elems()) {
                        continue;
                    }
                    let blocks = match format {
                        QuantFormat::Q4_0 | QuantFormat::Q4_1 | QuantFormat::Q8_0 => {
                            format.quantize(&rand_vec(n * k, 2))
                        }
                        _ => random_blocks(format, n * k / format.block_elems(), 5),
                    };
                    let w = QuantWeight::from_blocks(format, &blocks, n, k);
                    let mut dense = Vec::new();
                    format.dequantize(&blocks, &mut dense);
                    let mut row = vec![0f32; k];
                    w.row_f32(n - 1, &mut row);
                    assert_eq!(row, dense[(n - 1) * k..]);

                    let x = rand_vec(m * k, 1);
                    let xq = quantize_rows(&x, m, k, false, false);
                    let xd: Vec<f32> =
                        xq.q.iter().enumerate().map(|(t, &q)| q as f32 * xq.d[t / QK]).collect();
                    let mut out = vec![f32::NAN; m * n];
                    matmul(family, &x, m, &w, &mut out);
                    for i in 0..m {
                        for j in 0..n {
                            let dot = |x: &[f32]| -> f64 {
                                (0..k).map(|t| x[i * k + t] as f64 * dense[j * k + t] as f64).sum()
                            };
                            let got = out[i * n + j] as f64;
                            // Widened, the f32 input meets the widened weight.
                            let exact = if widens(&kernels(family), format, m) { dot(&x) } else { dot(&xd) };
                            let true_x = dot(&x);
                            let what = format!("{} {format} m={m} n={n} k={k} [{i},{j}]", family.name());
                            assert!(
                                (got - exact).abs() < 1e-5 * (k as f64).sqrt(),
                                "{what}: {got} vs {exact}"
                            );
                            // Each input rounds by at most half its block's step.
                            let reach: f64 = (0..k)
                                .map(|t| (dense[j * k + t] * xq.d[(i * k + t) / QK]).abs() as f64 * 0.5)
                                .sum();
                            assert!(
                                (got - true_x).abs() <= reach * 1.001 + 1e-4,
                                "{what}: {got} vs {true_x} with the f32 input (rounding reaches {reach})"
                            );
                        }
                    }
                }
            }
        }
    }
}
