"""Tolerances and the tie-aware compare function.

**Tolerances** ``(atol, rtol, mean_atol)`` per output and precision. Two Polygraphy checks per
output: ``elemwise`` (an element fails when it exceeds both atol and rtol) and ``mean`` (the mean
absolute error must stay under mean_atol), so the loose fp16 elementwise bound cannot hide a small
systematic error. Float outputs start from :data:`DEFAULT_TOLERANCES`; exact outputs
(``ExtraOutput.exact``, and any integer output) are :data:`EXACT`; each variant the model uses may
override an output's bound (``VariantSpec.tolerances[precision][output]``; with several, the loosest).
The fp16 defaults come from measurements (ONNX Runtime CPU on the fp16 file vs the fp32 reference,
d_model 32 and 256, 2 layers, batch 1-16, seq 1-512): worst element 2.8e-2, worst per-case mean 7.9e-4.

**Ties.** An exact output whose variant declares a decision margin (``ExtraOutput.margin``, e.g.
the top-1 minus top-2 policy logit behind a chosen depth) may legitimately differ in fp16 where the
reference's margin is under ``ExtraOutput.tie_margin[precision]``. Such rows are *reported* as ties
(:class:`TieTracker`) and left out of that comparison's statistics; a difference at a clear
margin is a failure.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Mapping, Sequence

import numpy as np

from attnx.contract import Role, TensorEntry
from attnx.parity.runners import MARGIN_PREFIX

Tolerance = tuple[float, float, float]

#: Float outputs, per precision, unless a variant says otherwise.
DEFAULT_TOLERANCES: dict[str, Tolerance] = {"fp32": (1e-4, 1e-4, 1e-5), "fp16": (5e-2, 5e-2, 2e-3),
                                             "int8": (1.5e-1, 1.5e-1, 2e-2)}  # 8-bit weights and activations
EXACT: Tolerance = (0.0, 0.0, 0.0)


def variant_specs(model) -> list:
    """The ``VariantSpec`` of every variant the model's blocks use, once each."""
    specs: dict[str, object] = {}
    for block in getattr(model, "blocks", []):
        specs.setdefault(block.spec.name, block.spec)
    return list(specs.values())


def resolve_tolerances(model, outputs: Sequence[TensorEntry], precision: str,
                       overrides: Mapping[str, Sequence[float]] | None = None) -> dict[str, Tolerance]:
    """``{output: (atol, rtol, mean_atol)}`` for a model's outputs (see the module doc);
    ``overrides`` (``{output: (atol, rtol[, mean_atol])}``) come last."""
    specs = variant_specs(model)
    exact = {e.name for spec in specs for e in spec.extra_outputs if e.exact}
    base = DEFAULT_TOLERANCES.get(precision, DEFAULT_TOLERANCES["fp32"])
    tol: dict[str, Tolerance] = {}
    for out in outputs:
        integer = np.dtype(out.dtype).kind in "iub"
        given = [spec.tolerances[precision][out.name] for spec in specs
                 if out.name in spec.tolerances.get(precision, {})]
        if given:
            tol[out.name] = tuple(max(values) for values in zip(*given))  # type: ignore[assignment]
        else:
            tol[out.name] = EXACT if out.name in exact or integer else base
    for name, value in (overrides or {}).items():
        if name in tol:
            v = [float(x) for x in value]
            tol[name] = (v[0], v[1], v[2] if len(v) > 2 else tol[name][2])
    return tol


def tie_margins(model, precision: str) -> dict[str, float]:
    """``{output: margin}``: exact outputs whose variants declare a decision margin, and the margin
    (reference, at ``precision``) under which a different value is a tie."""
    out: dict[str, float] = {}
    for spec in variant_specs(model):
        for extra in spec.extra_outputs:
            if extra.exact and extra.margin is not None:
                # int8's noise is at least fp16's: a spec without an int8 margin gets its fp16 one
                margin = extra.tie_margin.get(precision, extra.tie_margin.get("fp16", 0.0) if precision == "int8" else 0.0)
                out[extra.name] = max(out.get(extra.name, 0.0), float(margin))
    return out


