#include <cuda_fp8.h>
// `y = x @ wᵀ` for a few rows of x (decode steps of up to 8 sequences) and 16-bit weights
// (or 4-bit and FP8 ones widened to 16 bits in registers: `Int4` and `Fp8` below), on tensor
// cores: y[m, n] = Σ_k x[m, k] · w[n, k], x and w of type T (x already rounded to
// it), f32 accumulation and output. (common.cuh comes first.)
//
// Such a product only streams the weights, so everything serves the loads: each lane reads
// 16 bytes of two weight rows per 32 k, several such loads in flight, bypassing L1. The
// weights are the A operand of mma.m16n8k16 (16 rows of w per warp) and x is B (tokens as
// its 8 columns), so 32 elements of k cost two mmas where CUDA cores would spend 8 FMAs
// per token per element.
//
// The mma's k index may stand for any element of a chunk as long as both operands agree.
// Lane (g, q) (g = lane / 4, q = lane % 4) loads elements 8q .. 8q + 7 of a 32-element
// chunk: of weight rows g and g + 8, and of token row g. Its four words feed two mmas:
// words 0 and 1 stand for k 2q.. and 2q + 8.. of the first, words 2 and 3 of the second. A fragment a0 = (g, 2q..), a1 = (g + 8, 2q..),
// a2 = (g, 2q + 8..), a3 = (g + 8, 2q + 8..); B b0 = (k 2q.., n g), b1 = (k 2q + 8.., n g);
// C c0, c1 = (g, 2q..2q+1), c2, c3 = (g + 8, 2q..2q+1).
//
// A block of W warps (8, or 16 for the `_wide` kernels; the host launches 32 · W threads)
// takes turns over the chunks of its 16 rows (warp w: chunks w, w + W, ...), and their
// partial sums are added through shared memory. Rows of w past n and tokens past m read the
// last valid one and are not stored. k must be a multiple of 8 (16-byte loads). Needs
// sm_80 (the host uses cuBLAS below).

#define GEMV_WARPS 8
// Chunks a warp loads before it multiplies: 2 · U weight loads (16 bytes) in flight per lane.
#define GEMV_UNROLL 4

// mma.m16n8k16 with every row of A (flash.cu's drops rows g + 8), in the weights'
// 16-bit type TY ("bf16" or "f16").
template <typename T> struct MmaFull;
#define MMA_FULL(T, TY)                                                                                     \
    template <> struct MmaFull<T> {                                                                         \
        static __device__ __forceinline__ void run(float (&c)[4], unsigned a0, unsigned a1, unsigned a2,    \
                                                   unsigned a3, unsigned b0, unsigned b1) {                 \
            asm("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "    \
                "{%8,%9}, {%0,%1,%2,%3};\n"                                                                  \
                : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                            \
                : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));                                    \
        }                                                                                                   \
    };
MMA_FULL(__nv_bfloat16, "bf16")
MMA_FULL(__half, "f16")

// One 32-element chunk: weight rows g (a) and g + 8 (b), token row g (x), two mmas.
template <typename T>
__device__ __forceinline__ void gemv_chunk(float (&c)[4], const uint4& a, const uint4& b, const uint4& x) {
#if __CUDA_ARCH__ >= 800
    MmaFull<T>::run(c, a.x, b.x, a.y, b.y, x.x, x.y);
    MmaFull<T>::run(c, a.z, b.z, a.w, b.w, x.z, x.w);
#endif
}

// 4 bytes from global to shared memory without a register (cp.async, sm_80).
__device__ __forceinline__ void cp_async4(float* smem, const float* p) {
#if __CUDA_ARCH__ >= 800
    unsigned a = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(a), "l"(p) : "memory");
#endif
}

__device__ __forceinline__ void cp_async8(long long* smem, const long long* p) {
#if __CUDA_ARCH__ >= 800
    unsigned a = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(a), "l"(p) : "memory");
#endif
}

// Tokens (rows of x) a GEMV takes: the 8 columns of the mma's B operand.
#define GEMV_TOKENS 8

// An RMSNorm whose 1/rms is applied by the GEMV that reads it (gemv_res_norm writes such
// norms): x holds w ⊙ v, rounded to T, and token t's products are to be multiplied by
// rsqrt(Σ v² / k + eps), whose sum of squares `parts` blocks of the GEMV that wrote v left
// at sums[t · parts ..]. A null `sums`: x is final.
struct NormScale {
    const float* sums;
    int parts;
    float eps;
};

// Token t's 1/rms from its `parts` sums (a whole warp): every lane adds the sums j ≡ lane
// (mod 32) in order of j, eight loads at a time, then the lanes meet by xor shuffles, so
// every lane of every block that asks gets the same value.
__device__ __forceinline__ float row_rscale(NormScale s, int t, int cols) {
    const int lane = threadIdx.x & 31;
    const float* p = s.sums + (size_t)t * s.parts;
    float acc = 0.0f;
    for (int j0 = 0; j0 < s.parts; j0 += 8 * 32) {
        float v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            int j = j0 + u * 32 + lane;
            v[u] = j < s.parts ? __ldcg(p + j) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 8; u++) acc += v[u];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    return rsqrtf(acc / cols + s.eps);
}

