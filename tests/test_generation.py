"""Decoders generate (issue 23): the with-past signature, its cache semantics per variant, the export, the
generation loop and sampling, each against transformers itself.

- the criterion, for every variant (moved off its neutral values, so the variant's own math is what the
  cache carries): greedy generation with the cache (a left-padded batch of two prompts, driven by the
  runtime's own :class:`~attnx.runtime.core.decoding.Decoder`) equals greedy generation by re-running the full
  sequence each step, token for token; maw in an earlier layer, whose cached form is documented as not
  exact, equals it while its depth stays the same;
- the with-past ONNX export on ONNX Runtime equals transformers' own ``generate`` (mha and a neutral
  placement) and the full-recompute reference (trained smal, trained appended maw), and ``attnx check``
  passes on it;
- sampling (repetition penalty, temperature, top-k, top-p) gives transformers' logits processors'
  distribution; streamed text equals the tokens decoded at once; stop strings cut exactly;
- the scheduler batches concurrent generations at the step level with the tokens each gets alone, and
  frees a cancelled request's row.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import generation_fixtures as gf

import transformers
transformers.logging.set_verbosity_error()

from attnx import pretrained  # noqa: E402
from attnx.parity.generation import TorchSession  # noqa: E402
from attnx.pretrained.cached import CachedHost  # noqa: E402
from attnx.runtime.core.decoding import Decoder, NotAGenerator  # noqa: E402
from attnx.runtime.core.sampling import SamplingError, SamplingParams, sampling_params  # noqa: E402

STEPS = 6


pytestmark = pytest.mark.usefixtures("toy_registered")  # the toy variant, for this module only


def prompts(vocab: int) -> list[list[int]]:
    g = np.random.default_rng(1)
    return [g.integers(4, vocab, 7).tolist(), g.integers(4, vocab, 3).tolist()]


def cached_greedy(host, batch: list[list[int]], steps: int, context=None, attention: str = "fast") -> list[list[int]]:
    """Greedy generation with the cache: each prompt prefilled, both merged into one left-padded batch."""
    session = TorchSession.of(CachedHost.of(host))
    session.attention = attention
    decoder = Decoder(session)
    firsts, states = [], []
    for ids in batch:
        logits, state = decoder.start(ids, context)
        firsts.append(int(np.argmax(logits)))
        states.append(state)
    state, out = decoder.merge(states), [[t] for t in firsts]
    for _ in range(steps - 1):
        logits, state = decoder.step(state, [row[-1] for row in out])
        for row, lg in zip(out, logits):
            row.append(int(np.argmax(lg)))
    return out


CASES = [("llama", "mha", {}), ("llama", "smal", {}), ("gpt2", "cultural", {}), ("qwen3", "metaphor", {}),
         ("mistral", "toy", {}), ("llama", "maw", {}), ("gpt2", "maw", {}), ("llama", "maw", {"layers": [1], "append": 0}),
         ("gemma3", "smal", {"layers": [0]})]


@pytest.mark.parametrize("family,variant,placement", CASES,
                         ids=[f"{f}-{v}{'-' + '-'.join(map(str, p.get('layers', []))) if p else ''}" for f, v, p in CASES])
def test_cache_equals_full_recompute(family, variant, placement):
    host = pretrained.load(gf.folder(family), variant, **placement)
    gf.move_off_neutral(host)
    ctx = gf.neutral_context(host.context_inputs())
    batch = prompts(host.vocab_size)
    want = [gf.greedy_full_recompute(host, p, STEPS, {k: torch.from_numpy(v) for k, v in ctx.items()})
            for p in batch]
    assert cached_greedy(host, batch, STEPS, ctx) == want
    if variant in ("smal", "maw"):  # the literal formulas (reference path) give the same tokens
        assert cached_greedy(host, batch, STEPS, ctx, attention="reference") == want


def test_maw_in_an_earlier_layer_equals_full_recompute_while_its_depth_holds():
    """maw's documented cached semantics in a layer before the last: past tokens keep their step's keys; with
    the depth fixed (the policy's last bias makes one depth win), cached == full recompute."""
    torch.manual_seed(0)  # maw's own parameters start random
    host = pretrained.load(gf.folder("llama"), "maw", layers=[0], append=0)
    gf.move_off_neutral(host)
    with torch.no_grad():
        policy = host.blocks[0].attn.policy[-1]
        policy.weight.zero_()
        policy.bias.copy_(torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0]))
    batch = prompts(host.vocab_size)
    want = [gf.greedy_full_recompute(host, p, STEPS) for p in batch]
    assert cached_greedy(host, batch, STEPS) == want
    # a policy that changes its depth as the sequence grows: re-running the sequence recomputes the past
    # tokens of layer 0 under the new depth, the cache does not (the documented difference shows)
    torch.manual_seed(0)
    host = pretrained.load(gf.folder("llama"), "maw", layers=[0], append=0)
    gf.move_off_neutral(host)
    with torch.no_grad():
        host.blocks[0].attn.policy[-1].bias.copy_(torch.tensor([0.0, 0.0, 50.0, 0.0, 0.0]))
    want = [gf.greedy_full_recompute(host, p, STEPS) for p in batch]
    assert cached_greedy(host, batch, STEPS) != want


