"""What each attention head does: entropy and pattern scores from a cached run.

    behaviors = analyze_heads(model, x, mask)              # runs the model, caches hook_pattern
    behaviors = analyze_cache(cache, mask, is_causal=True) # or from a cache you already have
    for b in behaviors:
        print(b.layer, b.head, b.primary_pattern, b.scores, b.entropy)

Works on anything whose attention feeds ``blocks.{i}.attn.hook_pattern``
``[B, H, Lq, Lk]`` (every attnx encoder, and the pretrained hosts that wrap one).

Definitions (per head, pooled over every valid query row of every example)
-------------------------------------------------------------------------
A query row ``i`` is *valid* when token ``i`` is real (``attention_mask == 1``)
and it has at least one allowed key. Allowed keys are the real tokens, and for a
causal model only ``j <= i``. ``f`` is the example's first real position (the
BOS / first token; with left padding it is not 0).

- ``entropy``: ``-sum_j A[i, j] log A[i, j]`` in nats, averaged over valid rows.
  A uniform pattern over ``n`` allowed keys gives ``log n``; a one-hot gives 0.
- Each pattern is a *target set* ``T(i)`` of keys for query ``i``:

  ============== ====================================================================
  previous_token ``{i - 1}``
  first_token    ``{f}`` (attention parked on the first token, "BOS sink")
  self           ``{i}`` (the diagonal)
  local_window   keys with ``1 <= |i - j| <= window`` other than ``i - 1`` and ``f``
                 (nearby context beyond the immediate previous token)
  ============== ====================================================================

  The sets are kept disjoint so one behaviour cannot score on two labels: a key
  that is also ``f`` is removed from the other sets (row ``f + 1``'s previous
  token *is* the first token, so it counts for neither), and ``first_token``
  skips rows ``f`` and ``f + 1`` for the same reason. Only allowed keys count.

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
- ``primary_pattern``: the pattern with the highest score (ties: the order of
  :data:`PATTERNS`). It is always set, so a diffuse head still gets a label;
  check ``primary_score`` (or pass ``min_score``) to call such heads ``"diffuse"``.
  ``"none"`` when no score is defined (e.g. a one-token input).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence

import torch
from torch import nn

from attnx.interp.hooks import run_with_cache

PATTERNS: tuple[str, ...] = ("previous_token", "first_token", "self", "local_window")


@dataclass
class HeadBehavior:
    """One head's summary (see the module docstring for what each number means)."""

    layer: int
    head: int
    entropy: float  # mean nats over valid query rows
    scores: dict[str, float]  # lift over uniform per pattern, comparable across patterns
    primary_pattern: str  # argmax of scores (or "diffuse" under min_score)
    mass: dict[str, float] = field(default_factory=dict)  # raw mean attention mass on each target set

    @property
    def primary_score(self) -> float:
        return self.scores.get(self.primary_pattern, float("nan"))

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- running the model


def _n_layers(model: nn.Module) -> int:
    enc = getattr(model, "encoder", model)
    return len(enc.blocks)


def cache_patterns(model: nn.Module, inputs: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                   layers: Sequence[int] | None = None, fwd_hooks: Sequence = (), **context) -> dict[str, torch.Tensor]:
    """Run ``model(inputs, attention_mask, **context)`` once (no grad) and return
    ``{"blocks.{i}.attn.hook_pattern": [B, H, Lq, Lk]}`` for the chosen layers.

    ``fwd_hooks`` (hook name, fn) run before the caching, so an intervention (e.g. a
    replaced pattern or an ablated head upstream) is what gets analysed.
    """
    n = _n_layers(model)
    layers = list(range(n)) if layers is None else [int(i) for i in layers]
    for i in layers:
        if not 0 <= i < n:
            raise ValueError(f"layer {i} out of range: the model has {n} layers")
    names = [f"blocks.{i}.attn.hook_pattern" for i in layers]
    with torch.no_grad():
        _, cache = run_with_cache(model, inputs, attention_mask, names_filter=names, fwd_hooks=fwd_hooks, **context)
    return {n_: cache[n_] for n_ in names}


