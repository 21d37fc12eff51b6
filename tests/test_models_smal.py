"""SMAL / TTA: the distance op, the exact rewrite, by-hand references, context sensitivity."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_models_support import D_MODEL, HEAD_DIM, N_HEADS, SMALL, gen, left_pad_mask, on_path, right_pad_mask  # noqa: E402

from attnx.models import attention_path, build_encoder, build_variant, reference  # noqa: E402
from attnx.models import smal as smal_module  # noqa: E402
from attnx.models.smal import tta_distance, tta_distance_expanded  # noqa: E402
from attnx.models.hooks import run_with_cache  # noqa: E402


def naive_distance(q, k, trace):
    """Plain Python loops over (b, h, i, j): (q_i - k_j)^T T (q_i - k_j)."""
    b, h, lq, dh = q.shape
    lk = k.shape[2]
    t = trace.expand(b, h, dh, dh)
    out = torch.empty(b, h, lq, lk, dtype=q.dtype)
    for bi in range(b):
        for hi in range(h):
            for i in range(lq):
                for j in range(lk):
                    d = q[bi, hi, i] - k[bi, hi, j]
                    out[bi, hi, i, j] = d @ t[bi, hi] @ d
    return out


@pytest.mark.parametrize("heads_in_trace", [1, 3])
def test_tta_distance_matches_expanded_and_naive_loop(heads_in_trace, monkeypatch):
    g = gen(0)
    q = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, 6, 4, generator=g, dtype=torch.float64)
    trace = torch.randn(2, heads_in_trace, 4, 4, generator=g, dtype=torch.float64)  # not symmetric
    ref = naive_distance(q, k, trace)
    torch.testing.assert_close(tta_distance(q, k, trace), ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(tta_distance_expanded(q, k, trace), ref, atol=1e-12, rtol=0)
    # the chunked path (several query rows per chunk, and one row per chunk) gives the same
    for elements in (2 * 3 * 6 * 4 * 2, 1):
        monkeypatch.setattr(smal_module, "_TTA_CHUNK_ELEMENTS", elements)
        torch.testing.assert_close(tta_distance(q, k, trace), ref, atol=1e-12, rtol=0)
    # fp32 agreement between the literal and the expanded form on unit-scale inputs
    q32, k32, t32 = q.float(), k.float(), trace.float()
    torch.testing.assert_close(tta_distance(q32, k32, t32), tta_distance_expanded(q32, k32, t32), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("heads_in_trace", [1, 3])
def test_tta_distance_gradients(heads_in_trace):
    g = gen(1)
    q = torch.randn(2, 3, 4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    trace = torch.randn(2, heads_in_trace, 3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(tta_distance, (q, k, trace))
    w = torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(tta_distance(q, k, trace), (q, k, trace), w)
    want = torch.autograd.grad(naive_distance(q, k, trace), (q, k, trace), w)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


# ----------------------------------------------------------------------------- module level


def smal(seed=0, **options):
    mod = build_variant("smal", seed=seed, d_self=10, **SMALL, **options).eval()
    with torch.no_grad():
        mod.gamma.fill_(0.8)
    return mod


def smal_inputs(per_head, b=3, l=6, seed=0, unbatched=False):
    g = gen(seed)
    x = torch.randn(b, l, D_MODEL, generator=g)
    s = torch.randn(b, 10, generator=g)
    shape = ((N_HEADS,) if per_head else ()) + (HEAD_DIM, HEAD_DIM)
    trace = 0.3 * torch.randn(*((() if unbatched else (b,)) + shape), generator=g)
    return x, s, trace


def by_hand(mod, x, mask, s, trace, mode, causal=False):
    """The spec's formula, written out: heads, D, S, mask, softmax, V, W_O."""
    b, l, _ = x.shape
    h, dh = N_HEADS, HEAD_DIM
    q = (x @ mod.W_Q.weight.T + mod.W_Q.bias).view(b, l, h, dh).transpose(1, 2)
    k = (x @ mod.W_K.weight.T + mod.W_K.bias).view(b, l, h, dh).transpose(1, 2)
    v = (x @ mod.W_V.weight.T + mod.W_V.bias).view(b, l, h, dh).transpose(1, 2)
    t = trace if mod.config.per_head_trace else trace.unsqueeze(-3)  # shared: one [Dh, Dh] for all heads
    t = t.expand(b, h, dh, dh)  # (an unbatched trace broadcasts over the batch)
    diff = q[:, :, :, None, :] - k[:, :, None, :, :]  # [B, H, Lq, Lk, Dh]
    D = torch.einsum("bhijd,bhde,bhije->bhij", diff, t, diff)
    beta = torch.sigmoid(s @ mod.self_gate.weight.T + mod.self_gate.bias).view(b, 1, 1, 1)
    S = -D if mode == "tta" else q @ k.transpose(-1, -2) / math.sqrt(dh) - mod.gamma * beta * D
    allowed = torch.ones(b, 1, l, l, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & mask.bool()[:, None, None, :]
    if causal:
        allowed = allowed & torch.ones(l, l, dtype=torch.bool).tril()
    p = torch.where(allowed, S, float("-inf")).softmax(-1).nan_to_num(0.0)
    z = (p @ v).transpose(1, 2).reshape(b, l, h * dh)
    return z @ mod.W_O.weight.T + mod.W_O.bias, p


@pytest.mark.parametrize("unbatched", [False, True], ids=["batched-trace", "unbatched-trace"])
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "perhead"])
@pytest.mark.parametrize("mode", ["smal", "tta"])
def test_reference_matches_formula_by_hand(mode, per_head, unbatched):
    mod = smal(mode=mode, per_head_trace=per_head)
    x, s, trace = smal_inputs(per_head, unbatched=unbatched)
    mask = right_pad_mask([6, 3, 0], 6)
    want, p_want = by_hand(mod, x, mask, s, trace, mode)
    out, cache = run_with_cache(mod, x, mask, self_state=s, trace=trace)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache["hook_pattern"], p_want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(mod(x, mask, self_state=s, trace=trace), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "perhead"])
