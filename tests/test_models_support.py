"""Shared helpers for the ``tests/test_models_*.py`` files (no tests here).

The other files import it as ``test_models_support`` (their directory is put on
``sys.path`` first, so this works with or without ``tests/__init__.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from attnx.models import VARIANTS, attention_path
from attnx.models.signature import InputSpec

D_MODEL, N_HEADS = 32, 4
HEAD_DIM = D_MODEL // N_HEADS
SMALL = dict(d_model=D_MODEL, n_heads=N_HEADS)

# (id, variant, options): every option combination the brief names.
VARIANT_CASES: list[tuple[str, str, dict]] = [("mha", "mha", {})]
for _bias in ("key", "query"):
    for _fusion in ("additive", "gated"):
        for _lam in ("scalar", "mlp"):
            VARIANT_CASES.append((f"cultural-{_bias}-{_fusion}-{_lam}", "cultural",
                                  dict(bias_mode=_bias, fusion=_fusion, lambda_mode=_lam, d_cultural=12)))
for _mi in ("sequence", "token", "type", "token_type"):
    for _pn in (False, True):
        VARIANT_CASES.append((f"metaphor-{_mi}-{'postnorm' if _pn else 'nonorm'}", "metaphor",
                              dict(metaphor_input=_mi, post_norm=_pn, d_metaphor=12, n_metaphor_types=5)))
VARIANT_CASES.append(("maw", "maw", dict(depth_dim=4)))
for _mode in ("smal", "tta"):
    for _ph in (False, True):
        VARIANT_CASES.append((f"smal-{_mode}-{'perhead' if _ph else 'shared'}", "smal",
                              dict(mode=_mode, per_head_trace=_ph, d_self=10)))
# Every registered variant is covered, with its defaults when the matrix above does not name it.
VARIANT_CASES += [(name, name, {}) for name in VARIANTS if name not in {c[1] for c in VARIANT_CASES}]
CASE_IDS = [c[0] for c in VARIANT_CASES]


def on_path(rewrite: bool):
    """The fast path (smal: the exact rewrite) or the reference path (the literal formulas)."""
    return attention_path("fast" if rewrite else "reference")


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def specs_of(model: nn.Module) -> list[InputSpec]:
    """Context input specs of an Encoder, a Block or an attention module."""
    if hasattr(model, "blocks") or hasattr(model, "spec"):
        return model.context_inputs()
    return model.context_inputs(model.config)


def make_context(specs: list[InputSpec], b: int, l: int, g: torch.Generator, n_types: int = 5,
                 trace_scale: float = 0.3) -> dict[str, torch.Tensor]:
    out = {}
    for s in specs:
        shape = [b if d == "batch" else l if d == "seq" else d for d in s.shape]
        if s.dtype == "float":
            t = torch.randn(*shape, generator=g)
            out[s.name] = t * trace_scale if s.name == "trace" else t
        else:
            out[s.name] = torch.randint(0, n_types, shape, generator=g)
    return out


def right_pad_mask(lengths, l: int) -> torch.Tensor:
    return (torch.arange(l)[None, :] < torch.as_tensor(lengths)[:, None]).long()


def left_pad_mask(lengths, l: int) -> torch.Tensor:
    return (torch.arange(l)[None, :] >= (l - torch.as_tensor(lengths))[:, None]).long()


@torch.no_grad()
def randomize_init(model: nn.Module, seed: int = 123, scale: float = 0.5) -> nn.Module:
    """Give every constant-initialised parameter (lambda, gate weights/biases, gamma, ...)
    random values, so a test exercises the variant's extra path instead of its identity init."""
    g = gen(seed)
    for name, p in model.named_parameters():
        if name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight", "post_norm.weight")):
            continue  # keep LayerNorm scales at 1
        if p.numel() == 1 or bool((p == p.flatten()[0]).all()):
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


def slice_context(ctx: dict, specs: list[InputSpec], rows) -> dict:
    return {s.name: ctx[s.name][rows] for s in specs}


def pad_context(ctx: dict, specs: list[InputSpec], extra: int, g: torch.Generator) -> dict:
    """Append ``extra`` positions (random values) along each input's seq axis."""
    out = {}
    for s in specs:
        t = ctx[s.name]
        if "seq" in s.shape:
            axis = s.shape.index("seq")
            shape = list(t.shape)
            shape[axis] = extra
            filler = torch.randn(shape, generator=g) if t.is_floating_point() else torch.zeros(shape, dtype=t.dtype)
            t = torch.cat([t, filler.to(t.dtype)], dim=axis)
        out[s.name] = t
    return out