# --------------------------------------------------------------------------- the numbers


def _target_sets(valid_k: torch.Tensor, is_causal: bool, window: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """allowed ``[B, L, L]`` and the disjoint target sets ``[B, L, L]`` (bool) per pattern."""
    b, l = valid_k.shape
    dev = valid_k.device
    allowed = valid_k[:, None, :].expand(b, l, l)  # [B, Lq, Lk]: real keys
    if is_causal:
        allowed = allowed & torch.ones(l, l, dtype=torch.bool, device=dev).tril()
    i = torch.arange(l, device=dev)[:, None]  # [Lq, 1]
    j = torch.arange(l, device=dev)[None, :]  # [1, Lk]
    # First real position per example (argmax of a bool row = its first True).
    first = valid_k.int().argmax(dim=-1)  # [B]
    is_first = (j == first[:, None, None])  # [B, 1, Lk]
    diag, prev = (i == j), (j == i - 1)  # [Lq, Lk]
    near = ((i - j).abs() <= window) & ~diag & ~prev
    targets = {
        "previous_token": prev & ~is_first,
        "first_token": is_first & ~diag & ~prev,  # rows f and f+1 drop out: ambiguous with self/previous
        "self": diag & ~is_first,
        "local_window": near & ~is_first,
    }
    return allowed, {k: (t & allowed) for k, t in targets.items()}


def pattern_stats(pattern: torch.Tensor, attention_mask: torch.Tensor | None = None, *, is_causal: bool = False,
                  window: int = 3) -> dict[str, torch.Tensor]:
    """Per-head numbers of one layer's pattern ``[B, H, L, L]``.

    Returns ``entropy`` ``[H]``, and for each name in :data:`PATTERNS` ``score_<name>``
    and ``mass_<name>`` ``[H]`` (NaN where no row is eligible). Definitions: module docstring.
    """
    if pattern.dim() != 4 or pattern.shape[-1] != pattern.shape[-2]:
        raise ValueError(f"pattern: expected [B, H, L, L], got {list(pattern.shape)}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    b, h, l, _ = pattern.shape
    p = pattern.detach().double()  # float64: entropy sums of many small terms
    if attention_mask is None:
        valid_k = torch.ones(b, l, dtype=torch.bool, device=p.device)
    else:
        if tuple(attention_mask.shape) != (b, l):
            raise ValueError(f"attention_mask: expected shape [{b}, {l}] to match the pattern, "
                             f"got {list(attention_mask.shape)}")
        valid_k = attention_mask.to(p.device).bool()
    allowed, targets = _target_sets(valid_k, is_causal, window)
    n_allowed = allowed.sum(-1)  # [B, Lq]
    q_valid = valid_k & (n_allowed > 0)  # [B, Lq]: real query rows with something to attend to

    def row_mean(v: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """v [B, H, Lq] averaged over rows [B, Lq] -> [H] (NaN if no row)."""
        count = rows.sum()
        if count == 0:
            return torch.full((h,), float("nan"), dtype=torch.float64)
        return (v * rows[:, None].to(v.dtype)).sum(dim=(0, 2)).cpu() / count.cpu()

    out = {"entropy": row_mean(-torch.xlogy(p, p).sum(-1), q_valid)}  # [B, H, Lq] -> [H]
    for name, t in targets.items():
        k = t.sum(-1)  # [B, Lq] target keys per row
        chance = k.to(p.dtype) / n_allowed.clamp(min=1).to(p.dtype)  # [B, Lq] what a uniform row puts on the target
        eligible = q_valid & (k > 0) & (chance < 1)
        mass = (p * t[:, None].to(p.dtype)).sum(-1)  # [B, H, Lq]
        lift = (mass - chance[:, None]) / (1 - chance[:, None]).clamp(min=1e-12)
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


def _primary(scores: dict[str, float], min_score: float | None) -> str:
    finite = [(s, -PATTERNS.index(n), n) for n, s in scores.items() if not math.isnan(s)]
    if not finite:
        return "none"
    best, _, name = max(finite)
    if min_score is not None and best < min_score:
        return "diffuse"
    return name


def analyze_cache(cache: Mapping[str, torch.Tensor], attention_mask: torch.Tensor | None = None, *,
                  layers: Sequence[int] | None = None, is_causal: bool | Sequence[bool] = False,
                  window: int = 3, min_score: float | None = None) -> list[HeadBehavior]:
    """:class:`HeadBehavior` per (layer, head) from a cache holding
    ``blocks.{i}.attn.hook_pattern`` (e.g. from ``run_with_cache``; see :func:`pattern_keys`).

    ``is_causal`` (one bool, or one per analysed layer) tells which keys were allowed,
    which sets the chance level; ``analyze_heads`` reads it from the model.
    """
    keys = pattern_keys(cache)
    available = list(keys)
    if layers is None:
        layers = available
    if not layers:
        raise ValueError("the cache holds no blocks.{i}.attn.hook_pattern; run with names_filter covering them")
    missing = [i for i in layers if i not in available]
    if missing:
        raise ValueError(f"the cache has no hook_pattern for layer(s) {missing}; it has {available}")
    causal = [bool(is_causal)] * len(layers) if isinstance(is_causal, bool) else [bool(c) for c in is_causal]
    if len(causal) != len(layers):
        raise ValueError(f"is_causal has {len(causal)} entries for {len(layers)} layers")
    result = []
    for layer, c in zip(layers, causal):
        stats = pattern_stats(cache[keys[layer]], attention_mask, is_causal=c, window=window)
        for head in range(stats["entropy"].shape[0]):
            scores = {n: float(stats[f"score_{n}"][head]) for n in PATTERNS}
            result.append(HeadBehavior(layer=layer, head=head, entropy=float(stats["entropy"][head]), scores=scores,
                                       primary_pattern=_primary(scores, min_score),
                                       mass={n: float(stats[f"mass_{n}"][head]) for n in PATTERNS}))
    return result


def analyze_heads(model: nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                  layers: Sequence[int] | None = None, window: int = 3, min_score: float | None = None,
                  fwd_hooks: Sequence = (), **context) -> list[HeadBehavior]:
    """Run ``model`` once and analyse its heads.

    ``model`` is an :class:`~attnx.models.encoder.Encoder` (``hidden_states`` ``[B, L, d_model]``)
    or a wrapper with ``.encoder`` taking token ids (``GPT2LM``: pass ``input_ids``).
    ``context`` holds the variant's extra inputs (``cultural=...``); ``fwd_hooks`` are
    applied during the run (analyse a model under an intervention).
    """
    cache = cache_patterns(model, hidden_states, attention_mask, layers=layers, fwd_hooks=fwd_hooks, **context)
    enc = getattr(model, "encoder", model)
    chosen = list(pattern_keys(cache))
    causal = [bool(getattr(enc.blocks[i].attn.config, "is_causal", False)) for i in chosen]
    return analyze_cache(cache, attention_mask, layers=chosen, is_causal=causal, window=window, min_score=min_score)


def format_behaviors(behaviors: Sequence[HeadBehavior]) -> str:
    """A plain-text table (one row per head) for logs and examples."""
    lines = [f"{'layer':>5} {'head':>4} {'entropy':>8}  " + " ".join(f"{n[:10]:>10}" for n in PATTERNS) + "  primary"]
    for b in behaviors:
        lines.append(f"{b.layer:>5} {b.head:>4} {b.entropy:>8.3f}  "
                     + " ".join(f"{b.scores[n]:>10.3f}" for n in PATTERNS) + f"  {b.primary_pattern}")
    return "\n".join(lines)
