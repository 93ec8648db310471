// Mixture-of-experts (vLLM's fused_moe): routing, tokens sorted by expert, the experts'
// gated MLPs over the rows routed to them, and each token's weighted sum. Every launch's
// grid depends on the batch's row count only, never on the routes, so a CUDA graph
// replays the whole block: blocks of experts no row took leave at once. Weights are
// [experts, rows, k] of type W (f32, bf16 or f16). (common.cuh comes first.)
//
// Two ways through the experts: few rows an expert (decode) take the warp-per-weight-row
// kernels (moe_gate_up, moe_down), which read each chosen expert's rows once per 8 tokens;
// many (prefill, large batches) take the tensor-core grouped GEMMs (moe_*_mma), whose
// tiles of 64 sorted rows each read their expert's weights once.

// Tokens a warp carries through one pass over its weight rows.
#define MOE_TOKENS 8
// Sorted rows, output columns and k of one tensor-core tile; shared rows are padded by 8
// elements so that the eight rows an ldmatrix reads fall in distinct banks.
#define MOE_BM 64
#define MOE_BN 64
#define MOE_BK 32
#define MOE_LD (MOE_BK + 8)
// Largest expert count a router kernel takes (16 logits a lane).
#define MOE_MAX_EXPERTS 512

// Row r's router: softmax over its logits (f32), then its top_k (≤ 8) experts by repeated
// warp argmax (ties to the lower index), renormalized to sum 1 when `renorm`. One warp a row;
// lane j ends with choice j. Every per-lane array is indexed by unrolled constants only (an
// index known at run time would put it in local memory).
__device__ void moe_route_row(const float* __restrict__ logits, int* __restrict__ ids, float* __restrict__ weights,
                              int r, int experts, int top_k, int renorm) {
    const int lane = threadIdx.x & 31;
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
    float chosen = 0.0f, mine = 0.0f;
    int mine_id = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        if (j >= top_k) break;
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
#pragma unroll
        for (int i = 0; i < MOE_MAX_EXPERTS / 32; i++)
            if (lane + 32 * i == at) p[i] = -2.0f;
        float prob = best / sum;
        chosen += prob;
        if (lane == j) mine = prob, mine_id = at;
    }
    if (lane < top_k) {
        ids[(size_t)r * top_k + lane] = mine_id;
        weights[(size_t)r * top_k + lane] = renorm ? mine / chosen : mine;
    }
}

extern "C" __global__ void moe_route(const float* __restrict__ logits, int* __restrict__ ids,
                                     float* __restrict__ weights, int rows, int experts, int top_k, int renorm) {
    grid_dep_sync();
    if ((int)blockIdx.x < rows) moe_route_row(logits, ids, weights, blockIdx.x, experts, top_k, renorm);
}

// Exclusive prefix sums of v over the block's threads (in thread order), and their total.
// Every thread of the block calls it.
__device__ __forceinline__ int3 moe_block_scan(int3 v, int3& total) {
    __shared__ int3 warp_sums[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int3 inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int x = __shfl_up_sync(0xffffffffu, inc.x, o), y = __shfl_up_sync(0xffffffffu, inc.y, o),
                  z = __shfl_up_sync(0xffffffffu, inc.z, o);
        if (lane >= o) inc.x += x, inc.y += y, inc.z += z;
    }
    if (lane == 31) warp_sums[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        int3 s = lane < warps ? warp_sums[lane] : make_int3(0, 0, 0);
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int x = __shfl_up_sync(0xffffffffu, s.x, o), y = __shfl_up_sync(0xffffffffu, s.y, o),
                      z = __shfl_up_sync(0xffffffffu, s.z, o);
            if (lane >= o) s.x += x, s.y += y, s.z += z;
        }
        warp_sums[lane] = s;
    }
    __syncthreads();
    const int3 base = warp > 0 ? warp_sums[warp - 1] : make_int3(0, 0, 0);
    total = warp_sums[warps - 1];
    return make_int3(base.x + inc.x - v.x, base.y + inc.y - v.y, base.z + inc.z - v.z);
}