// Where a block's partial sums meet: [warp][C fragment element][lane], for W warps.
template <int W> using GemvRed = float[W][4][32];

// After PDL's wait, with `scale.sums` (x is a norm's output whose 1/rms is still to apply,
// `NormScale`): warp t of the first m computes token t's scale into rs[t].
__device__ __forceinline__ void gemv_row_scales(NormScale scale, int k, int m, float (&rs)[GEMV_TOKENS]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (scale.sums != nullptr && warp < m) {
        float r = row_rscale(scale, warp, k);
        if (lane == 0) rs[warp] = r;
    }
}

// The end of a gemv_sums: its loads all issued, the next kernel may launch; the warp's C
// fragment goes to red, and the block meets.
template <int W> __device__ __forceinline__ void gemv_sums_meet(GemvRed<W>& red, const float (&c)[4]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    grid_dep_launch();
#pragma unroll
    for (int e = 0; e < 4; e++) red[warp][e][lane] = c[e];
    __syncthreads();
}

// The block's products of weight rows w0 (its rows g) and w1 (its rows g + 8, as the lane's
// A fragment rows) with token row xr, summed over k into red: after it, red[·][e][l] holds
// the warps' partial sums of C element e of lane l, and the block has synchronized.
//
// The first U chunks' weights are loaded before waiting for the kernel before (PDL,
// common.cuh): they do not depend on it, so inside a graph their loads overlap its last
// microseconds. The next kernel is let launch only once the block has issued its last
// loads: let launch right after the wait, as the other kernels do, the 8B model's batch-1
// step took 4.27 – 4.29 ms on the H200 against 4.24 – 4.26.
//
// With `scale.sums` (x is a norm's output whose 1/rms is still to apply, `NormScale`), warp t
// of the first m computes token t's scale into rs[t] once the kernel before has finished;
// the caller multiplies its sums by it.
template <typename T, int W>
__device__ __forceinline__ void gemv_sums(GemvRed<W>& red, const T* w0, const T* w1, const T* xr, int k,
                                          NormScale scale, int m, float (&rs)[GEMV_TOKENS]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, q = lane & 3;
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    // Whole chunks, U at a time with no conditions (so that all their loads issue before the
    // first mma waits), then what is left, U at a time with conditions: a lane's 8 elements
    // of the last, partial chunk lie wholly inside or past k (k % 8 == 0).
    const int full = k / 32, chunks = (k + 31) / 32;
    int c0 = warp;
    uint4 a[GEMV_UNROLL], b[GEMV_UNROLL];
    bool ahead = c0 + (GEMV_UNROLL - 1) * W < full;
    if (ahead) {
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            a[u] = ld_stream(w0 + (c0 + u * W) * 32);
            b[u] = ld_stream(w1 + (c0 + u * W) * 32);
        }
    }
    grid_dep_wait();
    gemv_row_scales(scale, k, m, rs);
    for (; c0 + (GEMV_UNROLL - 1) * W < full; c0 += W * GEMV_UNROLL) {
        uint4 xb[GEMV_UNROLL];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            int off = (c0 + u * W) * 32;
            if (!ahead) {
                a[u] = ld_stream(w0 + off);
                b[u] = ld_stream(w1 + off);
            }
            xb[u] = *(const uint4*)(xr + off);
        }
        ahead = false;
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) gemv_chunk<T>(c, a[u], b[u], xb[u]);
    }
    // What is left, fewer than U chunks (c0 + (U - 1) · W ≥ full, and chunks ≤ full + 1),
    // the last perhaps partial: loaded all at once as above, so that the warp waits for
    // memory once, not once a chunk. Every lane runs the mmas (they are warp-wide): chunks
    // and lanes past k bring zeros.
    if (c0 < chunks) {
        const uint4 zero = make_uint4(0, 0, 0, 0);
        uint4 xb[GEMV_UNROLL];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            const int off = (c0 + u * W) * 32;
            const bool in = c0 + u * W < chunks && off + q * 8 < k;
            a[u] = in ? ld_stream(w0 + off) : zero;
            b[u] = in ? ld_stream(w1 + off) : zero;
            xb[u] = in ? *(const uint4*)(xr + off) : zero;
        }
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) gemv_chunk<T>(c, a[u], b[u], xb[u]);
    }
    gemv_sums_meet<W>(red, c);
}

// Thread i < 128's sum: C element e = i / 32 of lane l = i % 32, which is weight row
// (l / 4) + (e ≥ 2 ? 8 : 0) of the block's 16 and token (l % 4) · 2 + e % 2.
template <int W>
__device__ __forceinline__ float gemv_sum(const GemvRed<W>& red, int e, int l) {
    float s = 0.0f;
#pragma unroll
    for (int v = 0; v < W; v++) s += red[v][e][l];
    return s;
}

