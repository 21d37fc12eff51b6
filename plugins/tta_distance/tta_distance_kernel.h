/*
 * TtaDistance kernels, C ABI (conventions: common/kernel_abi.h).
 *
 * dist[b,h,i,j] = (q_i - k_j)^T T (q_i - k_j), T = trace[b', h'] with b' = b if Bt == B else 0
 * (Bt in {1, B}) and h' = h if Ht == H else 0 (Ht in {1, H}).
 *   q [B,H,Lq,Dh], k [B,H,Lk,Dh], trace [Bt,Ht,Dh,Dh] (dtype), dist [B,H,Lq,Lk] (dtype)
 * Computed as qq_i + kk_j - q_i . (k_j S), S = T + T^T, qq_i = q_i^T T q_i, kk_j = k_j^T T k_j:
 * one launch computes kS and qq/kk into `workspace`, a second the GEMM-shaped distance pass on
 * the tensor cores (fp16: fp16 q times kS split in two fp16 halves; fp32: 3xTF32), fp32
 * accumulation. `workspace` must hold attnx_tta_distance_workspace_size(...) bytes (256-byte
 * aligned).
 */
#ifndef ATTNX_TTA_DISTANCE_KERNEL_H
#define ATTNX_TTA_DISTANCE_KERNEL_H

#include "common/kernel_abi.h"

#ifdef __cplusplus
extern "C" {
#endif

ATTNX_API size_t attnx_tta_distance_workspace_size(
    int64_t B, int64_t H, int64_t Bt, int64_t Ht, int64_t Lq, int64_t Lk, int64_t Dh);

ATTNX_API int attnx_tta_distance(int dtype, void const* q, void const* k, void const* trace, void* dist,
    int64_t B, int64_t H, int64_t Bt, int64_t Ht, int64_t Lq, int64_t Lk, int64_t Dh, void* workspace,
    size_t workspace_size, void* stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ATTNX_TTA_DISTANCE_KERNEL_H */
