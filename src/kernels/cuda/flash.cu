// Prefill attention on tensor cores (FlashAttention-2's schedule) over an f32 cache (16-bit
// and FP8 ones go to flash_prefill_pipe, below): Q, K and V are rounded to bf16, scores and
// the output accumulate in f32 through mma.sync m16n8k16, and the softmax is taken online
// in registers. (common.cuh comes first.)
//
// One block of 4 warps per (tile, query head). A tile is up to 64 consecutive query rows of
// one sequence with consecutive positions (`tiles` holds row0, nrows pairs); each warp owns
// 16 of them. The block walks the sequence's keys 0..last position in chunks of BC, staging
// each chunk's K (row-major) and V (transposed) into shared memory as bf16 from the paged
// cache (looking each key's slot up once per chunk); a warp skips chunks that lie wholly
// after its rows (causal). The mma fragment layouts are given in common.cuh.

#define BR 64
// Keys per chunk: 32 rather than 64 keeps the scores in fewer registers, so that three
// blocks fit an SM (with 64, 180 registers a thread allowed two; measured on the H200:
// 294 → 254 µs for a 1000-token prompt).
#define BC 32

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(unsigned*)&v;
}

// One chunk's causal mask and online softmax for a warp's two rows of a tile (a and b:
// rows g and g + 8 of its 16, at positions pa and pb; -1 for no row): the scores are soft-
// capped (cap > 0), scores of keys after a row's position or before its window (keys wa
// and wb on) are masked, the scores become exp(score - new max) in place, and the running
// sums and the output are rescaled to the new maxima.
template <int HD>
__device__ __forceinline__ void softmax_chunk(float (&s)[BC / 8][4], float (&o)[HD / 8][4], int c0, int tq, int pa,
                                              int pb, int wa, int wb, float cap, float& ma, float& mb, float& la,
                                              float& lb) {
    const float NEG = __int_as_float(0xff800000);  // -inf
    float mxa = ma, mxb = mb;
#pragma unroll
    for (int j = 0; j < BC / 8; j++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            int key = c0 + j * 8 + tq * 2 + e;
            s[j][e] = soft_cap(s[j][e], cap);
            s[j][2 + e] = soft_cap(s[j][2 + e], cap);
            if (key > pa || key < wa) s[j][e] = NEG;
            if (key > pb || key < wb) s[j][2 + e] = NEG;
            mxa = fmaxf(mxa, s[j][e]);
            mxb = fmaxf(mxb, s[j][2 + e]);
        }
    }
    mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffff, mxa, 1));
    mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffff, mxa, 2));
    mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffff, mxb, 1));
    mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffff, mxb, 2));
    // A row with no key yet (or no row at all) keeps a zero base: exp(-inf - 0) = 0.
    float ba = mxa == NEG ? 0.0f : mxa, bb = mxb == NEG ? 0.0f : mxb;
    float fa = expf(ma - ba), fb = expf(mb - bb);
    float sa = 0.0f, sb = 0.0f;
#pragma unroll
    for (int j = 0; j < BC / 8; j++) {
        s[j][0] = expf(s[j][0] - ba);
        s[j][1] = expf(s[j][1] - ba);
        s[j][2] = expf(s[j][2] - bb);
        s[j][3] = expf(s[j][3] - bb);
        sa += s[j][0] + s[j][1];
        sb += s[j][2] + s[j][3];
    }
    la = la * fa + sa;
    lb = lb * fb + sb;
    ma = mxa;
    mb = mxb;
#pragma unroll
    for (int n = 0; n < HD / 8; n++) {
        o[n][0] *= fa;
        o[n][1] *= fa;
        o[n][2] *= fb;
        o[n][3] *= fb;
    }
}

// A warp's two rows of a finished tile (a and b: rows ra and rb from row0, written when
// va and vb): the running sums are joined over the quad's lanes and the output, divided
// by them, stored in f32 and (kind 1 bf16, 2 f16) rounded to 16 bits.
template <int HD>
__device__ __forceinline__ void store_rows(float (&o)[HD / 8][4], float la, float lb, float* __restrict__ out,
                                           void* out16, int kind, int row0, int ra, int rb, bool va, bool vb,
                                           int heads, int h, int tq) {
    la += __shfl_xor_sync(0xffffffff, la, 1);
    la += __shfl_xor_sync(0xffffffff, la, 2);
    lb += __shfl_xor_sync(0xffffffff, lb, 1);
    lb += __shfl_xor_sync(0xffffffff, lb, 2);
    float ia = 1.0f / la, ib = 1.0f / lb;
    // A lane's two adjacent columns in one store: a quad writes 32 contiguous bytes of f32.
#pragma unroll
    for (int n = 0; n < HD / 8; n++) {
        int c = n * 8 + tq * 2;
        if (va) {
            size_t at = ((size_t)(row0 + ra) * heads + h) * HD + c;
            *(float2*)(out + at) = make_float2(o[n][0] * ia, o[n][1] * ia);
            if (kind) store16x2(out16, at, o[n][0] * ia, o[n][1] * ia, kind);
        }
        if (vb) {
            size_t at = ((size_t)(row0 + rb) * heads + h) * HD + c;
            *(float2*)(out + at) = make_float2(o[n][2] * ib, o[n][3] * ib);
            if (kind) store16x2(out16, at, o[n][2] * ib, o[n][3] * ib, kind);
        }
    }
}

