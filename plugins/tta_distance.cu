// TtaDistance kernels: dist[b,h,i,j] = (q_i - k_j)^T T (q_i - k_j) without the Dh^2 loop
// per output element, through the expansion
//
//     dist_ij = qq_i + kk_j - q_i . (k_j S),   S = T + T^T,
//     qq_i = q_i^T T q_i = 0.5 q_i . (q_i S),   kk_j = 0.5 k_j . (k_j S).
//
// Pipeline (all fp32 in the workspace, one stream, no host synchronisation):
//   1. S = T + T^T                       [Bt, Ht, Dh, Dh]     (elementwise)
//   2. kS = K S,  qS = Q S               [B, H, L, Dh]        (tiled GEMM, mode kStoreF32)
//   3. kk_j, qq_i                        [B, H, L]            (one warp per row)
//   4. dist = qq + kk - Q kS^T           [B, H, Lq, Lk]       (tiled GEMM, mode kDistance)
// Steps 2 and 4 share one tiled shared-memory GEMM kernel (64x64 output tile, 16-deep
// k-slices, 256 threads, 4x4 outputs per thread, fp32 accumulation).
#include "attnx_kernels.h"
#include "kernel_common.cuh"

#include <climits>

namespace attnx
{
namespace kernels
{
namespace
{

constexpr int kBM = 64;
constexpr int kBN = 64;
constexpr int kBK = 16;
constexpr int kGemmThreads = 256;
constexpr int kPad = 2; // (2c + r) % 32 spreads the transposed shared-memory stores over all banks
constexpr size_t kAlign = 256;

enum GemmMode : int
{
    kStoreF32 = 0, // outF[bh, m, n] = acc
    kDistance = 1, // outT[bh, m, n] = rowTerm[bh, m] + colTerm[bh, n] - acc
};

// C[bh, m, n] = sum_d A[bh, m, d] * Bt[b, h, n, d] for a batch of (b, h) pairs.
// A: [B*H, M, K] (type TA); Bt: fp32 [N, K] per (b, h) at Bt + b*bStrideB + h*bStrideH
// (a stride of 0 broadcasts). Block = one 64x64 tile of one (b, h); grid flattened to 1-D.
template <typename TA, int Mode, typename TO>
__global__ void __launch_bounds__(kGemmThreads) tiledGemmKernel(TA const* __restrict__ A, float const* __restrict__ Bt,
    int64_t H, int64_t M, int64_t N, int64_t K, int64_t bStrideB, int64_t bStrideH, int64_t tilesM, int64_t tilesN,
    float* __restrict__ outF, TO* __restrict__ outT, float const* __restrict__ rowTerm,
    float const* __restrict__ colTerm)
{
    __shared__ float As[kBK][kBM + kPad]; // transposed: As[d][m]
    __shared__ float Bs[kBK][kBN + kPad]; // transposed: Bs[d][n]

    int64_t const tilesPerHead = tilesM * tilesN;
    int64_t const bh = static_cast<int64_t>(blockIdx.x) / tilesPerHead;
    int64_t const rem = static_cast<int64_t>(blockIdx.x) - bh * tilesPerHead;
    int64_t const tm = rem / tilesN;
    int64_t const tn = rem - tm * tilesN;
    int64_t const b = bh / H;
    int64_t const h = bh - b * H;

    TA const* Ab = A + bh * M * K;
    float const* Bb = Bt + b * bStrideB + h * bStrideH;
    int64_t const m0 = tm * kBM;
    int64_t const n0 = tn * kBN;

    int const tid = threadIdx.x;
    int const tx = tid % 16; // output columns tx + 16 c
    int const ty = tid / 16; // output rows    ty + 16 r

    float acc[4][4];
#pragma unroll
    for (int r = 0; r < 4; ++r)
    {
#pragma unroll
        for (int c = 0; c < 4; ++c)
        {
            acc[r][c] = 0.0f;
        }
    }

    for (int64_t k0 = 0; k0 < K; k0 += kBK)
    {
        // Each thread stages 4 elements of each operand: a warp reads two rows x 16
        // consecutive d (whole 32-byte sectors), stored transposed.
#pragma unroll
        for (int l = 0; l < (kBM * kBK) / kGemmThreads; ++l)
        {
            int const idx = tid + l * kGemmThreads;
            int const row = idx / kBK;
            int const d = idx % kBK;
            int64_t const gk = k0 + d;
            int64_t const gm = m0 + row;
            int64_t const gn = n0 + row;
            As[d][row] = (gm < M && gk < K) ? toFloat(Ab[gm * K + gk]) : 0.0f;
            Bs[d][row] = (gn < N && gk < K) ? Bb[gn * K + gk] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int d = 0; d < kBK; ++d)
        {
            float a[4];
            float bv[4];
#pragma unroll
            for (int r = 0; r < 4; ++r)
            {
                a[r] = As[d][ty + 16 * r];
            }
#pragma unroll
            for (int c = 0; c < 4; ++c)
            {
                bv[c] = Bs[d][tx + 16 * c];
            }
#pragma unroll
            for (int r = 0; r < 4; ++r)
            {
#pragma unroll
                for (int c = 0; c < 4; ++c)
                {
                    acc[r][c] = fmaf(a[r], bv[c], acc[r][c]);
                }
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int r = 0; r < 4; ++r)
    {
        int64_t const m = m0 + ty + 16 * r;
        if (m >= M)
        {
            continue;
        }
        float const rowValue = Mode == kDistance ? rowTerm[bh * M + m] : 0.0f;
#pragma unroll
        for (int c = 0; c < 4; ++c)
        {
            int64_t const n = n0 + tx + 16 * c;
            if (n >= N)
            {
                continue;
            }
            int64_t const o = (bh * M + m) * N + n;
            if (Mode == kDistance)
            {
                outT[o] = fromFloat<TO>(rowValue + colTerm[bh * N + n] - acc[r][c]);
            }
            else
            {
                outF[o] = acc[r][c];
            }
        }
    }
}

// S[s, d, e] = T[s, d, e] + T[s, e, d] for every trace matrix s.
template <typename T>
__global__ void symmetrizeKernel(T const* __restrict__ trace, float* __restrict__ S, int64_t nMatrices, int64_t Dh)
{
    int64_t const per = Dh * Dh;
    int64_t const total = nMatrices * per;
    for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
         idx += static_cast<int64_t>(gridDim.x) * blockDim.x)
    {
        int64_t const s = idx / per;
        int64_t const rem = idx - s * per;
        int64_t const d = rem / Dh;
        int64_t const e = rem - d * Dh;
        S[idx] = toFloat(trace[idx]) + toFloat(trace[s * per + e * Dh + d]);
    }
}

// out[row] = 0.5 * x[row, :] . xS[row, :] (= x^T T x); one warp per row.
template <typename T>
__global__ void halfRowDotKernel(
    T const* __restrict__ x, float const* __restrict__ xS, float* __restrict__ out, int64_t rows, int64_t Dh)
{
    int const lane = threadIdx.x & 31;
    int64_t const warpsPerBlock = blockDim.x / 32;
    int64_t const first = static_cast<int64_t>(blockIdx.x) * warpsPerBlock + threadIdx.x / 32;
    int64_t const step = static_cast<int64_t>(gridDim.x) * warpsPerBlock;
    for (int64_t row = first; row < rows; row += step)
    {
        T const* xr = x + row * Dh;
        float const* sr = xS + row * Dh;
        float sum = 0.0f;
        for (int64_t d = lane; d < Dh; d += 32)
        {
            sum = fmaf(toFloat(xr[d]), sr[d], sum);
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1)
        {
            sum += __shfl_xor_sync(0xffffffffu, sum, offset);
        }
        if (lane == 0)
        {
            out[row] = 0.5f * sum;
        }
    }
}

struct Workspace
{
    float* S;
    float* kS;
    float* qS;
    float* qq;
    float* kk;
    size_t bytes;
};

inline size_t alignUp(size_t n)
{
    return (n + kAlign - 1) / kAlign * kAlign;
}

// Carve the workspace (base may be null to just measure it).
inline Workspace layout(void* base, int64_t B, int64_t H, int64_t Bt, int64_t Ht, int64_t Lq, int64_t Lk, int64_t Dh)
{
    auto* p = static_cast<char*>(base);
    size_t off = 0;
    auto take = [&](int64_t elements) {
        float* ptr = p ? reinterpret_cast<float*>(p + off) : nullptr;
        off += alignUp(static_cast<size_t>(elements) * sizeof(float));
        return ptr;
    };
    Workspace w{};
    w.S = take(Bt * Ht * Dh * Dh);
    w.kS = take(B * H * Lk * Dh);
    w.qS = take(B * H * Lq * Dh);
    w.qq = take(B * H * Lq);
    w.kk = take(B * H * Lk);
    w.bytes = off;
    return w;
}

template <typename TA, int Mode, typename TO>
int launchGemm(TA const* A, float const* Bt, int64_t B, int64_t H, int64_t M, int64_t N, int64_t K, int64_t bStrideB,
    int64_t bStrideH, float* outF, TO* outT, float const* rowTerm, float const* colTerm, cudaStream_t stream)
{
    int64_t const tilesM = ceilDiv(M, kBM);
    int64_t const tilesN = ceilDiv(N, kBN);
    int64_t const blocks = B * H * tilesM * tilesN;
    if (blocks == 0)
    {
        return 0;
    }
    if (blocks > kMaxGridX || blocks / (tilesM * tilesN) != B * H)
    {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    tiledGemmKernel<TA, Mode, TO><<<static_cast<unsigned>(blocks), kGemmThreads, 0, stream>>>(
        A, Bt, H, M, N, K, bStrideB, bStrideH, tilesM, tilesN, outF, outT, rowTerm, colTerm);
    return launchStatus();
}

inline unsigned gridFor(int64_t work, int64_t perBlock)
{
    int64_t const blocks = ceilDiv(work, perBlock);
    return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65535 ? 65535 : blocks));
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
    Workspace const w = layout(workspace, B, H, Bt, Ht, Lq, Lk, Dh);
    if (workspace == nullptr || workspaceSize < w.bytes || (reinterpret_cast<uintptr_t>(workspace) % kAlign) != 0)
    {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    int status = 0;
    int64_t const matrices = Bt * Ht;
    symmetrizeKernel<T><<<gridFor(matrices * Dh * Dh, 256), 256, 0, stream>>>(trace, w.S, matrices, Dh);
    if ((status = launchStatus()) != 0)
    {
        return status;
    }
    // S is symmetric, so its row-major [Dh, Dh] block is also the "Bt" (= S^T) operand.
    int64_t const sStrideB = Bt == B ? Ht * Dh * Dh : 0;
    int64_t const sStrideH = Ht == H ? Dh * Dh : 0;
    if ((status = launchGemm<T, kStoreF32, float>(
             k, w.S, B, H, Lk, Dh, Dh, sStrideB, sStrideH, w.kS, nullptr, nullptr, nullptr, stream))
        != 0)
    {
        return status;
    }
    if ((status = launchGemm<T, kStoreF32, float>(
             q, w.S, B, H, Lq, Dh, Dh, sStrideB, sStrideH, w.qS, nullptr, nullptr, nullptr, stream))
        != 0)
    {
        return status;
    }
    halfRowDotKernel<T><<<gridFor(B * H * Lk, 8), 256, 0, stream>>>(k, w.kS, w.kk, B * H * Lk, Dh);
    if ((status = launchStatus()) != 0)
    {
        return status;
    }
    halfRowDotKernel<T><<<gridFor(B * H * Lq, 8), 256, 0, stream>>>(q, w.qS, w.qq, B * H * Lq, Dh);
    if ((status = launchStatus()) != 0)
    {
        return status;
    }
    // dist = qq + kk - Q (kS)^T: kS [Lk, Dh] per (b, h) is the row-major "Bt" operand.
    return launchGemm<T, kDistance, T>(
        q, w.kS, B, H, Lq, Lk, Dh, H * Lk * Dh, Lk * Dh, nullptr, dist, w.qq, w.kk, stream);
}

bool validShape(int64_t B, int64_t H, int64_t Bt, int64_t Ht, int64_t Lq, int64_t Lk, int64_t Dh)
{
    return B >= 0 && H >= 0 && Lq >= 0 && Lk >= 0 && Dh >= 1
        && (Bt == B || Bt == 1) && (Ht == H || Ht == 1);
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
    return layout(nullptr, B, H, Bt, Ht, Lq, Lk, Dh).bytes;
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
    auto const s = static_cast<cudaStream_t>(stream);
    switch (dtype)
    {
    case ATTNX_DTYPE_FP32:
        return launchTta<float>(q, k, trace, dist, B, H, Bt, Ht, Lq, Lk, Dh, workspace, workspace_size, s);
    case ATTNX_DTYPE_FP16:
        return launchTta<__half>(q, k, trace, dist, B, H, Bt, Ht, Lq, Lk, Dh, workspace, workspace_size, s);
    default: return static_cast<int>(cudaErrorInvalidValue);
    }
}
