"""ctypes bindings of the plugin library's CUDA kernels (C ABI in ``common/attnx_kernels.h``).

For tests and benchmarks: call the same kernels the TensorRT plugins run, on PyTorch CUDA
tensors, without TensorRT::

    from attnx.plugins import kernels
    logits, depth = kernels.maw_depth_select(q_depth, k_depth, policy_logits, scale)
    q_sel, k_sel, depth = kernels.maw_depth_gather(q_depth, k_depth, policy_logits)
    dist = kernels.tta_distance(q, k, trace)

Launches are asynchronous on the current PyTorch CUDA stream (like a PyTorch op). Inputs must
be contiguous (a TensorRT plugin always receives dense linear tensors); a strided view is
refused with a message naming it (call ``.contiguous()`` first). The raw functions
(:class:`KernelLibrary`) take device pointers, sizes and a stream handle.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

DTYPE_FP32 = 0
DTYPE_FP16 = 1
ABI_VERSION = 2

_c_int64 = ctypes.c_int64
_c_ptr = ctypes.c_void_p


class KernelError(RuntimeError):
    """A kernel call returned a CUDA error code."""


class KernelLibrary:
    """The C ABI of ``libattnx_plugins.so`` with exact ctypes signatures."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lib = ctypes.CDLL(str(self.path))
        lib = self._lib
        lib.attnx_kernels_abi_version.argtypes = []
        lib.attnx_kernels_abi_version.restype = ctypes.c_int
        version = lib.attnx_kernels_abi_version()
        if version != ABI_VERSION:
            raise KernelError(f"{self.path} has kernel ABI {version}, these bindings expect {ABI_VERSION}; rebuild "
                              "with `attnx plugins build`")
        # int attnx_maw_depth_select(int dtype, const void* q, const void* k, const void* policy, void* logits,
        #     int64_t* depth, int64_t B, int64_t H, int64_t Lq, int64_t Lk, int64_t D, float scale, void* stream)
        lib.attnx_maw_depth_select.argtypes = [ctypes.c_int, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_int64,
                                               _c_int64, _c_int64, _c_int64, _c_int64, ctypes.c_float, _c_ptr]
        lib.attnx_maw_depth_select.restype = ctypes.c_int
        # int attnx_maw_depth_gather(int dtype, const void* q, const void* k, const void* policy, void* q_sel,
        #     void* k_sel, int64_t* depth, int64_t B, int64_t H, int64_t Lq, int64_t Lk, int64_t D, void* stream)
        lib.attnx_maw_depth_gather.argtypes = [ctypes.c_int] + [_c_ptr] * 6 + [_c_int64] * 5 + [_c_ptr]
        lib.attnx_maw_depth_gather.restype = ctypes.c_int
        # size_t attnx_tta_distance_workspace_size(int64_t B, H, Bt, Ht, Lq, Lk, Dh)
        lib.attnx_tta_distance_workspace_size.argtypes = [_c_int64] * 7
        lib.attnx_tta_distance_workspace_size.restype = ctypes.c_size_t
        # int attnx_tta_distance(int dtype, const void* q, const void* k, const void* trace, void* dist,
        #     int64_t B, H, Bt, Ht, Lq, Lk, Dh, void* workspace, size_t workspace_size, void* stream)
        lib.attnx_tta_distance.argtypes = [ctypes.c_int, _c_ptr, _c_ptr, _c_ptr, _c_ptr] + [_c_int64] * 7 + [
            _c_ptr, ctypes.c_size_t, _c_ptr]
        lib.attnx_tta_distance.restype = ctypes.c_int

    def maw_depth_select(self, dtype: int, q_depth: int, k_depth: int, policy_logits: int, logits: int, depth: int,
                         B: int, H: int, Lq: int, Lk: int, D: int, scale: float, stream: int | None = None) -> int:
        return self._lib.attnx_maw_depth_select(dtype, q_depth, k_depth, policy_logits, logits, depth, B, H, Lq, Lk, D,
                                                scale, stream)

    def maw_depth_gather(self, dtype: int, q_depth: int, k_depth: int, policy_logits: int, q_sel: int, k_sel: int,
                         depth: int, B: int, H: int, Lq: int, Lk: int, D: int, stream: int | None = None) -> int:
        return self._lib.attnx_maw_depth_gather(dtype, q_depth, k_depth, policy_logits, q_sel, k_sel, depth, B, H, Lq,
                                                Lk, D, stream)

    def tta_distance_workspace_size(self, B: int, H: int, Bt: int, Ht: int, Lq: int, Lk: int, Dh: int) -> int:
        return int(self._lib.attnx_tta_distance_workspace_size(B, H, Bt, Ht, Lq, Lk, Dh))

    def tta_distance(self, dtype: int, q: int, k: int, trace: int, dist: int, B: int, H: int, Bt: int, Ht: int,
                     Lq: int, Lk: int, Dh: int, workspace: int, workspace_size: int, stream: int | None = None) -> int:
        return self._lib.attnx_tta_distance(dtype, q, k, trace, dist, B, H, Bt, Ht, Lq, Lk, Dh, workspace,
                                            workspace_size, stream)