template <int HD, typename T>
__device__ void flash_prefill(const float* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc, float* __restrict__ out, void* out16, int kind,
                              const unsigned int* positions, const unsigned int* token_seq,
                              const unsigned int* tables, const unsigned int* table_off, const unsigned int* tiles,
                              int heads, int kv_heads, int block_size, float scale, int window, float softcap) {
    constexpr int KS = HD + 8;  // padded rows: the fragment loads hit 32 distinct banks
    constexpr int VS = BC + 8;
    __shared__ __nv_bfloat16 ks[BC * KS];
    __shared__ __nv_bfloat16 vt[HD * VS];
    __shared__ size_t kv_at[BC];
    const float NEG = __int_as_float(0xff800000);  // -inf
    int row0 = tiles[2 * blockIdx.x], nrows = tiles[2 * blockIdx.x + 1];
    int h = blockIdx.y, kvh = h / (heads / kv_heads);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const unsigned int* table = tables + table_off[token_seq[row0]];
    int ctx_end = positions[row0 + nrows - 1] + 1;
    int width = kv_heads * HD;
    int ra = warp * 16 + g, rb = ra + 8;
    bool va = ra < nrows, vb = rb < nrows;
    int pa = va ? (int)positions[row0 + ra] : -1, pb = vb ? (int)positions[row0 + rb] : -1;
    int last = min(warp * 16 + 15, nrows - 1);
    int warp_end = warp * 16 < nrows ? (int)positions[row0 + last] + 1 : 0;
    // With a sliding window, a row sees the keys from its position - window + 1 on: the
    // block starts at the chunk of the tile's first row's first key, and a warp skips the
    // chunks before its own first row's.
    int wa = window > 0 ? pa - window + 1 : 0, wb = window > 0 ? pb - window + 1 : 0;
    int c_first = window > 0 ? max(0, (int)positions[row0] - window + 1) / BC * BC : 0;
    int warp_lo = window > 0 && warp * 16 < nrows ? (int)positions[row0 + warp * 16] - window + 1 : 0;

    unsigned qf[HD / 16][4];
    const float* qa = q + ((size_t)(row0 + ra) * heads + h) * HD;
    const float* qb = q + ((size_t)(row0 + rb) * heads + h) * HD;
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
        int c = kk * 16 + tq * 2;
        qf[kk][0] = va ? pack_bf16(qa[c] * scale, qa[c + 1] * scale) : 0u;
        qf[kk][1] = vb ? pack_bf16(qb[c] * scale, qb[c + 1] * scale) : 0u;
        qf[kk][2] = va ? pack_bf16(qa[c + 8] * scale, qa[c + 9] * scale) : 0u;
        qf[kk][3] = vb ? pack_bf16(qb[c + 8] * scale, qb[c + 9] * scale) : 0u;
    }
    float o[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float ma = NEG, mb = NEG, la = 0.0f, lb = 0.0f;

    for (int c0 = c_first; c0 < ctx_end; c0 += BC) {
        int cn = min(BC, ctx_end - c0);
        __syncthreads();
        // Where each key row of the chunk lives in the paged cache, looked up once, so that
        // the staging loads below do not each wait on a table load first.
        if (threadIdx.x < BC) {
            int p = c0 + threadIdx.x;
            kv_at[threadIdx.x] =
                threadIdx.x < cn ? ((size_t)table[p / block_size] * block_size + p % block_size) * width + kvh * HD : 0;
        }
        __syncthreads();
        // K row-major: consecutive threads on consecutive columns of a row (coalesced loads,
        // conflict-free stores).
#pragma unroll 4
        for (int i = threadIdx.x; i < BC * (HD / 4); i += blockDim.x) {
            int r = i / (HD / 4), c4 = (i % (HD / 4)) * 4;
            float4 kx = r < cn ? ld4(kc + kv_at[r] + c4) : make_float4(0.f, 0.f, 0.f, 0.f);
            *(unsigned*)&ks[r * KS + c4] = pack_bf16(kx.x, kx.y);
            *(unsigned*)&ks[r * KS + c4 + 2] = pack_bf16(kx.z, kx.w);
        }
        // V transposed: consecutive threads on consecutive rows, so that the column-major
        // stores fall in distinct banks.
#pragma unroll 4
        for (int i = threadIdx.x; i < BC * (HD / 4); i += blockDim.x) {
            int r = i % BC, c4 = (i / BC) * 4;
            float4 vx = r < cn ? ld4(vc + kv_at[r] + c4) : make_float4(0.f, 0.f, 0.f, 0.f);
            vt[(c4 + 0) * VS + r] = __float2bfloat16(vx.x);
            vt[(c4 + 1) * VS + r] = __float2bfloat16(vx.y);
            vt[(c4 + 2) * VS + r] = __float2bfloat16(vx.z);
            vt[(c4 + 3) * VS + r] = __float2bfloat16(vx.w);
        }
        __syncthreads();
        // Every key of the chunk is after this warp's rows, or before their windows.
        if (c0 >= warp_end || c0 + BC <= warp_lo) continue;

        float s[BC / 8][4];
#pragma unroll
        for (int j = 0; j < BC / 8; j++) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                const __nv_bfloat16* kr = ks + (j * 8 + g) * KS + kk * 16 + tq * 2;
                mma_bf16(s[j], qf[kk], *(const unsigned*)kr, *(const unsigned*)(kr + 8));
            }
        }
        softmax_chunk<HD>(s, o, c0, tq, pa, pb, wa, wb, softcap, ma, mb, la, lb);
#pragma unroll
        for (int kk = 0; kk < BC / 16; kk++) {
            unsigned a[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                             pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int n = 0; n < HD / 8; n++) {
                const __nv_bfloat16* vr = vt + (n * 8 + g) * VS + kk * 16 + tq * 2;
                mma_bf16(o[n], a, *(const unsigned*)vr, *(const unsigned*)(vr + 8));
            }
        }
    }
    store_rows<HD>(o, la, lb, out, out16, kind, row0, ra, rb, va, vb, heads, h, tq);
}

#define FLASH_ENTRY(HD, SUF, T)                                                                                 \
    extern "C" __global__ void __launch_bounds__(128, 3) flash_prefill_h##HD##_##SUF(                              \
        const float* q, const T* kc, const T* vc, float* out, void* out16, int kind,                           \
        const unsigned int* positions, const unsigned int* token_seq, const unsigned int* tables,              \
        const unsigned int* table_off, const unsigned int* tiles, int heads, int kv_heads, int head_dim,      \
        int block_size, float scale, int window, float softcap) { grid_dep_sync();                            \
        flash_prefill<HD, T>(q, kc, vc, out, out16, kind, positions, token_seq, tables, table_off, tiles, heads,   \
                          kv_heads, block_size, scale, window, softcap);                                        \
    }

FLASH_ENTRY(64, f32, float)
FLASH_ENTRY(128, f32, float)

// Decode attention on tensor cores (split over partitions of the context, as
// paged_attention_split, whose reduce kernel joins the partitions). Up to `parts_max` warps
// per (query row, KV head), up to four per block, take the row's context in partitions of
// the length the host chose for the row (row_meta; whole chunks of 16 keys, warps past the
// end have nothing to do), each key of the KV head read once for the whole GQA group (up
// to 8 query heads). Keys go 16 at a time, scores and output accumulate in f32 through
// mma.sync m16n8k16, and the softmax is online. A 16-bit cache is staged through shared
// memory and computed in transposed tiles (flash_decode_pipe, below); an f32 one is loaded
// into registers (flash_decode_regs), with the group's query heads as the rows of the A
// fragment.
//
// flash_decode_regs: the mma's k and n indices may stand for any dims as long as both
// operands agree, so they are chosen to make every lane's loads contiguous:
// - scores (k = dims): lane (g, q) loads 8 dims at i·32 + q·8 of key g for i < HD/32; the
//   kk-th mma (kk = 2i + jj) takes elements jj·4 + {0, 1} as b0 and jj·4 + {2, 3} as b1,
//   and the query fragment is loaded the same way;
// - output (n = dims): n index g of output tile tt is dim g·(HD/8) + tt, so lane (g, q)
//   loads dims g·(HD/8) .. + HD/8 of its four keys (2q, 2q+1, 2q+8, 2q+9) and pairs them
//   per dim (the B fragment holds two keys of one dim); its results are dims
//   (2q + e)·(HD/8) + tt.
// Rows g + 8 of the A fragments (past the group) are zero and their results are dropped.

