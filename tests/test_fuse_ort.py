"""ONNX Runtime's fused operators in with-past decoders (:mod:`attnx.runtime.core.ort_fusions`, at load on the CPU).

Each against the same file run as written (``decoder_fusions=False``), on the tiny random decoders the generation
tests already export (the shared export cache: no export of its own):

- plain attention (Llama: RMS norms, rotary, grouped K/V): every fusion applies; a prompt per row, the rows merged
  into one left-padded batch (masked slots at the front of the shorter row) and decoded: the same greedy tokens,
  logits within 1e-4; one run of several new tokens over a past for two rows with a masked slot (what ONNX
  Runtime's GroupQueryAttention refuses) gives the same logits and ``present`` tensors;
- a placed variant (trained smal; trained maw appended) keeps its own ops and gains the fusions around them, same bar;
- the file on disk is not changed; a file that is not a with-past export, or a rewrite that fails, runs as written.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import generation_fixtures as gf

from attnx.contract import Role
from attnx.runtime.core.decoding import Decoder

STEPS = 6
ATOL = 1e-4


def _load(path, fused: bool):
    from attnx.runtime import load

    return load(path, device="cpu", decoder_fusions=fused)


def _prompts(vocab: int) -> list[list[int]]:
    g = np.random.default_rng(3)
    return [g.integers(4, vocab, 9).tolist(), g.integers(4, vocab, 4).tolist()]


def _greedy(session, prompts, context=None):
    """Each prompt prefilled alone, the rows merged (left-padded) and decoded greedily: (tokens, logits per step)."""
    decoder = Decoder(session)
    firsts, states = zip(*(decoder.start(p, context) for p in prompts))
    tokens, logits = [[int(np.argmax(f))] for f in firsts], [np.stack(firsts)]
    state = decoder.merge(states)
    for _ in range(STEPS - 1):
        step, state = decoder.step(state, [row[-1] for row in tokens])
        logits.append(step)
        for row, lg in zip(tokens, step):
            row.append(int(np.argmax(lg)))
    return tokens, logits


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _fused_graph(path):
    import onnx

    from attnx.runtime.core.ort_fusions import fused_model_bytes

    return onnx.load_from_string(fused_model_bytes(path)[0]).graph


def test_plain_attention_gains_every_fusion_and_decodes_the_same():
    path = gf.export(gf.folder("llama"), "mha")
    before = _digest(path)
    fused, plain = _load(path, True), _load(path, False)
    assert plain.fusions == {}
    assert fused.fusions["skip_rms_norm"] > 0 and fused.fusions["rms_norm"] >= 1, fused.fusions
    assert fused.fusions["rotary"] == 2 * fused.fusions["attention_with_past"] > 0, fused.fusions
    graph = _fused_graph(path)
    ops = {n.op_type for n in graph.node}
    assert {"SkipSimplifiedLayerNormalization", "RotaryEmbedding", "Attention"} <= ops
    assert not {"ReduceMean", "Neg"} & ops  # the norms' and the rotary's own nodes are gone
    assert not any(n.op_type == "Concat" and n.input[0].startswith("past_key_values.") for n in graph.node)
    prompts = _prompts(Decoder(plain).vocab_size)
    want_tokens, want = _greedy(plain, prompts)
    got_tokens, got = _greedy(fused, prompts)
    assert got_tokens == want_tokens
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)
    assert _digest(path) == before  # the file stays standard ONNX (for TensorRT)


def test_several_new_tokens_over_a_past_for_a_batch():
    """Two rows, three new tokens each over a past of four slots, a masked slot in front and a left-padded row:
    logits and every ``present`` tensor as the file computes them."""
    path = gf.export(gf.folder("llama"), "mha")
    fused, plain = _load(path, True), _load(path, False)
    g = np.random.default_rng(0)
    feeds = {}
    for spec in plain.inputs:
        dims = [2 if d == "batch" else 3 if d == "seq" else 4 if d == "past" else 7 if d == "total" else d
                for d in spec.shape]
        if spec.name.startswith("past_key_values."):
            feeds[spec.name] = g.standard_normal(dims).astype(np.float32)
    mask = np.ones((2, 7), np.int64)
    mask[:, 0] = 0
    mask[1, :3] = 0
    feeds.update(input_ids=g.integers(4, 60, (2, 3)).astype(np.int64), attention_mask=mask,
                 position_ids=np.array([[5, 6, 7], [3, 4, 5]], np.int64))
    names = plain.output_names
    want, got = plain.run(feeds, names), fused.run(feeds, names)
    for name in names:
        np.testing.assert_allclose(got[name], want[name], atol=ATOL, rtol=0, err_msg=name)


#: op types the rewrites remove, add or may leave dead (the norms, the rotary, the cache's attention, shapes)
_REWRITTEN = {"Pow", "ReduceMean", "Add", "Sqrt", "Reciprocal", "Mul", "Neg", "Slice", "Concat", "Reshape",
              "Transpose", "Unsqueeze", "Attention", "Cos", "Sin", "Cast", "Shape", "Squeeze", "Expand", "Gather",
              "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "RotaryEmbedding"}


@pytest.mark.parametrize("variant", ["smal", "maw"])
def test_a_placed_variant_keeps_its_ops_and_gains_the_fusions_around_them(variant):
    """Trained smal in every layer (its distances read the whole cache: its attention is left as it is) and
    trained maw appended (the host's layers fused): every op outside the rewrites' is still there, as often."""
    import onnx
    from collections import Counter

    path = gf.export(gf.trained_folder("llama", variant), None, "plugin")
    fused, plain = _load(path, True), _load(path, False)
    assert fused.fusions["skip_rms_norm"] > 0 and fused.fusions["rotary"] > 0, fused.fusions
    hosts = 0 if variant == "smal" else 2  # the tiny Llama's two layers, maw appended after them
    assert fused.fusions["attention_with_past"] == hosts, fused.fusions
    written = Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)
    rewritten = Counter(n.op_type for n in _fused_graph(path).node)
    own = {op: n for op, n in written.items() if op not in _REWRITTEN}
    assert own and own == {op: rewritten[op] for op in own}, (written, rewritten)
    ctx = gf.neutral_context([s for s in plain.inputs if s.role == Role.CONTEXT])
    prompts = _prompts(Decoder(plain).vocab_size)
    want_tokens, want = _greedy(plain, prompts, ctx)
    got_tokens, got = _greedy(fused, prompts, ctx)
    assert got_tokens == want_tokens
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)


def test_other_files_and_failed_rewrites_run_as_written(pretrained_export, monkeypatch):
    from attnx.runtime.core import ort_fusions as fuse_ort

    encoder = pretrained_export(gf.folder("llama"), "mha").path  # no cache: not a decoder that generates
    assert _load(encoder, True).fusions == {}

    def broken(path):
        raise RuntimeError("no such pattern")

    monkeypatch.setattr(fuse_ort, "fused_model_bytes", broken)
    with pytest.warns(RuntimeWarning, match="fused operators not applied .*no such pattern"):
        session = _load(gf.export(gf.folder("llama"), "mha"), True)
    assert session.fusions == {}
