// Sampling on the GPU: one block of 1024 threads per row of logits picks the row's token
// by the rules of src/sampling.rs (its CPU twin), so that only token ids, and the logprobs
// a request asked for, come back to the host.
//
// Per row, in order: logprobs of the raw logits (log-sum-exp and the top n); min_tokens
// masking and penalties on the listed tokens (in place, the raw values kept for the chosen
// token's logprob); then greedy argmax, or temperature → top-k → top-p → min-p cuts at a
// logit value (found by binary search over the float order, no sort) and an exponential
// race among the kept tokens keyed by a counter hash (seeded, batch-independent).
//
// Rows that ask for no logprobs and no top-k or top-p cut (the common case) take the split
// sampler at the end instead: a row's columns are spread over several blocks and its
// passes over three launches.
//
// Row parameters, 13 words each (sampling::PARAM_WORDS):
//   0 temperature (0 = greedy)  1 top_p  2 min_p  3 top_k (≤ 0 off)  4 repetition penalty
//   5 presence  6 frequency  7 logprobs n (-1 none)  8 first entry  9 entries
//   10, 11 noise base (low, high word)  12 1 when sample_f32 takes the row, 0 when the
//   split sampler does
// Entries, 3 words each (sampling::ENTRY_WORDS), one per distinct token a rule touches:
//   0 token  1 bit 31 masked, bit 30 seen (repetition penalty), bits 0..29 count in the output
//   2 written here: the token's raw logit
// Output: tokens [rows], then per row LOGPROB_WORDS words: the chosen token's logprob and
// n (id, logprob) pairs, most likely first.

#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
#define PARAM_WORDS 13
#define FULL_WORD 12
#define ENTRY_WORDS 3
#define LOGPROB_WORDS 41
#define NEG_INF __int_as_float(0xff800000)

template <int WARPS>
struct ReduceT {
    double key[WARPS];
    int idx[WARPS];
};
typedef ReduceT<SAMPLE_WARPS> Reduce;

__device__ __forceinline__ bool better(double& k, int& i, double ok, int oi) {
    if (ok > k || (ok == k && oi < i)) {
        k = ok;
        i = oi;
        return true;
    }
    return false;
}

// The largest key in the warp and its index (the lowest on ties), to every lane.
__device__ __forceinline__ void warp_argmax(double& k, int& i) {
    for (int o = 16; o > 0; o >>= 1) {
        double ok = __shfl_xor_sync(0xffffffff, k, o);
        int oi = __shfl_xor_sync(0xffffffff, i, o);
        better(k, i, ok, oi);
    }
}

// The largest key in the block and its index (the lowest on ties), to every thread.
template <int WARPS>
__device__ void block_argmax(double& k, int& i, ReduceT<WARPS>& r) {
    warp_argmax(k, i);
    __syncthreads();  // the previous reduction's readers are done with r
    if ((threadIdx.x & 31) == 0) { r.key[threadIdx.x >> 5] = k; r.idx[threadIdx.x >> 5] = i; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < WARPS; w++) better(k, i, r.key[w], r.idx[w]);
        r.key[0] = k;
        r.idx[0] = i;
    }
    __syncthreads();
    k = r.key[0];
    i = r.idx[0];
}

// The block's sum in a fixed order (the same value every run), to every thread.
__device__ double block_sum(double v, Reduce& r) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffff, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) r.key[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < SAMPLE_WARPS; w++) v += r.key[w];
        r.key[0] = v;
    }
    __syncthreads();
    return r.key[0];
}

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// u uniform in (0, 1) from token i's hash h = splitmix64(base ^ i) (sampling::gumbel's).
__device__ __forceinline__ double uniform_of(unsigned long long h) {
    return ((double)(h >> 12) + 0.5) * (1.0 / 4503599627370496.0);
}
__device__ __forceinline__ double uniform(unsigned long long base, unsigned int i) {
    return uniform_of(splitmix64(base ^ (unsigned long long)i));
}

// −ln(−ln u): Gumbel noise, in double as the host takes it.
__device__ __forceinline__ double gumbel(double u) { return -log(-log(u)); }

