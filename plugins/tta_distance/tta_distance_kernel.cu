// TtaDistance kernels: dist[b,h,i,j] = (q_i - k_j)^T T (q_i - k_j) without the Dh^2 loop per
// output element, through the expansion
//
//     dist_ij = qq_i + kk_j - q_i . (k_j S),   S = T + T^T,
//     qq_i = q_i^T T q_i = 0.5 q_i . (q_i S),   kk_j = 0.5 k_j . (k_j S).
//
// Two launches on one stream, no host synchronisation:
//   1. ttaPrepKernel (tta_prep_kernel.cu): for 128 rows of q or k of one (b, h): xS = x S on the
//      tensor cores (3xTF32), the row terms qq / kk, and for k the operand kS (fp32, or for fp16
//      inputs two fp16 arrays hi + lo with kS = hi + lo to ~2^-22). fp16 with Dh <= 64, Dh % 8 == 0:
//      ttaPrepFp16Kernel (tta_prep_fp16_kernel.cu), one trip to memory, fp16 tensor cores.
//   2. The distance pass dist = qq + kk - Q kS^T, a GEMM on the tensor cores (mma.sync, fp32
//      accumulation): fp16 inputs multiply q by hi and by lo (q is exact in fp16); fp32 inputs use
//      3xTF32 (a = a_big + a_small in TF32; a_s b_b + a_b b_s + a_b b_b), accurate to about fp32.
//      ttaDistanceKernel here: one 128x64 tile per block, the tile staged in shared memory and
//      written as whole rows (16-byte stores when Lk is a multiple of 16 bytes' worth). fp16 with
//      Dh <= 64, Dh % 8 == 0: ttaDistanceFp16Kernel (tta_distance_fp16_kernel.cu), which keeps A
//      in registers over several k tiles and prefetches the next B tile, and on sm_90 overlaps
//      the prep's tail (programmatic dependent launch).
// The output is the dominant traffic (Dh is small), so the target is the store bandwidth.
#include "common/kernel_common.cuh"
#include "tta_distance/tta_distance_internal.h"
#include "tta_distance/tta_distance_kernel.h"
#include "tta_distance/tta_mma_tiles.cuh"

#include <type_traits>