// 4-bit weights (kernels/int4.rs's rows): each row's values, 8 a 32-bit word (elements
// 0, 2, 4, 6 in its low half, 1, 3, 5, 7 in its high half), then a (scale, MAGIC + zero)
// pair of 16-bit values for each group. Read as T, `MAGIC | q` is MAGIC + q, so a word's
// elements become T pairs with one mask and or each, and (MAGIC + q − (MAGIC + zero)) ×
// scale rounds once, as the checkpoint's own dequantization does.
template <typename T> struct Half2;
template <> struct Half2<__nv_bfloat16> {
    using t = __nv_bfloat162;
    static constexpr unsigned MAGIC = 0x43004300u;  // 128
};
template <> struct Half2<__half> {
    using t = __half2;
    static constexpr unsigned MAGIC = 0x64006400u;  // 1024
};

template <typename H2> __device__ __forceinline__ H2 as_h2(unsigned u) {
    H2 h;
    memcpy(&h, &u, 4);
    return h;
}
template <typename H2> __device__ __forceinline__ unsigned as_word(H2 h) {
    unsigned u;
    memcpy(&u, &h, 4);
    return u;
}

// The 8 elements of word v, in order, with their group's pair (scale in the low half).
template <typename T> __device__ __forceinline__ uint4 int4_word(unsigned v, unsigned pair) {
    using H2 = typename Half2<T>::t;
    const H2 scale = as_h2<H2>(__byte_perm(pair, 0, 0x1010)), off = as_h2<H2>(__byte_perm(pair, 0, 0x3232));
    unsigned o[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const unsigned e = ((v >> (4 * j)) & 0x000f000fu) | Half2<T>::MAGIC;
        o[j] = as_word(__hmul2(__hsub2(as_h2<H2>(e), off), scale));
    }
    return make_uint4(o[0], o[1], o[2], o[3]);
}

// Superchunks of 128 elements a warp loads before it multiplies.
#define INT4_UNROLL 2

// gemv_sums for 4-bit rows r0 and r1 (their first bytes) in groups of `group` (0: one a
// row): lane (g, q) takes elements 32q .. 32q + 31 of each 128-element superchunk, one
// 16-byte load a row and a 4-byte pair, and multiplies them as four of gemv_sums' 32-element
// chunks (the mma's k order is the lanes' own, x read the same way). Warp w takes
// superchunks w, w + W, ...; a lane's 32 elements lie wholly inside or past k (k % 32 == 0)
// and inside one group (group % 32 == 0). The first superchunks' weights are loaded before
// PDL's wait, as gemv_sums does.
template <typename T, int W>
__device__ __forceinline__ void gemv_sums_int4(GemvRed<W>& red, const unsigned char* r0, const unsigned char* r1,
                                               int group, const T* xr, int k, NormScale scale, int m,
                                               float (&rs)[GEMV_TOKENS]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, q = lane & 3;
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int supers = (k + 127) / 128;
    const unsigned* p0 = (const unsigned*)(r0 + k / 2);
    const unsigned* p1 = (const unsigned*)(r1 + k / 2);
    const uint4 zero = make_uint4(0, 0, 0, 0);
    uint4 a[INT4_UNROLL], b[INT4_UNROLL];
    unsigned pa[INT4_UNROLL], pb[INT4_UNROLL];
    auto load = [&](int s0) {
#pragma unroll
        for (int u = 0; u < INT4_UNROLL; u++) {
            const int e = (s0 + u * W) * 128 + q * 32;
            const bool in = s0 + u * W < supers && e < k;
            const int gi = group ? e / group : 0;
            a[u] = in ? ld_stream(r0 + e / 2) : zero;
            b[u] = in ? ld_stream(r1 + e / 2) : zero;
            pa[u] = in ? __ldg(p0 + gi) : 0u;
            pb[u] = in ? __ldg(p1 + gi) : 0u;
        }
    };
    load(warp);
    grid_dep_wait();
    gemv_row_scales(scale, k, m, rs);
    for (int s0 = warp; s0 < supers; s0 += W * INT4_UNROLL) {
        if (s0 != warp) load(s0);
#pragma unroll
        for (int u = 0; u < INT4_UNROLL; u++) {
            if (s0 + u * W >= supers) break;  // the same for the whole warp
            const int e = (s0 + u * W) * 128 + q * 32;
            const bool in = e < k;
            const unsigned wa[4] = {a[u].x, a[u].y, a[u].z, a[u].w}, wb[4] = {b[u].x, b[u].y, b[u].z, b[u].w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const uint4 x = in ? *(const uint4*)(xr + e + 8 * j) : zero;
                gemv_chunk<T>(c, int4_word<T>(wa[j], pa[u]), int4_word<T>(wb[j], pb[u]), x);
            }
        }
    }
    gemv_sums_meet<W>(red, c);
}