// The routed pairs (row, choice) sorted by expert, in one block of at least `experts`
// threads: offsets (an exclusive scan of the counts, offsets[experts] = pairs), pos[pair] its
// place in the sorted order and sorted[place] the pair; active[a] the a-th expert some pair
// took, in order, and -1 past the last (active holds `experts` entries). With `tiles`, also
// the tensor-core tiles: (expert, first place) for each run of up to MOE_BM places of one
// expert, *num_tiles of them. Thread e takes expert e through one block-wide scan of its
// count, its being taken and its tiles.
#define MOE_SORT_ARGS                                                                                     \
    int *__restrict__ ids, int pairs, int experts, int *__restrict__ offsets, int *__restrict__ pos,    \
        int *__restrict__ sorted, int *__restrict__ active, int *__restrict__ tiles, int *__restrict__ num_tiles
__device__ void moe_sort_pairs(MOE_SORT_ARGS) {
    extern __shared__ int count[];  // [experts] counts, [experts] cursors
    int* cursor = count + experts;
    const int e = threadIdx.x;
    if (e < experts) count[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) atomicAdd(&count[ids[p]], 1);
    __syncthreads();
    const int c = e < experts ? count[e] : 0;
    int3 total;
    const int3 at = moe_block_scan(make_int3(c, c > 0, (c + MOE_BM - 1) / MOE_BM), total);
    if (e < experts) {
        offsets[e] = at.x;
        cursor[e] = at.x;
        if (c > 0) active[at.y] = e;
        if (e >= total.y) active[e] = -1;
        if (tiles)
            for (int i = 0; i * MOE_BM < c; i++) {
                tiles[2 * (at.z + i)] = e;
                tiles[2 * (at.z + i) + 1] = at.x + i * MOE_BM;
            }
    }
    if (threadIdx.x == 0) {
        offsets[experts] = total.x;
        if (tiles) *num_tiles = total.z;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        int place = atomicAdd(&cursor[ids[p]], 1);
        pos[p] = place;
        sorted[place] = p;
    }
}

extern "C" __global__ void __launch_bounds__(1024) moe_sort(MOE_SORT_ARGS) {
    grid_dep_sync();
    moe_sort_pairs(ids, pairs, experts, offsets, pos, sorted, active, tiles, num_tiles);
}