// K and V of a 16-bit cache are used as they are, with the mma of that type; an f32 cache
// is rounded to bf16, and an FP8 one widened to f16 (exactly: every e4m3 value is a half).
template <typename T> struct Frag16 {
    static __device__ __forceinline__ unsigned pack(float lo, float hi) { return pack_bf16(lo, hi); }
    static __device__ __forceinline__ void mma(float& c0, float& c1, unsigned a0, unsigned a2, unsigned b0,
                                               unsigned b1) {
        float d2, d3;  // rows g + 8: dropped
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%10,%11,%12,%13};\n"
            : "=f"(c0), "=f"(c1), "=f"(d2), "=f"(d3)
            : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(c0), "f"(c1), "f"(0.0f), "f"(0.0f));
    }
};
template <> struct Frag16<__half> {
    static __device__ __forceinline__ unsigned pack(float lo, float hi) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *(unsigned*)&v;
    }
    static __device__ __forceinline__ void mma(float& c0, float& c1, unsigned a0, unsigned a2, unsigned b0,
                                               unsigned b1) {
        float d2, d3;  // rows g + 8: dropped
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%10,%11,%12,%13};\n"
            : "=f"(c0), "=f"(c1), "=f"(d2), "=f"(d3)
            : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(c0), "f"(c1), "f"(0.0f), "f"(0.0f));
    }
};

template <> struct Frag16<kv_fp8> : Frag16<__half> {};

// Eight FP8 elements (bytes 0..3 of lo, then of hi) as four f16 pairs.
__device__ __forceinline__ uint4 fp8x8_half(unsigned lo, unsigned hi) {
    __half2 h[4] = {fp8x2_half2(lo), fp8x2_half2(lo >> 16), fp8x2_half2(hi), fp8x2_half2(hi >> 16)};
    return make_uint4(*(unsigned*)&h[0], *(unsigned*)&h[1], *(unsigned*)&h[2], *(unsigned*)&h[3]);
}

// Eight consecutive cache elements as four packed 16-bit pairs (of Frag16's type).
__device__ __forceinline__ uint4 ld8(const __nv_bfloat16* p) { return *(const uint4*)p; }
__device__ __forceinline__ uint4 ld8(const kv_fp8* p) {
    uint2 u = *(const uint2*)p;
    return fp8x8_half(u.x, u.y);
}
__device__ __forceinline__ uint4 ld8(const __half* p) { return *(const uint4*)p; }
__device__ __forceinline__ uint4 ld8(const float* p) {
    float4 a = *(const float4*)p, b = *(const float4*)(p + 4);
    return make_uint4(pack_bf16(a.x, a.y), pack_bf16(a.z, a.w), pack_bf16(b.x, b.y), pack_bf16(b.z, b.w));
}

__device__ __forceinline__ unsigned word(const uint4& u, int i) {
    return i == 0 ? u.x : i == 1 ? u.y : i == 2 ? u.z : u.w;
}

// What a flash_decode warp works on: its lane's place (g, tq), the row t (at place
// blockIdx.y of `rows`), KV head kvh (blockIdx.x), partition pi of the row's keys
// [start, end) (alone: the row's only one) and the row's block table; query head h of the
// group for lane group g (live: inside the group). Blocks go KV head fastest, so that the
// warps that run together read every head of the same keys, whole cache rows, rather than
// one head's slice of many rows (on the H200, +0.9 % throughput).
struct DecodeWarp {
    // lo: the row's first key inside its sliding window (0 without one); parts: the row's
    // partitions.
    int warp, lane, g, tq, t, kvh, pi, start, end, h, lo, parts;
    bool live, alone;
    const unsigned int* table;
};

// Fills `d` from the launch and the row's metadata (context, table offset and partition
// length at row_meta[3 · place]) and the layer's sliding window; false when the warp has nothing to do (past parts_max, or
// a partition past the row's context: the reduction counts alike).
__device__ __forceinline__ bool decode_warp(DecodeWarp& d, const unsigned int* rows, const unsigned int* row_meta,
                                            const unsigned int* tables, int heads, int kv_heads, int parts_max,
                                            int window) {
    d.warp = threadIdx.x >> 5;
    d.lane = threadIdx.x & 31;
    d.g = d.lane >> 2;
    d.tq = d.lane & 3;
    d.kvh = blockIdx.x;
    d.pi = blockIdx.z * (blockDim.x >> 5) + d.warp;
    if (d.pi >= parts_max) return false;
    const unsigned int* meta = row_meta + 3 * blockIdx.y;
    d.t = rows[blockIdx.y];
    int ctx = meta[0], part = meta[2];
    int group = heads / kv_heads;
    d.live = d.g < group;
    d.h = d.kvh * group + d.g;
    // With a sliding window the partitions cover the row's keys from decode_first on.
    const int first = decode_first(ctx, window);
    d.lo = window > 0 ? max(0, ctx - window) : 0;
    d.parts = (ctx - first + part - 1) / part;
    d.start = first + d.pi * part;
    if (d.start >= ctx) return false;
    d.end = min(ctx, d.start + part);
    d.alone = part >= ctx - first;
    d.table = tables + meta[1];
    return true;
}

// The warp's query heads as A fragments, pre-scaled: piece i of a lane covers dims
// i·32 + tq·8 .. + 8, as the K pieces below (rows past the group are zero).
template <int HD, typename T>
__device__ __forceinline__ void decode_query(unsigned (&qa)[HD / 16][2], const float* __restrict__ q, size_t qrow,
                                             bool live, int tq, float scale) {
    typedef Frag16<T> F;
    const float* qr = q + qrow * HD;
#pragma unroll
    for (int i = 0; i < HD / 32; i++) {
        float4 a = live ? *(const float4*)(qr + i * 32 + tq * 8) : make_float4(0.f, 0.f, 0.f, 0.f);
        float4 b = live ? *(const float4*)(qr + i * 32 + tq * 8 + 4) : make_float4(0.f, 0.f, 0.f, 0.f);
        qa[2 * i][0] = F::pack(a.x * scale, a.y * scale);
        qa[2 * i][1] = F::pack(a.z * scale, a.w * scale);
        qa[2 * i + 1][0] = F::pack(b.x * scale, b.y * scale);
        qa[2 * i + 1][1] = F::pack(b.z * scale, b.w * scale);
    }
}

