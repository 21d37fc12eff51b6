"""`attnx check` on pretrained exports (issue 11, item 4): real text, compared with the original
model itself (sentence-transformers / transformers), per sentence; and bad input at export and check
time (one line, non-zero exit, nothing half-written)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from attnx import parity, pretrained  # noqa: E402
from attnx.contract import ModelInfo  # noqa: E402
from attnx.export.tokenizer import ExportTokenizer  # noqa: E402
from attnx.parity.text_cases import default_texts  # noqa: E402
from attnx.pretrained.sentences import SENTENCES  # noqa: E402
from support.cli import one_line_error  # noqa: E402
from support.cli import run as attnx  # noqa: E402

transformers.logging.set_verbosity_error()
MINILM = pretrained.minilm_path()
FEW = [SENTENCES[0], SENTENCES[1], SENTENCES[2], " ".join(SENTENCES)]  # short, short, 4 tokens, ~216 tokens


@pytest.fixture(scope="module")
def st(st_minilm):
    return st_minilm


def _comparison(report, runner, reference, output):
    return next(c for c in report.comparisons if (c.runner, c.reference, c.output) == (runner, reference, output))


def _ort_embeddings(path: Path, texts, output="sentence_embedding", model=None):
    """The export run by ONNX Runtime on each text alone, tokenized by the tokenizer beside it (a
    variant's context inputs at their example values from ``model``)."""
    import onnxruntime as ort

    from attnx.export.exporter import example_inputs

    info = ModelInfo.read(path)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    out = []
    for enc in ExportTokenizer(path, info).encode(texts):
        ids = np.asarray([enc.ids], dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.asarray([enc.type_ids])}
        if model is not None:
            extra = example_inputs(model, batch=1, seq=ids.shape[1])
            feeds.update({k: v.numpy() for k, v in extra.items() if k not in feeds})
        out.append(sess.run([output], {k: v for k, v in feeds.items() if k in names})[0][0].astype(np.float64))
    return out


def _cosines(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


# ----------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def fp32_report(minilm_export, tmp_path_factory):
    return parity.run_check(minilm_export("mha").path, workdir=tmp_path_factory.mktemp("check32"))


def test_fp32_export_equals_sentence_transformers_on_every_sentence(fp32_report, minilm_export, st):
    rep, path = fp32_report, minilm_export("mha").path
    texts = default_texts()
    assert rep.passed and rep.verdict == "pass" and rep.original["used"], rep.mismatches()
    assert "sentence-transformers" in rep.original["library"]
    hidden = _comparison(rep, "onnxrt-plugin", "original", "last_hidden_state")
    emb = _comparison(rep, "onnxrt-plugin", "original", "sentence_embedding")
    assert sorted(r["text"] for r in hidden.rows) == list(range(len(texts)))  # every sentence, once
    assert hidden.gate.metric == "max_abs" and hidden.gate.bound == 1e-4
    assert max(r["max_abs"] for r in hidden.rows) <= 1e-4
    assert min(r["cosine"] for r in emb.rows) >= 0.999
    lengths = [t["tokens"] for t in rep.texts]
    assert min(lengths) <= 4 and 128 < sorted(lengths)[-2] <= 256 and rep.texts[-1]["truncated"]  # varied lengths
    assert any(len(b) > 1 for b in rep.batches)  # batched, so padding is exercised

    # The same figures recomputed here: the export alone per text against SentenceTransformer.encode.
    got = np.stack(_ort_embeddings(path, texts))
    want = st.encode(texts, convert_to_numpy=True).astype(np.float64)
    cos = _cosines(got, want)
    assert cos.min() >= 0.999 and np.abs(got - want).max() <= 1e-4
    by_text = {r["text"]: r for r in emb.rows}
    for i, c in enumerate(cos):  # the report's per-sentence cosine is the real one
        assert abs(by_text[i]["cosine"] - c) < 1e-6
    # last_hidden_state against transformers' BertModel on the export's own token ids
    hf = st[0].auto_model.eval()
    for text, hidden_got in zip(texts[:3], _ort_embeddings(path, texts[:3], "last_hidden_state")):
        ids = torch.tensor([st.tokenizer(text)["input_ids"]])
        with torch.no_grad():
            ref = hf(input_ids=ids).last_hidden_state[0].double().numpy()
        assert np.abs(hidden_got - ref).max() <= 1e-4


def _corrupt_copy(path: Path, dest: Path, token: str) -> Path:
    """A copy of the export whose ONNX has one word-embedding row moved (the weights file beside it,
    which the torch reference reads, is intact)."""
    import onnx
    from onnx import numpy_helper

    dest.mkdir()
    for p in path.parent.iterdir():
        if p.name.startswith(path.stem + "."):
            (shutil.copytree if p.is_dir() else shutil.copy2)(p, dest / p.name)
    model = onnx.load(str(path))
    info = ModelInfo.read(path)
    token_id = ExportTokenizer(path, info).tokenizer.token_to_id(token)
    table = next(t for t in model.graph.initializer if list(t.dims) == [30522, 384])
    arr = numpy_helper.to_array(table).copy()
    arr[token_id] += np.random.default_rng(0).normal(0, 0.05, arr.shape[1])  # not a constant: LayerNorm removes that
    table.CopyFrom(numpy_helper.from_array(arr, table.name))
    onnx.save(model, str(dest / path.name))
    return dest / path.name


def test_a_corrupted_export_fails_and_names_the_sentence(minilm_export, tmp_path):
    bad = _corrupt_copy(minilm_export("mha").path, tmp_path / "bad", "guitar")
    rep = parity.run_check(bad, workdir=tmp_path, texts=FEW[:3])
    assert not rep.passed and rep.verdict == "FAIL"
    failed = {(c.runner, c.reference, c.output): [r["text"] for r in c.rows if not r["passed"]]
              for c in rep.comparisons if not c.passed}
    # Only the guitar sentence moves; the reference (intact weights) still equals the original.
    assert failed[("onnxrt-plugin", "original", "last_hidden_state")] == [1]
    assert failed[("onnxrt-plugin", "torch", "last_hidden_state")] == [1]
    assert not any(k[0] == "torch" for k in failed)
    assert any('sentence 1 ("A man is playing a guitar.")' in m for m in rep.mismatches())
    row = next(r for r in _comparison(rep, "onnxrt-plugin", "original", "last_hidden_state").rows if r["text"] == 1)
    assert row["max_abs"] > 1e-3


def test_fp16_export_keeps_every_sentence_embedding(minilm_export, tmp_path, st):
    path = minilm_export("mha", fp16=True).path
    rep = parity.run_check(path, workdir=tmp_path, texts=FEW)
    assert rep.precision == "fp16" and rep.passed, rep.mismatches()
    emb = _comparison(rep, "onnxrt-plugin", "original", "sentence_embedding")
    assert emb.gate.metric == "cosine" and emb.gate.bound == 0.999
    assert len(emb.rows) == len(FEW) and all(r["cosine"] >= 0.999 for r in emb.rows)
    assert _comparison(rep, "onnxrt-plugin", "original", "last_hidden_state").gate.metric == "report"
    cos = _cosines(np.stack(_ort_embeddings(path, FEW)), st.encode(FEW, convert_to_numpy=True))
    assert cos.min() >= 0.999
    assert max(r["max_abs"] for r in emb.rows) > 1e-6  # really fp16: not the fp32 file again


@pytest.fixture(scope="module")
def trained_cultural(tmp_path_factory):
    """Random (non-neutral) parameters for cultural in layers 1 and 2 of MiniLM."""
    host = pretrained.load(MINILM, "cultural", layers=[1, 2])
    g = torch.Generator().manual_seed(5)
    state = host.state_dict()
    out = {}
    for name in host.variant_parameter_names():
        t = state[name]
        out[name] = (torch.randn(t.shape, generator=g) * 0.5 / (t.shape[-1] ** 0.5 if t.dim() >= 2 else 1.0)).contiguous()
    path = tmp_path_factory.mktemp("cultural") / "cultural.safetensors"
    save_file(out, str(path))
    return path


def test_a_trained_placed_variant_is_compared_with_the_reference_not_the_original(minilm_export, trained_cultural,
                                                                                   tmp_path, st):
    res = minilm_export("cultural", layers=[1, 2], checkpoint=trained_cultural)
    rep = parity.run_check(res.path, workdir=tmp_path, texts=FEW)
    assert rep.passed, rep.mismatches()
    assert rep.original["used"] is False and "original model no longer applies" in rep.original["note"]
    assert rep.notes[0] == rep.original["note"]
    assert {c.reference for c in rep.comparisons} == {"torch"}
    hidden = _comparison(rep, "onnxrt-plugin", "torch", "last_hidden_state")
    assert len(hidden.rows) == len(FEW) and max(r["max_abs"] for r in hidden.rows) <= 1e-4
    # The original really no longer applies: the trained variant moved the embeddings.
    got = np.stack(_ort_embeddings(res.path, FEW, model=res.model))
    assert np.abs(got - st.encode(FEW, convert_to_numpy=True)).max() > 1e-3  # fp32 noise is ~1e-6


# ----------------------------------------------------------------------------- the CLI on a small BERT


def one_line(result, *phrases):
    return one_line_error(result, *phrases, alone=True)


def _bert_folder(folder: Path, vocab: int = 30522, positions: int = 64, pooling: dict | None = None) -> Path:
    """A small BERT saved by transformers itself, MiniLM's tokenizer beside it; with ``pooling`` a
    sentence-transformers folder (modules.json, 1_Pooling/config.json)."""
    cfg = transformers.BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=positions)
    torch.manual_seed(0)
    transformers.BertModel(cfg, add_pooling_layer=False).save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy2(MINILM / name, folder / name)
    if pooling is not None:
        for name in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"):
            shutil.copy2(MINILM / name, folder / name)
        (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": positions // 2,
                                                                      "do_lower_case": False}))
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **pooling}))
    return folder


