"""Attention outputs and the head mask through `attnx serve` (issue 13, items 2-4): returned only when
named, ``head_mask`` optional (default: no ablation), one clear 400 for a bad one, batching intact;
the ``/explain`` page and ``attnx explain URL`` computed by the served model."""

from __future__ import annotations

import concurrent.futures
import json
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

sys.path.insert(0, str(Path(__file__).parent))
from conftest_runtime import running_server  # noqa: E402
from explain_fixtures import explained_minilm, ort_run  # noqa: E402

from attnx.explain.explanation import explain  # noqa: E402
from attnx.interp.source import open_source  # noqa: E402
from attnx.runtime import BatcherConfig, load  # noqa: E402
from support.cli import run as attnx  # noqa: E402


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return explained_minilm()


@pytest.fixture(scope="module")
def plain(exported):
    return exported("mha", n_layers=1).path  # no attention outputs, no tokenizer


@pytest.fixture(scope="module")
def server(export, plain):
    with running_server({"minilm": export.path, "plain": plain},
                        batching=BatcherConfig(max_batch_size=16, max_queue_delay_ms=50)) as s:
        yield s


@pytest.fixture(scope="module")
def batch(export):
    source = open_source(export.path)
    return source.encoder.encode(["The cat sat on the mat.", "Where is the nearest train station?"])


def _inputs(feeds: dict, head_mask=None, dtype=np.float32):
    items = []
    for name, arr in feeds.items():
        item = httpclient.InferInput(name, list(arr.shape), "INT64")
        item.set_data_from_numpy(arr, binary_data=True)
        items.append(item)
    if head_mask is not None:
        arr = np.asarray(head_mask, dtype=dtype)
        item = httpclient.InferInput("head_mask", list(arr.shape), {np.float32: "FP32", np.float64: "FP64"}[dtype])
        item.set_data_from_numpy(arr, binary_data=True)
        items.append(item)
    return items


def test_attentions_only_when_named_and_head_mask_optional(server, export, batch):
    client = httpclient.InferenceServerClient(server.address, network_timeout=120)
    plain = client.infer("minilm", _inputs(batch.feeds)).get_response()
    assert [o["name"] for o in plain["outputs"]] == ["last_hidden_state", "sentence_embedding"]
    wanted = [httpclient.InferRequestedOutput(n, binary_data=True) for n in ("sentence_embedding", "attentions.0")]
    res = client.infer("minilm", _inputs(batch.feeds), outputs=wanted)
    direct = ort_run(export.path, {**batch.feeds, "head_mask": np.ones((6, 12), np.float32)})
    np.testing.assert_allclose(res.as_numpy("attentions.0"), direct["attentions.0"], atol=1e-6, rtol=0)
    np.testing.assert_allclose(res.as_numpy("sentence_embedding"), direct["sentence_embedding"], atol=1e-6, rtol=0)
    mask = np.ones((6, 12), np.float32)
    mask[0, 2] = 0
    ablated = client.infer("minilm", _inputs(batch.feeds, mask), outputs=wanted[:1]).as_numpy("sentence_embedding")
    want = ort_run(export.path, {**batch.feeds, "head_mask": mask})["sentence_embedding"]
    np.testing.assert_allclose(ablated, want, atol=1e-6, rtol=0)
    assert np.abs(ablated - direct["sentence_embedding"]).max() > 1e-4
    for bad, dtype, needle in ((np.ones((12, 6)), np.float32, "head_mask"), (np.ones((6, 12)), np.float64, "FP32")):
        with pytest.raises(InferenceServerException) as err:
            client.infer("minilm", _inputs(batch.feeds, bad, dtype))
        assert "head_mask" in err.value.message() and needle in err.value.message()
    assert client.is_server_live()  # a bad request never takes the server down
    client.close()


def test_batching_with_head_masks_and_attention_maps(export, batch):
    session = load(export.path, device="cpu")
    from attnx.runtime.core.batcher import DynamicBatcher

    rng = np.random.default_rng(0)
    texts = ["Hi!", "The cat sat on the mat.", "A man is playing a guitar.", "Ok.", "Where is the station?"]
    source = open_source(export.path)
    requests = []
    for i, text in enumerate(texts * 2):
        feeds = source.encoder.encode([text]).feeds
        mask = None if i % 2 else np.where(rng.random((6, 12)) < 0.2, 0, 1).astype(np.float32)
        requests.append((feeds, mask))
    names = ["sentence_embedding", "attentions.3"]
    with DynamicBatcher(session, BatcherConfig(max_batch_size=16, max_queue_delay_ms=200, max_length_ratio=None)) as b:
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            futures = [pool.submit(b.infer, {**f, **({} if m is None else {"head_mask": m})}, output_names=names)
                       for f, m in requests]
            results = [f.result() for f in futures]
        assert b.stats.batches < len(requests)  # requests with the same head mask shared runs
    for (feeds, mask), got in zip(requests, results):
        alone = session.run({**feeds, **({} if mask is None else {"head_mask": mask})}, names)
        n = feeds["input_ids"].shape[1]
        assert got["attentions.3"].shape == (1, 12, n, n)
        np.testing.assert_allclose(got["attentions.3"], alone["attentions.3"], atol=1e-5, rtol=0)
        np.testing.assert_allclose(got["sentence_embedding"], alone["sentence_embedding"], atol=1e-5, rtol=0)


def test_explain_page_and_info_on_the_server(server, export):
    page = httpx.get(server.url + "/explain/minilm", params={"text": "The cat sat on the mat."}, timeout=120)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    data = json.loads(page.text.split('id="attnx-data">')[1].split("</script>")[0])
    assert data["examples"][0]["tokens"] == ["[CLS]", "the", "cat", "sat", "on", "the", "mat", ".", "[SEP]"]
    prev = next(a for a in data["analysis"]["A"] if (a["layer"], a["head"]) == (0, 2))
    assert prev["primary"] == "previous_token"
    ex = explain(open_source(export.path), ["The cat sat on the mat."])
    served = np.array(data["maps"]["A"][0][0][2]).reshape(9, 9) / data["scale"]
    np.testing.assert_allclose(served, ex.patterns[0][0, 2], atol=6e-4)
    index = httpx.get(server.url + "/explain", timeout=60).text
    assert 'action="/explain/minilm"' in index and "plain" in index and "no attention outputs" in index
    for path, status, needle in (("/explain/nope", 404, "unknown model"), ("/explain/plain", 400, "attention outputs"),
                                 ("/explain/minilm?text=%20", 400, "empty")):
        r = httpx.get(server.url + path, timeout=60)
        assert r.status_code == status and needle in r.json()["error"], (path, r.text)


def test_explain_a_server_url_equals_the_export(server, export, tmp_path):
    remote = open_source(f"{server.url}/minilm")
    local = open_source(export.path)
    texts = ["The cat sat on the mat.", "A man is playing a guitar."]
    a, b = explain(remote, texts), explain(local, texts)
    for x, y in zip(a.behaviors, b.behaviors):
        assert x.primary_pattern == y.primary_pattern and x.entropy == pytest.approx(y.entropy, abs=1e-5)
    res = attnx("explain", server.url, "The cat sat on the mat.", "--model", "minilm", "--layer", "0", "--ablate", "-o",
                str(tmp_path / "p.html"), "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["ablation"]["columns"] == ["ablated (deployed)"]  # no weights on the client: no torch columns
    assert len(out["ablation"]["rows"]) == 12
