"""``torch.compile`` of a placed model: the whole model is one graph (no break at attnx's per-forward
state, which lives in :class:`attnx.models.attention.TracedVar`s), and the compiled model gives the eager
model's numbers, with the context inputs as graph inputs (new values, new results: not baked in).

Dynamo's own backend (``backend="eager"``) runs the captured graph: what is tested is the capture, in
seconds; the GPU figures with CUDA graphs are in docs/gpu.md (``bench_variants_gpu.py --compile``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_folders import lazy_folders, move_off_neutral, placed_feeds  # noqa: E402

from attnx import pretrained  # noqa: E402
from attnx.models import reference  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return lazy_folders(tmp_path_factory.mktemp("compile"))


@pytest.mark.parametrize("variant", ["mha", "cultural", "metaphor", "maw", "smal"])
@pytest.mark.parametrize("family", ["llama", "modernbert"])
def test_a_placed_model_compiles_into_one_graph_with_the_eager_numbers(folders, family, variant):
    model = pretrained.load(folders(family), variant).eval()
    move_off_neutral(model, seed=3)
    feeds = placed_feeds(model, batch=3, seq=12)
    torch._dynamo.reset()
    # fullgraph: a graph break is an error naming its reason, so the model ran as one captured graph
    compiled = torch.compile(model.hf, backend="eager", fullgraph=True)
    for scale in (1.0, 1.7):  # other context values: other outputs, from the same graph
        feeds_now = {k: v * scale if v.is_floating_point() else v for k, v in feeds.items()}
        with torch.no_grad():
            want = model.hf(**feeds_now)[0]
            got = compiled(**feeds_now)[0]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if any(v.is_floating_point() for v in feeds.values()):  # the context inputs reached the graph
        assert not torch.allclose(compiled(**feeds)[0], compiled(**{k: v * 1.7 if v.is_floating_point() else v
                                                                    for k, v in feeds.items()})[0])


def test_the_attention_path_is_followed_under_compile(folders):
    """``with reference():`` around a compiled call recompiles on the reference path (the path is guarded)."""
    model = pretrained.load(folders("llama"), "smal").eval()
    move_off_neutral(model, seed=5)
    feeds = placed_feeds(model, batch=2, seq=10)
    torch._dynamo.reset()
    compiled = torch.compile(model.hf, backend="eager", fullgraph=True)
    with torch.no_grad():
        fast = compiled(**feeds)[0]
        with reference():
            ref = compiled(**feeds)[0]
            want = model.hf(**feeds)[0]
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast, ref, atol=1e-4, rtol=1e-4)
