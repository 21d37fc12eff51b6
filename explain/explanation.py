"""Explaining a model on real text, from whatever runs it (a :class:`~attnx.explain.source.Source`).

    source = open_source("minilm.onnx")                          # attnx.interp.source
    ex = explain(source, ["The cat sat on the mat"])             # patterns + per-head analysis
    report = ablate_layer(source, ex.batch, layer=0)              # each head of layer 0 through head_mask
    cmp = compare_contexts(source, ["..."], ctx_a, ctx_b)         # one input under two context values

Everything here is numpy over ``source.run`` (the export's outputs ``attentions.{i}`` and its
``head_mask`` input), so the same code explains an ONNX file, a running server and a torch model;
comparing two sources (an export and its torch reference) is comparing two calls. The table that
adds activation patching on the torch model (``attnx explain --ablate``) is
:func:`attnx.interp.patching.ablation_table`.

Output effects (:func:`output_effect`), by the model's main output:

- ``sentence_embedding``: ``1 - cos(ablated, baseline)`` per example;
- ``logits`` (causal LMs): the drop of the target token's logit at each example's last real position
  (target: ``target_id``, default the baseline's top prediction there);
- ``last_hidden_state`` / ``output``: ``1 - cos`` per real token, averaged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from attnx.explain.analysis import DEFAULT_STANDOUT, HeadBehavior, Standout, analyze_patterns
from attnx.explain.source import (
    EncodedBatch, ExplainError, ModelFacts, Source, attention_output_name,
)


@dataclass
class Explanation:
    """Patterns and analysis of one batch of texts under one context and head mask."""

    facts: ModelFacts
    batch: EncodedBatch
    patterns: dict[int, np.ndarray]  # layer -> [B, H, L, L]
    behaviors: list[HeadBehavior]
    outputs: dict[str, np.ndarray]  # the main output and the extra (aux) outputs
    context: dict[str, np.ndarray] = field(default_factory=dict)
    head_mask: np.ndarray | None = None

    @property
    def main(self) -> np.ndarray:
        return self.outputs[self.facts.main_output]

    def behavior(self, layer: int, head: int) -> HeadBehavior:
        return next(b for b in self.behaviors if (b.layer, b.head) == (layer, head))


def full_context(facts: ModelFacts, batch: EncodedBatch, given: Mapping[str, np.ndarray] | None) -> dict:
    """Context feeds for the batch: the given values (one example's, repeated per row) and zeros for
    the inputs not given (zeros are in range for integer ids too)."""
    given = dict(given or {})
    rows, length = batch.feeds["input_ids"].shape if "input_ids" in batch.feeds else (1, 1)
    out = {}
    for spec in facts.context_inputs:
        if spec.name in given:
            arr = np.asarray(given[spec.name])
            out[spec.name] = np.repeat(arr, rows, axis=0) if arr.shape[:1] == (1,) and rows > 1 else arr
            continue
        shape = [rows if d == "batch" else length if d == "seq" else d for d in spec.shape]
        out[spec.name] = np.zeros(shape, dtype=np.dtype(spec.dtype))
    return out


def _feeds(source: Source, batch: EncodedBatch, context, head_mask) -> dict[str, np.ndarray]:
    feeds = {**batch.feeds, **full_context(source.facts, batch, context)}
    if head_mask is not None:
        feeds["head_mask"] = source.facts.check_head_mask(head_mask)
    elif source.facts.head_mask:  # sent explicitly: a runtime that does not default it still runs
        feeds["head_mask"] = np.ones((source.facts.n_layers, source.facts.n_heads), dtype=np.float32)
    return feeds


def run_outputs(source: Source, batch: EncodedBatch, outputs: Sequence[str], *, context=None,
                head_mask=None) -> dict[str, np.ndarray]:
    """``source.run`` on the batch with its context (zeros where not given) and an optional head mask."""
    return source.run(_feeds(source, batch, context, head_mask), list(outputs))


def explain(source: Source, texts: str | Sequence[str] | EncodedBatch, *, layers: Sequence[int] | None = None,
            context: Mapping[str, np.ndarray] | None = None, head_mask=None, window: int = 3,
            standout: Standout = DEFAULT_STANDOUT) -> Explanation:
    """Run the texts once with the chosen layers' patterns and analyse every head of them.

    Special tokens ([CLS], [SEP], BOS) join the first token as attention sinks (analysis docstring)."""
    facts = source.facts
    facts.require_patterns()
    chosen = list(facts.attention_layers) if layers is None else [facts.check_layer(i, needs_pattern=True)
                                                                   for i in layers]
    batch = texts if isinstance(texts, EncodedBatch) else source.require_text().encode(texts)
    wanted = [facts.main_output] + [e.name for e in facts.extra_outputs] + [attention_output_name(i) for i in chosen]
    out = run_outputs(source, batch, wanted, context=context, head_mask=head_mask)
    patterns = {i: np.asarray(out[attention_output_name(i)], dtype=np.float32) for i in chosen}
    behaviors = analyze_patterns(patterns, batch.attention_mask, is_causal=facts.is_causal, window=window,
                                 sinks=batch.special, standout=standout)
    kept = {k: v for k, v in out.items() if not k.startswith("attentions.")}
    return Explanation(facts, batch, patterns, behaviors, kept, dict(context or {}),
                       None if head_mask is None else np.asarray(head_mask, dtype=np.float32))


# --------------------------------------------------------------------------- output effects


def _cosine_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    na, nb = np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)
    return 1.0 - (a * b).sum(-1) / np.maximum(na * nb, 1e-30)


def last_positions(mask: np.ndarray) -> np.ndarray:
    """Each example's last real position ``[B]`` (right padding)."""
    return mask.shape[1] - 1 - np.argmax(mask[:, ::-1] > 0, axis=1)


@dataclass
class OutputMetric:
    """How a change of the main output is measured (see the module docstring)."""

    output: str
    description: str
    target_ids: np.ndarray | None = None  # logits: the target token per example

    def effect(self, baseline: np.ndarray, changed: np.ndarray, mask: np.ndarray) -> float:
        """One number, larger = the output moved more (or the target logit fell more)."""
        if self.target_ids is not None:
            pos = last_positions(mask)
            rows = np.arange(len(pos))
            drop = baseline[rows, pos, self.target_ids] - changed[rows, pos, self.target_ids]
            return float(drop.astype(np.float64).mean())
        d = _cosine_distance(baseline, changed)
        if d.ndim == 2:  # per token: real tokens only
            return float((d * mask).sum() / max(mask.sum(), 1))
        return float(d.mean())


def output_metric(facts: ModelFacts, baseline: np.ndarray, mask: np.ndarray, target_id: int | None = None) -> OutputMetric:
    name = facts.main_output
    if name == "logits":
        pos = last_positions(mask)
        if target_id is None:
            targets = baseline[np.arange(len(pos)), pos].argmax(-1)
            how = "the baseline's top next token"
        else:
            vocab = baseline.shape[-1]
            if not 0 <= int(target_id) < vocab:
                raise ExplainError(f"target token id {target_id} out of range (vocabulary of {vocab})")
            targets = np.full(len(pos), int(target_id))
            how = f"token id {int(target_id)}"
        return OutputMetric(name, f"drop of the logit of {how} at the last token", targets.astype(np.int64))
    if name == "sentence_embedding":
        return OutputMetric(name, "1 - cosine(sentence_embedding, baseline)")
    return OutputMetric(name, f"1 - cosine({name}, baseline), mean over real tokens")


# --------------------------------------------------------------------------- head ablation


@dataclass
class AblationReport:
    """Each head of one layer ablated alone through ``head_mask``; ``effects[h]`` per :class:`OutputMetric`."""

    layer: int
    metric: OutputMetric
    effects: list[float]

    @property
    def ranking(self) -> list[int]:
        """Heads, largest effect first."""
        return sorted(range(len(self.effects)), key=lambda h: (-self.effects[h], h))


def ablate_layer(source: Source, batch: EncodedBatch, layer: int, *, context=None, target_id: int | None = None,
                 heads: Sequence[int] | None = None) -> AblationReport:
    """Ablate each head of ``layer`` (``head_mask[layer, h] = 0``) and measure the main output's change."""
    facts = source.facts
    facts.require_head_mask()
    layer = facts.check_layer(layer)
    heads = list(range(facts.n_heads)) if heads is None else [facts.check_head(h) for h in heads]
    ones = np.ones((facts.n_layers, facts.n_heads), dtype=np.float32)
    main = facts.main_output
    base = run_outputs(source, batch, [main], context=context, head_mask=ones)[main]
    metric = output_metric(facts, base, batch.attention_mask, target_id)
    effects = [float("nan")] * facts.n_heads
    for h in heads:
        mask = ones.copy()
        mask[layer, h] = 0.0
        out = run_outputs(source, batch, [main], context=context, head_mask=mask)[main]
        effects[h] = metric.effect(base, out, batch.attention_mask)
    return AblationReport(layer, metric, effects)


# --------------------------------------------------------------------------- two context values


@dataclass
class HeadDifference:
    layer: int
    head: int
    max_abs: float  # largest |A - B| weight over real query rows and keys
    mean_abs: float  # mean over real query rows of sum_k |A - B| / 2 (total variation, in [0, 1])


@dataclass
class ContextComparison:
    """One input under two context values: both explanations, per-head differences, output distance."""

    a: Explanation
    b: Explanation
    differences: list[HeadDifference]
    output_distance: dict[str, float]

    def difference(self, layer: int, head: int) -> HeadDifference:
        return next(d for d in self.differences if (d.layer, d.head) == (layer, head))


def pattern_differences(a: Mapping[int, np.ndarray], b: Mapping[int, np.ndarray], mask: np.ndarray) -> list[HeadDifference]:
    real = mask.astype(bool)
    rows = real[:, None, :, None] & real[:, None, None, :]  # [B, 1, Lq, Lk]: real query rows and keys
    out = []
    for layer in sorted(a):
        diff = np.abs(a[layer].astype(np.float64) - b[layer].astype(np.float64)) * rows
        tv = diff.sum(-1) / 2  # [B, H, Lq]: total variation distance per query row
        n_rows = max(int(real.sum()), 1)
        for h in range(diff.shape[1]):
            out.append(HeadDifference(layer, h, float(diff[:, h].max()), float(tv[:, h].sum() / n_rows)))
    return out


def compare_contexts(source: Source, texts, context_a: Mapping, context_b: Mapping, *, layers=None,
                     window: int = 3, standout: Standout = DEFAULT_STANDOUT) -> ContextComparison:
    """Explain the same texts under ``context_a`` and ``context_b``; inputs given in only one of
    them take that value in both (only the differing inputs differ)."""
    facts = source.facts
    if not facts.context_inputs:
        raise ExplainError(f"{facts.name} takes no context inputs ({facts.variant!r} attention): nothing to compare")
    a = {**context_b, **context_a}
    b = {**context_a, **context_b}
    batch = texts if isinstance(texts, EncodedBatch) else source.require_text().encode(texts)
    ex_a = explain(source, batch, layers=layers, context=a, window=window, standout=standout)
    ex_b = explain(source, batch, layers=layers, context=b, window=window, standout=standout)
    diffs = pattern_differences(ex_a.patterns, ex_b.patterns, batch.attention_mask)
    mask = batch.attention_mask
    metric = output_metric(facts, ex_a.main, mask)
    distance = {"metric": metric.description, "value": metric.effect(ex_a.main, ex_b.main, mask),
                "max_abs": float(np.abs(ex_a.main.astype(np.float64) - ex_b.main).max())}
    return ContextComparison(ex_a, ex_b, diffs, distance)
