/*
 * attnx CUDA kernels behind a small C ABI: every op's entry points in one include.
 *
 * Used by the TensorRT plugins and callable directly (ctypes) so the kernels can be tested
 * against the PyTorch reference without TensorRT (attnx.plugins.kernels). Conventions in
 * common/kernel_abi.h; each op's contract in its own header.
 */
#ifndef ATTNX_KERNELS_H
#define ATTNX_KERNELS_H

#include "common/kernel_abi.h"
#include "maw_depth_gather/maw_depth_gather_kernel.h"
#include "maw_depth_select/maw_depth_select_kernel.h"
#include "tta_distance/tta_distance_kernel.h"

#endif /* ATTNX_KERNELS_H */
