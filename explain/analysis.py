"""What each attention head does: entropy and pattern scores, and a primary pattern or "mixed".

    behaviors = analyze_cache(cache, mask, is_causal=True)     # from a run_with_cache cache
    behaviors = analyze_patterns({0: p0, 3: p3}, mask, sinks=special)   # from any [B, H, L, L] arrays
    print(format_behaviors(behaviors))

The numbers are computed with numpy (float64), so the deployed side (an ONNX export's
``attentions.{i}``, the server's ``/explain`` page) analyses without torch; torch tensors are
accepted anywhere an array is. Running a torch model and analysing its heads in one call is
:func:`attnx.interp.analysis.analyze_heads`.

Definitions (per head, pooled over every valid query row of every example)
-------------------------------------------------------------------------
A query row ``i`` is *valid* when token ``i`` is real (``attention_mask == 1``)
and it has at least one allowed key. Allowed keys are the real tokens, and for a
causal model only ``j <= i``. ``f`` is the example's first real position (the
BOS / [CLS] / first token; with left padding it is not 0). The *sink set* ``S`` is
``{f}`` plus, when ``sinks`` marks them, the special tokens ([CLS], [SEP], BOS, EOS):
the places heads park attention when they have nothing to do.

- ``entropy``: ``-sum_j A[i, j] log A[i, j]`` in nats, averaged over valid rows.
  A uniform pattern over ``n`` allowed keys gives ``log n``; a one-hot gives 0.
- Each pattern is a *target set* ``T(i)`` of keys for query ``i``:

  ============== ====================================================================
  previous_token ``{i - 1}``
  first_token    ``S``: the first token and the other sinks ("first-token / sink")
  self           ``{i}`` (the diagonal)
  local_window   keys with ``1 <= |i - j| <= window`` other than ``i - 1``
                 (nearby context beyond the immediate previous token)
  ============== ====================================================================

  The sets are kept disjoint so one behaviour cannot score on two labels: a sink is
  removed from the other sets (row ``f + 1``'s previous token *is* the first token, so it
  counts for neither), and ``first_token`` leaves out ``i`` and ``i - 1`` for the same
  reason (rows ``f`` and ``f + 1`` drop out when ``S = {f}``). Only allowed keys count.

- ``mass[p]``: the attention mass on ``T(i)`` (in [0, 1]), averaged over rows.
- ``scores[p]``: mass normalised to *lift over a uniform head*, so the four
  patterns are comparable although their target sets have different sizes and
  rows have different numbers of keys::

      chance(i) = |T(i)| / |allowed(i)|               # mass a uniform row would give
      lift(i)   = (mass(i) - chance(i)) / (1 - chance(i))

  1 = all attention on the target, 0 = no more than a uniform head, negative =
  avoids the target. It is averaged over the valid rows where the target is
  non-empty and ``chance < 1`` (a row with one key, or whose every key is the
  target, says nothing about the head). A pattern with no such row is NaN.

When a score *stands out* (the primary pattern)
-----------------------------------------------
A head is labelled with a pattern only when that pattern's score stands out
(:class:`Standout`): it is at least ``min_score`` (default 0.5: the head moved at
least half of the way from a uniform head to putting everything on the target) *and*
leads the runner-up by at least ``min_margin`` (default 0.2: a head that splits its
attention between two behaviours is not called one of them). Otherwise the head is
``"mixed"`` (diffuse heads, heads doing something none of the four patterns describe,
heads doing two things); ``"none"`` when no score is defined (e.g. a one-token input).
``best_pattern`` is the highest score whatever its size.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence

import numpy as np

PATTERNS: tuple[str, ...] = ("previous_token", "first_token", "self", "local_window")
#: How the patterns read in tables and on the page.
PATTERN_TITLES = {"previous_token": "previous token", "first_token": "first token / sink", "self": "self",
                  "local_window": "local window"}
MIXED = "mixed"
NO_PATTERN = "none"


@dataclass(frozen=True)
class Standout:
    """When a pattern's score stands out enough to name the head after it (module docstring)."""

    min_score: float = 0.5
    min_margin: float = 0.2

    def __post_init__(self) -> None:
        if not -1.0 <= self.min_score <= 1.0:
            raise ValueError(f"min_score must be in [-1, 1] (a lift over uniform), got {self.min_score}")
        if self.min_margin < 0:
            raise ValueError(f"min_margin must be >= 0, got {self.min_margin}")


DEFAULT_STANDOUT = Standout()


@dataclass
class HeadBehavior:
    """One head's summary (see the module docstring for what each number means)."""

    layer: int
    head: int
    entropy: float  # mean nats over valid query rows
    scores: dict[str, float]  # lift over uniform per pattern, comparable across patterns
    primary_pattern: str  # the pattern whose score stands out, else "mixed" ("none": no score defined)
    mass: dict[str, float] = field(default_factory=dict)  # raw mean attention mass on each target set

    @property
    def best_pattern(self) -> str:
        """The highest-scoring pattern (ties: the order of :data:`PATTERNS`), standing out or not."""
        ranked = _ranked(self.scores)
        return ranked[0][1] if ranked else NO_PATTERN

    @property
    def primary_score(self) -> float:
        return self.scores.get(self.best_pattern, float("nan"))

    def to_dict(self) -> dict:
        return asdict(self)