// One chunk of 16 keys, c0 .. c0 + 15 (those from `end` on and before `lo` masked, after the
// soft cap `cap`): the group's scores from
// the lane's K pieces kf[j][i] (key j·8 + g, dims i·32 + tq·8 ..), the online softmax, and
// the output from its V pieces vf[r][i] (key 2tq + (r & 1) + (r >> 1)·8, dims g·HD/8 + i·8 ..;
// zero past `end`, where a stale row could hold NaNs).
template <int HD, typename T>
__device__ __forceinline__ void decode_chunk(const unsigned (&qa)[HD / 16][2], const uint4 (&kf)[2][HD / 32],
                                             const uint4 (&vf)[4][HD / 64], float (&o)[HD / 8][2], float& m,
                                             float& l, int c0, int lo, int end, float cap, int tq) {
    typedef Frag16<T> F;
    constexpr int NC = HD / 32, NT = HD / 8;
    const float NEG = __int_as_float(0xff800000);  // -inf
    float s[2][2];
#pragma unroll
    for (int j = 0; j < 2; j++) {
        s[j][0] = s[j][1] = 0.0f;
#pragma unroll
        for (int i = 0; i < NC; i++) {
            F::mma(s[j][0], s[j][1], qa[2 * i][0], qa[2 * i][1], kf[j][i].x, kf[j][i].y);
            F::mma(s[j][0], s[j][1], qa[2 * i + 1][0], qa[2 * i + 1][1], kf[j][i].z, kf[j][i].w);
        }
    }
    float mx = m;
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int key = c0 + j * 8 + 2 * tq + e;
            s[j][e] = soft_cap(s[j][e], cap);
            if (key >= end || key < lo) s[j][e] = NEG;
            mx = fmaxf(mx, s[j][e]);
        }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
    // A key of the chunk is in the partition and the window: mx is finite.
    float f = expf(m - mx);
    float p[2][2];
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) p[j][e] = expf(s[j][e] - mx);
    l = l * f + p[0][0] + p[0][1] + p[1][0] + p[1][1];
    m = mx;
    unsigned pa0 = F::pack(p[0][0], p[0][1]), pa2 = F::pack(p[1][0], p[1][1]);
#pragma unroll
    for (int n = 0; n < NT; n++) {
        // Dim g·NT + n of keys (2q, 2q+1) and of keys (2q+8, 2q+9), paired.
        int w = (n % 8) / 2, i = n / 8;
        unsigned sel = n % 2 ? 0x7632 : 0x5410;
        unsigned b0 = __byte_perm(word(vf[0][i], w), word(vf[1][i], w), sel);
        unsigned b1 = __byte_perm(word(vf[2][i], w), word(vf[3][i], w), sel);
        o[n][0] *= f;
        o[n][1] *= f;
        F::mma(o[n][0], o[n][1], pa0, pa2, b0, b1);
    }
}

// The warp's result: where it is its row's only part, the output as the reduction would
// write it (the reduction leaves such rows alone); else the part's unnormalized output,
// maximum and sum at its slot (by place in `rows`).
template <int HD>
__device__ __forceinline__ void decode_finish(const float (&o)[HD / 8][2], float m, float l, const DecodeWarp& d,
                                              float* __restrict__ part_out, float* __restrict__ part_max,
                                              float* __restrict__ part_sum, float* __restrict__ out,
                                              void* __restrict__ out16, int kind, int heads, int parts_max) {
    constexpr int NT = HD / 8;
    const int t = d.t, h = d.h, pi = d.pi, tq = d.tq;
    const bool live = d.live, alone = d.alone;
    l += __shfl_xor_sync(0xffffffff, l, 1);
    l += __shfl_xor_sync(0xffffffff, l, 2);
    if (!live) return;
    if (alone) {
        float inv = 1.0f / l;
        size_t at = ((size_t)t * heads + h) * HD;
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                size_t d = at + (2 * tq + e) * NT + n;
                out[d] = o[n][e] * inv;
                if (kind) store16(out16, d, o[n][e] * inv, kind);
            }
        return;
    }
    size_t at = ((size_t)blockIdx.y * heads + h) * parts_max + pi;
    if (tq == 0) {
        part_max[at] = m;
        part_sum[at] = l;
    }
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int e = 0; e < 2; e++) part_out[at * HD + (2 * tq + e) * NT + n] = o[n][e];
}

// The parameters of the flash_decode kernels and of their two bodies, which read head_dim
// as their template's HD (the host passes it as to every attention kernel).
#define DECODE_ARGS(T)                                                                                          \
    const float *q, const T *kc, const T *vc, float *part_out, float *part_max, float *part_sum, float *out,   \
        void *out16, int kind, const unsigned int *rows, const unsigned int *row_meta,                         \
        const unsigned int *tables, int heads, int kv_heads, int head_dim, int block_size, float scale,         \
        int parts_max, int join, int window, float softcap
#define DECODE_CALL                                                                                             \
    (q, kc, vc, part_out, part_max, part_sum, out, out16, kind, rows, row_meta, tables, heads, kv_heads,       \
     head_dim, block_size, scale, parts_max, join, window, softcap)

// An f32 or FP8 cache: each lane loads its K and V pieces of a chunk straight into
// registers (rounded to bf16, widened to f16), every load of the chunk issued before the
// first use.
template <int HD, typename T, bool WHOLE>
__device__ __forceinline__ void flash_decode_regs(DECODE_ARGS(T)) {
    constexpr int NC = HD / 32, NT = HD / 8;
    DecodeWarp d;
    if (!decode_warp(d, rows, row_meta, tables, heads, kv_heads, parts_max, window)) return;
    const int g = d.g, tq = d.tq, kvh = d.kvh, start = d.start, end = d.end, width = kv_heads * HD;
    const unsigned int* table = d.table;
    unsigned qa[HD / 16][2];
    decode_query<HD, T>(qa, q, (size_t)d.t * heads + d.h, d.live, tq, scale);
    float o[NT][2];
#pragma unroll
    for (int n = 0; n < NT; n++) o[n][0] = o[n][1] = 0.0f;
    float m = __int_as_float(0xff800000), l = 0.0f;
    // With cache blocks of 16 keys or more (WHOLE) a chunk lies in one block, `blk`, looked
    // up while the chunk before it is loaded; keys past the partition lie in that same
    // allocated block and are read too, their scores masked and their V rows zeroed.
    // Smaller blocks are looked up key by key, and keys past the partition are not read
    // (row 0). Block sizes are powers of two.
    const int shift = __ffs(block_size) - 1, in_block = block_size - 1;
    unsigned blk = WHOLE ? table[start >> shift] : 0u;
    auto row_at = [&](int p) -> size_t {
        if (!WHOLE && p >= end) return 0;
        unsigned b = WHOLE ? blk : table[p >> shift];
        return ((size_t)b * block_size + (p & in_block)) * width + kvh * HD;
    };
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (int c0 = start; c0 < end; c0 += 16) {
        uint4 kf[2][NC];
#pragma unroll
        for (int j = 0; j < 2; j++) {
            int p = c0 + j * 8 + g;
            size_t at = row_at(p);
#pragma unroll
            for (int i = 0; i < NC; i++) kf[j][i] = WHOLE || p < end ? ld8(kc + at + i * 32 + tq * 8) : zero;
        }
        uint4 vf[4][NT / 8];
#pragma unroll
        for (int r = 0; r < 4; r++) {
            int p = c0 + 2 * tq + (r & 1) + (r >> 1) * 8;
            size_t at = row_at(p);
#pragma unroll
            for (int i = 0; i < NT / 8; i++) {
                uint4 v = WHOLE || p < end ? ld8(vc + at + g * NT + i * 8) : zero;
                vf[r][i] = p < end ? v : zero;
            }
        }
        if (WHOLE && c0 + 16 < end) blk = table[(c0 + 16) >> shift];
        decode_chunk<HD, T>(qa, kf, vf, o, m, l, c0, d.lo, end, softcap, tq);
    }
    decode_finish<HD>(o, m, l, d, part_out, part_max, part_sum, out, out16, kind, heads, parts_max);
}



