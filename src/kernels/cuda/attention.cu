// Paged KV cache and attention. Cache layout per layer: [num_blocks, block_size, kv_heads,
// head_dim] for K and for V, of type T: f32, bf16/f16 for 16-bit models, or e4m3 bytes
// (entry points end in _f32, _bf16, _f16, _fp8). (common.cuh comes first.)

// K and V are stored divided by the cache's scales (an FP8 cache's per-layer k_scale and
// v_scale, 1 for any other), as the CPU's cache stores them; the attention kernels read
// them unscaled, the host folding k_scale into the softmax scale and v_scale into the
// output (attend.rs).
template <typename T>
__device__ void write_kv(const float* k, const float* v, T* kc, T* vc, const long long* slots, int width,
                         float k_scale, float v_scale) {
    int t = blockIdx.x;
    long long s = slots[t];
    if (s < 0) return;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        st(kc + s * width + i, k[(size_t)t * width + i] / k_scale);
        st(vc + s * width + i, v[(size_t)t * width + i] / v_scale);
    }
}

// The attention kernels below take `rows`, the query rows they handle (the others are left
// to flash_prefill), and write their output also rounded to 16 bits at `out16` when `kind`
// is 1 (bf16) or 2 (f16), for the o_proj GEMM.

// One block per (row, head): scores over the token's visible context (its causal context,
// the last `window` positions of it with a sliding window) through its sequence's block
// table, soft-capped when `softcap` > 0, softmax, weighted sum of V. `tables` holds every
// sequence's block table at `table_off[seq]`. The context is taken ATT_CHUNK positions at
// a time with an online softmax (a running max and sum, the output rescaled as the max
// grows), so that any context length fits the block's shared memory. This kernel serves
// the shapes the split and tensor-core kernels do not (head sizes, and the attention
// options: sliding windows and soft caps).
#define ATT_CHUNK 512
#define ATT_MAX_DIMS 4  // head_dim up to 4 · blockDim.x (128 threads: 512)
template <typename T>
__device__ void paged_attention(const float* q, const T* kc, const T* vc, float* out, void* out16, int kind,
                                const unsigned int* rows, const unsigned int* positions,
                                const unsigned int* token_seq, const unsigned int* tables,
                                const unsigned int* table_off, int heads, int kv_heads, int head_dim,
                                int block_size, float scale, int window, float softcap) {
    __shared__ float scores[ATT_CHUNK];
    __shared__ float red[32];
    int t = rows[blockIdx.x / heads], h = blockIdx.x % heads;
    int kvh = h / (heads / kv_heads);
    int width = kv_heads * head_dim;
    int ctx = positions[t] + 1;
    int start = window > 0 ? max(0, ctx - window) : 0;
    const unsigned int* table = tables + table_off[token_seq[t]];
    const float* qv = q + ((size_t)t * heads + h) * head_dim;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float acc[ATT_MAX_DIMS];
#pragma unroll
    for (int i = 0; i < ATT_MAX_DIMS; i++) acc[i] = 0.0f;
    float m = -3.0e38f, l = 0.0f;
    for (int c0 = start; c0 < ctx; c0 += ATT_CHUNK) {
        int cn = min(ATT_CHUNK, ctx - c0);
        // Scores of the chunk: one warp per position.
        for (int i = warp; i < cn; i += nw) {
            int p = c0 + i;
            size_t at = ((size_t)table[p / block_size] * block_size + p % block_size) * width + kvh * head_dim;
            float s = 0.0f;
            for (int d = lane; d < head_dim; d += 32) s += qv[d] * ld(kc + at + d);
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
            s *= scale;
            if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
            if (lane == 0) scores[i] = s;
        }
        __syncthreads();
        float cm = -3.0e38f;
        for (int i = threadIdx.x; i < cn; i += blockDim.x) cm = fmaxf(cm, scores[i]);
        for (int o = 16; o > 0; o >>= 1) cm = fmaxf(cm, __shfl_xor_sync(0xffffffff, cm, o));
        if (lane == 0) red[warp] = cm;
        __syncthreads();
        cm = -3.0e38f;
        for (int w = 0; w < nw; w++) cm = fmaxf(cm, red[w]);
        __syncthreads();
        float nm = fmaxf(m, cm), rescale = expf(m - nm);
        float sum = 0.0f;
        for (int i = threadIdx.x; i < cn; i += blockDim.x) {
            float e = expf(scores[i] - nm);
            scores[i] = e;
            sum += e;
        }
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
        if (lane == 0) red[warp] = sum;
        __syncthreads();
        sum = 0.0f;
        for (int w = 0; w < nw; w++) sum += red[w];
        l = l * rescale + sum;
        m = nm;
#pragma unroll
        for (int k = 0; k < ATT_MAX_DIMS; k++) {
            int d = threadIdx.x + k * blockDim.x;
            if (d >= head_dim) break;
            float a = acc[k] * rescale;
            for (int i = 0; i < cn; i++) {
                int p = c0 + i;
                size_t at = ((size_t)table[p / block_size] * block_size + p % block_size) * width + kvh * head_dim;
                a += scores[i] * ld(vc + at + d);
            }
            acc[k] = a;
        }
        __syncthreads();
    }
    float inv = 1.0f / l;
#pragma unroll
    for (int k = 0; k < ATT_MAX_DIMS; k++) {
        int d = threadIdx.x + k * blockDim.x;
        if (d >= head_dim) break;
        size_t o = ((size_t)t * heads + h) * head_dim + d;
        out[o] = acc[k] * inv;
        if (kind) store16(out16, o, acc[k] * inv, kind);
    }
}