// FP8 weights (kernels/rows.rs's Fp8 rows): each row's e4m3 bytes, then an f32 scale for
// each group. A byte pair becomes a half pair (exactly) in one instruction, then floats
// times the scale, rounded to T once, as the checkpoint's own dequantization does.
__device__ __forceinline__ unsigned fp8_pair(unsigned short v, float s, __nv_bfloat16*) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)v, __NV_E4M3);
    const float2 f = __half22float2(__half2(h));
    return as_word(__floats2bfloat162_rn(f.x * s, f.y * s));
}
__device__ __forceinline__ unsigned fp8_pair(unsigned short v, float s, __half*) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)v, __NV_E4M3);
    const float2 f = __half22float2(__half2(h));
    return as_word(__floats2half2_rn(f.x * s, f.y * s));
}

// The 8 elements of bytes lo (elements 0..3) and hi (4..7), in order, times scale s.
template <typename T> __device__ __forceinline__ uint4 fp8_words(unsigned lo, unsigned hi, float s) {
    return make_uint4(fp8_pair(lo & 0xffff, s, (T*)nullptr), fp8_pair(lo >> 16, s, (T*)nullptr),
                      fp8_pair(hi & 0xffff, s, (T*)nullptr), fp8_pair(hi >> 16, s, (T*)nullptr));
}

// Superchunks of 64 elements a warp loads before it multiplies.
#define FP8_UNROLL 4

// gemv_sums for FP8 rows r0 and r1 in groups of `group` (0: one a row): lane (g, q) takes
// elements 16q .. 16q + 15 of each 64-element superchunk, one 16-byte load a row and its
// group's scale, and multiplies them as two of gemv_sums' 32-element chunks. A lane's 16
// elements lie wholly inside or past k (k % 16 == 0) and inside one group (group % 16 == 0).
template <typename T, int W>
__device__ __forceinline__ void gemv_sums_fp8(GemvRed<W>& red, const unsigned char* r0, const unsigned char* r1,
                                              int group, const T* xr, int k, NormScale scale, int m,
                                              float (&rs)[GEMV_TOKENS]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, q = lane & 3;
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int supers = (k + 63) / 64;
    const float* s0p = (const float*)(r0 + k);
    const float* s1p = (const float*)(r1 + k);
    const uint4 zero = make_uint4(0, 0, 0, 0);
    uint4 a[FP8_UNROLL], b[FP8_UNROLL];
    float sa[FP8_UNROLL], sb[FP8_UNROLL];
    auto load = [&](int s0) {
#pragma unroll
        for (int u = 0; u < FP8_UNROLL; u++) {
            const int e = (s0 + u * W) * 64 + q * 16;
            const bool in = s0 + u * W < supers && e < k;
            const int gi = group ? e / group : 0;
            a[u] = in ? ld_stream(r0 + e) : zero;
            b[u] = in ? ld_stream(r1 + e) : zero;
            sa[u] = in ? __ldg(s0p + gi) : 0.0f;
            sb[u] = in ? __ldg(s1p + gi) : 0.0f;
        }
    };
    load(warp);
    grid_dep_wait();
    gemv_row_scales(scale, k, m, rs);
    for (int s0 = warp; s0 < supers; s0 += W * FP8_UNROLL) {
        if (s0 != warp) load(s0);
#pragma unroll
        for (int u = 0; u < FP8_UNROLL; u++) {
            if (s0 + u * W >= supers) break;  // the same for the whole warp
            const int e = (s0 + u * W) * 64 + q * 16;
            const bool in = e < k;
            const uint4 x0 = in ? *(const uint4*)(xr + e) : zero, x1 = in ? *(const uint4*)(xr + e + 8) : zero;
            gemv_chunk<T>(c, fp8_words<T>(a[u].x, a[u].y, sa[u]), fp8_words<T>(b[u].x, b[u].y, sb[u]), x0);
            gemv_chunk<T>(c, fp8_words<T>(a[u].z, a[u].w, sa[u]), fp8_words<T>(b[u].z, b[u].w, sb[u]), x1);
        }
    }
    gemv_sums_meet<W>(red, c);
}

// The weights a GEMV reads, as the kernels below take them: `sums` is gemv_sums over the
// rows ra (as the lanes' rows g) and rb (rows g + 8) with token row xr (its first element).
// 16-bit rows of k values:
template <typename T> struct Dense {
    const T* w;
    int k;
    template <int W>
    __device__ __forceinline__ void sums(GemvRed<W>& red, size_t ra, size_t rb, const T* xr, NormScale s, int m,
                                         float (&rs)[GEMV_TOKENS]) const {
        const int q = threadIdx.x & 3;
        gemv_sums<T, W>(red, w + ra * k + q * 8, w + rb * k + q * 8, xr + q * 8, k, s, m, rs);
    }
};
// 4-bit rows of `row_bytes` bytes:
template <typename T> struct Int4 {
    const unsigned char* w;
    int k;
    long long row_bytes;
    int group;
    template <int W>
    __device__ __forceinline__ void sums(GemvRed<W>& red, size_t ra, size_t rb, const T* xr, NormScale s, int m,
                                         float (&rs)[GEMV_TOKENS]) const {
        gemv_sums_int4<T, W>(red, w + ra * row_bytes, w + rb * row_bytes, group, xr, k, s, m, rs);
    }
};