// A 16-bit cache, transposed tiles: the scores are computed as S^T = K · Q^T, the chunk's
// 16 keys the rows of the A fragment and the group's query heads (up to 8) the columns of
// B, so that no A row is padding; the output likewise as O^T = V^T · P^T. Each warp copies
// its chunks into its own two buffers of shared memory with cp.async, one chunk ahead of
// the one it computes (2 · 2 · 16 rows · HD · 2 bytes a warp), and reads them back with
// ldmatrix (.trans for V); movmatrix turns the scores' C fragment into P^T's B fragment.
// The query is pre-scaled by scale · log2 e, so that the softmax takes exp2. The block
// table entries of the partition are read 32 at a time, one per lane, and handed out by
// shuffles (the next 32 read while these are used); keys past the partition are
// zero-filled, not read. With cache blocks of 16 keys or more (WHOLE) a chunk lies in one
// block, looked up once; smaller blocks are looked up key by key.
//
// A lane (g, tq) holds the scores of keys g and g + 8 for heads 2tq and 2tq + 1, their
// running maxima (m) and its share of their sums (l, summed over g at the end), and the
// output dims mt·16 + g and + 8 of the same two heads.

__device__ __forceinline__ void ldsm_x4_trans(unsigned (&r)[4], const uint4* p) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
// The transpose of the 8 × 8 matrix whose fragment the warp holds (lane: row g, cols 2tq, 2tq + 1).
__device__ __forceinline__ unsigned movmatrix_trans(unsigned x) {
    unsigned y;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

// Piece `seg` (16 bytes) of key row r of a chunk in shared memory: pieces are XOR-permuted
// by the row's low three bits, so that the eight rows an ldmatrix reads at once, and the
// eight pieces a quarter-warp copies, hit distinct groups of four banks (rows are HD · 2
// bytes, a multiple of the 128 bytes of all banks).
template <int HD> __device__ __forceinline__ int decode_piece(int r, int seg) {
    return r * (HD / 8) + (seg ^ (r & 7));
}

// With `join` (a 16-bit cache, all of a row's partitions in one block of up to
// DECODE_JOIN_WARPS warps: the host launches the `flash_decode_join` kernels so), the block
// joins its warps' partitions itself, with paged_attention_reduce_f32's arithmetic, and no
// reduction runs: at batch 1 on the H200 that kernel sat between two others of every
// layer. The warps with a partition (the first `parts` of the block; the others have
// returned) have left their results in their stage buffers (ws: [head][HD] unnormalized
// outputs, then the maxima and the sums of 8 heads) and meet at a barrier of their own.
#define DECODE_JOIN_WARPS 8
template <int HD>
__device__ __forceinline__ void decode_join(const uint4* smem, const DecodeWarp& d, float* __restrict__ out,
                                            void* __restrict__ out16, int kind, int heads, int group) {
    constexpr int CHUNK = 16 * (HD / 8);
    const int parts = d.parts;
    asm volatile("bar.sync 1, %0;" ::"r"(parts * 32) : "memory");
    const float* ws[DECODE_JOIN_WARPS];
#pragma unroll
    for (int p = 0; p < DECODE_JOIN_WARPS; p++) ws[p] = (const float*)(smem + (size_t)p * 4 * CHUNK);
    for (int i = threadIdx.x; i < group * HD; i += parts * 32) {
        const int head = i / HD, dim = i - head * HD;
        float m = -3.0e38f;
#pragma unroll
        for (int p = 0; p < DECODE_JOIN_WARPS; p++)
            if (p < parts) m = fmaxf(m, ws[p][8 * HD + head]);
        float total = 0.0f, acc = 0.0f;
#pragma unroll
        for (int p = 0; p < DECODE_JOIN_WARPS; p++)
            if (p < parts) {
                const float w = expf(ws[p][8 * HD + head] - m);
                total += w * ws[p][8 * HD + 8 + head];
                acc += w * ws[p][i];
            }
        const size_t o = ((size_t)d.t * heads + d.kvh * group + head) * HD + dim;
        out[o] = acc * (1.0f / total);
        if (kind) store16(out16, o, acc * (1.0f / total), kind);
    }
}

template <int HD, typename T, bool WHOLE>
__device__ __forceinline__ void flash_decode_pipe(DECODE_ARGS(T)) {
    typedef Frag16<T> F;
    // Pieces of a key row, uint4s of K (or V) a chunk, rows a pass of 32 lanes copies,
    // k-steps of the scores (= m-tiles of the output).
    constexpr int SEGS = HD / 8, CHUNK = 16 * SEGS, RP = 32 / SEGS, KT = HD / 16;
    const float NEG = __int_as_float(0xff800000);  // -inf
    extern __shared__ uint4 decode_smem[];
    DecodeWarp d;
    // The step's rows, their metadata and block tables were copied before the forward: the
    // warp reads them before PDL's wait (the entry points below leave the wait to it), and
    // the cache and the queries after it. On the H200 the 8B model's batch-1 step (tokens
    // fed on the device) took 3.89 ms so, 3.93 reading the first chunk of keys before the
    // wait too where it held no key of this step (one run), and 3.94 waiting first (the next).
    if (!decode_warp(d, rows, row_meta, tables, heads, kv_heads, parts_max, window)) {
        grid_dep_launch();
        return;
    }
    const int lane = d.lane, g = d.g, tq = d.tq, start = d.start, end = d.end, width = kv_heads * HD;
    const int group = heads / kv_heads;
    const unsigned int* table = d.table;
    const int shift = __ffs(block_size) - 1, in_block = block_size - 1;
    // Entries wbase + lane (cur) and wbase + 32 + lane (next) of the table, up to the last
    // one the partition reads.
    const int last = (end - 1) >> shift;
    int wbase = start >> shift;
    unsigned cur = wbase + lane <= last ? table[wbase + lane] : 0u;
    unsigned next = wbase + 32 + lane <= last ? table[wbase + 32 + lane] : 0u;
    uint4* buf = decode_smem + (size_t)d.warp * 4 * CHUNK;  // [stage][K, V][CHUNK]
    // Each pass of the copy: lane i takes piece i % SEGS of row i / SEGS (+ RP a pass).
    const int r0 = lane / SEGS, seg = lane % SEGS;
    const size_t lane_at = (size_t)r0 * width + d.kvh * HD + seg * 8;

    // Issues the copies of chunk c0 into stage `st`.
    auto stage = [&](int c0, int st) {
        if ((c0 >> shift) - wbase >= 32) {  // a chunk never straddles two windows
            wbase += 32;
            cur = next;
            next = wbase + 32 + lane <= last ? table[wbase + 32 + lane] : 0u;
        }
        uint4* ks = buf + st * 2 * CHUNK;
        if (WHOLE) {
            unsigned b = __shfl_sync(0xffffffff, cur, (c0 >> shift) - wbase);
            const size_t at = ((size_t)b * block_size + (c0 & in_block)) * width + lane_at;
#pragma unroll
            for (int k = 0; k < 16 / RP; k++) {
                int r = r0 + k * RP, i = decode_piece<HD>(r, seg);
                bool ok = c0 + r < end;
                cp_async16(ks + i, kc + at + (size_t)k * RP * width, ok);
                cp_async16(ks + CHUNK + i, vc + at + (size_t)k * RP * width, ok);
            }
        } else {
#pragma unroll
            for (int k = 0; k < 16 / RP; k++) {
                int r = r0 + k * RP, i = decode_piece<HD>(r, seg), p = c0 + r;
                bool ok = p < end;
                unsigned b = __shfl_sync(0xffffffff, cur, ((p >> shift) - wbase) & 31);
                size_t at = ok ? ((size_t)b * block_size + (p & in_block)) * width + d.kvh * HD + seg * 8 : 0;
                cp_async16(ks + i, kc + at, ok);
                cp_async16(ks + CHUNK + i, vc + at, ok);
            }
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };

    grid_dep_wait();
    grid_dep_launch();
    stage(start, 0);
    // Q^T's B fragments: head g (zero past the group), dims kk·16 + 2tq (+ 1) and + 8 (+ 9).
    unsigned qb[KT][2];
    {
        const float* qr = q + ((size_t)d.t * heads + d.h) * HD + 2 * tq;
        const float sc = scale * 1.4426950408889634f;  // log2 e
#pragma unroll
        for (int kk = 0; kk < KT; kk++) {
            float2 a = d.live ? *(const float2*)(qr + kk * 16) : make_float2(0.f, 0.f);
            float2 b = d.live ? *(const float2*)(qr + kk * 16 + 8) : make_float2(0.f, 0.f);
            qb[kk][0] = F::pack(a.x * sc, a.y * sc);
            qb[kk][1] = F::pack(b.x * sc, b.y * sc);
        }
    }
    // ldmatrix row addresses: K's four matrices are (keys 0-7 | 8-15) × (piece 2kk | 2kk + 1),
    // V's (keys 0-7 | 8-15) × (piece 2mt | 2mt + 1), lanes 8j .. 8j + 7 pointing at matrix j's
    // rows; the XOR of decode_piece folds into a lane constant (pieces 2kk are even).
    const int krow = (lane & 7) + ((lane >> 3) & 1) * 8, kx = (lane & 7) ^ (lane >> 4);
    const int vrow = (lane & 7) + (lane >> 4) * 8, vx = (lane & 7) ^ ((lane >> 3) & 1);

    float o[KT][4];
#pragma unroll
    for (int mt = 0; mt < KT; mt++) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.0f;
    float m0 = NEG, m1 = NEG, l0 = 0.0f, l1 = 0.0f;  // heads 2tq and 2tq + 1
    const float cap2 = softcap * 1.4426950408889634f;  // the soft cap in the scores' log2 units
    for (int c0 = start, st = 0; c0 < end; c0 += 16, st ^= 1) {
        if (c0 + 16 < end) {
            stage(c0 + 16, st ^ 1);
            asm volatile("cp.async.wait_group 1;\n" ::);
        } else {
            asm volatile("cp.async.wait_group 0;\n" ::);
        }
        __syncwarp();
        const uint4* ks = buf + st * 2 * CHUNK;
        // Scores in two chains of k-steps, to halve the mma's dependent latency.
        float s[4] = {0.f, 0.f, 0.f, 0.f}, s2[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int kk = 0; kk < KT; kk++) {
            unsigned a[4];
            ldsm_x4(a, ks + krow * SEGS + ((2 * kk) ^ kx));
            mma16<T>(kk & 1 ? s2 : s, a, qb[kk][0], qb[kk][1]);
        }
#pragma unroll
        for (int e = 0; e < 4; e++) s[e] = soft_cap(s[e] + s2[e], cap2);
        if (c0 + g >= end || c0 + g < d.lo) s[0] = s[1] = NEG;
        if (c0 + g + 8 >= end || c0 + g + 8 < d.lo) s[2] = s[3] = NEG;
        // The chunk holds a key inside the partition and the window: the maxima are finite.
        float x0 = fmaxf(m0, fmaxf(s[0], s[2])), x1 = fmaxf(m1, fmaxf(s[1], s[3]));
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) {
            x0 = fmaxf(x0, __shfl_xor_sync(0xffffffff, x0, off));
            x1 = fmaxf(x1, __shfl_xor_sync(0xffffffff, x1, off));
        }
        const float f0 = exp2f(m0 - x0), f1 = exp2f(m1 - x1);
        const float p0 = exp2f(s[0] - x0), p1 = exp2f(s[1] - x1), p2 = exp2f(s[2] - x0), p3 = exp2f(s[3] - x1);
        l0 = l0 * f0 + p0 + p2;
        l1 = l1 * f1 + p1 + p3;
        m0 = x0;
        m1 = x1;
        const unsigned b0 = movmatrix_trans(F::pack(p0, p1)), b1 = movmatrix_trans(F::pack(p2, p3));
        if (__any_sync(0xffffffff, f0 != 1.0f || f1 != 1.0f)) {
#pragma unroll
            for (int mt = 0; mt < KT; mt++) {
                o[mt][0] *= f0;
                o[mt][1] *= f1;
                o[mt][2] *= f0;
                o[mt][3] *= f1;
            }
        }
#pragma unroll
        for (int mt = 0; mt < KT; mt++) {
            unsigned a[4];
            ldsm_x4_trans(a, ks + CHUNK + vrow * SEGS + ((2 * mt) ^ vx));
            mma16<T>(o[mt], a, b0, b1);
        }
        __syncwarp();  // this stage is copied into again two chunks on
    }

    // The result: where the warp is its row's only part, the output as the reduction would
    // write it (the reduction leaves such rows alone); else the part's unnormalized output,
    // maximum (in natural units) and sum at its slot (by place in `rows`), or with `join`
    // in its stage buffers, for the block to join (decode_join).
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
        l0 += __shfl_xor_sync(0xffffffff, l0, off);
        l1 += __shfl_xor_sync(0xffffffff, l1, off);
    }
    if (join && !d.alone) {
        float* ws = (float*)buf;  // [head][HD] outputs, then maxima and sums of 8 heads
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int head = 2 * tq + e;
            if (head >= group) continue;
#pragma unroll
            for (int mt = 0; mt < KT; mt++)
#pragma unroll
                for (int half = 0; half < 2; half++) ws[head * HD + mt * 16 + half * 8 + g] = o[mt][2 * half + e];
            if (g == 0) {
                ws[8 * HD + head] = (e ? m1 : m0) * 0.6931471805599453f;  // ln 2
                ws[8 * HD + 8 + head] = e ? l1 : l0;
            }
        }
        decode_join<HD>(decode_smem, d, out, out16, kind, heads, group);
        return;
    }
