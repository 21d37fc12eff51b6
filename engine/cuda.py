"""Just enough of the CUDA runtime (libcudart through ctypes) for engines: device count, compute
capability, device buffers, a stream and copies. No CUDA Python package is needed; without a
driver or GPU :func:`cuda` is None and :func:`gpu_compute_capability` None.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import logging
import os
import sys

_log = logging.getLogger("attnx.tensorrt")


class CudaRuntime:
    """libcudart's functions with their ctypes signatures."""

    H2D = 1
    D2H = 2

    def __init__(self):
        self.lib = self._load()
        lib = self.lib
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.cudaGetDeviceCount.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cudaGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cudaDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        lib.cudaMalloc.argtypes = [ctypes.POINTER(vp), sz]
        lib.cudaFree.argtypes = [vp]
        lib.cudaMemcpyAsync.argtypes = [vp, vp, sz, ctypes.c_int, vp]
        lib.cudaStreamCreate.argtypes = [ctypes.POINTER(vp)]
        lib.cudaStreamSynchronize.argtypes = [vp]
        lib.cudaStreamDestroy.argtypes = [vp]
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        for fn in ("cudaGetDeviceCount", "cudaGetDevice", "cudaDeviceGetAttribute", "cudaMalloc", "cudaFree",
                   "cudaMemcpyAsync", "cudaStreamCreate", "cudaStreamSynchronize", "cudaStreamDestroy"):
            getattr(lib, fn).restype = ctypes.c_int

    @staticmethod
    def _load():
        names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
        found = ctypes.util.find_library("cudart")
        if found:
            names.append(found)
        for name in names:
            try:
                return ctypes.CDLL(name)
            except OSError:
                continue
        # The nvidia-cuda-runtime wheels (nvidia/cu13/lib, nvidia/cuda_runtime/lib).
        for base in sys.path:
            for pattern in ("nvidia/cu1*/lib/libcudart.so.*", "nvidia/cuda_runtime/lib/libcudart.so.*"):
                for candidate in sorted(glob.glob(os.path.join(base, pattern)), reverse=True):
                    try:
                        return ctypes.CDLL(candidate)
                    except OSError:
                        continue
        raise OSError("libcudart not found (install the CUDA runtime, e.g. `pip install nvidia-cuda-runtime`)")

    def check(self, status: int, what: str) -> None:
        if status != 0:
            msg = self.lib.cudaGetErrorString(status)
            raise RuntimeError(f"{what} failed: cudaError {status} ({msg.decode() if msg else '?'})")

    def device_count(self) -> int:
        n = ctypes.c_int(0)
        return n.value if self.lib.cudaGetDeviceCount(ctypes.byref(n)) == 0 else 0

    def compute_capability(self) -> tuple[int, int] | None:
        if self.device_count() < 1:
            return None
        dev = ctypes.c_int(0)
        self.lib.cudaGetDevice(ctypes.byref(dev))
        major, minor = ctypes.c_int(0), ctypes.c_int(0)
        if self.lib.cudaDeviceGetAttribute(ctypes.byref(major), 75, dev.value) != 0:  # ComputeCapabilityMajor
            return None
        if self.lib.cudaDeviceGetAttribute(ctypes.byref(minor), 76, dev.value) != 0:  # ComputeCapabilityMinor
            return None
        return major.value, minor.value


_cudart: CudaRuntime | None = None


def cuda() -> CudaRuntime | None:
    """The CUDA runtime, loaded once; None where libcudart cannot be loaded."""
    global _cudart
    if _cudart is None:
        try:
            _cudart = CudaRuntime()
        except OSError as e:
            _log.debug("no CUDA runtime: %s", e)
            return None
    return _cudart


def gpu_compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the current CUDA device, or None without a usable GPU/driver."""
    rt = cuda()
    return rt.compute_capability() if rt is not None else None


class DeviceBuffer:
    """A device allocation that grows on demand (freed by :meth:`free`)."""

    def __init__(self, rt: CudaRuntime):
        self.cuda = rt
        self.ptr = ctypes.c_void_p(0)
        self.size = 0

    def ensure(self, nbytes: int) -> int:
        if nbytes > self.size:
            self.free()
            cap = max(nbytes, 256)
            self.cuda.check(self.cuda.lib.cudaMalloc(ctypes.byref(self.ptr), cap), "cudaMalloc")
            self.size = cap
        return self.ptr.value or 0

    def free(self) -> None:
        if self.ptr.value:
            self.cuda.lib.cudaFree(self.ptr)
        self.ptr = ctypes.c_void_p(0)
        self.size = 0
