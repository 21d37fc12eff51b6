// MawDepthSelect kernel: per-example argmax depth and that depth's attention logits.
//
// logits[b,h,i,j] = scale * q_depth[b,h,i,t_b] * k_depth[b,h,j,t_b],  t_b = argmax_t policy[b,t].
// The output (B*H*Lq*Lk) is all the traffic that matters, so the kernel is a store stream:
// one block per (b, h, 64-row x 32V-column tile), V = 16 bytes / sizeof(T). Each warp
// recomputes t_b from the (tiny, cached) policy row, so there is no barrier and nothing depends
// on another launch; each lane holds V selected k values in registers and writes V outputs per
// row, as one 16-byte store when Lk is a multiple of V (else V coalesced scalar stores). Only the
// selected depth slice of q_depth / k_depth is read, and the 5-D tensor is never formed.
#include "common/kernel_common.cuh"
#include "maw_depth_select/maw_depth_select_kernel.h"

namespace attnx
{
namespace kernels
{
namespace
{

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTileI = 64; // rows per block: 8 per warp

template <typename T>
struct Vec
{
    static constexpr int kWidth = 16 / static_cast<int>(sizeof(T));
};

// Store qv * kv[0..V) as one 16-byte vector at p (16-byte aligned).
__device__ __forceinline__ void storeRow(float* p, float qv, float const (&kv)[4])
{
    *reinterpret_cast<float4*>(p) = make_float4(qv * kv[0], qv * kv[1], qv * kv[2], qv * kv[3]);
}

__device__ __forceinline__ void storeRow(__half* p, float qv, float const (&kv)[8])
{
    union
    {
        uint4 u;
        __half2 h[4];
    } pack;
#pragma unroll
    for (int v = 0; v < 4; ++v)
    {
        pack.h[v] = __floats2half2_rn(qv * kv[2 * v], qv * kv[2 * v + 1]);
    }
    *reinterpret_cast<uint4*>(p) = pack.u;
}

template <typename T, bool kVector>
__global__ void __launch_bounds__(kThreads) mawDepthSelectKernel(T const* __restrict__ q, T const* __restrict__ k,
    T const* __restrict__ policy, T* __restrict__ logits, int64_t* __restrict__ depth, int64_t H, int64_t Lq,
    int64_t Lk, int64_t D, float scale, int64_t tilesI, int64_t tilesJ)
{
    constexpr int V = Vec<T>::kWidth;
    constexpr int kTileJ = 32 * V;

    int64_t const tilesPerHead = tilesI * tilesJ;
    int64_t const bh = static_cast<int64_t>(blockIdx.x) / tilesPerHead;
    int64_t const rem = static_cast<int64_t>(blockIdx.x) - bh * tilesPerHead;
    int64_t const ti = rem / tilesJ;
    int64_t const tj = rem - ti * tilesJ;
    int64_t const b = bh / H;
    int const lane = threadIdx.x & 31;
    int const warp = threadIdx.x >> 5;

    int64_t const t = warpArgmax(policy + b * D, D);
    if (threadIdx.x == 0 && bh == b * H && rem == 0)
    {
        depth[b] = t;
    }

    // Column of element v of this lane: vector path lane*V + v (one 16-byte store per row);
    // scalar path v*32 + lane (each store instruction covers 32 consecutive columns).
    int64_t const j0 = tj * kTileJ;
    float kv[V];
#pragma unroll
    for (int v = 0; v < V; ++v)
    {
        int64_t const j = j0 + (kVector ? lane * V + v : v * 32 + lane);
        kv[v] = j < Lk ? toFloat(k[(bh * Lk + j) * D + t]) : 0.0f;
    }

    T const* qCol = q + bh * Lq * D + t;
    T* out = logits + bh * Lq * Lk;
    int64_t const i0 = ti * kTileI;
#pragma unroll 4
    for (int r = warp; r < kTileI; r += kWarps)
    {
        int64_t const i = i0 + r;
        if (i >= Lq)
        {
            break;
        }
        float const qv = scale * toFloat(qCol[i * D]);
        T* row = out + i * Lk;
        if (kVector)
        {
            int64_t const j = j0 + lane * V;
            if (j < Lk) // Lk is a multiple of V: the whole vector is inside the row
            {
                storeRow(row + j, qv, kv);
            }
        }
        else
        {
#pragma unroll
            for (int v = 0; v < V; ++v)
            {
                int64_t const j = j0 + v * 32 + lane;
                if (j < Lk)
                {
                    row[j] = fromFloat<T>(qv * kv[v]);
                }
            }
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
    constexpr int V = Vec<T>::kWidth;
    int64_t const tilesI = ceilDiv(Lq, kTileI);
    int64_t const tilesJ = ceilDiv(Lk, 32 * V);
    int64_t const blocks = B * H * tilesI * tilesJ;
    if (blocks > kMaxGridX || blocks / (tilesI * tilesJ) != B * H)
    {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    bool const vector = Lk % V == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
    auto kernel = vector ? mawDepthSelectKernel<T, true> : mawDepthSelectKernel<T, false>;
    kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(static_cast<T const*>(q), static_cast<T const*>(k),
        static_cast<T const*>(policy), static_cast<T*>(logits), depth, H, Lq, Lk, D, scale, tilesI, tilesJ);
    return launchStatus();
}

} // namespace
} // namespace kernels
} // namespace attnx

extern "C" ATTNX_API int attnx_maw_depth_select(int dtype, void const* q_depth, void const* k_depth,
    void const* policy_logits, void* logits, int64_t* depth, int64_t B, int64_t H, int64_t Lq, int64_t Lk, int64_t D,
    float scale, void* stream)
{
    using namespace attnx::kernels;
    if (!mawSizesValid(B, H, Lq, Lk, D))
    {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    return withDtype(dtype, [&](auto tag) {
        return launchMaw<decltype(tag)>(q_depth, k_depth, policy_logits, logits, depth, B, H, Lq, Lk, D, scale,
            static_cast<cudaStream_t>(stream));
    });
}