#pragma unroll
    for (int e = 0; e < 2; e++) {
        const int head = 2 * tq + e;
        if (head >= group) continue;
        const int h = d.kvh * group + head;
        const float l = e ? l1 : l0, m = e ? m1 : m0;
        if (d.alone) {
            const float inv = 1.0f / l;
            const size_t at = ((size_t)d.t * heads + h) * HD + g;
#pragma unroll
            for (int mt = 0; mt < KT; mt++)
#pragma unroll
                for (int half = 0; half < 2; half++) {
                    size_t i = at + mt * 16 + half * 8;
                    float v = o[mt][2 * half + e] * inv;
                    out[i] = v;
                    if (kind) store16(out16, i, v, kind);
                }
        } else {
            const size_t at = ((size_t)blockIdx.y * heads + h) * parts_max + d.pi;
            if (g == 0) {
                part_max[at] = m * 0.6931471805599453f;  // ln 2
                part_sum[at] = l;
            }
#pragma unroll
            for (int mt = 0; mt < KT; mt++)
#pragma unroll
                for (int half = 0; half < 2; half++) part_out[at * HD + mt * 16 + half * 8 + g] = o[mt][2 * half + e];
        }
    }
}

#define DECODE_ENTRY_REGS(HD, SUF, T)                                                                           \
    extern "C" __global__ void __launch_bounds__(128, 3) flash_decode_h##HD##_##SUF(DECODE_ARGS(T)) {           \
        grid_dep_sync();                                                                                        \
        if (block_size >= 16) flash_decode_regs<HD, T, true> DECODE_CALL;                                       \
        else flash_decode_regs<HD, T, false> DECODE_CALL;                                                       \
    }
