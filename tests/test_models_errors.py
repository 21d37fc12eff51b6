"""Bad input is a clear ValueError: the input's name, the expected shape/dtype and the given one;
unknown variants/options list the valid ones; bad configurations say what is wrong."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_models_support import D_MODEL, HEAD_DIM, N_HEADS, SMALL, gen, make_context, specs_of  # noqa: E402

from attnx.models import VARIANTS, build_encoder, build_variant, encoder_from_config, make_config  # noqa: E402
from attnx.models.hooks import run_with_hooks  # noqa: E402

B, L = 2, 5
OPTIONS = {
    "mha": {},
    "cultural": dict(d_cultural=12, fusion="gated"),
    "metaphor": dict(d_metaphor=12, metaphor_input="token"),
    "maw": {},
    "smal": dict(d_self=10, per_head_trace=True),
}


def raises(fn, *needles):
    with pytest.raises(ValueError) as info:
        fn()
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in error message: {msg!r}"
    return msg


def good_inputs(model):
    g = gen(0)
    return torch.randn(B, L, D_MODEL, generator=g), torch.ones(B, L, dtype=torch.int64), \
        make_context(specs_of(model), B, L, g, n_types=3)


@pytest.fixture(params=VARIANTS)
def variant(request):
    return request.param


@pytest.fixture(params=["encoder", "module"])
def model_and_name(request, variant):
    if request.param == "encoder":
        return build_encoder(variant, n_layers=1, **SMALL, **OPTIONS[variant]), "hidden_states"
    return build_variant(variant, **SMALL, **OPTIONS[variant]).eval(), "x"


def test_good_inputs_run(model_and_name):
    model, _ = model_and_name
    x, mask, ctx = good_inputs(model)
    assert model(x, mask, **ctx).shape == (B, L, D_MODEL)


def test_hidden_states_shape_and_dtype(model_and_name):
    model, name = model_and_name
    x, mask, ctx = good_inputs(model)
    raises(lambda: model(x[..., :-1], mask, **ctx), f"{name}:", f"{D_MODEL}]", f"[{B}, {L}, {D_MODEL - 1}]")
    raises(lambda: model(x[0], None, **{k: v[0] for k, v in ctx.items()}), f"{name}:", "expected shape",
           f"[{L}, {D_MODEL}]", "rank 2")
    raises(lambda: model(x.long(), mask, **ctx), f"{name}:", "dtype", "float32", "int64")


def test_attention_mask_shape_and_dtype(model_and_name):
    model, _ = model_and_name
    x, mask, ctx = good_inputs(model)
    longer = torch.ones(B, L + 1, dtype=torch.int64)
    raises(lambda: model(x, longer, **ctx), "attention_mask:", f"[batch={B}, seq={L}]", f"[{B}, {L + 1}]")
    raises(lambda: model(x, mask[:1], **ctx), "attention_mask:", f"[batch={B}, seq={L}]", f"[1, {L}]")
    raises(lambda: model(x, mask[:, :, None], **ctx), "attention_mask:", f"[{B}, {L}, 1]")
    raises(lambda: model(x, mask.float(), **ctx), "attention_mask:", "dtype", "float32")


# every context input, several ways to get it wrong: (options, name, bad value, substrings of the message)
CTX_CASES = [
    ("cultural", dict(d_cultural=12), "cultural", torch.randn(B, 13), ["[batch=2, 12]", "[2, 13]"]),
    ("cultural", dict(d_cultural=12), "cultural", torch.randn(B + 1, 12), ["[batch=2, 12]", "[3, 12]"]),
    ("cultural", dict(d_cultural=12), "cultural", torch.randn(12), ["[batch=2, 12]", "[12]"]),
    ("cultural", dict(d_cultural=12), "cultural", torch.randint(0, 3, (B, 12)), ["dtype", "int64"]),
    ("metaphor", dict(d_metaphor=12, metaphor_input="sequence"), "metaphor", torch.randn(B, L, 12),
     ["[batch=2, 12]", "[2, 5, 12]"]),
    ("metaphor", dict(d_metaphor=12, metaphor_input="token"), "metaphor", torch.randn(B, L + 1, 12),
     ["[batch=2, seq=5, 12]", "[2, 6, 12]"]),
    ("metaphor", dict(d_metaphor=12, metaphor_input="token"), "metaphor", torch.randn(B, L, 11),
     ["[batch=2, seq=5, 12]", "[2, 5, 11]"]),
    ("metaphor", dict(metaphor_input="type"), "metaphor", torch.randint(0, 3, (B, L)), ["[batch=2]", "[2, 5]"]),
    ("metaphor", dict(metaphor_input="type"), "metaphor", torch.randn(B), ["dtype", "float32"]),
    ("metaphor", dict(metaphor_input="token_type"), "metaphor", torch.randint(0, 3, (B, L + 2)),
     ["[batch=2, seq=5]", "[2, 7]"]),
    ("metaphor", dict(metaphor_input="token_type", n_metaphor_types=4), "metaphor",
     torch.full((B, L), 4, dtype=torch.int64), ["ids must be in", "[0, 4)", "[4, 4]"]),
    ("metaphor", dict(metaphor_input="type", n_metaphor_types=4), "metaphor",
     torch.tensor([0, -1]), ["ids must be in", "[0, 4)", "[-1, 0]"]),
    ("smal", dict(d_self=10), "self_state", torch.randn(B, 11), ["[batch=2, 10]", "[2, 11]"]),
    ("smal", dict(d_self=10), "self_state", torch.randn(B, 10).double().long(), ["dtype", "int64"]),
    ("smal", dict(d_self=10), "trace", torch.randn(B, HEAD_DIM, HEAD_DIM + 1),
     [f"[batch=2, {HEAD_DIM}, {HEAD_DIM}]", f"[2, {HEAD_DIM}, {HEAD_DIM + 1}]"]),
    ("smal", dict(d_self=10), "trace", torch.randn(B, N_HEADS, HEAD_DIM, HEAD_DIM),
     [f"[batch=2, {HEAD_DIM}, {HEAD_DIM}]", f"[2, {N_HEADS}, {HEAD_DIM}, {HEAD_DIM}]"]),
    ("smal", dict(d_self=10, per_head_trace=True), "trace", torch.randn(B, HEAD_DIM, HEAD_DIM),
     [f"[{N_HEADS}, {HEAD_DIM}, {HEAD_DIM}]", f"[2, {HEAD_DIM}, {HEAD_DIM}]", f"[batch=2, {N_HEADS}, {HEAD_DIM}"]),
    ("smal", dict(d_self=10), "trace", torch.randn(B + 1, HEAD_DIM, HEAD_DIM),
     [f"[batch=2, {HEAD_DIM}, {HEAD_DIM}]", f"[3, {HEAD_DIM}, {HEAD_DIM}]"]),
    ("smal", dict(d_self=10), "trace", torch.randint(0, 2, (B, HEAD_DIM, HEAD_DIM)), ["dtype", "int64"]),
]


@pytest.mark.parametrize("where", ["encoder", "module"])
@pytest.mark.parametrize("variant,options,name,bad,needles", CTX_CASES,
                         ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(CTX_CASES)])
def test_context_input_errors(variant, options, name, bad, needles, where):
    if where == "encoder":
        model = build_encoder(variant, n_layers=1, **SMALL, **options)
    else:
        model = build_variant(variant, **SMALL, **options).eval()
    x, mask, ctx = good_inputs(model)
    model(x, mask, **ctx)  # the good inputs are fine
    ctx[name] = bad
    raises(lambda: model(x, mask, **ctx), f"{name}:", *needles)


def test_missing_and_unexpected_context_inputs():
    enc = build_encoder("smal", n_layers=1, d_self=10, **SMALL)
    x, mask, ctx = good_inputs(enc)
    raises(lambda: enc(x, mask, self_state=ctx["self_state"]), "missing input", "trace")
    raises(lambda: enc(x, mask, **ctx, cultural=torch.randn(B, 4)), "unexpected input", "cultural",
           "self_state", "trace")
    mha = build_encoder("mha", n_layers=1, **SMALL)
    raises(lambda: mha(x, mask, metaphor=torch.randn(B, 4)), "unexpected input", "metaphor", "hidden_states")


def test_unknown_variant_lists_valid_ones():
    for fn in (lambda: build_variant("mhaa"), lambda: build_encoder("gpt"),
               lambda: build_encoder("mha", n_layers=2, layer_variants=("mha", "nope"))):
        msg = raises(fn, "unknown variant")
        for v in VARIANTS:
            assert v in msg


def test_unknown_option_lists_valid_ones():
    msg = raises(lambda: build_variant("smal", gama_init=0.0), "unknown option", "gama_init", "'smal'")
    for opt in ("gamma_init", "per_head_trace", "mode", "use_rewrite", "d_model"):
        assert opt in msg
    msg = raises(lambda: build_encoder("mha", n_layer=3), "unknown option", "n_layer")
    assert "n_layers" in msg and "layer_variants" in msg
    raises(lambda: make_config("maw", depth=3), "unknown option", "depth_dim")
    # an option of a variant the encoder does not use is unknown too
    raises(lambda: build_encoder("mha", depth_dim=3), "unknown option", "depth_dim")


@pytest.mark.parametrize("variant,option,value,needle", [
    ("cultural", "bias_mode", "keys", "'key', 'query'"),
    ("cultural", "lambda_mode", "vector", "'scalar', 'mlp'"),
    ("cultural", "fusion", "concat", "'additive', 'gated'"),
    ("metaphor", "metaphor_input", "word", "'sequence', 'token', 'type', 'token_type'"),
    ("smal", "mode", "trace", "'smal', 'tta'"),
    ("maw", "reward", "entropy", "'neg_entropy', 'neg_variance'"),
])
def test_bad_option_values_list_choices(variant, option, value, needle):
    raises(lambda: build_variant(variant, **{option: value}), option, needle, repr(value))


def test_bad_dimensions():
    raises(lambda: build_variant("mha", d_model=30, n_heads=4), "d_model (30)", "divisible", "n_heads (4)")
    raises(lambda: build_encoder("smal", d_model=64, n_heads=5), "d_model (64)", "n_heads (5)")
    raises(lambda: build_variant("mha", d_model=0), "positive")
    raises(lambda: build_encoder("mha", n_layers=0), "n_layers")
    raises(lambda: build_encoder("mha", n_layers=2, layer_variants=("mha",)), "layer_variants", "2 layers")


def test_head_mask_shape_errors():
    enc = build_encoder("mha", n_layers=2, **SMALL)
    x, mask, _ = good_inputs(enc)
    raises(lambda: enc(x, mask, head_mask=torch.ones(3, N_HEADS)), "head_mask", f"[n_layers=2, H={N_HEADS}]", "[3, 4]")
    raises(lambda: enc(x, mask, head_mask=torch.ones(N_HEADS + 1)), "head_mask", "[5]")
    mod = build_variant("mha", **SMALL)
    raises(lambda: mod(x, mask, head_mask=torch.ones(N_HEADS - 1)), "head_mask", f"{N_HEADS} heads")
    raises(lambda: mod(x, mask, head_mask=torch.ones(B, 1, N_HEADS)), "head_mask")


def test_hook_returning_wrong_shape_is_an_error():
    enc = build_encoder("mha", n_layers=1, **SMALL)
    x, mask, _ = good_inputs(enc)
    raises(lambda: run_with_hooks(enc, x, mask, fwd_hooks=[("blocks.0.attn.hook_z", lambda z, h: z[:, :-1])]),
           "blocks.0.attn.hook_z", "returned shape")
    raises(lambda: run_with_hooks(enc, x, mask, fwd_hooks=[("blocks.9.attn.hook_z", lambda z, h: None)]),
           "no hook point matches")
    # hooks are removed even after the error
    assert not any(p.active for p in enc.modules() if hasattr(p, "active"))


def test_extras_of_a_model_without_extra_outputs_are_empty():
    enc = build_encoder("mha", n_layers=1, **SMALL)
    x, mask, _ = good_inputs(enc)
    out, extras = enc(x, mask, return_extras=True)
    assert extras == {} and out.shape == x.shape


def test_config_roundtrip_rejects_nothing_valid():
    enc = build_encoder("cultural", n_layers=2, layer_variants=("cultural", "smal"), d_cultural=12, d_self=10,
                        **SMALL)
    again = encoder_from_config(enc.config_dict())
    assert [b.variant for b in again.blocks] == ["cultural", "smal"]
    x, mask, ctx = good_inputs(enc)
    torch.testing.assert_close(again(x, mask, **ctx), enc(x, mask, **ctx), atol=0, rtol=0)
    assert re.search("valid variants", raises(lambda: encoder_from_config({**enc.config_dict(), "variant": "x"}),
                                              "unknown variant"))
