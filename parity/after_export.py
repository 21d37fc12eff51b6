"""The check ``attnx export`` runs on the file it has just written: one small case, ONNX Runtime against PyTorch.

Optimum's exporters validate a model's outputs right after export; so does ``attnx export``, where the reference
is cheap: the PyTorch model the file was exported from is still in memory (:attr:`ExportResult.model`). One case,
batch 1 and :data:`TOKENS` tokens (within the file's ``seq`` profile), every input as the trace's examples give it
(:func:`attnx.export.exporter.example_inputs`, no padding) runs through ONNX Runtime (CPU) and through the model on
its reference attention path (the literal formulas, what ``attnx check`` compares with). Each main output (role
``output``; ``logits`` of a decoder exported with its cache, over every prefill position, the cache empty) passes
or fails by the bound ``attnx check`` holds that file to:

- attnx's own encoders: :func:`attnx.parity.compare.resolve_tolerances` (per precision and variant; an element
  fails past both atol and rtol, and the mean absolute difference must stay under mean_atol);
- ``--from-pretrained`` encoders: :func:`attnx.parity.text_report.gates` (fp32: max abs, next-token scores relative
  to their size, or 10x the model's own fp32-vs-float64 floor where the first fails; fp16 and int8: cosine);
- decoders with their cache: :data:`attnx.parity.generation.BOUNDS` (``|a - b| <= atol + rtol |ref|``).

Skipped, with one line saying why (:func:`skip_reason`): weights not in memory (a ``--with-past`` export streams
them from the checkpoint), more than :data:`MAX_REFERENCE_BYTES` of weights (the reference then costs what
``attnx check`` costs), and weight-only int4/int8 files (judged by perplexity, not by a bound per element).
``attnx check`` stays the full comparison: many cases, real text, the original model, the other lowering, engines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import numpy as np

from attnx.contract import SEQ, ModelInfo, Role, TensorEntry

#: Above this many bytes of (fp32) weights in memory the check after export is skipped.
MAX_REFERENCE_BYTES = 2 << 30
#: Tokens of the one case (batch 1), clamped to the file's ``seq`` profile.
TOKENS = 8
_CHECKED_PRECISIONS = ("fp32", "fp16", "int8")


@dataclass
class Verification:
    """What :func:`verify_export` found: ``passed`` (None: skipped), the largest absolute difference of each
    output compared, and the one line ``attnx export`` prints."""

    passed: bool | None
    line: str
    max_abs: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


def weight_bytes(model) -> int:
    """Bytes of the model's parameters and buffers in memory (shared tensors once)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "meta" and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def skip_reason(model, info: ModelInfo) -> str | None:
    """Why the check after export does not run on this file (None: it runs)."""
    if info.precision not in _CHECKED_PRECISIONS:
        return (f"{info.precision} (weight-only) files are judged by perplexity, not element by element: "
                "`attnx check` measures it")
    from attnx.export.streaming import binding_of

    if binding_of(model)[1] is not None or any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()]):
        return "the weights were streamed from the checkpoint (not in memory): `attnx check` compares the file"
    size = weight_bytes(model)
    if size > MAX_REFERENCE_BYTES:
        return (f"{size / 1e9:.1f} GB of weights, above the {MAX_REFERENCE_BYTES / 2**30:.0f} GiB this check runs "
                "under: `attnx check` compares the file")
    return None


def _tokens(info: ModelInfo, tokens: int) -> int:
    lo, _, hi = (int(v) for v in (info.profiles.get(SEQ) or (1, tokens, tokens)))
    return max(lo, min(tokens, hi))


def _feeds(model, info: ModelInfo, session, n: int, cached: bool) -> dict[str, np.ndarray]:
    """The case's inputs as the file takes them (numpy, the file's dtypes)."""
    from attnx.export.exporter import example_inputs

    examples = model.example_inputs(batch=1, seq=n, past=0) if cached else example_inputs(model, batch=1, seq=n)
    dtypes = {i.name: i.type for i in session.get_inputs()}
    feeds = {}
    for entry in info.inputs:
        value = examples[entry.name].detach().numpy()
        if entry.role == Role.ATTENTION_MASK:
            value = np.ones_like(value)  # every token real: padded rows are `attnx check`'s cases
        elif entry.role == Role.POSITION_IDS:
            value = np.arange(n, dtype=value.dtype)[None]  # the cache empty, no padding: 0..n-1
        if "float16" in dtypes.get(entry.name, ""):
            value = value.astype(np.float16)
        feeds[entry.name] = value
    if cached and "logits_to_keep" in dtypes:  # every prefill position's logits, not only the last one's
        feeds["logits_to_keep"] = np.arange(n, dtype=np.int64)
    return feeds


def _reference(model, feeds: Mapping[str, np.ndarray], names: list[str], float64: bool = False) -> dict[str, np.ndarray]:
    import copy

    import torch

    from attnx.models.attention import reference

    if float64:
        model = copy.deepcopy(model).double()
    tensors = {}
    for name, value in feeds.items():
        t = torch.from_numpy(np.ascontiguousarray(value))
        tensors[name] = (t.double() if float64 else t.float()) if t.is_floating_point() else t
    with torch.no_grad(), reference():
        out = model.forward_named(tensors)
    return {n: out[n].detach().double().numpy() for n in names}