// Split attention (PagedAttention v2 style), for GQA groups of up to G query heads and
// head_dim up to 32·D (a multiple of 32); instantiated for G in 1, 2, 4, 8 and D in 2, 4, 8
// so that the per-thread arrays take no more registers than the shape needs. One block per (row, KV head, partition of `part`
// positions): the partition's K rows, then its V rows, are staged through shared memory
// CHUNK at a time by all threads at once (so the loads overlap instead of queueing behind
// one another), and each row is read once for the whole group of query heads. The block
// writes its unnormalized partial output, running max and sum; paged_attention_reduce_f32
// joins the partitions. Dynamic shared memory: group · part + CHUNK · head_dim floats.
#define CHUNK 32

// Copies cache rows c0..c0+cn of KV head kvh (through the block table) into `stage` as f32,
// all threads of the block loading at once.
template <typename T>
__device__ __forceinline__ void stage_rows(float* stage, const T* cache, const unsigned int* table, int c0, int cn,
                                           int kv_heads, int kvh, int head_dim, int block_size) {
    int hd4 = head_dim / 4;
    for (int i = threadIdx.x; i < cn * hd4; i += blockDim.x) {
        int p = c0 + i / hd4;
        size_t at = (((size_t)table[p / block_size] * block_size + p % block_size) * kv_heads + kvh) * head_dim;
        ((float4*)stage)[i] = ld4(cache + at + 4 * (i % hd4));
    }
}