def test_cache_layout_names_every_state():
    cached = CachedHost.of(pretrained.load(gf.folder("llama"), "maw"))  # appended after layer 1
    meta = cached.cache_metadata()
    names = {e["input"] for e in meta["entries"]}
    assert {"past_key_values.0.key", "past_key_values.1.value", "past_key_values.2.key", "past_key_values.2.value",
            "past_key_values.2.key_depth", "past_key_values.2.pool_sum", "past_key_values.2.pool_count"} <= names
    assert meta["layers"] == 3 and meta["host_layers"] == 2
    assert {e["axis"] for e in meta["entries"] if e["name"] == "pool_sum"} == {None}
    assert "exact when appended" in meta["semantics"]["maw"]
    smal = CachedHost.of(pretrained.load(gf.folder("llama"), "smal")).cache_metadata()
    assert [e["shape"] for e in smal["entries"] if e["name"] == "key_term"][0] == ["batch", 4, "past"]
    with pytest.raises(ValueError, match="causal LM"):
        CachedHost.of(pretrained.load(gf.folder("bert"), "mha"))


# --------------------------------------------------------------------------- the export


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_export_generates_as_transformers_does(family):
    """mha and a neutral placement (smal, every layer): greedy on ONNX Runtime == transformers' generate."""
    from attnx.runtime import TextModel

    source = gf.folder(family)
    for variant in ("mha", "smal"):
        model = TextModel(gf.export(source, variant))
        ids = model.tokenizer.tokenize(["the cat sat on the mat"])[0].ids.tolist()
        pieces = list(model.generate("the cat sat on the mat", max_new_tokens=10, details=True))
        got = [p.token for p in pieces if p.token is not None]
        want = gf.greedy_transformers(source, ids, 10)
        eos = model.decoder.layout.eos
        cut = next((i for i, t in enumerate(want) if t in eos), len(want))
        assert got[:cut + 1] == want[:cut + 1], variant
        assert "".join(p.text for p in pieces) == model.tokenizer.decode(got)


@pytest.mark.parametrize("variant,lowering,placement", [("smal", "rewrite", {}), ("smal", "plugin", {}),
                                                         ("maw", "plugin", {})])