// Routing and the sort in one block, for batches of few rows (a warp routes every 32nd row).
extern "C" __global__ void __launch_bounds__(1024) moe_route_sort(const float* __restrict__ logits, float* __restrict__ weights, int rows,
                                          int top_k, int renorm, MOE_SORT_ARGS) {
    grid_dep_sync();
    for (int r = threadIdx.x >> 5; r < rows; r += blockDim.x >> 5)
        moe_route_row(logits, ids, weights, r, experts, top_k, renorm);
    __syncthreads();
    moe_sort_pairs(ids, pairs, experts, offsets, pos, sorted, active, tiles, num_tiles);
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

// Eight consecutive weights as loaded (16 bytes of a 16-bit type, 32 of f32), streamed past
// L1 (`ld_stream`), and widened to f32 where they are used.
template <typename W> struct MoeRaw {
    uint4 u;
};
template <> struct MoeRaw<float> {
    uint4 u[2];
};
template <typename W> __device__ __forceinline__ void moe_load(const W* p, MoeRaw<W>& r) { r.u = ld_stream(p); }
__device__ __forceinline__ void moe_load(const float* p, MoeRaw<float>& r) {
    r.u[0] = ld_stream(p);
    r.u[1] = ld_stream(p + 4);
}
template <typename W> __device__ __forceinline__ void moe_widen(const MoeRaw<W>& r, float (&v)[8]) {
    const W* h = (const W*)&r.u;
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = ld(h + i);
}
__device__ __forceinline__ void moe_widen(const MoeRaw<float>& r, float (&v)[8]) {
    const float* f = (const float*)r.u;
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = f[i];
}

// Σ_k w_r[k] · x_t[k] for R weight rows (w_r = w + r · stride) and the (up to MOE_TOKENS)
// places first .. first + n, summed over the warp into every lane. k % 8 == 0. Place p's row
// is row p of xs, or with GATHER, row sorted[p] / top_k (the token of the pair at p). A lane
// loads U passes of 256 elements of k (R · U loads of 16 bytes in flight) before it
// multiplies: one pass at a time left the experts' decode kernels at 44 % of the bandwidth.
template <typename W, int R, int U, bool GATHER>
__device__ __forceinline__ void moe_dots(const W* w, size_t stride, const float* xs, const int* sorted, int top_k,
                                         int first, int n, int k, float (&acc)[R][MOE_TOKENS]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < MOE_TOKENS; t++) acc[r][t] = 0.0f;
    for (int k0 = lane * 8; k0 < k; k0 += 256 * U) {
        MoeRaw<W> raw[R][U];
#pragma unroll
        for (int u = 0; u < U; u++)
            if (k0 + u * 256 < k)
#pragma unroll
                for (int r = 0; r < R; r++) moe_load(w + r * stride + k0 + u * 256, raw[r][u]);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int kk = k0 + u * 256;
            if (kk >= k) break;
            float a[R][8];
#pragma unroll
            for (int r = 0; r < R; r++) moe_widen(raw[r][u], a[r]);
#pragma unroll
            for (int t = 0; t < MOE_TOKENS; t++) {
                if (t >= n) break;
                // The row's index is read again each pass (from L1): held for every token,
                // the indices pushed the gate/up kernel past its registers.
                const int row = GATHER ? sorted[first + t] / top_k : first + t;
                float xv[8];
                moe_ld8(xs + (size_t)row * k + kk, xv);
#pragma unroll
                for (int i = 0; i < 8; i++)
#pragma unroll
                    for (int r = 0; r < R; r++) acc[r][t] = fmaf(a[r][i], xv[i], acc[r][t]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < MOE_TOKENS; t++)
            if (t < n)
                for (int o = 16; o > 0; o >>= 1) acc[r][t] += __shfl_xor_sync(0xffffffffu, acc[r][t], o);
}

// The gate/up projection of each active expert over its sorted rows (read from x through
// `sorted`), then act(gate) · up: inter[place, j] for j < n_inter. Block (b, a) takes active
// expert a, and its warps the intermediate indices 8b .. 8b + 7 (gate row j, up row n_inter + j).
//
// An active expert has at least one row, so the first pass over its rows starts without
// waiting for its offsets: the weights' first loads go out beside theirs.
template <typename W, int U>
__device__ void moe_gate_up(const W* __restrict__ w, const float* __restrict__ x, const int* __restrict__ sorted,
                            int top_k, float* __restrict__ inter, const int* __restrict__ offsets,
                            const int* __restrict__ active, int n_inter, int k, int act) {
    grid_dep_sync();
    const int e = active[blockIdx.y], j = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (e < 0 || j >= n_inter) return;
    const W* gate = w + ((size_t)e * 2 * n_inter + j) * k;
    const int end = offsets[e + 1];
    int first = offsets[e];
    do {
        const int n = min(MOE_TOKENS, end - first);
        float acc[2][MOE_TOKENS];
        moe_dots<W, 2, U, true>(gate, (size_t)n_inter * k, x, sorted, top_k, first, n, k, acc);
        if (lane < n) {
            float g = 0.0f, u = 0.0f;
#pragma unroll
            for (int t = 0; t < MOE_TOKENS; t++)
                if (t == lane) g = acc[0][t], u = acc[1][t];
            inter[(size_t)(first + lane) * n_inter + j] = act_fn(g, act) * u;
        }
        first += MOE_TOKENS;
    } while (first < end);
}

// The down projection of each active expert over its rows of inter: y[place, h]. Block
// (b, a) takes active expert a and its warps R output rows each, 8R·b + R·warp .. (a warp
// of one row read 1.5 KB of the Qwen3-30B-A3B shape's experts: too little in flight).
// hidden % R == 0 (the host holds hidden to a multiple of 8).
template <typename W, int R, int U>
__device__ void moe_down(const W* __restrict__ w, const float* __restrict__ inter, float* __restrict__ y,
                         const int* __restrict__ offsets, const int* __restrict__ active, int hidden, int k) {
    grid_dep_sync();
    const int e = active[blockIdx.y], h = (blockIdx.x * 8 + (threadIdx.x >> 5)) * R, lane = threadIdx.x & 31;
    if (e < 0 || h >= hidden) return;
    const W* row = w + ((size_t)e * hidden + h) * k;
    const int end = offsets[e + 1];
    int first = offsets[e];
    do {
        const int n = min(MOE_TOKENS, end - first);
        float acc[R][MOE_TOKENS];
        moe_dots<W, R, U, false>(row, k, inter, nullptr, 1, first, n, k, acc);
        if (lane < n)
#pragma unroll
            for (int r = 0; r < R; r++) {
                float v = 0.0f;
#pragma unroll
                for (int t = 0; t < MOE_TOKENS; t++)
                    if (t == lane) v = acc[r][t];
                y[(size_t)(first + lane) * hidden + h + r] = v;
            }
        first += MOE_TOKENS;
    } while (first < end);
}

// Gate/up: two passes of two rows' loads in flight take 80 registers, three blocks an SM
// (under four blocks' 64 they spilled).
#define MOE_GATE_UP_ENTRY(NAME, W, U, BLOCKS)                                                              \
    extern "C" __global__ void __launch_bounds__(256, BLOCKS)                                              \
        NAME(const W* w, const float* x, const int* sorted, int top_k, float* inter, const int* offsets,  \
             const int* active, int n_inter, int k, int act) {                                             \
        moe_gate_up<W, U>(w, x, sorted, top_k, inter, offsets, active, n_inter, k, act);                   \
    }
#define MOE_DOWN_ENTRY(NAME, W, R, U)                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        NAME(const W* w, const float* inter, float* y, const int* offsets, const int* active, int hidden, \
             int k) {                                                                                      \
        moe_down<W, R, U>(w, inter, y, offsets, active, hidden, k);                                        \
    }
MOE_GATE_UP_ENTRY(moe_gate_up_f32, float, 2, 3)
MOE_GATE_UP_ENTRY(moe_gate_up_bf16, __nv_bfloat16, 2, 3)
MOE_GATE_UP_ENTRY(moe_gate_up_f16, __half, 2, 3)
// Down: f32 rows one a warp in four passes; 16-bit rows four a warp in two passes (moe.rs's
// `down_rows`): on an 8-layer Qwen3-30B-A3B (H100, batch 1, one run each) 4×2 took 0.77 ms a
// step against 0.79–0.88 for 1×4, 2×4 and 4×3, which the run's spread barely separates.
MOE_DOWN_ENTRY(moe_down_f32, float, 1, 4)
MOE_DOWN_ENTRY(moe_down_bf16, __nv_bfloat16, 4, 2)
MOE_DOWN_ENTRY(moe_down_f16, __half, 4, 2)

// The tensor-core path. xs[place] = x[row of the pair at place], rounded to T (as the
// dense GEMMs round a 16-bit model's activations).
template <typename T>
__device__ void moe_gather16(const float* __restrict__ x, const int* __restrict__ sorted, T* __restrict__ xs,
                             int pairs, int top_k, int cols) {
    grid_dep_sync();
    const int place = blockIdx.x;
    if (place >= pairs) return;
    const float* src = x + (size_t)(sorted[place] / top_k) * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) st(xs + (size_t)place * cols + c, src[c]);
}

