"""Parity of an attnx export against its PyTorch reference (``attnx check``), with Polygraphy.

Runners (all Polygraphy ``BaseRunner`` s, run by ``Comparator.run`` on the same inputs):

- ``torch``: :class:`TorchReferenceRunner` -- the encoder rebuilt from the file's
  ``attnx.config`` metadata with the weights file named in ``attnx.weights`` (fp32, CPU;
  Polygraphy's own PyTorch runner assumes CUDA). It is the reference every other runner is
  compared with (``Comparator.compare_accuracy`` with ``SimpleCompareFunc``, per-output
  tolerances; relative errors are relative to the reference).
- ``onnxrt-plugin`` / ``onnxrt-rewrite``: ONNX Runtime (CPU) on both lowerings: the given
  file is one, the other is re-exported from the reference into ``<workdir>/parity/``.
- ``tensorrt``: the engine through the backend adapter's ``Engine``, where it can run (a GPU of
  the architecture it was built for); otherwise one line says why and the rest is checked.

Inputs (:class:`ParityDataLoader`): several batch sizes and lengths inside the profiles, none
of them the export example's, with right-padded masks of different lengths per row.

Tolerances (:data:`TOLERANCES`) are per output and per precision. ``maw_depth`` is compared
exactly. An fp16 model may legitimately pick another depth where the reference's policy
logits nearly tie (the top two within :data:`TIE_MARGIN`): such rows are *reported* as depth
ties (``depth_ties`` in the report, a yellow line in the table) and left out of that
comparison's statistics; a depth difference at a clear margin is a failure.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

import attnx

__all__ = [
    "TOLERANCES",
    "TIE_MARGIN",
    "MARGIN_KEY",
    "ParityError",
    "Case",
    "default_cases",
    "parse_cases",
    "ParityDataLoader",
    "TorchReferenceRunner",
    "EngineRunner",
    "TieAwareCompareFunc",
    "Comparison",
    "ParityReport",
    "run_check",
    "find_engine_for",
]

_log = logging.getLogger("attnx.parity")

#: ``{precision: {output: (atol, rtol, mean_atol)}}``. Two Polygraphy checks per output: ``elemwise``
#: (an element fails when it exceeds both atol and rtol) and ``mean`` (the mean absolute error
#: must stay under mean_atol), so the loose fp16 elementwise bound cannot hide a small systematic
#: error. fp16 values come from measurements on the five variants (ONNX Runtime CPU on the fp16
#: file vs the fp32 reference, d_model 32 and 256, 2 layers, batch 1-16, seq 1-512): worst element
#: 2.8e-2 (smal, whose distance logits grow with length; elementwise use of the bound <= 0.45), the
#: other variants <= 2.1e-3; worst per-case mean 7.9e-4 (smal), the others <= 2.2e-4.
TOLERANCES: dict[str, dict[str, tuple[float, float, float]]] = {
    "fp32": {"output": (1e-4, 1e-4, 1e-5), "maw_depth": (0.0, 0.0, 0.0)},
    "fp16": {"output": (5e-2, 5e-2, 2e-3), "maw_depth": (0.0, 0.0, 0.0)},
}
#: Policy-logit margin (top1 - top2, reference) under which a different maw depth is a tie, not an error.
TIE_MARGIN: dict[str, float] = {"fp32": 1e-4, "fp16": 2e-2}
#: Extra output of the reference runner: per maw layer and row, the reference's policy-logit margin.
MARGIN_KEY = "__attnx_policy_margin"
REFERENCE = "torch"
LOWERINGS = ("plugin", "rewrite")


class ParityError(ValueError):
    """A user-fixable problem setting up a parity check (one line)."""


# ============================================================================ inputs


@dataclass(frozen=True)
class Case:
    batch: int
    seq: int
    lengths: tuple[int, ...]  # valid tokens per row (right padding)

    def label(self) -> str:
        return f"{self.batch}x{self.seq}"

    def to_json(self) -> dict:
        return {"batch": self.batch, "seq": self.seq, "lengths": list(self.lengths)}


#: (batch, seq) tried by default, clipped to the profiles: none is the export example (2x8).
DEFAULT_SHAPES = ((1, 5), (2, 16), (3, 33), (4, 64), (1, 1))


def _lengths(batch: int, seq: int) -> tuple[int, ...]:
    # Row 0 full; the others shorter and different from each other (>= 1 token each).
    return tuple([seq] + [max(1, (seq * (batch - i)) // (batch + 1)) for i in range(1, batch)])


def _check_in_profile(batch: int, seq: int, profiles: Mapping[str, Sequence[int]], where: str) -> None:
    for axis, value in (("batch", batch), ("seq", seq)):
        rng = profiles.get(axis)
        if rng is not None and not int(rng[0]) <= value <= int(rng[2]):
            raise ParityError(f"case {batch}x{seq}: {axis} {value} is outside the {where} profile "
                              f"{axis}={rng[0]}..{rng[2]}")


def default_cases(profiles: Mapping[str, Sequence[int]] | None) -> list[Case]:
    """The default cases clipped into ``profiles`` (``{"batch": (min, opt, max), "seq": ...}``)."""
    profiles = profiles or {}
    out: list[Case] = []
    for b, s in DEFAULT_SHAPES:
        if "batch" in profiles:
            b = min(max(b, int(profiles["batch"][0])), int(profiles["batch"][2]))
        if "seq" in profiles:
            s = min(max(s, int(profiles["seq"][0])), int(profiles["seq"][2]))
        case = Case(b, s, _lengths(b, s))
        if case not in out:
            out.append(case)
    return out


def parse_cases(items: Iterable[str], profiles: Mapping[str, Sequence[int]] | None = None,
                where: str = "model's") -> list[Case]:
    """``["2x16", "3x33"]`` (batch x seq) -> cases; each must lie inside ``profiles``."""
    out = []
    for item in items:
        for part in str(item).replace(",", " ").split():
            b, sep, s = part.lower().partition("x")
            if not sep or not b.isdigit() or not s.isdigit() or int(b) < 1 or int(s) < 1:
                raise ParityError(f"--case {part!r}: expected BATCHxSEQ with positive integers, e.g. 2x16")
            if profiles:
                _check_in_profile(int(b), int(s), profiles, where)
            out.append(Case(int(b), int(s), _lengths(int(b), int(s))))
    return out


class ParityDataLoader:
    """A Polygraphy data loader: one feed dict per :class:`Case` (values from
    ``attnx.export.exporter.example_inputs``, masks right-padded to each row's length, floats
    in the file's dtype). Random access, so Polygraphy can reload inputs."""

    def __init__(self, model, inputs: Sequence[Mapping[str, Any]], cases: Sequence[Case], seed: int = 0):
        self.model = model
        self.inputs = list(inputs)
        self.cases = list(cases)
        self.seed = seed
        self._cache: dict[int, OrderedDict] = {}

    def __len__(self) -> int:
        return len(self.cases)

    def __getitem__(self, index: int) -> OrderedDict:
        if index >= len(self.cases) or index < -len(self.cases):
            raise IndexError(index)
        index %= len(self.cases)
        if index not in self._cache:
            self._cache[index] = self._make(index)
        return OrderedDict((k, v.copy()) for k, v in self._cache[index].items())

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def _make(self, index: int) -> OrderedDict:
        from attnx.export.exporter import example_inputs

        case = self.cases[index]
        feeds = example_inputs(self.model, batch=case.batch, seq=case.seq, seed=self.seed + 1000 + index)
        out: OrderedDict[str, np.ndarray] = OrderedDict()
        for spec in self.inputs:
            name = spec["name"]
            arr = feeds[name].numpy()
            if spec.get("role") == "attention_mask":
                arr = np.zeros((case.batch, case.seq), dtype=np.int64)
                for row, n in enumerate(case.lengths):
                    arr[row, :n] = 1
            out[name] = np.ascontiguousarray(arr.astype(np.dtype(spec.get("dtype", arr.dtype.name))))
        return out


# ============================================================================ runners


def _base_runner():
    from polygraphy.backend.base import BaseRunner

    return BaseRunner


def _metadata(inputs: Sequence[Mapping[str, Any]]):
    from polygraphy.common import TensorMetadata

    meta = TensorMetadata()
    for spec in inputs:
        shape = [d if isinstance(d, int) and d > 0 else None for d in spec.get("shape", [])]
        meta.add(spec["name"], dtype=np.dtype(spec.get("dtype", "float32")), shape=shape)
    return meta


class TorchReferenceRunner(_base_runner()):
    """The PyTorch reference (CPU, fp32) of an attnx export, as a Polygraphy runner.

    Float inputs are run in fp32 whatever the file's precision (the reference of an fp16 file
    is the fp32 model on the same, fp16-rounded, inputs). Besides the file's outputs it
    returns :data:`MARGIN_KEY`: each maw layer's top-1 minus top-2 policy logit per row."""

    def __init__(self, model, inputs: Sequence[Mapping[str, Any]], outputs: Sequence[str], name: str = REFERENCE):
        super().__init__(name=name, prefix="torch-reference")
        self.model = model.eval()
        self.inputs = list(inputs)
        self.output_names = list(outputs)

    @classmethod
    def from_onnx(cls, path: str | os.PathLike, name: str = REFERENCE) -> "TorchReferenceRunner":
        model, info = load_reference(path)
        return cls(model, info.inputs, [o["name"] for o in info.outputs], name=name)

    def activate_impl(self):
        pass

    def deactivate_impl(self):
        pass

    def get_input_metadata_impl(self):
        return _metadata(self.inputs)

    def infer_impl(self, feed_dict):
        import torch

        start = time.perf_counter()
        tensors = {}
        for name, arr in feed_dict.items():
            t = torch.from_numpy(np.ascontiguousarray(arr))
            tensors[name] = t.float() if t.is_floating_point() else t
        margins: list[torch.Tensor] = []
        handles = []
        for block in self.model.blocks:
            if block.variant == "maw":
                def hook(_module, _args, out, _store=margins):
                    top = torch.topk(out.detach().float(), k=min(2, out.shape[-1]), dim=-1).values
                    _store.append(top[..., 0] - top[..., 1] if top.shape[-1] > 1 else torch.full_like(top[..., 0], np.inf))
                handles.append(block.attn.policy.register_forward_hook(hook))
        try:
            with torch.no_grad():
                context = {k: v for k, v in tensors.items() if k not in ("hidden_states", "attention_mask")}
                result = self.model(tensors["hidden_states"], tensors.get("attention_mask"),
                                    return_depth=self.model.has_maw, **context)
        finally:
            for h in handles:
                h.remove()
        outputs = OrderedDict()
        if isinstance(result, tuple):
            outputs["output"] = result[0].float().numpy()
            outputs["maw_depth"] = result[1].to(torch.int64).numpy()
        else:
            outputs["output"] = result.float().numpy()
        outputs = OrderedDict((k, outputs[k]) for k in self.output_names if k in outputs)
        if margins:
            outputs[MARGIN_KEY] = torch.stack(margins).numpy().astype(np.float32)
        self.inference_time = time.perf_counter() - start
        return outputs


class EngineRunner(_base_runner()):
    """A TensorRT engine through the backend adapter's ``Engine`` (needs the GPU it was built for)."""

    def __init__(self, engine_path: str | os.PathLike, plugins: str | os.PathLike | bool | None = True,
                 name: str = "tensorrt"):
        super().__init__(name=name, prefix="tensorrt-engine")
        self.engine_path = Path(engine_path)
        self.plugins = plugins
        self.engine = None

    def open(self):
        """Deserialize now (raises the adapter's ``EngineUnavailable`` where it cannot run)."""
        from attnx.runtime import tensorrt_backend as tb

        if self.engine is None:
            self.engine = tb.deserialize(self.engine_path, plugins=self.plugins)
        return self.engine

    def activate_impl(self):
        self.open()

    def deactivate_impl(self):
        pass  # the engine stays loaded between activations; close() frees it

    def close(self):
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def get_input_metadata_impl(self):
        from polygraphy.common import TensorMetadata

        meta = TensorMetadata()
        for t in self.engine.io_tensors:
            if t.is_input:
                meta.add(t.name, dtype=np.dtype(t.dtype), shape=[d if d >= 0 else None for d in t.shape])
        return meta

    def infer_impl(self, feed_dict):
        start = time.perf_counter()
        out = self.engine.run(feed_dict)
        self.inference_time = time.perf_counter() - start
        return OrderedDict((k, np.asarray(v)) for k, v in out.items())


def _onnxrt_runner(path: Path, name: str):
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

    return OnnxrtRunner(SessionFromOnnx(str(path), providers=["cpu"]), name=name)


# ============================================================================ comparison


def _compare_func_base():
    from polygraphy.comparator import SimpleCompareFunc

    return SimpleCompareFunc


class _TieTracker:
    """Decides once per (runner pair, iteration) which rows are maw depth ties (shared by the
    compare functions, so the elementwise and the mean checks exclude the same rows)."""

    def __init__(self, tie_margin: float):
        self.tie_margin = float(tie_margin)
        self.ties: list[dict] = []
        self._rows: dict[tuple[str, str, int], list[int]] = {}

    def rows(self, key, out, ref, margins, row_fails) -> list[int]:
        if key in self._rows:
            return self._rows[key]
        rows: list[int] = []
        if margins is not None and "maw_depth" in out and "maw_depth" in ref and \
                out["maw_depth"].shape == ref["maw_depth"].shape:
            margins = np.asarray(margins, dtype=np.float64)  # [maw layers, B]
            min_margin = margins.min(axis=0)
            near = min_margin < self.tie_margin
            depth_diff = out["maw_depth"] != ref["maw_depth"]
            output_bad = np.zeros_like(depth_diff)
            if "output" in out and "output" in ref and out["output"].shape == ref["output"].shape:
                output_bad = row_fails("output", out["output"], ref["output"])
            rows = np.nonzero(near & (depth_diff | output_bad))[0].tolist()
            for row in rows:
                entry = {"runner": key[0], "reference": key[1], "iteration": key[2], "row": int(row),
                         "reference_depth": int(ref["maw_depth"][row]), "depth": int(out["maw_depth"][row]),
                         "margin": float(min_margin[row]), "layer_margins": [float(m) for m in margins[:, row]],
                         "tie_margin": self.tie_margin}
                if "output" in out and out["output"].shape == ref["output"].shape:
                    entry["output_max_abs"] = float(np.max(np.abs(out["output"][row].astype(np.float64)
                                                                  - ref["output"][row].astype(np.float64))))
                self.ties.append(entry)
        self._rows[key] = rows
        return rows


class TieAwareCompareFunc(_compare_func_base()):
    """Polygraphy's ``SimpleCompareFunc`` (per-output atol/rtol, one error statistic) plus maw
    depth ties.

    Called as ``(runner_result, reference_result)``. Rows (batch entries) where the reference's
    policy logits nearly tie in some maw layer and the runner chose another depth (or the row's
    output misses the elementwise tolerance) are recorded by the shared tracker (``ties``) and
    replaced by the reference's values before Polygraphy compares, so they neither fail the
    check nor vanish from the report. Depth differences at a clear margin go to Polygraphy
    unchanged (and fail)."""

    def __init__(self, *, tracker: _TieTracker, atol, rtol, check_error_stat: str = "elemwise",
                 row_atol=None, row_rtol=None, **kwargs):
        super().__init__(atol=atol, rtol=rtol, check_error_stat=check_error_stat, **kwargs)
        self.tracker = tracker
        self.row_atol = row_atol if row_atol is not None else atol
        self.row_rtol = row_rtol if row_rtol is not None else rtol
        self._iterations: dict[tuple[str, str], int] = {}

    @property
    def ties(self) -> list[dict]:
        return self.tracker.ties

    def _row_fails(self, name: str, out: np.ndarray, ref: np.ndarray) -> np.ndarray:
        from polygraphy import util

        atol = float(util.value_or_from_dict(self.row_atol, name, 0.0))
        rtol = float(util.value_or_from_dict(self.row_rtol, name, 0.0))
        a = out.astype(np.float64)
        r = ref.astype(np.float64)
        absdiff = np.abs(a - r)
        with np.errstate(divide="ignore", invalid="ignore"):
            reldiff = absdiff / np.where(r == 0, 2.220446049250313e-16, np.abs(r))
        bad = ((absdiff > atol) | np.isnan(absdiff)) & ((reldiff > rtol) | np.isnan(reldiff))
        return bad.reshape(bad.shape[0], -1).any(axis=1) if bad.ndim else np.array([bool(bad)])

    def __call__(self, iter_result0, iter_result1):
        from polygraphy.comparator import IterationResult

        pair = (iter_result0.runner_name, iter_result1.runner_name)
        iteration = self._iterations.get(pair, 0)
        self._iterations[pair] = iteration + 1
        out = OrderedDict((k, np.asarray(v)) for k, v in iter_result0.items() if k != MARGIN_KEY)
        ref = OrderedDict((k, np.asarray(v)) for k, v in iter_result1.items() if k != MARGIN_KEY)
        margins = iter_result1[MARGIN_KEY] if MARGIN_KEY in iter_result1 else None
        rows = self.tracker.rows((*pair, iteration), out, ref, margins, self._row_fails)
        if rows:
            out = OrderedDict((k, v.copy()) for k, v in out.items())
            for row in rows:
                for name in out:
                    if name in ref and out[name].shape == ref[name].shape:
                        out[name][row] = ref[name][row].astype(out[name].dtype)
        with np.errstate(divide="ignore", invalid="ignore"):
            return super().__call__(IterationResult(out, runner_name=pair[0]),
                                    IterationResult(ref, runner_name=pair[1]))


@dataclass
class Comparison:
    """One output of one runner compared with the reference, over every case."""

    runner: str
    reference: str
    output: str
    atol: float
    rtol: float
    mean_atol: float
    passed: bool
    max_abs: float
    max_rel: float
    mean_abs: float  # the worst case's mean absolute error
    elemwise_passed: bool = True
    mean_passed: bool = True
    iterations: list[dict] = field(default_factory=list)
    ties: int = 0

    @property
    def pair(self) -> str:
        return f"{self.runner} vs {self.reference}"

    def to_json(self) -> dict:
        return {"runner": self.runner, "reference": self.reference, "output": self.output, "atol": self.atol,
                "rtol": self.rtol, "mean_atol": self.mean_atol, "passed": self.passed,
                "elemwise_passed": self.elemwise_passed, "mean_passed": self.mean_passed,
                "max_abs": _json_float(self.max_abs), "max_rel": _json_float(self.max_rel),
                "mean_abs": _json_float(self.mean_abs), "depth_ties": self.ties,
                "iterations": self.iterations}

    def failure(self) -> str:
        """Why it failed, in words ("" when it passed)."""
        why = []
        if not self.elemwise_passed:
            why.append(f"max abs {self.max_abs:.3g} / max rel {self.max_rel:.3g} over atol {self.atol:g} "
                       f"and rtol {self.rtol:g}")
        if not self.mean_passed:
            why.append(f"mean abs {self.mean_abs:.3g} over {self.mean_atol:g}")
        return "; ".join(why)


@dataclass
class ParityReport:
    model: Path
    variant: str
    precision: str
    lowering: str
    runners: list[dict]
    cases: list[Case]
    tolerances: dict[str, tuple[float, float, float]]
    tie_margin: float
    comparisons: list[Comparison]
    ties: list[dict]
    engine: dict | None
    seconds: float
    model_sha256: str = ""

    @property
    def passed(self) -> bool:
        return bool(self.comparisons) and all(c.passed for c in self.comparisons)

    @property
    def verdict(self) -> str:
        if not self.passed:
            return "FAIL"
        return f"pass ({len(self.ties)} depth tie{'s' if len(self.ties) != 1 else ''})" if self.ties else "pass"

    def mismatches(self) -> list[str]:
        return [f"{c.pair}: {c.output} {c.failure()}" for c in self.comparisons if not c.passed]

    def max_errors(self) -> dict[str, float]:
        """Worst max-abs error per output over every runner (the demo's summary)."""
        out: dict[str, float] = {}
        for c in self.comparisons:
            out[c.output] = max(out.get(c.output, 0.0), c.max_abs)
        return out

    def to_json(self) -> dict:
        return {
            "attnx_version": attnx.__version__,
            "polygraphy_version": _polygraphy_version(),
            "model": str(self.model),
            "model_sha256": self.model_sha256,
            "variant": self.variant,
            "precision": self.precision,
            "lowering": self.lowering,
            "reference": REFERENCE,
            "runners": self.runners,
            "engine": self.engine,
            "cases": [c.to_json() for c in self.cases],
            "tolerances": {k: {"atol": a, "rtol": r, "mean_atol": m} for k, (a, r, m) in self.tolerances.items()},
            "check_error_stat": ["elemwise", "mean"],
            "tie_margin": self.tie_margin,
            "comparisons": [c.to_json() for c in self.comparisons],
            "depth_ties": self.ties,
            "mismatches": self.mismatches(),
            "passed": self.passed,
            "verdict": self.verdict,
            "seconds": round(self.seconds, 3),
        }

    def write(self, path: str | os.PathLike) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return p


def _polygraphy_version() -> str:
    try:
        import polygraphy

        return polygraphy.__version__
    except Exception:  # pragma: no cover
        return "unknown"


# ============================================================================ the check


def load_reference(path: str | os.PathLike):
    """``(Encoder with the export's weights, ModelInfo)`` for an attnx export."""
    from attnx.export.exporter import load_checkpoint
    from attnx.models.registry import encoder_from_config
    from attnx.runtime.engine import read_model_info

    path = Path(path)
    info, _proto = read_model_info(path)
    if info is None:
        raise ParityError(f"{path} has no attnx metadata (not an `attnx export` file): the PyTorch reference "
                          "cannot be rebuilt")
    if not info.weights:
        raise ParityError(f"{path} names no weights file (attnx.weights): re-export it with `attnx export`")
    weights = (path.parent / info.weights)
    if not weights.is_file():
        raise ParityError(f"the reference weights {weights} named by {path.name} are missing (they are written "
                          "beside the file by `attnx export`)")
    try:
        model = encoder_from_config(info.config, seed=None)
    except (KeyError, TypeError, ValueError) as e:
        raise ParityError(f"{path}: cannot rebuild the encoder from its attnx.config ({e})") from None
    load_checkpoint(model, weights)
    return model.eval(), info


def _other_lowering_file(model, info, source: Path, folder: Path, weights_sha: str) -> tuple[Path, str]:
    """The reference re-exported with the other lowering into ``folder`` (reused while the
    weights, config and precision are the same)."""
    from attnx.export.exporter import export_encoder

    other = "rewrite" if info.lowering == "plugin" else "plugin"
    stem = source.stem
    for suffix in (f"-{info.lowering}",):
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
    path = folder / f"{stem}-{other}.onnx"
    key = hashlib.sha256(json.dumps({"config": info.config, "precision": info.precision, "lowering": other,
                                     "weights": weights_sha, "profiles": info.profiles,
                                     "attnx": attnx.__version__}, sort_keys=True).encode()).hexdigest()
    stamp = path.with_name(path.name + ".key")
    if path.is_file() and stamp.is_file() and stamp.read_text().strip() == key:
        return path, other
    folder.mkdir(parents=True, exist_ok=True)
    # torch's exporter logs a warning per missing torchvision op; nothing to do with this check.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    export_encoder(model, path, lowering=other, fp16=info.precision == "fp16", profiles=info.profiles,
                   save_weights=False)
    stamp.write_text(key + "\n")
    return path, other