def _bounded(out: np.ndarray, ref: np.ndarray, atol: float, rtol: float) -> bool:
    return bool(np.all(np.abs(out - ref) <= atol + rtol * np.abs(ref)))


def _polygraphy_bound(out: np.ndarray, ref: np.ndarray, tol: tuple[float, float, float]) -> bool:
    """``attnx check``'s two checks of an attnx encoder's output: elementwise and mean (:mod:`attnx.parity.compare`)."""
    atol, rtol, mean_atol = tol
    absdiff = np.abs(out - ref)
    with np.errstate(divide="ignore", invalid="ignore"):
        reldiff = absdiff / np.where(ref == 0, np.finfo(np.float64).eps, np.abs(ref))
    elementwise = not np.any(((absdiff > atol) | np.isnan(absdiff)) & ((reldiff > rtol) | np.isnan(reldiff)))
    return elementwise and float(absdiff.mean()) <= mean_atol


def _judge(model, info: ModelInfo, outputs: list[TensorEntry], got: Mapping[str, np.ndarray],
           ref: Mapping[str, np.ndarray], feeds: Mapping[str, np.ndarray], n: int, cached: bool) -> dict[str, bool]:
    """``{output: passed}`` by the bound ``attnx check`` holds this file to (see the module doc)."""
    from attnx.parity.pretrained import is_pretrained

    precision = info.precision
    if cached:
        from attnx.parity.generation import BOUNDS

        atol, rtol = BOUNDS[precision]
        return {o.name: _bounded(got[o.name], ref[o.name], atol, rtol) for o in outputs}
    if is_pretrained(info):
        from attnx.parity.text_report import FLOOR_FACTOR, gates, row_figures

        found, floors = {}, None
        for o in outputs:
            gate = gates(precision, [o], set())[o.name]
            figures = row_figures(got[o.name], ref[o.name], 0, n, o)
            if gate.metric == "cosine":
                found[o.name] = figures["cosine"] >= gate.bound
            elif gate.metric == "max_abs":
                bound = gate.bound * (figures["scale"] if o.name == "logits" else 1.0)
                if not figures["max_abs"] <= bound:  # the model's own fp32 floor, as `attnx check` allows
                    floors = floors or _reference(model, feeds, [e.name for e in outputs], float64=True)
                    floor = row_figures(ref[o.name], floors[o.name], 0, n, o)["max_abs"]
                    bound = max(bound, FLOOR_FACTOR * floor)
                found[o.name] = figures["max_abs"] <= bound
            else:
                found[o.name] = True  # reported by `attnx check`, not gated
        return found
    from attnx.parity.compare import resolve_tolerances

    tol = resolve_tolerances(model, outputs, precision)
    return {o.name: _polygraphy_bound(got[o.name], ref[o.name], tol[o.name]) for o in outputs}


def verify_export(model, path: str | Path, info: ModelInfo | None = None, *, tokens: int = TOKENS) -> Verification:
    """Compare the file at ``path`` with ``model`` (the PyTorch model it was exported from) on one small case; see
    the module doc. Never raises for a mismatch: the result says so."""
    import onnxruntime as ort

    from attnx.export.protocol import is_cached

    started = time.monotonic()
    path = Path(path)
    info = info or ModelInfo.read(path)
    if info is None:
        return Verification(None, f"verify: skipped: {path.name} has no attnx metadata")
    reason = skip_reason(model, info)
    if reason is not None:
        return Verification(None, f"verify: skipped: {reason}")
    cached = is_cached(model)
    outputs = [o for o in info.outputs if o.role == Role.OUTPUT and np.dtype(o.dtype).kind == "f"]
    if cached:
        outputs = [o for o in outputs if o.name == "logits"]
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    n = _tokens(info, tokens)
    feeds = _feeds(model, info, session, n, cached)
    names = [o.name for o in outputs]
    got = {k: np.asarray(v, dtype=np.float64) for k, v in zip(names, session.run(names, feeds))}
    ref = _reference(model, feeds, names)
    passed = _judge(model, info, outputs, got, ref, feeds, n, cached)
    max_abs = {k: float(np.abs(got[k] - ref[k]).max()) if got[k].size else 0.0 for k in names}
    shown = ", ".join(f"{k} {v:.1e}" + ("" if passed[k] else " FAIL") for k, v in max_abs.items())
    seconds = time.monotonic() - started
    where = f"ONNX Runtime vs PyTorch, {info.precision}, 1x{n} tokens"
    if all(passed.values()):
        line = f"verify: passed ({where}; max abs diff {shown}; {seconds:.1f}s)"
    else:
        bad = next(k for k, ok in passed.items() if not ok)
        line = (f"verify: FAILED: {bad} differs from the PyTorch model by up to {max_abs[bad]:.3g} ({where}, beyond "
                f"what `attnx check` allows at {info.precision}); the file is kept: `attnx check {path}` gives the "
                "full report")
    return Verification(all(passed.values()), line, max_abs, seconds)
