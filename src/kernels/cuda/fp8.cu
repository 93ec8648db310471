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

__device__ __forceinline__ float2 fp8_pair_of(unsigned u, __nv_bfloat16*) {
    return __bfloat1622float2(*(const __nv_bfloat162*)&u);
}
__device__ __forceinline__ float2 fp8_pair_of(unsigned u, __half*) {
    return __half22float2(*(const __half2*)&u);
}

// x [m, k] (k % 8 == 0) into q [m, k] e4m3 bytes and scales [m]: a block a row, 8 values a
// thread at a time. A row of zeros takes scale 1.
template <typename T>
__device__ void quantize_fp8_rows(const T* __restrict__ x, int k, unsigned char* __restrict__ q,
                                  float* __restrict__ scales) {
    grid_dep_wait();
    const size_t row = blockIdx.x;
    const uint4* xr = (const uint4*)(x + row * k);
    const int chunks = k / 8;
    float amax = 0.f;
    for (int c = threadIdx.x; c < chunks; c += FP8_THREADS) {
        const uint4 v = xr[c];
        const unsigned u[4] = {v.x, v.y, v.z, v.w};
        for (int j = 0; j < 4; ++j) {
            const float2 f = fp8_pair_of(u[j], (T*)nullptr);
            amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
        }
    }
    amax = fp8_block_max(amax);
    const float scale = amax > 0.f ? amax / 448.f : 1.f;
    if (threadIdx.x == 0) scales[row] = scale;
    uint2* qr = (uint2*)(q + row * k);
    for (int c = threadIdx.x; c < chunks; c += FP8_THREADS) {
        const uint4 v = xr[c];
        const unsigned u[4] = {v.x, v.y, v.z, v.w};
        unsigned short pairs[4];
        for (int j = 0; j < 4; ++j) {
            const float2 f = fp8_pair_of(u[j], (T*)nullptr);
            pairs[j] = __nv_cvt_float2_to_fp8x2(make_float2(__fdiv_rn(f.x, scale), __fdiv_rn(f.y, scale)),
                                                __NV_SATFINITE, __NV_E4M3);
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
        float o[4] = {v.x * sx * w.x, v.y * sx * w.y, v.z * sx * w.z, v.w * sx * w.w};
        if (kind == 0) {
            float4* p = (float4*)out + i;
            if (beta != 0.f) {
                const float4 b = *p;
                o[0] += beta * b.x, o[1] += beta * b.y, o[2] += beta * b.z, o[3] += beta * b.w;
            }
            *p = make_float4(o[0], o[1], o[2], o[3]);
        } else {
            if (beta != 0.f) {
                const uint2 b = ((const uint2*)out)[i];
                const unsigned u[2] = {b.x, b.y};
                for (int j = 0; j < 2; ++j) {
                    const float2 f = kind == 1 ? fp8_pair_of(u[j], (__nv_bfloat16*)nullptr)
                                               : fp8_pair_of(u[j], (__half*)nullptr);
                    o[2 * j] += beta * f.x, o[2 * j + 1] += beta * f.y;
                }
            }
            store16x4(out, 4 * i, o[0], o[1], o[2], o[3], kind);
        }
    }
    grid_dep_launch();
}