#define DECODE_ENTRY_16(HD, SUF, T)                                                                             \
    extern "C" __global__ void __launch_bounds__(128, 3) flash_decode_h##HD##_##SUF(DECODE_ARGS(T)) {           \
        /* PDL's wait: flash_decode_pipe */                                                                     \
        if (block_size >= 16) flash_decode_pipe<HD, T, true> DECODE_CALL;                                      \
        else flash_decode_pipe<HD, T, false> DECODE_CALL;                                                      \
    }

// The same over a 16-bit cache with blocks of up to DECODE_JOIN_WARPS warps, each block
// every partition of its row, which it joins (decode_join).
#define DECODE_JOIN_ENTRY(HD, SUF, T)                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * DECODE_JOIN_WARPS)                                        \
        flash_decode_join_h##HD##_##SUF(DECODE_ARGS(T)) {                                                       \
        /* PDL's wait: flash_decode_pipe */                                                                     \
        if (block_size >= 16) flash_decode_pipe<HD, T, true> DECODE_CALL;                                      \
        else flash_decode_pipe<HD, T, false> DECODE_CALL;                                                      \
    }

DECODE_ENTRY_REGS(64, f32, float)
DECODE_ENTRY_REGS(128, f32, float)
DECODE_ENTRY_REGS(64, fp8, kv_fp8)
DECODE_ENTRY_REGS(128, fp8, kv_fp8)
DECODE_ENTRY_16(64, bf16, __nv_bfloat16)
DECODE_ENTRY_16(128, bf16, __nv_bfloat16)
DECODE_ENTRY_16(64, f16, __half)
DECODE_ENTRY_16(128, f16, __half)
// head_dim 256 (Gemma 2 and 3) over 16-bit caches only: four warps' chunk buffers take 128
// KiB, and the f32 cache's register kernel would spill.
DECODE_ENTRY_16(256, bf16, __nv_bfloat16)
DECODE_ENTRY_16(256, f16, __half)
DECODE_JOIN_ENTRY(64, bf16, __nv_bfloat16)
DECODE_JOIN_ENTRY(128, bf16, __nv_bfloat16)
DECODE_JOIN_ENTRY(64, f16, __half)
DECODE_JOIN_ENTRY(128, f16, __half)

// Prefill attention over a 16-bit or FP8 cache, pipelined: the same tiles and online softmax
// as flash_prefill, for `blockDim.x / 128` query heads of one GQA group at once
// (PREFILL_HEADS, chosen by the host: four warps a head, a warp per 16 rows of the tile), so
// that each chunk's K and V rows are staged once for all of them. The rows are copied into
// shared memory as they are (cp.async, 16 bytes at a time, no conversion) while the previous
// chunk is being computed, into one of two buffers. An FP8 cache's bytes are copied so into
// buffers of their own, then widened by the whole block into the 16-bit ones (f16: every
// e4m3 value is a half), once a chunk for all of the block's heads. V stays row-major:
// ldmatrix .trans hands each lane its B fragment (two keys of one dim). The queries are
// rounded to the 16-bit type into shared memory once, and their A fragments read back by
// ldmatrix per chunk, which keeps the kernel within 128 registers (four blocks of one head,
// or one of four heads, an SM). The mma runs in that 16-bit type. Tiles are taken longest
// first (the last tile of a prompt has the most keys), so that the short ones fill the last
// wave. Dynamic shared memory: prefill_smem_bytes (attend.rs).

// The 16-bit type flash_prefill_pipe computes in over a cache of C, and whether C's rows are
// staged as raw FP8 bytes first.
template <typename C> struct Pipe16 {
    typedef C t;
    static constexpr bool RAW = false;
};
template <> struct Pipe16<kv_fp8> {
    typedef __half t;
    static constexpr bool RAW = true;
};

