"""ONNX Runtime: :class:`OrtOptions`, :func:`ort_providers`, :class:`OnnxRuntimeSession` (an ``.onnx``
file), and :func:`onnx_io_specs` (a file's I/O specs without creating a session).

attnx custom ops need nothing here: every one carries a model-local function that ONNX Runtime inlines.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from attnx.contract import ModelInfo, graph_io, load_onnx
from attnx.runtime.core.session import FileSpec, Session, TensorSpec, merge_specs

#: ONNX Runtime type strings -> numpy dtypes (the ones attnx models use, plus the usual).
_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int16)": np.int16,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(uint16)": np.uint16,
    "tensor(uint32)": np.uint32,
    "tensor(uint64)": np.uint64,
    "tensor(bool)": np.bool_,
}


def default_threads() -> int:
    """CPUs this process may use (affinity-aware; containers often restrict it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def ort_providers(device: str = "auto") -> list[str]:
    """Execution providers for ``device``: ``cpu``, ``cuda`` (must exist), or ``auto`` (CUDA when present)."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if device == "cuda":
        if "CUDAExecutionProvider" not in available:
            raise RuntimeError(
                "device 'cuda' asked for, but this onnxruntime has no CUDAExecutionProvider "
                "(install onnxruntime-gpu in place of onnxruntime)"
            )
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if device == "auto":
        if "CUDAExecutionProvider" in available:
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]
        return ["CPUExecutionProvider"]
    raise ValueError(f"unknown device {device!r} (cpu, cuda or auto)")


@dataclass
class OrtOptions:
    """ONNX Runtime settings a service cares about; the defaults are what ``benchmarks/bench_ort_settings.py`` measured
    best or equal (docs/performance.md). Override through ``attnx.runtime.load(path, **options)``.

    - ``threads``: intra-op threads (default: the CPUs this process may use).
    - ``inter_threads``: inter-op threads (default 1: the graph runs sequentially; an encoder is a chain, parallel
      branches are rare, and more pools only compete for the same cores).
    - ``spin``: let idle pool threads busy-wait. Off by default: a served model is idle between batches, and spinning
      threads would steal the cores the HTTP front end and the other models need (measured: no faster when busy,
      either).
    - ``optimization``: graph optimization level (``all``, ``extended``, ``basic``, ``none``).
    - ``arena``: ORT's CPU memory arena (default on: buffers are reused between calls; off returns them to the system
      after each call, for a lower resident footprint at some latency).
    - ``mem_pattern``: pre-plan buffers from the first call's shapes (default on).
    - ``disabled_optimizers``: ORT graph rewrites to skip. Default ``SkipLayerNormFusion``: its fused CPU kernel was
      slower than the LayerNormalization + Add it replaces on the BERT exports (all-MiniLM-L6-v2 fp32: 1.06-1.14x
      faster at 8x128 without it, 1.05-1.07x at 1x128; int8 files unchanged). ``()`` runs every rewrite of the level.
    - ``denormal_as_zero``: ORT's pool threads flush denormal floats to zero (FTZ/DAZ). Default on: softmax over wide
      logits (SMAL's distances) underflows into denormals, which x86 computes with microcode assists (measured: a SMAL
      encoder 1.79x faster at 8x512, MiniLM 1.03-1.11x). Values below 1.2e-38 become 0. ORT's intra-op work also runs
      on the calling thread, so :class:`OnnxRuntimeSession` flushes there too for the length of each run
      (:func:`denormals_flushed`), and restores the thread's mode after it. ORT alone would set it for good on the
      thread that creates the session; attnx restores that thread too.
    - ``decoder_fusions``: a with-past export on the CPU runs rewritten with ONNX Runtime's fused operators (the file
      is not changed; :mod:`attnx.runtime.core.ort_fusions`). On unless ``ATTNX_DECODER_FUSIONS=0``.
    """

    device: str = "auto"
    threads: int | None = None
    inter_threads: int = 1
    spin: bool = False
    optimization: str = "all"
    arena: bool = True
    mem_pattern: bool = True
    disabled_optimizers: tuple[str, ...] = ("SkipLayerNormFusion",)
    denormal_as_zero: bool = True
    extra_session_config: dict[str, str] = field(default_factory=dict)
    log_severity: int = 2  # the session's ONNX Runtime log level (2: its default, warnings; decoders run at 3)
    decoder_fusions: bool = field(default_factory=lambda: os.environ.get("ATTNX_DECODER_FUSIONS") != "0")

    _LEVELS = ("all", "extended", "basic", "none")

    def __post_init__(self):
        if self.optimization not in self._LEVELS:
            raise ValueError(f"optimization {self.optimization!r}: valid: {', '.join(self._LEVELS)}")
        for name in ("threads", "inter_threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def session_options(self):
        """These options as an ``onnxruntime.SessionOptions``."""
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = self.threads or default_threads()
        so.inter_op_num_threads = self.inter_threads
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL if self.inter_threads == 1 else \
            ort.ExecutionMode.ORT_PARALLEL
        so.enable_cpu_mem_arena = self.arena
        so.enable_mem_pattern = self.mem_pattern
        so.graph_optimization_level = {
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        }[self.optimization]
        if not self.spin:
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            so.add_session_config_entry("session.inter_op.allow_spinning", "0")
        if self.denormal_as_zero:
            so.add_session_config_entry("session.set_denormal_as_zero", "1")
        for k, v in self.extra_session_config.items():
            so.add_session_config_entry(k, v)
        so.log_severity_level = self.log_severity
        return so

    def inference_session(self, path: str | os.PathLike, providers=None, model_bytes: bytes | None = None):
        """An ``onnxruntime.InferenceSession`` of ``path`` (or of ``model_bytes``, its rewrite) with these options."""
        import onnxruntime as ort

        options = self.session_options()
        if model_bytes is not None:  # its external data: beside the file
            options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                             str(Path(path).parent))
        with _callers_fp_mode_kept():
            return ort.InferenceSession(model_bytes if model_bytes is not None else str(path), sess_options=options,
                                        providers=providers or ort_providers(self.device),
                                        disabled_optimizers=list(self.disabled_optimizers))


_FTZ_DAZ = 0x8040  # MXCSR flush-to-zero (bit 15) | denormals-are-zero (bit 6)
_MXCSR_OFFSET = 28  # of __mxcsr in the x86-64 Linux fenv_t (glibc and musl; a stable ABI)


@lru_cache(maxsize=1)
def _libm():
    name = ctypes.util.find_library("m")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


@contextmanager
def _callers_fp_mode_kept(flush: bool = False):
    """Restore this thread's C floating-point environment (``fegetenv``/``fesetenv`` through ctypes)
    after the block; ``flush``: set FTZ/DAZ for the block (x86-64 Linux only: the fenv_t layout is known
    there). A no-op where libm is not found."""
    libm = _libm()
    env = ctypes.create_string_buffer(256)  # fenv_t: 32 bytes on x86-64 glibc, 8 on aarch64
    saved = libm is not None and libm.fegetenv(env) == 0
    if saved and flush and sys.platform.startswith("linux") and platform.machine() == "x86_64":
        flushing = ctypes.create_string_buffer(env.raw, len(env))
        mxcsr = int.from_bytes(flushing.raw[_MXCSR_OFFSET:_MXCSR_OFFSET + 4], "little") | _FTZ_DAZ
        ctypes.memmove(ctypes.addressof(flushing) + _MXCSR_OFFSET, mxcsr.to_bytes(4, "little"), 4)
        libm.fesetenv(flushing)
    try:
        yield
    finally:
        if saved:
            libm.fesetenv(env)


def denormals_flushed():
    """A context in which this thread flushes denormal floats to zero, as ORT's pool threads do with
    ``OrtOptions.denormal_as_zero``; the thread's own mode is restored after it."""
    return _callers_fp_mode_kept(flush=True)


