// Row-wise and element-wise ops on f32 activations [rows, cols] (row-major).
// Entry points are named {op}_{dtype}; each launch uses one block per row unless noted.
// (common.cuh comes first.)

extern "C" __global__ void embedding_f32(const float* table, const unsigned int* ids, float* out, int hidden) {
    grid_dep_sync();
    int row = blockIdx.x;
    const float* src = table + (size_t)ids[row] * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[(size_t)row * hidden + i] = src[i];
}

// Block-wide sum of a float (blockDim.x a multiple of 32, at most 1024).
__device__ float block_sum(float v) {
    __shared__ float warp_sums[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    int nw = blockDim.x >> 5;
    v = lane < nw ? warp_sums[lane] : 0.0f;
    if (warp == 0)
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    if (threadIdx.x == 0) warp_sums[0] = v;
    __syncthreads();
    float total = warp_sums[0];
    __syncthreads();
    return total;
}

// HF LlamaRMSNorm: w * (x * rsqrt(mean(x^2) + eps)). With `residual`, first residual += x
// and the norm is taken of the sum (written back to residual). With `kind` 1 (bf16) or 2
// (f16) the output is also written rounded to 16 bits at `out16`, for the next GEMM; with
// `out` null, only there. blockDim.x up to 1024.
//
// A decode step of a few sequences waits on this kernel between two GEMVs, so its latency
// counts: where the row is float4s and each thread has at most NORM_VECS of them (rows up
// to 16,384 values at 1024 threads), the thread keeps its values in registers between the
// sum and the output instead of reading them again, and loads its norm weights before
// waiting for the kernel before (PDL, common.cuh: they do not depend on it). The sum runs
// in the same order either way.
//
// With `pre_w` (only where the row fits the registers), x is first normed itself, with its
// own sum, weights pre_w and pre_eps: residual += norm(x), then the norm of the sum (Gemma
// 2's norm after each block, then the next block's norm, in one kernel).
#define NORM_VECS 4
extern "C" __global__ void rms_norm_f32(const float* __restrict__ x, float* __restrict__ residual, int use_residual,
                                        const float* __restrict__ w, const float* __restrict__ pre_w, float pre_eps,
                                        float* __restrict__ out, void* out16, int kind, int cols, float eps) {
    size_t base = (size_t)blockIdx.x * cols;
    const float* xr = x + base;
    float* rr = use_residual ? residual + base : nullptr;
    float ss = 0.0f;
    const int n4 = cols / 4;
    if ((cols & 3) == 0 && n4 <= NORM_VECS * (int)blockDim.x) {
        const float4* x4 = (const float4*)xr;
        float4* r4 = (float4*)rr;
        float4 g[NORM_VECS], v[NORM_VECS];
#pragma unroll
        for (int j = 0; j < NORM_VECS; j++) {
            int i = threadIdx.x + j * blockDim.x;
            if (i < n4) g[j] = ((const float4*)w)[i];
        }
        grid_dep_sync();
        if (pre_w) {
            float ps = 0.0f;
#pragma unroll
            for (int j = 0; j < NORM_VECS; j++) {
                int i = threadIdx.x + j * blockDim.x;
                if (i >= n4) continue;
                v[j] = x4[i];
                ps += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
            }
            float prs = rsqrtf(block_sum(ps) / cols + pre_eps);
#pragma unroll
            for (int j = 0; j < NORM_VECS; j++) {
                int i = threadIdx.x + j * blockDim.x;
                if (i >= n4) continue;
                float4 p = ((const float4*)pre_w)[i];
                v[j] = make_float4(p.x * (v[j].x * prs), p.y * (v[j].y * prs), p.z * (v[j].z * prs),
                                   p.w * (v[j].w * prs));
            }
        }
#pragma unroll
        for (int j = 0; j < NORM_VECS; j++) {
            int i = threadIdx.x + j * blockDim.x;
            if (i >= n4) continue;
            if (!pre_w) v[j] = x4[i];
            if (r4) {
                float4 r = r4[i];
                v[j].x += r.x; v[j].y += r.y; v[j].z += r.z; v[j].w += r.w;
                r4[i] = v[j];
            }
            ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
        }
        float rs = rsqrtf(block_sum(ss) / cols + eps);
#pragma unroll
        for (int j = 0; j < NORM_VECS; j++) {
            int i = threadIdx.x + j * blockDim.x;
            if (i >= n4) continue;
            float4 o = make_float4(g[j].x * (v[j].x * rs), g[j].y * (v[j].y * rs), g[j].z * (v[j].z * rs),
                                   g[j].w * (v[j].w * rs));
            if (out) ((float4*)(out + base))[i] = o;
            if (kind) store16x4(out16, base + 4 * i, o.x, o.y, o.z, o.w, kind);
        }
        return;
    }
    grid_dep_sync();
    bool vec = (cols & 3) == 0;
    if (vec) {
        const float4* x4 = (const float4*)xr;
        float4* r4 = (float4*)rr;
        for (int i = threadIdx.x; i < n4; i += blockDim.x) {
            float4 v = x4[i];
            if (r4) {
                float4 r = r4[i];
                v.x += r.x; v.y += r.y; v.z += r.z; v.w += r.w;
                r4[i] = v;
            }
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
        for (int i = threadIdx.x; i < cols; i += blockDim.x) {
            float v = xr[i];
            if (rr) { v += rr[i]; rr[i] = v; }
            ss += v * v;
        }
    }
    ss = block_sum(ss);  // also orders the residual writes before the reads below
    float r = rsqrtf(ss / cols + eps);
    const float* src = rr ? rr : xr;
    if (vec) {
        const float4* s4 = (const float4*)src;
        const float4* w4 = (const float4*)w;
        float4* o4 = (float4*)(out + base);
        for (int i = threadIdx.x; i < n4; i += blockDim.x) {
            float4 v = s4[i], g = w4[i];
            float4 o = make_float4(g.x * (v.x * r), g.y * (v.y * r), g.z * (v.z * r), g.w * (v.w * r));
            if (out) o4[i] = o;
            if (kind) store16x4(out16, base + 4 * i, o.x, o.y, o.z, o.w, kind);
        }
    } else {
        for (int i = threadIdx.x; i < cols; i += blockDim.x) {
            float o = w[i] * (src[i] * r);
            if (out) out[base + i] = o;
            if (kind) store16(out16, base + i, o, kind);
        }
    }
}

// act(gate) · up of gate_up = [rows, 2·inter] (gate then up), read as T: f32, or the
// 16-bit type in which a GEMM of 16-bit weights wrote it. One thread per silu_width columns
// (8 of a 16-bit input where inter allows, in 16-byte loads; else 4), grid (column blocks,
// up to 65535 row blocks striding over the rows): no division per element. The f32 result
// is not written where `out` is null (the 16-bit copy is all the next GEMM reads).
template <typename T> __device__ __forceinline__ int silu_width(int inter) {
    return sizeof(T) == 2 && (inter & 7) == 0 ? 8 : 4;
}

template <typename T>
__device__ __forceinline__ void act_mul(const T* __restrict__ gate_up, float* __restrict__ out, void* out16, int kind,
                                        int inter, int rows, int act) {
    const int width = silu_width<T>(inter);
    int c = width * (blockIdx.x * blockDim.x + threadIdx.x);
    if (c >= inter) return;
    for (size_t row = blockIdx.y; row < (size_t)rows; row += gridDim.y) {
        const T* g = gate_up + row * 2 * inter + c;
        const T* u = g + inter;
        size_t o = row * inter + c;
        if constexpr (sizeof(T) == 2) {
            if (width == 8) {
                float gv[8], uv[8], r[8];
                ld8f(g, gv);
                ld8f(u, uv);
#pragma unroll
                for (int j = 0; j < 8; j++) r[j] = act_fn(gv[j], act) * uv[j];
                if (out) {
                    *(float4*)(out + o) = make_float4(r[0], r[1], r[2], r[3]);
                    *(float4*)(out + o + 4) = make_float4(r[4], r[5], r[6], r[7]);
                }
                if (kind) {
                    store16x4(out16, o, r[0], r[1], r[2], r[3], kind);
                    store16x4(out16, o + 4, r[4], r[5], r[6], r[7], kind);
                }
                continue;
            }
        }
        float gv[4], uv[4];
        int n = min(4, inter - c);
        if (n == 4 && (inter & 3) == 0) {
            float4 a = ld4(g), b = ld4(u);
            gv[0] = a.x; gv[1] = a.y; gv[2] = a.z; gv[3] = a.w;
            uv[0] = b.x; uv[1] = b.y; uv[2] = b.z; uv[3] = b.w;
        } else {
            for (int j = 0; j < n; j++) gv[j] = ld(g + j), uv[j] = ld(u + j);
        }
        float r[4];
    #pragma unroll
        for (int j = 0; j < 4; j++) r[j] = act_fn(gv[j], act) * uv[j];
        if (n == 4 && (inter & 3) == 0) {
            if (out) *(float4*)(out + o) = make_float4(r[0], r[1], r[2], r[3]);
            if (kind) store16x4(out16, o, r[0], r[1], r[2], r[3], kind);
        } else {
            if (out)
                for (int j = 0; j < n; j++) out[o + j] = r[j];
            if (kind)
                for (int j = 0; j < n; j++) store16(out16, o + j, r[j], kind);
        }
    }
}

#define ACT_MUL_ENTRY(SUF, T)                                                                                    \
    extern "C" __global__ void act_mul_##SUF(const T* __restrict__ gate_up, float* __restrict__ out, void* out16, \
                                             int kind, int inter, int rows, int act) { grid_dep_sync();           \
        act_mul(gate_up, out, out16, kind, inter, rows, act);                                                    \
    }
ACT_MUL_ENTRY(f32, float)
ACT_MUL_ENTRY(bf16, __nv_bfloat16)
ACT_MUL_ENTRY(f16, __half)

// In-place element-wise ops on n values: an activation, a scale, a soft cap.
extern "C" __global__ void activation_f32(float* x, long long n, int act) {
    grid_dep_sync();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = act_fn(x[i], act);
}
extern "C" __global__ void scale_f32(float* x, long long n, float s) {
    grid_dep_sync();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}
extern "C" __global__ void softcap_f32(float* x, long long n, float cap) {
    grid_dep_sync();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = cap * tanhf(x[i] / cap);
}

// LayerNorm of each row (one block a row): (x − mean) · rsqrt(var + eps) · w (+ b), with the
// biased variance, as torch computes it.
extern "C" __global__ void layer_norm_f32(const float* __restrict__ x, const float* __restrict__ w,
                                          const float* __restrict__ b, int has_bias, float* __restrict__ out, int cols,
                                          float eps) {
    grid_dep_sync();
    const float* xr = x + (size_t)blockIdx.x * cols;
    float s = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) s += xr[i];
    float mean = block_sum(s) / cols;
    float v = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        float d = xr[i] - mean;
        v += d * d;
    }
    float r = rsqrtf(block_sum(v) / cols + eps);
    for (int i = threadIdx.x; i < cols; i += blockDim.x)
        out[(size_t)blockIdx.x * cols + i] = (xr[i] - mean) * r * w[i] + (has_bias ? b[i] : 0.0f);
}