def main_outputs(outputs: Sequence[TensorEntry]) -> list[str]:
    """The model's main float outputs (role ``output``): the rows a tie may change."""
    return [o.name for o in outputs if o.role == Role.OUTPUT and np.dtype(o.dtype).kind == "f"]


def _rows_differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    diff = np.asarray(a != b)
    return diff.reshape(diff.shape[0], -1).any(axis=1) if diff.ndim else np.array([bool(diff)])


class TieTracker:
    """Decides once per (runner pair, iteration) which rows are ties (shared by the compare
    functions, so the elementwise and the mean checks exclude the same rows)."""

    def __init__(self, margins: Mapping[str, float], main: Sequence[str]):
        self.margins = dict(margins)
        self.main = list(main)
        self.ties: list[dict] = []
        self._rows: dict[tuple[str, str, int], list[int]] = {}

    def rows(self, key, out, ref, row_fails) -> list[int]:
        if key in self._rows:
            return self._rows[key]
        rows: set[int] = set()
        for name, tie_margin in self.margins.items():
            layer_margins = ref.get(MARGIN_PREFIX + name)
            if layer_margins is None or name not in out or name not in ref or out[name].shape != ref[name].shape:
                continue
            layer_margins = np.asarray(layer_margins, dtype=np.float64)  # [layers, B]
            min_margin = layer_margins.min(axis=0)
            main_bad = np.zeros(min_margin.shape, dtype=bool)
            row_abs = np.zeros(min_margin.shape)
            for m in self.main:
                if m in out and m in ref and out[m].shape == ref[m].shape:
                    main_bad |= row_fails(m, out[m], ref[m])
                    absdiff = np.abs(out[m].astype(np.float64) - ref[m].astype(np.float64))
                    row_abs = np.maximum(row_abs, absdiff.reshape(absdiff.shape[0], -1).max(axis=1))
            flagged = (min_margin < tie_margin) & (_rows_differ(out[name], ref[name]) | main_bad)
            for row in np.nonzero(flagged)[0].tolist():
                rows.add(row)
                self.ties.append({"runner": key[0], "reference": key[1], "iteration": key[2], "row": int(row),
                                  "output": name, "reference_value": np.asarray(ref[name][row]).tolist(),
                                  "value": np.asarray(out[name][row]).tolist(), "margin": float(min_margin[row]),
                                  "layer_margins": [float(v) for v in layer_margins[:, row]],
                                  "tie_margin": tie_margin, "row_max_abs": float(row_abs[row])})
        self._rows[key] = sorted(rows)
        return self._rows[key]


def _compare_func_base():
    from polygraphy.comparator import SimpleCompareFunc

    return SimpleCompareFunc


class TieAwareCompareFunc(_compare_func_base()):
    """Polygraphy's ``SimpleCompareFunc`` (per-output atol/rtol, one error statistic) plus ties.

    Called as ``(runner_result, reference_result)``. Tie rows (:class:`TieTracker`) are replaced
    by the reference's values before Polygraphy compares, so they neither fail the check nor
    vanish from the report (the tracker keeps them). Differences at a clear margin go to
    Polygraphy unchanged (and fail)."""

    def __init__(self, *, tracker: TieTracker, atol, rtol, check_error_stat: str = "elemwise",
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
        out = OrderedDict((k, np.asarray(v)) for k, v in iter_result0.items() if not k.startswith(MARGIN_PREFIX))
        ref = OrderedDict((k, np.asarray(v)) for k, v in iter_result1.items())
        rows = self.tracker.rows((*pair, iteration), out, ref, self._row_fails)
        ref = OrderedDict((k, v) for k, v in ref.items() if not k.startswith(MARGIN_PREFIX))
        if rows:
            out = OrderedDict((k, v.copy()) for k, v in out.items())
            for row in rows:
                for name in out:
                    if name in ref and out[name].shape == ref[name].shape:
                        out[name][row] = ref[name][row].astype(out[name].dtype)
        with np.errstate(divide="ignore", invalid="ignore"):
            return super().__call__(IterationResult(out, runner_name=pair[0]),
                                    IterationResult(ref, runner_name=pair[1]))
