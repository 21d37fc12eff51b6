"""Sessions: load a model once, run it many times with named numpy tensors.

A session is the smallest runnable unit of the runtime. It knows its inputs
and outputs as :class:`TensorSpec` (name, numpy dtype, shape with the dynamic
axes named ``"batch"`` / ``"seq"``, role) and runs feeds -> outputs. Every
session is safe to call from several threads at once.

- :class:`OnnxRuntimeSession` runs an ``.onnx`` file with ONNX Runtime
  (CPU by default, CUDA when available and asked for).
- :class:`EngineSession` runs a TensorRT ``.engine`` through the backend adapter
  ``attnx.runtime.tensorrt_backend`` where TensorRT can run.

``load(path)`` picks one by the file suffix.

Feeds may omit ``attention_mask``: it then means "every token is real" (all
ones for the request's length), the same convention the batcher and the
server use.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

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

BATCH = "batch"
SEQ = "seq"

ROLE_HIDDEN = "hidden_states"
ROLE_MASK = "attention_mask"
ROLE_CONTEXT = "context"
ROLE_OUTPUT = "output"
ROLE_AUX = "aux"


class InputError(ValueError):
    """Feeds that do not fit the model (missing/unknown name, dtype, rank, fixed dim, lengths)."""


@dataclass(frozen=True)
class TensorSpec:
    """One named input or output: dtype, shape (ints fixed, strings dynamic), role."""

    name: str
    dtype: np.dtype
    shape: tuple[int | str, ...]
    role: str = ROLE_CONTEXT

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def batch_axis(self) -> int | None:
        return self.shape.index(BATCH) if BATCH in self.shape else None

    @property
    def seq_axis(self) -> int | None:
        return self.shape.index(SEQ) if SEQ in self.shape else None

    def describe(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        return f"{self.name} {np.dtype(self.dtype).name} [{dims}]"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": np.dtype(self.dtype).name, "shape": list(self.shape), "role": self.role}


def _default_role(name: str, is_input: bool) -> str:
    if is_input:
        return {"hidden_states": ROLE_HIDDEN, "attention_mask": ROLE_MASK}.get(name, ROLE_CONTEXT)
    return ROLE_OUTPUT if name == "output" else ROLE_AUX


def _merge_specs(
    file_specs: list[tuple[str, np.dtype, list[Any]]], meta: list[dict] | None, is_input: bool
) -> list[TensorSpec]:
    """Combine the file's own dims (the truth) with the ``attnx.inputs``/``attnx.outputs`` metadata.

    The metadata only names dims the file left anonymous (an exporter may call an
    output's dynamic dim ``s0``) and supplies roles; a fixed dim in the file always wins.
    """
    by_name = {m.get("name"): m for m in (meta or []) if isinstance(m, dict)}
    specs = []
    for name, dtype, dims in file_specs:
        m = by_name.get(name, {})
        mshape = m.get("shape") if isinstance(m.get("shape"), list) else None
        shape: list[int | str] = []
        for axis, d in enumerate(dims):
            if isinstance(d, int) and d >= 0:
                shape.append(d)
                continue
            named = d if isinstance(d, str) and d else "?"
            if named not in (BATCH, SEQ) and mshape is not None and len(mshape) == len(dims):
                if mshape[axis] in (BATCH, SEQ):
                    named = mshape[axis]
            shape.append(named)
        role = m.get("role") or _default_role(name, is_input)
        specs.append(TensorSpec(name, np.dtype(dtype), tuple(shape), role))
    return specs


def _json_or_none(text: str | None) -> Any:
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


class Session:
    """Base of every session: specs, feed checking, and ``run``.

    Subclasses implement :meth:`_run` (already-checked feeds -> outputs).
    """

    path: Path
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    metadata: dict[str, str]
    #: Where it runs, for humans and /v2 metadata ("onnxruntime:CPUExecutionProvider", "tensorrt").
    provider: str = "?"
    #: Triton platform name for model metadata.
    platform: str = "?"

    # --- lookups -------------------------------------------------------------
    def input(self, name: str) -> TensorSpec:
        for spec in self.inputs:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def output(self, name: str) -> TensorSpec:
        for spec in self.outputs:
            if spec.name == name:
                return spec
        raise KeyError(name)

    @property
    def input_names(self) -> list[str]:
        return [s.name for s in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [s.name for s in self.outputs]

    @property
    def mask_input(self) -> TensorSpec | None:
        """The attention-mask input (role ``attention_mask``), if the model has one."""
        for spec in self.inputs:
            if spec.role == ROLE_MASK:
                return spec
        return None

    @property
    def variant(self) -> str | None:
        return self.metadata.get("attnx.variant")

    @property
    def profiles(self) -> dict | None:
        """``attnx.profiles`` metadata: ``{"batch": [min, opt, max], "seq": [...]}`` or None."""
        value = _json_or_none(self.metadata.get("attnx.profiles"))
        return value if isinstance(value, dict) else None

    # --- running -------------------------------------------------------------
    def check_feeds(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Check names, dtypes, ranks and fixed dims; fill an omitted attention mask with ones.

        Raises :class:`InputError` for anything that does not fit. Arrays are not
        cast between dtypes: a float64 array for a float32 input is an error,
        because silently casting hides client bugs and costs a copy per call.
        """
        unknown = sorted(set(feeds) - set(self.input_names))
        if unknown:
            raise InputError(f"unknown input(s) {unknown}; the model takes {self.input_names}")
        checked: dict[str, np.ndarray] = {}
        for spec in self.inputs:
            if spec.name not in feeds:
                continue
            value = feeds[spec.name]
            arr = value if isinstance(value, np.ndarray) else np.asarray(value)
            if arr.dtype != spec.dtype:
                raise InputError(f"input {spec.name!r}: dtype {arr.dtype}, expected {np.dtype(spec.dtype).name}")
            if arr.ndim != spec.rank:
                raise InputError(f"input {spec.name!r}: rank {arr.ndim} {list(arr.shape)}, expected {spec.describe()}")
            for axis, (want, got) in enumerate(zip(spec.shape, arr.shape)):
                if isinstance(want, int) and want != got:
                    raise InputError(
                        f"input {spec.name!r}: dim {axis} is {got}, expected {want} ({spec.describe()})"
                    )
            checked[spec.name] = arr
        mask = self.mask_input
        if mask is not None and mask.name not in checked:
            checked[mask.name] = default_mask(mask, checked, self.inputs)
        missing = [s.name for s in self.inputs if s.name not in checked]
        if missing:
            raise InputError(f"missing input(s) {missing}; the model takes {self.input_names}")
        _check_shared_dims(self.inputs, checked)
        return checked

    def run(self, feeds: Mapping[str, Any], output_names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """Run once: named numpy inputs -> named numpy outputs (all, or ``output_names``)."""
        names = list(output_names) if output_names is not None else self.output_names
        for n in names:
            if n not in self.output_names:
                raise InputError(f"unknown output {n!r}; the model gives {self.output_names}")
        return self._run(self.check_feeds(feeds), names)

    def _run(self, feeds: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def describe(self) -> str:
        lines = [f"{self.path} ({self.provider})"]
        lines += [f"  in  {s.describe()}  role={s.role}" for s in self.inputs]
        lines += [f"  out {s.describe()}  role={s.role}" for s in self.outputs]
        return "\n".join(lines)

    def close(self) -> None:
        """Release the underlying runtime objects (optional; garbage collection also does it)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.path.name} inputs={self.input_names} outputs={self.output_names}>"


def default_mask(mask: TensorSpec, feeds: Mapping[str, np.ndarray], specs: list[TensorSpec]) -> np.ndarray:
    """The all-ones mask for feeds that omit it, sized from another input's batch/seq dims."""
    batch = seq = None
    for spec in specs:
        arr = feeds.get(spec.name)
        if arr is None or spec.name == mask.name:
            continue
        if batch is None and spec.batch_axis is not None:
            batch = arr.shape[spec.batch_axis]
        if seq is None and spec.seq_axis is not None:
            seq = arr.shape[spec.seq_axis]
    dims = []
    for d in mask.shape:
        if d == BATCH and batch is not None:
            dims.append(batch)
        elif d == SEQ and seq is not None:
            dims.append(seq)
        elif isinstance(d, int):
            dims.append(d)
        else:
            raise InputError(f"cannot infer the shape of the omitted {mask.name!r}; pass it explicitly")
    return np.ones(dims, dtype=mask.dtype)


def _check_shared_dims(specs: list[TensorSpec], feeds: Mapping[str, np.ndarray]) -> None:
    """Every input must agree on the size of each named dynamic dim ("batch", "seq", ...)."""
    seen: dict[str, tuple[int, str]] = {}
    for spec in specs:
        arr = feeds[spec.name]
        for axis, d in enumerate(spec.shape):
            if not isinstance(d, str) or d == "?":
                continue
            size = arr.shape[axis]
            if d in seen and seen[d][0] != size:
                raise InputError(
                    f"dim {d!r} disagrees between inputs: {seen[d][1]} has {seen[d][0]}, {spec.name} has {size}"
                )
            seen.setdefault(d, (size, spec.name))


# --------------------------------------------------------------------------------------
# ONNX Runtime
# --------------------------------------------------------------------------------------


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
    """ONNX Runtime settings a service cares about.

    - ``threads``: intra-op threads (default: the CPUs this process may use).
    - ``spin``: let idle pool threads busy-wait. Off by default: a served model
      is idle between batches, and spinning threads would steal the cores the
      HTTP front end and the other models need.
    - ``optimization``: graph optimization level (``all``, ``extended``, ``basic``, ``none``).
    """

    device: str = "auto"
    threads: int | None = None
    spin: bool = False
    optimization: str = "all"
    extra_session_config: dict[str, str] = field(default_factory=dict)


class OnnxRuntimeSession(Session):
    """An ``.onnx`` model on ONNX Runtime. ``InferenceSession.run`` is thread-safe, so is this."""

    platform = "onnxruntime_onnx"

    def __init__(self, path: str | os.PathLike, options: OrtOptions | None = None):
        import onnxruntime as ort

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no model file at {self.path}")
        self.options = options or OrtOptions()
        so = ort.SessionOptions()
        so.intra_op_num_threads = self.options.threads or default_threads()
        so.inter_op_num_threads = 1  # one graph at a time per call; parallelism comes from intra-op
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = {
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        }[self.options.optimization]
        if not self.options.spin:
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            so.add_session_config_entry("session.inter_op.allow_spinning", "0")
        for k, v in self.options.extra_session_config.items():
            so.add_session_config_entry(k, v)
        providers = ort_providers(self.options.device)
        self._sess = ort.InferenceSession(str(self.path), sess_options=so, providers=providers)
        self.provider = "onnxruntime:" + self._sess.get_providers()[0]
        self.metadata = dict(self._sess.get_modelmeta().custom_metadata_map)

        def file_specs(args):
            out = []
            for a in args:
                if a.type not in _ORT_TYPES:
                    raise ValueError(f"{self.path}: tensor {a.name!r} has unsupported type {a.type}")
                out.append((a.name, np.dtype(_ORT_TYPES[a.type]), list(a.shape)))
            return out

        self.inputs = _merge_specs(
            file_specs(self._sess.get_inputs()), _json_or_none(self.metadata.get("attnx.inputs")), True
        )
        self.outputs = _merge_specs(
            file_specs(self._sess.get_outputs()), _json_or_none(self.metadata.get("attnx.outputs")), False
        )

    def _run(self, feeds: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        values = self._sess.run(output_names, feeds)
        return dict(zip(output_names, values))

    def close(self) -> None:
        self._sess = None  # type: ignore[assignment]


# --------------------------------------------------------------------------------------
# TensorRT engines (through the backend adapter owned by the engine code)
# --------------------------------------------------------------------------------------


def engine_sidecar(path: Path) -> dict:
    """The JSON written next to an engine by ``attnx build-engine`` (``x.engine.json`` or ``x.json``)."""
    for candidate in (path.with_name(path.name + ".json"), path.with_suffix(".json")):
        if candidate.is_file():
            try:
                data = json.loads(candidate.read_text())
                return data if isinstance(data, dict) else {}
            except ValueError:
                return {}
    return {}


def engine_io_specs(path: Path, onnx_path: Path | None = None) -> tuple[list[TensorSpec], list[TensorSpec], dict]:
    """I/O specs of an engine without running it: the sidecar's, else those of its source ONNX.

    Used where TensorRT cannot run (``attnx triton-repo`` on a CPU machine).
    """
    sidecar = engine_sidecar(path)
    if isinstance(sidecar.get("inputs"), list) and isinstance(sidecar.get("outputs"), list):
        # `attnx build-engine` writes {name, dtype, shape (dim names / ints / null), role} per tensor.
        def specs(items, is_input):
            listed = [(i["name"], np.dtype(i.get("dtype", "float32")), list(i.get("shape", []))) for i in items]
            return _merge_specs(listed, items, is_input)

        return specs(sidecar["inputs"], True), specs(sidecar["outputs"], False), sidecar
    candidates = [onnx_path] if onnx_path else []
    for key in ("onnx", "source", "onnx_path", "model"):
        if isinstance(sidecar.get(key), str):
            candidates.append(Path(sidecar[key]))
    candidates.append(path.with_suffix(".onnx"))
    for c in candidates:
        if c is not None and c.is_file():
            inputs, outputs = onnx_io_specs(c)
            return inputs, outputs, sidecar
    raise FileNotFoundError(
        f"cannot tell the inputs/outputs of {path}: no sidecar with 'inputs'/'outputs' "
        f"and no source ONNX found (pass the .onnx it was built from)"
    )


def onnx_io_specs(path: Path) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """I/O specs read from an ONNX file's graph and metadata, without creating a session."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    initializers = {i.name for i in model.graph.initializer}

    def file_specs(values):
        out = []
        for v in values:
            if v.name in initializers:
                continue
            tt = v.type.tensor_type
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
            dims = [d.dim_param if d.dim_param else (d.dim_value if d.HasField("dim_value") else None)
                    for d in tt.shape.dim]
            out.append((v.name, np.dtype(dtype), dims))
        return out

    return (
        _merge_specs(file_specs(model.graph.input), _json_or_none(meta.get("attnx.inputs")), True),
        _merge_specs(file_specs(model.graph.output), _json_or_none(meta.get("attnx.outputs")), False),
    )


class EngineSession(Session):
    """A TensorRT engine, run through ``attnx.runtime.tensorrt_backend.load_engine``.

    The adapter owns deserialization and execution (and serializes calls on its one
    execution context); this class gives it the session interface. I/O specs come
    from the build sidecar or the source ONNX (which name the ``batch``/``seq``
    dims); failing those, from the engine itself, reading its first dynamic dim as
    ``batch`` and its second as ``seq`` (the export contract's order).
    """

    platform = "tensorrt_plan"

    def __init__(self, path: str | os.PathLike, onnx_path: str | os.PathLike | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no engine file at {self.path}")
        try:
            from attnx.runtime import tensorrt_backend
        except ImportError as e:  # the adapter's own imports may fail where TensorRT is absent
            raise RuntimeError(f"cannot run {self.path.name}: the TensorRT backend is unavailable ({e})") from e
        self._engine = tensorrt_backend.load_engine(self.path)
        try:
            self.inputs, self.outputs, sidecar = engine_io_specs(self.path, Path(onnx_path) if onnx_path else None)
        except FileNotFoundError:
            sidecar = engine_sidecar(self.path)
            tensors = getattr(self._engine, "io_tensors", [])
            self.inputs = [_engine_spec(t, True) for t in tensors if t.is_input]
            self.outputs = [_engine_spec(t, False) for t in tensors if not t.is_input]
        self.metadata = {k: v if isinstance(v, str) else json.dumps(v) for k, v in sidecar.items()}
        self.provider = "tensorrt:" + str(sidecar.get("backend", "tensorrt"))

    def _run(self, feeds: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        out = self._engine.run(feeds)
        return {n: np.asarray(out[n]) for n in output_names}

    def close(self) -> None:
        close = getattr(self._engine, "close", None)
        if close is not None:
            close()


def _engine_spec(tensor: Any, is_input: bool) -> TensorSpec:
    names = iter((BATCH, SEQ))
    shape = tuple(d if d >= 0 else next(names, "?") for d in tensor.shape)
    return TensorSpec(tensor.name, np.dtype(tensor.dtype), shape, _default_role(tensor.name, is_input))


def load(path: str | os.PathLike, *, device: str = "auto", threads: int | None = None, **opts: Any) -> Session:
    """Load a model file once; returns a thread-safe :class:`Session`.

    ``.onnx`` -> ONNX Runtime (``device``: ``auto`` | ``cpu`` | ``cuda``; ``threads``:
    intra-op threads; ``spin``, ``optimization`` as in :class:`OrtOptions`).
    ``.engine`` / ``.plan`` -> TensorRT through the backend adapter (``onnx_path``:
    the source ONNX, when the engine's sidecar does not list its I/O).
    """
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix == ".onnx":
        return OnnxRuntimeSession(p, OrtOptions(device=device, threads=threads, **opts))
    if suffix in (".engine", ".plan"):
        return EngineSession(p, onnx_path=opts.get("onnx_path"))
    raise ValueError(f"{p}: unknown model type {suffix!r} (expected .onnx or .engine)")