// RMSNorm over each head of q and k in a fused [n, (heads + 2·kv_heads)·head_dim] projection,
// in place: one block per (token, head of q or k); q's heads then k's lie side by side.
extern "C" __global__ void qk_norm_f32(float* __restrict__ qkv, const float* __restrict__ qw,
                                       const float* __restrict__ kw, int cols, int heads, int head_dim, float eps) {
    grid_dep_sync();
    int h = blockIdx.y;
    float* p = qkv + (size_t)blockIdx.x * cols + (size_t)h * head_dim;
    const float* w = h < heads ? qw : kw;
    float ss = 0.0f;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) ss += p[d] * p[d];
    float r = rsqrtf(block_sum(ss) / head_dim + eps);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) p[d] = w[d] * (p[d] * r);
}

// Learned position embeddings: out[t] = table[positions[t] + offset] (one block a token).
template <typename T>
__device__ __forceinline__ void embed_positions(const T* table, const unsigned int* positions, float* out, int hidden,
                                                int offset) {
    int row = blockIdx.x;
    const T* src = table + (size_t)(positions[row] + offset) * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[(size_t)row * hidden + i] = ld(src + i);
}
#define EMBED_POSITIONS_ENTRY(SUF, T)                                                                           \
    extern "C" __global__ void embed_positions_##SUF(const T* table, const unsigned int* positions, float* out, \
                                                     int hidden, int offset) { grid_dep_sync();                \
        embed_positions<T>(table, positions, out, hidden, offset);                                             \
    }
