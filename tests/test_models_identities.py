"""Identity and near-identity properties (variants.md: each variant reduces to or stays close to mha).

- cultural ``bias_mode="query"`` == mha with the same weights, whatever lambda is;
- cultural (any mode) with lambda at its init 0 and additive fusion == mha;
- smal with gamma = 0 == mha (both the reference and the rewrite path);
- gates at init: cultural gated ``out - out_mha = (1 - sigmoid(4)) (C_f(c) - z_att) W_O``
  (the docstring's bound ``|out - out_mha| <= (1 - sigmoid(4)) |(z_att - C_f(c)) W_O|`` with equality),
  metaphor ``y - y_base = (1 - sigmoid(4)) (f_m(r) - y_base)`` elementwise.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_models_support import D_MODEL, SMALL, gen, make_context, on_path, right_pad_mask, specs_of  # noqa: E402

from attnx.models import build_encoder, build_variant  # noqa: E402
from attnx.models.hooks import run_with_cache  # noqa: E402

GATE_GAP = 1.0 - 1.0 / (1.0 + math.exp(-4.0))  # 1 - sigmoid(4) = 0.01799
SHARED = ("W_Q.", "W_K.", "W_V.", "W_O.")


def mha_like(model, variant="mha", dtype=torch.float32, **options):
    """An mha module/encoder with a *different* seed, then given ``model``'s shared weights."""
    if hasattr(model, "blocks"):
        base = build_encoder(variant, seed=99, n_layers=len(model.blocks), **SMALL, **options)
    else:
        base = build_variant(variant, seed=99, **SMALL, **options)
    own = model.state_dict()
    missing = base.load_state_dict({k: own[k] for k in base.state_dict() if k in own}, strict=False)
    assert not missing.missing_keys, missing.missing_keys
    return base.to(dtype).eval()


def data(model, b=3, l=6, seed=0, dtype=torch.float32):
    g = gen(seed)
    x = torch.randn(b, l, D_MODEL, generator=g, dtype=torch.float64).to(dtype)
    ctx = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in make_context(specs_of(model), b, l, g).items()}
    mask = right_pad_mask([l, l - 2, 0][:b], l)
    return x, mask, ctx


# ----------------------------------------------------------------------------- cultural query == mha


def _set_lambda(mod, lam_mode, value, g):
    with torch.no_grad():
        if lam_mode == "scalar":
            mod.lam.fill_(value)
        else:  # non-zero last layer: lambda(c) [B, H] is large and varies per example and head
            last = mod.lam_mlp[2]
            last.weight.copy_(torch.randn(last.weight.shape, generator=g) * value)
            last.bias.copy_(torch.randn(last.bias.shape, generator=g) * value)


@pytest.mark.parametrize("lam_mode", ["scalar", "mlp"])
@pytest.mark.parametrize("lam", [10.0, -7.0, 2.5])
def test_cultural_query_mode_equals_mha_fp32(lam_mode, lam):
    mod = build_variant("cultural", seed=1, bias_mode="query", lambda_mode=lam_mode, d_cultural=12, **SMALL).eval()
    _set_lambda(mod, lam_mode, lam, gen(7))
    base = mha_like(mod)
    x, mask, ctx = data(mod)
    lam_values = mod.lambda_(ctx["cultural"])
    assert lam_values.abs().min() > 0.1, "lambda must be non-zero for the test to mean anything"
    # the literal query bias really is large here; softmax removes it anyway
    _, cache = run_with_cache(mod, x, mask, **ctx)
    _, cache_base = run_with_cache(base, x, mask)
    shift = (cache["hook_attn_scores"] - cache_base["hook_attn_scores"])[:2]
    assert shift.abs().max() > 1.0
    torch.testing.assert_close(cache["hook_pattern"], cache_base["hook_pattern"], atol=2e-6, rtol=0)
    torch.testing.assert_close(mod(x, mask, **ctx), base(x, mask), atol=1e-5, rtol=0)  # fused path