// FP8 rows of `row_bytes` bytes:
template <typename T> struct Fp8 {
    const unsigned char* w;
    int k;
    long long row_bytes;
    int group;
    template <int W>
    __device__ __forceinline__ void sums(GemvRed<W>& red, size_t ra, size_t rb, const T* xr, NormScale s, int m,
                                         float (&rs)[GEMV_TOKENS]) const {
        gemv_sums_fp8<T, W>(red, w + ra * row_bytes, w + rb * row_bytes, group, xr, k, s, m, rs);
    }
};

// FP8 rows widened to T: out [n, k] (for the GEMMs of prompts). A thread 8 elements.
template <typename T>
__device__ void fp8_widen(const unsigned char* __restrict__ w, long long row_bytes, int group, T* __restrict__ out,
                          int n, int k) {
    grid_dep_wait();
    const size_t chunks = (size_t)n * (k / 8);
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < chunks; i += (size_t)gridDim.x * blockDim.x) {
        const size_t row = i / (k / 8);
        const int e = (int)(i % (k / 8)) * 8;
        const unsigned char* r = w + row * row_bytes;
        const float s = ((const float*)(r + k))[group ? e / group : 0];
        const uint2 v = *(const uint2*)(r + e);
        *(uint4*)(out + row * k + e) = fp8_words<T>(v.x, v.y, s);
    }
    grid_dep_launch();
}
extern "C" __global__ void fp8_widen_bf16(const unsigned char* w, long long row_bytes, int group, __nv_bfloat16* out,
                                          int n, int k) {
    fp8_widen(w, row_bytes, group, out, n, k);
}
extern "C" __global__ void fp8_widen_f16(const unsigned char* w, long long row_bytes, int group, __half* out, int n,
                                         int k) {
    fp8_widen(w, row_bytes, group, out, n, k);
}

// 4-bit rows widened to T: out [n, k] (for the GEMMs of prompts, through cuBLAS). A thread
// a word of 8 elements.
template <typename T>
__device__ void int4_widen(const unsigned char* __restrict__ w, long long row_bytes, int group, T* __restrict__ out,
                           int n, int k) {
    grid_dep_wait();
    const size_t words = (size_t)n * (k / 8);
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x) {
        const size_t row = i / (k / 8);
        const int e = (int)(i % (k / 8)) * 8;
        const unsigned char* r = w + row * row_bytes;
        const unsigned pair = ((const unsigned*)(r + k / 2))[group ? e / group : 0];
        *(uint4*)(out + row * k + e) = int4_word<T>(((const unsigned*)r)[e / 8], pair);
    }
    grid_dep_launch();
}
extern "C" __global__ void int4_widen_bf16(const unsigned char* w, long long row_bytes, int group,
                                           __nv_bfloat16* out, int n, int k) {
    int4_widen(w, row_bytes, group, out, n, k);
}
extern "C" __global__ void int4_widen_f16(const unsigned char* w, long long row_bytes, int group, __half* out, int n,
                                          int k) {
    int4_widen(w, row_bytes, group, out, n, k);
}

// y = x @ wᵀ: block b takes weight rows 16b .. 16b + 15.
template <typename T, typename WT, int W>
__device__ void gemv(WT wt, const T* __restrict__ x, float* __restrict__ y, int m, int n, int k, NormScale scale) {
    __shared__ GemvRed<W> red;
    __shared__ float rs[GEMV_TOKENS];
    const int g = (threadIdx.x & 31) >> 2;
    const int row0 = blockIdx.x * 16;
    wt.template sums<W>(red, min(row0 + g, n - 1), min(row0 + g + 8, n - 1), x + (size_t)min(g, m - 1) * k, scale, m,
                        rs);
    if (threadIdx.x < 128) {
        int e = threadIdx.x / 32, l = threadIdx.x % 32;
        int row = row0 + (l >> 2) + (e >= 2 ? 8 : 0);
        int tok = (l & 3) * 2 + (e & 1);
        float s = gemv_sum(red, e, l);
        if (row < n && tok < m) y[(size_t)tok * n + row] = scale.sums ? s * rs[tok] : s;
    }
}

