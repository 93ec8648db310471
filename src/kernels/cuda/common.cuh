// Prepended to every kernel source.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

// Stores v rounded to 16 bits: kind 1 is bf16, 2 is f16 (the dtype of the GEMM's weights).
__device__ __forceinline__ void store16(void* p, size_t i, float v, int kind) {
    if (kind == 1) ((__nv_bfloat16*)p)[i] = __float2bfloat16(v);
    else ((__half*)p)[i] = __float2half(v);
}