template <typename T, int MAX_GROUP, int MAX_DIM_PER_LANE>
__device__ void paged_attention_split(const float* q, const T* kc, const T* vc, float* part_out, float* part_max,
                                      float* part_sum, const unsigned int* rows, const unsigned int* positions,
                                      const unsigned int* token_seq, const unsigned int* tables,
                                      const unsigned int* table_off, int heads, int kv_heads, int head_dim,
                                      int block_size, float scale, int part, int parts_max) {
    extern __shared__ float smem[];
    int group = heads / kv_heads;
    float* sc = smem;
    float* stage = smem + group * part;
    int t = rows[blockIdx.x], kvh = blockIdx.y, pi = blockIdx.z;
    int ctx = positions[t] + 1;
    int start = pi * part;
    if (start >= ctx) return;  // the reduction reads only partitions inside the context
    int end = min(ctx, start + part);
    const unsigned int* table = tables + table_off[token_seq[t]];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int per_lane = head_dim / 32;
    // Register arrays are indexed only by unrolled constant loops (guarded by the runtime
    // sizes): a runtime index would put them in local memory.
    float qr[MAX_GROUP][MAX_DIM_PER_LANE];
#pragma unroll
    for (int g = 0; g < MAX_GROUP; g++)
#pragma unroll
        for (int i = 0; i < MAX_DIM_PER_LANE; i++)
            qr[g][i] = g < group && i < per_lane
                           ? q[((size_t)t * heads + kvh * group + g) * head_dim + lane + 32 * i] * scale
                           : 0.0f;
    for (int c0 = start; c0 < end; c0 += CHUNK) {
        int cn = min(CHUNK, end - c0);
        __syncthreads();
        stage_rows(stage, kc, table, c0, cn, kv_heads, kvh, head_dim, block_size);
        __syncthreads();
        for (int r = warp; r < cn; r += nw) {
            float kr[MAX_DIM_PER_LANE];
#pragma unroll
            for (int i = 0; i < MAX_DIM_PER_LANE; i++) kr[i] = i < per_lane ? stage[r * head_dim + lane + 32 * i] : 0.0f;
            float s[MAX_GROUP];
#pragma unroll
            for (int g = 0; g < MAX_GROUP; g++) {
                s[g] = 0.0f;
#pragma unroll
                for (int i = 0; i < MAX_DIM_PER_LANE; i++) s[g] += qr[g][i] * kr[i];
            }
            // The group's sums reduced together: independent shuffles overlap.
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
#pragma unroll
                for (int g = 0; g < MAX_GROUP; g++)
                    if (g < group) s[g] += __shfl_xor_sync(0xffffffff, s[g], o);
            if (lane == 0)
#pragma unroll
                for (int g = 0; g < MAX_GROUP; g++)
                    if (g < group) sc[g * part + (c0 - start) + r] = s[g];
        }
    }
    __syncthreads();
    int n = end - start;
    for (int g = warp; g < group; g += nw) {
        float m = -3.0e38f;
        for (int j = lane; j < n; j += 32) m = fmaxf(m, sc[g * part + j]);
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
        float sum = 0.0f;
        for (int j = lane; j < n; j += 32) {
            float e = expf(sc[g * part + j] - m);
            sc[g * part + j] = e;
            sum += e;
        }
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
        if (lane == 0) {
            size_t at = ((size_t)blockIdx.x * heads + kvh * group + g) * parts_max + pi;
            part_max[at] = m;
            part_sum[at] = sum;
        }
    }
    // Each thread owns dims threadIdx.x and threadIdx.x + blockDim.x (head_dim ≤ 2·blockDim).
    float acc[MAX_GROUP][2];
#pragma unroll
    for (int g = 0; g < MAX_GROUP; g++) acc[g][0] = acc[g][1] = 0.0f;
    for (int c0 = start; c0 < end; c0 += CHUNK) {
        int cn = min(CHUNK, end - c0);
        __syncthreads();
        stage_rows(stage, vc, table, c0, cn, kv_heads, kvh, head_dim, block_size);
        __syncthreads();
#pragma unroll
        for (int di = 0; di < 2; di++) {
            int d = threadIdx.x + di * blockDim.x;
            if (d < head_dim)
                for (int j = 0; j < cn; j++) {
                    float v = stage[j * head_dim + d];
                    const float* w = sc + (c0 - start) + j;
#pragma unroll
                    for (int g = 0; g < MAX_GROUP; g++)
                        if (g < group) acc[g][di] += w[g * part] * v;
                }
        }
    }
#pragma unroll
    for (int di = 0; di < 2; di++) {
        int d = threadIdx.x + di * blockDim.x;
        if (d < head_dim)
#pragma unroll
            for (int g = 0; g < MAX_GROUP; g++)
                if (g < group)
                    part_out[(((size_t)blockIdx.x * heads + kvh * group + g) * parts_max + pi) * head_dim + d] = acc[g][di];
    }
}

#define KV_ENTRIES(SUF, T)                                                                                     \
    extern "C" __global__ void write_kv_##SUF(const float* k, const float* v, T* kc, T* vc,                     \
                                              const long long* slots, int width, float k_scale,                 \
                                              float v_scale) { grid_dep_sync();                                 \
        write_kv<T>(k, v, kc, vc, slots, width, k_scale, v_scale);                                              \
    }                                                                                                           \
    extern "C" __global__ void paged_attention_##SUF(                                                           \
        const float* q, const T* kc, const T* vc, float* out, void* out16, int kind, const unsigned int* rows,  \
        const unsigned int* positions, const unsigned int* token_seq, const unsigned int* tables,              \
        const unsigned int* table_off, int heads, int kv_heads, int head_dim, int block_size, float scale,      \
        int window, float softcap) {                                                                           \
        grid_dep_sync();                                                                                       \
        paged_attention<T>(q, kc, vc, out, out16, kind, rows, positions, token_seq, tables, table_off, heads,  \
                           kv_heads, head_dim, block_size, scale, window, softcap);                             \
    }