// Stage k0 .. k0 + MOE_BK of a tile into shared memory with cp.async: n rows of `a` from
// place `first` (rows past n and columns past k zero-filled), and SETS · MOE_BN weight rows
// (set s: rows s · n_out + col0 ..) of the expert's weights w.
template <typename T, int SETS>
__device__ __forceinline__ void moe_stage(T* as, T* bs, const T* __restrict__ a, const T* __restrict__ w, int first,
                                          int n, int col0, int n_out, int k, int k0) {
    for (int c = threadIdx.x; c < MOE_BM * 4; c += 128) {
        const int r = c >> 2, kc = k0 + (c & 3) * 8;
        const bool ok = r < n && kc < k;
        cp_async16(as + r * MOE_LD + (c & 3) * 8, a + (size_t)(first + (ok ? r : 0)) * k + (ok ? kc : 0), ok);
    }
    for (int c = threadIdx.x; c < SETS * MOE_BN * 4; c += 128) {
        const int r = c >> 2, kc = k0 + (c & 3) * 8, s = r / MOE_BN, j = col0 + r % MOE_BN;
        const bool ok = j < n_out && kc < k;
        cp_async16(bs + r * MOE_LD + (c & 3) * 8, w + ((size_t)s * n_out + (ok ? j : 0)) * k + (ok ? kc : 0), ok);
    }
}

