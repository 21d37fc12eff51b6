"""Every variant and option combination: shapes, masking, empty rows, batch invariance.

Run on both the encoder stack (``build_encoder``) and the single module
(``build_variant``; for ``metaphor`` that is a whole block with the fusion).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_models_support import (  # noqa: E402
    CASE_IDS,
    D_MODEL,
    N_HEADS,
    SMALL,
    VARIANT_CASES,
    gen,
    left_pad_mask,
    make_context,
    pad_context,
    randomize_init,
    right_pad_mask,
    slice_context,
    specs_of,
)

from attnx.models import attention_path, build_encoder, build_variant, get_spec  # noqa: E402
from attnx.models.hooks import run_with_cache  # noqa: E402

ATOL = 2e-5


def encoder(variant, options, **extra):
    return randomize_init(build_encoder(variant, n_layers=2, seed=0, **SMALL, **options, **extra)).eval()


def module(variant, options, **extra):
    return randomize_init(build_variant(variant, seed=0, **SMALL, **options, **extra)).eval()


def patterns(cache) -> list[torch.Tensor]:
    keys = sorted(k for k in cache if k.endswith("hook_pattern"))
    assert keys, "no hook_pattern in the cache"
    return [cache[k] for k in keys]


def inputs(model, b, l, seed=0):
    g = gen(seed)
    x = torch.randn(b, l, D_MODEL, generator=g)
    return x, make_context(specs_of(model), b, l, g)


@pytest.mark.parametrize("case", VARIANT_CASES, ids=CASE_IDS)
def test_output_shapes(case):
    _, variant, options = case
    enc = encoder(variant, options)
    x, ctx = inputs(enc, 3, 7)
    mask = right_pad_mask([7, 4, 1], 7)
    out = enc(x, mask, **ctx)
    assert out.shape == (3, 7, D_MODEL) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    mod = module(variant, options)
    x, ctx = inputs(mod, 3, 7)
    y = mod(x, mask, **ctx)
    assert y.shape == (3, 7, D_MODEL) and torch.isfinite(y).all()
    out2, extras = enc(x, mask, return_extras=True, **ctx)
    torch.testing.assert_close(out2, out, atol=0, rtol=0)
    assert set(extras) == {o.name for o in get_spec(variant).extra_outputs}
    for spec in get_spec(variant).extra_outputs:
        assert tuple(extras[spec.name].shape) == tuple(3 if d == "batch" else 7 if d == "seq" else d
                                                       for d in spec.shape)
    if variant == "maw":
        depth = extras["maw_depth"]
        assert depth.dtype == torch.int64 and ((depth >= 0) & (depth < options["depth_dim"])).all()


@pytest.mark.parametrize("case", VARIANT_CASES, ids=CASE_IDS)
def test_padded_keys_get_exactly_zero_weight(case):
    _, variant, options = case
    lengths = [6, 3, 1]
    mask = right_pad_mask(lengths, 6)
    for model in (encoder(variant, options), module(variant, options)):
        x, ctx = inputs(model, 3, 6, seed=1)
        _, cache = run_with_cache(model, x, mask, **ctx)
        pats = patterns(cache)
        assert len(pats) == (2 if hasattr(model, "blocks") else 1)
        for p in pats:
            assert p.shape == (3, N_HEADS, 6, 6)
            for b, n in enumerate(lengths):
                assert (p[b, :, :, n:] == 0).all(), "a padded key got non-zero weight"
                torch.testing.assert_close(p[b].sum(-1), torch.ones(N_HEADS, 6), atol=1e-5, rtol=0)


def _check_empty_example(model, variant, x, mask, ctx, empty: int):
    """Example ``empty`` has no real token: its patterns and z are 0, nothing is NaN (fwd or bwd)."""
    x = x.clone().requires_grad_(True)
    out, cache = run_with_cache(model, x, mask, **ctx)
    assert torch.isfinite(out).all()
    for p in patterns(cache):
        assert (p[empty] == 0).all()
    for k in (k for k in cache if k.endswith("hook_z")):
        assert (cache[k][empty] == 0).all()
    if not hasattr(model, "blocks") and variant != "metaphor":
        # attention module: z = 0 -> output = W_O's bias exactly
        torch.testing.assert_close(out[empty], model.W_O.bias.expand(x.shape[1], -1), atol=0, rtol=0)
    out.square().sum().backward()
    assert torch.isfinite(x.grad).all()
    for name, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("case", VARIANT_CASES, ids=CASE_IDS)
def test_fully_masked_example_gives_zeros_not_nan(case):
    _, variant, options = case
    mask = right_pad_mask([5, 0], 5)
    for model in (encoder(variant, options), module(variant, options)):
        x, ctx = inputs(model, 2, 5, seed=2)
        _check_empty_example(model, variant, x, mask, ctx, empty=1)


@pytest.mark.parametrize("case", VARIANT_CASES, ids=CASE_IDS)
def test_causal_with_left_padding(case):
    _, variant, options = case
    lengths, l = [5, 3], 5
    mask = left_pad_mask(lengths, l)
    causal = torch.ones(l, l).tril().bool()
    for model in (encoder(variant, options, is_causal=True), module(variant, options, is_causal=True)):
        x, ctx = inputs(model, 2, l, seed=3)
        out, cache = run_with_cache(model, x, mask, **ctx)
        assert torch.isfinite(out).all()
        for p in patterns(cache):
            assert (p[:, :, ~causal] == 0).all(), "a future key got weight"
            assert (p[1, :, :, : l - 3] == 0).all(), "a left-padding key got weight"
            assert (p[1, :, : l - 3] == 0).all(), "a query whose keys are all padding must give zeros"
            torch.testing.assert_close(p[1, :, l - 3:].sum(-1), torch.ones(N_HEADS, 3), atol=1e-5, rtol=0)
        # the real tokens of the left-padded example equal the example run alone (no positions here)
        specs = specs_of(model)
        alone_ctx = slice_context(ctx, specs, slice(1, 2))
        alone_ctx = {s.name: (alone_ctx[s.name][:, l - 3:] if "seq" in s.shape else alone_ctx[s.name]) for s in specs}
        alone = model(x[1:2, l - 3:], None, **alone_ctx)
        torch.testing.assert_close(out[1:2, l - 3:], alone, atol=ATOL, rtol=1e-5)
        x2 = x.clone()
        x2[1, : l - 3] = 1e3  # garbage in the padding must not leak
        torch.testing.assert_close(model(x2, mask, **ctx)[1, l - 3:], out[1, l - 3:], atol=ATOL, rtol=1e-5)


def _batch_invariance(model, seed):
    specs = specs_of(model)
    lengths, l = [6, 3, 5], 6
    g = gen(seed)
    x = torch.randn(3, l, D_MODEL, generator=g)
    ctx = make_context(specs, 3, l, g)
    mask = right_pad_mask(lengths, l)
    batched = model(x, mask, **ctx)
    for i, n in enumerate(lengths):
        c_i = slice_context(ctx, specs, slice(i, i + 1))
        c_i = {s.name: (c_i[s.name][:, :n] if "seq" in s.shape else c_i[s.name]) for s in specs}
        alone = model(x[i:i + 1, :n], None, **c_i)
        torch.testing.assert_close(batched[i:i + 1, :n], alone, atol=ATOL, rtol=1e-5,
                                   msg=lambda m: f"example {i} alone != batched: {m}")
        # extra right padding (garbage hidden states) on its real tokens changes nothing
        extra = 4
        x_pad = torch.cat([x[i:i + 1, :n], 50 * torch.randn(1, extra, D_MODEL, generator=g)], dim=1)
        c_pad = pad_context(c_i, specs, extra, g)
        padded = model(x_pad, right_pad_mask([n], n + extra), **c_pad)
        torch.testing.assert_close(padded[:, :n], alone, atol=ATOL, rtol=1e-5,
                                   msg=lambda m: f"example {i} with right padding != alone: {m}")


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("case", VARIANT_CASES, ids=CASE_IDS)
def test_batch_invariance_encoder(case, causal):
    _, variant, options = case
    _batch_invariance(encoder(variant, options, is_causal=causal), seed=4)


@pytest.mark.parametrize("case", VARIANT_CASES, ids=CASE_IDS)
def test_batch_invariance_module(case):
    _, variant, options = case
    _batch_invariance(module(variant, options), seed=5)


def _plain_mha_by_construction(case) -> bool:
    """mha itself, and cultural with a query bias fused additively (a per-query constant that softmax removes:
    the identity is tested in test_models_identities)."""
    _, variant, options = case
    return variant == "mha" or options.get("bias_mode") == "query" and options.get("fusion") == "additive"


NOT_PLAIN_CASES = [c for c in VARIANT_CASES if not _plain_mha_by_construction(c)]


@pytest.mark.parametrize("case", NOT_PLAIN_CASES, ids=[c[0] for c in NOT_PLAIN_CASES])
def test_options_change_the_function(case):
    """Sanity that the randomised extra parameters matter: the variant is not plain mha."""
    _, variant, options = case
    enc = encoder(variant, options)
    base = randomize_init(build_encoder("mha", n_layers=2, seed=0, **SMALL)).eval()
    own = enc.state_dict()
    base.load_state_dict({k: own[k] for k in base.state_dict()})
    x, ctx = inputs(enc, 2, 5, seed=6)
    assert (enc(x, None, **ctx) - base(x, None)).abs().max() > 1e-3


@pytest.mark.parametrize("variant,options,path", [
    ("smal", dict(mode="tta", d_self=10), "reference"),  # explicit path, scores = -D (large and negative)
    ("smal", dict(mode="tta", d_self=10), "fast"),  # fused path with a negative per-key bias
    ("cultural", dict(d_cultural=12), "fast"),  # fused path with a large negative cultural key bias
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_empty_rows_stay_finite_in_half_precision(variant, options, path, dtype):
    with attention_path(path):
        _empty_rows_stay_finite(variant, options, dtype)


def _empty_rows_stay_finite(variant, options, dtype):
    """fp16's dtype-min mask plus a score below -16 overflows to -inf; an all-masked row must still give 0."""
    from attnx.models.attention import mask_bias

    mod = build_variant(variant, seed=0, **SMALL, **options).eval()
    g = gen(9)
    x = torch.randn(2, 5, D_MODEL, generator=g)
    ctx = make_context(specs_of(mod), 2, 5, g)
    with torch.no_grad():
        if variant == "smal":  # T = 40 I: D_ij = 40 |q_i - k_j|^2, every score far below -16
            ctx["trace"] = 40 * torch.eye(8).expand(2, 8, 8).clone()
        else:  # every key equals u with u_h = c'_h of example 1, lambda < 0: bias = -200 |c'_h|^2 / sqrt(Dh)
            mod.W_K.weight.zero_()
            mod.W_K.bias.copy_(mod.W_C(ctx["cultural"][1]))
            mod.lam.fill_(-200.0)
    mod = mod.to(dtype)
    x = x.to(dtype)
    ctx = {k: v.to(dtype) for k, v in ctx.items()}
    mask = right_pad_mask([5, 0], 5)
    with torch.no_grad():
        out, cache = run_with_cache(mod, x, mask, **ctx)
        fused = mod(x, mask, **ctx)
    bias, _ = mask_bias(mask, 5, 5, dtype, False)
    if dtype == torch.float16:  # the precondition: some row of the empty example overflows entirely
        assert torch.isinf(cache["hook_attn_scores"] + bias)[1].all(-1).any()
    assert torch.isfinite(out).all() and torch.isfinite(fused).all()
    assert (cache["hook_pattern"][1] == 0).all()
    torch.testing.assert_close(fused[1].float(), mod.W_O.bias.float().expand(5, -1), atol=0, rtol=0)