def find_engine_for(model: Path) -> Path | None:
    """``<stem>.engine`` beside ``model`` when its sidecar says it was built from this file."""
    from attnx.export.exporter import sha256_file
    from attnx.runtime.engine import read_sidecar

    candidate = model.with_suffix(".engine")
    if not candidate.is_file():
        return None
    try:
        sidecar = read_sidecar(candidate)
    except ValueError:
        return None
    if sidecar and sidecar.get("onnx_sha256") == sha256_file(model):
        return candidate
    return None


def _engine_status(engine: Path, sidecar: dict | None) -> tuple[bool, str]:
    """(can run here, reason when not)."""
    from attnx.runtime import tensorrt_backend as tb

    try:
        info = tb.backend()
    except tb.TensorRTUnavailable as e:
        return False, f"no TensorRT installed here ({' '.join(str(e).split())})"
    cc = tb.gpu_compute_capability()
    if cc is None:
        return False, f"no CUDA GPU on this machine ({info.describe()} engines run on the GPU they were built for)"
    local = f"sm{cc[0]}{cc[1]}"
    target = (sidecar or {}).get("target")
    if target and target not in (local, "local"):
        return False, f"the engine was built for {target} and this GPU is {local}"
    if sidecar and sidecar.get("backend") and sidecar["backend"] != info.name:
        return False, f"the engine was built with {sidecar['backend']} and this machine has {info.name}"
    return True, ""