@functools.lru_cache(maxsize=None)
def _load_cached(path: str) -> KernelLibrary:
    return KernelLibrary(path)


def load(path: str | os.PathLike | None = None) -> KernelLibrary:
    """The kernels of the given (default: the built) plugin library."""
    if path is None:
        from attnx.plugins import require_library

        path = require_library()
    return _load_cached(str(Path(path).resolve()))


# ------------------------------------------------------------------------------------ torch wrappers


def _dtype_code(t) -> int:
    import torch

    if t.dtype == torch.float32:
        return DTYPE_FP32
    if t.dtype == torch.float16:
        return DTYPE_FP16
    raise TypeError(f"attnx kernels take float32 or float16 tensors, got {t.dtype}")


def _check(tensors: dict, dtype) -> None:
    for name, t in tensors.items():
        if not t.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor")
        if t.dtype != dtype:
            raise TypeError(f"{name} is {t.dtype} but the inputs are {dtype}: one dtype for all float tensors")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (strides {tuple(t.stride())} for shape {tuple(t.shape)}); "
                             "the kernels, like the TensorRT plugins, take dense row-major tensors: pass "
                             f"{name}.contiguous()")


def _stream(device, stream) -> int | None:
    import torch

    if stream is None:
        return torch.cuda.current_stream(device).cuda_stream
    return getattr(stream, "cuda_stream", stream)


def _maw_inputs(q_depth, k_depth, policy_logits) -> tuple[int, int, int, int, int]:
    """B, H, Lq, Lk, D of MawDepthSelect / MawDepthGather inputs (checked)."""
    if q_depth.dim() != 4 or k_depth.dim() != 4 or policy_logits.dim() != 2:
        raise ValueError("q_depth and k_depth must be rank 4 and policy_logits rank 2")
    B, H, Lq, D = q_depth.shape
    if k_depth.shape[0] != B or k_depth.shape[1] != H or k_depth.shape[3] != D or tuple(policy_logits.shape) != (B, D):
        raise ValueError(f"inconsistent shapes q_depth {tuple(q_depth.shape)}, k_depth {tuple(k_depth.shape)}, "
                         f"policy_logits {tuple(policy_logits.shape)}")
    _check({"q_depth": q_depth, "k_depth": k_depth, "policy_logits": policy_logits}, q_depth.dtype)
    return B, H, Lq, k_depth.shape[2], D


def _output(out, shape, like, name: str):
    import torch

    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    _check({name: out}, like.dtype)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} must be {list(shape)}, got {list(out.shape)}")
    return out


def _depth_output(depth, B: int, device):
    import torch

    if depth is None:
        return torch.empty((B,), dtype=torch.int64, device=device)
    if tuple(depth.shape) != (B,) or depth.dtype != torch.int64 or not depth.is_contiguous():
        raise ValueError("depth must be a contiguous [B] int64 tensor")
    return depth


