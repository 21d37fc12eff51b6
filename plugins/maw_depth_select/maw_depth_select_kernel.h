/*
 * MawDepthSelect kernel, C ABI (conventions: common/kernel_abi.h).
 *
 * t_b = argmax_t policy_logits[b, t] (first maximum on ties, NaN wins like torch.argmax),
 * logits[b,h,i,j] = scale * q_depth[b,h,i,t_b] * k_depth[b,h,j,t_b], depth[b] = t_b (int64).
 *   q_depth [B,H,Lq,D], k_depth [B,H,Lk,D], policy_logits [B,D] (dtype)
 *   logits  [B,H,Lq,Lk] (dtype), depth [B] int64
 * Only the selected depth slice of q_depth/k_depth is read.
 */
#ifndef ATTNX_MAW_DEPTH_SELECT_KERNEL_H
#define ATTNX_MAW_DEPTH_SELECT_KERNEL_H

#include "common/kernel_abi.h"

#ifdef __cplusplus
extern "C" {
#endif

ATTNX_API int attnx_maw_depth_select(int dtype, void const* q_depth, void const* k_depth,
    void const* policy_logits, void* logits, int64_t* depth, int64_t B, int64_t H, int64_t Lq,
    int64_t Lk, int64_t D, float scale, void* stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ATTNX_MAW_DEPTH_SELECT_KERNEL_H */
