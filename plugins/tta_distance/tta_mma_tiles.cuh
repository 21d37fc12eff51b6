// TtaDistance device pieces shared by its kernel files: tensor-core primitives (mma.sync,
// sm_80+), the 128 x 64 block tile (8 warps as 4 x 2, each 32 x 32 = 2 x 4 mma tiles), its
// shared-memory operand layouts, staging of row-major slices, and the product of one slice.
#ifndef ATTNX_TTA_MMA_TILES_CUH
#define ATTNX_TTA_MMA_TILES_CUH

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace attnx
{
namespace kernels
{
namespace tta
{

// c += a b on the tensor cores, fp32 accumulation: m16n8k16 with fp16 operands.
__device__ __forceinline__ void mmaF16(float (&c)[4], uint32_t const (&a)[4], uint32_t b0, uint32_t b1)
{
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += a b, m16n8k8 with TF32 operands.
__device__ __forceinline__ void mmaTf32(float (&c)[4], uint32_t const (&a)[4], uint32_t b0, uint32_t b1)
{
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t toTf32(float x)
{
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
}

// x = big + small, both TF32 (3xTF32: products big*big + big*small + small*big are ~fp32 exact).
__device__ __forceinline__ void splitTf32(float x, uint32_t& big, uint32_t& small)
{
    big = toTf32(x);
    small = toTf32(x - __uint_as_float(big));
}


constexpr int kBM = 128; // q rows per block
constexpr int kBN = 64;  // k rows per block
constexpr int kThreads = 256;
constexpr int kWarpN = kBN / 2; // warps: 4 (rows) x 2 (columns), each 32 x kWarpN
constexpr int kNi = kWarpN / 8; // mma tiles per warp along n

// Dh slice staged per step: 64 halves (Dh = 64 in one step) or 32 floats (keeps fp32 under 48 KB).
template <typename T>
constexpr int kSliceK = std::is_same<T, float>::value ? 32 : 64;
// Elements per 16-byte vector.
template <typename T>
constexpr int kVec = 16 / static_cast<int>(sizeof(T));

template <typename T>
struct Operands;

template <>
struct Operands<float> // fp32 A and B tiles, [row][k], stride 36 words: conflict-free fragment loads
{
    static constexpr int kStride = kSliceK<float> + 4;
    float a[kBM][kStride];
    float b[kBN][kStride];
};

template <>
struct Operands<__half> // fp16 A, B hi and lo, [row][k], stride 72 halves (36 words)
{
    static constexpr int kStride = kSliceK<__half> + 8;
    __half a[kBM][kStride];
    __half bHi[kBN][kStride];
    __half bLo[kBN][kStride];
};

__device__ __forceinline__ uint32_t ld32(__half const* p)
{
    return *reinterpret_cast<uint32_t const*>(p);
}

// Copy rows [0, rows) x slice columns [k0, k0 + K) of a row-major [*, Dh] matrix (from its row 0
// at src) into dst[row][0..K), zero outside. Vector path (Dh a multiple of the vector width,
// 16-byte aligned rows): one 16-byte load and store per vector, consecutive threads along a row.
// Scalar path: consecutive threads along a row, one element each.
template <int kRows, int K, bool kVecLoad, typename E, int kStride>
__device__ __forceinline__ void stageRows(E (*dst)[kStride], E const* src, int rows, int64_t Dh, int64_t k0)
{
    if constexpr (kVecLoad)
    {
        constexpr int V = 16 / static_cast<int>(sizeof(E));
        constexpr int kPerRow = K / V;
#pragma unroll
        for (int idx = threadIdx.x; idx < kRows * kPerRow; idx += kThreads)
        {
            int const row = idx / kPerRow;
            int const c = (idx % kPerRow) * V;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (row < rows && k0 + c < Dh) // Dh is a multiple of V: the vector is inside the row
            {
                v = *reinterpret_cast<uint4 const*>(src + row * Dh + k0 + c);
            }
            *reinterpret_cast<uint4*>(&dst[row][c]) = v;
        }
    }
    else
    {
#pragma unroll 4
        for (int idx = threadIdx.x; idx < kRows * K; idx += kThreads)
        {
            int const row = idx / K;
            int const c = idx % K;
            dst[row][c] = (row < rows && k0 + c < Dh) ? src[row * Dh + k0 + c] : E(0.0f);
        }
    }
}

// acc[mi][ni] += A[warp rows] * B[warp cols]^T over one staged slice.
template <typename T>
__device__ __forceinline__ void mmaSlice(Operands<T> const& s, float (&acc)[2][kNi][4], int wm, int wn, int g, int t)
{
    if constexpr (std::is_same<T, float>::value)
    {
#pragma unroll
        for (int kb = 0; kb < kSliceK<T>; kb += 8)
        {
            uint32_t aBig[2][4];
            uint32_t aSmall[2][4];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
            {
                int const r = wm * 32 + mi * 16 + g;
                splitTf32(s.a[r][kb + t], aBig[mi][0], aSmall[mi][0]);
                splitTf32(s.a[r + 8][kb + t], aBig[mi][1], aSmall[mi][1]);
                splitTf32(s.a[r][kb + t + 4], aBig[mi][2], aSmall[mi][2]);
                splitTf32(s.a[r + 8][kb + t + 4], aBig[mi][3], aSmall[mi][3]);
            }
#pragma unroll
            for (int ni = 0; ni < kNi; ++ni)
            {
                int const n = wn * kWarpN + ni * 8 + g;
                uint32_t b0Big, b0Small, b1Big, b1Small;
                splitTf32(s.b[n][kb + t], b0Big, b0Small);
                splitTf32(s.b[n][kb + t + 4], b1Big, b1Small);
#pragma unroll
                for (int mi = 0; mi < 2; ++mi)
                {
                    mmaTf32(acc[mi][ni], aSmall[mi], b0Big, b1Big);
                    mmaTf32(acc[mi][ni], aBig[mi], b0Small, b1Small);
                    mmaTf32(acc[mi][ni], aBig[mi], b0Big, b1Big);
                }
            }
        }
    }
    else
    {
#pragma unroll
        for (int kb = 0; kb < kSliceK<T>; kb += 16)
        {
            uint32_t a[2][4];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
            {
                int const r = wm * 32 + mi * 16 + g;
                a[mi][0] = ld32(&s.a[r][kb + 2 * t]);
                a[mi][1] = ld32(&s.a[r + 8][kb + 2 * t]);
                a[mi][2] = ld32(&s.a[r][kb + 2 * t + 8]);
                a[mi][3] = ld32(&s.a[r + 8][kb + 2 * t + 8]);
            }
#pragma unroll
            for (int ni = 0; ni < kNi; ++ni)
            {
                int const n = wn * kWarpN + ni * 8 + g;
                uint32_t const hi0 = ld32(&s.bHi[n][kb + 2 * t]);
                uint32_t const hi1 = ld32(&s.bHi[n][kb + 2 * t + 8]);
                uint32_t const lo0 = ld32(&s.bLo[n][kb + 2 * t]);
                uint32_t const lo1 = ld32(&s.bLo[n][kb + 2 * t + 8]);
#pragma unroll
                for (int mi = 0; mi < 2; ++mi)
                {
                    mmaF16(acc[mi][ni], a[mi], lo0, lo1);
                    mmaF16(acc[mi][ni], a[mi], hi0, hi1);
                }
            }
        }
    }
}

// The rows a prep block works on: blocks [0, blocksQ) tile q's rows, the rest k's, tileRows rows at
// a time per (batch, head); rows < tileRows on the last tile of a sequence.
struct PrepTile
{
    bool isK;
    int64_t bh, b, h, row0, L;
    int rows;

    template <typename T>
    __device__ __forceinline__ T const* rowsOf(T const* q, T const* k, int64_t Dh) const
    {
        return (isK ? k : q) + (bh * L + row0) * Dh;
    }

    template <typename T> // trace [Bt, Ht, Dh, Dh], Bt and Ht 1 or the full size
    __device__ __forceinline__ T const* traceOf(T const* trace, int64_t Bt, int64_t Ht, int64_t Dh) const
    {
        return trace + ((Bt == 1 ? 0 : b) * Ht + (Ht == 1 ? 0 : h)) * Dh * Dh;
    }
};

__device__ __forceinline__ PrepTile prepTile(int64_t blk, int64_t blocksQ, int64_t tilesQ, int64_t tilesK, int64_t Lq,
    int64_t Lk, int64_t H, int tileRows)
{
    PrepTile p;
    p.isK = blk >= blocksQ;
    if (p.isK)
    {
        blk -= blocksQ;
    }
    int64_t const tiles = p.isK ? tilesK : tilesQ;
    p.bh = blk / tiles;
    p.row0 = (blk - p.bh * tiles) * tileRows;
    p.L = p.isK ? Lk : Lq;
    p.rows = static_cast<int>(p.L - p.row0 < tileRows ? p.L - p.row0 : tileRows);
    p.b = p.bh / H;
    p.h = p.bh - p.b * H;
    return p;
}

// This thread's place in the block tile: warp row wm (0-3) and column wn (0-1), and its mma
// fragment coordinates g = lane / 4 (row), t = lane % 4 (column pair).
struct WarpPos
{
    int wm, wn, g, t;
};

__device__ __forceinline__ WarpPos warpPos()
{
    int const lane = threadIdx.x & 31;
    int const warp = threadIdx.x >> 5;
    return WarpPos{warp & 3, warp >> 2, lane >> 2, lane & 3};
}

__device__ __forceinline__ void zeroAcc(float (&acc)[2][kNi][4])
{
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
    {
#pragma unroll
        for (int ni = 0; ni < kNi; ++ni)
        {
#pragma unroll
            for (int c = 0; c < 4; ++c)
            {
                acc[mi][ni][c] = 0.0f;
            }
        }
    }
}

// The accumulators into a [row][column] float staging tile (the block's 128 x 64 layout).
template <int kStride>
__device__ __forceinline__ void stageAcc(float (*stage)[kStride], float const (&acc)[2][kNi][4], WarpPos p)
{
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
    {
#pragma unroll
        for (int ni = 0; ni < kNi; ++ni)
        {
            int const r = p.wm * 32 + mi * 16 + p.g;
            int const c = p.wn * kWarpN + ni * 8 + 2 * p.t;
            *reinterpret_cast<float2*>(&stage[r][c]) = make_float2(acc[mi][ni][0], acc[mi][ni][1]);
            *reinterpret_cast<float2*>(&stage[r + 8][c]) = make_float2(acc[mi][ni][2], acc[mi][ni][3]);
        }
    }
}

// Programmatic dependent launch (sm_90+): the prep kernel lets the distance pass start once every
// prep block is past its main work; the distance pass stages its q tile (written before the prep
// began), then waits for the whole prep grid (its writes visible) before reading kS, qq and kk.
// Compiled for older targets both are no-ops; the host only asks for the overlap when the kernel
// it launches was compiled for sm_90+ (so the wait is there).
__device__ __forceinline__ void letDependentsLaunch()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void waitForPrerequisiteGrid()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

} // namespace tta
} // namespace kernels
} // namespace attnx

#endif // ATTNX_TTA_MMA_TILES_CUH