EMBED_POSITIONS_ENTRY(f32, float)
EMBED_POSITIONS_ENTRY(bf16, __nv_bfloat16)
EMBED_POSITIONS_ENTRY(f16, __half)

extern "C" __global__ void add_f32(float* acc, const float* x, long long n) {
    grid_dep_sync();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) acc[i] += x[i];
}

extern "C" __global__ void add_bias_f32(float* y, const float* b, int cols, long long n) {
    grid_dep_sync();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += b[i % cols];
}

extern "C" __global__ void gather_rows_f32(const float* x, const unsigned int* rows, float* out, int cols) {
    grid_dep_sync();
    int r = blockIdx.x;
    const float* src = x + (size_t)rows[r] * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) out[(size_t)r * cols + i] = src[i];
}

// Tensor parallelism: `parts` holds each rank's [rows, cols] shard one after another (NCCL's
// all-gather); out[r, s*keep + j] = parts[s][r, j] for j < keep, cut at `total` columns.
extern "C" __global__ void join_shards_f32(const float* parts, float* out, int rows, int cols, int keep, int total) {
    grid_dep_sync();
    int r = blockIdx.x;
    for (int c = threadIdx.x; c < total; c += blockDim.x) {
        int s = c / keep, j = c - s * keep;
        out[(size_t)r * total + c] = parts[((size_t)s * rows + r) * cols + j];
    }
}

