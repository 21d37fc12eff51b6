"""A model's signature: declared inputs and outputs, and the checks that give one clear error per bad tensor.

An :class:`InputSpec` is what a model (or a variant's context input) declares: name, shape
(ints, or the dynamic names ``"batch"`` / ``"seq"``), dtype class, role, and for integer ids the
``[low, high)`` range of valid values; an :class:`OutputSpec` likewise for outputs. The exporter
writes both into the file's metadata, so serving validates requests against the same declarations.

A model attnx can export has ``input_specs()``, ``output_specs()``, ``config_dict()``, a
``variant`` name, and ``forward_named(inputs: dict) -> dict`` (the file's signature by name).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch


def check_choice(name: str, value, choices: Sequence) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


@dataclass(frozen=True)
class InputSpec:
    """A model input: dims are ints or the dynamic names "batch" / "seq"."""

    name: str
    shape: tuple
    dtype: str  # "float" (float32/float16/bfloat16), "int64" (int64/int32), or "mask" (int64/int32/bool)
    role: str  # attnx.contract.Role: hidden_states | input_ids | attention_mask | context | ...
    doc: str = ""
    broadcast_batch: bool = False  # may be given without the batch dim (shared by the batch)
    range: tuple[int, int] | None = None  # [low, high) for integer ids (checked here and by the server)
    #: A context input's value meaning "no context" ("zeros" | "ones"): what serving fills in when a
    #: text-only request leaves it out (attnx.contract.INPUT_DEFAULTS). None: always required.
    default: str | None = None

    def describe(self) -> str:
        return f"{self.name} [{', '.join(map(str, self.shape))}] {self.dtype}"


@dataclass(frozen=True)
class OutputSpec:
    """A model output: dims are ints or the dynamic names; dtype "float" or a numpy name ("int64")."""

    name: str
    shape: tuple
    dtype: str
    role: str  # attnx.contract.Role: output | aux
    doc: str = ""


_DTYPES = {
    "float": (torch.float32, torch.float16, torch.bfloat16, torch.float64),
    "int64": (torch.int64, torch.int32),
    "mask": (torch.int64, torch.int32, torch.bool),
}


def _shown(shape: Sequence, dims: dict[str, int]) -> str:
    return "[" + ", ".join(f"{d}={dims[d]}" if isinstance(d, str) and d in dims else str(d) for d in shape) + "]"


def check_tensor(spec: InputSpec, value, dims: dict[str, int]) -> None:
    """Raise ValueError naming the input, the expected shape and the given one.

    ``dims`` binds "batch"/"seq" on first sight, so later inputs must agree with the first.
    """
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{spec.name}: expected a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in _DTYPES[spec.dtype]:
        allowed = ", ".join(str(d).replace("torch.", "") for d in _DTYPES[spec.dtype])
        raise ValueError(f"{spec.name}: expected dtype {allowed}; got {str(value.dtype).replace('torch.', '')}")
    expected = [dims.get(d, d) if isinstance(d, str) else d for d in spec.shape]
    if value.dim() != len(spec.shape):
        raise ValueError(f"{spec.name}: expected shape {_shown(spec.shape, dims)}, got {list(value.shape)} "
                         f"(rank {value.dim()})")
    for want, got in zip(expected, value.shape):
        if isinstance(want, int) and want != got:
            raise ValueError(f"{spec.name}: expected shape {_shown(spec.shape, dims)}, got {list(value.shape)}")
    for d, got in zip(spec.shape, value.shape):
        if isinstance(d, str):
            dims.setdefault(d, int(got))
    check_range(spec, value)


def check_range(spec: InputSpec, value: torch.Tensor) -> None:
    """Integer ids outside ``spec.range`` are an error (a Gather would wrap or fail later)."""
    if spec.range is None or value.numel() == 0 or torch.compiler.is_exporting():
        return
    lo, hi = spec.range
    vmin, vmax = int(value.min()), int(value.max())
    if vmin < lo or vmax >= hi:
        raise ValueError(f"{spec.name}: ids must be in [{lo}, {hi}), got range [{vmin}, {vmax}]")


def check_inputs(specs: Sequence[InputSpec], values: dict, *, optional: Sequence[str] = ()) -> dict[str, int]:
    """Check every named input against its spec; unknown or missing names are errors.

    An input whose spec is marked ``broadcast_batch`` may also come without its batch dim.
    """
    known = {s.name for s in specs}
    extra = sorted(set(values) - known)
    if extra:
        raise ValueError(f"unexpected input(s) {', '.join(extra)}; this model takes: "
                         + ", ".join(s.describe() for s in specs))
    dims: dict[str, int] = {}
    for spec in specs:
        if values.get(spec.name) is None:
            if spec.name in optional:
                continue
            raise ValueError(f"missing input {spec.describe()}")
        value = values[spec.name]
        if spec.broadcast_batch and isinstance(value, torch.Tensor) and value.dim() == len(spec.shape) - 1:
            try:
                check_tensor(dataclasses.replace(spec, shape=spec.shape[1:]), value, dims)
            except ValueError as e:  # name the batched form too: the rank alone may be the mistake
                raise ValueError(f"{e} (or the batched form {_shown(spec.shape, dims)})") from None
            continue
        check_tensor(spec, value, dims)
    return dims


def example_tensor(spec: InputSpec, dims: dict[str, int], generator: torch.Generator) -> torch.Tensor:
    """A unit-scale example value for ``spec`` (ids drawn from its range)."""
    shape = [dims.get(d, d) if isinstance(d, str) else d for d in spec.shape]
    if spec.dtype == "float":
        return torch.randn(shape, generator=generator)
    if spec.dtype == "mask":
        return torch.ones(shape, dtype=torch.int64)
    lo, hi = spec.range or (0, 2)
    return torch.randint(lo, hi, shape, generator=generator)