@pytest.mark.parametrize("mode", ["smal", "tta"])
def test_rewrite_matches_reference(mode, per_head, causal):
    mod = smal(mode=mode, per_head_trace=per_head, is_causal=causal)
    x, s, trace = smal_inputs(per_head, b=4, l=7, seed=3)
    masks = [None, right_pad_mask([7, 4, 1, 0], 7), left_pad_mask([7, 5, 2, 0], 7)]
    for mask in masks:
        with reference():
            want = mod(x, mask, self_state=s, trace=trace)
        got = mod(x, mask, self_state=s, trace=trace)  # the default (fast) path: the rewrite
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        hand, _ = by_hand(mod, x, mask, s, trace, mode, causal)
        torch.testing.assert_close(got, hand, atol=1e-5, rtol=0)
    # unbatched trace broadcasts the same way on both paths
    t0 = trace[0]
    with reference():
        want = mod(x, masks[1], self_state=s, trace=t0)
    torch.testing.assert_close(mod(x, masks[1], self_state=s, trace=t0), want, atol=1e-5, rtol=0)


def test_a_causal_mask_and_the_key_bias_never_make_a_per_head_square_mask(monkeypatch):
    """The per-key bias is per head; a causal mask is [B, 1, L, L]: their sum would be [B, H, L, L] (the
    GPU run measured 2.6x mha's memory). The fast path folds the bias into q/k instead, and stays exact."""
    mod = smal(per_head_trace=True, is_causal=True)
    x, s, trace = smal_inputs(True, b=3, l=9, seed=7)
    masks = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, **kw):
        masks.append(None if attn_mask is None else tuple(attn_mask.shape))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    got = mod(x, left_pad_mask([9, 6, 2], 9), self_state=s, trace=trace)
    assert masks and all(m is None or m[1] == 1 for m in masks), masks
    with reference():
        want = mod(x, left_pad_mask([9, 6, 2], 9), self_state=s, trace=trace)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["smal", "tta"])
