"""ONNX Runtime's fused operators in with-past decoders (:mod:`attnx.runtime.core.ort_fusions`, at load on the CPU).

Each against the same file run as written (``decoder_fusions=False``), on the tiny random decoders the generation
tests already export (the shared export cache: no export of its own):

- plain attention (Llama: RMS norms, rotary, grouped K/V): every fusion applies; a prompt per row, the rows merged
  into one left-padded batch (masked slots at the front of the shorter row) and decoded: the same greedy tokens,
  logits within 1e-4; one run of several new tokens over a past for two rows with a masked slot (what ONNX
  Runtime's GroupQueryAttention refuses: run row by row) gives the same logits and ``present`` tensors;
- heads of 16 (a second tiny Llama): GroupQueryAttention with the cache held in place (kv_in_place), through
  prefill, merge, select, a state stepped twice and buffers that outgrow their capacity;
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


def _selected_greedy(session, prompts):
    """:func:`_greedy`, then row 1 alone (``select``) for two more steps, then row 1 stepped twice from one state
    (a fork): (tokens, logits per step)."""
    decoder = Decoder(session)
    tokens, logits = _greedy(session, prompts)
    firsts, states = zip(*(decoder.start(p) for p in prompts))
    state = decoder.merge(states)
    for step in range(STEPS - 1):
        _, state = decoder.step(state, [row[step + 1] for row in tokens])
    state = decoder.select(state, [1])
    for _ in range(2):
        step_logits, state = decoder.step(state, [tokens[1][-1]])
        logits.append(step_logits)
        tokens[1].append(int(np.argmax(step_logits[0])))
    one, _ = decoder.step(state, [5])
    other, after = decoder.step(state, [7])  # the same state again: its cache must not have changed
    again, _ = decoder.step(state, [5])
    logits += [one, other, again]
    return tokens, logits, after


def test_grouped_query_attention_with_the_cache_in_place(monkeypatch):
    """Heads of 16: the attention becomes GroupQueryAttention (rotary inside, the packed Q/K/V read as it is) and
    the cache stays in buffers the kernel writes into. Prefill, a merged left-padded batch, ``select``, a state
    stepped twice, buffers outgrown (first capacity 8): the tokens and logits of the file as written."""
    import onnx

    from attnx.runtime.core import kv_in_place

    monkeypatch.setattr(kv_in_place, "FIRST_CAPACITY", 8)
    path = gf.export(gf.wide_heads_folder(), "mha")
    fused, plain = _load(path, True), _load(path, False)
    assert fused.fusions["grouped_query_attention"] == fused.fusions["attention_with_past"] == 2, fused.fusions
    assert fused.fusions["cache_in_place"] == fused.fusions["padding_bias"] == 1
    assert fused.in_place_cache and not plain.in_place_cache
    ops = [n.op_type for n in _fused_graph(path).node]
    assert ops.count("GroupQueryAttention") == 2 and not {"Attention", "RotaryEmbedding"} & set(ops)
    written = onnx.load(str(path), load_external_data=False).graph.node
    assert ops.count("Split") < sum(n.op_type == "Split" for n in written)  # the packed Q/K/V's split is read in
    prompts = _prompts(Decoder(plain).vocab_size)
    want_tokens, want, _ = _selected_greedy(plain, prompts)
    got_tokens, got, state = _selected_greedy(fused, prompts)
    assert got_tokens == want_tokens
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)
    assert state.buffers is not None and state.buffers.capacity >= state.slots
    for name, view in state.cache.items():  # the state's cache is a view of the buffers ORT wrote
        assert np.shares_memory(view, state.buffers.arrays[name]) and view.shape[2] == state.slots
    # a decode step writes its ids into the array bound before (no new binding) and still reads the new token
    decoder = Decoder(fused)
    logits, state = decoder.start(prompts[0])
    for token in (3, 5, 3):
        logits, state = decoder.step(state, [token])
    held = state.buffers.bound["input_ids"]
    logits, state = decoder.step(state, [5])
    assert state.buffers.bound["input_ids"] is held and held[0, 0] == 5
    plain_decoder = Decoder(plain)
    want_logits, want_state = plain_decoder.start(prompts[0])
    for token in (3, 5, 3, 5):
        want_logits, want_state = plain_decoder.step(want_state, [token])
    np.testing.assert_allclose(logits, want_logits, atol=ATOL, rtol=0)


def test_cache_buffers_grow_by_doubling():
    from attnx.runtime.core.kv_in_place import FIRST_CAPACITY, capacity_for

    assert capacity_for(5) == FIRST_CAPACITY
    assert capacity_for(FIRST_CAPACITY + 1, FIRST_CAPACITY) == 2 * FIRST_CAPACITY
    assert capacity_for(5 * FIRST_CAPACITY, FIRST_CAPACITY) == 8 * FIRST_CAPACITY
    assert capacity_for(5, limit=65) == 65 and capacity_for(70, 64, limit=65) == 70


@pytest.mark.parametrize("heads", ["8", "16"])
def test_several_new_tokens_over_a_past_for_a_batch(heads):
    """Two rows, three new tokens each over a past of four slots, a masked slot in front and a left-padded row:
    logits and every ``present`` tensor as the file computes them (with heads of 16, GroupQueryAttention's kernel
    refuses this for two rows: the session runs it row by row)."""
    path = gf.export(gf.folder("llama") if heads == "8" else gf.wide_heads_folder(), "mha")
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
    assert bool(fused.fusions.get("grouped_query_attention")) == (heads == "16"), fused.fusions
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


def test_prompt_logprobs_through_grouped_query_attention():
    """The chunked prefill of prompt logprobs (several new tokens over the cache, ``logits_to_keep`` fed) on the
    GroupQueryAttention session: every token's logprob and rank as the file as written gives them."""
    from attnx.runtime.core.prompt_logprobs import score

    path = gf.export(gf.wide_heads_folder(), "mha")
    fused, plain = _load(path, True), _load(path, False)
    assert fused.fusions["grouped_query_attention"] == 2
    prompt = np.random.default_rng(5).integers(4, Decoder(plain).vocab_size, 23).tolist()
    want, got = score(Decoder(plain), prompt, top=3, chunk=7), score(Decoder(fused), prompt, top=3, chunk=7)
    assert want is not None and got is not None
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=ATOL, rtol=0)
    assert got.ranks.tolist() == want.ranks.tolist()


