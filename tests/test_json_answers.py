"""JSON answers (issue 26, item 13). Finite inputs that drive a model past float range are the client's
input, not a server error: smal with a ``trace`` of 3e38 overflows to NaN, and a JSON answer is a 422 naming
the input and its size (it was a 500). A big all-JSON answer is streamed in pieces (never built whole in
memory) and is the same JSON, to the number, as the binary answer."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient

from conftest_runtime import EXPORT_KW, request, running_server, triton_infer
from support.cli import run as attnx


@pytest.fixture(scope="module")
def smal(exported):
    return exported("smal", **EXPORT_KW).path


def body(feeds, binary: bool = False) -> dict:
    inputs = [{"name": n, "datatype": "FP32" if a.dtype == np.float32 else "INT64", "shape": list(a.shape),
               "data": a.ravel().tolist()} for n, a in feeds.items()]
    return {"inputs": inputs, "outputs": [{"name": "output", "parameters": {"binary_data": binary}}]}


def test_a_trace_of_3e38_is_a_422_naming_it_and_the_server_goes_on(smal):
    from attnx.runtime import load

    session = load(smal, device="cpu")
    good = request(session, rows=1, length=5, seed=0)
    bad = {**good, "trace": np.full(good["trace"].shape, 3e38, np.float32)}
    with running_server({"smal": smal}) as srv:
        url = f"{srv.url}/v2/models/smal/infer"
        r = httpx.post(url, json=body(bad), timeout=30)
        assert r.status_code == 422, r.text[:300]
        error = r.json()["error"]
        assert "largest |value|: 3e+38 in 'trace'" in error and "past float range" in error and "\n" not in error
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        assert 'reason="internal"' not in metrics and 'reason="unprocessable"' in metrics
        assert httpx.post(url, json=body(good), timeout=30).status_code == 200
        raw = httpx.post(url, json=body(bad, binary=True), timeout=30)  # binary carries the values as they are
        assert raw.status_code == 200


def test_a_big_json_answer_is_streamed_and_equals_the_binary_one(exported):
    from attnx.runtime import load

    path = exported("maw", **EXPORT_KW).path
    session = load(path, device="cpu")
    feeds = request(session, rows=32, length=300, seed=3)  # output [32, 300, 32] float32: 1.2 MB
    with running_server({"maw": path}) as srv:
        client = httpclient.InferenceServerClient(srv.address, network_timeout=60)
        try:
            as_json, _ = triton_infer(client, "maw", feeds, binary_out=False)
            as_binary, _ = triton_infer(client, "maw", feeds)
        finally:
            client.close()
        r = httpx.post(f"{srv.url}/v2/models/maw/infer", json=body(feeds), timeout=30)
    assert r.headers.get("transfer-encoding") == "chunked" and "content-length" not in r.headers
    assert r.json()["outputs"][0]["shape"] == [32, 300, 32]
    for name in ("output", "maw_depth"):
        np.testing.assert_array_equal(as_json[name], as_binary[name])


def test_attnx_serve_keeps_long_requests_from_sharing_a_run_by_default(exported, tmp_path):
    """Two 31 MB requests merged into one run doubled the model's activations (6 at once: 9.8x their JSON size
    in RSS, benchmarks/bench_server_load.py); by default a batch holds at most 8192 padded tokens."""
    path = exported("maw", **EXPORT_KW).path
    run = attnx("serve", str(path), "--describe", env={"ATTNX_WORKDIR": str(tmp_path)})
    assert run.returncode == 0, run.stderr
    assert "at most 32 rows and 8192 tokens a batch" in run.stdout
