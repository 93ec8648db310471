// FP8 (e4m3) activations for the W8A8 GEMMs of FP8 weights (fp8_gemm.rs): each row of x
// (a token's features, in the weights' 16-bit type) scaled by its own amax / 448 and
// rounded to e4m3, nearest even, as vLLM's dynamic per-token quantization does.
#include <cuda_fp8.h>

#define FP8_THREADS 256

// The largest |x| of a row, shared by the block's threads.
__device__ __forceinline__ float fp8_block_max(float v) {
    __shared__ float warps[FP8_THREADS / 32];
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    if ((threadIdx.x & 31) == 0) warps[threadIdx.x >> 5] = v;
    __syncthreads();
    v = warps[0];
    for (int w = 1; w < FP8_THREADS / 32; ++w) v = fmaxf(v, warps[w]);
    return v;
}

// x [m, k] (k % 8 == 0) into q [m, k] e4m3 bytes and scales [m]: a block a row, 8 values a
// thread at a time. A row of zeros takes scale 1.
template <typename T>
__device__ void quantize_fp8_rows(const T* __restrict__ x, int k, unsigned char* __restrict__ q,
                                  float* __restrict__ scales) {
    grid_dep_wait();
    const size_t row = blockIdx.x;
    const T* xr = x + row * k;
    const int chunks = k / 8;
    float amax = 0.f;
    for (int c = threadIdx.x; c < chunks; c += FP8_THREADS) {
        float v[8];
        ld8f(xr + 8 * c, v);
        for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(v[j]));
    }
    amax = fp8_block_max(amax);
    const float scale = amax > 0.f ? amax / 448.f : 1.f;
    if (threadIdx.x == 0) scales[row] = scale;
    uint2* qr = (uint2*)(q + row * k);
    for (int c = threadIdx.x; c < chunks; c += FP8_THREADS) {
        float v[8];
        ld8f(xr + 8 * c, v);
        unsigned short pairs[4];
        for (int j = 0; j < 4; ++j) {
            const float2 f = make_float2(__fdiv_rn(v[2 * j], scale), __fdiv_rn(v[2 * j + 1], scale));
            pairs[j] = __nv_cvt_float2_to_fp8x2(f, __NV_SATFINITE, __NV_E4M3);
        }
        qr[c] = make_uint2(pairs[0] | ((unsigned)pairs[1] << 16), pairs[2] | ((unsigned)pairs[3] << 16));
    }
    grid_dep_launch();
}

extern "C" __global__ void __launch_bounds__(FP8_THREADS)
    quantize_fp8_rows_bf16(const __nv_bfloat16* x, int k, unsigned char* q, float* scales) {
    quantize_fp8_rows(x, k, q, scales);
}
extern "C" __global__ void __launch_bounds__(FP8_THREADS)
    quantize_fp8_rows_f16(const __half* x, int k, unsigned char* q, float* scales) {
    quantize_fp8_rows(x, k, q, scales);
}

// The W8A8 GEMM's raw sums [m, n] (f32, of x's and the weights' e4m3 values) times x's row
// scale and the weight's row scale, plus beta times out: out f32 (kind 0), bf16 (1) or f16
// (2). n % 4 == 0; 4 values a thread.
extern "C" __global__ void fp8_scale_sums(const float* __restrict__ raw, const float* __restrict__ x_scales,
                                          const float* __restrict__ w_scales, void* out, int kind, int m, int n,
                                          float beta) {
    grid_dep_wait();
    const size_t quads = (size_t)m * (n / 4);
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < quads; i += (size_t)gridDim.x * blockDim.x) {
        const size_t t = i / (n / 4);
        const int r = (int)(i % (n / 4)) * 4;
        const float4 v = ((const float4*)raw)[i];
        const float4 w = *(const float4*)(w_scales + r);
        const float sx = x_scales[t];
        float4 o = make_float4(v.x * sx * w.x, v.y * sx * w.y, v.z * sx * w.z, v.w * sx * w.w);
        if (beta != 0.f) {
            const float4 b = kind == 0   ? ld4((const float*)out + 4 * i)
                             : kind == 1 ? ld4((const __nv_bfloat16*)out + 4 * i)
                                         : ld4((const __half*)out + 4 * i);
            o = make_float4(o.x + beta * b.x, o.y + beta * b.y, o.z + beta * b.z, o.w + beta * b.w);
        }
        if (kind == 0) st4((float*)out + 4 * i, o);
        else store16x4(out, 4 * i, o.x, o.y, o.z, o.w, kind);
    }
    grid_dep_launch();
}