template <int HD, typename C>
__device__ void flash_prefill_pipe(const float* __restrict__ q, const C* __restrict__ kc, const C* __restrict__ vc,
                                   float* __restrict__ out, void* out16, int kind, const unsigned int* positions,
                                   const unsigned int* token_seq, const unsigned int* tables,
                                   const unsigned int* table_off, const unsigned int* tiles, int heads, int kv_heads,
                                   int block_size, float scale, int window, float softcap) {
    typedef typename Pipe16<C>::t T;
    constexpr bool RAW = Pipe16<C>::RAW;
    typedef Frag16<T> F;
    constexpr int RS = HD + 8;   // padded rows: fragment loads and ldmatrix hit distinct banks
    constexpr int PER = 16 / sizeof(C);  // elements a 16-byte piece of a cache row holds
    constexpr int PIECES = HD / PER;  // 16-byte pieces per row
    extern __shared__ __align__(16) unsigned char prefill_smem[];
    T* ks = reinterpret_cast<T*>(prefill_smem);  // [2][BC * RS]
    T* vs = ks + 2 * BC * RS;                     // [2][BC * RS]
    // FP8 only, after every warp's queries: [2][K, V][BC * HD] bytes.
    unsigned char* raw = reinterpret_cast<unsigned char*>(vs + 2 * BC * RS + (blockDim.x >> 5) * 16 * RS);
    const float NEG = __int_as_float(0xff800000);  // -inf
    int tile = gridDim.x - 1 - blockIdx.x;
    int row0 = tiles[2 * tile], nrows = tiles[2 * tile + 1];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    int rw = warp & 3;  // the warp's 16 rows of the tile
    int h = blockIdx.y * (blockDim.x >> 7) + (warp >> 2), kvh = h / (heads / kv_heads);
    T* qs = vs + 2 * BC * RS + warp * 16 * RS;  // the warp's queries, [16 * RS]
    const unsigned int* table = tables + table_off[token_seq[row0]];
    int ctx_end = positions[row0 + nrows - 1] + 1;
    int width = kv_heads * HD;
    int ra = rw * 16 + g, rb = ra + 8;
    bool va = ra < nrows, vb = rb < nrows;
    int pa = va ? (int)positions[row0 + ra] : -1, pb = vb ? (int)positions[row0 + rb] : -1;
    int last = min(rw * 16 + 15, nrows - 1);
    int warp_end = rw * 16 < nrows ? (int)positions[row0 + last] + 1 : 0;
    // Sliding windows as in flash_prefill.
    int wa = window > 0 ? pa - window + 1 : 0, wb = window > 0 ? pb - window + 1 : 0;
    int c_first = window > 0 ? max(0, (int)positions[row0] - window + 1) / BC * BC : 0;
    int warp_lo = window > 0 && rw * 16 < nrows ? (int)positions[row0 + rw * 16] - window + 1 : 0;

    // Issues the copies of chunk c0 into buffer `buf` (rows past the context are zeros).
    auto stage = [&](int c0, int buf) {
        for (int i = threadIdx.x; i < BC * PIECES; i += blockDim.x) {
            int r = i / PIECES, c = (i % PIECES) * PER;
            int p = c0 + r;
            bool ok = p < ctx_end;
            size_t at = ok ? ((size_t)table[p / block_size] * block_size + p % block_size) * width + kvh * HD : 0;
            if constexpr (RAW) {
                cp_async16(raw + (2 * buf) * BC * HD + r * HD + c, kc + at + c, ok);
                cp_async16(raw + (2 * buf + 1) * BC * HD + r * HD + c, vc + at + c, ok);
            } else {
                cp_async16(&ks[buf * BC * RS + r * RS + c], kc + at + c, ok);
                cp_async16(&vs[buf * BC * RS + r * RS + c], vc + at + c, ok);
            }
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };

    stage(c_first, 0);
    // The warp's 16 query rows, scaled and rounded, 4 values a lane at a time (zeros past
    // the tile).
    for (int r = 0; r < 16; r++) {
        bool ok = rw * 16 + r < nrows;
        for (int c = lane * 4; c < HD; c += 128) {
            float4 v = ok ? *(const float4*)(q + ((size_t)(row0 + rw * 16 + r) * heads + h) * HD + c)
                          : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            *(uint2*)&qs[r * RS + c] = make_uint2(F::pack(v.x * scale, v.y * scale), F::pack(v.z * scale, v.w * scale));
        }
    }
    __syncwarp();
    // ldmatrix.x4 over the queries: lanes 0-15 point at rows 0-15, lanes 16-31 at the same
    // rows 8 columns on, giving a0..a3 of the 16×16 A tile.
    unsigned q_addr = (unsigned)__cvta_generic_to_shared(qs + (lane & 15) * RS + (lane >> 4) * 8);

    float o[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float ma = NEG, mb = NEG, la = 0.0f, lb = 0.0f;

    for (int c0 = c_first, buf = 0; c0 < ctx_end; c0 += BC, buf ^= 1) {
        if (c0 + BC < ctx_end) {
            stage(c0 + BC, buf ^ 1);
            asm volatile("cp.async.wait_group 1;\n" ::);
        } else {
            asm volatile("cp.async.wait_group 0;\n" ::);
        }
        __syncthreads();
        if constexpr (RAW) {
            // The chunk's FP8 rows widened into the 16-bit buffers, 16 elements a thread.
            for (int i = threadIdx.x; i < 2 * BC * (HD / 16); i += blockDim.x) {
                int v = i / (BC * (HD / 16)), j = i % (BC * (HD / 16));
                int r = j / (HD / 16), c = (j % (HD / 16)) * 16;
                uint4 u = *(const uint4*)(raw + (2 * buf + v) * BC * HD + r * HD + c);
                T* dst = (v ? vs : ks) + buf * BC * RS + r * RS + c;
                *(uint4*)dst = fp8x8_half(u.x, u.y);
                *(uint4*)(dst + 8) = fp8x8_half(u.z, u.w);
            }
            __syncthreads();
        }
        if (c0 < warp_end && c0 + BC > warp_lo) {
            const T* kb = ks + buf * BC * RS;
            const T* vb_ = vs + buf * BC * RS;
            float s[BC / 8][4];
#pragma unroll
            for (int j = 0; j < BC / 8; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                unsigned a[4];
                asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                             : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                             : "r"(q_addr + kk * 32));
#pragma unroll
                for (int j = 0; j < BC / 8; j++) {
                    const T* kr = kb + (j * 8 + g) * RS + kk * 16 + tq * 2;
                    mma16<T>(s[j], a, *(const unsigned*)kr, *(const unsigned*)(kr + 8));
                }
            }
            softmax_chunk<HD>(s, o, c0, tq, pa, pb, wa, wb, softcap, ma, mb, la, lb);
#pragma unroll
            for (int kk = 0; kk < BC / 16; kk++) {
                unsigned a[4] = {F::pack(s[2 * kk][0], s[2 * kk][1]), F::pack(s[2 * kk][2], s[2 * kk][3]),
                                 F::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                 F::pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
                // Lanes 0-15 point at keys kk·16 + lane (dims n·8..), lanes 16-31 at the same
                // keys' dims (n+1)·8..: b0, b1 of output tiles n and n+1.
                const T* vrow = vb_ + (kk * 16 + (lane & 15)) * RS + (lane >> 4) * 8;
#pragma unroll
                for (int n = 0; n < HD / 8; n += 2) {
                    unsigned b[4];
                    unsigned addr = (unsigned)__cvta_generic_to_shared(vrow + n * 8);
                    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
                                 : "r"(addr));
                    mma16<T>(o[n], a, b[0], b[1]);
                    mma16<T>(o[n + 1], a, b[2], b[3]);
                }
            }
        }
        __syncthreads();  // the buffer is staged again two chunks on
    }
    store_rows<HD>(o, la, lb, out, out16, kind, row0, ra, rb, va, vb, heads, h, tq);
}

#define FLASH_PIPE_ENTRY(HD, SUF, T)                                                                            \
    extern "C" __global__ void __launch_bounds__(512, 1) flash_prefill_h##HD##_##SUF(                              \
        const float* q, const T* kc, const T* vc, float* out, void* out16, int kind,                           \
        const unsigned int* positions, const unsigned int* token_seq, const unsigned int* tables,              \
        const unsigned int* table_off, const unsigned int* tiles, int heads, int kv_heads, int head_dim,      \
        int block_size, float scale, int window, float softcap) { grid_dep_sync();                            \
        flash_prefill_pipe<HD, T>(q, kc, vc, out, out16, kind, positions, token_seq, tables, table_off, tiles,     \
                                  heads, kv_heads, block_size, scale, window, softcap);                         \
    }

FLASH_PIPE_ENTRY(64, bf16, __nv_bfloat16)
FLASH_PIPE_ENTRY(128, bf16, __nv_bfloat16)
FLASH_PIPE_ENTRY(64, f16, __half)
FLASH_PIPE_ENTRY(128, f16, __half)
FLASH_PIPE_ENTRY(64, fp8, kv_fp8)
FLASH_PIPE_ENTRY(128, fp8, kv_fp8)