// The same in float, within GUMBEL_F_ERR of gumbel(u): −ln u from u rounded to float (its
// log's error relative, so absolute in the result) or, above 1/2, from u − 1 (exact in
// double, then rounded) through log1pf, so that u near 1 keeps its small −ln u; each float
// step adds a relative error of a few 2⁻²⁴, under 1e-5 in all for |noise| ≤ 40.
#define GUMBEL_F_ERR 1e-3
__device__ __forceinline__ float gumbel_f(double u) {
    float e = u < 0.5 ? -logf((float)u) : -log1pf((float)(u - 1.0));
    return -logf(e);
}

// Floats as unsigned integers in the same order, and back.
__device__ __forceinline__ unsigned int ord(float f) {
    unsigned int u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float unord(unsigned int u) {
    return __uint_as_float((u & 0x80000000u) ? (u & 0x7fffffffu) : ~u);
}

// (l − max) / T, rounded as the host rounds it.
__device__ __forceinline__ float scaled(float l, float max, float t) { return __fdiv_rn(__fsub_rn(l, max), t); }

// The largest value v in [lo, hi] (as floats, lo satisfying it) with
// count(row ≥ v) ≥ k (mass = false) or mass(row ≥ v, row ≥ floor) ≥ target (mass = true).
__device__ float search(const float* row, int cols, float lo_f, float hi_f, bool mass, double target, float floor,
                        float max, float t, Reduce& r) {
    unsigned int lo = ord(lo_f), hi = ord(hi_f);
    while (lo < hi) {
        unsigned int mid = lo + (hi - lo + 1) / 2;
        float v = unord(mid);
        double acc = 0.0;
        for (int i = threadIdx.x; i < cols; i += SAMPLE_THREADS) {
            float l = row[i];
            if (l >= v && l >= floor) acc += mass ? (double)expf(scaled(l, max, t)) : 1.0;
        }
        if (block_sum(acc, r) >= target) lo = mid;
        else hi = mid - 1;
    }
    return unord(lo);
}

// min_tokens masking and penalties on the entries' tokens in [lo, hi), in place (entries
// name distinct tokens), each entry's raw logit saved in its third word; the caller's
// threads take entries first, first + stride, ...
__device__ void penalize(float* row, const unsigned int* p, unsigned int* ent, unsigned int n_ent, int lo, int hi,
                         unsigned int first, unsigned int stride) {
    float rep = __uint_as_float(p[4]), presence = __uint_as_float(p[5]), freq = __uint_as_float(p[6]);
    for (unsigned int e = first; e < n_ent; e += stride) {
        unsigned int tok = ent[ENTRY_WORDS * e], info = ent[ENTRY_WORDS * e + 1];
        if ((int)tok < lo || (int)tok >= hi) continue;
        float l = row[tok];
        ent[ENTRY_WORDS * e + 2] = __float_as_uint(l);
        if (info & 0x40000000u) l = l > 0.0f ? __fdiv_rn(l, rep) : __fmul_rn(l, rep);
        unsigned int count = info & 0x3fffffffu;
        if (count > 0) l = __fsub_rn(l, __fadd_rn(__fmul_rn(freq, (float)count), presence));
        if (info & 0x80000000u) l = NEG_INF;
        row[tok] = l;
    }
}

// Structured output: sets to -inf the logits of the tokens a grammar forbids, before any
// other rule reads the row. `masks` holds the n masked rows' indexes, then n masks of
// `words` words (bit t % 32 of word t / 32 set: token t allowed). Grid (words / 256, n).
extern "C" __global__ void apply_token_mask(float* logits, const unsigned int* masks, int n, int words,
                                            int cols) {
    grid_dep_sync();
    int m = blockIdx.y, w = blockIdx.x * blockDim.x + threadIdx.x;
    if (w >= words) return;
    unsigned int bits = masks[n + (size_t)m * words + w];
    if (bits == 0xffffffffu) return;
    float* row = logits + (size_t)masks[m] * cols;
    for (int b = 0; b < 32; b++) {
        int c = w * 32 + b;
        if (c < cols && !((bits >> b) & 1u)) row[c] = NEG_INF;
    }
}

// logit_bias: adds each (row, token, bias) entry's bias to its logit, after the masks and
// before the sampler. `entries` holds n triples (the bias as float bits).
extern "C" __global__ void apply_logit_bias(float* logits, const unsigned int* entries, int n, int cols) {
    grid_dep_sync();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned int row = entries[3 * i], tok = entries[3 * i + 1];
    if ((int)tok < cols) logits[(size_t)row * cols + tok] += __uint_as_float(entries[3 * i + 2]);
}

extern "C" __global__ void sample_f32(float* logits, const unsigned int* params, unsigned int* entries,
                                      unsigned int* out, int rows, int cols) {
    grid_dep_sync();
    __shared__ Reduce r;
    __shared__ float raw_chosen;
    float* row = logits + (size_t)blockIdx.x * cols;
    const unsigned int* p = params + blockIdx.x * PARAM_WORDS;
    float t = __uint_as_float(p[0]), top_p = __uint_as_float(p[1]), min_p = __uint_as_float(p[2]);
    int top_k = (int)p[3], n_logprobs = (int)p[7];
    unsigned int* ent = entries + ENTRY_WORDS * p[8];
    unsigned int n_ent = p[9];
    unsigned long long base = (unsigned long long)p[10] | ((unsigned long long)p[11] << 32);
    unsigned int* lp = out + rows + (size_t)blockIdx.x * LOGPROB_WORDS;
    if (!p[FULL_WORD]) return;

    // Logprobs of the raw logits.
    float lse = 0.0f;
    if (n_logprobs >= 0) {
        double k = (double)NEG_INF;
        int i = 0x7fffffff;
        for (int c = threadIdx.x; c < cols; c += SAMPLE_THREADS) better(k, i, (double)row[c], c);
        block_argmax(k, i, r);
        float m = (float)k;
        double s = 0.0;
        for (int c = threadIdx.x; c < cols; c += SAMPLE_THREADS) s += (double)expf(row[c] - m);
        lse = m + (float)log(block_sum(s, r));
        float prev = __int_as_float(0x7f800000);  // +inf
        int prev_i = -1;
        for (int j = 0; j < n_logprobs && j < cols; j++) {
            k = (double)NEG_INF;
            i = 0x7fffffff;
            for (int c = threadIdx.x; c < cols; c += SAMPLE_THREADS) {
                float l = row[c];
                if (l < prev || (l == prev && c > prev_i)) better(k, i, (double)l, c);
            }
            block_argmax(k, i, r);
            if (threadIdx.x == 0) {
                lp[1 + 2 * j] = (unsigned int)i;
                lp[2 + 2 * j] = __float_as_uint((float)k - lse);
            }
            prev = (float)k;
            prev_i = i;
        }
    }

    // min_tokens masking and penalties, in place (entries name distinct tokens).
    penalize(row, p, ent, n_ent, 0, cols, threadIdx.x, SAMPLE_THREADS);
    __syncthreads();

    // Greedy: the argmax (the lowest id on ties; 0 when every token is masked).
    double k = (double)NEG_INF;
    int token = 0x7fffffff;
    for (int c = threadIdx.x; c < cols; c += SAMPLE_THREADS) better(k, token, (double)row[c], c);
    block_argmax(k, token, r);
    float max = (float)k;
    if (t != 0.0f && max != NEG_INF) {
        float floor = -3.402823466e+38f;  // keeps every finite logit
        if (top_k > 0) {
            double finite = 0.0;
            for (int c = threadIdx.x; c < cols; c += SAMPLE_THREADS) finite += row[c] > NEG_INF ? 1.0 : 0.0;
            if ((double)top_k < block_sum(finite, r))
                floor = search(row, cols, floor, max, false, (double)top_k, floor, max, t, r);
        }
        if (top_p < 1.0f) {
            double z = 0.0;
            for (int c = threadIdx.x; c < cols; c += SAMPLE_THREADS)
                if (row[c] >= floor) z += (double)expf(scaled(row[c], max, t));
            double target = (double)top_p * block_sum(z, r);
            floor = search(row, cols, floor, max, true, target, floor, max, t, r);
        }
        // Each thread keeps its best key in double; a token whose key, with the noise taken
        // in float, falls more than GUMBEL_F_ERR short of it cannot win, and skips the double
        // logarithms (most do: a thread's best is soon among its highest).
        k = (double)NEG_INF;
        token = 0x7fffffff;
        for (int c = threadIdx.x; c < cols; c += SAMPLE_THREADS) {
            float l = row[c];
            if (l == NEG_INF || l < floor) continue;
            float key = scaled(l, max, t);
            if (min_p > 0.0f && expf(key) < min_p) continue;
            double u = uniform(base, (unsigned int)c);
            if ((double)key + (double)gumbel_f(u) + GUMBEL_F_ERR < k) continue;
            better(k, token, (double)key + gumbel(u), c);
        }
        block_argmax(k, token, r);
    }

    if (n_logprobs >= 0) {
        // The chosen token's raw logit: its entry's saved value when a rule touched it.
        if (threadIdx.x == 0) raw_chosen = row[token];
        __syncthreads();
        for (unsigned int e = threadIdx.x; e < n_ent; e += SAMPLE_THREADS)
            if (ent[ENTRY_WORDS * e] == (unsigned int)token) raw_chosen = __uint_as_float(ent[ENTRY_WORDS * e + 2]);
        __syncthreads();
        if (threadIdx.x == 0) lp[0] = __float_as_uint(raw_chosen - lse);
    }
    if (threadIdx.x == 0) out[blockIdx.x] = (unsigned int)token;
}

// The split sampler. Row r's columns are cut into `slices` slices of `chunk` columns (a
// multiple of 4), each taken by one block of SPLIT_THREADS threads (grid: slices × rows):
// - sample_max applies the row's penalties in its slice and writes the slice's argmax;
// - sample_race, for a sampled row, takes the row's max from those, runs the race over its
//   slice and writes the slice's best score;
// - sample_pick writes each row's winner.
// Partials live in `scratch`: (max, index) pairs for every (row, slice), then the race's
// scores (double) and their indices.
#define SPLIT_THREADS 256
#define SPLIT_WARPS (SPLIT_THREADS / 32)
// sample_max's and sample_race's parameters (sample_race leaves the entries alone).
#define SPLIT_ARGS                                                                                        \
    float *logits, const unsigned int *params, unsigned int *entries, unsigned int *scratch, int rows, int cols, \
        int slices, int chunk

// Calls f(value, column) for this thread's columns of row[c0, c1), a V-float vector per
// load (V = 4 needs c0 and c1 multiples of 4) and four loads in flight, and group() after
// each four loads that the whole warp made (so that group() may use warp shuffles).
template <int V, typename F, typename G>
__device__ __forceinline__ void for_slice(const float* row, int c0, int c1, F f, G group) {
    const int step = SPLIT_THREADS * V;
    int c = c0 + threadIdx.x * V;
    const int lane_off = (threadIdx.x & 31) * V;  // c − lane_off is the same across the warp
    for (; c - lane_off + 32 * V + 3 * step <= c1; c += 4 * step) {
        float x[4][V];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            if constexpr (V == 4) {
                float4 v = *reinterpret_cast<const float4*>(row + c + u * step);
                x[u][0] = v.x;
                x[u][1] = v.y;
                x[u][2] = v.z;
                x[u][3] = v.w;
            } else {
                x[u][0] = row[c + u * step];
            }
        }
#pragma unroll
        for (int u = 0; u < 4; u++)
#pragma unroll
            for (int v = 0; v < V; v++) f(x[u][v], c + u * step + v);
        group();
    }
    for (; c < c1; c += step) {
        if constexpr (V == 4) {
            float4 v = *reinterpret_cast<const float4*>(row + c);
            f(v.x, c);
            f(v.y, c + 1);
            f(v.z, c + 2);
            f(v.w, c + 3);
        } else {
            f(row[c], c);
        }
    }
}