#define SPLIT_ENTRY(SUF, T, G, D)                                                                              \
    extern "C" __global__ void paged_attention_split_g##G##_d##D##_##SUF(                                       \
        const float* q, const T* kc, const T* vc, float* part_out, float* part_max, float* part_sum,           \
        const unsigned int* rows, const unsigned int* positions, const unsigned int* token_seq,                \
        const unsigned int* tables, const unsigned int* table_off, int heads, int kv_heads, int head_dim,      \
        int block_size, float scale, int part, int parts_max) { grid_dep_sync();                               \
        paged_attention_split<T, G, D>(q, kc, vc, part_out, part_max, part_sum, rows, positions, token_seq,    \
                                       tables, table_off, heads, kv_heads, head_dim, block_size, scale, part,   \
                                       parts_max);                                                              \
    }
#define SPLIT_ENTRIES_G(SUF, T, G) SPLIT_ENTRY(SUF, T, G, 2) SPLIT_ENTRY(SUF, T, G, 4) SPLIT_ENTRY(SUF, T, G, 8)
#define SPLIT_ENTRIES(SUF, T) \
    SPLIT_ENTRIES_G(SUF, T, 1) SPLIT_ENTRIES_G(SUF, T, 2) SPLIT_ENTRIES_G(SUF, T, 4) SPLIT_ENTRIES_G(SUF, T, 8)

KV_ENTRIES(f32, float)
KV_ENTRIES(bf16, __nv_bfloat16)
KV_ENTRIES(f16, __half)
KV_ENTRIES(fp8, kv_fp8)
SPLIT_ENTRIES(f32, float)
SPLIT_ENTRIES(bf16, __nv_bfloat16)
SPLIT_ENTRIES(f16, __half)
SPLIT_ENTRIES(fp8, kv_fp8)

// paged_attention_reduce_f32 for a (row, head) of at most REDUCE_REGS parts, as the loops
// below compute it (same order, same values) but with each thread's loads issued at once:
// at batch 1 the reduction sits between two kernels of the decode step, and three rounds
// of dependent loads were most of its time.
#define REDUCE_REGS 16
__device__ __forceinline__ void reduce_in_registers(const float* part_out, const float* part_max,
                                                    const float* part_sum, float* out, void* out16, int kind,
                                                    size_t base, size_t o0, int head_dim, int parts) {
    float pm[REDUCE_REGS], ps[REDUCE_REGS];
#pragma unroll
    for (int p = 0; p < REDUCE_REGS; p++) {
        pm[p] = p < parts ? part_max[base + p] : 0.0f;
        ps[p] = p < parts ? part_sum[base + p] : 0.0f;
    }
    float m = -3.0e38f;
#pragma unroll
    for (int p = 0; p < REDUCE_REGS; p++)
        if (p < parts) m = fmaxf(m, pm[p]);
    float total = 0.0f;
#pragma unroll
    for (int p = 0; p < REDUCE_REGS; p++)
        if (p < parts) {
            pm[p] = expf(pm[p] - m);  // the part's weight from here on
            total += pm[p] * ps[p];
        }
    float inv = 1.0f / total;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float po[REDUCE_REGS];
#pragma unroll
        for (int p = 0; p < REDUCE_REGS; p++) po[p] = p < parts ? part_out[(base + p) * head_dim + d] : 0.0f;
        float acc = 0.0f;
#pragma unroll
        for (int p = 0; p < REDUCE_REGS; p++)
            if (p < parts) acc += pm[p] * po[p];
        out[o0 + d] = acc * inv;
        if (kind) store16(out16, o0 + d, acc * inv, kind);
    }
}

