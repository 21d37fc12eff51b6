"""``torch.export.export`` of every variant's encoder stack (eval mode, dynamic batch and seq);
the exported program equals eager at a batch/seq other than the example's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.export import Dim

sys.path.insert(0, str(Path(__file__).parent))
from test_models_support import D_MODEL, SMALL, gen, make_context, randomize_init, right_pad_mask  # noqa: E402

from attnx.models import attention_path, build_encoder  # noqa: E402

EXPORT_CASES = [
    ("mha", {}),
    ("mha-causal", {"is_causal": True}),
    ("cultural-key-gated-mlp", {"d_cultural": 12, "fusion": "gated", "lambda_mode": "mlp"}),
    ("cultural-query", {"d_cultural": 12, "bias_mode": "query"}),
    ("metaphor-sequence", {"d_metaphor": 12}),
    ("metaphor-token_type-postnorm", {"d_metaphor": 12, "metaphor_input": "token_type", "post_norm": True,
                                      "n_metaphor_types": 5}),
    ("maw", {"depth_dim": 4}),
    ("smal-shared-ref", {"d_self": 10}),
    ("smal-perhead-tta-rewrite", {"d_self": 10, "per_head_trace": True, "mode": "tta"}),
]


class Positional(torch.nn.Module):
    """The encoder with its context inputs as named positional parameters (export's input order)."""

    def __init__(self, encoder, names):
        super().__init__()
        self.encoder, self.names = encoder, names

    def forward(self, hidden_states, attention_mask, ctx0=None, ctx1=None):
        ctx = dict(zip(self.names, (ctx0, ctx1)))
        return self.encoder(hidden_states, attention_mask, **ctx)


@pytest.mark.parametrize("case", EXPORT_CASES, ids=[c[0] for c in EXPORT_CASES])
def test_torch_export_dynamic_batch_and_seq(case):
    name, options = case
    with attention_path("reference" if name.endswith("-ref") else "fast"):
        _export_dynamic_batch_and_seq(name, options)


def _export_dynamic_batch_and_seq(name, options):
    variant = name.split("-")[0]
    enc = randomize_init(build_encoder(variant, seed=0, n_layers=2, **SMALL, **options)).eval()
    specs = enc.context_inputs()
    names = [s.name for s in specs]
    assert len(names) <= 2
    batch, seq = Dim("batch", min=1, max=64), Dim("seq", min=1, max=512)

    def dims(shape):
        return {i: (batch if d == "batch" else seq) for i, d in enumerate(shape) if d in ("batch", "seq")}

    dynamic = [dims(("batch", "seq", D_MODEL)), dims(("batch", "seq"))] + [dims(s.shape) for s in specs]
    dynamic += [None] * (4 - len(dynamic))
    g = gen(1)

    def example(b, l, lengths):
        ctx = make_context(specs, b, l, g)
        return (torch.randn(b, l, D_MODEL, generator=g), right_pad_mask(lengths, l),
                *[ctx[n] for n in names], *[None] * (2 - len(names)))

    wrapped = Positional(enc, names)
    args = example(2, 5, [5, 3])
    ep = torch.export.export(wrapped, args, dynamic_shapes=dynamic)
    # the graph is generic in batch and seq
    symbolic = [n.meta["val"].shape for n in ep.graph.nodes if n.op == "placeholder" and n.name == "hidden_states"]
    assert symbolic and not isinstance(symbolic[0][0], int) and not isinstance(symbolic[0][1], int)
    exported = ep.module()
    for b, l, lengths in ((3, 7, [7, 2, 0]), (1, 4, [4]), (5, 11, [11, 1, 6, 9, 3])):
        new = example(b, l, lengths)
        with torch.no_grad():
            want = wrapped(*new)
            got = exported(*new)
        assert got.shape == (b, l, D_MODEL)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if variant == "maw":  # the selection survives export: a graph node of the custom op
        assert any("maw_depth_gather" in str(n.target) for n in ep.graph.nodes)
    if name == "smal-shared-ref":
        assert any("tta_distance" in str(n.target) for n in ep.graph.nodes)


def test_torch_export_maw_with_depth_output():
    enc = randomize_init(build_encoder("maw", seed=3, n_layers=2, depth_dim=4, **SMALL)).eval()

    class WithDepth(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = enc

        def forward(self, hidden_states, attention_mask):
            out, extras = self.encoder(hidden_states, attention_mask, return_extras=True)
            return out, extras["maw_depth"]

    batch, seq = Dim("batch", min=1, max=64), Dim("seq", min=1, max=512)
    g = gen(4)
    args = (torch.randn(2, 5, D_MODEL, generator=g), right_pad_mask([5, 2], 5))
    ep = torch.export.export(WithDepth(), args, dynamic_shapes=[{0: batch, 1: seq}, {0: batch, 1: seq}])
    x = 3 * torch.randn(6, 9, D_MODEL, generator=g)
    mask = right_pad_mask([9, 3, 7, 1, 9, 5], 9)
    with torch.no_grad():
        out, depth = ep.module()(x, mask)
        want_out, extras = enc(x, mask, return_extras=True)
        want_depth = extras["maw_depth"]
    assert depth.dtype == torch.int64 and depth.shape == (6,)
    assert torch.equal(depth, want_depth)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