struct Slice {
    const unsigned int* p;  // the row's parameters
    float* row;
    int c0, c1;             // the block's columns
    unsigned int* part;     // this (row, slice)'s argmax pair
    double* score;          // this (row, slice)'s race score, and its index
    int* score_idx;
    const unsigned int* row_parts;  // the row's argmax pairs
};

__device__ __forceinline__ Slice slice_of(float* logits, const unsigned int* params, unsigned int* scratch, int rows,
                                          int cols, int slices, int chunk) {
    int r = blockIdx.y, s = blockIdx.x;
    Slice sl;
    sl.p = params + r * PARAM_WORDS;
    sl.row = logits + (size_t)r * cols;
    sl.c0 = min(cols, s * chunk);
    sl.c1 = min(cols, sl.c0 + chunk);
    sl.row_parts = scratch + 2 * r * slices;
    sl.part = scratch + 2 * (r * slices + s);
    double* scores = reinterpret_cast<double*>(scratch + 2 * rows * slices);
    sl.score = scores + r * slices + s;
    sl.score_idx = reinterpret_cast<int*>(scores + rows * slices) + r * slices + s;
    return sl;
}

// The row's max and its index (the lowest on ties) from its slices' pairs.
template <int WARPS>
__device__ void row_max(const unsigned int* parts, int slices, double& k, int& i, ReduceT<WARPS>& r) {
    k = (double)NEG_INF;
    i = 0x7fffffff;
    for (int s = threadIdx.x; s < slices; s += 32 * WARPS) better(k, i, (double)__uint_as_float(parts[2 * s]), (int)parts[2 * s + 1]);
    block_argmax(k, i, r);
}