@contextlib.contextmanager
def _quiet_polygraphy(verbose: bool):
    from polygraphy.logger import G_LOGGER

    saved = G_LOGGER.module_severity
    try:
        import onnxruntime as ort
    except ImportError:  # pragma: no cover - a dependency
        ort = None
    ort_saved = 2  # ONNX Runtime's default (warning); it has no getter
    if not verbose:
        G_LOGGER.module_severity = G_LOGGER.CRITICAL
        if ort is not None:
            ort.set_default_logger_severity(3)  # its constant-folding warnings on fp16 graphs are noise here
    try:
        yield
    finally:
        G_LOGGER.module_severity = saved
        if ort is not None:
            ort.set_default_logger_severity(ort_saved)


def run_check(model_path: str | os.PathLike, *, engine: str | os.PathLike | None = None,
              workdir: str | os.PathLike = "attnx-out", cases: Sequence[Case] | None = None,
              case_specs: Iterable[str] | None = None, tolerances: Mapping[str, Sequence[float]] | None = None,
              plugins: str | os.PathLike | bool | None = True, verbose: bool = False,
              progress=None, seed: int = 0) -> ParityReport:
    """Compare ``model_path`` (and its other lowering, and ``engine`` where it can run) with the
    PyTorch reference. ``progress(step)`` is called with ``reference``, ``lowering``,
    ``engine``, ``run``, ``compare``. Raises :class:`ParityError` for set-up problems; a
    mismatch is a report with ``passed == False``."""
    from polygraphy.comparator import Comparator

    from attnx.export.exporter import sha256_file
    from attnx.runtime.engine import verify_engine_file

    started = time.monotonic()
    step = progress or (lambda name: None)
    model_path = Path(model_path)

    step("reference")
    model, info = load_reference(model_path)
    precision = info.precision if info.precision in TOLERANCES else "fp32"
    tol = {k: tuple(v) for k, v in TOLERANCES[precision].items()}
    for k, v in (tolerances or {}).items():  # (atol, rtol[, mean_atol])
        v = [float(x) for x in v]
        tol[k] = (v[0], v[1], v[2] if len(v) > 2 else tol.get(k, TOLERANCES[precision]["output"])[2])
    output_names = [o["name"] for o in info.outputs]
    tol = {k: v for k, v in tol.items() if k in output_names}
    for name in output_names:
        tol.setdefault(name, TOLERANCES[precision]["output"])
    weights_sha = sha256_file(model_path.parent / info.weights)

    # The engine: verify it before any long work, decide whether it can run here.
    engine_info: dict | None = None
    engine_runner = None
    profiles = {k: list(v) for k, v in (info.profiles or {}).items()}
    model_sha = sha256_file(model_path)
    if engine is not None:
        step("engine")
        engine = Path(engine)
        sidecar = verify_engine_file(engine)
        if sidecar is not None and sidecar.get("onnx_sha256") and sidecar["onnx_sha256"] != model_sha:
            raise ParityError(f"{engine.name} was built from {sidecar.get('onnx_name', 'another file')} "
                              f"(sha256 {sidecar['onnx_sha256'][:12]}), not from {model_path.name}: pass the ONNX "
                              "it was built from, or rebuild the engine")
        engine_profiles = (sidecar or {}).get("profiles") or {}
        for axis, rng in engine_profiles.items():  # cases must fit both the model's and the engine's
            if axis in profiles:
                profiles[axis] = [max(profiles[axis][0], rng[0]), min(max(profiles[axis][1], rng[0]), rng[2]),
                                  min(profiles[axis][2], rng[2])]
            else:
                profiles[axis] = list(rng)
        runnable, reason = _engine_status(engine, sidecar)
        engine_info = {"path": str(engine), "sidecar": sidecar is not None, "ran": False,
                       "target": (sidecar or {}).get("target"), "backend": (sidecar or {}).get("backend")}
        if runnable:
            runner = EngineRunner(engine, plugins=plugins)
            try:
                runner.open()
                engine_runner = runner
                engine_info["ran"] = True
            except Exception as e:  # EngineUnavailable, a plugin library that does not load, ...
                reason = " ".join(str(e).split())
        if not engine_info["ran"]:
            engine_info["reason"] = reason
            if sidecar is None:
                engine_info["reason"] += " (and it has no sidecar, so it was not verified either)"

    where = "engine's" if engine is not None else "model's"
    if cases is None:
        cases = parse_cases(case_specs, profiles, where) if case_specs else default_cases(profiles)
    else:
        for c in cases:
            _check_in_profile(c.batch, c.seq, profiles, where)
    if not cases:
        raise ParityError("no input cases to check")

    step("lowering")
    other_path, other = _other_lowering_file(model, info, model_path, Path(workdir) / "parity", weights_sha)

    runners = [TorchReferenceRunner(model, info.inputs, output_names)]
    by_lowering = {info.lowering: model_path, other: other_path}
    for lowering in LOWERINGS:
        runners.append(_onnxrt_runner(by_lowering[lowering], f"onnxrt-{lowering}"))
    if engine_runner is not None:
        runners.append(engine_runner)
    runner_info = [{"name": REFERENCE, "kind": "pytorch", "path": str(model_path.parent / info.weights)}]
    runner_info += [{"name": f"onnxrt-{lw}", "kind": "onnxruntime", "path": str(by_lowering[lw]),
                     "given": lw == info.lowering} for lw in LOWERINGS]
    if engine is not None:
        runner_info.append({"name": "tensorrt", "kind": "tensorrt", "path": str(engine),
                            "ran": engine_runner is not None, **({} if engine_runner is not None else
                                                                  {"reason": engine_info["reason"]})})

    loader = ParityDataLoader(model, info.inputs, cases, seed=seed)
    tracker = _TieTracker(TIE_MARGIN[precision])
    atol = {k: v[0] for k, v in tol.items()}
    rtol = {k: v[1] for k, v in tol.items()}
    compare_funcs = [
        TieAwareCompareFunc(tracker=tracker, atol=atol, rtol=rtol, check_error_stat="elemwise"),
        # rtol 0: the mean relative error is meaningless next to near-zero reference values.
        TieAwareCompareFunc(tracker=tracker, atol={k: v[2] for k, v in tol.items()}, rtol=0.0,
                            check_error_stat="mean", row_atol=atol, row_rtol=rtol),
    ]
    step("run")
    try:
        with _quiet_polygraphy(verbose):
            results = Comparator.run(runners, data_loader=loader)
            step("compare")
            accuracy = Comparator.compare_accuracy(results, comparisons=[(i, 0) for i in range(1, len(runners))],
                                                   compare_func=compare_funcs)
    except Exception as e:
        from polygraphy.exception import PolygraphyException

        if isinstance(e, PolygraphyException):
            raise ParityError(f"Polygraphy could not run the comparison: {' '.join(str(e).split())[:400]}") from None
        raise
    finally:
        if engine_runner is not None:
            engine_runner.close()

    comparisons = _summarize(accuracy[0], accuracy[1], tol, tracker.ties, cases)
    return ParityReport(model=model_path, variant=info.variant, precision=precision, lowering=info.lowering,
                        runners=runner_info, cases=list(cases), tolerances=tol, tie_margin=TIE_MARGIN[precision],
                        comparisons=comparisons, ties=tracker.ties, engine=engine_info,
                        seconds=time.monotonic() - started, model_sha256=model_sha)