def test_trained_export_equals_full_recompute(variant, lowering, placement, tmp_path):
    """A trained placement (saved folder), exported with its cache: ONNX Runtime's greedy tokens, batched,
    equal the full-recompute reference's; ``attnx check`` passes on the file."""
    from attnx.parity import run_check
    from attnx.runtime import load

    folder = gf.trained_folder("llama", variant, **placement)
    path = gf.export(folder, None, lowering)
    host = pretrained.load(folder)
    decoder = Decoder(load(path, device="cpu"))
    batch = prompts(host.vocab_size)
    ctx = gf.neutral_context(host.context_inputs())
    firsts, states = zip(*(decoder.start(p, ctx) for p in batch))
    out = [[int(np.argmax(f))] for f in firsts]
    state = decoder.merge(states)
    for _ in range(STEPS - 1):
        logits, state = decoder.step(state, [r[-1] for r in out])
        for r, lg in zip(out, logits):
            r.append(int(np.argmax(lg)))
    torch_ctx = {k: torch.from_numpy(v) for k, v in ctx.items()}
    assert out == [gf.greedy_full_recompute(host, p, STEPS, torch_ctx) for p in batch]
    report = run_check(path, engine=None, workdir=tmp_path / "parity")
    assert report.kind == "generation" and report.passed, report.mismatches()
    assert any(c["output"] == "present.*" for c in report.comparisons)


def test_check_compares_with_the_original(tmp_path):
    from attnx.parity import run_check

    report = run_check(gf.export(gf.folder("llama"), "mha"), workdir=tmp_path / "parity")
    assert report.passed, report.mismatches()
    original = [c for c in report.comparisons if c["reference"] == "original"]
    assert original and original[0]["max_abs"] < 1e-4


def test_the_export_computes_the_last_positions_logits_only():
    """A with-past export's ``logits`` are ``[batch, 1, vocab]`` unless ``logits_to_keep`` asks for more (its default
    in the file: the last position), at a prefill too (the LM head never runs on the whole prompt), and equal
    transformers' logits there (more positions: tests/test_prompt_logprobs.py)."""
    from attnx.runtime import load

    source = gf.folder("llama")
    session = load(gf.export(source, "mha"), device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(source, local_files_only=True).eval()
    vocab = hf.config.vocab_size
    assert session.output("logits").shape == ("batch", 1, vocab)
    ids = prompts(vocab)[0]
    decoder = Decoder(session)
    feeds = decoder._feeds(decoder.start(ids[:1])[1], np.array([ids[1:]]), np.ones((1, len(ids) - 1), np.int64))
    out = session.run(feeds, ["logits"])["logits"]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0, -1].numpy()
    assert out.shape == (1, 1, vocab)
    np.testing.assert_allclose(out[0, 0], want, atol=1e-4)


def test_decode_steps_hand_the_cache_back_without_a_copy():
    """Every step's ``present.*`` go back as the next step's ``past_key_values.*`` at the same address, and those
    arrays are ONNX Runtime's own output buffers (numpy wraps them: no copy on the way out either). The IOBinding
    path a GPU session takes (run here on the CPU) gives the same logits, its cache kept as ``OrtValue`` s."""
    import onnxruntime as ort

    from attnx.runtime import load

    session = load(gf.export(gf.folder("llama"), "mha"), device="cpu")
    calls, run = [], session._run

    def spy(feeds, names):
        out = run(feeds, names)
        calls.append(({k: v.ctypes.data for k, v in feeds.items()}, out))
        return out

    session._run = spy
    plain, bound = Decoder(session), Decoder(session, bind=True)
    assert not plain.session.on_device and plain._keeping is None
    batch = prompts(plain.vocab_size)
    got = {}
    for name, decoder in (("plain", plain), ("bound", bound)):
        firsts, states = zip(*(decoder.start(p) for p in batch))
        state, rows = decoder.merge(states), [np.stack(firsts)]
        for step in range(4):
            logits, state = decoder.step(state, [7 + step, 9])
            rows.append(logits)
        logits, state = decoder.step(decoder.select(state, [1]), [3])  # a row leaves: the cache comes to the host
        got[name] = rows + [logits]
        kinds = {type(v) for v in state.cache.values()}
        assert kinds == ({np.ndarray} if name == "plain" else {ort.OrtValue}), name
    for a, b in zip(got["plain"], got["bound"]):
        np.testing.assert_allclose(a, b, atol=1e-6)
    pairs = [(t.output, t.input) for t in plain.layout.tensors]
    steps = calls[len(batch):len(batch) + 4]  # the plain decoder's steps after the merge (IOBinding bypasses _run)
    assert len(steps) == 4
    for (_, before), (feeds, _) in zip(steps, steps[1:]):
        for present, past in pairs:
            assert feeds[past] == before[present].ctypes.data, past
            assert not before[present].flags.owndata  # ONNX Runtime's buffer, not a copy of it


