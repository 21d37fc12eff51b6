"""Activation patching and head ablation, by hook name.

    fn = patch_hook(clean_cache, "blocks.1.attn.hook_z", heads=[2], positions=[4])
    out = run_with_hooks(model, corrupted_x, fwd_hooks=[fn])
    scores = patch_heads(model, clean, corrupted, metric)   # [n_layers, H]: one patched head at a time
    out = model(x, mask, head_mask=hm)                      # hm [n_layers, H], 0 ablates a head
    report = patching_sweep(torch_source, batch, layer=0)   # text-level: restore each head from the clean run
    table = ablation_table(source, batch, layer=0, reference=torch_source)   # `attnx explain --ablate`

:func:`patching_sweep` is the torch side of ``attnx explain --ablate``: beside the export's head
ablation (a head removed) it shows activation patching (a head restored into a corrupted run), so
the heads a model *needs* and the heads that *carry* the input's information can be told apart;
:func:`ablation_table` puts both side by side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from attnx.explain.explanation import _feeds, ablate_layer, output_metric
from attnx.explain.source import EncodedBatch, ExplainError, Source
from attnx.models.hooks import HookFn, HookPoint, run_with_cache, run_with_hooks

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
                hook: str = "hook_z", positions: Sequence[int] | None = None, *, layers: Sequence[int] | None = None,
                corrupted_hooks: Sequence = ()) -> torch.Tensor:
    """Activation-patching sweep: for each layer and head, run ``corrupted`` inputs with that
    head's ``hook`` activation taken from the ``clean`` run; return ``metric(output)`` per
    (layer, head), ``[n_layers, H]`` (NaN for layers not in ``layers``). Inputs are keyword dicts
    for ``model``; ``corrupted_hooks`` run on every corrupted run (e.g. noise on ``hook_embed``)."""
    with torch.no_grad():
        _, cache = run_with_cache(model, names_filter=lambda n: n.endswith(f"attn.{hook}"), **clean)
    n_layers, n_heads = len(model.blocks), model.blocks[0].config.n_heads
    chosen = range(n_layers) if layers is None else list(layers)
    for layer in chosen:
        if not 0 <= layer < n_layers:
            raise ValueError(f"layer {layer} out of range: the model has {n_layers} layers (0..{n_layers - 1})")
    result = torch.full((n_layers, n_heads), float("nan"))
    with torch.no_grad():
        for layer in chosen:
            for head in range(n_heads):
                fwd = [*corrupted_hooks,
                       patch_hook(cache, f"blocks.{layer}.attn.{hook}", heads=[head], positions=positions)]
                result[layer, head] = metric(run_with_hooks(model, fwd_hooks=fwd, **corrupted)).float()
    return result


class NamedOutput(nn.Module):
    """``forward(**inputs) -> one named output`` of a model with the export signature (``forward_named``),
    so the hook-based tools (``patch_heads``) drive pretrained hosts and exports' references alike."""

    def __init__(self, model: nn.Module, output: str):
        super().__init__()
        self.model, self.output = model, output

    @property
    def blocks(self):
        return self.model.blocks

    def forward(self, **inputs) -> torch.Tensor:
        return self.model.forward_named(inputs)[self.output]


@dataclass
class PatchingReport:
    """``restored[h]``: the share of the clean-vs-corrupted output distance that restoring head ``h``'s
    ``hook_z`` (from the clean run) removes; 1 = the head alone restores the clean output."""

    layer: int
    corruption: str
    distance_corrupted: float  # the metric's distance of the corrupted run from the clean output
    restored: list[float]