namespace attnx
{
namespace kernels
{
namespace
{

constexpr size_t kAlign = 256;

// ------------------------------------------------------------------------------------ distance pass

using namespace tta;

constexpr int kStageStride = kBN + 4;

template <typename T>
union SharedTile
{
    Operands<T> ops;
    float stage[kBM][kStageStride];
};

__device__ __forceinline__ void storeVec(float* p, float const* v)
{
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}

__device__ __forceinline__ void storeVec(__half* p, float const* v)
{
    union
    {
        uint4 u;
        __half2 h[4];
    } pack;
#pragma unroll
    for (int i = 0; i < 4; ++i)
    {
        pack.h[i] = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
    }
    *reinterpret_cast<uint4*>(p) = pack.u;
}

// One block = one 128x64 tile of dist for one (b, h); 8 warps as 4 (rows) x 2 (columns), each
// warp 32x32 = 2 x 4 mma tiles. kVecStore: 16-byte output stores (Lk a multiple of the vector
// width, aligned output); kVecLoad: 16-byte operand loads (Dh a multiple of it, aligned inputs).
template <typename T, bool kVecStore, bool kVecLoad>
__global__ void __launch_bounds__(kThreads, 3) ttaDistanceKernel(T const* __restrict__ q, float const* __restrict__ kS32,
    __half const* __restrict__ kSHi, __half const* __restrict__ kSLo, float const* __restrict__ qq,
    float const* __restrict__ kk, T* __restrict__ dist, int64_t M, int64_t N, int64_t Dh, int64_t tilesM,
    int64_t tilesN)
{
    __shared__ __align__(16) SharedTile<T> smem;
    constexpr int K = kSliceK<T>;

    int64_t const tilesPerHead = tilesM * tilesN;
    int64_t const bh = static_cast<int64_t>(blockIdx.x) / tilesPerHead;
    int64_t const rem = static_cast<int64_t>(blockIdx.x) - bh * tilesPerHead;
    int64_t const m0 = (rem / tilesN) * kBM;
    int64_t const n0 = (rem % tilesN) * kBN;

    WarpPos const pos = warpPos();
    int const wm = pos.wm;
    int const wn = pos.wn;
    int const g = pos.g;
    int const t = pos.t;

    float acc[2][kNi][4];
    zeroAcc(acc);

    int const rowsA = static_cast<int>(M - m0 < kBM ? M - m0 : kBM);
    int const rowsB = static_cast<int>(N - n0 < kBN ? N - n0 : kBN);
    T const* aRows = q + (bh * M + m0) * Dh;
    int64_t const bRow0 = (bh * N + n0) * Dh;
    for (int64_t k0 = 0; k0 < Dh; k0 += K)
    {
        stageRows<kBM, K, kVecLoad>(smem.ops.a, aRows, rowsA, Dh, k0);
        if constexpr (std::is_same<T, float>::value)
        {
            stageRows<kBN, K, kVecLoad>(smem.ops.b, kS32 + bRow0, rowsB, Dh, k0);
        }
        else
        {
            stageRows<kBN, K, kVecLoad>(smem.ops.bHi, kSHi + bRow0, rowsB, Dh, k0);
            stageRows<kBN, K, kVecLoad>(smem.ops.bLo, kSLo + bRow0, rowsB, Dh, k0);
        }
        __syncthreads();
        mmaSlice<T>(smem.ops, acc, wm, wn, g, t);
        __syncthreads();
    }

    // Epilogue: dist = qq_i + kk_j - acc, the tile staged in shared memory (the operands'
    // shared memory is free now: the loop ended with a barrier), then written row by row.
    stageAcc(smem.stage, acc, pos);
    __syncthreads();
    float const* qqh = qq + bh * M;
    float const* kkh = kk + bh * N;
    T* out = dist + bh * M * N;
    if constexpr (kVecStore)
    {
        constexpr int V = 16 / static_cast<int>(sizeof(T));
        constexpr int kPerRow = kBN / V;
        constexpr int kRowsPerPass = kThreads / kPerRow;
        int const c = (threadIdx.x % kPerRow) * V;
        int64_t const n = n0 + c;
        if (n < N) // N is a multiple of V: the whole vector is inside the row
        {
            float kv[V];
#pragma unroll
            for (int i = 0; i < V; ++i)
            {
                kv[i] = kkh[n + i];
            }
#pragma unroll 4
            for (int r = threadIdx.x / kPerRow; r < kBM; r += kRowsPerPass)
            {
                int64_t const m = m0 + r;
                if (m >= M)
                {
                    break;
                }
                float const qv = qqh[m];
                float v[V];
#pragma unroll
                for (int i = 0; i < V; ++i)
                {
                    v[i] = qv + kv[i] - smem.stage[r][c + i];
                }
                storeVec(out + m * N + n, v);
            }
        }
    }
    else
    {
        int const c = threadIdx.x % kBN;
        int64_t const n = n0 + c;
        if (n < N)
        {
            float const kv = kkh[n];
            for (int r = threadIdx.x / kBN; r < kBM; r += kThreads / kBN)
            {
                int64_t const m = m0 + r;
                if (m >= M)
                {
                    break;
                }
                out[m * N + n] = fromFloat<T>(qqh[m] + kv - smem.stage[r][c]);
            }
        }
    }
}

// ------------------------------------------------------------------------------------ host side

struct Workspace
{
    void* kSA; // fp32 kS [B*H, Lk, Dh] over kSA..kSB, or fp16 hi in kSA and lo in kSB
    void* kSB;
    float* qq; // [B*H, Lq]
    float* kk; // [B*H, Lk]
    size_t bytes;
};

inline size_t alignUp(size_t n)
{
    return (n + kAlign - 1) / kAlign * kAlign;
}

// Carve the workspace (base may be null to just measure it). kSA and kSB are adjacent and each
// holds n halves, so together they hold the n floats of the fp32 kS.
inline Workspace layout(void* base, int64_t B, int64_t H, int64_t Lq, int64_t Lk, int64_t Dh)
{
    auto* p = static_cast<char*>(base);
    size_t off = 0;
    auto take = [&](size_t bytes) {
        void* ptr = p ? static_cast<void*>(p + off) : nullptr;
        off += alignUp(bytes);
        return ptr;
    };
    size_t const n = static_cast<size_t>(B * H * Lk * Dh);
    Workspace w{};
    w.kSA = take(n * sizeof(__half));
    w.kSB = take(n * sizeof(__half));
    w.qq = static_cast<float*>(take(static_cast<size_t>(B * H * Lq) * sizeof(float)));
    w.kk = static_cast<float*>(take(static_cast<size_t>(B * H * Lk) * sizeof(float)));
    w.bytes = off;
    return w;
}

template <typename T>
int launchTta(void const* qv, void const* kv, void const* tracev, void* distv, int64_t B, int64_t H, int64_t Bt,
    int64_t Ht, int64_t Lq, int64_t Lk, int64_t Dh, void* workspace, size_t workspaceSize, cudaStream_t stream)
{
    auto const* q = static_cast<T const*>(qv);
    auto const* k = static_cast<T const*>(kv);
    auto const* trace = static_cast<T const*>(tracev);
    auto* dist = static_cast<T*>(distv);
    if (B * H * Lq * Lk == 0)
    {
        return 0;
    }
    Workspace const w = layout(workspace, B, H, Lq, Lk, Dh);
    if (workspace == nullptr || workspaceSize < w.bytes || (reinterpret_cast<uintptr_t>(workspace) % kAlign) != 0)
    {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    bool constexpr isFloat = std::is_same<T, float>::value;
    auto* kS32 = static_cast<float*>(w.kSA);
    auto* kSHi = static_cast<__half*>(w.kSA);
    auto* kSLo = static_cast<__half*>(w.kSB);

    int64_t const tilesM = ceilDiv(Lq, kBM);
    int64_t const tilesN = ceilDiv(Lk, kBN);
    int64_t const blocks = B * H * tilesM * tilesN;
    if (blocks > kMaxGridX || blocks / (tilesM * tilesN) != B * H)
    {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    int status = 0;
    bool fastPrep = false;
    if constexpr (!isFloat)
    {
        fastPrep = ttaFp16FastPrepApplies(q, k, trace, Dh);
        if (fastPrep)
        {
            status = launchTtaPrepFp16(q, k, trace, kSHi, kSLo, w.qq, w.kk, B, H, Bt, Ht, Lq, Lk, Dh, stream);
        }
    }
    if (!fastPrep)
    {
        status = launchTtaPrep<T>(q, k, trace, isFloat ? kS32 : nullptr, isFloat ? nullptr : kSHi,
            isFloat ? nullptr : kSLo, w.qq, w.kk, B, H, Bt, Ht, Lq, Lk, Dh, stream);
    }
    if (status != 0)
    {
        return status;
    }
    if constexpr (!isFloat)
    {
        if (ttaFp16FastPathApplies(q, Dh))
        {
            return launchTtaDistanceFp16(q, kSHi, kSLo, w.qq, w.kk, dist, B * H, Lq, Lk, Dh, stream);
        }
    }
    constexpr int V = kVec<T>;
    bool const vecStore = Lk % V == 0 && reinterpret_cast<uintptr_t>(dist) % 16 == 0;
    bool const vecLoad = Dh % V == 0 && reinterpret_cast<uintptr_t>(q) % 16 == 0; // workspace: 256-aligned
    auto kernel = vecStore ? (vecLoad ? ttaDistanceKernel<T, true, true> : ttaDistanceKernel<T, true, false>)
                           : (vecLoad ? ttaDistanceKernel<T, false, true> : ttaDistanceKernel<T, false, false>);
    kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        q, kS32, kSHi, kSLo, w.qq, w.kk, dist, Lq, Lk, Dh, tilesM, tilesN);
    return launchStatus();
}

bool validShape(int64_t B, int64_t H, int64_t Bt, int64_t Ht, int64_t Lq, int64_t Lk, int64_t Dh)
{
    return B >= 0 && H >= 0 && Lq >= 0 && Lk >= 0 && Dh >= 1 && (Bt == B || Bt == 1) && (Ht == H || Ht == 1);
}

} // namespace
} // namespace kernels
} // namespace attnx

extern "C" ATTNX_API size_t attnx_tta_distance_workspace_size(
    int64_t B, int64_t H, int64_t Bt, int64_t Ht, int64_t Lq, int64_t Lk, int64_t Dh)
{
    using namespace attnx::kernels;
    if (!validShape(B, H, Bt, Ht, Lq, Lk, Dh))
    {
        return 0;
    }
    return layout(nullptr, B, H, Lq, Lk, Dh).bytes;
}

extern "C" ATTNX_API int attnx_tta_distance(int dtype, void const* q, void const* k, void const* trace, void* dist,
    int64_t B, int64_t H, int64_t Bt, int64_t Ht, int64_t Lq, int64_t Lk, int64_t Dh, void* workspace,
    size_t workspace_size, void* stream)
{
    using namespace attnx::kernels;
    if (!validShape(B, H, Bt, Ht, Lq, Lk, Dh))
    {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    return withDtype(dtype, [&](auto tag) {
        return launchTta<decltype(tag)>(q, k, trace, dist, B, H, Bt, Ht, Lq, Lk, Dh, workspace, workspace_size,
            static_cast<cudaStream_t>(stream));
    });
}