def _summarize(elemwise, mean, tol, ties, cases) -> list[Comparison]:
    out = []
    for (runner, reference), iterations in elemwise.items():
        mean_iterations = mean[(runner, reference)] if (runner, reference) in mean else []
        names = list(dict.fromkeys(name for it in iterations for name in it))
        for name in names:
            per_iter = []
            elem_ok = mean_ok = True
            max_abs = max_rel = worst_mean = 0.0
            for i, it in enumerate(iterations):
                res = it.get(name)
                mres = mean_iterations[i].get(name) if i < len(mean_iterations) else None
                ok_e = bool(res) if res is not None else False
                ok_m = bool(mres) if mres is not None else False
                elem_ok &= ok_e
                mean_ok &= ok_m
                abs_i = _finite(getattr(res, "max_absdiff", None))
                rel_i = 0.0 if abs_i == 0.0 else _finite(getattr(res, "max_reldiff", None))
                mean_i = _finite(getattr(res, "mean_absdiff", None))
                per_iter.append({"case": cases[i].label() if i < len(cases) else str(i), "passed": ok_e and ok_m,
                                 "max_abs": _json_float(abs_i), "max_rel": _json_float(rel_i),
                                 "mean_abs": _json_float(mean_i)})
                max_abs, max_rel, worst_mean = max(max_abs, abs_i), max(max_rel, rel_i), max(worst_mean, mean_i)
            atol, rtol, mean_atol = tol.get(name, (0.0, 0.0, 0.0))
            n_ties = sum(1 for t in ties if t["runner"] == runner)
            out.append(Comparison(runner=runner, reference=reference, output=name, atol=atol, rtol=rtol,
                                  mean_atol=mean_atol, passed=elem_ok and mean_ok, max_abs=max_abs, max_rel=max_rel,
                                  mean_abs=worst_mean, elemwise_passed=elem_ok, mean_passed=mean_ok,
                                  iterations=per_iter, ties=n_ties))
    return out


def _json_float(value: float) -> float | None:
    return value if np.isfinite(value) else None


def _finite(value) -> float:
    if value is None:
        return float("inf")
    value = float(value)
    return value if np.isfinite(value) else float("inf")
