"""Activation patching and head ablation, by hook name.

    fn = patch_hook(clean_cache, "blocks.1.attn.hook_z", heads=[2], positions=[4])
    out = run_with_hooks(model, corrupted_x, fwd_hooks=[fn])
    scores = patch_heads(model, clean, corrupted, metric)   # [n_layers, H]: one patched head at a time
    out = model(x, mask, head_mask=hm)                      # hm [n_layers, H], 0 ablates a head
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from attnx.interp.hooks import HookFn, HookPoint, run_with_cache, run_with_hooks

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