def test_rewrite_matches_reference_encoder_and_gradients(mode):
    model = build_encoder("smal", seed=4, n_layers=2, mode=mode, per_head_trace=True, d_self=10, **SMALL)
    x, s, trace = smal_inputs(True, b=3, l=6, seed=5)
    mask = right_pad_mask([6, 2, 4], 6)
    with reference():
        want = model(x, mask, self_state=s, trace=trace)
    torch.testing.assert_close(model(x, mask, self_state=s, trace=trace), want, atol=1e-5, rtol=0)
    # both paths train: same gradients (the reference goes through tta_distance's autograd)
    grads = []
    model.train()
    for path in ("reference", "fast"):
        model.zero_grad()
        tr = trace.clone().requires_grad_(True)
        probe = torch.randn(3, 2, D_MODEL, generator=gen(11))  # (sum of squares of a LayerNorm output is constant)
        with attention_path(path):
            (model(x, mask, self_state=s, trace=tr)[:, :2] * probe).sum().backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()] + [tr.grad])
    assert grads[0][-1].abs().max() > 1e-3  # the trace does get a gradient
    for a, b in zip(*grads):
        assert (a is None) == (b is None)  # (tta: gamma and the self gate are unused on both paths)
        if a is not None:
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_tta_mode_is_softmax_of_minus_distance():
    """mode="tta": output = softmax(-D) V W_O, D built by the naive loop."""
    mod = smal(mode="tta", per_head_trace=True)
    x, s, trace = smal_inputs(True, b=2, l=4, seed=6)
    b, l = 2, 4
    q, k, v = (lin(x).view(b, l, N_HEADS, HEAD_DIM).transpose(1, 2) for lin in (mod.W_Q, mod.W_K, mod.W_V))
    D = naive_distance(q.detach(), k.detach(), trace)
    p = torch.softmax(-D, dim=-1)
    want = mod.W_O((p @ v).transpose(1, 2).reshape(b, l, D_MODEL))
    torch.testing.assert_close(mod(x, None, self_state=s, trace=trace), want, atol=1e-5, rtol=0)
    # tta ignores self_state and gamma
    s2 = torch.randn_like(s) * 5
    torch.testing.assert_close(mod(x, None, self_state=s2, trace=trace), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("rewrite", [False, True])
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "perhead"])
def test_self_state_and_trace_change_output_and_attention(per_head, rewrite):
    """The seed's evaluation point: same x, different self_state / trace -> different output and map."""
    with on_path(rewrite):
        _self_state_and_trace_change_output_and_attention(per_head)


def _self_state_and_trace_change_output_and_attention(per_head):
    enc = build_encoder("smal", seed=7, n_layers=2, per_head_trace=per_head, d_self=10, **SMALL)
    g = gen(8)
    x, s, trace = smal_inputs(per_head, b=2, l=6, seed=8)
    mask = right_pad_mask([6, 5], 6)
    trace = trace * 3  # a strong trace effect (unit-scale entries)
    # self_state enters through beta = sigmoid(w . s + b): make the two states give very different betas
    w = enc.blocks[0].attn.self_gate.weight.detach()[0]
    s_hi, s_lo = 4 * w / w.norm() ** 2 * 1.0, -4 * w / w.norm() ** 2 * 1.0
    s_hi, s_lo = s_hi.expand(2, -1), s_lo.expand(2, -1)
    out_a, cache_a = run_with_cache(enc, x, mask, self_state=s_hi, trace=trace)
    out_a2 = enc(x, mask, self_state=s_hi, trace=trace)
    torch.testing.assert_close(out_a, out_a2, atol=1e-5, rtol=0)  # deterministic; fused == explicit
    out_b, cache_b = run_with_cache(enc, x, mask, self_state=s_lo, trace=trace)
    other_trace = 3 * 0.3 * torch.randn(trace.shape, generator=g)
    out_c, cache_c = run_with_cache(enc, x, mask, self_state=s_hi, trace=other_trace)
    for out, cache in ((out_b, cache_b), (out_c, cache_c)):
        assert (out - out_a)[:, :5].abs().max() > 1e-2
        p_diff = (cache["blocks.0.attn.hook_pattern"] - cache_a["blocks.0.attn.hook_pattern"])[:, :, :5]
        assert p_diff.abs().max() > 1e-2, "the attention map must depend on the context"
        assert p_diff[1, :, :, 5:].abs().max() == 0  # still nothing on example 1's padded key
