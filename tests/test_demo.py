"""`attnx demo` (issue 12 item 5): the semantic search it runs over a served real all-MiniLM-L6-v2 with
smal placed, and examples/semantic_search.py, both against sentence-transformers' own
``util.semantic_search``; the comparison catching a wrong ranking; ``--toy`` still running.

The whole real demo (two exports, checks, engines: ~3 min) is not run here; its pieces are."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from attnx.cli import demo_minilm as demo
from conftest_runtime import running_server
from support import exports
from support.cli import run as attnx

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "semantic_search.py"


@pytest.fixture(scope="module")
def server(minilm_export):
    # smal placed in every layer: the model declares context inputs (self_state, trace) besides the text
    with running_server({"minilm-smal": minilm_export("smal").path}, grpc_port=0) as s:
        yield s


@pytest.fixture(scope="module")
def st():
    return exports.minilm_reference()


def st_search(st, queries: list[str], corpus: list[str], k: int):
    """sentence-transformers' own search: [[(corpus index, cosine)]] per query, best first."""
    from sentence_transformers import util

    q = st.encode(queries, convert_to_tensor=True)
    c = st.encode(corpus, convert_to_tensor=True)
    return [[(h["corpus_id"], h["score"]) for h in hits] for hits in util.semantic_search(q, c, top_k=k)]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_served_search_matches_sentence_transformers(server, st, protocol):
    address = server.address if protocol == "http" else server.grpc_address
    texts = demo.QUERIES + demo.CORPUS
    context = demo.context_inputs(address, "minilm-smal", len(texts), protocol)
    assert {k: v.shape for k, v in context.items()} == {"self_state": (len(texts), 32), "trace": (len(texts), 32, 32)}
    emb = demo.embed(address, "minilm-smal", texts, protocol, context)
    want = st.encode(texts, convert_to_numpy=True)
    assert emb.shape == want.shape == (len(texts), 384)
    np.testing.assert_allclose(emb, want, atol=2e-5, rtol=0)

    scores, top = demo.search(emb[:len(demo.QUERIES)], emb[len(demo.QUERIES):])
    reference = st_search(st, demo.QUERIES, demo.CORPUS, demo.TOP_K)
    for q, hits in enumerate(reference):
        assert [int(i) for i in top[q]] == [i for i, _ in hits], (q, top[q], hits)
        np.testing.assert_allclose([scores[q, i] for i, _ in hits], [s for _, s in hits], atol=demo.SCORE_TOL)
    # the demo's own verdict agrees
    ref_scores, ref_top = demo.search(*np.split(want, [len(demo.QUERIES)]))
    assert demo.compare_search(scores, top, ref_scores, ref_top) == []


def test_compare_search_catches_a_wrong_ranking_and_allows_a_tie():
    ref_scores = np.array([[0.9, 0.5, 0.3, 0.1]])
    ref_top = np.argsort(-ref_scores, axis=1, kind="stable")[:, :3]
    assert demo.compare_search(ref_scores, ref_top, ref_scores, ref_top) == []

    swapped = ref_scores.copy()
    swapped[0, [1, 2]] = swapped[0, [2, 1]]  # hits 2 and 3 change places, scores off by 0.2
    top = np.argsort(-swapped, axis=1, kind="stable")[:, :3]
    problems = demo.compare_search(swapped, top, ref_scores, ref_top)
    assert any("cosine differs" in p for p in problems) and any("rank 2" in p for p in problems), problems

    drift = ref_scores + np.array([[0, 0, 2e-4, 0]])  # same ranking, one score 2e-4 off
    assert demo.compare_search(drift, ref_top, ref_scores, ref_top) == ["cosine differs by 2.00e-04 > 0.0001 "
                                                                         "(query 0, sentence 2)"]
    tie = np.array([[0.9, 0.50004, 0.5, 0.1]])  # a near-tie in the reference may swap
    flipped = np.array([[0.9, 0.5, 0.50004, 0.1]])
    tie_top = np.argsort(-tie, axis=1, kind="stable")[:, :3]
    assert demo.compare_search(flipped, np.argsort(-flipped, axis=1, kind="stable")[:, :3], tie, tie_top) == []


def test_demo_server_subprocess_serves_and_stops(minilm_export, st, tmp_path):
    path = minilm_export("smal").path
    with demo._Server({"m": path}, tmp_path / "serve.log") as server:
        texts = demo.CORPUS[:4]
        context = demo.context_inputs(f"127.0.0.1:{server.grpc}", "m", len(texts), "grpc")
        emb = demo.embed(f"127.0.0.1:{server.grpc}", "m", texts, "grpc", context)
        np.testing.assert_allclose(emb, st.encode(texts, convert_to_numpy=True), atol=2e-5, rtol=0)
        proc = server.proc
    assert proc.poll() is not None  # stopped on the way out
    with pytest.raises(RuntimeError, match=r"attnx serve exited with status \d+: .*missing\.onnx"):
        with demo._Server({"m": tmp_path / "missing.onnx"}, tmp_path / "bad.log"):
            pass


def _load_example():
    spec = importlib.util.spec_from_file_location("semantic_search_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_example_client_prints_sentence_transformers_ranking(server, st, protocol):
    example = _load_example()
    queries = ["Will it rain tomorrow?", "Someone is making music."]
    args = [sys.executable, str(EXAMPLE), "--model", "minilm-smal", "--top-k", "3"]
    args += ["--url", server.address] if protocol == "http" else ["--grpc", "--url", server.grpc_address]
    for q in queries:
        args += ["--query", q]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    printed = [(float(m[0]), m[1]) for m in re.findall(r"^\s+\d\. (-?[0-9.]+)\s+(.*)$", proc.stdout, re.M)]
    want = st_search(st, queries, example.CORPUS, 3)
    assert len(printed) == 6, proc.stdout
    for (score, sentence), (i, ref) in zip(printed, [h for hits in want for h in hits]):
        assert sentence == example.CORPUS[i]
        assert abs(score - ref) <= demo.SCORE_TOL + 5e-5  # printed with 4 decimals


def test_example_client_unknown_model_is_one_line(server):
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--model", "nope", "--url", server.address],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "unknown model 'nope'" in proc.stderr


@pytest.mark.parametrize("args, words", [
    (["--variants", "nope"], "--variants: unknown nope"),
    (["--toy", "--query", "x"], "--query and --full-check are for the real-model demo"),
    (["--query", " "], "--query: a query must not be empty"),
    (["--variants", "maw", "--set", "d_model=32"], "--set d_model: the pretrained model fixes it"),
])
def test_demo_bad_options_are_one_line(tmp_path, args, words):
    proc = attnx("demo", "--workdir", tmp_path / "w", *args, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and words in errors[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "w").exists()


def test_the_default_placed_variant_is_read_from_the_specs():
    """The demo names no variant: it places one that replaces attention and lowers to a custom op,
    so the engine it builds shows plugin layers."""
    from attnx.cli.demo_cmd import _default_variant
    from attnx.models import get_spec

    spec = get_spec(_default_variant())
    assert spec.custom_ops and spec.placement.default == "replace"
