/*
 * attnx CUDA kernels behind a small C ABI.
 *
 * Used by the TensorRT plugins (maw_depth_select_plugin.cpp, tta_distance_plugin.cpp)
 * and callable directly (ctypes) so the kernels can be tested against the PyTorch
 * reference without TensorRT (attnx.plugins.kernels).
 *
 * Conventions
 *  - All tensors are dense, row-major ("linear"), on the device.
 *  - `dtype` is ATTNX_DTYPE_FP32 or ATTNX_DTYPE_FP16 for every floating tensor of a call;
 *    arithmetic is done in fp32.
 *  - `stream` is a cudaStream_t passed as void* (NULL = the legacy default stream).
 *  - The return value is a cudaError_t as int: 0 = launched; errors from bad arguments
 *    are cudaErrorInvalidValue (1). Launches are asynchronous; nothing synchronizes.
 */
#ifndef ATTNX_KERNELS_H
#define ATTNX_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define ATTNX_API __declspec(dllexport)
#else
#define ATTNX_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

enum
{
    ATTNX_DTYPE_FP32 = 0,
    ATTNX_DTYPE_FP16 = 1
};

/* C ABI version, bumped on any signature change (checked by the Python bindings). */
#define ATTNX_KERNELS_ABI_VERSION 1
ATTNX_API int attnx_kernels_abi_version(void);

/*
 * MawDepthSelect: t_b = argmax_t policy_logits[b, t] (first maximum on ties, NaN wins like
 * torch.argmax), logits[b,h,i,j] = scale * q_depth[b,h,i,t_b] * k_depth[b,h,j,t_b],
 * depth[b] = t_b (int64).
 *   q_depth [B,H,Lq,D], k_depth [B,H,Lk,D], policy_logits [B,D] (dtype)
 *   logits  [B,H,Lq,Lk] (dtype), depth [B] int64
 * Only the selected depth slice of q_depth/k_depth is read.
 */
ATTNX_API int attnx_maw_depth_select(int dtype, void const* q_depth, void const* k_depth,
    void const* policy_logits, void* logits, int64_t* depth, int64_t B, int64_t H, int64_t Lq,
    int64_t Lk, int64_t D, float scale, void* stream);

/*
 * TtaDistance: dist[b,h,i,j] = (q_i - k_j)^T T (q_i - k_j), T = trace[b', h'] with
 * b' = b if Bt == B else 0 (Bt in {1, B}) and h' = h if Ht == H else 0 (Ht in {1, H}).
 *   q [B,H,Lq,Dh], k [B,H,Lk,Dh], trace [Bt,Ht,Dh,Dh] (dtype), dist [B,H,Lq,Lk] (dtype)
 * Computed as qq_i + kk_j - q_i . (k_j S), S = T + T^T, qq_i = q_i^T T q_i,
 * kk_j = k_j^T T k_j: S, kS and qq/kk are precomputed into `workspace` (fp32), then one
 * tiled shared-memory GEMM-shaped kernel over (i, j) tiles with fp32 accumulation.
 * `workspace` must hold attnx_tta_distance_workspace_size(...) bytes (256-byte aligned).
 */
ATTNX_API size_t attnx_tta_distance_workspace_size(
    int64_t B, int64_t H, int64_t Bt, int64_t Ht, int64_t Lq, int64_t Lk, int64_t Dh);

ATTNX_API int attnx_tta_distance(int dtype, void const* q, void const* k, void const* trace, void* dist,
    int64_t B, int64_t H, int64_t Bt, int64_t Ht, int64_t Lq, int64_t Lk, int64_t Dh, void* workspace,
    size_t workspace_size, void* stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ATTNX_KERNELS_H */
