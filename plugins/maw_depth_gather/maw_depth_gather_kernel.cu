// MawDepthGather kernel: per-example argmax depth and that depth's column of q_depth / k_depth.
//
// Grid: x = chunks of 256 rows of one example's [H, L] block, y = examples (grid-stride over
// B), z = 0 for q, 1 for k. Each warp recomputes t_b from the (tiny, cached) policy row, so
// there is no barrier; each thread copies one element (a strided read, a coalesced write).
#include "common/kernel_common.cuh"
#include "maw_depth_gather/maw_depth_gather_kernel.h"

namespace attnx
{
namespace kernels
{
namespace
{

constexpr int kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads) mawDepthGatherKernel(T const* __restrict__ q, T const* __restrict__ k,
    T const* __restrict__ policy, T* __restrict__ qSel, T* __restrict__ kSel, int64_t* __restrict__ depth, int64_t B,
    int64_t rowsQ, int64_t rowsK, int64_t D)
{
    bool const isK = blockIdx.z == 1;
    T const* src = isK ? k : q;
    T* dst = isK ? kSel : qSel;
    int64_t const rows = isK ? rowsK : rowsQ; // H * L per example
    int64_t const idx = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
    for (int64_t b = blockIdx.y; b < B; b += gridDim.y)
    {
        int64_t const t = warpArgmax(policy + b * D, D);
        if (!isK && blockIdx.x == 0 && threadIdx.x == 0)
        {
            depth[b] = t;
        }
        if (idx < rows)
        {
            int64_t const row = b * rows + idx;
            dst[row] = src[row * D + t];
        }
    }
}

template <typename T>
int launchGather(void const* q, void const* k, void const* policy, void* qSel, void* kSel, int64_t* depth, int64_t B,
    int64_t H, int64_t Lq, int64_t Lk, int64_t D, cudaStream_t stream)
{
    if (B == 0)
    {
        return 0;
    }
    int64_t const rowsQ = H * Lq;
    int64_t const rowsK = H * Lk;
    int64_t const most = rowsQ > rowsK ? rowsQ : rowsK;
    int64_t const blocksX = most > 0 ? ceilDiv(most, kThreads) : 1; // >= 1: depth is written even when empty
    if (blocksX > kMaxGridX || (H > 0 && (rowsQ / H != Lq || rowsK / H != Lk)))
    {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    dim3 const grid(static_cast<unsigned>(blocksX), static_cast<unsigned>(B < kMaxGridYZ ? B : kMaxGridYZ), 2);
    mawDepthGatherKernel<T><<<grid, kThreads, 0, stream>>>(static_cast<T const*>(q), static_cast<T const*>(k),
        static_cast<T const*>(policy), static_cast<T*>(qSel), static_cast<T*>(kSel), depth, B, rowsQ, rowsK, D);
    return launchStatus();
}

} // namespace
} // namespace kernels
} // namespace attnx

extern "C" ATTNX_API int attnx_maw_depth_gather(int dtype, void const* q_depth, void const* k_depth,
    void const* policy_logits, void* q_sel, void* k_sel, int64_t* depth, int64_t B, int64_t H, int64_t Lq, int64_t Lk,
    int64_t D, void* stream)
{
    using namespace attnx::kernels;
    if (!mawSizesValid(B, H, Lq, Lk, D))
    {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    return withDtype(dtype, [&](auto tag) {
        return launchGather<decltype(tag)>(q_depth, k_depth, policy_logits, q_sel, k_sel, depth, B, H, Lq, Lk, D,
            static_cast<cudaStream_t>(stream));
    });
}
