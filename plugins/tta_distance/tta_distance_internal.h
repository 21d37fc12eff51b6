// TtaDistance internals: the launches that live in their own kernel files (host side; the
// device pieces they share are in tta_mma_tiles.cuh).
#ifndef ATTNX_TTA_DISTANCE_INTERNAL_H
#define ATTNX_TTA_DISTANCE_INTERNAL_H

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace attnx
{
namespace kernels
{

//! Launch 1: kS (fp32 into kS32, or fp16 hi/lo into kSHi/kSLo; the other pointer(s) null) for
//! every k row, qq for every q row, kk for every k row. cudaError as int.
template <typename T>
int launchTtaPrep(T const* q, T const* k, T const* trace, float* kS32, __half* kSHi, __half* kSLo, float* qq,
    float* kk, int64_t B, int64_t H, int64_t Bt, int64_t Ht, int64_t Lq, int64_t Lk, int64_t Dh, cudaStream_t stream);

//! Launch 1 for fp16 with Dh <= 64, Dh a multiple of 8 and 16-byte aligned q, k and trace
//! (tta_prep_fp16_kernel.cu): the same outputs (kS as hi/lo, qq, kk) with one trip to memory.
bool ttaFp16FastPrepApplies(void const* q, void const* k, void const* trace, int64_t Dh);
int launchTtaPrepFp16(__half const* q, __half const* k, __half const* trace, __half* kSHi, __half* kSLo, float* qq,
    float* kk, int64_t B, int64_t H, int64_t Bt, int64_t Ht, int64_t Lq, int64_t Lk, int64_t Dh, cudaStream_t stream);

//! The fp16 distance pass for Dh <= 64, Dh a multiple of 8 and 16-byte aligned q
//! (tta_distance_fp16_kernel.cu): A fragments kept in registers over several k tiles. Launched
//! as a programmatic dependent of the prep launch before it on `stream` (sm_90+).
bool ttaFp16FastPathApplies(void const* q, int64_t Dh);
int launchTtaDistanceFp16(__half const* q, __half const* kSHi, __half const* kSLo, float const* qq, float const* kk,
    __half* dist, int64_t BH, int64_t M, int64_t N, int64_t Dh, cudaStream_t stream);


} // namespace kernels
} // namespace attnx

#endif // ATTNX_TTA_DISTANCE_INTERNAL_H