// Splits fused qkv [n, q+2kv] into q, k, v and rotates q and k (HF rotate-half, the first
// 2·half dims of each head; none when half is 0) at each token's position, cos and sin
// multiplied by `mscale` (yarn's and LongRoPE's attention factor, else 1). Blocks of (threads over a head) ×
// head slots, grid (token, slot groups). K and V go to tensors k and v, or, with a cache (kc
// non-null), straight into it at the token's slot (as write_kv writes them; none for a
// negative slot). Where the rotation covers the whole head in groups of four (head_dim =
// 2·half, half a multiple of 4), a thread takes four pairs at a time in 16-byte loads;
// else one. The frequencies are one row for every token (freq_stride 0), or a row each,
// freq_stride apart, where they follow the length the token is computed at.
template <typename T>
__device__ __forceinline__ void split_qkv_rope(const float* __restrict__ qkv, float* __restrict__ q,
                                               float* __restrict__ k, float* __restrict__ v, T* __restrict__ kc,
                                               T* __restrict__ vc, const long long* slots,
                                               const unsigned int* positions, const float* inv_freq,
                                               int freq_stride, int heads, int kv_heads, int head_dim, int half,
                                               float mscale, float k_scale, float v_scale) {
    int t = blockIdx.x, slot = blockIdx.y * blockDim.y + threadIdx.y;
    inv_freq += (size_t)t * freq_stride;
    if (slot >= heads + 2 * kv_heads) return;
    int qn = heads * head_dim, kn = kv_heads * head_dim;
    const float* src = qkv + (size_t)t * (qn + 2 * kn) + (size_t)slot * head_dim;
    bool cached = kc != nullptr;
    long long at = cached && slot >= heads ? slots[t] : 0;
    if (at < 0) return;  // a padding row: no cache write
    const bool by4 = head_dim == 2 * half && (half & 3) == 0;
    float* dst = nullptr;
    T* cdst = nullptr;
    if (slot < heads) {
        dst = q + (size_t)t * qn + slot * head_dim;
    } else if (slot < heads + kv_heads) {
        if (cached) cdst = kc + at * kn + (slot - heads) * head_dim;
        else dst = k + (size_t)t * kn + (slot - heads) * head_dim;
    } else {
        int h = slot - heads - kv_heads;
        if (cached) {
            T* c = vc + at * kn + h * head_dim;
            if (by4)
                for (int i = 4 * threadIdx.x; i < head_dim; i += 4 * blockDim.x)
                    st4(c + i, div4(*(const float4*)(src + i), v_scale));
            else
                for (int i = threadIdx.x; i < head_dim; i += blockDim.x) st(c + i, src[i] / v_scale);
        } else {
            float* d = v + (size_t)t * kn + h * head_dim;
            for (int i = threadIdx.x; i < head_dim; i += blockDim.x) d[i] = src[i];
        }
        return;
    }
    float p = (float)positions[t];
    if (by4) {
        for (int j = 4 * threadIdx.x; j < half; j += 4 * blockDim.x) {
            const float4 f = *(const float4*)(inv_freq + j), a = *(const float4*)(src + j),
                         b = *(const float4*)(src + j + half);
            const float fs[4] = {f.x, f.y, f.z, f.w}, as[4] = {a.x, a.y, a.z, a.w}, bs[4] = {b.x, b.y, b.z, b.w};
            float ra[4], rb[4];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float s, c;
                sincosf(p * fs[e], &s, &c);
                s *= mscale;
                c *= mscale;
                ra[e] = as[e] * c - bs[e] * s;
                rb[e] = bs[e] * c + as[e] * s;
            }
            const float4 x = make_float4(ra[0], ra[1], ra[2], ra[3]), y = make_float4(rb[0], rb[1], rb[2], rb[3]);
            if (cdst) {
                st4(cdst + j, div4(x, k_scale));
                st4(cdst + j + half, div4(y, k_scale));
            } else {
                *(float4*)(dst + j) = x;
                *(float4*)(dst + j + half) = y;
            }
        }
        return;
    }
    auto put = [&](int i, float x) {
        if (cdst) st(cdst + i, x / k_scale);
        else dst[i] = x;
    };
    for (int j = threadIdx.x; j < head_dim - half; j += blockDim.x) {
        if (j < half) {
            float s, c;
            sincosf(p * inv_freq[j], &s, &c);
            s *= mscale;
            c *= mscale;
            float x0 = src[j], x1 = src[j + half];
            put(j, x0 * c - x1 * s);
            put(j + half, x1 * c + x0 * s);
        } else {
            put(j + half, src[j + half]);
        }
    }
}

