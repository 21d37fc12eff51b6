/*
 * The conventions every attnx kernel's C ABI shares: export macro, dtype codes, ABI version.
 * Each op declares its own entry points in <op>/<op>_kernel.h; common/attnx_kernels.h
 * includes them all.
 *
 *  - All tensors are dense, row-major ("linear"), on the device.
 *  - `dtype` is ATTNX_DTYPE_FP32 or ATTNX_DTYPE_FP16 for every floating tensor of a call;
 *    arithmetic is done in fp32.
 *  - `stream` is a cudaStream_t passed as void* (NULL = the legacy default stream).
 *  - The return value is a cudaError_t as int: 0 = launched; errors from bad arguments
 *    are cudaErrorInvalidValue (1). Launches are asynchronous; nothing synchronizes.
 */
#ifndef ATTNX_KERNEL_ABI_H
#define ATTNX_KERNEL_ABI_H

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

/* C ABI version, bumped on any signature or contract change (checked by the Python bindings).
 * 2: attnx_maw_depth_gather added; TtaDistance's workspace no longer holds S, qS. */
#define ATTNX_KERNELS_ABI_VERSION 2
ATTNX_API int attnx_kernels_abi_version(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ATTNX_KERNEL_ABI_H */
