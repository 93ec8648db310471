// Batched LoRA (lora.rs). For a few rows, Punica's BGMV: each row reads only its own slot's
// A and B, in two launches per group of modules that read the same x (q/k/v, gate/up, o,
// down). Weights are W (f32 or bf16), A `[slots · R, in]` and Bᵀ `[slots · R, out]` per
// module, ranks under R padded with zeros; x and y are f32. For more rows cuBLAS runs the
// GEMMs and lora_mask_f32 (at the end) keeps each row's own slot between them.

// Ranks are taken 16 at a time so that each thread issues 16 independent loads at once
// (a loop over a runtime rank would wait on one load after another).
#define RCHUNK 16

// Shrink: part[p][t][m·R + r] = Σ over the p-th chunk of kc input features of
// A_m[s·R + r][i] · x[t][i], with s = slots[t] (rows without a slot are skipped).
// Grid (rows, modules, parts), 128 threads; each thread takes 4 features at a time.
template <typename W>
__device__ void lora_shrink(float* part, const float* x, const W* a0, const W* a1, const W* a2,
                            const int* slots, int rows, int fin, int kc, int rank) {
    __shared__ float red[4][RCHUNK];
    int t = blockIdx.x, m = blockIdx.y, p = blockIdx.z;
    int s = slots[t];
    if (s < 0) return;
    const W* a = (m == 0 ? a0 : (m == 1 ? a1 : a2)) + (size_t)s * rank * fin + (size_t)p * kc;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float* xr = x + (size_t)t * fin + (size_t)p * kc;
    int width = gridDim.y * rank;
    bool vec = (kc & 3) == 0 && (fin & 3) == 0;
    for (int r0 = 0; r0 < rank; r0 += RCHUNK) {
        float acc[RCHUNK];
#pragma unroll
        for (int j = 0; j < RCHUNK; j++) acc[j] = 0.0f;
        if (vec) {
            for (int i = threadIdx.x * 4; i < kc; i += blockDim.x * 4) {
                float4 v = *(const float4*)(xr + i);
                float4 w[RCHUNK];
#pragma unroll
                for (int j = 0; j < RCHUNK; j++)
                    w[j] = r0 + j < rank ? ld4(a + (size_t)(r0 + j) * fin + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
                for (int j = 0; j < RCHUNK; j++) acc[j] += w[j].x * v.x + w[j].y * v.y + w[j].z * v.z + w[j].w * v.w;
            }
        } else {
            for (int i = threadIdx.x; i < kc; i += blockDim.x) {
                float v = xr[i];
#pragma unroll
                for (int j = 0; j < RCHUNK; j++)
                    if (r0 + j < rank) acc[j] += ld(a + (size_t)(r0 + j) * fin + i) * v;
            }
        }
#pragma unroll
        for (int j = 0; j < RCHUNK; j++)
            for (int o = 16; o > 0; o >>= 1) acc[j] += __shfl_xor_sync(0xffffffff, acc[j], o);
        if (lane == 0) {
#pragma unroll
            for (int j = 0; j < RCHUNK; j++) red[warp][j] = acc[j];
        }
        __syncthreads();
        int j = threadIdx.x;
        if (j < RCHUNK && r0 + j < rank)
            part[((size_t)p * rows + t) * width + m * rank + r0 + j] = red[0][j] + red[1][j] + red[2][j] + red[3][j];
        __syncthreads();
    }
}

// Expand: y[t][off_m + o] += Σ_r v[r] · Bᵀ_m[s·R + r][o], v the shrink's parts summed.
// Grid (rows, blocks of 4 · blockDim columns, modules); each thread takes 4 columns.
template <typename W>
__device__ void lora_expand(float* y, const float* part, const W* b0, const W* b1, const W* b2,
                            const int* slots, int rows, int parts, int rank, int f0, int f1, int f2, int o0,
                            int o1, int o2, int ycols) {
    __shared__ float v[512 + RCHUNK];  // --max-lora-rank is at most 512; zeros past the rank
    int t = blockIdx.x, m = blockIdx.z;
    int s = slots[t];
    if (s < 0) return;
    int fout = m == 0 ? f0 : (m == 1 ? f1 : f2);
    int off = m == 0 ? o0 : (m == 1 ? o1 : o2);
    const W* bt = (m == 0 ? b0 : (m == 1 ? b1 : b2)) + (size_t)s * rank * fout;
    int width = gridDim.z * rank;
    for (int r = threadIdx.x; r < rank + RCHUNK; r += blockDim.x) {
        float acc = 0.0f;
        if (r < rank)
            for (int p = 0; p < parts; p++) acc += part[((size_t)p * rows + t) * width + m * rank + r];
        v[r] = acc;
    }
    __syncthreads();
    int o = (blockIdx.y * blockDim.x + threadIdx.x) * 4;
    if (o >= fout) return;
    float* yr = y + (size_t)t * ycols + off;
    if ((fout & 3) == 0) {
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int r0 = 0; r0 < rank; r0 += RCHUNK) {
            float4 w[RCHUNK];
#pragma unroll
            for (int j = 0; j < RCHUNK; j++)
                w[j] = r0 + j < rank ? ld4(bt + (size_t)(r0 + j) * fout + o) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
            for (int j = 0; j < RCHUNK; j++) {
                float vr = v[r0 + j];
                acc.x += vr * w[j].x;
                acc.y += vr * w[j].y;
                acc.z += vr * w[j].z;
                acc.w += vr * w[j].w;
            }
        }
        yr[o] += acc.x;
        yr[o + 1] += acc.y;
        yr[o + 2] += acc.z;
        yr[o + 3] += acc.w;
    } else {
        for (int c = o; c < o + 4 && c < fout; c++) {
            float acc = 0.0f;
            for (int r = 0; r < rank; r++) acc += v[r] * ld(bt + (size_t)r * fout + c);
            yr[c] += acc;
        }
    }
}