class OnnxRuntimeSession(Session):
    """An ``.onnx`` model on ONNX Runtime. ``InferenceSession.run`` is thread-safe, so is this."""

    platform = "onnxruntime_onnx"

    def __init__(self, path: str | os.PathLike, options: OrtOptions | None = None):

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no model file at {self.path}")
        self.options = options or OrtOptions()
        providers = ort_providers(self.options.device)
        from attnx.runtime.core.decoding import decoding_options

        fused = None  # a with-past export on the CPU: ONNX Runtime's fused operators (attnx.runtime.core.ort_fusions)
        if self.options.decoder_fusions and providers == ["CPUExecutionProvider"] and decoding_options(self.path):
            from attnx.runtime.core.ort_fusions import session_graph

            fused = session_graph(self.path)
        self.fusions: dict[str, int] = fused[1] if fused else {}  # what was rewritten (empty: the file as written)
        self._sess = self.options.inference_session(self.path, providers, fused[0] if fused else None)
        self.provider = "onnxruntime:" + self._sess.get_providers()[0]
        self.metadata = dict(self._sess.get_modelmeta().custom_metadata_map)
        info = self.info
        _warn_if_int8_weights_clip(self.path, info)
        self.inputs = merge_specs(self._file_specs(self._sess.get_inputs()), info.inputs if info else None, True)
        self.outputs = merge_specs(self._file_specs(self._sess.get_outputs()), info.outputs if info else None, False)
        # the inputs with input_ids' batch axis, where a call must be split by rows (_run)
        batch = next((i.shape[0] for i in self._sess.get_inputs() if i.name == "input_ids" and i.shape), None)
        self._rows_alone = frozenset(i.name for i in self._sess.get_inputs() if i.shape and i.shape[0] == batch) \
            if self.fusions.get("grouped_query_attention") and isinstance(batch, str) else frozenset()

    def _file_specs(self, args) -> list[FileSpec]:
        out = []
        for a in args:
            if a.type not in _ORT_TYPES:
                raise ValueError(f"{self.path}: tensor {a.name!r} has unsupported type {a.type}")
            out.append((a.name, np.dtype(_ORT_TYPES[a.type]), list(a.shape)))
        return out

    def _run(self, feeds: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        ids = feeds.get("input_ids")
        if self._rows_alone and ids is not None and ids.ndim == 2 and ids.shape[0] > 1 and ids.shape[1] > 1:
            # GroupQueryAttention's CPU kernel takes several new tokens over a past for one row only (ort_attention)
            rows = [self._run_rows({k: v[r:r + 1] if k in self._rows_alone else v for k, v in feeds.items()},
                                   output_names) for r in range(ids.shape[0])]
            return {name: np.concatenate([row[name] for row in rows]) for name in output_names}
        return self._run_rows(feeds, output_names)

    def _run_rows(self, feeds: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        if self.options.denormal_as_zero:  # this thread does part of ORT's intra-op work
            with denormals_flushed():
                values = self._sess.run(output_names, feeds)
        else:
            values = self._sess.run(output_names, feeds)
        return dict(zip(output_names, values))

    @property
    def on_device(self) -> bool:
        """The session runs on CUDA (its outputs can stay there between runs: :meth:`run_keeping`)."""
        return self.provider.endswith("CUDAExecutionProvider")

    @property
    def in_place_cache(self) -> bool:
        """Each ``past`` input may share its buffer with its ``present`` output (the graph's attention writes the
        new slots into it: :mod:`attnx.runtime.core.kv_in_place`)."""
        return bool(self.fusions.get("cache_in_place"))

    def io_binding(self):
        """A new ``onnxruntime.IOBinding`` of this session (for :meth:`run_binding`)."""
        return self._sess.io_binding()

    def run_binding(self, binding) -> None:
        """One run of what ``binding`` binds (the caller's buffers are written in place)."""
        if self.options.denormal_as_zero:
            with denormals_flushed():
                self._sess.run_with_iobinding(binding)
        else:
            self._sess.run_with_iobinding(binding)

    def run_keeping(self, feeds: dict, output_names: list[str], keep) -> dict:
        """One run through ONNX Runtime's IOBinding, for a decoder's steps: numpy feeds are bound where they lie,
        ``OrtValue`` feeds (an earlier run's outputs) where they are; the outputs named in ``keep`` come back as
        ``OrtValue`` s on the session's device, to be fed to the next run as they are (a KV cache on CUDA never
        crosses to the host and back), the others as numpy. Feeds are not checked (:meth:`check_feeds` first)."""
        import onnxruntime as ort

        binding = self._sess.io_binding()
        for name, value in feeds.items():
            if isinstance(value, ort.OrtValue):
                binding.bind_ortvalue_input(name, value)
            else:
                binding.bind_cpu_input(name, value)
        device = "cuda" if self.on_device else "cpu"
        for name in output_names:
            binding.bind_output(name, device if name in keep else "cpu")
        if self.options.denormal_as_zero:
            with denormals_flushed():
                self._sess.run_with_iobinding(binding)
        else:
            self._sess.run_with_iobinding(binding)
        # on the CPU, .numpy() wraps ONNX Runtime's buffer (no copy); from CUDA it is the one copy to the host
        return {name: value if name in keep else value.numpy()
                for name, value in zip(output_names, binding.get_outputs())}

    def close(self) -> None:
        self._sess = None


def _warn_if_int8_weights_clip(path: Path, info: ModelInfo | None) -> None:
    """An int8 file with 8-bit weights on a CPU whose integer GEMM saturates them (attnx.runtime.core.cpu) runs,
    but less accurately than its ``attnx check``: say so once, at load."""
    from attnx.runtime.core.cpu import int8_dot_product, saturates_8bit_weights

    bits = (info.quantization or {}).get("weight_bits") if info is not None and info.precision == "int8" else None
    if bits == 8 and saturates_8bit_weights():
        warnings.warn(f"{path.name} has 8-bit int8 weights, and this CPU's integer dot product is "
                      f"{int8_dot_product()}: ONNX Runtime clips some products and embeddings lose accuracy; "
                      "re-export with --int8-weight-bits 7 for this CPU", RuntimeWarning, stacklevel=3)


def onnx_io_specs(path: str | os.PathLike) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """I/O specs read from an ONNX file's graph and metadata, without creating a session."""
    model = load_onnx(path)
    info = ModelInfo.read(model)
    ins, outs = graph_io(model)

    def file_specs(items) -> list[FileSpec]:
        return [(name, np.dtype(dtype), dims) for name, dtype, dims in items]

    return (merge_specs(file_specs(ins), info.inputs if info else None, True),
            merge_specs(file_specs(outs), info.outputs if info else None, False))
