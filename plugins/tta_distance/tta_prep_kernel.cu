// TtaDistance, launch 1 of 2: for 128 rows of q or k of one (b, h), xS = x S with S = T + T^T
// (symmetrised while it is staged) on the tensor cores (3xTF32, fp32-accurate; the 128 x 64 tile
// and slice product of tta_mma_tiles.cuh), the row terms qq = 0.5 q.(qS) and kk = 0.5 k.(kS),
// and for k the distance pass's operand kS: fp32, or for fp16 inputs two fp16 arrays hi + lo
// with kS = hi + lo (to about 2^-22 relative). The xS tile is staged in shared memory so x is
// re-read and kS written as whole rows (16-byte accesses when Dh allows), 8 threads per row.
#include "common/kernel_common.cuh"
#include "tta_distance/tta_distance_internal.h"
#include "tta_distance/tta_mma_tiles.cuh"

#include <type_traits>

namespace attnx
{
namespace kernels
{
namespace
{

using namespace tta;

constexpr int kPrepRows = kBM; // rows of x per block
constexpr int kSlice = kSliceK<float>;
constexpr int kStageStride = kBN + 4;
constexpr int kColsPerThread = 8;                     // epilogue: 8 threads per 64-column row
constexpr int kRowsPerPass = kThreads / (kBN / kColsPerThread);

union PrepShared
{
    Operands<float> ops;                   // a: x slice [row][d]; b: S slice [e][d] (S symmetric)
    float stage[kPrepRows][kStageStride];  // xS of one 64-column chunk
};

// Eight consecutive elements of a row as floats (vector path: one 16-byte load for fp16, two for fp32).
template <bool kVector>
__device__ __forceinline__ void load8(float (&v)[8], float const* p, int64_t valid)
{
    if (kVector && valid >= 8)
    {
        float4 const a = *reinterpret_cast<float4 const*>(p);
        float4 const b = *reinterpret_cast<float4 const*>(p + 4);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        return;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i)
    {
        v[i] = i < valid ? p[i] : 0.0f;
    }
}

template <bool kVector>
__device__ __forceinline__ void load8(float (&v)[8], __half const* p, int64_t valid)
{
    if (kVector && valid >= 8)
    {
        union
        {
            uint4 u;
            __half2 h[4];
        } pack;
        pack.u = *reinterpret_cast<uint4 const*>(p);
#pragma unroll
        for (int i = 0; i < 4; ++i)
        {
            float2 const f = __half22float2(pack.h[i]);
            v[2 * i] = f.x;
            v[2 * i + 1] = f.y;
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i)
    {
        v[i] = i < valid ? __half2float(p[i]) : 0.0f;
    }
}

// kS for eight consecutive columns: fp32 (T = float), or fp16 hi + lo (T = __half).
template <typename T, bool kVector>
__device__ __forceinline__ void storeKS(
    float const (&v)[8], float* kS32, __half* kSHi, __half* kSLo, int64_t o, int64_t valid)
{
    if constexpr (std::is_same<T, float>::value)
    {
        if (kVector && valid >= 8)
        {
            *reinterpret_cast<float4*>(kS32 + o) = make_float4(v[0], v[1], v[2], v[3]);
            *reinterpret_cast<float4*>(kS32 + o + 4) = make_float4(v[4], v[5], v[6], v[7]);
            return;
        }
        for (int i = 0; i < 8 && i < valid; ++i)
        {
            kS32[o + i] = v[i];
        }
    }
    else
    {
        union
        {
            uint4 u;
            __half e[8];
        } hi, lo;
#pragma unroll
        for (int i = 0; i < 8; ++i)
        {
            hi.e[i] = __float2half_rn(v[i]);
            lo.e[i] = __float2half_rn(v[i] - __half2float(hi.e[i]));
        }
        if (kVector && valid >= 8)
        {
            *reinterpret_cast<uint4*>(kSHi + o) = hi.u;
            *reinterpret_cast<uint4*>(kSLo + o) = lo.u;
            return;
        }
        for (int i = 0; i < 8 && i < valid; ++i)
        {
            kSHi[o + i] = hi.e[i];
            kSLo[o + i] = lo.e[i];
        }
    }
}

// kVector: Dh is a multiple of 16 bytes' worth of T and x is 16-byte aligned (vector loads/stores).
template <typename T, bool kVector>
__global__ void __launch_bounds__(kThreads, 2) ttaPrepKernel(T const* __restrict__ q, T const* __restrict__ k,
    T const* __restrict__ trace, float* __restrict__ kS32, __half* __restrict__ kSHi, __half* __restrict__ kSLo,
    float* __restrict__ qq, float* __restrict__ kk, int64_t H, int64_t Bt, int64_t Ht, int64_t Lq, int64_t Lk,
    int64_t Dh, int64_t blocksQ, int64_t tilesQ, int64_t tilesK)
{
    __shared__ __align__(16) PrepShared s;
    __shared__ float rowSum[kPrepRows];

    PrepTile const tile = prepTile(blockIdx.x, blocksQ, tilesQ, tilesK, Lq, Lk, H, kPrepRows);
    T const* x = tile.rowsOf(q, k, Dh);
    T const* tm = tile.traceOf(trace, Bt, Ht, Dh);

    WarpPos const pos = warpPos();
    int const wm = pos.wm;
    int const wn = pos.wn;
    int const g = pos.g;
    int const t = pos.t;
    if (threadIdx.x < kPrepRows)
    {
        rowSum[threadIdx.x] = 0.0f;
    }

    for (int64_t e0 = 0; e0 < Dh; e0 += kBN)
    {
        float acc[2][kNi][4];
        zeroAcc(acc);
        for (int64_t k0 = 0; k0 < Dh; k0 += kSlice)
        {
            // x slice: 128 rows x 32 columns, 8 consecutive columns per thread (all loads in flight).
#pragma unroll
            for (int l = 0; l < (kPrepRows * kSlice) / (kThreads * 8); ++l)
            {
                int const idx = threadIdx.x + l * kThreads;
                int const r = idx / (kSlice / 8);
                int const c = (idx % (kSlice / 8)) * 8;
                float v[8];
                int64_t const valid = r < tile.rows ? Dh - (k0 + c) : 0;
                load8<kVector>(v, x + r * Dh + k0 + c, valid);
                *reinterpret_cast<float4*>(&s.ops.a[r][c]) = make_float4(v[0], v[1], v[2], v[3]);
                *reinterpret_cast<float4*>(&s.ops.a[r][c + 4]) = make_float4(v[4], v[5], v[6], v[7]);
            }
            // S[e][d] = T[e][d] + T[d][e]: first T's rows, then (coalesced) its columns.
#pragma unroll
            for (int l = 0; l < (kBN * kSlice) / kThreads; ++l)
            {
                int const idx = threadIdx.x + l * kThreads;
                int const e = idx / kSlice;
                int const d = idx % kSlice;
                int64_t const ge = e0 + e;
                int64_t const gd = k0 + d;
                s.ops.b[e][d] = (ge < Dh && gd < Dh) ? toFloat(tm[ge * Dh + gd]) : 0.0f;
            }
            __syncthreads();
#pragma unroll
            for (int l = 0; l < (kBN * kSlice) / kThreads; ++l)
            {
                int const idx = threadIdx.x + l * kThreads;
                int const d = idx / kBN;
                int const e = idx % kBN;
                int64_t const ge = e0 + e;
                int64_t const gd = k0 + d;
                if (ge < Dh && gd < Dh)
                {
                    s.ops.b[e][d] += toFloat(tm[gd * Dh + ge]);
                }
            }
            __syncthreads();
            mmaSlice<float>(s.ops, acc, wm, wn, g, t);
            __syncthreads();
        }
        // Stage xS of this chunk, then whole rows: x . xS into rowSum, kS for k rows.
        stageAcc(s.stage, acc, pos);
        __syncthreads();
        int const c = (threadIdx.x % (kBN / kColsPerThread)) * kColsPerThread;
        int64_t const valid = Dh - (e0 + c);
#pragma unroll
        for (int pass = 0; pass < kPrepRows / kRowsPerPass; ++pass)
        {
            int const r = pass * kRowsPerPass + threadIdx.x / (kBN / kColsPerThread);
            float xs[8];
            float xv[8];
            float4 const lo4 = *reinterpret_cast<float4 const*>(&s.stage[r][c]);
            float4 const hi4 = *reinterpret_cast<float4 const*>(&s.stage[r][c + 4]);
            xs[0] = lo4.x, xs[1] = lo4.y, xs[2] = lo4.z, xs[3] = lo4.w;
            xs[4] = hi4.x, xs[5] = hi4.y, xs[6] = hi4.z, xs[7] = hi4.w;
            load8<kVector>(xv, x + r * Dh + e0 + c, r < tile.rows ? valid : 0);
            float p = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i)
            {
                p = fmaf(xv[i], xs[i], p); // xv is 0 outside the row
            }
            p += __shfl_xor_sync(0xffffffffu, p, 1);
            p += __shfl_xor_sync(0xffffffffu, p, 2);
            p += __shfl_xor_sync(0xffffffffu, p, 4);
            if (threadIdx.x % (kBN / kColsPerThread) == 0)
            {
                rowSum[r] += p; // one thread per row per chunk: chunks are ordered by the barriers
            }
            if (tile.isK && r < tile.rows && valid > 0)
            {
                storeKS<T, kVector>(xs, kS32, kSHi, kSLo, (tile.bh * Lk + tile.row0 + r) * Dh + e0 + c, valid);
            }
        }
        __syncthreads();
    }
    if (static_cast<int>(threadIdx.x) < tile.rows)
    {
        (tile.isK ? kk : qq)[tile.bh * tile.L + tile.row0 + threadIdx.x] = 0.5f * rowSum[threadIdx.x];
    }
}

} // namespace

template <typename T>
int launchTtaPrep(T const* q, T const* k, T const* trace, float* kS32, __half* kSHi, __half* kSLo, float* qq,
    float* kk, int64_t B, int64_t H, int64_t Bt, int64_t Ht, int64_t Lq, int64_t Lk, int64_t Dh, cudaStream_t stream)
{
    int64_t const BH = B * H;
    int64_t const tilesQ = ceilDiv(Lq, kPrepRows);
    int64_t const tilesK = ceilDiv(Lk, kPrepRows);
    int64_t const blocks = BH * (tilesQ + tilesK);
    if (blocks == 0)
    {
        return 0;
    }
    if (blocks > kMaxGridX || blocks / (tilesQ + tilesK) != BH)
    {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    constexpr int V = kVec<T>;
    bool const vector = Dh % V == 0 && reinterpret_cast<uintptr_t>(q) % 16 == 0
        && reinterpret_cast<uintptr_t>(k) % 16 == 0; // workspace: 256-aligned
    auto kernel = vector ? ttaPrepKernel<T, true> : ttaPrepKernel<T, false>;
    kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        q, k, trace, kS32, kSHi, kSLo, qq, kk, H, Bt, Ht, Lq, Lk, Dh, BH * tilesQ, tilesQ, tilesK);
    return launchStatus();
}

template int launchTtaPrep<float>(float const*, float const*, float const*, float*, __half*, __half*, float*, float*,
    int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, cudaStream_t);
template int launchTtaPrep<__half>(__half const*, __half const*, __half const*, float*, __half*, __half*, float*,
    float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, cudaStream_t);

} // namespace kernels
} // namespace attnx