extern "C" __global__ void __launch_bounds__(SPLIT_THREADS) sample_max(SPLIT_ARGS) {
    grid_dep_sync();
    __shared__ ReduceT<SPLIT_WARPS> r;
    Slice sl = slice_of(logits, params, scratch, rows, cols, slices, chunk);
    if (sl.p[FULL_WORD]) return;
    penalize(sl.row, sl.p, entries + ENTRY_WORDS * sl.p[8], sl.p[9], sl.c0, sl.c1, threadIdx.x, SPLIT_THREADS);
    __syncthreads();
    float k = NEG_INF;
    int i = 0x7fffffff;
    auto f = [&](float l, int c) {
        if (l > k || (l == k && c < i)) {
            k = l;
            i = c;
        }
    };
    auto none = [] {};
    if ((cols & 3) == 0) for_slice<4>(sl.row, sl.c0, sl.c1, f, none);
    else for_slice<1>(sl.row, sl.c0, sl.c1, f, none);
    double kd = (double)k;
    block_argmax(kd, i, r);
    if (threadIdx.x == 0) {
        sl.part[0] = __float_as_uint((float)kd);
        sl.part[1] = (unsigned int)i;
    }
}

__device__ __forceinline__ float ex2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// A token's race score as sample_f32 computes it (−inf when min-p drops it); out of line,
// as few tokens get this far.
__device__ __noinline__ double race_score(float l, float max, float t, float min_p, unsigned long long h) {
    float key = scaled(l, max, t);
    if (min_p > 0.0f && expf(key) < min_p) return (double)NEG_INF;
    return (double)key + gumbel(uniform_of(h));
}

