// Mixture-of-experts (vLLM's fused_moe): routing, tokens sorted by expert, the experts'
// gated MLPs over the rows routed to them, and each token's weighted sum. Every launch's
// grid depends on the batch's row count only, never on the routes, so a CUDA graph
// replays the whole block: blocks of experts no row took leave at once. Weights are
// [experts, rows, k] of type W (f32, bf16 or f16). (common.cuh comes first.)

// Tokens a warp carries through one pass over its weight rows.
#define MOE_TOKENS 8
// Largest expert count a router kernel takes (16 logits a lane).
#define MOE_MAX_EXPERTS 512

__device__ __forceinline__ float moe_act(float x, int act) {
    if (act == 0) return x / (1.0f + expf(-x));
    if (act == 1) {
        const float k = 0.7978845608f;
        return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
    }
    return fmaxf(x, 0.0f);
}

// Row r's router: softmax over its logits (f32), then its top_k (≤ 8) experts by repeated
// warp argmax (ties to the lower index), renormalized to sum 1 when `renorm`. One warp a row.
extern "C" __global__ void moe_route(const float* __restrict__ logits, int* __restrict__ ids,
                                     float* __restrict__ weights, int rows, int experts, int top_k, int renorm) {
    grid_dep_sync();
    const int r = blockIdx.x, lane = threadIdx.x;
    if (r >= rows) return;
    const float* l = logits + (size_t)r * experts;
    const float NEG = __int_as_float(0xff800000);  // -inf
    float p[MOE_MAX_EXPERTS / 32];
    float mx = NEG;
#pragma unroll
    for (int i = 0; i < MOE_MAX_EXPERTS / 32; i++) {
        int e = lane + 32 * i;
        p[i] = e < experts ? l[e] : NEG;
        mx = fmaxf(mx, p[i]);
    }
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < MOE_MAX_EXPERTS / 32; i++) {
        p[i] = lane + 32 * i < experts ? expf(p[i] - mx) : -1.0f;
        sum += fmaxf(p[i], 0.0f);
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    float chosen = 0.0f, mine[8];
    int mine_id[8];
    for (int j = 0; j < top_k; j++) {
        float best = -2.0f;
        int at = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < MOE_MAX_EXPERTS / 32; i++)
            if (p[i] > best) best = p[i], at = lane + 32 * i;
        for (int o = 16; o > 0; o >>= 1) {
            float ob = __shfl_xor_sync(0xffffffffu, best, o);
            int oa = __shfl_xor_sync(0xffffffffu, at, o);
            if (ob > best || (ob == best && oa < at)) best = ob, at = oa;
        }
        if ((at & 31) == lane) p[at >> 5] = -2.0f;
        float prob = best / sum;
        chosen += prob;
        mine[j] = prob, mine_id[j] = at;
    }
    if (lane == 0)
        for (int j = 0; j < top_k; j++) {
            ids[(size_t)r * top_k + j] = mine_id[j];
            weights[(size_t)r * top_k + j] = renorm ? mine[j] / chosen : mine[j];
        }
}

// The routed pairs (row, choice) sorted by expert, in one block: counts[e], offsets (an
// exclusive scan, offsets[experts] = pairs), pos[pair] its place in the sorted order and
// sorted[place] the pair; active[0 .. *num_active) the experts some pair took, in order.
extern "C" __global__ void moe_sort(const int* __restrict__ ids, int pairs, int experts, int* __restrict__ offsets,
                                    int* __restrict__ pos, int* __restrict__ sorted, int* __restrict__ active,
                                    int* __restrict__ num_active) {
    grid_dep_sync();
    extern __shared__ int count[];  // [experts] counts, then [experts] cursors
    int* cursor = count + experts;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) atomicAdd(&count[ids[p]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int at = 0, n = 0;
        for (int e = 0; e < experts; e++) {
            offsets[e] = at;
            cursor[e] = at;
            if (count[e] > 0) active[n++] = e;
            at += count[e];
        }
        offsets[experts] = at;
        *num_active = n;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        int place = atomicAdd(&cursor[ids[p]], 1);
        pos[p] = place;
        sorted[place] = p;
    }
}

// xs[place] = x[row of the pair at place], f32.
extern "C" __global__ void moe_gather(const float* __restrict__ x, const int* __restrict__ sorted,
                                      float* __restrict__ xs, int pairs, int top_k, int cols) {
    grid_dep_sync();
    const int place = blockIdx.x;
    if (place >= pairs) return;
    const float* src = x + (size_t)(sorted[place] / top_k) * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) xs[(size_t)place * cols + c] = src[c];
}