def test_a_file_without_a_cache_does_not_generate(pretrained_export):
    from attnx.runtime import TextModel

    path = pretrained_export(gf.folder("llama"), "mha").path
    with pytest.raises(NotAGenerator, match="--with-past"):
        next(iter(TextModel(path).generate("hi")))


# --------------------------------------------------------------------------- sampling and text


def test_sampling_distribution_is_transformers():
    """The distribution a token is drawn from equals transformers' processors' (penalty, temperature, top-k,
    top-p), and draws follow it."""
    from transformers.generation.logits_process import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    from attnx.runtime.core.sampling import distribution

    g = np.random.default_rng(0)
    logits = (g.standard_normal(50) * 3).astype(np.float32)
    seen = [3, 7, 7, 11]
    for t, k, p, r in [(0.7, 10, 0.9, 1.3), (1.0, 0, 0.5, 1.0), (2.0, 5, 1.0, 0.8), (1.0, 0, 1.0, 1.0)]:
        params = SamplingParams(temperature=t, top_k=k, top_p=p, repetition_penalty=r, do_sample=True)
        procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(r), TemperatureLogitsWarper(t)]
                                    + ([TopKLogitsWarper(k)] if k else []) + ([TopPLogitsWarper(p)] if p < 1 else []))
        want = torch.softmax(procs(torch.tensor([seen]), torch.tensor(logits)[None].clone()), -1)[0].numpy()
        np.testing.assert_allclose(distribution(logits, params, seen), want, atol=1e-6)
    from attnx.runtime.core.sampling import next_token

    params = SamplingParams(temperature=0.7, top_k=10, do_sample=True, seed=5)

    rng = params.rng()
    counts = np.bincount([next_token(logits, params, rng) for _ in range(4000)], minlength=50) / 4000
    np.testing.assert_allclose(counts, distribution(logits, params), atol=0.03)
    rng_a, rng_b = params.rng(), params.rng()  # a seed gives the same draws
    assert [next_token(logits, params, rng_a) for _ in range(20)] == [next_token(logits, params, rng_b)
                                                                      for _ in range(20)]


@pytest.mark.parametrize("bad,match", [({"max_new_tokens": 0}, "max_new_tokens"), ({"top_p": 1.5}, "top_p"),
                                       ({"top_k": -1}, "top_k"), ({"temperature": -0.1}, "temperature"),
                                       ({"repetition_penalty": 0}, "repetition_penalty"), ({"stop": [""]}, "stop"),
                                       ({"seed": -1}, "seed")])
def test_sampling_parameters_are_checked(bad, match):
    with pytest.raises(SamplingError, match=match):
        sampling_params(**bad)


def test_greedy_unless_sampling_is_asked_for():
    assert sampling_params().greedy and sampling_params(temperature=0.0, top_k=5).greedy
    assert not sampling_params(temperature=0.8).greedy and not sampling_params(top_p=0.9).greedy