#define LORA_BGMV(sfx, W)                                                                                     \
    extern "C" __global__ void lora_shrink_##sfx(float* part, const float* x, const W* a0, const W* a1,      \
                                                 const W* a2, const int* slots, int rows, int fin, int kc,    \
                                                 int rank) { grid_dep_sync();                                 \
        lora_shrink<W>(part, x, a0, a1, a2, slots, rows, fin, kc, rank);                                      \
    }                                                                                                         \
    extern "C" __global__ void lora_expand_##sfx(float* y, const float* part, const W* b0, const W* b1,      \
                                                 const W* b2, const int* slots, int rows, int parts,         \
                                                 int rank, int f0, int f1, int f2, int o0, int o1, int o2,   \
                                                 int ycols) { grid_dep_sync();                               \
        lora_expand<W>(y, part, b0, b1, b2, slots, rows, parts, rank, f0, f1, f2, o0, o1, o2, ycols);         \
    }
LORA_BGMV(f32, float)
LORA_BGMV(bf16, __nv_bfloat16)

// Masked LoRA shrink output: v holds `parts` partial sums (split over the input features)
// of `[rows, width]` (total values each), `width / per` modules side by side, each `per` =
// slots · R columns of x · Aᵀ over every slot's A. Row t keeps only the R columns of its own
// slot (slots[t]; none when negative), summed over the parts, so that one GEMM against
// every slot's Bᵀ expands each row with its own adapter. kind 0 writes the result over the
// first part, 1 (bf16) and 2 (f16) write it rounded into v16.
extern "C" __global__ void lora_mask_f32(float* v, void* v16, const int* slots, int width, int per, int rank,
                                         long long total, int kind, int parts) {
    grid_dep_sync();
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= total) return;
    int t = (int)(i / width), c = (int)(i % width);
    int s = slots[t];
    float x = 0.0f;
    if (s >= 0 && (c % per) / rank == s)
        for (int p = 0; p < parts; p++) x += v[i + p * total];
    if (kind) store16(v16, i, x, kind);
    else v[i] = x;
}
