"""Embedded use: ``attnx.runtime.TextModel(...).encode`` against sentence-transformers itself (the real
all-MiniLM-L6-v2, with mha and with a variant placed), and GPT-2 logits against transformers."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from attnx.runtime import TextModel, load
from attnx.runtime.core.text import TextTokenizer
from conftest_runtime import cosine_rows, long_text
from support import exports

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
             "A man is riding a horse.", "A woman is playing violin.", "Two men pushed carts through the woods.",
             "A man is riding a white horse on an enclosed ground.", "A monkey is playing drums.", "Hi",
             long_text(180, seed=1), long_text(400, seed=2)]  # the last one passes the max length, 256


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    return exports.minilm().path


@pytest.fixture(scope="module")
def model(minilm):
    return TextModel(minilm, device="cpu")


@pytest.fixture(scope="module")
def st():
    return exports.minilm_reference()


@pytest.mark.parametrize("batch_size", [1, 4, 32])
def test_encode_equals_sentence_transformers(model, st, batch_size):
    got = model.encode(SENTENCES, batch_size=batch_size)
    want = st.encode(SENTENCES, batch_size=batch_size)
    assert isinstance(got, np.ndarray) and got.shape == (len(SENTENCES), 384) and got.dtype == np.float32
    assert np.abs(got - want).max() < 2e-5
    assert cosine_rows(got, want).min() > 0.99999


def test_encode_options_as_sentence_transformers_has_them(model, st):
    got = model.encode(SENTENCES[:4], normalize_embeddings=True, show_progress_bar=True)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(got, st.encode(SENTENCES[:4], normalize_embeddings=True), atol=2e-5, rtol=0)
    one = model.encode("A man is eating food.")
    assert one.shape == (384,) and np.abs(one - st.encode("A man is eating food.")).max() < 2e-5
    as_list = model.encode(SENTENCES[:3], convert_to_numpy=False)
    assert isinstance(as_list, list) and len(as_list) == 3 and as_list[0].shape == (384,)
    tokens = model.encode(SENTENCES[:3], output_value="token_embeddings")
    ref = st.encode(SENTENCES[:3], output_value="token_embeddings")
    for g, w in zip(tokens, ref):
        assert g.shape == tuple(w.shape)
        np.testing.assert_allclose(g, w.numpy(), atol=3e-5, rtol=0)
    assert model.encode([]).shape == (0, 384)
    assert model.max_seq_length == st.max_seq_length == 256
    with pytest.raises(ValueError, match="output_value 'nope'"):
        model.encode(["x"], output_value="nope")


def test_a_folder_loads_and_a_missing_tokenizer_is_a_clear_error(minilm, tmp_path, st):
    folder = tmp_path / "export"
    folder.mkdir()
    for f in minilm.parent.iterdir():
        if f.name.startswith(minilm.stem):
            (shutil.copytree if f.is_dir() else shutil.copy2)(f, folder / f.name)
    got = TextModel(folder, device="cpu").encode(SENTENCES[:2])
    assert np.abs(got - st.encode(SENTENCES[:2])).max() < 2e-5
    shutil.rmtree(folder / f"{minilm.stem}.tokenizer")
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        TextModel(folder, device="cpu")


def test_a_variant_placed_in_minilm_still_equals_sentence_transformers(tmp_path_factory, st):
    """smal placed at its neutral values computes the original model; its context rows go with the texts."""
    path = exports.minilm("smal").path
    model = TextModel(path, device="cpu")
    context = {}
    for spec in model.session.inputs:
        if spec.role == "context":
            shape = [len(SENTENCES) if d == "batch" else d for d in spec.shape]
            context[spec.name] = np.random.default_rng(0).standard_normal(shape).astype(spec.dtype) * 0.1
    assert context, "smal takes context inputs"
    got = model.encode(SENTENCES, batch_size=4, context=context)
    assert np.abs(got - st.encode(SENTENCES)).max() < 5e-5


def test_tokenizer_follows_the_export_not_the_files_own_padding(minilm, st):
    tok = TextTokenizer.from_export(minilm, load(minilm, device="cpu").info)
    ids = tok.tokenize(["short text", long_text(400, seed=5)])
    want = st.tokenizer(["short text", long_text(400, seed=5)], truncation=True, max_length=256)["input_ids"]
    assert [list(e.ids) for e in ids] == want  # no padding to 128, truncation at 256 like sentence-transformers
    assert ids[1].truncated and not ids[0].truncated


# --- GPT-2: logits for text --------------------------------------------------------------------------

VOCAB_WORDS = ["<|endoftext|>", "[UNK]"] + sorted(set(" ".join(SENTENCES[:9]).lower().replace(".", " .").split()))


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    import transformers
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    from attnx.export.pretrained import export_pretrained

    transformers.logging.set_verbosity_error()
    folder = tmp_path_factory.mktemp("gpt2-text")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=len(VOCAB_WORDS), n_positions=48,
                                  bos_token_id=0, eos_token_id=0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(10.0)  # GPT-2's init gives near-constant logits; bigger weights make the check meaningful
    hf.save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB_WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    out = tmp_path_factory.mktemp("gpt2-export") / "gpt2.onnx"
    export_pretrained(folder, out, variant="mha")
    return TextModel(out, device="cpu"), hf, tok


def test_gpt2_logits_for_text_equal_transformers(gpt2):
    import torch

    model, hf, tok = gpt2
    texts = ["a man is eating food .", "a monkey is playing drums", "a woman is playing violin ."]
    got = model.logits(texts, batch_size=2)
    assert isinstance(got, list) and len(got) == 3
    for text, logits in zip(texts, got):
        ids = tok.encode(text).ids
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0].numpy()
        assert logits.shape == want.shape == (len(ids), len(VOCAB_WORDS))
        np.testing.assert_allclose(logits, want, atol=1e-5 * np.abs(want).max(), rtol=0)  # logits reach ~30
    one = model.logits("a man is riding a horse")
    assert one.shape == (6, len(VOCAB_WORDS))


def test_one_call_runs_texts_of_like_length_together():
    """Longest first, cut where a run reaches batch_size or its longest exceeds 1.5x the next text (the server's
    ratio): little padding, the same numbers as one padded batch (issue 25)."""
    from attnx.runtime.core.encode import length_chunks

    lengths = [78, 4, 70, 12, 11, 5, 9, 37]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    chunks = length_chunks(order, lengths, batch_size=32)
    assert [[lengths[i] for i in c] for c in chunks] == [[78, 70], [37], [12, 11, 9], [5, 4]]
    assert [len(c) for c in length_chunks(order, [10] * 8, batch_size=3)] == [3, 3, 2]


def test_length_runs_give_the_padded_batchs_numbers(model, monkeypatch):
    from attnx.pretrained.sentences import CALIBRATION, SENTENCES
    from attnx.runtime.core import encode as encode_module

    texts = [*SENTENCES, *CALIBRATION]
    runs = model.encode(texts, batch_size=32)
    monkeypatch.setattr(encode_module, "length_chunks", lambda o, lengths, b: [o[i:i + b] for i in range(0, len(o), b)])
    np.testing.assert_allclose(model.encode(texts, batch_size=32), runs, atol=1e-6)


def test_text_model_spins_by_default_and_a_served_session_does_not(model, minilm):
    """In process, ONNX Runtime's pool threads spin between ops (its own default, the peers'; one short text
    ~20% faster, benchmarks/bench_peers.py); `load()`, which `attnx serve` uses, keeps them idle; both can be
    changed, and the session options say what ONNX Runtime was given."""
    def spinning(session) -> bool:  # an unset entry is ONNX Runtime's default: spinning
        so = session.options.session_options()
        try:
            return so.get_session_config_entry("session.intra_op.allow_spinning") != "0"
        except RuntimeError:
            return True

    assert model.session.options.spin and spinning(model.session)
    served = load(minilm, device="cpu")
    assert not served.options.spin and not spinning(served)
    assert not TextModel(minilm, device="cpu", spin=False).session.options.spin