// One tile of a grouped expert GEMM on tensor cores: block (t, c) takes tile t of the sort
// (an expert and up to MOE_BM consecutive places of it) and output columns c · MOE_BN ..;
// its four warps each a 32 × 32 quarter, k in steps of MOE_BK through two cp.async stages.
// SETS 2 is the gate/up projection: weights [experts, 2 · n_out, k], out[place, j] =
// act(gate_j) · up_j rounded to T. SETS 1 is the down projection: weights
// [experts, n_out, k], out[place, j] in f32. Blocks past the sort's tiles leave at once.
template <typename T, int SETS>
__device__ void moe_mma(const T* __restrict__ w, const T* __restrict__ a, void* __restrict__ out,
                        const int* __restrict__ tiles, const int* __restrict__ num_tiles,
                        const int* __restrict__ offsets, int n_out, int k, int act) {
    __shared__ __align__(16) T as[2][MOE_BM * MOE_LD];
    __shared__ __align__(16) T bs[2][SETS * MOE_BN * MOE_LD];
    grid_dep_sync();
    const int t = blockIdx.x;
    if (t >= *num_tiles) return;
    const int e = tiles[2 * t], first = tiles[2 * t + 1], n = min(MOE_BM, offsets[e + 1] - first);
    const int col0 = blockIdx.y * MOE_BN, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = warp >> 1, wn = warp & 1;
    // A warp whose 32 rows are all past the tile's end only helps to load.
    const bool busy = wm * 32 < n;
    const T* we = w + (size_t)e * SETS * n_out * k;
    float acc[SETS][2][4][4];
#pragma unroll
    for (int s = 0; s < SETS; s++)
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int ni = 0; ni < 4; ni++)
#pragma unroll
                for (int i = 0; i < 4; i++) acc[s][mi][ni][i] = 0.0f;
    const int steps = (k + MOE_BK - 1) / MOE_BK;
    moe_stage<T, SETS>(as[0], bs[0], a, we, first, n, col0, n_out, k, 0);
    cp_async_commit();
    for (int kt = 0; kt < steps; kt++) {
        if (kt + 1 < steps) {
            moe_stage<T, SETS>(as[(kt + 1) & 1], bs[(kt + 1) & 1], a, we, first, n, col0, n_out, k, (kt + 1) * MOE_BK);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const T* A = as[kt & 1];
        const T* B = bs[kt & 1];
        if (busy) {
#pragma unroll
            for (int kk = 0; kk < MOE_BK / 16; kk++) {
                unsigned af[2][4];
#pragma unroll
                for (int mi = 0; mi < 2; mi++)
                    ldsm_x4(af[mi], A + (wm * 32 + mi * 16 + (lane & 15)) * MOE_LD + kk * 16 + (lane >> 4) * 8);
#pragma unroll
                for (int s = 0; s < SETS; s++)
#pragma unroll
                    for (int np = 0; np < 2; np++) {
                        // n rows np·16 + (0..7 | 8..15) by k halves 0..7 | 8..15: b0, b1 of
                        // n-tile 2np, then of 2np + 1.
                        unsigned bf[4];
                        const int nr = s * MOE_BN + wn * 32 + np * 16 + (lane & 7) + ((lane >> 4) << 3);
                        ldsm_x4(bf, B + nr * MOE_LD + kk * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
                        for (int mi = 0; mi < 2; mi++) {
                            mma16<T>(acc[s][mi][2 * np], af[mi], bf[0], bf[1]);
                            mma16<T>(acc[s][mi][2 * np + 1], af[mi], bf[2], bf[3]);
                        }
                    }
            }
        }
        __syncthreads();
    }
    if (!busy) return;
    const int g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int ni = 0; ni < 4; ni++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = wm * 32 + mi * 16 + g + h * 8, col = col0 + wn * 32 + ni * 8 + 2 * q;
                if (r >= n || col >= n_out) continue;
                const size_t o = (size_t)(first + r) * n_out + col;
                if (SETS == 2) {
                    const float v0 = act_fn(acc[0][mi][ni][2 * h], act) * acc[SETS - 1][mi][ni][2 * h];
                    const float v1 = act_fn(acc[0][mi][ni][2 * h + 1], act) * acc[SETS - 1][mi][ni][2 * h + 1];
                    st((T*)out + o, v0);
                    st((T*)out + o + 1, v1);
                } else {
                    *(float2*)((float*)out + o) = make_float2(acc[0][mi][ni][2 * h], acc[0][mi][ni][2 * h + 1]);
                }
            }
}

