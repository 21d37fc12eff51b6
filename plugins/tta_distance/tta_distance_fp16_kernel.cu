// TtaDistance distance pass, fp16 fast path (Dh <= 64, Dh a multiple of 8, 16-byte aligned q):
// dist = qq + kk - Q (hi + lo)^T on the tensor cores, fp32 accumulation.
//
// One block owns 128 q rows of one (b, h) and walks `tilesPerBlock` consecutive 64-column tiles
// of k. Its A operand (128 x 64 halves) is staged once and kept as mma fragments in registers;
// for each tile the B operand (kS hi and lo) for the *next* tile is loaded into registers while
// this one is multiplied and written, so load latency hides behind the tensor cores and the
// stores. The output tile is converted to fp16 in registers, staged in shared memory (the A
// staging area, free after the fragments are loaded) and written as whole rows of 16-byte stores.
#include "common/kernel_common.cuh"
#include "tta_distance/tta_distance_internal.h"
#include "tta_distance/tta_mma_tiles.cuh"

namespace attnx
{
namespace kernels
{
namespace
{

constexpr int kRows = 128;   // q rows per block
constexpr int kCols = 64;    // k rows per tile
constexpr int kK = 64;       // Dh, zero-padded to 64
constexpr int kStride = 72;  // halves per shared-memory row (36 words: conflict-free fragments)
constexpr int kThreads = 256;
constexpr int kNi = 4;       // 8-column mma tiles per warp (warps: 4 rows x 2 columns, each 32 x 32)

struct Smem
{
    __half a[kRows][kStride]; // A staging, then the output staging
    __half bHi[kCols][kStride];
    __half bLo[kCols][kStride];
};

using tta::ld32;
using tta::mmaF16;
using tta::WarpPos;
using tta::warpPos;
using tta::zeroAcc;

// This thread's share of one B tile: rows idx / 8, 16-byte column vectors idx % 8, idx = tid + 256 l.
struct BRegs
{
    uint4 hi[2];
    uint4 lo[2];
};

__device__ __forceinline__ void loadB(BRegs& r, __half const* hi, __half const* lo, int64_t n0, int64_t N, int64_t Dh)
{
#pragma unroll
    for (int l = 0; l < 2; ++l)
    {
        int const idx = threadIdx.x + l * kThreads;
        int64_t const n = n0 + idx / 8;
        int const c = (idx % 8) * 8;
        r.hi[l] = make_uint4(0u, 0u, 0u, 0u);
        r.lo[l] = make_uint4(0u, 0u, 0u, 0u);
        if (n < N && c < Dh)
        {
            r.hi[l] = *reinterpret_cast<uint4 const*>(hi + n * Dh + c);
            r.lo[l] = *reinterpret_cast<uint4 const*>(lo + n * Dh + c);
        }
    }
}

__device__ __forceinline__ void storeB(Smem& s, BRegs const& r)
{
#pragma unroll
    for (int l = 0; l < 2; ++l)
    {
        int const idx = threadIdx.x + l * kThreads;
        *reinterpret_cast<uint4*>(&s.bHi[idx / 8][(idx % 8) * 8]) = r.hi[l];
        *reinterpret_cast<uint4*>(&s.bLo[idx / 8][(idx % 8) * 8]) = r.lo[l];
    }
}

template <bool kVecStore>
__global__ void __launch_bounds__(kThreads, 2) ttaDistanceFp16Kernel(__half const* __restrict__ q,
    __half const* __restrict__ kSHi, __half const* __restrict__ kSLo, float const* __restrict__ qq,
    float const* __restrict__ kk, __half* __restrict__ dist, int64_t M, int64_t N, int64_t Dh, int64_t tilesM,
    int64_t chunks, int tilesPerBlock)
{
    __shared__ __align__(16) Smem s;

    int64_t const perHead = tilesM * chunks;
    int64_t const bh = static_cast<int64_t>(blockIdx.x) / perHead;
    int64_t const rem = static_cast<int64_t>(blockIdx.x) - bh * perHead;
    int64_t const m0 = (rem / chunks) * kRows;
    int64_t const nFirst = (rem % chunks) * tilesPerBlock * kCols;
    int64_t const nEnd = nFirst + static_cast<int64_t>(tilesPerBlock) * kCols < N ? nFirst + tilesPerBlock * kCols : N;

    WarpPos const pos = warpPos();
    int const wm = pos.wm;
    int const wn = pos.wn;
    int const g = pos.g;
    int const t = pos.t;
    int const kSteps = static_cast<int>((Dh + 15) / 16);

    // A: 128 rows x 64 halves (zero beyond M and Dh), then to fragments. q does not come from the
    // prep: its loads go out before the wait for the prep grid (overlapping the prep's tail on
    // sm_90), the first B tile's right after, in flight while A is staged.
    __half const* aRows = q + (bh * M + m0) * Dh;
    uint4 av[(kRows * 8) / kThreads];
#pragma unroll
    for (int l = 0; l < (kRows * 8) / kThreads; ++l)
    {
        int const idx = threadIdx.x + l * kThreads;
        int const row = idx / 8;
        int const c = (idx % 8) * 8;
        av[l] = make_uint4(0u, 0u, 0u, 0u);
        if (m0 + row < M && c < Dh)
        {
            av[l] = *reinterpret_cast<uint4 const*>(aRows + row * Dh + c);
        }
    }
    tta::waitForPrerequisiteGrid(); // kS, qq and kk are complete and visible from here
    __half const* hi = kSHi + bh * N * Dh;
    __half const* lo = kSLo + bh * N * Dh;
    BRegs next;
    loadB(next, hi, lo, nFirst, N, Dh);
#pragma unroll
    for (int l = 0; l < (kRows * 8) / kThreads; ++l)
    {
        int const idx = threadIdx.x + l * kThreads;
        *reinterpret_cast<uint4*>(&s.a[idx / 8][(idx % 8) * 8]) = av[l];
    }
    __syncthreads();
    uint32_t aF[4][2][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
    {
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
        {
            int const r = wm * 32 + mi * 16 + g;
            int const kb = ks * 16;
            aF[ks][mi][0] = ld32(&s.a[r][kb + 2 * t]);
            aF[ks][mi][1] = ld32(&s.a[r + 8][kb + 2 * t]);
            aF[ks][mi][2] = ld32(&s.a[r][kb + 2 * t + 8]);
            aF[ks][mi][3] = ld32(&s.a[r + 8][kb + 2 * t + 8]);
        }
    }
    // Row terms of this thread's 4 rows (mi, g / g + 8).
    float qRow[2][2];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
    {
#pragma unroll
        for (int h = 0; h < 2; ++h)
        {
            int64_t const m = m0 + wm * 32 + mi * 16 + g + 8 * h;
            qRow[mi][h] = m < M ? qq[bh * M + m] : 0.0f;
        }
    }
    float const* kkh = kk + bh * N;
    __half* out = dist + bh * M * N;

    for (int64_t n0 = nFirst; n0 < nEnd; n0 += kCols)
    {
        __syncthreads(); // the last tile's MMA and write-out are done with bHi/bLo and the staging
        storeB(s, next);
        __syncthreads();
        if (n0 + kCols < nEnd)
        {
            loadB(next, hi, lo, n0 + kCols, N, Dh); // in flight during this tile
        }

        float acc[2][kNi][4];
        zeroAcc(acc);
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
        {
            if (ks < kSteps)
            {
                int const kb = ks * 16;
#pragma unroll
                for (int ni = 0; ni < kNi; ++ni)
                {
                    int const n = wn * 32 + ni * 8 + g;
                    uint32_t const hi0 = ld32(&s.bHi[n][kb + 2 * t]);
                    uint32_t const hi1 = ld32(&s.bHi[n][kb + 2 * t + 8]);
                    uint32_t const lo0 = ld32(&s.bLo[n][kb + 2 * t]);
                    uint32_t const lo1 = ld32(&s.bLo[n][kb + 2 * t + 8]);
#pragma unroll
                    for (int mi = 0; mi < 2; ++mi)
                    {
                        mmaF16(acc[mi][ni], aF[ks][mi], lo0, lo1);
                        mmaF16(acc[mi][ni], aF[ks][mi], hi0, hi1);
                    }
                }
            }
        }

        // dist = qq_i + kk_j - acc in registers, to fp16, staged in s.a.
#pragma unroll
        for (int ni = 0; ni < kNi; ++ni)
        {
            int const c = wn * 32 + ni * 8 + 2 * t;
            int64_t const n = n0 + c;
            float const k0v = n < N ? kkh[n] : 0.0f;
            float const k1v = n + 1 < N ? kkh[n + 1] : 0.0f;
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
            {
                int const r = wm * 32 + mi * 16 + g;
                *reinterpret_cast<__half2*>(&s.a[r][c]) = __floats2half2_rn(
                    qRow[mi][0] + k0v - acc[mi][ni][0], qRow[mi][0] + k1v - acc[mi][ni][1]);
                *reinterpret_cast<__half2*>(&s.a[r + 8][c]) = __floats2half2_rn(
                    qRow[mi][1] + k0v - acc[mi][ni][2], qRow[mi][1] + k1v - acc[mi][ni][3]);
            }
        }
        __syncthreads();
        if constexpr (kVecStore)
        {
            // 128 rows x 8 vectors of 8 halves; N is a multiple of 8, so a vector is all in or all out.
#pragma unroll
            for (int l = 0; l < (kRows * 8) / kThreads; ++l)
            {
                int const idx = threadIdx.x + l * kThreads;
                int const row = idx / 8;
                int const c = (idx % 8) * 8;
                int64_t const m = m0 + row;
                int64_t const n = n0 + c;
                if (m < M && n < N)
                {
                    *reinterpret_cast<uint4*>(out + m * N + n) = *reinterpret_cast<uint4 const*>(&s.a[row][c]);
                }
            }
        }
        else
        {
            for (int idx = threadIdx.x; idx < kRows * kCols; idx += kThreads)
            {
                int const row = idx / kCols;
                int const c = idx % kCols;
                int64_t const m = m0 + row;
                int64_t const n = n0 + c;
                if (m < M && n < N)
                {
                    out[m * N + n] = s.a[row][c];
                }
            }
        }
    }
}

// May this kernel be launched as a programmatic dependent? Only if the code that will run was
// compiled for sm_90+ (so it waits for the prep grid); a PTX JIT of an older target would not.
bool dependentLaunchOk(void const* kernel)
{
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess)
    {
        (void) cudaGetLastError();
        return false;
    }
    return attr.ptxVersion >= 90 && attr.binaryVersion >= 90;
}

int multiprocessors()
{
    int device = 0;
    int count = 0;
    if (cudaGetDevice(&device) != cudaSuccess
        || cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || count < 1)
    {
        (void) cudaGetLastError(); // not sticky: clear it
        return 132;
    }
    return count;
}

} // namespace

bool ttaFp16FastPathApplies(void const* q, int64_t Dh)
{
    return Dh >= 1 && Dh <= kK && Dh % 8 == 0 && reinterpret_cast<uintptr_t>(q) % 16 == 0;
}

int launchTtaDistanceFp16(__half const* q, __half const* kSHi, __half const* kSLo, float const* qq, float const* kk,
    __half* dist, int64_t BH, int64_t M, int64_t N, int64_t Dh, cudaStream_t stream)
{
    int64_t const tilesM = ceilDiv(M, kRows);
    int64_t const tilesN = ceilDiv(N, kCols);
    // Tiles per block: 1, 2, 4 or 8, the fewest cost units by a simple model: each wave of blocks
    // (2 resident per multiprocessor) costs its blocks' time, one unit to start (load A, the first
    // B) plus one per tile. More tiles per block amortise the start but may leave SMs idle
    // (L = 512, B*H = 24: 4 tiles; L >= 2048: 8).
    int64_t const slots = 2LL * multiprocessors();
    int tilesPerBlock = 1;
    int64_t best = -1;
    for (int per = 1; per <= 8; per *= 2)
    {
        int64_t const n = BH * tilesM * ceilDiv(tilesN, per);
        int64_t const cost = ceilDiv(n, slots) * (1 + per);
        if (best < 0 || cost < best)
        {
            best = cost;
            tilesPerBlock = per;
        }
        if (per >= tilesN)
        {
            break;
        }
    }
    int64_t const chunks = ceilDiv(tilesN, tilesPerBlock);
    int64_t const blocks = BH * tilesM * chunks;
    if (blocks > kMaxGridX || blocks / (tilesM * chunks) != BH)
    {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    bool const vecStore = N % 8 == 0 && reinterpret_cast<uintptr_t>(dist) % 16 == 0;
    auto kernel = vecStore ? ttaDistanceFp16Kernel<true> : ttaDistanceFp16Kernel<false>;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(static_cast<unsigned>(blocks));
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = 0;
    config.stream = stream;
    config.attrs = attr;
    config.numAttrs = dependentLaunchOk(reinterpret_cast<void const*>(kernel)) ? 1 : 0;
    cudaError_t const status
        = cudaLaunchKernelEx(&config, kernel, q, kSHi, kSLo, qq, kk, dist, M, N, Dh, tilesM, chunks, tilesPerBlock);
    return status != cudaSuccess ? static_cast<int>(status) : launchStatus();
}

} // namespace kernels
} // namespace attnx
