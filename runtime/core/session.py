"""Sessions: load a model once, run it many times with named numpy tensors.

A session is the smallest runnable unit of the runtime. It knows its inputs and outputs as :class:`TensorSpec` (name,
numpy dtype, shape with the dynamic axes named ``"batch"`` / ``"seq"``, role) and runs feeds -> outputs. Every session
is safe to call from several threads at once. The backends (:mod:`attnx.runtime.core.backends`) implement it:

- ONNX Runtime for ``.onnx`` files (CPU by default, CUDA when available and asked for);
- TensorRT for ``.engine`` / ``.plan`` files, through :mod:`attnx.engine` where TensorRT can run.

:func:`attnx.runtime.core.loading.load` picks one by the file suffix. Specs come from the file's own dims (the
truth) with the names and roles of its attnx metadata (:class:`attnx.contract.ModelInfo`), or the contract's default
roles for any other file.

Feeds may omit ``attention_mask``: it then means "every token is real" (all ones for the request's length), and
``token_type_ids`` (all zeros: one segment), the same convention the batcher and the server use; so may an input whose
metadata entry has ``default: "zeros"`` (a neutral placed variant's context inputs), which is then zeros of the
request's batch size. Integer inputs with a declared ``[low, high)`` range (token ids, type ids) are checked against
it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from attnx.contract import BATCH, SEQ, ContractError, ModelInfo, Role, TensorEntry, default_role, read_profiles
from attnx.runtime.core.errors import Kind, Refusal

#: A tensor as the file itself declares it: (name, numpy dtype, dims as ints / dim names / None).
FileSpec = tuple[str, np.dtype, list]


#: Outputs a server returns only when a request names them: the per-layer attention patterns
#: ``attentions.{i}`` of ``attnx export --attention-outputs`` (large, and normal traffic does not want them).
ON_REQUEST_OUTPUT = re.compile(r"^attentions\.\d+$")


class InputError(Refusal, ValueError):
    """Feeds that do not fit the model (missing/unknown name, dtype, rank, fixed dim, lengths)."""

    kind = Kind.BAD_INPUT


@dataclass(frozen=True)
class TensorSpec:
    """One named input or output: dtype, shape (ints fixed, strings dynamic), role."""

    name: str
    dtype: np.dtype
    shape: tuple[int | str, ...]
    role: str = Role.CONTEXT
    #: ``[low, high)`` of an integer input that indexes a table (token ids, type ids); None: unchecked.
    range: tuple[int, int] | None = None
    #: What fills this input when a request omits it (``"zeros"`` | ``"ones"``, from the metadata); None: required.
    default: str | None = None

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
        out = {"name": self.name, "dtype": np.dtype(self.dtype).name, "shape": list(self.shape), "role": self.role}
        if self.range is not None:
            out["range"] = list(self.range)
        if self.default is not None:
            out["default"] = self.default
        return out


def merge_specs(file_specs: Iterable[FileSpec], entries: Sequence[TensorEntry] | None, is_input: bool) -> list[TensorSpec]:
    """Combine the file's own dims (the truth) with the metadata's entries (``ModelInfo.inputs``/``outputs``).

    The metadata only names dims the file left anonymous (an exporter may call an output's
    dynamic dim ``s0``) and supplies roles; a fixed dim in the file always wins."""
    by_name = {e.name: e for e in entries or ()}
    specs = []
    for name, dtype, dims in file_specs:
        entry = by_name.get(name)
        mshape = list(entry.shape) if entry is not None else None
        shape: list[int | str] = []
        for axis, d in enumerate(dims):
            if isinstance(d, int) and d >= 0:
                shape.append(d)
                continue
            named = d if isinstance(d, str) and d else "?"
            if named not in (BATCH, SEQ) and mshape is not None and len(mshape) == len(dims):
                stated = mshape[axis]
                if isinstance(stated, str) and stated in (BATCH, SEQ):
                    named = stated
            shape.append(named)
        role = entry.role if entry is not None else default_role(name, is_input)
        specs.append(TensorSpec(name, np.dtype(dtype), tuple(shape), role, entry.range if entry is not None else None,
                                entry.default if entry is not None and is_input else None))
    return specs


class Session:
    """Base of every session: specs, feed checking, and ``run``.

    Subclasses set ``path``, ``inputs``, ``outputs``, ``metadata`` (the file's ``{key: value}``)
    and implement :meth:`_run` (already-checked feeds -> outputs)."""

    path: Path
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    metadata: dict[str, str]
    #: Where it runs, for humans and /v2 metadata ("onnxruntime:CPUExecutionProvider", "tensorrt").
    provider: str = "?"
    #: Triton platform name for model metadata.
    platform: str = "?"
    #: How each tensor's batch/seq axes were decided (:func:`attnx.runtime.core.axes.apply_axes`).
    axis_decisions: list = []

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
            if spec.role == Role.ATTENTION_MASK:
                return spec
        return None

    @functools.cached_property
    def info(self) -> ModelInfo | None:
        """The attnx metadata of the file (None for other files, or when it is unreadable)."""
        try:
            return ModelInfo.from_props(self.metadata)
        except ContractError:
            return None

    @property
    def variant(self) -> str | None:
        return self.info.variant if self.info is not None else None

    @property
    def profiles(self) -> dict | None:
        """The file's profiles: ``{"batch": [min, opt, max], "seq": [...]}`` or None."""
        try:
            found = read_profiles(self.metadata)
        except ContractError:
            return None
        return {axis: list(rng) for axis, rng in found.items()} or None

    # --- running -------------------------------------------------------------
    def check_feeds(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Check names, dtypes, ranks and fixed dims; fill an omitted attention mask with ones.

        Raises :class:`InputError` for anything that does not fit. Arrays are not cast between dtypes: a float64 array
        for a float32 input is an error, because silently casting hides client bugs and costs a copy per call.
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
            check_range(spec, arr)
            checked[spec.name] = arr
        # Omitted, these mean "every position is a token" and "one segment" (as in transformers).
        for spec in self.inputs:
            if spec.name not in checked and spec.role in OPTIONAL_ROLES:
                checked[spec.name] = default_mask(spec, checked, self.inputs, OPTIONAL_ROLES[spec.role])
        for spec in self.inputs:  # an omitted head mask keeps every head (no ablation)
            if spec.role == Role.HEAD_MASK and spec.name not in checked and all(isinstance(d, int) for d in spec.shape):
                checked[spec.name] = np.ones([int(d) for d in spec.shape], dtype=spec.dtype)
        for spec in self.inputs:  # the metadata says what an omitted input means (a neutral variant's context)
            if spec.default in ("zeros", "ones") and spec.name not in checked:
                checked[spec.name] = default_mask(spec, checked, self.inputs, 0 if spec.default == "zeros" else 1)
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


#: Inputs a request may omit, and the value that then fills them.
OPTIONAL_ROLES = {Role.ATTENTION_MASK: 1, Role.TOKEN_TYPE_IDS: 0}


def default_mask(mask: TensorSpec, feeds: Mapping[str, np.ndarray], specs: list[TensorSpec], fill: int = 1
                 ) -> np.ndarray:
    """The all-``fill`` tensor (an all-ones mask) for feeds that omit it, sized from another input's batch/seq dims."""
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
    return np.full(dims, fill, dtype=mask.dtype)


#: Roles whose values index a table: never negative, even where no upper bound is known.
ID_ROLES = (Role.INPUT_IDS, Role.TOKEN_TYPE_IDS)


def check_range(spec: TensorSpec, arr: np.ndarray) -> None:
    """Refuse integer ids outside the input's ``[low, high)`` (a Gather would fail, or silently wrap a
    negative id, for the whole batch); token and type ids are never negative."""
    if arr.dtype.kind not in "iu" or arr.size == 0:
        return
    low, high = spec.range if spec.range is not None else ((0, None) if spec.role in ID_ROLES else (None, None))
    if low is None and high is None:
        return
    lo, hi = int(arr.min()), int(arr.max())
    bad = lo if low is not None and lo < low else hi if high is not None and hi >= high else None
    if bad is not None:
        where = tuple(int(i) for i in np.argwhere(arr == bad)[0])
        bounds = f"[{low}, {high})" if high is not None else f">= {low}"
        raise InputError(f"input {spec.name!r}: value {bad} at {list(where)} is outside the model's range {bounds}")


#: Exception types (by name) that ONNX Runtime raises when a node cannot run the inputs it was given.
_RUNTIME_INPUT_ERRORS = {"InvalidArgument", "Fail", "RuntimeException", "NotImplemented", "InvalidGraph"}


def model_input_error(exc: BaseException) -> InputError | None:
    """An :class:`InputError` for a runtime's refusal of one request's inputs (an index out of a table's
    bounds, a shape a node cannot take), with internal node names left out; None for anything else.

    The batcher only calls this for a request that failed when run alone, so its inputs are the cause."""
    module = type(exc).__module__ or ""
    if not (module.startswith("onnxruntime") and type(exc).__name__ in _RUNTIME_INPUT_ERRORS):
        return None
    return InputError(f"the model could not run this request: {public_message(str(exc))}")


def public_message(text: str) -> str:
    """A runtime's error text without graph internals: ONNX Runtime's ``Status Message`` part when it has
    one, node names and ``[ONNXRuntimeError] : N : CODE :`` prefixes removed, one line."""
    found = re.search(r"Status Message:\s*(.*)", text, re.S)
    text = found.group(1) if found else text
    text = re.sub(r"\[ONNXRuntimeError\]\s*:\s*\d+\s*:\s*[A-Z_]+\s*:\s*", "", text)
    text = re.sub(r"\s*Name:\s*'[^']*'", "", text)
    text = re.sub(r"\b(node|Node)\s+'[^']*'", "a node", text)
    line = " ".join(text.split())
    return (line[:300] + "...") if len(line) > 300 else line


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