// y = x @ wᵀ added to the residual stream, and the RMSNorm (weights nw) of the sum made
// ready for the next projection's GEMV: residual += y; out16 = nw ⊙ residual, rounded to
// 16 bits (kind 1 bf16, 2 f16), with each token's 1/rms left to that GEMV (NormScale): the
// block writes the sums of squares of its rows' new residual values to sums[t · gridDim.x
// + block]. No kernel between the projection and the next one, and no block waits for
// another: the sums meet in the next GEMV, which needs them only for its epilogue.
//
// The residual and the norm weights are loaded before PDL's wait: the residual was last
// written two kernels before at least (the projection that wrote it was done before the
// kernel before this one passed its own wait, which it did before this one could launch).
template <typename T, typename WT, int W>
__device__ void gemv_res_norm(WT wt, const T* __restrict__ x, float* __restrict__ residual,
                              const float* __restrict__ nw, void* out16, int kind, float* __restrict__ sums, int m,
                              int n, int k) {
    __shared__ GemvRed<W> red;
    __shared__ float rs[GEMV_TOKENS];
    // Copied to shared memory, so that no register holds them through the products.
    __shared__ float res[GEMV_TOKENS][16], nws[16], sq[GEMV_TOKENS][17];
    const int g = (threadIdx.x & 31) >> 2;
    const int row0 = blockIdx.x * 16;
    // Epilogue thread i < 128: C element e = i / 32 of lane l = i % 32 (gemv_sum's).
    auto row_of = [&] { return row0 + ((threadIdx.x & 31) >> 2) + (threadIdx.x >= 64 ? 8 : 0); };
    auto tok_of = [&] { return (threadIdx.x & 3) * 2 + ((threadIdx.x >> 5) & 1); };
    if (threadIdx.x < 128 && row_of() < n && tok_of() < m) {
        cp_async4(&res[tok_of()][row_of() - row0], residual + (size_t)tok_of() * n + row_of());
        cp_async4(&nws[row_of() - row0], nw + row_of());
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    wt.template sums<W>(red, min(row0 + g, n - 1), min(row0 + g + 8, n - 1), x + (size_t)min(g, m - 1) * k,
                        NormScale{nullptr, 0, 0.0f}, m, rs);
    asm volatile("cp.async.wait_all;" ::: "memory");  // this thread's own copies
    if (threadIdx.x < 128) {
        const int row = row_of(), tok = tok_of();
        float v = 0.0f;
        if (row < n && tok < m) {
            const size_t at = (size_t)tok * n + row;
            v = gemv_sum(red, threadIdx.x / 32, threadIdx.x % 32) + res[tok][row - row0];
            residual[at] = v;
            store16(out16, at, nws[row - row0] * v, kind);
        }
        sq[tok][row - row0] = v * v;
    }
    __syncthreads();
    if (threadIdx.x < m) {
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < 16; i++) s += sq[threadIdx.x][i];
        sums[(size_t)threadIdx.x * gridDim.x + blockIdx.x] = s;
    }
}

// The gate/up projection (w's rows: gate, then up, `inter` each) followed by act(gate)·up
// (act_fn's code `act`), as act_mul_f32 would compute it from the f32 projection: block b takes gate rows
// 8b .. 8b + 7 as its rows g and the same rows of up as its rows g + 8, so each thread
// of the epilogue holds a gate value and its up value. The result [m, inter] goes to out
// (unless null) and, rounded to 16 bits, to out16 (kind 1 bf16, 2 f16; none with kind 0).
template <typename T, typename WT, int W>
__device__ void gemv_act(WT wt, const T* __restrict__ x, float* __restrict__ out, void* out16, int kind, int act, int m,
                         int inter, int k, NormScale scale) {
    __shared__ GemvRed<W> red;
    __shared__ float rs[GEMV_TOKENS];
    const int g = (threadIdx.x & 31) >> 2;
    const int row0 = blockIdx.x * 8;
    const size_t gate = min(row0 + g, inter - 1);
    wt.template sums<W>(red, gate, gate + inter, x + (size_t)min(g, m - 1) * k, scale, m, rs);
    if (threadIdx.x < 64) {
        int e = threadIdx.x / 32, l = threadIdx.x % 32;
        int row = row0 + (l >> 2);
        int tok = (l & 3) * 2 + e;
        float gv = gemv_sum(red, e, l), uv = gemv_sum(red, e + 2, l);
        if (scale.sums) {
            gv *= rs[tok];
            uv *= rs[tok];
        }
        float r = act_fn(gv, act) * uv;
        size_t o = (size_t)tok * inter + row;
        if (row < inter && tok < m) {
            if (out) out[o] = r;
            if (kind) store16(out16, o, r, kind);
        }
    }
}