def patching_sweep(source, batch, layer: int, *, corrupt=None, noise: float = 3.0, seed: int = 0,
                   context=None) -> PatchingReport:
    """Activation patching of every head of ``layer`` on a torch source (:class:`attnx.interp.source.TorchSource`).

    The corrupted run is ``corrupt`` (another :class:`EncodedBatch` of the same shape) or, by default,
    the same text with Gaussian noise of ``noise`` x the embeddings' std added to the token embeddings
    (``hook_embed``; the causal-tracing corruption of Meng et al., 2022), seeded."""
    facts = source.facts
    layer = facts.check_layer(layer)
    model = NamedOutput(getattr(source.model, "model", source.model), facts.main_output)

    def tensors(b) -> dict:
        feeds = _feeds(source, b, context, None)
        return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in feeds.items()}

    clean = tensors(batch)
    hooks_: list = []
    if corrupt is not None:
        if corrupt.feeds["input_ids"].shape != batch.feeds["input_ids"].shape:
            raise ExplainError(f"the corrupted text has {corrupt.lengths} tokens, the text {batch.lengths}: "
                               "patching needs the same number of tokens")
        corrupted, how = tensors(corrupt), f"text {corrupt.texts[0]!r}"
    else:
        def add_noise(x: torch.Tensor, hook) -> torch.Tensor:  # the same noise on every run: a fresh seeded draw
            return x + noise * x.std() * torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))

        corrupted, how = clean, f"Gaussian noise ({noise:g} x std) on the token embeddings, seed {seed}"
        hooks_ = [("hook_embed", add_noise)]
    with torch.no_grad():
        clean_out = model(**clean).numpy()
        corrupted_out = run_with_hooks(model, fwd_hooks=hooks_, **corrupted).numpy()
    mask = batch.attention_mask
    metric = output_metric(facts, clean_out, mask)
    base = metric.effect(clean_out, corrupted_out, mask)
    if not base > 0:
        raise ExplainError("the corrupted run gives the clean output: nothing for patching to restore")

    def distance(out: torch.Tensor) -> torch.Tensor:
        return torch.tensor(metric.effect(clean_out, out.numpy(), mask))

    sweep = patch_heads(model, clean, corrupted, distance, layers=[layer], corrupted_hooks=hooks_)[layer]
    return PatchingReport(layer, how, base, [float(1 - d / base) for d in sweep.tolist()])


# --------------------------------------------------------------------------- the side-by-side table


@dataclass
class AblationTable:
    """``attnx explain --ablate``: per head of one layer, the deployed model's ablation effect, the same
    ablation on the torch reference, and activation patching on the torch reference; rows ranked by
    the deployed model's effect."""

    layer: int
    metric: str
    columns: list[str]
    rows: list[dict]  # {"head": h, column: value}
    patching: str = ""  # how the corrupted run was made

    @property
    def ranking(self) -> list[int]:
        return [r["head"] for r in self.rows]


def ablation_table(source: Source, batch: EncodedBatch, layer: int, *, reference: Source | None = None,
                   patch: bool = True, corrupt: EncodedBatch | None = None, context=None,
                   target_id: int | None = None) -> AblationTable:
    """Ablate each head of ``layer`` on ``source`` (and ``reference``, a torch source) and, with ``patch``,
    sweep activation patching over the same heads on the torch model (``reference``, or ``source`` itself
    when it is one)."""
    own = ablate_layer(source, batch, layer, context=context, target_id=target_id)
    columns = ["ablated (torch)" if hasattr(source, "model") else "ablated (deployed)"]
    values = {columns[0]: own.effects}
    if reference is not None:
        ref = ablate_layer(reference, batch, layer, context=context, target_id=target_id)
        columns.append("ablated (torch reference)")
        values[columns[-1]] = ref.effects
    torch_source = reference if reference is not None else (source if hasattr(source, "model") else None)
    how = ""
    if patch and torch_source is not None:
        report = patching_sweep(torch_source, batch, layer, corrupt=corrupt, context=context)
        columns.append("patched: share restored")
        values[columns[-1]] = report.restored
        how = report.corruption
    rows = [{"head": h, **{c: values[c][h] for c in columns}} for h in own.ranking]
    return AblationTable(own.layer, own.metric.description, columns, rows, how)