def _ranked(scores: Mapping[str, float]) -> list[tuple[float, str]]:
    """(score, name) best first; NaN scores left out; ties keep the order of PATTERNS."""
    finite = [(s, n) for n, s in scores.items() if not math.isnan(s)]
    order = {n: i for i, n in enumerate(PATTERNS)}
    return sorted(finite, key=lambda sn: (-sn[0], order.get(sn[1], len(order))))


def primary_pattern(scores: Mapping[str, float], standout: Standout = DEFAULT_STANDOUT) -> str:
    """The pattern that stands out (:class:`Standout`), ``"mixed"`` if none does, ``"none"`` without scores."""
    ranked = _ranked(scores)
    if not ranked:
        return NO_PATTERN
    best, name = ranked[0]
    runner_up = ranked[1][0] if len(ranked) > 1 else -1.0
    if best >= standout.min_score and best - runner_up >= standout.min_margin:
        return name
    return MIXED


# --------------------------------------------------------------------------- the numbers


def _as_array(x, name: str) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor, without importing torch here
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def _target_sets(valid_k: np.ndarray, sinks: np.ndarray | None, is_causal: bool,
                 window: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """allowed ``[B, L, L]`` and the disjoint target sets ``[B, L, L]`` (bool) per pattern."""
    b, l = valid_k.shape
    allowed = np.broadcast_to(valid_k[:, None, :], (b, l, l))  # [B, Lq, Lk]: real keys
    if is_causal:
        allowed = allowed & np.tri(l, dtype=bool)[None]
    i = np.arange(l)[:, None]  # [Lq, 1]
    j = np.arange(l)[None, :]  # [1, Lk]
    first = valid_k.argmax(axis=-1)  # [B]: first real position (argmax of a bool row = its first True)
    sink = (j[None] == first[:, None, None])  # [B, 1, Lk]
    if sinks is not None:
        sink = sink | (sinks & valid_k)[:, None, :]
    diag, prev = (i == j)[None], (j == i - 1)[None]  # [1, Lq, Lk]
    near = (np.abs(i - j) <= window)[None] & ~diag & ~prev
    targets = {
        "previous_token": prev & ~sink,
        "first_token": sink & ~diag & ~prev,
        "self": diag & ~sink,
        "local_window": near & ~sink,
    }
    return allowed, {k: (t & allowed) for k, t in targets.items()}


def pattern_stats(pattern, attention_mask=None, *, is_causal: bool = False, window: int = 3,
                  sinks=None) -> dict[str, np.ndarray]:
    """Per-head numbers of one layer's pattern ``[B, H, L, L]`` (numpy or torch).

    ``sinks`` ``[B, L]`` (bool) marks special tokens that join the first token's sink set.
    Returns ``entropy`` ``[H]``, and for each name in :data:`PATTERNS` ``score_<name>``
    and ``mass_<name>`` ``[H]`` (NaN where no row is eligible). Definitions: module docstring.
    """
    p = _as_array(pattern, "pattern").astype(np.float64)  # float64: entropy sums of many small terms
    if p.ndim != 4 or p.shape[-1] != p.shape[-2]:
        raise ValueError(f"pattern: expected [B, H, L, L], got {list(p.shape)}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    b, h, l, _ = p.shape
    valid_k = np.ones((b, l), dtype=bool)
    if attention_mask is not None:
        valid_k = _as_array(attention_mask, "attention_mask")
        if tuple(valid_k.shape) != (b, l):
            raise ValueError(f"attention_mask: expected shape [{b}, {l}] to match the pattern, "
                             f"got {list(valid_k.shape)}")
        valid_k = valid_k.astype(bool)
    sink_mask = None
    if sinks is not None:
        sink_mask = _as_array(sinks, "sinks")
        if tuple(sink_mask.shape) != (b, l):
            raise ValueError(f"sinks: expected shape [{b}, {l}] to match the pattern, got {list(sink_mask.shape)}")
        sink_mask = sink_mask.astype(bool)
    allowed, targets = _target_sets(valid_k, sink_mask, is_causal, window)
    n_allowed = allowed.sum(-1)  # [B, Lq]
    q_valid = valid_k & (n_allowed > 0)  # [B, Lq]: real query rows with something to attend to

    def row_mean(v: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """v [B, H, Lq] averaged over rows [B, Lq] -> [H] (NaN if no row)."""
        count = rows.sum()
        if count == 0:
            return np.full((h,), np.nan)
        return (v * rows[:, None]).sum(axis=(0, 2)) / count

    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    out = {"entropy": row_mean(-plogp.sum(-1), q_valid)}
    for name, t in targets.items():
        k = t.sum(-1)  # [B, Lq] target keys per row
        chance = k / np.maximum(n_allowed, 1)  # [B, Lq] what a uniform row puts on the target
        eligible = q_valid & (k > 0) & (chance < 1)
        mass = np.einsum("bhqk,bqk->bhq", p, t.astype(np.float64))  # [B, H, Lq]
        lift = (mass - chance[:, None]) / np.maximum(1 - chance[:, None], 1e-12)
        out[f"mass_{name}"] = row_mean(mass, eligible)
        out[f"score_{name}"] = row_mean(lift, eligible)
    return out


_PATTERN_KEY = re.compile(r"(?:^|\.)blocks\.(\d+)\.attn\.hook_pattern$")


def pattern_keys(cache: Mapping[str, object]) -> dict[int, str]:
    """``{layer: cache key}`` of the attention patterns in a cache. Keys may be the encoder's
    (``blocks.3.attn.hook_pattern``) or carry a prefix (``encoder.blocks.3.attn.hook_pattern``,
    what ``hooks.run_with_cache`` gives for a model wrapping the encoder)."""
    found: dict[int, str] = {}
    for key in cache:
        m = _PATTERN_KEY.search(key) if isinstance(key, str) else None
        if m:
            layer = int(m.group(1))
            if layer in found:
                raise ValueError(f"two patterns for layer {layer} in the cache: {found[layer]!r} and {key!r}")
            found[layer] = key
    return dict(sorted(found.items()))


def analyze_patterns(patterns: Mapping[int, object], attention_mask=None, *, is_causal: bool | Sequence[bool] = False,
                     window: int = 3, sinks=None, standout: Standout = DEFAULT_STANDOUT) -> list[HeadBehavior]:
    """:class:`HeadBehavior` per (layer, head) of ``{layer: [B, H, L, L]}`` patterns, layers in order.

    ``is_causal`` (one bool, or one per layer) tells which keys were allowed, which sets the chance level.
    """
    layers = sorted(patterns)
    if not layers:
        raise ValueError("no attention patterns to analyse")
    causal = [bool(is_causal)] * len(layers) if isinstance(is_causal, bool) else [bool(c) for c in is_causal]
    if len(causal) != len(layers):
        raise ValueError(f"is_causal has {len(causal)} entries for {len(layers)} layers")
    result = []
    for layer, c in zip(layers, causal):
        stats = pattern_stats(patterns[layer], attention_mask, is_causal=c, window=window, sinks=sinks)
        for head in range(stats["entropy"].shape[0]):
            scores = {n: float(stats[f"score_{n}"][head]) for n in PATTERNS}
            result.append(HeadBehavior(layer=layer, head=head, entropy=float(stats["entropy"][head]), scores=scores,
                                       primary_pattern=primary_pattern(scores, standout),
                                       mass={n: float(stats[f"mass_{n}"][head]) for n in PATTERNS}))
    return result


def analyze_cache(cache: Mapping[str, object], attention_mask=None, *, layers: Sequence[int] | None = None,
                  is_causal: bool | Sequence[bool] = False, window: int = 3, sinks=None,
                  standout: Standout = DEFAULT_STANDOUT) -> list[HeadBehavior]:
    """:class:`HeadBehavior` per (layer, head) from a cache holding
    ``blocks.{i}.attn.hook_pattern`` (e.g. from ``run_with_cache``; see :func:`pattern_keys`)."""
    keys = pattern_keys(cache)
    available = list(keys)
    if layers is None:
        layers = available
    if not layers:
        raise ValueError("the cache holds no blocks.{i}.attn.hook_pattern; run with names_filter covering them")
    missing = [i for i in layers if i not in available]
    if missing:
        raise ValueError(f"the cache has no hook_pattern for layer(s) {missing}; it has {available}")
    causal = [bool(is_causal)] * len(layers) if isinstance(is_causal, bool) else list(is_causal)
    if len(causal) != len(layers):
        raise ValueError(f"is_causal has {len(causal)} entries for {len(layers)} layers")
    by_layer = dict(zip(layers, causal))
    ordered = sorted(layers)
    return analyze_patterns({i: cache[keys[i]] for i in ordered}, attention_mask,
                            is_causal=[by_layer[i] for i in ordered], window=window, sinks=sinks, standout=standout)


def format_behaviors(behaviors: Sequence[HeadBehavior]) -> str:
    """A plain-text table (one row per head) for logs and examples."""
    lines = [f"{'layer':>5} {'head':>4} {'entropy':>8}  " + " ".join(f"{n[:11]:>11}" for n in PATTERNS) + "  primary"]
    for b in behaviors:
        lines.append(f"{b.layer:>5} {b.head:>4} {b.entropy:>8.3f}  "
                     + " ".join(f"{b.scores[n]:>11.3f}" for n in PATTERNS) + f"  {b.primary_pattern}")
    return "\n".join(lines)