extern "C" __global__ void __launch_bounds__(SPLIT_THREADS) sample_race(SPLIT_ARGS) {
    grid_dep_sync();
    __shared__ ReduceT<SPLIT_WARPS> r;
    Slice sl = slice_of(logits, params, scratch, rows, cols, slices, chunk);
    float t = __uint_as_float(sl.p[0]), min_p = __uint_as_float(sl.p[2]);
    if (sl.p[FULL_WORD] || t == 0.0f) return;
    double mk;
    int mi;
    row_max(sl.row_parts, slices, mk, mi, r);
    float max = (float)mk;
    if (max == NEG_INF) return;  // sample_pick takes index 0
    unsigned long long base = (unsigned long long)sl.p[10] | ((unsigned long long)sl.p[11] << 32);
    float inv_t = 1.0f / t;
    double k = (double)NEG_INF;
    int token = 0x7fffffff;
    // th: a lower bound on the row's winning score (the warp's best so far, less rounding),
    // first from float estimates of the scores of this warp's first vectors.
    float th = NEG_INF;
    auto seed = [&](float l, int c) {
        if (l == NEG_INF) return;
        float key = scaled(l, max, t);
        if (min_p > 0.0f && expf(key) < min_p) return;
        th = fmaxf(th, key + gumbel_f(uniform(base, (unsigned int)c)) - (2 * GUMBEL_F_ERR + 1e-5f * fabsf(key)));
    };
    auto share = [&] {
        for (int o = 16; o > 0; o >>= 1) th = fmaxf(th, __shfl_xor_sync(0xffffffff, th, o));
    };
    auto none = [] {};
    // A token can win only if its noise g(u) = −ln(−ln u) reaches d, its key's distance
    // below th, that is only if u ≥ exp(−exp(−d)). d is taken from float keys and shrunk
    // by more than their rounding, the bound on u loosened by 2⁻²⁰ past the approximate
    // exponentials' error and u read from its hash's top 24 bits (below u by under 2⁻²⁴):
    // a skipped token could not have won, nor tied. Noise never exceeds 37 (u < 1 − 2⁻⁵³).
    auto f = [&](float l, int c) {
        if (l == NEG_INF) return;
        float ka = (l - max) * inv_t;
        float d = th - ka - (1e-3f + 1e-5f * (fabsf(ka) + fabsf(th)));
        if (d > 37.0f) return;
        unsigned long long h = splitmix64(base ^ (unsigned long long)c);
        float uf = (float)(unsigned int)(h >> 40) * 5.9604645e-8f;
        if (uf + 9.5367432e-7f < ex2_approx(-ex2_approx(-d * 1.44269504f) * 1.44269504f)) return;
        double score = race_score(l, max, t, min_p, h);
        if (score != (double)NEG_INF && better(k, token, score, c)) th = fmaxf(th, (float)k);
    };
    if ((cols & 3) == 0) {
        for_slice<4>(sl.row, sl.c0, min(sl.c1, sl.c0 + 4 * SPLIT_THREADS), seed, none);
        share();
        for_slice<4>(sl.row, sl.c0, sl.c1, f, share);
    } else {
        for_slice<1>(sl.row, sl.c0, min(sl.c1, sl.c0 + SPLIT_THREADS), seed, none);
        share();
        for_slice<1>(sl.row, sl.c0, sl.c1, f, share);
    }
    block_argmax(k, token, r);
    if (threadIdx.x == 0) {
        *sl.score = k;
        *sl.score_idx = token;
    }
}

