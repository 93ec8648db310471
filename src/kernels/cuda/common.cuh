// Prepended to every kernel source.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

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

// KV cache elements: f32, the 16-bit type of a 16-bit model, or kv_fp8 (below), read and
// written as f32.
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
// Two 16-bit values of a word, and eight at p (16-byte aligned), as floats.
__device__ __forceinline__ float2 pair_f(unsigned w, const __nv_bfloat16*) {
    return __bfloat1622float2(*(const __nv_bfloat162*)&w);
}
__device__ __forceinline__ float2 pair_f(unsigned w, const __half*) { return __half22float2(*(const __half2*)&w); }
template <typename T> __device__ __forceinline__ void ld8f(const T* p, float (&v)[8]) {
    uint4 u = *(const uint4*)p;
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 f = pair_f(w[i], p);
        v[2 * i] = f.x;
        v[2 * i + 1] = f.y;
    }
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

// Each of v's values divided by s (a KV cache's scale).
__device__ __forceinline__ float4 div4(float4 v, float s) { return make_float4(v.x / s, v.y / s, v.z / s, v.w / s); }

// An FP8 KV cache's element (--kv-cache-dtype fp8): an e4m3 byte of the value divided by
// the layer's scale (see write_kv), rounded to nearest even and saturated at ±448 (as the
// CPU's e4m3::encode), read exactly (every e4m3 value is a half). Entry points over such a
// cache end in _fp8. Four consecutive elements are 4-byte aligned; a byte pair is one
// conversion.
struct kv_fp8 {
    unsigned char b;
};
__device__ __forceinline__ __half2 fp8x2_half2(unsigned w) {
    return __half2(__nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w & 0xffff), __NV_E4M3));
}
__device__ __forceinline__ float ld(const kv_fp8* p) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(p->b, __NV_E4M3)));
}
__device__ __forceinline__ void st(kv_fp8* p, float v) { p->b = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3); }
__device__ __forceinline__ float4 ld4(const kv_fp8* p) {
    unsigned u = *(const unsigned*)p;
    float2 a = __half22float2(fp8x2_half2(u)), b = __half22float2(fp8x2_half2(u >> 16));
    return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ void st4(kv_fp8* p, float4 v) {
    unsigned lo = __nv_cvt_float2_to_fp8x2(make_float2(v.x, v.y), __NV_SATFINITE, __NV_E4M3);
    unsigned hi = __nv_cvt_float2_to_fp8x2(make_float2(v.z, v.w), __NV_SATFINITE, __NV_E4M3);
    *(unsigned*)p = (lo & 0xffff) | (hi << 16);
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

// Tensor-core building blocks (flash.cu, moe.cu). Fragment layouts of mma.m16n8k16
// (g = lane / 4, q = lane % 4): A a0 = (g, 2q..2q+1), a1 = (g+8, 2q..), a2 = (g, 2q+8..),
// a3 = (g+8, 2q+8..); B b0 = (k 2q..2q+1, n g), b1 = (k 2q+8.., n g); C c0,c1 = (g, 2q..2q+1),
// c2,c3 = (g+8, 2q..2q+1).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    unsigned dst = (unsigned)__cvta_generic_to_shared(smem);
    int size = valid ? 16 : 0;  // 0: the 16 bytes are zero-filled
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(size));
}

__device__ __forceinline__ void mma_bf16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

template <typename T> __device__ __forceinline__ void mma16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    mma_bf16(c, a, b0, b1);
}
template <> __device__ __forceinline__ void mma16<__half>(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* p) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// 16 bytes of weights, read once per step (the GEMVs, the experts' decode kernels): not kept in L1, and L2 fetches the whole 256-byte
// line (the block's other warps read the rest of it next). The hint took the 8B model's
// batch-1 decode step from 5.06–5.09 to 4.82–4.88 ms on the H200.
__device__ __forceinline__ uint4 ld_stream(const void* p) {
    uint4 u;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w)
        : "l"(p));
    return u;
}
