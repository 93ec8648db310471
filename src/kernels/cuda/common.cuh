// Prepended to every kernel source.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

// Programmatic dependent launch (sm_90 and later), the first statement of every kernel:
// inside a CUDA graph whose kernel-to-kernel edges are programmatic (graph.rs), a kernel is
// launched while the one before it still runs, and waits here for it to finish and its
// writes to land before touching memory; then it lets the next kernel launch in turn.
// Outside such a graph both are no-ops. Some kernels load what does not depend on the
// kernel before first: rms_norm_f32 its norm weights, the GEMVs (gemv.cu) their first
// weight chunks (and gemv_res_norm its residual and norm weights, gemv_qkv_rope the step's
// positions, slots and frequencies), flash_decode's 16-bit kernels the rows' metadata and
// block tables; the GEMVs also issue the two apart.
__device__ __forceinline__ void grid_dep_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dep_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dep_sync() {
    grid_dep_wait();
    grid_dep_launch();
}

// Stores v rounded to 16 bits: kind 1 is bf16, 2 is f16 (the dtype of the GEMM's weights).
__device__ __forceinline__ void store16(void* p, size_t i, float v, int kind) {
    if (kind == 1) ((__nv_bfloat16*)p)[i] = __float2bfloat16(v);
    else ((__half*)p)[i] = __float2half(v);
}

// Two values at i (even) rounded to 16 bits, in one 4-byte store.
__device__ __forceinline__ void store16x2(void* p, size_t i, float a, float b, int kind) {
    unsigned u;
    if (kind == 1) {
        __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
        u = *(unsigned*)&v;
    } else {
        __half2 v = __floats2half2_rn(a, b);
        u = *(unsigned*)&v;
    }
    *(unsigned*)((unsigned short*)p + i) = u;
}

// Four values at i (a multiple of 4) rounded to 16 bits, in one 8-byte store.
__device__ __forceinline__ void store16x4(void* p, size_t i, float a, float b, float c, float d, int kind) {
    uint2 u;
    if (kind == 1) {
        __nv_bfloat162 lo = __floats2bfloat162_rn(a, b), hi = __floats2bfloat162_rn(c, d);
        u = make_uint2(*(unsigned*)&lo, *(unsigned*)&hi);
    } else {
        __half2 lo = __floats2half2_rn(a, b), hi = __floats2half2_rn(c, d);
        u = make_uint2(*(unsigned*)&lo, *(unsigned*)&hi);
    }
    *(uint2*)((unsigned short*)p + i) = u;
}

// KV cache elements: f32, or the 16-bit type of a 16-bit model, read and written as f32.
__device__ __forceinline__ float ld(const float* p) { return *p; }
__device__ __forceinline__ float ld(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float ld(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ void st(float* p, float v) { *p = v; }
__device__ __forceinline__ void st(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }
__device__ __forceinline__ void st(__half* p, float v) { *p = __float2half(v); }
// Four consecutive elements (16-byte aligned for f32, 8-byte for 16-bit types).
__device__ __forceinline__ float4 ld4(const float* p) { return *(const float4*)p; }
__device__ __forceinline__ float4 ld4(const __nv_bfloat16* p) {
    uint2 u = *(const uint2*)p;
    float2 a = __bfloat1622float2(*(__nv_bfloat162*)&u.x), b = __bfloat1622float2(*(__nv_bfloat162*)&u.y);
    return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ float4 ld4(const __half* p) {
    uint2 u = *(const uint2*)p;
    float2 a = __half22float2(*(__half2*)&u.x), b = __half22float2(*(__half2*)&u.y);
    return make_float4(a.x, a.y, b.x, b.y);
}
// Four values stored at p as T, in one store (16-byte aligned for f32, 8-byte for 16-bit types).
__device__ __forceinline__ void st4(float* p, float4 v) { *(float4*)p = v; }
__device__ __forceinline__ void st4(__nv_bfloat16* p, float4 v) {
    __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
    *(uint2*)p = make_uint2(*(unsigned*)&lo, *(unsigned*)&hi);
}
__device__ __forceinline__ void st4(__half* p, float4 v) {
    __half2 lo = __floats2half2_rn(v.x, v.y), hi = __floats2half2_rn(v.z, v.w);
    *(uint2*)p = make_uint2(*(unsigned*)&lo, *(unsigned*)&hi);
}

// Sliding windows and soft caps in the flash kernels (flash.cu) and the reduction of their
// partitions (attention.cu). A decode row of `ctx` keys with a window of `window` keys
// (0: none) reads its keys from the window's first one rounded down to a chunk of 16, so
// that its partitions start on flash_decode's chunks (the keys before the window masked).
__device__ __forceinline__ int decode_first(int ctx, int window) {
    return window > 0 ? (max(0, ctx - window) & ~15) : 0;
}
// A score soft-capped as Gemma 2 does (cap · tanh(score / cap)); `cap` 0: unchanged. Scores
// in log2 units take the cap in those units too.
__device__ __forceinline__ float soft_cap(float s, float cap) { return cap > 0.0f ? cap * tanhf(s / cap) : s; }

// MLP activations by code (kernels::Activation): 0 SiLU, 1 GELU's tanh approximation,
// 2 ReLU.
__device__ __forceinline__ float act_fn(float x, int act) {
    if (act == 1) {
        const float k = 0.7978845608f;  // √(2/π)
        return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
    }
    if (act == 2) return fmaxf(x, 0.0f);
    return x / (1.0f + expf(-x));
}