#define MOE_MMA_ENTRIES(SUF, T)                                                                                  \
    extern "C" __global__ void moe_gather_##SUF(const float* x, const int* sorted, T* xs, int pairs, int top_k, \
                                                int cols) {                                                      \
        moe_gather16<T>(x, sorted, xs, pairs, top_k, cols);                                                      \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(128)                                                            \
        moe_gate_up_mma_##SUF(const T* w, const T* a, T* out, const int* tiles, const int* num_tiles,            \
                              const int* offsets, int n_out, int k, int act) {                                   \
        moe_mma<T, 2>(w, a, out, tiles, num_tiles, offsets, n_out, k, act);                                      \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(128)                                                            \
        moe_down_mma_##SUF(const T* w, const T* a, float* out, const int* tiles, const int* num_tiles,           \
                           const int* offsets, int n_out, int k) {                                               \
        moe_mma<T, 1>(w, a, out, tiles, num_tiles, offsets, n_out, k, 0);                                        \
    }
MOE_MMA_ENTRIES(bf16, __nv_bfloat16)
MOE_MMA_ENTRIES(f16, __half)

// out[r, c] = Σ_j weights[r, j] · y[pos[r · top_k + j], c], the choices taken in expert
// order (transformers adds the experts' outputs in that order). A row's choices name
// distinct experts, so choice j's place in that order is the count of choices below it;
// every load is issued before the sum, which walks the places with unrolled selects.
extern "C" __global__ void moe_combine(const float* __restrict__ y, const int* __restrict__ ids,
                                       const int* __restrict__ pos, const float* __restrict__ weights,
                                       float* __restrict__ out, int rows, int top_k, int cols) {
    grid_dep_sync();
    const int r = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows || c >= cols) return;
    int id[8], rank[8];
    float wt[8], yv[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const size_t p = (size_t)r * top_k + j;
        id[j] = j < top_k ? ids[p] : 0x7fffffff;
        wt[j] = j < top_k ? weights[p] : 0.0f;
        yv[j] = j < top_k ? y[(size_t)pos[p] * cols + c] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < 8; j++) {
        rank[j] = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) rank[j] += id[i] < id[j];
    }
    float acc = 0.0f;
#pragma unroll
    for (int n = 0; n < 8; n++) {
        if (n >= top_k) break;
        float a = 0.0f, b = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (rank[j] == n) a = wt[j], b = yv[j];
        acc = fmaf(a, b, acc);
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