// The fused qkv projection with RoPE applied, q written out and k and v written into the
// cache at each token's slot (none for a negative one), as split_qkv_rope_kv computes them
// from the projection, which is never written. Block b takes, of head slot h = b / (hd / 16)
// (q heads, then k, then v), the rows of dims 8j .. 8j + 7 as its rows g and those of dims
// half + 8j .. as its rows g + 8 (j = b % (hd / 16), half = hd / 2), so that each thread of
// the epilogue holds a pair the rotation mixes. Needs the rotation over the whole head, hd a
// multiple of 16. The tokens' positions and slots and the block's frequencies do not depend
// on the kernel before: they are copied to shared memory before PDL's wait. The frequencies
// are one row for all tokens (freq_stride 0) or a row a token, freq_stride apart; cos and
// sin are scaled by mscale.
template <typename T, typename WT, int W>
__device__ void gemv_qkv_rope(WT wt, const T* __restrict__ x, float* __restrict__ q,
                              T* __restrict__ kc, T* __restrict__ vc, const long long* __restrict__ slots,
                              const unsigned* __restrict__ positions, const float* __restrict__ inv_freq,
                              int freq_stride, float mscale, int heads, int kv_heads, int hd, int m, int k,
                              NormScale scale) {
    __shared__ GemvRed<W> red;
    __shared__ float rs[GEMV_TOKENS], freq[GEMV_TOKENS * 8];
    __shared__ unsigned pos[GEMV_TOKENS];
    __shared__ long long at[GEMV_TOKENS];
    const int g = (threadIdx.x & 31) >> 2;
    const int per_head = hd / 16, half = hd / 2;
    const int slot = blockIdx.x / per_head, d0 = (blockIdx.x % per_head) * 8;
    if (threadIdx.x < m) {
        cp_async4((float*)&pos[threadIdx.x], (const float*)(positions + threadIdx.x));
        cp_async8(&at[threadIdx.x], slots + threadIdx.x);
    } else if (threadIdx.x >= 32 && threadIdx.x < 32 + 8 * (freq_stride ? m : 1)) {
        const int i = threadIdx.x - 32;
        cp_async4(&freq[i], inv_freq + (size_t)(i / 8) * freq_stride + d0 + i % 8);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    const size_t lo = (size_t)slot * hd + d0;
    wt.template sums<W>(red, lo + g, lo + half + g, x + (size_t)min(g, m - 1) * k, scale, m, rs);
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();  // the copies of other threads
    if (threadIdx.x >= 64) return;
    const int e = threadIdx.x / 32, l = threadIdx.x % 32;
    const int d = d0 + (l >> 2), tok = (l & 3) * 2 + e;
    if (tok >= m) return;
    float a = gemv_sum(red, e, l), b = gemv_sum(red, e + 2, l);
    if (scale.sums) {
        a *= rs[tok];
        b *= rs[tok];
    }
    const size_t kn = (size_t)kv_heads * hd;
    if (slot >= heads + kv_heads) {
        if (at[tok] < 0) return;
        T* c = vc + at[tok] * kn + (slot - heads - kv_heads) * hd;
        st(c + d, a);
        st(c + d + half, b);
        return;
    }
    float sn, cs;
    sincosf((float)pos[tok] * freq[(freq_stride ? tok * 8 : 0) + d - d0], &sn, &cs);
    sn *= mscale;
    cs *= mscale;
    const float ra = a * cs - b * sn, rb = b * cs + a * sn;
    if (slot < heads) {
        float* o = q + (size_t)tok * heads * hd + slot * hd;
        o[d] = ra;
        o[d + half] = rb;
    } else if (at[tok] >= 0) {
        T* c = kc + at[tok] * kn + (slot - heads) * hd;
        st(c + d, ra);
        st(c + d + half, rb);
    }
}

// One tile of 8 tokens: a second one (up to 16 rows) measured slower than cuBLAS at 16
// rows on the H200 (6.14 against 6.02 ms per 8B decode step).
//
// Each kernel comes in two widths: GEMV_WARPS warps a block, and twice as many (`_wide`)
// for grids the GPU holds at two blocks an SM (the host's choice, gemm.rs): at two blocks
// of 8 warps an SM too few loads were in flight to keep HBM busy. The 8B model's o and
// down projections (256 blocks on the H200's 132 SMs) took the batch-1 step from
// 4.21 – 4.22 to 4.16 – 4.20 ms and the batch-8 one from 4.43 to 4.33 – 4.34.
// The plain and gate/up kernels end with a NormScale's three fields (a null `sums` where x is
// final); gemv_res_norm writes such norms.
#define GEMV_SCALE const float *sums, int parts, float eps
// Every GEMV takes its weights as (w, row_bytes, group): 16-bit rows use w alone (DENSE),
// 4-bit and FP8 ones all three (INT4, FP8).
#define GEMV_W const void *w_, long long row_bytes, int group
#define DENSE(T) Dense<T>{(const T*)w_, k}
#define INT4(T) Int4<T>{(const unsigned char*)w_, k, row_bytes, group}
#define FP8(T) Fp8<T>{(const unsigned char*)w_, k, row_bytes, group}
#define GEMV(SUF, T, WT)                                                                                    \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                           \
        gemv_##SUF(GEMV_W, const T* __restrict__ x, float* __restrict__ y, int m, int n, int k, GEMV_SCALE) { \
        gemv<T, decltype(WT(T)), GEMV_WARPS>(WT(T), x, y, m, n, k, NormScale{sums, parts, eps});            \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(2 * GEMV_WARPS * 32)                                       \
        gemv_wide_##SUF(GEMV_W, const T* __restrict__ x, float* __restrict__ y, int m, int n, int k,        \
                        GEMV_SCALE) {                                                                       \
        gemv<T, decltype(WT(T)), 2 * GEMV_WARPS>(WT(T), x, y, m, n, k, NormScale{sums, parts, eps});        \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                           \
        gemv_act_##SUF(GEMV_W, const T* __restrict__ x, float* out, void* out16, int kind, int act, int m,  \
                       int inter, int k, GEMV_SCALE) {                                                      \
        gemv_act<T, decltype(WT(T)), GEMV_WARPS>(WT(T), x, out, out16, kind, act, m, inter, k,              \
                                                 NormScale{sums, parts, eps});                              \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(2 * GEMV_WARPS * 32)                                       \
        gemv_act_wide_##SUF(GEMV_W, const T* __restrict__ x, float* out, void* out16, int kind, int act,    \
                            int m, int inter, int k, GEMV_SCALE) {                                          \
        gemv_act<T, decltype(WT(T)), 2 * GEMV_WARPS>(WT(T), x, out, out16, kind, act, m, inter, k,          \
                                                     NormScale{sums, parts, eps});                          \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                           \
        gemv_res_norm_##SUF(GEMV_W, const T* __restrict__ x, float* residual, const float* nw, void* out16, \
                            int kind, float* sums, int m, int n, int k) {                                   \
        gemv_res_norm<T, decltype(WT(T)), GEMV_WARPS>(WT(T), x, residual, nw, out16, kind, sums, m, n, k);  \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(2 * GEMV_WARPS * 32)                                       \
        gemv_res_norm_wide_##SUF(GEMV_W, const T* __restrict__ x, float* residual, const float* nw,         \
                                 void* out16, int kind, float* sums, int m, int n, int k) {                 \
        gemv_res_norm<T, decltype(WT(T)), 2 * GEMV_WARPS>(WT(T), x, residual, nw, out16, kind, sums, m, n, \
                                                          k);                                               \
    }
