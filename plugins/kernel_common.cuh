// Small device helpers shared by the attnx kernels (fp16/fp32 loads and stores, launch checks).
#ifndef ATTNX_KERNEL_COMMON_CUH
#define ATTNX_KERNEL_COMMON_CUH

#include <cuda_fp16.h>
#include <cuda_runtime.h>

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

// Largest grid.x we launch with (flattened 1-D grids).
constexpr int64_t kMaxGridX = 2147483647LL;

inline int launchStatus()
{
    return static_cast<int>(cudaGetLastError());
}

inline int64_t ceilDiv(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

} // namespace kernels
} // namespace attnx

#endif // ATTNX_KERNEL_COMMON_CUH