// Eight consecutive elements of a weight row, widened to f32 (16-byte aligned for 16-bit
// types, 32-byte for f32).
__device__ __forceinline__ void moe_ld8(const float* p, float (&v)[8]) {
    float4 a = *(const float4*)p, b = *(const float4*)(p + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
template <typename T>
__device__ __forceinline__ void moe_ld8(const T* p, float (&v)[8]) {
    uint4 u = *(const uint4*)p;
    const T* h = (const T*)&u;
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = ld(h + i);
}

// Σ_k w0[k] · x_t[k] and Σ_k w1[k] · x_t[k] for the (up to MOE_TOKENS) rows x_t of xs at
// places first .. first + n, summed over the warp into every lane. k % 8 == 0.
template <typename W, int R>
__device__ __forceinline__ void moe_dots(const W* w0, const W* w1, const float* xs, int first, int n, int k,
                                         float (&acc)[R][MOE_TOKENS]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < MOE_TOKENS; t++) acc[r][t] = 0.0f;
    for (int k0 = lane * 8; k0 < k; k0 += 256) {
        float a[8], b[8];
        moe_ld8(w0 + k0, a);
        if (R == 2) moe_ld8(w1 + k0, b);
#pragma unroll
        for (int t = 0; t < MOE_TOKENS; t++) {
            if (t >= n) break;
            float xv[8];
            moe_ld8(xs + (size_t)(first + t) * k + k0, xv);
#pragma unroll
            for (int i = 0; i < 8; i++) {
                acc[0][t] = fmaf(a[i], xv[i], acc[0][t]);
                if (R == 2) acc[R - 1][t] = fmaf(b[i], xv[i], acc[R - 1][t]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < MOE_TOKENS; t++)
            for (int o = 16; o > 0; o >>= 1) acc[r][t] += __shfl_xor_sync(0xffffffffu, acc[r][t], o);
}

// The gate/up projection of each active expert over its sorted rows, then act(gate) · up:
// inter[place, j] for j < n_inter. Block (b, a) takes active expert a, and its warps the
// intermediate indices 8b .. 8b + 7 (gate row j, up row n_inter + j).
template <typename W>
__device__ void moe_gate_up(const W* __restrict__ w, const float* __restrict__ xs, float* __restrict__ inter,
                            const int* __restrict__ offsets, const int* __restrict__ active,
                            const int* __restrict__ num_active, int n_inter, int k, int act) {
    grid_dep_sync();
    if ((int)blockIdx.y >= *num_active) return;
    const int e = active[blockIdx.y], j = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (j >= n_inter) return;
    const W* gate = w + ((size_t)e * 2 * n_inter + j) * k;
    const W* up = gate + (size_t)n_inter * k;
    for (int first = offsets[e]; first < offsets[e + 1]; first += MOE_TOKENS) {
        const int n = min(MOE_TOKENS, offsets[e + 1] - first);
        float acc[2][MOE_TOKENS];
        moe_dots<W, 2>(gate, up, xs, first, n, k, acc);
        if (lane < n) {
            float g = 0.0f, u = 0.0f;
#pragma unroll
            for (int t = 0; t < MOE_TOKENS; t++)
                if (t == lane) g = acc[0][t], u = acc[1][t];
            inter[(size_t)(first + lane) * n_inter + j] = moe_act(g, act) * u;
        }
    }
}

// The down projection of each active expert over its rows of inter: y[place, h]. Block
// (b, a) takes active expert a and its warps the output rows 8b .. 8b + 7.
template <typename W>
__device__ void moe_down(const W* __restrict__ w, const float* __restrict__ inter, float* __restrict__ y,
                         const int* __restrict__ offsets, const int* __restrict__ active,
                         const int* __restrict__ num_active, int hidden, int k) {
    grid_dep_sync();
    if ((int)blockIdx.y >= *num_active) return;
    const int e = active[blockIdx.y], h = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (h >= hidden) return;
    const W* row = w + ((size_t)e * hidden + h) * k;
    for (int first = offsets[e]; first < offsets[e + 1]; first += MOE_TOKENS) {
        const int n = min(MOE_TOKENS, offsets[e + 1] - first);
        float acc[1][MOE_TOKENS];
        moe_dots<W, 1>(row, row, inter, first, n, k, acc);
        if (lane < n) {
            float v = 0.0f;
#pragma unroll
            for (int t = 0; t < MOE_TOKENS; t++)
                if (t == lane) v = acc[0][t];
            y[(size_t)(first + lane) * hidden + h] = v;
        }
    }
}

#define MOE_ENTRIES(SUF, W)                                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                            \
        moe_gate_up_##SUF(const W* w, const float* xs, float* inter, const int* offsets, const int* active,      \
                          const int* num_active, int n_inter, int k, int act) {                                  \
        moe_gate_up<W>(w, xs, inter, offsets, active, num_active, n_inter, k, act);                              \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(256)                                                            \
        moe_down_##SUF(const W* w, const float* inter, float* y, const int* offsets, const int* active,          \
                       const int* num_active, int hidden, int k) {                                               \
        moe_down<W>(w, inter, y, offsets, active, num_active, hidden, k);                                        \
    }
MOE_ENTRIES(f32, float)
MOE_ENTRIES(bf16, __nv_bfloat16)
MOE_ENTRIES(f16, __half)

// out[r, c] = Σ_j weights[r, j] · y[pos[r · top_k + j], c], the choices taken in expert
// order (transformers adds the experts' outputs in that order).
extern "C" __global__ void moe_combine(const float* __restrict__ y, const int* __restrict__ ids,
                                       const int* __restrict__ pos, const float* __restrict__ weights,
                                       float* __restrict__ out, int rows, int top_k, int cols) {
    grid_dep_sync();
    const int r = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows || c >= cols) return;
    const int* id = ids + (size_t)r * top_k;
    float acc = 0.0f;
    int last = -1;
    for (int n = 0; n < top_k; n++) {
        // The next expert above `last` among the row's choices.
        int j = -1;
        for (int i = 0; i < top_k; i++)
            if (id[i] > last && (j < 0 || id[i] < id[j])) j = i;
        last = id[j];
        const size_t p = (size_t)r * top_k + j;
        acc += weights[p] * y[(size_t)pos[p] * cols + c];
    }
    out[(size_t)r * cols + c] = acc;
}

// acc[r, c] += sigmoid(gate[r]) · x[r, c] (a shared expert under its gate).
extern "C" __global__ void add_sigmoid_gated(float* __restrict__ acc, const float* __restrict__ x,
                                             const float* __restrict__ gate, int rows, int cols) {
    grid_dep_sync();
    const int r = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows || c >= cols) return;
    const float s = 1.0f / (1.0f + expf(-gate[r]));
    acc[(size_t)r * cols + c] += s * x[(size_t)r * cols + c];
}