@pytest.mark.parametrize("config, causal", [
    ({"model_type": "llama"}, True),
    ({"sliding_window": 4096}, False),  # Mistral: the graph's mask holds the window
    ({"sliding_window": 4096, "use_sliding_window": False}, True),  # Qwen2's default
    ({"layer_types": ["sliding_attention", "full_attention"]}, False),
    ({"attention_chunk_size": 8192}, False),
])
def test_the_mask_becomes_the_padding_alone_only_for_plain_causal_attention(config, causal):
    """GroupQueryAttention is causal by itself, so the graph's mask may shrink to the padding; not where the
    model's attention is also windowed or chunked (its mask says what the kernel alone would not)."""
    import json

    import onnx_ir as ir

    from attnx.runtime.core.ort_fusions import causal_only

    model = ir.Model(ir.Graph([], [], nodes=[]), ir_version=10)
    model.metadata_props["attnx.config"] = json.dumps({"hf_config": config})
    assert causal_only(model) == causal
    assert not causal_only(ir.Model(ir.Graph([], [], nodes=[]), ir_version=10))  # nothing said: not assumed


@pytest.mark.parametrize("folder, fused", [("llama", False), ("llama", True), ("wide", True)])
def test_a_long_prompt_is_prefilled_in_runs_over_the_cache(folder, fused, monkeypatch):
    """``Decoder.start`` prefills a prompt longer than ``PREFILL_CHUNK`` a run at a time over the cache so far (the
    scores ONNX Runtime's attention holds stay [heads, chunk, tokens]): the next token's logits, and the greedy
    tokens after them, as one run of the whole prompt gives them (the file as written, its fused operators, and
    GroupQueryAttention with the cache in place)."""
    from attnx.runtime.core import decoding

    path = gf.export(gf.wide_heads_folder() if folder == "wide" else gf.folder("llama"), "mha")
    decoder = Decoder(_load(path, fused))
    prompt = np.random.default_rng(7).integers(4, decoder.vocab_size, 11).tolist()

    def greedy(chunk: int):
        monkeypatch.setattr(decoding, "PREFILL_CHUNK", chunk)
        first, state = decoder.start(prompt)
        tokens, logits = [int(np.argmax(first))], [first]
        for _ in range(STEPS):
            step, state = decoder.step(state, tokens[-1:])
            tokens.append(int(np.argmax(step[0])))
            logits.append(step[0])
        assert state.positions.tolist() == [len(prompt) + STEPS]
        return tokens, np.stack(logits)

    whole_tokens, whole = greedy(len(prompt))
    for chunk in (4, 5):  # runs of 4 + 4 + 3 and 5 + 5 + 1 tokens
        tokens, logits = greedy(chunk)
        assert tokens == whole_tokens
        np.testing.assert_allclose(logits, whole, atol=ATOL, rtol=0)
