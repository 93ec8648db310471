// Paged KV cache and attention. Cache layout per layer: [num_blocks, block_size, kv_heads,
// head_dim] for K and for V, f32.

extern "C" __global__ void write_kv_f32(const float* k, const float* v, float* kc, float* vc, const long long* slots, int width) {
    int t = blockIdx.x;
    long long s = slots[t];
    if (s < 0) return;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        kc[s * width + i] = k[(size_t)t * width + i];
        vc[s * width + i] = v[(size_t)t * width + i];
    }
}

// One block per (token, head): scores over the token's causal context through its
// sequence's block table, softmax, weighted sum of V. `tables` holds every sequence's
// block table at `table_off[seq]`. Dynamic shared memory: ctx_max floats of scores.
extern "C" __global__ void paged_attention_f32(const float* q, const float* kc, const float* vc, float* out,
                                               const unsigned int* positions, const unsigned int* token_seq,
                                               const unsigned int* tables, const unsigned int* table_off,
                                               int heads, int kv_heads, int head_dim, int block_size, float scale) {
    extern __shared__ float scores[];
    __shared__ float red[32];
    int t = blockIdx.x / heads, h = blockIdx.x % heads;
    int kvh = h / (heads / kv_heads);
    int width = kv_heads * head_dim;
    int ctx = positions[t] + 1;
    const unsigned int* table = tables + table_off[token_seq[t]];
    const float* qv = q + ((size_t)t * heads + h) * head_dim;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    // Scores: one warp per position.
    for (int p = warp; p < ctx; p += nw) {
        size_t at = ((size_t)table[p / block_size] * block_size + p % block_size) * width + kvh * head_dim;
        float s = 0.0f;
        for (int d = lane; d < head_dim; d += 32) s += qv[d] * kc[at + d];
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
        if (lane == 0) scores[p] = s * scale;
    }
    __syncthreads();
    float m = -3.0e38f;
    for (int p = threadIdx.x; p < ctx; p += blockDim.x) m = fmaxf(m, scores[p]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = -3.0e38f;
    for (int w = 0; w < nw; w++) m = fmaxf(m, red[w]);
    __syncthreads();
    float sum = 0.0f;
    for (int p = threadIdx.x; p < ctx; p += blockDim.x) {
        float e = expf(scores[p] - m);
        scores[p] = e;
        sum += e;
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
    if (lane == 0) red[warp] = sum;
    __syncthreads();
    sum = 0.0f;
    for (int w = 0; w < nw; w++) sum += red[w];
    float inv = 1.0f / sum;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int p = 0; p < ctx; p++) {
            size_t at = ((size_t)table[p / block_size] * block_size + p % block_size) * width + kvh * head_dim;
            acc += scores[p] * vc[at + d];
        }
        out[((size_t)t * heads + h) * head_dim + d] = acc * inv;
    }
}

// Batched LoRA (BGMV): one block per row; row t with slot s >= 0 gets
// y[t, off + o] += sum_r Bt[s, r, o] * (A[s, r, :] . x[t, :]). Dynamic shared: max_rank floats.
extern "C" __global__ void lora_f32(float* y, const float* x, const float* a, const float* bt, const int* ranks,
                                    const int* slots, int max_rank, int fin, int fout, int off, int ycols) {
    extern __shared__ float v[];
    int t = blockIdx.x;
    int s = slots[t];
    if (s < 0) return;
    int rank = ranks[s];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int r = warp; r < rank; r += nw) {
        const float* ar = a + ((size_t)s * max_rank + r) * fin;
        float acc = 0.0f;
        for (int i = lane; i < fin; i += 32) acc += ar[i] * x[(size_t)t * fin + i];
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, o);
        if (lane == 0) v[r] = acc;
    }
    __syncthreads();
    for (int o = threadIdx.x; o < fout; o += blockDim.x) {
        float acc = 0.0f;
        for (int r = 0; r < rank; r++) acc += v[r] * bt[((size_t)s * max_rank + r) * fout + o];
        y[(size_t)t * ycols + off + o] += acc;
    }
}
