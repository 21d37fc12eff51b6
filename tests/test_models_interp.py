"""mha interpretability: hook points, fused == explicit, hooks that replace activations,
head_mask ablation, activation patching, per-head weight views; reproducible init."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_models_support import (  # noqa: E402
    D_MODEL, HEAD_DIM, N_HEADS, SMALL, gen, make_context, right_pad_mask, specs_of,
)

from attnx.models import VARIANTS, build_encoder, build_variant, encoder_from_config  # noqa: E402
from attnx.interp import hook_points, patch_heads, patch_hook, run_with_cache, run_with_hooks  # noqa: E402

N_LAYERS = 3
B, L = 3, 6


@pytest.fixture
def enc():
    return build_encoder("mha", seed=0, n_layers=N_LAYERS, **SMALL)


@pytest.fixture
def batch():
    g = gen(0)
    return torch.randn(B, L, D_MODEL, generator=g), right_pad_mask([6, 4, 5], L)


def z_ablation_hook(heads):
    def fn(z, hook):
        z = z.clone()
        z[:, :, heads] = 0
        return z
    return fn


# ----------------------------------------------------------------------------- hook points


def test_run_with_cache_has_every_hook_point_with_shapes(enc, batch):
    x, mask = batch
    out, cache = run_with_cache(enc, x, mask)
    want = {}
    for i in range(N_LAYERS):
        for name in ("hook_q", "hook_k", "hook_v", "hook_z"):
            want[f"blocks.{i}.attn.{name}"] = (B, L, N_HEADS, HEAD_DIM)
        for name in ("hook_attn_scores", "hook_pattern"):
            want[f"blocks.{i}.attn.{name}"] = (B, N_HEADS, L, L)
        for name in ("hook_resid_pre", "hook_resid_post", "hook_attn_out", "hook_mlp_out"):
            want[f"blocks.{i}.{name}"] = (B, L, D_MODEL)
    assert set(want) <= set(cache), sorted(set(want) - set(cache))
    for name, shape in want.items():
        assert tuple(cache[name].shape) == shape, name
    # the residual stream is what it says: pre of layer 0 is the input, post of layer i is pre of i+1
    torch.testing.assert_close(cache["blocks.0.hook_resid_pre"], x, atol=0, rtol=0)
    for i in range(N_LAYERS - 1):
        torch.testing.assert_close(cache[f"blocks.{i}.hook_resid_post"], cache[f"blocks.{i + 1}.hook_resid_pre"])
    torch.testing.assert_close(out, enc.ln_f(cache[f"blocks.{N_LAYERS - 1}.hook_resid_post"]), atol=1e-6, rtol=0)
    # the cached values are the module's own: scores = q k^T / sqrt(Dh), pattern = masked softmax, z = pattern v
    q, k, v = (cache[f"blocks.1.attn.hook_{n}"].transpose(1, 2) for n in "qkv")
    scores = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
    torch.testing.assert_close(cache["blocks.1.attn.hook_attn_scores"], scores, atol=1e-5, rtol=1e-5)
    p = torch.where(mask.bool()[:, None, None, :], scores, float("-inf")).softmax(-1)
    torch.testing.assert_close(cache["blocks.1.attn.hook_pattern"], p, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(cache["blocks.1.attn.hook_z"], (p @ v).transpose(1, 2), atol=1e-6, rtol=1e-5)
    # names_filter
    _, only = run_with_cache(enc, x, mask, names_filter=lambda n: n.endswith("hook_pattern"))
    assert sorted(only) == [f"blocks.{i}.attn.hook_pattern" for i in range(N_LAYERS)]
    assert not any(p.active for p in hook_points(enc).values())


def test_bare_module_cache_names(batch):
    x, mask = batch
    mod = build_variant("mha", **SMALL)
    _, cache = run_with_cache(mod, x, mask)
    assert {"hook_q", "hook_k", "hook_v", "hook_attn_scores", "hook_pattern", "hook_z"} <= set(cache)
    assert cache["hook_pattern"].shape == (B, N_HEADS, L, L)


@pytest.mark.parametrize("variant,options", [("mha", {}), ("mha", {"is_causal": True}),
                                             ("cultural", {"d_cultural": 12}),
                                             ("cultural", {"d_cultural": 12, "bias_mode": "query"}),
                                             ("smal", {"d_self": 10})])
def test_fused_path_equals_explicit_path(variant, options, batch):
    x, mask = batch
    enc = build_encoder(variant, seed=1, n_layers=2, **SMALL, **options)
    for block in enc.blocks:  # non-trivial extra parameters
        if variant == "cultural":
            with torch.no_grad():
                block.attn.lam.fill_(1.7)
    ctx = make_context(specs_of(enc), B, L, gen(1))
    fused = enc(x, mask, **ctx)  # no pattern hook: scaled_dot_product_attention (smal: the rewrite)
    observe = [(lambda n: n.endswith("hook_pattern"), lambda p, h: None)]  # forces the explicit path
    explicit = run_with_hooks(enc, x, mask, **ctx, fwd_hooks=observe)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=0)


def test_hook_replacing_z_equals_head_mask_and_hand_computation(batch):
    x, mask = batch
    mod = build_variant("mha", seed=2, **SMALL).eval()
    out, cache = run_with_cache(mod, x, mask)
    z = cache["hook_z"]  # [B, L, H, Dh]
    for h in range(N_HEADS):
        hooked = run_with_hooks(mod, x, mask, fwd_hooks=[("hook_z", z_ablation_hook([h]))])
        hm = torch.ones(N_HEADS)
        hm[h] = 0
        masked = mod(x, mask, head_mask=hm)
        by_hand = out - z[:, :, h] @ mod.output_weights[h]  # remove head h's W_O contribution
        torch.testing.assert_close(hooked, by_hand, atol=1e-5, rtol=0)
        torch.testing.assert_close(masked, by_hand, atol=1e-5, rtol=0)
        assert (masked - out).abs().max() > 1e-3
    # a hook scaling the pattern changes the output exactly as (c * pattern) v would
    scaled = run_with_hooks(mod, x, mask, fwd_hooks=[("hook_pattern", lambda p, hook: 0.5 * p)])
    torch.testing.assert_close(scaled, 0.5 * (out - mod.W_O.bias) + mod.W_O.bias, atol=1e-5, rtol=0)


def test_head_mask_per_example_and_fractional(batch):
    x, mask = batch
    mod = build_variant("mha", seed=3, **SMALL).eval()
    out, cache = run_with_cache(mod, x, mask)
    z = cache["hook_z"]
    hm = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.5, 1.0, 0.0]])  # [B, H]
    want = out - torch.einsum("blhd,hde,bh->ble", z, mod.output_weights, 1 - hm)
    torch.testing.assert_close(mod(x, mask, head_mask=hm), want, atol=1e-5, rtol=0)
    # [H] applies to every example; all-ones changes nothing; all-zeros leaves the bias
    torch.testing.assert_close(mod(x, mask, head_mask=hm[0]), mod(x, mask, head_mask=hm[0].expand(B, -1)))
    torch.testing.assert_close(mod(x, mask, head_mask=torch.ones(N_HEADS)), out, atol=1e-5, rtol=0)
    torch.testing.assert_close(mod(x, mask, head_mask=torch.zeros(N_HEADS)), mod.W_O.bias.expand(B, L, -1))


def test_encoder_head_mask_per_layer(enc, batch):
    x, mask = batch
    hm = torch.ones(N_LAYERS, N_HEADS)
    hm[0, 1] = 0
    hm[2, 0] = hm[2, 3] = 0
    got, cache = run_with_cache(enc, x, mask, head_mask=hm)
    hooks = [("blocks.0.attn.hook_z", z_ablation_hook([1])), ("blocks.2.attn.hook_z", z_ablation_hook([0, 3]))]
    torch.testing.assert_close(got, run_with_hooks(enc, x, mask, fwd_hooks=hooks), atol=1e-6, rtol=0)
    # layer 0 by hand: its attention output loses exactly head 1's W_O term
    _, clean = run_with_cache(enc, x, mask)
    attn0 = enc.blocks[0].attn
    want = clean["blocks.0.hook_attn_out"] - clean["blocks.0.attn.hook_z"][:, :, 1] @ attn0.output_weights[1]
    torch.testing.assert_close(cache["blocks.0.hook_attn_out"], want, atol=1e-5, rtol=0)
    # [H] = the same mask on every layer
    torch.testing.assert_close(enc(x, mask, head_mask=hm[2]), enc(x, mask, head_mask=hm[2].expand(N_LAYERS, -1)))


# ----------------------------------------------------------------------------- activation patching


def test_patching_all_of_a_layer_z_reproduces_clean_downstream(enc, batch):
    x, mask = batch
    x_bad = x + torch.randn(x.shape, generator=gen(4))
    clean_out, clean = run_with_cache(enc, x, mask)
    bad_out, _ = run_with_cache(enc, x_bad, mask)
    for layer in range(N_LAYERS):
        name = f"blocks.{layer}.attn.hook_z"
        hook = patch_hook(clean, name)  # every head, every position
        out, cache = _run_hooked_with_cache(enc, x_bad, mask, [hook])
        torch.testing.assert_close(cache[name], clean[name], atol=0, rtol=0)
        # that layer's attention output is the clean one (z is all W_O sees)
        torch.testing.assert_close(cache[f"blocks.{layer}.hook_attn_out"], clean[f"blocks.{layer}.hook_attn_out"],
                                   atol=1e-6, rtol=0)
        assert (out - bad_out).abs().max() > 1e-3
    # patching the whole residual stream at layer 0 reproduces the clean run everywhere downstream
    out, cache = _run_hooked_with_cache(enc, x_bad, mask, [patch_hook(clean, "blocks.0.hook_resid_pre")])
    torch.testing.assert_close(out, clean_out, atol=0, rtol=0)
    torch.testing.assert_close(cache["blocks.2.attn.hook_pattern"], clean["blocks.2.attn.hook_pattern"], atol=0, rtol=0)


def _run_hooked_with_cache(model, x, mask, hooks):
    cache = {}

    def saver(name):
        def save(t, hook):
            cache[name] = t.detach()
        return save

    names = list(hook_points(model))
    # patch hooks run first, then the savers see the patched values
    out = run_with_hooks(model, x, mask, fwd_hooks=list(hooks) + [(n, saver(n)) for n in names])
    return out, cache


def test_patch_hook_selects_heads_and_positions(enc, batch):
    x, mask = batch
    x_bad = x + torch.randn(x.shape, generator=gen(5))
    _, clean = run_with_cache(enc, x, mask)
    _, bad = run_with_cache(enc, x_bad, mask)
    name = "blocks.0.attn.hook_z"
    _, cache = _run_hooked_with_cache(enc, x_bad, mask, hooks=[patch_hook(clean, name, heads=[1, 3], positions=[0, 2])])
    z, zc, zb = cache[name], clean[name], bad[name]
    sel = torch.zeros(B, L, N_HEADS, 1, dtype=torch.bool)
    for pos in (0, 2):
        sel[:, pos, [1, 3]] = True
    torch.testing.assert_close(z, torch.where(sel, zc, zb), atol=0, rtol=0)
    # pattern patching: heads on axis 1, query positions on axis 2
    pname = "blocks.1.attn.hook_pattern"
    _, cache = _run_hooked_with_cache(enc, x_bad, mask, hooks=[patch_hook(clean, pname, heads=[2])])
    torch.testing.assert_close(cache[pname][:, 2], clean[pname][:, 2], atol=0, rtol=0)
    assert (cache[pname][:, 0] - clean[pname][:, 0]).abs().max() > 1e-4  # other heads: the corrupted run's
    with pytest.raises(ValueError, match="no head axis"):
        patch_hook(clean, "blocks.0.hook_resid_pre", heads=[0])


def test_patch_heads_sweep_known_answers(batch):
    x, mask = batch
    x_bad = x + torch.randn(x.shape, generator=gen(6))
    enc = build_encoder("mha", seed=7, n_layers=2, **SMALL)
    with torch.no_grad():  # head (0, 1) writes nothing: patching it cannot change anything
        enc.blocks[0].attn.W_O.weight[:, HEAD_DIM:2 * HEAD_DIM] = 0
    probe = torch.randn(D_MODEL, generator=gen(8))

    def metric(out):
        return (out[:, 1] @ probe).sum()

    clean, corrupted = {"hidden_states": x, "attention_mask": mask}, {"hidden_states": x_bad, "attention_mask": mask}
    sweep = patch_heads(enc, clean, corrupted, metric)
    assert sweep.shape == (2, N_HEADS)
    base = metric(enc(x_bad, mask)).item()
    assert sweep[0, 1].item() == pytest.approx(base, abs=1e-5)
    # every entry equals a run that replaces that head's z by hand
    _, cc = run_with_cache(enc, x, mask)
    for layer in range(2):
        for h in range(N_HEADS):
            src = cc[f"blocks.{layer}.attn.hook_z"][:, :, h]

            def fn(z, hook, src=src, h=h):
                z = z.clone()
                z[:, :, h] = src
                return z

            want = metric(run_with_hooks(enc, x_bad, mask, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", fn)]))
            assert sweep[layer, h].item() == pytest.approx(want.item(), abs=1e-5)
            if (layer, h) != (0, 1):
                assert abs(sweep[layer, h].item() - base) > 1e-5
    # clean == corrupted: every patch is a no-op
    same = patch_heads(enc, clean, clean, metric)
    torch.testing.assert_close(same, torch.full((2, N_HEADS), metric(enc(x, mask)).item()), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- per-head weights


def test_per_head_weight_views(batch):
    x, mask = batch
    mod = build_variant("mha", seed=9, **SMALL)
    _, cache = run_with_cache(mod, x, mask)
    assert mod.query_weights.shape == (N_HEADS, D_MODEL, HEAD_DIM)
    assert mod.output_weights.shape == (N_HEADS, HEAD_DIM, D_MODEL)
    for h in range(N_HEADS):
        cols = slice(h * HEAD_DIM, (h + 1) * HEAD_DIM)
        for weights, lin, name in ((mod.query_weights, mod.W_Q, "hook_q"), (mod.key_weights, mod.W_K, "hook_k"),
                                   (mod.value_weights, mod.W_V, "hook_v")):
            torch.testing.assert_close(x @ weights[h] + lin.bias[cols], cache[name][:, :, h], atol=1e-6, rtol=1e-5)
    # views: they share storage with the Linear weights
    with torch.no_grad():
        mod.W_Q.weight[HEAD_DIM + 2, 5] = 42.0
    assert mod.query_weights[1, 5, 2].item() == 42.0
    assert mod.query_weights.untyped_storage().data_ptr() == mod.W_Q.weight.untyped_storage().data_ptr()
    # output: sum_h z_h W_O[h] + b = the module output
    out, cache = run_with_cache(mod, x, mask)
    recon = torch.einsum("blhd,hde->ble", cache["hook_z"], mod.output_weights) + mod.W_O.bias
    torch.testing.assert_close(recon, out, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- reproducible init


@pytest.mark.parametrize("variant", VARIANTS)
def test_seeded_init_is_reproducible(variant):
    a = build_encoder(variant, seed=11, n_layers=2, **SMALL).state_dict()
    b = build_encoder(variant, seed=11, n_layers=2, **SMALL).state_dict()
    c = build_encoder(variant, seed=12, n_layers=2, **SMALL).state_dict()
    assert a.keys() == b.keys() == c.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    random_keys = [k for k in a if a[k].numel() > 1 and a[k].std() > 0]
    assert random_keys
    assert all(not torch.equal(a[k], c[k]) for k in random_keys)
    m1 = build_variant(variant, seed=3, **SMALL).state_dict()
    m2 = build_variant(variant, seed=3, **SMALL).state_dict()
    m3 = build_variant(variant, seed=4, **SMALL).state_dict()
    assert all(torch.equal(m1[k], m2[k]) for k in m1)
    assert any(not torch.equal(m1[k], m3[k]) for k in m1)


def test_seeded_build_leaves_global_rng_alone_and_config_roundtrip():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    enc = build_encoder("cultural", seed=5, n_layers=2, **SMALL)
    torch.testing.assert_close(torch.rand(3), expected, atol=0, rtol=0)
    again = encoder_from_config(enc.config_dict(), seed=5)
    for k, v in enc.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k