// One warp a row: the greedy rows' argmax, the sampled rows' best score, as the token.
extern "C" __global__ void sample_pick(const unsigned int* params, const unsigned int* scratch, unsigned int* out,
                                       int rows, int slices) {
    grid_dep_sync();
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (row >= rows) return;
    const unsigned int* p = params + row * PARAM_WORDS;
    if (p[FULL_WORD]) return;
    const unsigned int* parts = scratch + 2 * row * slices;
    double k = (double)NEG_INF;
    int i = 0x7fffffff;
    for (int s = lane; s < slices; s += 32) better(k, i, (double)__uint_as_float(parts[2 * s]), (int)parts[2 * s + 1]);
    warp_argmax(k, i);
    if (__uint_as_float(p[0]) != 0.0f && k != (double)NEG_INF) {
        const double* all = reinterpret_cast<const double*>(scratch + 2 * rows * slices);
        const double* scores = all + row * slices;
        const int* idx = reinterpret_cast<const int*>(all + rows * slices) + row * slices;
        k = (double)NEG_INF;
        i = 0x7fffffff;
        for (int s = lane; s < slices; s += 32) better(k, i, scores[s], idx[s]);
        warp_argmax(k, i);
    }
    if (lane == 0) out[row] = (unsigned int)i;
}

// A step's token ids that name a row of the sampling before it (FED_TOKEN | row, the host's
// kernels::FED_TOKEN) take that row's token from its output: the step was issued before the
// host had the tokens.
extern "C" __global__ void feed_tokens(unsigned int* ids, const unsigned int* sampled, int n) {
    grid_dep_sync();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && (ids[i] & 0x80000000u)) ids[i] = sampled[ids[i] & 0x7fffffffu];
}
