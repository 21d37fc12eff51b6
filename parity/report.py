"""What a parity check found: :class:`Comparison` (one output of one runner against the reference,
over every case), :class:`ParityReport` (the verdict, mismatches in words, the JSON report), and
:func:`summarize`, which builds the comparisons from Polygraphy's accuracy results.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import attnx
from attnx.parity.cases import Case
from attnx.parity.runners import REFERENCE


def _json_float(value: float) -> float | None:
    return value if np.isfinite(value) else None


def _finite(value) -> float:
    if value is None:
        return float("inf")
    value = float(value)
    return value if np.isfinite(value) else float("inf")


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
                "mean_abs": _json_float(self.mean_abs), "ties": self.ties, "iterations": self.iterations}

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
    tie_margins: dict[str, float]  # {exact output: the margin under which a difference is a tie}
    comparisons: list[Comparison]
    ties: list[dict]
    engine: dict | None
    seconds: float
    model_sha256: str = ""

    @property
    def passed(self) -> bool:
        return bool(self.comparisons) and all(c.passed for c in self.comparisons)

    @property
    def exact_outputs(self) -> list[str]:
        return [name for name, (atol, rtol, _m) in self.tolerances.items() if atol == 0 and rtol == 0]

    @property
    def verdict(self) -> str:
        if not self.passed:
            return "FAIL"
        return f"pass ({len(self.ties)} tie{'s' if len(self.ties) != 1 else ''})" if self.ties else "pass"

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
            "tie_margins": self.tie_margins,
            "comparisons": [c.to_json() for c in self.comparisons],
            "ties": self.ties,
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


def _iteration_stats(res, mres, label: str) -> tuple[bool, bool, float, float, float, dict]:
    ok_e = bool(res) if res is not None else False
    ok_m = bool(mres) if mres is not None else False
    abs_i = _finite(getattr(res, "max_absdiff", None))
    rel_i = 0.0 if abs_i == 0.0 else _finite(getattr(res, "max_reldiff", None))
    mean_i = _finite(getattr(res, "mean_absdiff", None))
    row = {"case": label, "passed": ok_e and ok_m, "max_abs": _json_float(abs_i), "max_rel": _json_float(rel_i),
           "mean_abs": _json_float(mean_i)}
    return ok_e, ok_m, abs_i, rel_i, mean_i, row


def summarize(elemwise, mean, tol, ties, cases) -> list[Comparison]:
    """Comparisons from Polygraphy's two accuracy results (the elementwise and the mean check)."""
    out = []
    for (runner, reference), iterations in elemwise.items():
        mean_iterations = mean[(runner, reference)] if (runner, reference) in mean else []
        names = list(dict.fromkeys(name for it in iterations for name in it))
        n_ties = sum(1 for t in ties if t["runner"] == runner)
        for name in names:
            per_iter = []
            elem_ok = mean_ok = True
            max_abs = max_rel = worst_mean = 0.0
            for i, it in enumerate(iterations):
                mres = mean_iterations[i].get(name) if i < len(mean_iterations) else None
                label = cases[i].label() if i < len(cases) else str(i)
                ok_e, ok_m, abs_i, rel_i, mean_i, row = _iteration_stats(it.get(name), mres, label)
                elem_ok &= ok_e
                mean_ok &= ok_m
                per_iter.append(row)
                max_abs, max_rel, worst_mean = max(max_abs, abs_i), max(max_rel, rel_i), max(worst_mean, mean_i)
            atol, rtol, mean_atol = tol.get(name, (0.0, 0.0, 0.0))
            out.append(Comparison(runner=runner, reference=reference, output=name, atol=atol, rtol=rtol,
                                  mean_atol=mean_atol, passed=elem_ok and mean_ok, max_abs=max_abs, max_rel=max_rel,
                                  mean_abs=worst_mean, elemwise_passed=elem_ok, mean_passed=mean_ok,
                                  iterations=per_iter, ties=n_ties))
    return out
