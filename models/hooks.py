"""Hook points and the runs that use them: observe or replace any activation by name.

Hook names are the public contract, TransformerLens' own: ``blocks.3.attn.hook_pattern``,
``blocks.0.hook_resid_post``, ``hook_embed`` ... Every model of attnx (its encoders, and the
pretrained hosts that wrap them) names its hook points once with :func:`name_hook_points`, so
the same names work whatever wraps the blocks::

    out, cache = run_with_cache(model, x, mask)
    cache["blocks.0.attn.hook_pattern"]                     # [B, H, Lq, Lk]
    out = run_with_hooks(model, x, mask, fwd_hooks=[("blocks.0.attn.hook_z", fn)])

A hook is ``fn(tensor, hook) -> tensor | None``; returning a tensor replaces the activation.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

NameFilter = str | Sequence[str] | Callable[[str], bool] | None


class HookPoint(nn.Module):
    """An identity a user can observe or replace (TransformerLens-style)."""

    def __init__(self) -> None:
        super().__init__()
        self.name: str = ""  # set by name_hook_points; "" means "use the qualified module name"
        self._fns: list[Callable] = []

    @property
    def active(self) -> bool:
        return bool(self._fns)

    def add(self, fn: Callable) -> None:
        self._fns.append(fn)

    def clear(self) -> None:
        self._fns.clear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fn in self._fns:
            out = fn(x, self)
            if out is not None:
                if out.shape != x.shape:
                    raise ValueError(f"hook on {self.name} returned shape {list(out.shape)}, expected {list(x.shape)}")
                x = out
        return x


HookFn = Callable[[torch.Tensor, HookPoint], torch.Tensor | None]


def name_hook_points(model: nn.Module, strip: str = "") -> None:
    """Name every hook point of ``model`` by its qualified name, minus the prefix ``strip``
    (a host wrapping an encoder as ``.encoder`` passes ``"encoder."`` so names stay ``blocks.{i}...``)."""
    for qualified, module in model.named_modules():
        if isinstance(module, HookPoint):
            module.name = qualified[len(strip):] if strip and qualified.startswith(strip) else qualified


def hook_points(model: nn.Module) -> dict[str, HookPoint]:
    """Every hook point of ``model`` by its name."""
    return {m.name or q: m for q, m in model.named_modules() if isinstance(m, HookPoint)}


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
    """Attach hooks (by name, or a predicate over names) for the block; removed even on error."""
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
    """name -> activation; ``cache.pattern(layer)``, ``cache.z(layer)`` for the common ones."""

    def pattern(self, layer: int) -> torch.Tensor:
        return self[f"blocks.{layer}.attn.hook_pattern"]

    def z(self, layer: int) -> torch.Tensor:
        return self[f"blocks.{layer}.attn.hook_z"]


def run_with_cache(model: nn.Module, *args, names_filter: NameFilter = None, fwd_hooks=(), detach: bool = True,
                   **kwargs):
    """Run ``model`` and return ``(output, cache)`` of the hook points matching ``names_filter``.
    ``fwd_hooks`` run first, so the cache shows the activations under an intervention."""
    cache = ActivationCache()

    def saver(name: str) -> HookFn:
        def save(x: torch.Tensor, hook: HookPoint):
            cache[name] = x.detach() if detach else x
        return save

    names = [n for n in hook_points(model) if _matches(names_filter, n)]
    with hooks(model, [*fwd_hooks, *[(n, saver(n)) for n in names]]):
        out = model(*args, **kwargs)
    return out, cache


class Hooked:
    """Mixin for models with hook points: ``model.run_with_cache(...)``, ``model.run_with_hooks(...)``."""

    def hook_points(self) -> dict[str, HookPoint]:
        return hook_points(self)

    def run_with_hooks(self, *args, fwd_hooks=(), **kwargs):
        return run_with_hooks(self, *args, fwd_hooks=fwd_hooks, **kwargs)

    def run_with_cache(self, *args, names_filter: NameFilter = None, fwd_hooks=(), detach: bool = True, **kwargs):
        return run_with_cache(self, *args, names_filter=names_filter, fwd_hooks=fwd_hooks, detach=detach, **kwargs)
