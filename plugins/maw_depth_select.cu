// MawDepthSelect kernel: per-example argmax depth and that depth's attention logits.
//
// logits[b,h,i,j] = scale * q_depth[b,h,i,t_b] * k_depth[b,h,j,t_b],  t_b = argmax_t policy[b,t].
// One block per (b, h, 16-row x 64-column output tile). Each block recomputes t_b from the
// (tiny) policy row with one warp, so nothing depends on another launch; only the selected
// depth slice of q_depth / k_depth is read, and the 5-D tensor is never formed.
#include "attnx_kernels.h"
#include "kernel_common.cuh"

#include <cfloat>
#include <climits>

namespace attnx
{
namespace kernels
{
namespace
{

constexpr int kTileI = 16;
constexpr int kTileJ = 64;
constexpr int kThreads = 256;
constexpr int kRowsPerPass = kThreads / kTileJ; // 4

// Is (va, ia) the better argmax candidate than (vb, ib)? NaN beats numbers (as torch.argmax);
// on equal values (or two NaNs) the smaller index wins, so the result is the first maximum.
__device__ __forceinline__ bool better(float va, int ia, float vb, int ib)
{
    bool const na = va != va;
    bool const nb = vb != vb;
    if (na || nb)
    {
        return na && (!nb || ia < ib);
    }
    return va > vb || (va == vb && ia < ib);
}

// Warp-wide argmax over policy[0..D); every lane returns the result.
template <typename T>
__device__ __forceinline__ int warpArgmax(T const* policy, int64_t D)
{
    int const lane = threadIdx.x & 31;
    float best = -FLT_MAX;
    int bestIdx = INT_MAX;
    bool any = false;
    for (int64_t t = lane; t < D; t += 32)
    {
        float const v = toFloat(policy[t]);
        if (!any || better(v, static_cast<int>(t), best, bestIdx))
        {
            best = v;
            bestIdx = static_cast<int>(t);
            any = true;
        }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
    {
        float const ov = __shfl_xor_sync(0xffffffffu, best, offset);
        int const oi = __shfl_xor_sync(0xffffffffu, bestIdx, offset);
        if (oi != INT_MAX && (bestIdx == INT_MAX || better(ov, oi, best, bestIdx)))
        {
            best = ov;
            bestIdx = oi;
        }
    }
    return bestIdx;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) mawDepthSelectKernel(T const* __restrict__ q, T const* __restrict__ k,
    T const* __restrict__ policy, T* __restrict__ logits, int64_t* __restrict__ depth, int64_t H, int64_t Lq,
    int64_t Lk, int64_t D, float scale, int64_t tilesI, int64_t tilesJ)
{
    __shared__ float qs[kTileI];
    __shared__ float ks[kTileJ];
    __shared__ int sel;

    int64_t const tilesPerHead = tilesI * tilesJ;
    int64_t const bh = static_cast<int64_t>(blockIdx.x) / tilesPerHead;
    int64_t const rem = static_cast<int64_t>(blockIdx.x) - bh * tilesPerHead;
    int64_t const ti = rem / tilesJ;
    int64_t const tj = rem - ti * tilesJ;
    int64_t const b = bh / H;
    int64_t const h = bh - b * H;

    if (threadIdx.x < 32)
    {
        int const t = warpArgmax(policy + b * D, D);
        if (threadIdx.x == 0)
        {
            sel = t;
            if (h == 0 && rem == 0)
            {
                depth[b] = static_cast<int64_t>(t);
            }
        }
    }
    __syncthreads();
    int64_t const t = sel;

    int64_t const i0 = ti * kTileI;
    int64_t const j0 = tj * kTileJ;
    if (threadIdx.x < kTileI)
    {
        int64_t const i = i0 + threadIdx.x;
        qs[threadIdx.x] = i < Lq ? scale * toFloat(q[(bh * Lq + i) * D + t]) : 0.0f;
    }
    else if (threadIdx.x >= kThreads - kTileJ)
    {
        int const c = threadIdx.x - (kThreads - kTileJ);
        int64_t const j = j0 + c;
        ks[c] = j < Lk ? toFloat(k[(bh * Lk + j) * D + t]) : 0.0f;
    }
    __syncthreads();

    int const c = threadIdx.x % kTileJ;
    int64_t const j = j0 + c;
    if (j >= Lk)
    {
        return;
    }
    float const kv = ks[c];
    for (int r = threadIdx.x / kTileJ; r < kTileI; r += kRowsPerPass)
    {
        int64_t const i = i0 + r;
        if (i < Lq)
        {
            logits[(bh * Lq + i) * Lk + j] = fromFloat<T>(qs[r] * kv);
        }
    }
}

// Depth only (used when the logits are empty, i.e. H, Lq or Lk is 0).
template <typename T>
__global__ void mawArgmaxKernel(T const* __restrict__ policy, int64_t* __restrict__ depth, int64_t D)
{
    int const t = warpArgmax(policy + static_cast<int64_t>(blockIdx.x) * D, D);
    if (threadIdx.x == 0)
    {
        depth[blockIdx.x] = static_cast<int64_t>(t);
    }
}

template <typename T>
int launchMaw(void const* q, void const* k, void const* policy, void* logits, int64_t* depth, int64_t B, int64_t H,
    int64_t Lq, int64_t Lk, int64_t D, float scale, cudaStream_t stream)
{
    if (B == 0)
    {
        return 0;
    }
    if (H == 0 || Lq == 0 || Lk == 0)
    {
        if (B > kMaxGridX)
        {
            return static_cast<int>(cudaErrorInvalidValue);
        }
        mawArgmaxKernel<T><<<static_cast<unsigned>(B), 32, 0, stream>>>(static_cast<T const*>(policy), depth, D);
        return launchStatus();
    }
    int64_t const tilesI = ceilDiv(Lq, kTileI);
    int64_t const tilesJ = ceilDiv(Lk, kTileJ);
    int64_t const blocks = B * H * tilesI * tilesJ;
    if (blocks > kMaxGridX || blocks / (tilesI * tilesJ) != B * H)
    {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    mawDepthSelectKernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(static_cast<T const*>(q),
        static_cast<T const*>(k), static_cast<T const*>(policy), static_cast<T*>(logits), depth, H, Lq, Lk, D, scale,
        tilesI, tilesJ);
    return launchStatus();
}

} // namespace
} // namespace kernels
} // namespace attnx

extern "C" ATTNX_API int attnx_kernels_abi_version(void)
{
    return ATTNX_KERNELS_ABI_VERSION;
}

extern "C" ATTNX_API int attnx_maw_depth_select(int dtype, void const* q_depth, void const* k_depth,
    void const* policy_logits, void* logits, int64_t* depth, int64_t B, int64_t H, int64_t Lq, int64_t Lk, int64_t D,
    float scale, void* stream)
{
    using namespace attnx::kernels;
    if (B < 0 || H < 0 || Lq < 0 || Lk < 0 || D < 1 || D > INT_MAX)
    {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    auto const s = static_cast<cudaStream_t>(stream);
    switch (dtype)
    {
    case ATTNX_DTYPE_FP32:
        return launchMaw<float>(q_depth, k_depth, policy_logits, logits, depth, B, H, Lq, Lk, D, scale, s);
    case ATTNX_DTYPE_FP16:
        return launchMaw<__half>(q_depth, k_depth, policy_logits, logits, depth, B, H, Lq, Lk, D, scale, s);
    default: return static_cast<int>(cudaErrorInvalidValue);
    }
}
