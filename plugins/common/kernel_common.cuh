// Device helpers shared by the attnx kernels: fp16/fp32 conversion, launch checks, and the
// policy argmax of the MAW ops (first maximum on ties, NaN wins, like torch.argmax).
#ifndef ATTNX_KERNEL_COMMON_CUH
#define ATTNX_KERNEL_COMMON_CUH

#include "common/kernel_abi.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <climits>
#include <cstdint>

namespace attnx
{
namespace kernels
{

__device__ __forceinline__ float toFloat(float v)
{
    return v;
}
__device__ __forceinline__ float toFloat(__half v)
{
    return __half2float(v);
}

template <typename T>
__device__ __forceinline__ T fromFloat(float v);
template <>
__device__ __forceinline__ float fromFloat<float>(float v)
{
    return v;
}
template <>
__device__ __forceinline__ __half fromFloat<__half>(float v)
{
    return __float2half_rn(v);
}

// Largest grid.x we launch with (flattened 1-D grids), and grid.y / grid.z.
constexpr int64_t kMaxGridX = 2147483647LL;
constexpr int64_t kMaxGridYZ = 65535LL;

inline int launchStatus()
{
    return static_cast<int>(cudaGetLastError());
}

inline int64_t ceilDiv(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

// fn(T{}) with T = float for ATTNX_DTYPE_FP32, __half for ATTNX_DTYPE_FP16; cudaErrorInvalidValue
// for any other code. The C ABI entry points dispatch through this.
template <typename Fn>
int withDtype(int dtype, Fn&& fn)
{
    switch (dtype)
    {
    case ATTNX_DTYPE_FP32: return fn(float{});
    case ATTNX_DTYPE_FP16: return fn(__half{});
    default: return static_cast<int>(cudaErrorInvalidValue);
    }
}

// The MAW ops' sizes: B, H, Lq, Lk >= 0 and 1 <= D <= INT_MAX (the depth index is an int).
inline bool mawSizesValid(int64_t B, int64_t H, int64_t Lq, int64_t Lk, int64_t D)
{
    return B >= 0 && H >= 0 && Lq >= 0 && Lk >= 0 && D >= 1 && D <= INT_MAX;
}

// Is (va, ia) the better argmax candidate than (vb, ib)? NaN beats numbers (as torch.argmax);
// on equal values (or two NaNs) the smaller index wins, so the result is the first maximum.
__device__ __forceinline__ bool argmaxBetter(float va, int ia, float vb, int ib)
{
    bool const na = va != va;
    bool const nb = vb != vb;
    if (na || nb)
    {
        return na && (!nb || ia < ib);
    }
    return va > vb || (va == vb && ia < ib);
}

// Warp-wide argmax over policy[0..D); every lane of the (full) warp returns the result.
template <typename T>
__device__ __forceinline__ int warpArgmax(T const* policy, int64_t D)
{
    int const lane = threadIdx.x & 31;
    float best = -FLT_MAX;
    int bestIdx = INT_MAX;
    for (int64_t t = lane; t < D; t += 32)
    {
        float const v = toFloat(policy[t]);
        if (bestIdx == INT_MAX || argmaxBetter(v, static_cast<int>(t), best, bestIdx))
        {
            best = v;
            bestIdx = static_cast<int>(t);
        }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
    {
        float const ov = __shfl_xor_sync(0xffffffffu, best, offset);
        int const oi = __shfl_xor_sync(0xffffffffu, bestIdx, offset);
        if (oi != INT_MAX && (bestIdx == INT_MAX || argmaxBetter(ov, oi, best, bestIdx)))
        {
            best = ov;
            bestIdx = oi;
        }
    }
    return bestIdx;
}

} // namespace kernels
} // namespace attnx

#endif // ATTNX_KERNEL_COMMON_CUH