@pytest.fixture(scope="module")
def small_st(tmp_path_factory):
    return _bert_folder(tmp_path_factory.mktemp("st") / "bert", pooling={"pooling_mode_mean_tokens": True})


def test_check_cli_prints_a_table_per_sentence_and_passes(small_st, tmp_path):
    out = attnx("export", "--from-pretrained", small_st, "-o", tmp_path / "m" / "m.onnx", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    proc = attnx("check", tmp_path / "m" / "m.onnx", "--report", tmp_path / "r.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.startswith("PASS in ") for line in lines)
    assert "onnxrt-plugin vs original" in proc.stdout and "per sentence (against the original model)" in proc.stdout
    data = json.loads((tmp_path / "r.json").read_text())
    rows = [line for line in lines if line.startswith("│")]
    assert len(rows) == len(data["texts"]) == len(default_texts())  # one row per sentence
    emb = next(c for c in data["comparisons"] if (c["runner"], c["reference"], c["output"])
               == ("onnxrt-plugin", "original", "sentence_embedding"))
    first = next(s for s in emb["sentences"] if s["text"] == 0)
    cells = [c.strip() for c in rows[0].split("│")[1:-1]]
    assert cells[0] == "0" and cells[1] == str(data["texts"][0]["tokens"]) and cells[-1] == "pass"
    assert cells[-2] == f"{first['cosine']:.6f}"  # the cosine column is the report's figure
    assert data["passed"] and data["original"]["used"] and data["texts"][-1]["truncated"]  # cut at max_seq_length


def _assert_nothing_written(folder: Path, before: set):
    assert {p.name for p in folder.iterdir()} == before, sorted(p.name for p in folder.iterdir())


def test_export_bad_input_is_one_line_and_writes_nothing(small_st, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    mpnet = _bert_folder(tmp_path / "mpnet")
    cfg = json.loads((mpnet / "config.json").read_text())
    (mpnet / "config.json").write_text(json.dumps({**cfg, "model_type": "mpnet", "architectures": ["MPNetModel"]}))
    one_line(attnx("export", "--from-pretrained", mpnet, "-o", out / "a.onnx", cwd=tmp_path),
             "model_type 'mpnet'", "does not route attention through transformers' AttentionInterface")
    pool = _bert_folder(tmp_path / "pool", pooling={"pooling_mode_weightedmean_tokens": True})
    one_line(attnx("export", "--from-pretrained", pool, "-o", out / "b.onnx", cwd=tmp_path),
             "pooling mode pooling_mode_weightedmean_tokens is not supported")
    one_line(attnx("export", "--from-pretrained", small_st, "--seq", "1,8,100", "-o", out / "c.onnx", cwd=tmp_path),
             "exceeds the model's 64 positions")
    host = pretrained.load(small_st, "smal")
    state = host.state_dict()
    wrong = {n: torch.zeros(*state[n].shape, 2) for n in host.variant_parameter_names()}
    save_file(wrong, str(tmp_path / "smal.safetensors"))
    one_line(attnx("export", "--from-pretrained", small_st, "--variant", "smal", "--checkpoint",
                   tmp_path / "smal.safetensors", "-o", out / "d.onnx", cwd=tmp_path), "wrong shape")
    _assert_nothing_written(out, set())


def test_check_bad_input_is_one_line_and_writes_no_report(small_st, tmp_path):
    # A tokenizer that does not belong to the model: MiniLM's ids reach 30521, this model has 100.
    small_vocab = _bert_folder(tmp_path / "v100", vocab=100)
    m = tmp_path / "m"
    assert attnx("export", "--from-pretrained", small_vocab, "-o", m / "v.onnx", cwd=tmp_path).returncode == 0
    one_line(attnx("check", m / "v.onnx", cwd=tmp_path), "outside the model's vocabulary [0, 100)", "text 0",
             "v.tokenizer")
    # --original of another architecture, of an unknown pooling mode, of another model
    assert attnx("export", "--from-pretrained", small_st, "-o", m / "s.onnx", cwd=tmp_path).returncode == 0
    mpnet = _bert_folder(tmp_path / "mpnet")
    (mpnet / "config.json").write_text(json.dumps({**json.loads((mpnet / "config.json").read_text()),
                                                   "model_type": "mpnet", "architectures": ["MPNetModel"]}))
    one_line(attnx("check", m / "s.onnx", "--original", mpnet, cwd=tmp_path), "--original", "model_type 'mpnet'")
    pool = _bert_folder(tmp_path / "pool", pooling={"pooling_mode_weightedmean_tokens": True})
    one_line(attnx("check", m / "s.onnx", "--original", pool, cwd=tmp_path), "--original", "pooling_mode_weightedmean")
    one_line(attnx("check", m / "s.onnx", "--original", small_vocab, cwd=tmp_path),
             "not the model this export was made from")
    # A tokenizer that truncates past the model's positions (edited metadata)
    meta = ModelInfo.read(m / "s.onnx")
    import onnx

    proto = onnx.load(str(m / "s.onnx"))
    meta.tokenizer = dataclasses.replace(meta.tokenizer, max_length=65)
    meta.write(proto)
    onnx.save(proto, str(m / "s.onnx"))
    one_line(attnx("check", m / "s.onnx", cwd=tmp_path), "truncates at 65 tokens", "64 positions")
    assert not (tmp_path / "attnx-out" / "parity").exists() or not list((tmp_path / "attnx-out" / "parity").glob("*.json"))
