// TtaDistance, launch 1 of 2, fp16 fast path (Dh <= 64, Dh a multiple of 8, q, k and trace
// 16-byte aligned): the outputs of ttaPrepKernel (kS as fp16 hi + lo, qq, kk) in one trip to
// memory. The generic prep is a chain of dependent loads (x slices, T rows, T columns, x again)
// and at small L its time is that latency; here 128 rows of x and all of T arrive with 16-byte
// loads issued together, S = T + T^T is split into fp16 hi + lo in shared memory, and
// xS = x S_hi + x S_lo runs on the fp16 tensor cores: x is exact in fp16, every product is exact
// in fp32 and S_hi + S_lo = S to ~2^-22, so xS is fp32-accurate like the 3xTF32 prep. The row
// sums x . xS come straight from the accumulators; kS is staged and written as whole rows.
#include "common/kernel_common.cuh"
#include "tta_distance/tta_distance_internal.h"
#include "tta_distance/tta_mma_tiles.cuh"

namespace attnx
{
namespace kernels
{
namespace
{

using namespace tta;

constexpr int kRows = kBM;                            // rows of x per block
constexpr int kK = kSliceK<__half>;                   // Dh, zero-padded to 64
constexpr int kStride = Operands<__half>::kStride;   // 72 halves: conflict-free fragments
constexpr int kXVecs = kRows * (kK / 8) / kThreads;   // 16-byte vectors of x per thread
constexpr int kTVecs = kK * (kK / 8) / kThreads;      // ... of T

struct PrepShared
{
    Operands<__half> ops;       // a: x [row][d]; bHi/bLo: S hi/lo [e][d]; then the kS staging
    __half tr[kK][kStride];     // T [e][d]
    float rowPart[2][kRows];    // x . xS over each warp column's 32 columns
};

// Rows [0, rows) of a row-major [*, Dh] fp16 matrix, 16-byte vectors of kK / 8 per row, this thread's
// share (vector l is index threadIdx.x + l * kThreads); zeros past the rows and past Dh.
template <int kVecs>
__device__ __forceinline__ void loadRows(uint4 (&v)[kVecs], __half const* src, int rows, int64_t Dh)
{
#pragma unroll
    for (int l = 0; l < kVecs; ++l)
    {
        int const idx = threadIdx.x + l * kThreads;
        int const r = idx / (kK / 8);
        int const c = (idx % (kK / 8)) * 8;
        v[l] = r < rows && c < Dh ? *reinterpret_cast<uint4 const*>(src + r * Dh + c) : make_uint4(0u, 0u, 0u, 0u);
    }
}

// The vectors of loadRows into a shared tile [row][kStride] at the same places.
template <int kVecs>
__device__ __forceinline__ void storeRows(__half (*dst)[kStride], uint4 const (&v)[kVecs])
{
#pragma unroll
    for (int l = 0; l < kVecs; ++l)
    {
        int const idx = threadIdx.x + l * kThreads;
        *reinterpret_cast<uint4*>(&dst[idx / (kK / 8)][(idx % (kK / 8)) * 8]) = v[l];
    }
}

// Row r (0-127) of the 128-row lo staging area, made of bHi (rows 0-63) and bLo (64-127).
__device__ __forceinline__ __half* loStageRow(PrepShared& s, int r)
{
    return r < kBN ? s.ops.bHi[r] : s.ops.bLo[r - kBN];
}

__global__ void __launch_bounds__(kThreads, 4) ttaPrepFp16Kernel(__half const* __restrict__ q,
    __half const* __restrict__ k, __half const* __restrict__ trace, __half* __restrict__ kSHi,
    __half* __restrict__ kSLo, float* __restrict__ qq, float* __restrict__ kk, int64_t H, int64_t Bt, int64_t Ht,
    int64_t Lq, int64_t Lk, int64_t Dh, int64_t blocksQ, int64_t tilesQ, int64_t tilesK)
{
    __shared__ __align__(16) PrepShared s;

    PrepTile const tile = prepTile(blockIdx.x, blocksQ, tilesQ, tilesK, Lq, Lk, H, kRows);
    __half const* x = tile.rowsOf(q, k, Dh);
    __half const* tm = tile.traceOf(trace, Bt, Ht, Dh);

    // Every load in flight before the first is used; zero outside the rows and Dh.
    uint4 xv[kXVecs];
    uint4 tv[kTVecs];
    loadRows(xv, x, tile.rows, Dh);
    loadRows(tv, tm, static_cast<int>(Dh), Dh);
    storeRows(s.ops.a, xv);
    storeRows(s.tr, tv);
    __syncthreads();

    // S[e][d] = T[e][d] + T[d][e] in fp32, kept as hi + lo (S is symmetric: [e][d] is the B layout).
#pragma unroll 4
    for (int idx = threadIdx.x; idx < kK * kK; idx += kThreads)
    {
        int const e = idx / kK;
        int const d = idx % kK;
        float const v = __half2float(s.tr[e][d]) + __half2float(s.tr[d][e]);
        __half const hi = __float2half_rn(v);
        s.ops.bHi[e][d] = hi;
        s.ops.bLo[e][d] = __float2half_rn(v - __half2float(hi));
    }
    __syncthreads();

    WarpPos const pos = warpPos();
    float acc[2][kNi][4];
    zeroAcc(acc);
    mmaSlice<__half>(s.ops, acc, pos.wm, pos.wn, pos.g, pos.t);
    // Once every prep block is past its main work, the distance pass may take free room on the SMs
    // and stage its q tiles (it waits for this whole grid before it reads anything written here).
    letDependentsLaunch();

    // x . xS for this thread's 4 rows: the accumulator layout matches [row][column] of x.
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
    {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
        {
            int const r = pos.wm * 32 + mi * 16 + pos.g + 8 * hh;
            float p = 0.0f;
#pragma unroll
            for (int ni = 0; ni < kNi; ++ni)
            {
                int const c = pos.wn * kWarpN + ni * 8 + 2 * pos.t;
                float2 const xf = __half22float2(*reinterpret_cast<__half2 const*>(&s.ops.a[r][c]));
                p = fmaf(xf.x, acc[mi][ni][2 * hh], fmaf(xf.y, acc[mi][ni][2 * hh + 1], p));
            }
            p += __shfl_xor_sync(0xffffffffu, p, 1);
            p += __shfl_xor_sync(0xffffffffu, p, 2);
            if (pos.t == 0)
            {
                s.rowPart[pos.wn][r] = p;
            }
        }
    }
    __syncthreads(); // every warp is done with x and S: their space takes the kS staging
    if (tile.isK)
    {
        // kS = hi + lo into [row][column] staging: hi over x, lo over S.
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
        {
#pragma unroll
            for (int ni = 0; ni < kNi; ++ni)
            {
                int const c = pos.wn * kWarpN + ni * 8 + 2 * pos.t;
#pragma unroll
                for (int hh = 0; hh < 2; ++hh)
                {
                    int const r = pos.wm * 32 + mi * 16 + pos.g + 8 * hh;
                    float const v0 = acc[mi][ni][2 * hh];
                    float const v1 = acc[mi][ni][2 * hh + 1];
                    __half2 const hi = __floats2half2_rn(v0, v1);
                    float2 const hf = __half22float2(hi);
                    *reinterpret_cast<__half2*>(&s.ops.a[r][c]) = hi;
                    *reinterpret_cast<__half2*>(loStageRow(s, r) + c) = __floats2half2_rn(v0 - hf.x, v1 - hf.y);
                }
            }
        }
    }
    __syncthreads();
    if (tile.isK)
    {
        int64_t const base = (tile.bh * Lk + tile.row0) * Dh;
#pragma unroll
        for (int l = 0; l < kXVecs; ++l)
        {
            int const idx = threadIdx.x + l * kThreads;
            int const r = idx / (kK / 8);
            int const c = (idx % (kK / 8)) * 8;
            if (r < tile.rows && c < Dh)
            {
                *reinterpret_cast<uint4*>(kSHi + base + r * Dh + c) = *reinterpret_cast<uint4 const*>(&s.ops.a[r][c]);
                *reinterpret_cast<uint4*>(kSLo + base + r * Dh + c) = *reinterpret_cast<uint4 const*>(loStageRow(s, r) + c);
            }
        }
    }
    if (static_cast<int>(threadIdx.x) < tile.rows)
    {
        (tile.isK ? kk : qq)[tile.bh * tile.L + tile.row0 + threadIdx.x] = 0.5f * (s.rowPart[0][threadIdx.x] + s.rowPart[1][threadIdx.x]);
    }
}

} // namespace

bool ttaFp16FastPrepApplies(void const* q, void const* k, void const* trace, int64_t Dh)
{
    auto aligned = [](void const* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    return Dh >= 1 && Dh <= kK && Dh % 8 == 0 && aligned(q) && aligned(k) && aligned(trace);
}

int launchTtaPrepFp16(__half const* q, __half const* k, __half const* trace, __half* kSHi, __half* kSLo, float* qq,
    float* kk, int64_t B, int64_t H, int64_t Bt, int64_t Ht, int64_t Lq, int64_t Lk, int64_t Dh, cudaStream_t stream)
{
    int64_t const BH = B * H;
    int64_t const tilesQ = ceilDiv(Lq, kRows);
    int64_t const tilesK = ceilDiv(Lk, kRows);
    int64_t const blocks = BH * (tilesQ + tilesK);
    if (blocks == 0)
    {
        return 0;
    }
    if (blocks > kMaxGridX || blocks / (tilesQ + tilesK) != BH)
    {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    ttaPrepFp16Kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        q, k, trace, kSHi, kSLo, qq, kk, H, Bt, Ht, Lq, Lk, Dh, BH * tilesQ, tilesQ, tilesK);
    return launchStatus();
}

} // namespace kernels
} // namespace attnx