// Joins the partitions of paged_attention_split (`part` positions each) or of flash_decode
// (`part` 0: the row's own partition length is at row_meta[3i + 2]; a row of one partition
// was written by flash_decode). Partial results are indexed by the row's place i in
// `rows`, so they take rows · heads · parts_max slots whatever the step's prefill rows;
// the row's context length is at row_meta[3i]; flash_decode's partitions of a row with a
// sliding window (`window` > 0) start at its decode_first. Two kernels:
// - paged_attention_reduce_f32: one block per (row, head), a thread per dim looping over
//   the parts; it spreads a few rows over many SMs;
// - paged_attention_reduce_warp_f32: one warp per (row, head), four to a block, for many
//   rows (a block per head took 12.8 µs at 256 rows of the 8B shape on the H200; a warp
//   each took the step from 10.46 to 10.06 ms, but batch 1 from 4.71 to 4.80).
extern "C" __global__ void paged_attention_reduce_f32(const float* part_out, const float* part_max,
                                                      const float* part_sum, float* out, void* out16, int kind,
                                                      const unsigned int* rows, const unsigned int* row_meta,
                                                      int heads, int head_dim, int part, int parts_max,
                                                      int window) {
    grid_dep_sync();
    int i = blockIdx.x / heads, h = blockIdx.x % heads;
    int t = rows[i], ctx = row_meta[3 * i];
    bool flash = part == 0;
    if (flash) part = row_meta[3 * i + 2];
    int first = flash ? decode_first(ctx, window) : 0;
    int parts = (ctx - first + part - 1) / part;
    if (flash && parts == 1) return;  // flash_decode wrote the output
    size_t base = ((size_t)i * heads + h) * parts_max;
    if (parts <= REDUCE_REGS) {
        reduce_in_registers(part_out, part_max, part_sum, out, out16, kind, base,
                            ((size_t)t * heads + h) * head_dim, head_dim, parts);
        return;
    }
    float m = -3.0e38f;
    for (int p = 0; p < parts; p++) m = fmaxf(m, part_max[base + p]);
    float total = 0.0f;
    for (int p = 0; p < parts; p++) total += expf(part_max[base + p] - m) * part_sum[base + p];
    float inv = 1.0f / total;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int p = 0; p < parts; p++) acc += expf(part_max[base + p] - m) * part_out[(base + p) * head_dim + d];
        size_t o = ((size_t)t * heads + h) * head_dim + d;
        out[o] = acc * inv;
        if (kind) store16(out16, o, acc * inv, kind);
    }
}

// Lane p reads the maxima and sums of parts p, p + 32, ...; the warp agrees on the largest
// maximum and on the total, then each lane adds up dims lane, lane + 32, ... over the parts
// (head_dim is a multiple of 32, at most 256, for both kernels that leave partitions).
// `n` is rows · heads.
extern "C" __global__ void paged_attention_reduce_warp_f32(const float* part_out, const float* part_max,
                                                           const float* part_sum, float* out, void* out16,
                                                           int kind, const unsigned int* rows,
                                                           const unsigned int* row_meta, int heads, int head_dim,
                                                           int part, int parts_max, int n, int window) {
    grid_dep_sync();
    int lane = threadIdx.x & 31;
    int slot = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);  // place in rows · heads + head
    if (slot >= n) return;
    int i = slot / heads, h = slot % heads;
    int t = rows[i], ctx = row_meta[3 * i];
    bool flash = part == 0;
    if (flash) part = row_meta[3 * i + 2];
    int first = flash ? decode_first(ctx, window) : 0;
    int parts = (ctx - first + part - 1) / part;
    if (flash && parts == 1) return;  // flash_decode wrote the output
    size_t base = (size_t)slot * parts_max;
    float m = -3.0e38f;
    for (int p = lane; p < parts; p += 32) m = fmaxf(m, part_max[base + p]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, off));
    float total = 0.0f;
    for (int p = lane; p < parts; p += 32) total += expf(part_max[base + p] - m) * part_sum[base + p];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffff, total, off);
    float inv = 1.0f / total;
    constexpr int MAX_PER_LANE = 8;
    int per_lane = head_dim / 32;
    float acc[MAX_PER_LANE];
#pragma unroll
    for (int k = 0; k < MAX_PER_LANE; k++) acc[k] = 0.0f;
#pragma unroll 4
    for (int p = 0; p < parts; p++) {
        float w = expf(part_max[base + p] - m);
        const float* po = part_out + (base + p) * head_dim + lane;
#pragma unroll
        for (int k = 0; k < MAX_PER_LANE; k++)
            if (k < per_lane) acc[k] += w * po[32 * k];
    }
#pragma unroll
    for (int k = 0; k < MAX_PER_LANE; k++) {
        if (k >= per_lane) break;
        size_t o = ((size_t)t * heads + h) * head_dim + lane + 32 * k;
        out[o] = acc[k] * inv;
        if (kind) store16(out16, o, acc[k] * inv, kind);
    }
}