def maw_depth_select(q_depth, k_depth, policy_logits, scale: float, *, out=None, depth=None, stream=None,
                     library: KernelLibrary | None = None):
    """MawDepthSelect on CUDA tensors: q_depth [B,H,Lq,d], k_depth [B,H,Lk,d], policy_logits [B,d]
    -> (logits [B,H,Lq,Lk] in the input dtype, depth [B] int64)."""
    lib = library or load()
    B, H, Lq, Lk, D = _maw_inputs(q_depth, k_depth, policy_logits)
    out = _output(out, (B, H, Lq, Lk), q_depth, "out")
    depth = _depth_output(depth, B, q_depth.device)
    status = lib.maw_depth_select(_dtype_code(q_depth), q_depth.data_ptr(), k_depth.data_ptr(),
                                  policy_logits.data_ptr(), out.data_ptr(), depth.data_ptr(), B, H, Lq, Lk, D,
                                  float(scale), _stream(q_depth.device, stream))
    if status != 0:
        raise KernelError(f"attnx_maw_depth_select failed with cudaError {status}")
    return out, depth


def maw_depth_gather(q_depth, k_depth, policy_logits, *, q_sel=None, k_sel=None, depth=None, stream=None,
                     library: KernelLibrary | None = None):
    """MawDepthGather on CUDA tensors: q_depth [B,H,Lq,d], k_depth [B,H,Lk,d], policy_logits [B,d]
    -> (q_sel [B,H,Lq,1], k_sel [B,H,Lk,1] in the input dtype, depth [B] int64): the argmax depth's
    columns, whose outer product q_sel k_sel^T is that depth's logits (unscaled)."""
    lib = library or load()
    B, H, Lq, Lk, D = _maw_inputs(q_depth, k_depth, policy_logits)
    q_sel = _output(q_sel, (B, H, Lq, 1), q_depth, "q_sel")
    k_sel = _output(k_sel, (B, H, Lk, 1), q_depth, "k_sel")
    depth = _depth_output(depth, B, q_depth.device)
    status = lib.maw_depth_gather(_dtype_code(q_depth), q_depth.data_ptr(), k_depth.data_ptr(),
                                  policy_logits.data_ptr(), q_sel.data_ptr(), k_sel.data_ptr(), depth.data_ptr(), B, H,
                                  Lq, Lk, D, _stream(q_depth.device, stream))
    if status != 0:
        raise KernelError(f"attnx_maw_depth_gather failed with cudaError {status}")
    return q_sel, k_sel, depth


def tta_distance(q, k, trace, *, out=None, stream=None, library: KernelLibrary | None = None):
    """TtaDistance on CUDA tensors: q [B,H,Lq,Dh], k [B,H,Lk,Dh], trace [B|1,H|1,Dh,Dh]
    (also [B,Dh,Dh] or [Dh,Dh]) -> dist [B,H,Lq,Lk] in the input dtype."""
    import torch

    lib = library or load()
    if trace.dim() == 2:
        trace = trace[None, None]
    elif trace.dim() == 3:
        trace = trace[:, None]
    if q.dim() != 4 or k.dim() != 4 or trace.dim() != 4:
        raise ValueError("q, k must be rank 4 and trace rank 2, 3 or 4")
    B, H, Lq, Dh = q.shape
    Lk = k.shape[2]
    Bt, Ht = trace.shape[0], trace.shape[1]
    if (k.shape[0], k.shape[1], k.shape[3]) != (B, H, Dh) or tuple(trace.shape[2:]) != (Dh, Dh) \
            or Bt not in (1, B) or Ht not in (1, H):
        raise ValueError(f"inconsistent shapes q {tuple(q.shape)}, k {tuple(k.shape)}, trace {tuple(trace.shape)}")
    trace = trace.contiguous()
    _check({"q": q, "k": k, "trace": trace}, q.dtype)
    code = _dtype_code(q)
    device = q.device
    out = _output(out, (B, H, Lq, Lk), q, "out")
    ws_size = lib.tta_distance_workspace_size(B, H, Bt, Ht, Lq, Lk, Dh)
    # The caching allocator returns 512-byte aligned blocks (the kernels need 256).
    workspace = torch.empty((max(ws_size, 1),), dtype=torch.uint8, device=device)
    status = lib.tta_distance(code, q.data_ptr(), k.data_ptr(), trace.data_ptr(), out.data_ptr(), B, H, Bt, Ht, Lq,
                              Lk, Dh, workspace.data_ptr(), ws_size, _stream(device, stream))
    if status != 0:
        raise KernelError(f"attnx_tta_distance failed with cudaError {status}")
    return out
