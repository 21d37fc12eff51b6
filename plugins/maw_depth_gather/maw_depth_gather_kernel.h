/*
 * MawDepthGather kernel, C ABI (conventions: common/kernel_abi.h).
 *
 * t_b = argmax_t policy_logits[b, t] (first maximum on ties, NaN wins like torch.argmax),
 * q_sel[b,h,i,0] = q_depth[b,h,i,t_b], k_sel[b,h,j,0] = k_depth[b,h,j,t_b], depth[b] = t_b.
 *   q_depth [B,H,Lq,D], k_depth [B,H,Lk,D], policy_logits [B,D] (dtype)
 *   q_sel [B,H,Lq,1], k_sel [B,H,Lk,1] (dtype), depth [B] int64
 * The selected depth's logits are rank one (q_sel k_sel^T), so a standard attention with a
 * query/key head size of 1 does the rest; this op only selects the columns.
 */
#ifndef ATTNX_MAW_DEPTH_GATHER_KERNEL_H
#define ATTNX_MAW_DEPTH_GATHER_KERNEL_H

#include "common/kernel_abi.h"

#ifdef __cplusplus
extern "C" {
#endif

ATTNX_API int attnx_maw_depth_gather(int dtype, void const* q_depth, void const* k_depth,
    void const* policy_logits, void* q_sel, void* k_sel, int64_t* depth, int64_t B, int64_t H,
    int64_t Lq, int64_t Lk, int64_t D, void* stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ATTNX_MAW_DEPTH_GATHER_KERNEL_H */