#define GEMV_QKV_ROPE(NAME, BOUNDS, WARPS, T, WT)                                                           \
    extern "C" __global__ void __launch_bounds__ BOUNDS                                                     \
        NAME(GEMV_W, const T* __restrict__ x, float* q, T* kc, T* vc, const long long* slots,               \
             const unsigned* positions, const float* inv_freq, int freq_stride, float mscale, int heads,    \
             int kv_heads, int hd, int m, int k, GEMV_SCALE) {                                              \
        gemv_qkv_rope<T, decltype(WT(T)), WARPS>(WT(T), x, q, kc, vc, slots, positions, inv_freq,           \
                                                 freq_stride, mscale, heads, kv_heads, hd, m, k,            \
                                                 NormScale{sums, parts, eps});                              \
    }
GEMV(bf16, __nv_bfloat16, DENSE)
GEMV(f16, __half, DENSE)
GEMV(int4_bf16, __nv_bfloat16, INT4)
GEMV(int4_f16, __half, INT4)
GEMV(fp8_bf16, __nv_bfloat16, FP8)
GEMV(fp8_f16, __half, FP8)
// The wide kernel held to 64 registers, two blocks an SM as the other wide ones (its
// epilogue took it to 72).
GEMV_QKV_ROPE(gemv_qkv_rope_bf16, (GEMV_WARPS * 32), GEMV_WARPS, __nv_bfloat16, DENSE)
GEMV_QKV_ROPE(gemv_qkv_rope_f16, (GEMV_WARPS * 32), GEMV_WARPS, __half, DENSE)
GEMV_QKV_ROPE(gemv_qkv_rope_wide_bf16, (2 * GEMV_WARPS * 32, 2), 2 * GEMV_WARPS, __nv_bfloat16, DENSE)
GEMV_QKV_ROPE(gemv_qkv_rope_wide_f16, (2 * GEMV_WARPS * 32, 2), 2 * GEMV_WARPS, __half, DENSE)
GEMV_QKV_ROPE(gemv_qkv_rope_int4_bf16, (GEMV_WARPS * 32), GEMV_WARPS, __nv_bfloat16, INT4)
GEMV_QKV_ROPE(gemv_qkv_rope_int4_f16, (GEMV_WARPS * 32), GEMV_WARPS, __half, INT4)
GEMV_QKV_ROPE(gemv_qkv_rope_wide_int4_bf16, (2 * GEMV_WARPS * 32, 2), 2 * GEMV_WARPS, __nv_bfloat16, INT4)
GEMV_QKV_ROPE(gemv_qkv_rope_wide_int4_f16, (2 * GEMV_WARPS * 32, 2), 2 * GEMV_WARPS, __half, INT4)
GEMV_QKV_ROPE(gemv_qkv_rope_fp8_bf16, (GEMV_WARPS * 32), GEMV_WARPS, __nv_bfloat16, FP8)
GEMV_QKV_ROPE(gemv_qkv_rope_fp8_f16, (GEMV_WARPS * 32), GEMV_WARPS, __half, FP8)
GEMV_QKV_ROPE(gemv_qkv_rope_wide_fp8_bf16, (2 * GEMV_WARPS * 32, 2), 2 * GEMV_WARPS, __nv_bfloat16, FP8)
GEMV_QKV_ROPE(gemv_qkv_rope_wide_fp8_f16, (2 * GEMV_WARPS * 32, 2), 2 * GEMV_WARPS, __half, FP8)
