"""Per-sentence comparisons of a pretrained export (:mod:`attnx.parity.pretrained`) and their report.

Each output of a runner is compared with a reference (the original model, or attnx's torch
reference) row by row, i.e. sentence by sentence, over the sentence's real tokens only (every axis
named ``seq`` is cut at the sentence's length). Figures per sentence: the largest absolute
difference, the cosine similarity (of the row for ``[batch, d]`` outputs such as
``sentence_embedding``; for outputs with positions, the lowest over the sentence's positions of the
cosine along the last axis), and for next-token scores (:data:`SCORE_OUTPUTS`) the share of
positions whose top-1 token agrees.

What must hold (:func:`gates`), by the file's precision:

- ``fp32``: every float output's max abs difference <= :data:`FP32_ATOL` (for next-token scores,
  whose size grows with the vocabulary and the model, relative to the sentence's largest |score|),
  or, where the model itself amplifies fp32 rounding beyond that, <= :data:`FLOOR_FACTOR` times its
  *fp32 floor* on that sentence: how far attnx's own fp32 reference is from the same model run in
  float64. A trained SMAL in MiniLM at unit-scale trace is such a model: there the fp32 reference is
  up to 2.3e-3 from float64 and no fp32 runtime can hold 1e-4 (its exact fast rewrite in torch is
  4.5e-3 away). Two fp32 computations in different summation orders land at different distances from
  the exact result, measured up to 3.7x apart on one sentence (ONNX Runtime vs the reference), so
  the factor is 10: still an order of magnitude below a real defect (a wrong weight or mask moves
  outputs by 1e-2 and more). Near-neutral models have floors of ~1e-6, so 1e-4 is what holds there;
- ``fp16`` / ``int8``: the sentence-level output's cosine >= :data:`COSINE` (``sentence_embedding``;
  without one, the main outputs' per-position cosine); the other float outputs are reported;
- exact outputs (integers, e.g. a variant's depth choice): equal, except ties at a decision margin
  under the variant's ``tie_margin`` (reported, as in :mod:`attnx.parity.compare`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

import attnx
from attnx.contract import SEQ, Role, TensorEntry
from attnx.parity.report import _json_float, _polygraphy_version

FP32_ATOL = 1e-4
FLOOR_FACTOR = 10.0
COSINE = {"fp16": 0.999, "int8": 0.99}  # int8 with smoothing: worst built-in sentence 0.995 ("Ok."); docs/performance.md
#: Unnormalised next-token scores: fp32 bound relative to their size, top-1 agreement reported.
SCORE_OUTPUTS = ("logits",)
SENTENCE_OUTPUT = "sentence_embedding"


@dataclass(frozen=True)
class Gate:
    metric: str  # max_abs | cosine | exact | report
    bound: float = 0.0

    def describe(self) -> str:
        return {"max_abs": f"max abs <= {self.bound:g}", "cosine": f"cosine >= {self.bound:g}",
                "exact": "exact (ties reported)", "report": "reported"}[self.metric]


def gates(precision: str, outputs: Sequence[TensorEntry], exact: set[str]) -> dict[str, Gate]:
    """``{output: Gate}`` for a file of ``precision`` (see the module doc)."""
    out: dict[str, Gate] = {}
    floats = [o for o in outputs if np.dtype(o.dtype).kind == "f"]
    if precision == "fp32":
        out.update({o.name: Gate("max_abs", FP32_ATOL) for o in floats})
    else:
        bound = COSINE.get(precision, COSINE["fp16"])
        names = {o.name for o in floats}
        sentence = [SENTENCE_OUTPUT] if SENTENCE_OUTPUT in names else \
            [o.name for o in floats if o.role == Role.OUTPUT]
        out.update({o.name: Gate("cosine", bound) if o.name in sentence else Gate("report") for o in floats})
    out.update({o.name: Gate("exact") for o in outputs if o.name in exact or np.dtype(o.dtype).kind in "iub"})
    return out


def _real(arr: np.ndarray, row: int, length: int, shape: Sequence) -> np.ndarray:
    """Row ``row`` of ``arr`` cut at ``length`` along every axis the metadata names ``seq``."""
    index = [row] + [slice(0, length) if i < len(shape) and shape[i] == SEQ else slice(None)
                     for i in range(1, arr.ndim)]
    return arr[tuple(index)]


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a2 = a.reshape(-1, a.shape[-1]) if a.ndim > 1 else a.reshape(1, -1)
    b2 = b.reshape(-1, b.shape[-1]) if b.ndim > 1 else b.reshape(1, -1)
    na, nb = np.linalg.norm(a2, axis=1), np.linalg.norm(b2, axis=1)
    dot = (a2 * b2).sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        cos = np.where((na == 0) & (nb == 0), 1.0, dot / (na * nb))
    return float(np.nan_to_num(cos, nan=-1.0).min()) if cos.size else 1.0


def row_figures(out: np.ndarray, ref: np.ndarray, row: int, length: int, entry: TensorEntry) -> dict:
    """The figures of one sentence (see the module doc)."""
    a = _real(np.asarray(out), row, length, entry.shape).astype(np.float64)
    b = _real(np.asarray(ref), row, length, entry.shape).astype(np.float64)
    if a.shape != b.shape:
        return {"max_abs": float("inf"), "cosine": -1.0, "scale": 1.0, "shape": [list(a.shape), list(b.shape)]}
    figures = {"max_abs": float(np.abs(a - b).max()) if a.size else 0.0, "cosine": _cosine(a, b),
               "scale": max(1.0, float(np.abs(b).max())) if b.size else 1.0}
    if np.isnan(a).any():
        figures["max_abs"] = float("nan")
    if entry.name in SCORE_OUTPUTS and a.ndim >= 2:
        figures["top1"] = float((a.argmax(-1) == b.argmax(-1)).mean())
    return figures


@dataclass
class TextComparison:
    """One output of one runner against one reference, sentence by sentence."""

    runner: str
    reference: str
    output: str
    gate: Gate
    rows: list[dict] = field(default_factory=list)  # {"text": i, "max_abs", "cosine", ["top1"], "passed", ["tie"]}

    def add(self, text: int, figures: dict, tie: dict | None = None, floor: float | None = None) -> None:
        g = self.gate
        extra = {}
        if g.metric == "max_abs":
            bound = g.bound * (figures["scale"] if self.output in SCORE_OUTPUTS else 1.0)
            if floor is not None:
                extra["fp32_floor"] = floor
                bound = max(bound, FLOOR_FACTOR * floor)
            extra["bound"] = bound
            passed = figures["max_abs"] <= bound  # False for NaN
        elif g.metric == "cosine":
            passed = figures["cosine"] >= g.bound
        elif g.metric == "exact":
            passed = figures["max_abs"] == 0 or tie is not None
        else:
            passed = True
        row = {"text": text, **{k: v for k, v in figures.items() if k != "shape"}, **extra, "passed": bool(passed)}
        if tie is not None:
            row["tie"] = tie
        self.rows.append(row)

    @property
    def passed(self) -> bool:
        return all(r["passed"] for r in self.rows)

    @property
    def gated(self) -> bool:
        return self.gate.metric != "report"

    @property
    def pair(self) -> str:
        return f"{self.runner} vs {self.reference}"

    def worst(self, key: str) -> float:
        values = [r[key] for r in self.rows if key in r]
        if not values:
            return float("nan")
        if any(np.isnan(v) for v in values):
            return float("nan")
        return min(values) if key in ("cosine", "top1") else max(values)

    def failure(self) -> str:
        bad = [r for r in self.rows if not r["passed"]]
        key = "cosine" if self.gate.metric == "cosine" else "max_abs"
        worst = min(bad, key=lambda r: r[key]) if key == "cosine" else max(bad, key=lambda r: r[key])
        return (f"{self.gate.describe()} fails for {len(bad)} of {len(self.rows)} sentence(s) "
                f"(worst: sentence {worst['text']}, {key} {worst[key]:.3g})")

    def to_json(self) -> dict:
        rows = [{k: (_json_float(v) if isinstance(v, float) else v) for k, v in r.items()} for r in self.rows]
        return {"runner": self.runner, "reference": self.reference, "output": self.output,
                "gate": {"metric": self.gate.metric, "bound": self.gate.bound, "text": self.gate.describe()},
                "passed": self.passed, "max_abs": _json_float(self.worst("max_abs")),
                "min_cosine": _json_float(self.worst("cosine")), "sentences": rows}


@dataclass
class TextParityReport:
    """What a pretrained export's parity check found (the CLI renders it; :meth:`write` saves the JSON)."""

    model: Path
    variant: str
    precision: str
    lowering: str
    host: str
    placement: dict
    texts: list[dict]  # {"index", "text", "tokens", "truncated", ["left_out"]}
    tokenizer: dict
    original: dict
    runners: list[dict]
    comparisons: list[TextComparison]
    engine: dict | None
    notes: list[str]
    seconds: float
    model_sha256: str = ""
    batches: list[list[int]] = field(default_factory=list)
    kind: str = "pretrained"

    @property
    def passed(self) -> bool:
        """Every comparison that ran holds (an engine that could not run is :attr:`engine_unchecked`)."""
        return bool(self.comparisons) and all(c.passed for c in self.comparisons)

    @property
    def engine_unchecked(self) -> str | None:
        """Why the engine given to the check did not run here (None when it ran or none was given)."""
        if self.engine is None or self.engine.get("ran"):
            return None
        return str(self.engine.get("reason") or "it cannot run on this machine")

    @property
    def ties(self) -> list[dict]:
        return [{"runner": c.runner, "reference": c.reference, "output": c.output, **r["tie"], "text": r["text"]}
                for c in self.comparisons for r in c.rows if "tie" in r]

    @property
    def verdict(self) -> str:
        """``FAIL``, ``engine not run`` (never a pass: the engine asked for was not checked), or ``pass``."""
        if not self.passed:
            return "FAIL"
        if self.engine_unchecked:
            return "engine not run"
        n = len(self.ties)
        return f"pass ({n} tie{'s' if n != 1 else ''})" if n else "pass"

    def text_label(self, index: int, width: int = 40) -> str:
        """``sentence 3 ("Transformers process all...")``: how a report names a sentence."""
        text = " ".join(str(self.texts[index]["text"]).split()) if 0 <= index < len(self.texts) else ""
        return f'sentence {index} ("{text[:width - 3] + "..." if len(text) > width else text}")'

    def mismatches(self) -> list[str]:
        out = []
        for c in self.comparisons:
            if not c.passed:
                bad = [r["text"] for r in c.rows if not r["passed"]]
                out.append(f"{c.pair}: {c.output} {c.failure()}; failing: "
                           + ", ".join(self.text_label(i) for i in bad[:3]) + (" ..." if len(bad) > 3 else ""))
        return out

    def max_errors(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in self.comparisons:
            out[c.output] = max(out.get(c.output, 0.0), c.worst("max_abs"))
        return out

    def to_json(self) -> dict:
        return {
            "attnx_version": attnx.__version__, "polygraphy_version": _polygraphy_version(), "kind": self.kind,
            "model": str(self.model), "model_sha256": self.model_sha256, "variant": self.variant,
            "precision": self.precision, "lowering": self.lowering, "host": self.host, "placement": self.placement,
            "original": self.original, "tokenizer": self.tokenizer, "texts": self.texts, "batches": self.batches,
            "runners": self.runners, "engine": self.engine, "notes": self.notes,
            "comparisons": [c.to_json() for c in self.comparisons], "ties": self.ties,
            "mismatches": self.mismatches(), "passed": self.passed, "verdict": self.verdict,
            "engine_unchecked": self.engine_unchecked,
            "seconds": round(self.seconds, 3),
        }

    def write(self, path: str | os.PathLike) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_json(), indent=2, allow_nan=False) + "\n")
        return p


