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
// Row parameters, 12 words each (sampling::PARAM_WORDS):
//   0 temperature (0 = greedy)  1 top_p  2 min_p  3 top_k (≤ 0 off)  4 repetition penalty
//   5 presence  6 frequency  7 logprobs n (-1 none)  8 first entry  9 entries
//   10, 11 noise base (low, high word)
// Entries, 3 words each (sampling::ENTRY_WORDS), one per distinct token a rule touches:
//   0 token  1 bit 31 masked, bit 30 seen (repetition penalty), bits 0..29 count in the output
//   2 written here: the token's raw logit
// Output: tokens [rows], then per row LOGPROB_WORDS words: the chosen token's logprob and
// n (id, logprob) pairs, most likely first.

#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
#define PARAM_WORDS 12
#define ENTRY_WORDS 3
#define LOGPROB_WORDS 41
#define NEG_INF __int_as_float(0xff800000)

struct Reduce {
    double key[SAMPLE_WARPS];
    int idx[SAMPLE_WARPS];
};

__device__ __forceinline__ void better(double& k, int& i, double ok, int oi) {
    if (ok > k || (ok == k && oi < i)) { k = ok; i = oi; }
}

// The largest key in the block and its index (the lowest on ties), to every thread.
__device__ void block_argmax(double& k, int& i, Reduce& r) {
    for (int o = 16; o > 0; o >>= 1) {
        double ok = __shfl_xor_sync(0xffffffff, k, o);
        int oi = __shfl_xor_sync(0xffffffff, i, o);
        better(k, i, ok, oi);
    }
    __syncthreads();  // the previous reduction's readers are done with r
    if ((threadIdx.x & 31) == 0) { r.key[threadIdx.x >> 5] = k; r.idx[threadIdx.x >> 5] = i; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < SAMPLE_WARPS; w++) better(k, i, r.key[w], r.idx[w]);
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

// u uniform in (0, 1) for token i (sampling::gumbel's).
__device__ __forceinline__ double uniform(unsigned long long base, unsigned int i) {
    unsigned long long h = splitmix64(base ^ (unsigned long long)i);
    return ((double)(h >> 12) + 0.5) * (1.0 / 4503599627370496.0);
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

extern "C" __global__ void sample_f32(float* logits, const unsigned int* params, unsigned int* entries,
                                      unsigned int* out, int rows, int cols) {
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
    float rep = __uint_as_float(p[4]), presence = __uint_as_float(p[5]), freq = __uint_as_float(p[6]);
    for (unsigned int e = threadIdx.x; e < n_ent; e += SAMPLE_THREADS) {
        unsigned int tok = ent[ENTRY_WORDS * e], info = ent[ENTRY_WORDS * e + 1];
        float l = row[tok];
        ent[ENTRY_WORDS * e + 2] = __float_as_uint(l);
        if (info & 0x40000000u) l = l > 0.0f ? __fdiv_rn(l, rep) : __fmul_rn(l, rep);
        unsigned int count = info & 0x3fffffffu;
        if (count > 0) l = __fsub_rn(l, __fadd_rn(__fmul_rn(freq, (float)count), presence));
        if (info & 0x80000000u) l = NEG_INF;
        row[tok] = l;
    }
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
