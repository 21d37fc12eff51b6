"""Head analysis of a torch model: run it once with the hook points cached, then analyse the
patterns with :mod:`attnx.explain.analysis` (numpy; the definitions are there).

    behaviors = analyze_heads(model, x, mask)           # runs the model, caches hook_pattern
    print(format_behaviors(behaviors))                  # attnx.explain.analysis.format_behaviors
"""

from __future__ import annotations

from typing import Sequence

import torch

from attnx.explain.analysis import DEFAULT_STANDOUT, HeadBehavior, Standout, analyze_cache, pattern_keys
from attnx.models.hooks import run_with_cache


def _n_layers(model) -> int:
    enc = getattr(model, "encoder", model)
    return len(enc.blocks)


def cache_patterns(model, inputs, attention_mask=None, *, layers: Sequence[int] | None = None,
                   fwd_hooks: Sequence = (), **context) -> dict[str, object]:
    """Run ``model(inputs, attention_mask, **context)`` once (no grad) and return
    ``{"blocks.{i}.attn.hook_pattern": [B, H, Lq, Lk]}`` for the chosen layers.

    ``fwd_hooks`` (hook name, fn) run before the caching, so an intervention (e.g. a
    replaced pattern or an ablated head upstream) is what gets analysed.
    """
    n = _n_layers(model)
    layers = list(range(n)) if layers is None else [int(i) for i in layers]
    for i in layers:
        if not 0 <= i < n:
            raise ValueError(f"layer {i} out of range: the model has {n} layers (0..{n - 1})")
    names = [f"blocks.{i}.attn.hook_pattern" for i in layers]
    with torch.no_grad():
        _, cache = run_with_cache(model, inputs, attention_mask, names_filter=names, fwd_hooks=fwd_hooks, **context)
    return {n_: cache[n_] for n_ in names}


def analyze_heads(model, hidden_states, attention_mask=None, *, layers: Sequence[int] | None = None, window: int = 3,
                  standout: Standout = DEFAULT_STANDOUT, sinks=None, fwd_hooks: Sequence = (),
                  **context) -> list[HeadBehavior]:
    """Run a torch ``model`` once and analyse its heads.

    ``model`` is an :class:`~attnx.models.encoder.Encoder` (``hidden_states`` ``[B, L, d_model]``)
    or a wrapper with ``.encoder`` taking token ids (``GPT2LM``: pass ``input_ids``).
    ``context`` holds the variant's extra inputs; ``fwd_hooks`` are applied during the run
    (analyse a model under an intervention).
    """
    cache = cache_patterns(model, hidden_states, attention_mask, layers=layers, fwd_hooks=fwd_hooks, **context)
    enc = getattr(model, "encoder", model)
    chosen = list(pattern_keys(cache))
    causal = [bool(getattr(enc.blocks[i].attn.config, "is_causal", False)) for i in chosen]
    return analyze_cache(cache, attention_mask, layers=chosen, is_causal=causal, window=window, sinks=sinks,
                         standout=standout)
