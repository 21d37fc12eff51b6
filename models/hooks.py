"""Interpretability on any attnx model: caches, hooks, head ablation, activation patching.

Hook names are the modules' qualified names, TransformerLens-style:
``blocks.3.attn.hook_pattern``, ``blocks.0.hook_resid_post``, ... ::

    out, cache = run_with_cache(model, x, mask)
    cache["blocks.0.attn.hook_pattern"]                     # [B, H, Lq, Lk]
    out = run_with_hooks(model, x, mask, fwd_hooks=[("blocks.0.attn.hook_z", fn)])
    out = model(x, mask, head_mask=hm)                      # hm [n_layers, H], 0 ablates a head
    fn = patch_hook(clean_cache, "blocks.1.attn.hook_z", heads=[2], positions=[4])
    scores = patch_heads(model, clean, corrupted, metric)   # [n_layers, H] patching sweep
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from attnx.models.common import HookPoint

HookFn = Callable[[torch.Tensor, HookPoint], torch.Tensor | None]
NameFilter = str | Sequence[str] | Callable[[str], bool] | None


def hook_points(model: nn.Module) -> dict[str, HookPoint]:
    """Every hook point of ``model`` by name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, HookPoint)}


def _matches(names_filter: NameFilter, name: str) -> bool:
    if names_filter is None:
        return True
    if callable(names_filter):
        return bool(names_filter(name))
    if isinstance(names_filter, str):
        return name == names_filter
    return name in names_filter


@contextlib.contextmanager
def hooks(model: nn.Module, fwd_hooks: Iterable[tuple[str | Callable[[str], bool], HookFn]]):
    """Attach hooks for the duration of the block (removed even on error)."""
    points = hook_points(model)
    attached: list[HookPoint] = []
    try:
        for name, fn in fwd_hooks:
            targets = [p for n, p in points.items() if _matches(name, n)]
            if not targets:
                raise ValueError(f"no hook point matches {name!r}; e.g. {', '.join(list(points)[:6])}, ...")
            for p in targets:
                p.add(fn)
                attached.append(p)
        yield model
    finally:
        for p in attached:
            p.clear()


def run_with_hooks(model: nn.Module, *args, fwd_hooks=(), **kwargs):
    """Run ``model`` with hook functions that may observe or replace activations."""
    with hooks(model, fwd_hooks):
        return model(*args, **kwargs)


class ActivationCache(dict):
    """name -> activation; ``cache.pattern(layer)`` etc. for the common ones."""

    def pattern(self, layer: int) -> torch.Tensor:
        return self[f"blocks.{layer}.attn.hook_pattern"]

    def z(self, layer: int) -> torch.Tensor:
        return self[f"blocks.{layer}.attn.hook_z"]


def run_with_cache(model: nn.Module, *args, names_filter: NameFilter = None, detach: bool = True, **kwargs):
    """Run ``model`` and return ``(output, cache)`` of the hook points that match ``names_filter``."""
    cache = ActivationCache()

    # Key by the qualified name under ``model`` (what names_filter matched), not ``hook.name``:
    # the latter is only set by Encoder and is "" on a bare attention module.
    def saver(name: str) -> HookFn:
        def save(x: torch.Tensor, hook: HookPoint):
            cache[name] = x.detach() if detach else x
        return save

    names = [n for n in hook_points(model) if _matches(names_filter, n)]
    with hooks(model, [(n, saver(n)) for n in names]):
        out = model(*args, **kwargs)
    return out, cache


# Which axes of an activation hold heads and positions, by hook name suffix.
_HEAD_AXES = {"hook_q": (2, 1), "hook_k": (2, 1), "hook_v": (2, 1), "hook_z": (2, 1),
              "hook_attn_scores": (1, 2), "hook_pattern": (1, 2)}


def patch_hook(cache: dict, name: str, heads: Sequence[int] | None = None,
               positions: Sequence[int] | None = None) -> tuple[str, HookFn]:
    """A ``(name, fn)`` hook that replaces chosen heads/positions with the cached values.

    For per-head hooks (q/k/v/z, scores, pattern) ``heads`` selects heads and
    ``positions`` query positions; for residual hooks only ``positions`` applies.
    """
    source = cache[name]
    suffix = name.rsplit(".", 1)[-1]
    head_axis, pos_axis = _HEAD_AXES.get(suffix, (None, 1))
    if heads is not None and head_axis is None:
        raise ValueError(f"{name} has no head axis; patch it by positions only")

    def fn(x: torch.Tensor, hook: HookPoint) -> torch.Tensor:
        if source.shape != x.shape:
            raise ValueError(f"cannot patch {name}: cached shape {list(source.shape)} != run shape {list(x.shape)}")
        select = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
        index = [slice(None)] * x.dim()
        if heads is not None:
            index[head_axis] = torch.as_tensor(list(heads))
        if positions is not None:
            idx = torch.as_tensor(list(positions))
            if heads is not None:  # outer product of heads x positions
                shape = [1] * x.dim()
                shape[head_axis] = -1
                index[head_axis] = index[head_axis].view(shape)
                shape = [1] * x.dim()
                shape[pos_axis] = -1
                idx = idx.view(shape)
            index[pos_axis] = idx
        select[tuple(index)] = True
        return torch.where(select, source.to(x.dtype), x)

    return name, fn


def patch_heads(model: nn.Module, clean: dict, corrupted: dict, metric: Callable[[torch.Tensor], torch.Tensor],
                hook: str = "hook_z", positions: Sequence[int] | None = None) -> torch.Tensor:
    """Activation-patching sweep: for each layer and head, run ``corrupted`` inputs with that
    head's ``hook`` activation taken from the ``clean`` run; return ``metric(output)`` per
    (layer, head), ``[n_layers, H]``. Inputs are keyword dicts for ``model``."""
    _, cache = run_with_cache(model, names_filter=lambda n: n.endswith(f"attn.{hook}"), **clean)
    n_layers, n_heads = len(model.blocks), model.blocks[0].config.n_heads
    result = torch.zeros(n_layers, n_heads)
    with torch.no_grad():
        for layer in range(n_layers):
            for head in range(n_heads):
                fwd = [patch_hook(cache, f"blocks.{layer}.attn.{hook}", heads=[head], positions=positions)]
                result[layer, head] = metric(run_with_hooks(model, fwd_hooks=fwd, **corrupted)).float()
    return result