@pytest.mark.parametrize("lam_mode", ["scalar", "mlp"])
def test_cultural_query_mode_equals_mha_fp64_huge_lambda(lam_mode):
    mod = build_variant("cultural", seed=2, bias_mode="query", lambda_mode=lam_mode, d_cultural=12, **SMALL)
    mod = mod.double().eval()
    _set_lambda(mod, lam_mode, 300.0, gen(8))
    base = mha_like(mod, dtype=torch.float64)
    x, mask, ctx = data(mod, dtype=torch.float64)
    torch.testing.assert_close(mod(x, mask, **ctx), base(x, mask), atol=1e-10, rtol=0)


def test_cultural_query_mode_encoder_equals_mha_encoder():
    enc = build_encoder("cultural", seed=3, n_layers=2, bias_mode="query", lambda_mode="mlp", d_cultural=12, **SMALL)
    for block in enc.blocks:
        _set_lambda(block.attn, "mlp", 5.0, gen(9))
    base = mha_like(enc)
    x, mask, ctx = data(enc)
    torch.testing.assert_close(enc(x, mask, **ctx), base(x, mask), atol=1e-5, rtol=0)


def test_cultural_query_bias_gets_no_gradient_but_key_bias_does():
    """The seed's defect, shown: in query mode lambda and W_C get (numerically) zero gradient."""
    grads = {}
    for mode in ("query", "key"):
        mod = build_variant("cultural", seed=4, bias_mode=mode, d_cultural=12, **SMALL).train()
        with torch.no_grad():
            mod.lam.fill_(1.5)
        x, mask, ctx = data(mod)
        with on_path(False):  # the literal formula, where the query-mode bias is computed and cancels
            (mod(x, mask, **ctx)[:2] ** 2).sum().backward()
        grads[mode] = (mod.lam.grad.abs().item(), mod.W_C.weight.grad.abs().max().item())
    assert grads["query"][0] < 1e-4 and grads["query"][1] < 1e-4
    assert grads["key"][0] > 1e-3 and grads["key"][1] > 1e-3


@pytest.mark.parametrize("bias_mode", ["key", "query"])
@pytest.mark.parametrize("lam_mode", ["scalar", "mlp"])
def test_cultural_additive_at_init_is_exactly_mha(bias_mode, lam_mode):
    mod = build_variant("cultural", seed=5, bias_mode=bias_mode, lambda_mode=lam_mode, d_cultural=12, **SMALL).eval()
    base = mha_like(mod)
    x, mask, ctx = data(mod)
    torch.testing.assert_close(mod(x, mask, **ctx), base(x, mask), atol=1e-6, rtol=0)


def test_cultural_key_mode_differs_from_mha_when_lambda_nonzero():
    mod = build_variant("cultural", seed=5, bias_mode="key", d_cultural=12, **SMALL).eval()
    with torch.no_grad():
        mod.lam.fill_(3.0)
    base = mha_like(mod)
    x, mask, ctx = data(mod)
    assert (mod(x, mask, **ctx) - base(x, mask))[:2].abs().max() > 1e-3


# ----------------------------------------------------------------------------- gates at init


