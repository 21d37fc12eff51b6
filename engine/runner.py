"""Run engines: :class:`Engine` (deserialize a plan, run numpy feeds), :func:`load_engine`, and
:func:`runnable_here` (whether an engine built for a target can run on this machine).

An engine runs on a GPU of the architecture it was built for (an RTX engine for sm89 runs on
sm89 only); elsewhere :class:`EngineUnavailable` says why. The attnx plugin library is loaded
before deserializing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from attnx.engine.cuda import DeviceBuffer, cuda, gpu_compute_capability
from attnx.engine.discovery import backend
from attnx.engine.errors import EngineUnavailable, PluginLoadError, TensorRTUnavailable, one_line, unique
from attnx.engine.logger import get_logger
from attnx.engine.plugins import load_plugins

_log = logging.getLogger("attnx.tensorrt")


@dataclass(frozen=True)
class IOTensor:
    name: str
    is_input: bool
    dtype: np.dtype
    shape: tuple[int, ...]  # -1 for dynamic dims


class Engine:
    """A deserialized engine with one execution context; :meth:`run` is thread-safe (serialized).

    ``plugins``: True = the built attnx plugin library (a warning when it is missing), a path, or False."""

    def __init__(self, plan: bytes, *, plugins: str | os.PathLike | bool | None = True, name: str = "engine"):
        info = backend()
        trt = info.module
        self.name = name
        rt = cuda()
        cc = rt.compute_capability() if rt is not None else None
        if cc is None:
            raise EngineUnavailable(f"cannot run {name}: no CUDA GPU (or driver) on this machine; {info.describe()} "
                                    "engines run on a GPU of the architecture they were built for")
        self._cuda = rt
        self.plugins = None
        if plugins:
            try:
                self.plugins = load_plugins(None if plugins is True else plugins)
            except PluginLoadError:
                if plugins is not True:
                    raise
                _log.warning("attnx plugin library not loaded: engines with attnx plugin layers will fail")
        logger = get_logger()
        self._logger = logger
        mark = logger.mark()
        self._runtime = trt.Runtime(logger.native)
        self._engine = self._runtime.deserialize_cuda_engine(bytes(plan))
        if self._engine is None:
            errors = unique(logger.messages(mark))
            raise EngineUnavailable(f"{info.describe()} could not load {name} on this GPU (sm{cc[0]}{cc[1]}): "
                                    + (" | ".join(errors) if errors else "unknown reason")
                                    + " (was it built for another GPU architecture or TensorRT version?)")
        self._context = self._engine.create_execution_context()
        if self._context is None:
            raise EngineUnavailable(f"could not create an execution context for {name}: "
                                    + " | ".join(unique(logger.messages(mark))))
        self.io_tensors: list[IOTensor] = []
        for i in range(self._engine.num_io_tensors):
            tname = self._engine.get_tensor_name(i)
            is_input = self._engine.get_tensor_mode(tname) == trt.TensorIOMode.INPUT
            dtype = np.dtype(trt.nptype(self._engine.get_tensor_dtype(tname)))
            self.io_tensors.append(IOTensor(tname, is_input, dtype, tuple(self._engine.get_tensor_shape(tname))))
        self._buffers = {t.name: DeviceBuffer(rt) for t in self.io_tensors}
        stream = ctypes.c_void_p(0)
        rt.check(rt.lib.cudaStreamCreate(ctypes.byref(stream)), "cudaStreamCreate")
        self._stream = stream
        self._lock = threading.Lock()

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.io_tensors if t.is_input]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.io_tensors if not t.is_input]

    def _copy(self, dst: int, src: int, nbytes: int, kind: int, what: str) -> None:
        if nbytes:
            self._cuda.check(self._cuda.lib.cudaMemcpyAsync(dst, src, nbytes, kind, self._stream), what)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run once: named numpy inputs (cast to the engine's dtypes) -> named numpy outputs."""
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise ValueError(f"missing inputs: {', '.join(missing)} (engine inputs: {', '.join(self.input_names)})")
        rt = self._cuda
        with self._lock:
            hosts: dict[str, np.ndarray] = {}
            for t in self.io_tensors:
                if not t.is_input:
                    continue
                arr = np.ascontiguousarray(np.asarray(feeds[t.name]), dtype=t.dtype)
                if not self._context.set_input_shape(t.name, arr.shape):
                    raise ValueError(f"input {t.name!r} shape {arr.shape} is outside the engine's optimization profile "
                                     f"or does not fit its shape {t.shape}")
                ptr = self._buffers[t.name].ensure(arr.nbytes)
                hosts[t.name] = arr
                self._copy(ptr, arr.ctypes.data, arr.nbytes, rt.H2D, "cudaMemcpyAsync (to device)")
                self._context.set_tensor_address(t.name, ptr)
            outputs: dict[str, np.ndarray] = {}
            for t in self.io_tensors:
                if t.is_input:
                    continue
                shape = tuple(self._context.get_tensor_shape(t.name))
                if any(d < 0 for d in shape):
                    raise RuntimeError(f"output {t.name!r} has an unresolved shape {shape}")
                out = np.empty(shape, dtype=t.dtype)
                self._context.set_tensor_address(t.name, self._buffers[t.name].ensure(out.nbytes))
                outputs[t.name] = out
            mark = self._logger.mark()
            if not self._context.execute_async_v3(self._stream.value or 0):
                raise RuntimeError(f"{self.name}: enqueue failed: " + " | ".join(unique(self._logger.messages(mark))))
            for name, out in outputs.items():
                self._copy(out.ctypes.data, self._buffers[name].ptr, out.nbytes, rt.D2H, "cudaMemcpyAsync (to host)")
            rt.check(rt.lib.cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")
            hosts.clear()  # the host inputs had to stay alive until the stream finished
            return outputs

    def close(self) -> None:
        with self._lock:
            for b in self._buffers.values():
                b.free()
            if self._stream.value:
                self._cuda.lib.cudaStreamDestroy(self._stream)
                self._stream = ctypes.c_void_p(0)

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


def deserialize(plan: bytes | str | os.PathLike, *, plugins: str | os.PathLike | bool | None = True) -> Engine:
    """An :class:`Engine` from plan bytes or an engine file."""
    if isinstance(plan, (bytes, bytearray, memoryview)):
        return Engine(bytes(plan), plugins=plugins)
    path = Path(plan)
    if not path.is_file():
        raise FileNotFoundError(f"no engine file at {path}")
    return Engine(path.read_bytes(), plugins=plugins, name=path.name)


def load_engine(path: str | os.PathLike, *, plugins: str | os.PathLike | bool | None = True) -> Engine:
    """The engine file at ``path`` (what serving's engine session loads)."""
    return deserialize(Path(path), plugins=plugins)


def runnable_here(sidecar: Mapping | None) -> tuple[bool, str]:
    """Whether an engine with this sidecar can run on this machine: ``(True, "")`` or ``(False, why)``."""
    try:
        info = backend()
    except TensorRTUnavailable as e:
        return False, f"no TensorRT installed here ({one_line(e)})"
    cc = gpu_compute_capability()
    if cc is None:
        return False, f"no CUDA GPU on this machine ({info.describe()} engines run on the GPU they were built for)"
    local = f"sm{cc[0]}{cc[1]}"
    target = (sidecar or {}).get("target")
    if target and target not in (local, "local"):
        return False, f"the engine was built for {target} and this GPU is {local}"
    if sidecar and sidecar.get("backend") and sidecar["backend"] != info.name:
        return False, f"the engine was built with {sidecar['backend']} and this machine has {info.name}"
    return True, ""