def compare_iteration(comparisons: dict, results: Mapping[str, Mapping[str, np.ndarray]],
                      pair_gates: Mapping[tuple[str, str], Mapping[str, Gate]], entries: Mapping[str, TensorEntry],
                      indices: Sequence[int], lengths: Sequence[int], margins: Mapping[str, np.ndarray],
                      tie_margins: Mapping[str, float], floors: Mapping[str, Sequence[float]] | None = None) -> None:
    """Add one batch's rows to ``comparisons`` (``{(runner, reference, output): TextComparison}``).
    ``pair_gates[(runner, reference)]``: what must hold for that pair; ``margins``: the torch
    reference's decision margins (``{output: [layers, batch]}``), which tell a tie from an error;
    ``floors``: each output's fp32 floor per row (see the module doc)."""
    floors = floors or {}
    for (runner, reference), output_gates in pair_gates.items():
        out, ref = results.get(runner), results.get(reference)
        if out is None or ref is None:
            continue
        for name, gate in output_gates.items():
            if name not in out or name not in ref:
                continue
            comp = comparisons.setdefault((runner, reference, name), TextComparison(runner, reference, name, gate))
            for row, (text, length) in enumerate(zip(indices, lengths)):
                figures = row_figures(out[name], ref[name], row, length, entries[name])
                tie = None
                if gate.metric == "exact" and figures["max_abs"] != 0 and name in margins:
                    margin = float(np.asarray(margins[name])[:, row].min())
                    if margin < tie_margins.get(name, 0.0):
                        tie = {"margin": margin, "tie_margin": tie_margins[name],
                               "value": np.asarray(out[name])[row].tolist(),
                               "reference_value": np.asarray(ref[name])[row].tolist()}
                floor = floors[name][row] if name in floors else None
                comp.add(text, figures, tie, floor)


def fp32_floors(ref32: Mapping[str, np.ndarray], ref64: Mapping[str, np.ndarray], entries: Mapping[str, TensorEntry],
                lengths: Sequence[int]) -> dict[str, list[float]]:
    """``{output: [per-row max abs of the fp32 reference minus the float64 one]}`` over real tokens."""
    out = {}
    for name, value in ref32.items():
        if name in ref64 and name in entries and np.asarray(value).dtype.kind == "f":
            out[name] = [row_figures(value, ref64[name], row, n, entries[name])["max_abs"]
                         for row, n in enumerate(lengths)]
    return out