@pytest.mark.parametrize("bias_mode", ["key", "query"])
@pytest.mark.parametrize("lam_mode", ["scalar", "mlp"])
def test_cultural_gated_at_init_bound(bias_mode, lam_mode):
    mod = build_variant("cultural", seed=6, bias_mode=bias_mode, lambda_mode=lam_mode, fusion="gated",
                        d_cultural=12, **SMALL).eval()
    base = mha_like(mod)
    x, mask, ctx = data(mod)
    mask = right_pad_mask([6, 4, 5], 6)  # no empty example: there z = 0 in both by construction
    out = mod(x, mask, **ctx)
    out_mha, cache = run_with_cache(base, x, mask)
    z_att = cache["hook_z"].flatten(2)  # [B, L, H*Dh]
    c_value = mod.C_f(ctx["cultural"])[:, None, :]  # [B, 1, H*Dh]
    delta_full = (z_att - c_value) @ mod.W_O.weight.T  # (z_att - C_f(c)) W_O, no bias
    dev = out - out_mha
    # the docstring bound, elementwise
    assert (dev.abs() <= GATE_GAP * delta_full.abs() + 1e-6).all()
    # ... and it is attained: out - out_mha = (1 - sigmoid(4)) (C_f(c) - z_att) W_O
    torch.testing.assert_close(dev, -GATE_GAP * delta_full, atol=1e-6, rtol=1e-4)
    assert dev.abs().max() > 1e-4  # the gate is not exactly closed
    assert dev.abs().max() <= 0.02 * delta_full.abs().max()


def _metaphor_r(block, x, metaphor):
    fusion = block.fusion
    m_proj = fusion.features(metaphor, x.shape[1])
    return torch.tanh(fusion.W_r(torch.cat([x, m_proj], dim=-1)))


@pytest.mark.parametrize("post_norm", [False, True])
@pytest.mark.parametrize("metaphor_input", ["sequence", "token", "type", "token_type"])
def test_metaphor_at_init_bound(metaphor_input, post_norm):
    block = build_variant("metaphor", seed=7, metaphor_input=metaphor_input, post_norm=post_norm, d_metaphor=12,
                          n_metaphor_types=5, **SMALL).eval()
    with torch.no_grad():  # a non-trivial LayerNorm, so post_norm is not a plain standardisation
        if post_norm:
            block.fusion.post_norm.weight.uniform_(0.5, 1.5)
            block.fusion.post_norm.bias.normal_()
    x, mask, ctx = data(block)
    y = block(x, mask, **ctx)

    # y_base: the same block with the fusion removed
    fusion, block.fusion = block.fusion, None
    y_base = block(x, mask)
    block.fusion = fusion
    f_m = fusion.f_m(_metaphor_r(block, x, ctx["metaphor"]))
    fused = y_base + GATE_GAP * (f_m - y_base)
    if not post_norm:
        dev = y - y_base
        assert (dev.abs() <= GATE_GAP * (f_m - y_base).abs() + 1e-6).all()
        torch.testing.assert_close(dev, GATE_GAP * (f_m - y_base), atol=1e-6, rtol=1e-4)
        assert dev.abs().max() > 1e-4
    else:
        torch.testing.assert_close(y, fusion.post_norm(fused), atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- smal gamma = 0


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("rewrite", [False, True])
def test_smal_gamma_zero_is_mha(per_head, rewrite):
    mod = build_variant("smal", seed=8, gamma_init=0.0, per_head_trace=per_head, d_self=10, **SMALL).eval()
    base = mha_like(mod)
    x, mask, ctx = data(mod)
    ctx["trace"] = ctx["trace"] * 10  # a big trace: only gamma = 0 makes it irrelevant
    with on_path(rewrite):
        torch.testing.assert_close(mod(x, mask, **ctx), base(x, mask), atol=1e-5, rtol=0)
        _, cache = run_with_cache(mod, x, mask, **ctx)
        _, cache_base = run_with_cache(base, x, mask)
        torch.testing.assert_close(cache["hook_pattern"], cache_base["hook_pattern"], atol=1e-6, rtol=0)
        with torch.no_grad():
            mod.gamma.fill_(0.5)
        assert (mod(x, mask, **ctx) - base(x, mask))[:2].abs().max() > 1e-3


def test_smal_gamma_zero_encoder_is_mha_encoder():
    enc = build_encoder("smal", seed=9, n_layers=2, gamma_init=0.0, d_self=10, **SMALL)
    base = mha_like(enc)
    x, mask, ctx = data(enc)
    torch.testing.assert_close(enc(x, mask, **ctx), base(x, mask), atol=1e-5, rtol=0)
