// The library-wide C ABI version (common/kernel_abi.h), checked by attnx.plugins.kernels.
#include "common/kernel_abi.h"

extern "C" ATTNX_API int attnx_kernels_abi_version(void)
{
    return ATTNX_KERNELS_ABI_VERSION;
}
