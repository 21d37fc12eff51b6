"""The structural facts behind "variants at the cost of plain attention" (issue 14), for every variant:

- eval mode runs the fast path without a flag: fused SDPA is called, the reference path is not;
- key padding reaches attention as a per-key mask (one query row, ``[B, 1|H, 1, L]``), never ``[B, H, L, L]``;
- in the exported file, no tensor attnx builds is ``[B, H, L, L]`` (every intermediate, with the custom ops'
  function bodies inlined as ONNX Runtime inlines them, is run and its shape checked), nor rank 5: in both
  lowerings, so the default file is the fast form on every ONNX Runtime (issue 25).
Speed and memory themselves are measured by ``benchmarks/bench_variants.py``, not asserted here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnx.export.exporter import example_inputs
from attnx.models import build_encoder
from attnx.models.attention import current_path
from attnx.models.spec import variant_names

B, H, L, D = 3, 4, 37, 32  # sizes that coincide with nothing else in the graph
VARIANTS = variant_names()


def _padded_feeds(model, batch: int, seq: int) -> dict:
    feeds = example_inputs(model, batch, seq, seed=1)
    for spec in model.input_specs():
        if spec.role == "attention_mask":
            lengths = torch.tensor([seq, seq * 2 // 3, seq // 3][:batch])
            feeds[spec.name] = (torch.arange(seq)[None] < lengths[:, None]).to(feeds[spec.name].dtype)
    return feeds


@pytest.mark.parametrize("variant", VARIANTS)
def test_eval_runs_fused_attention_with_a_per_key_mask(variant, monkeypatch):
    model = build_encoder(variant, d_model=D, n_heads=H, n_layers=1, seed=0).eval()
    feeds = _padded_feeds(model, B, L)
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append((tuple(q.shape), tuple(k.shape), None if attn_mask is None else tuple(attn_mask.shape)))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    assert current_path() == "fast"  # the default, no flag
    with torch.inference_mode():
        out = model(**feeds)
    assert calls, f"{variant}: eval mode did not call fused attention"
    for q_shape, k_shape, mask in calls:
        assert q_shape[:3] == (B, H, L) and k_shape[:3] == (B, H, L)
        assert mask is not None, f"{variant}: padding did not reach attention"
        assert len(mask) == 4 and mask[0] == B and mask[1] in (1, H) and mask[2] == 1 and mask[3] == L, mask

    # the padded rows' real tokens equal the same rows run alone, unpadded (the mask is honoured)
    first = out["output"] if isinstance(out, dict) else out
    short = {k: v[1:2, : L * 2 // 3] if v.dim() >= 2 and v.shape[:2] == (B, L) else v[1:2] if v.shape[0] == B else v
             for k, v in feeds.items()}
    with torch.inference_mode():
        alone = model(**short)
    alone = alone["output"] if isinstance(alone, dict) else alone
    torch.testing.assert_close(first[1:2, : L * 2 // 3], alone, atol=2e-5, rtol=1e-4)


def _all_intermediate_shapes(path) -> dict[str, tuple]:
    """Every node output of the file, custom ops inlined (what ONNX Runtime runs), run by ONNX Runtime."""
    import onnx.inliner
    import onnxruntime as ort

    model = onnx.shape_inference.infer_shapes(onnx.inliner.inline_local_functions(onnx.load(str(path))))
    typed = {vi.name: vi for vi in [*model.graph.value_info, *model.graph.output]}
    known = {o.name for o in model.graph.output}
    for node in model.graph.node:
        for name in node.output:
            if name and name not in known and name in typed:
                model.graph.output.append(typed[name])
                known.add(name)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess, [o.name for o in sess.get_outputs()]


@pytest.mark.parametrize("lowering", ["plugin", "rewrite"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_no_BHLL_tensor_in_the_exported_graph(variant, lowering, exported):
    res = exported(variant, lowering=lowering, n_layers=1)
    sess, names = _all_intermediate_shapes(res.path)
    feeds = {k: v.numpy() for k, v in _padded_feeds(res.model, B, L).items()}
    values = sess.run(names, {k: v for k, v in feeds.items() if k in {i.name for i in sess.get_inputs()}})
    shapes = {n: v.shape for n, v in zip(names, values)}
    assert len(shapes) > 20  # the intermediates really were exposed
    quadratic = {n: s for n, s in shapes.items() if len(s) >= 4 and s[-2:] == (L, L) and H in s[:-2]}
    assert not quadratic, f"{variant}: [B, H, L, L] tensors in the graph: {quadratic}"
    assert not {n: s for n, s in shapes.items() if len(s) >= 5}, f"{variant}: rank-5 tensors"
    # the only L x L tensors are the mask's, shared by every head ([B, 1, L, L]: ORT's Attention refuses Lq = 1)
    for n, s in shapes.items():
        if len(s) == 4 and s[-2:] == (L, L):
            assert s[:2] == (B, 1), (n, s)