extern "C" __global__ void split_qkv_rope_f32(const float* __restrict__ qkv, float* __restrict__ q,
                                              float* __restrict__ k, float* __restrict__ v,
                                              const unsigned int* positions, const float* inv_freq,
                                              int freq_stride, int heads, int kv_heads, int head_dim, int half,
                                              float mscale) {
    grid_dep_sync();
    split_qkv_rope<float>(qkv, q, k, v, nullptr, nullptr, nullptr, positions, inv_freq, freq_stride, heads,
                          kv_heads, head_dim, half, mscale, 1.0f, 1.0f);
}

// The same, with k and v written straight into the KV cache (layout as write_kv's, divided
// by its scales as there) at each token's slot instead of into tensors.
#define SPLIT_ROPE_KV_ENTRY(SUF, T)                                                                               \
    extern "C" __global__ void split_qkv_rope_kv_##SUF(const float* __restrict__ qkv, float* __restrict__ q,      \
                                                       T* __restrict__ kc, T* __restrict__ vc,                    \
                                                       const long long* slots, const unsigned int* positions,    \
                                                       const float* inv_freq, int freq_stride, int heads,        \
                                                       int kv_heads, int head_dim, int half, float mscale,       \
                                                       float k_scale, float v_scale) {                           \
        grid_dep_sync();                                                                                          \
        split_qkv_rope<T>(qkv, q, nullptr, nullptr, kc, vc, slots, positions, inv_freq, freq_stride, heads,      \
                          kv_heads, head_dim, half, mscale, k_scale, v_scale);                                   \
    }
SPLIT_ROPE_KV_ENTRY(f32, float)
SPLIT_ROPE_KV_ENTRY(bf16, __nv_bfloat16)
SPLIT_ROPE_KV_ENTRY(f16, __half)
SPLIT_ROPE_KV_ENTRY(fp8, kv_fp8)

// Conversions for cuBLAS GEMMs with 16-bit weights, and the embedding of a 16-bit table.

extern "C" __global__ void f32_to_bf16(const float* x, __nv_bfloat16* y, long long n) {
    grid_dep_sync();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2bfloat16(x[i]);
}

extern "C" __global__ void f32_to_f16(const float* x, __half* y, long long n) {
    grid_dep_sync();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2half(x[i]);
}

extern "C" __global__ void embedding_bf16(const __nv_bfloat16* table, const unsigned int* ids, float* out, int hidden) {
    grid_dep_sync();
    int row = blockIdx.x;
    const __nv_bfloat16* src = table + (size_t)ids[row] * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[(size_t)row * hidden + i] = __bfloat162float(src[i]);
}

extern "C" __global__ void embedding_f16(const __half* table, const unsigned int* ids, float* out, int hidden) {
    grid_dep_sync();
    int row = blockIdx.x;
    const __half* src = table + (size_t)ids[row] * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[(size_t)row * hidden + i] = __half2float(src[i]);
}

// Pseudo-random values in [-1, 1) of a 16-bit type (kind 1 bf16, 2 f16): operands for
// timing GEMMs, whose speed depends on what they multiply.
extern "C" __global__ void fill_random_16(void* out, long long n, int kind, unsigned int seed) {
    grid_dep_sync();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        unsigned long long h = ((unsigned long long)i + 1) * 0x9E3779B97F4A7C15ull ^ ((unsigned long long)seed << 32);
        h ^= h >> 31;
        h *= 0xBF58476D1CE4E5B9ull;
        h ^= h >> 29;
        store16(out, (size_t)i, (float)(h >> 40) * (2.0f / 16777216.0f) - 1.0f, kind);
    }
}