def test_streamed_text_equals_decoding_at_once():
    """Byte-level BPE splits characters over tokens: the pieces, joined, equal the whole decode; stop strings
    are cut out exactly, even when streamed."""
    from attnx.runtime.core.detokenize import TextStream
    from attnx.runtime.core.text import TextTokenizer

    tok = TextTokenizer.from_folder(gf.folder("gpt2"))
    text = "naïve café — 東京 🙂 the cat sat on the mat"
    ids = tok.tokenize([text], add_special_tokens=False)[0].ids.tolist()
    stream = TextStream(tok)
    pieces = [stream.add(t) for t in ids] + [stream.finish()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    stream = TextStream(tok, stop=["on the", "zzz"])
    out = "".join(stream.add(t) for t in ids) + stream.finish()
    assert out == text[:text.index("on the")] and stream.stopped


# --------------------------------------------------------------------------- step-level batching


@pytest.mark.parametrize("heads", ["8", "16"])
def test_scheduler_batches_steps_with_the_tokens_each_gets_alone(heads):
    """Heads of 16: ONNX Runtime's GroupQueryAttention with the cache held in place (runtime/core/kv_in_place.py)
    through the scheduler's joins, merges and leaves."""
    from attnx.runtime import TextModel
    from attnx.runtime.core.generate import stream
    from attnx.runtime.core.scheduler import GenerationScheduler

    model = TextModel(gf.export(gf.folder("llama") if heads == "8" else gf.wide_heads_folder(), "mha"))
    decoder, tok = model.decoder, model.tokenizer
    assert (decoder._in_place is not None) == (heads == "16")
    texts = ["the cat", "a dog ran in the park", "hi", "the quick brown fox jumps", "one", "two three four"]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    alone = [[p.token for p in stream(decoder, tok, tok.tokenize([t])[0].ids, params)] for t in texts]
    scheduler = GenerationScheduler(decoder, tok, max_batch=4, name="llama")
    got, done = [[] for _ in texts], threading.Semaphore(0)

    def deliver(i):
        def on_piece(piece):
            got[i].append(piece.token)
            if piece.finish_reason:
                done.release()
        return on_piece

    try:
        for i, t in enumerate(texts):
            scheduler.submit(tok.tokenize([t])[0].ids.tolist(), params, deliver(i), lambda m: None)
        for _ in texts:
            assert done.acquire(timeout=60)
    finally:
        scheduler.close()
    assert got == alone
    assert scheduler.stats.max_rows == 4  # at most max_batch rows decode together, and they did
    assert scheduler.stats.rows / scheduler.stats.steps > 1.5  # rows share runs (arrivals join mid-way)


def test_a_cancelled_request_leaves_at_the_next_step():
    import time

    from attnx.runtime import TextModel
    from attnx.runtime.core.scheduler import GenerationScheduler

    model = TextModel(gf.export(gf.folder("llama"), "mha"))
    scheduler = GenerationScheduler(model.decoder, model.tokenizer, max_batch=8, name="llama")
    seen = []
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)

    def wait(condition):
        deadline = time.monotonic() + 30
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.002)
        return condition()

    try:
        long_run = scheduler.submit([1, 5, 6], params, lambda p: None, lambda m: None)
        other = scheduler.submit([1, 7, 8], params, lambda p: seen.append(p.token), lambda m: None)
        assert wait(lambda: scheduler.running == 2)
        scheduler.cancel(long_run)
        assert wait(lambda: long_run.finished)
        assert scheduler.running <= 1 and len(long_run.generation.tokens) < 60
        assert wait(lambda: other.finished)
    finally:
        scheduler.close()
    assert len(seen) == 60


def test_an_engine_generates_from_its_onnx_metadata():
    """An engine's sidecar has no attnx.* keys: the decoder and the tokenizer come from the ONNX it names
    (a session standing in for the engine, which needs a GPU: the ONNX file's own runs behind it)."""
    from attnx.runtime import TextModel, load
    from attnx.runtime.core.session import Session

    path = gf.export(gf.folder("llama"), "mha")
    inner = load(path, device="cpu")

    class EngineLike(Session):
        platform, provider = "tensorrt_plan", "tensorrt:stand-in"

        def __init__(self):
            self.path = path.with_suffix(".engine")
            self.inputs, self.outputs = inner.inputs, inner.outputs
            self.sidecar = {"onnx": str(path), "onnx_name": path.name, "profiles": {"batch": [1, 8, 32]}}
            self.metadata = {"onnx_name": path.name}

        def _run(self, feeds, names):
            return inner._run(feeds, names)

    engine = TextModel(EngineLike())
    assert list(engine.generate("the cat", max_new_tokens=6)) == list(TextModel(path).generate("the cat",
                                                                                               max_new_tokens=6))
