"""Bad requests: every kind gets a 4xx JSON error, and the server keeps serving correct results."""

from __future__ import annotations

import gzip
import json

import httpx
import numpy as np
import pytest

from attnx.runtime import load
from attnx.runtime.wire.limits import Limits
from conftest_runtime import EXPORT_KW, assert_outputs_equal, running_server

MAX_BODY = 256 << 10  # small, so an oversize body is cheap to send


@pytest.fixture(scope="module")
def sessions(exported):
    return {v: load(exported(v, **EXPORT_KW).path, device="cpu") for v in ("maw", "smal")}


@pytest.fixture(scope="module")
def server(sessions):
    limits = Limits(max_body_bytes=MAX_BODY, max_tensor_elements=100_000, max_seq=256)
    with running_server({"maw": sessions["maw"].path, "smal": sessions["smal"].path}, limits=limits) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


# --- request builders ------------------------------------------------------------------

D = D_SELF = None  # dims of the test exports, set by the fixture below


@pytest.fixture(scope="module", autouse=True)
def _dims(sessions):
    global D, D_SELF
    D = sessions["maw"].input("hidden_states").shape[2]
    D_SELF = sessions["smal"].input("self_state").shape[1]
    assert sessions["smal"].input("hidden_states").shape[2] == D


def json_tensor(name, arr, datatype=None):
    dt = datatype or {"float32": "FP32", "int64": "INT64"}[arr.dtype.name]
    return {"name": name, "datatype": dt, "shape": list(arr.shape), "data": arr.ravel().tolist()}


def good_maw(length=5):
    x = np.random.default_rng(length).standard_normal((1, length, D)).astype(np.float32)
    return x, np.ones((1, length), np.int64)


def json_body(*inputs, **extra):
    return json.dumps({"inputs": list(inputs), **extra}).encode()


def maw_json(**extra):
    x, m = good_maw()
    return json_body(json_tensor("hidden_states", x), json_tensor("attention_mask", m), **extra)


def binary_body(tensors, sizes=None, tail=b""):
    """KServe binary body: header, then raw bytes; ``sizes`` overrides declared binary_data_size."""
    header = {"inputs": []}
    blobs = []
    for i, (name, dt, arr) in enumerate(tensors):
        size = arr.nbytes if sizes is None else sizes[i]
        header["inputs"].append({"name": name, "datatype": dt, "shape": list(arr.shape),
                                 "parameters": {"binary_data_size": size}})
        blobs.append(arr.tobytes())
    h = json.dumps(header).encode()
    return h + b"".join(blobs) + tail, {"Inference-Header-Content-Length": str(len(h))}


def maw_binary(x=None, m=None, **kw):
    gx, gm = good_maw()
    x = gx if x is None else x
    m = gm if m is None else m
    return binary_body([("hidden_states", "FP32", x), ("attention_mask", "INT64", m)], **kw)


def infer(body, headers=None, model="maw", path=None):
    return ("POST", path or f"/v2/models/{model}/infer", headers or {}, body)


def hs_with(**overrides):
    x, m = good_maw()
    t = json_tensor("hidden_states", x)
    t.update(overrides)
    return json_body(t, json_tensor("attention_mask", m))


def mask_with(**overrides):
    x, m = good_maw()
    t = json_tensor("attention_mask", m)
    t.update(overrides)
    return json_body(json_tensor("hidden_states", x), t)


def smal_bad_trace():
    """A context input of the wrong shape (an omitted one would get the default the metadata declares)."""
    x, m = good_maw()
    s = np.zeros((1, D_SELF), np.float32)
    return json_body(json_tensor("hidden_states", x), json_tensor("attention_mask", m),
                     json_tensor("self_state", s), json_tensor("trace", np.zeros((1, 3, 3), np.float32)))


# Each case: id -> (method, path, headers, body) and the expected status.
CASES = {
    "malformed-json": (lambda: infer(b'{"inputs": [')),
    "body-not-object": (lambda: infer(b"[1, 2, 3]")),
    "invalid-utf8": (lambda: infer(b'{"inputs": "\xff\xfe"}')),
    "deeply-nested-json": (lambda: infer(b"[" * 100000 + b"]" * 100000)),
    "inputs-missing": (lambda: infer(json.dumps({"outputs": []}).encode())),
    "inputs-empty": (lambda: infer(json_body())),
    "input-not-object": (lambda: infer(json.dumps({"inputs": [3]}).encode())),
    "input-without-name": (lambda: infer(hs_with(name=None))),
    "extra-unknown-input": (lambda: infer(json_body(*json.loads(maw_json())["inputs"],
                                                    json_tensor("bogus", np.zeros(1, np.float32))))),
    "duplicate-input": (lambda: infer(json_body(*json.loads(maw_json())["inputs"],
                                                json.loads(maw_json())["inputs"][0]))),
    "missing-input": (lambda: infer(json_body(json_tensor("attention_mask", np.ones((1, 4), np.int64))))),
    "misshapen-context-input": (lambda: infer(smal_bad_trace(), model="smal")),
    "wrong-datatype": (lambda: infer(hs_with(datatype="FP64"))),
    "unknown-datatype": (lambda: infer(hs_with(datatype="FLOAT"))),
    "bytes-datatype": (lambda: infer(hs_with(datatype="BYTES"))),
    "wrong-rank": (lambda: infer(hs_with(shape=[5, D]))),
    "wrong-fixed-dim": (lambda: infer(hs_with(shape=[1, 5 * D // 8, 8]))),
    "negative-dim": (lambda: infer(hs_with(shape=[1, -5, D]))),
    "shape-not-integers": (lambda: infer(hs_with(shape=[1, 5.0, D]))),
    "data-count-mismatch": (lambda: infer(hs_with(data=[0.0] * 7))),
    "ragged-data": (lambda: infer(hs_with(data=[[0.0] * D] * 4 + [[0.0]]))),
    "strings-in-data": (lambda: infer(hs_with(data=["0.5"] * (5 * D)))),
    "data-not-list": (lambda: infer(hs_with(data=1.0))),
    "floats-for-int64-mask": (lambda: infer(mask_with(data=[1.0, 1.0, 1.0, 1.0, 0.5]))),
    "int-out-of-range": (lambda: infer(mask_with(data=[2**70, 1, 1, 1, 1]))),
    "nan-json-token": (lambda: infer(hs_with(data=[12345.5] + [0.0] * (5 * D - 1)).replace(b"12345.5", b"NaN"))),
    "infinite-json-number": (lambda: infer(hs_with(data=[12345.5] + [0.0] * (5 * D - 1)).replace(b"12345.5",
                                                                                              b"1e999"))),
    "nan-in-binary": (lambda: infer(*maw_binary(x=np.full((1, 5, D), np.nan, np.float32)))),
    "mask-not-zero-one": (lambda: infer(mask_with(data=[1, 1, 2, 1, 1]))),
    "huge-declared-shape": (lambda: infer(hs_with(shape=[1, 10**12, D]))),
    "huge-binary-declared-size": (lambda: infer(*maw_binary(sizes=[10**12, 40]))),
    "too-many-elements": (lambda: infer(hs_with(shape=[32, 200, D]))),
    "batch-over-max": (lambda: infer(json_body(
        json_tensor("hidden_states", np.zeros((33, 1, D), np.float32)),
        json_tensor("attention_mask", np.ones((33, 1), np.int64))))),
    "seq-zero": (lambda: infer(json_body(
        json_tensor("hidden_states", np.zeros((1, 0, D), np.float32)),
        json_tensor("attention_mask", np.ones((1, 0), np.int64))))),
    "seq-over-limit": (lambda: infer(json_body(
        json_tensor("hidden_states", np.zeros((1, 300, D), np.float32)),
        json_tensor("attention_mask", np.ones((1, 300), np.int64))))),
    "batch-seq-disagree": (lambda: infer(mask_with(shape=[1, 4], data=[1, 1, 1, 1]))),
    "binary-size-not-shape": (lambda: infer(*maw_binary(sizes=[5 * D * 4 - 4, 40]))),
    "binary-truncated": (lambda: (lambda b, h: infer(b[:-8], h))(*maw_binary())),
    "binary-trailing-bytes": (lambda: infer(*maw_binary(tail=b"\0" * 8))),
    "binary-without-header-length": (lambda: infer(maw_binary()[0])),
    "header-length-not-number": (lambda: infer(maw_binary()[0], {"Inference-Header-Content-Length": "12abc"})),
    "header-length-past-body": (lambda: infer(maw_binary()[0], {"Inference-Header-Content-Length": "99999999"})),
    "header-length-zero": (lambda: infer(maw_binary()[0], {"Inference-Header-Content-Length": "0"})),
    "header-length-too-short": (lambda: infer(maw_binary()[0], {"Inference-Header-Content-Length": "10"})),
    "data-and-binary": (lambda: infer(hs_with(parameters={"binary_data_size": 5 * D * 4}))),
    "no-data-no-binary": (lambda: infer(json_body({"name": "hidden_states", "datatype": "FP32",
                                                   "shape": [1, 5, D]}))),
    "binary-size-negative": (lambda: infer(*maw_binary(sizes=[-4, 40]))),
    "shared-memory": (lambda: infer(hs_with(parameters={"shared_memory_region": "r0"}))),
    "unknown-output": (lambda: infer(maw_json(outputs=[{"name": "logits"}]))),
    "duplicate-output": (lambda: infer(maw_json(outputs=[{"name": "output"}, {"name": "output"}]))),
    "classification-output": (lambda: infer(maw_json(outputs=[{"name": "output",
                                                               "parameters": {"classification": 3}}]))),
    "binary-output-flag-not-bool": (lambda: infer(maw_json(parameters={"binary_data_output": "yes"}))),
    "parameters-not-object": (lambda: infer(maw_json(parameters=[1]))),
    "id-not-string": (lambda: infer(maw_json(id=17))),
    "timeout-negative": (lambda: infer(maw_json(parameters={"timeout": -1}))),
    "unknown-model": (lambda: infer(maw_json(), model="gpt5")),
    "unknown-version": (lambda: infer(maw_json(), path="/v2/models/maw/versions/7/infer")),
    "unknown-model-metadata": (lambda: ("GET", "/v2/models/gpt5", {}, None)),
    "unknown-route": (lambda: ("GET", "/v2/not-a-route", {}, None)),
    "wrong-method": (lambda: ("GET", "/v2/models/maw/infer", {}, None)),
    "oversize-body": (lambda: infer(b" " * (MAX_BODY + 1000) + maw_json())),
    "oversize-after-gzip": (lambda: infer(gzip.compress(b" " * (MAX_BODY * 8) + maw_json()),
                                          {"Content-Encoding": "gzip"})),
    "corrupt-gzip": (lambda: infer(b"\x1f\x8b not gzip at all", {"Content-Encoding": "gzip"})),
    "unsupported-encoding": (lambda: infer(maw_json(), {"Content-Encoding": "br"})),
}

EXPECTED = {"unknown-model": 404, "unknown-version": 404, "unknown-model-metadata": 404, "unknown-route": 404,
            "wrong-method": 405, "oversize-body": 413, "oversize-after-gzip": 413}


def test_there_are_at_least_30_kinds():
    assert len(CASES) >= 30


def _check_still_correct(http, sessions):
    x, m = good_maw(7)
    r = http.post("/v2/models/maw/infer", content=json_body(json_tensor("hidden_states", x),
                                                            json_tensor("attention_mask", m)))
    assert r.status_code == 200, r.text
    out = {o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in r.json()["outputs"]}
    want = sessions["maw"].run({"hidden_states": x, "attention_mask": m})
    np.testing.assert_allclose(out["output"], want["output"], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(out["maw_depth"], want["maw_depth"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_request_gets_4xx_json_error_and_server_survives(case, http, sessions):
    method, path, headers, body = CASES[case]()
    r = http.request(method, path, headers=headers, content=body)
    expected = EXPECTED.get(case, 400)
    assert r.status_code == expected, (case, r.status_code, r.text[:300])
    payload = r.json()
    assert set(payload) == {"error"} and isinstance(payload["error"], str) and payload["error"], payload
    _check_still_correct(http, sessions)


def test_good_requests_still_work_in_every_form(http, sessions):
    """The positive twins of the cases above: binary, gzip, unknown parameters, versions, id."""
    x, m = good_maw(5)
    want = sessions["maw"].run({"hidden_states": x, "attention_mask": m})
    body, headers = maw_binary(x=x, m=m)
    r = http.post("/v2/models/maw/versions/1/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    out = {o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in r.json()["outputs"]}
    np.testing.assert_allclose(out["output"], want["output"], atol=1e-5, rtol=0)
    raw = maw_json(parameters={"someone_elses_flag": {"a": 1}, "timeout": 10_000_000}, id="x1")
    r = http.post("/v2/models/maw/infer", content=gzip.compress(raw), headers={"Content-Encoding": "gzip"})
    assert r.status_code == 200 and r.json()["id"] == "x1", r.text
    out = {o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in r.json()["outputs"]}
    assert_outputs_equal({"output": out["output"].astype(np.float32), "maw_depth": out["maw_depth"]}, want)


def test_out_of_range_metaphor_type_ids_fail_alone_among_concurrent_good_requests(exported):
    """Item 1: integer context inputs (metaphor type ids, range [0, 16)) are checked before they join a
    batch; the bad requests get 400 naming the range, the good ones sent with them their own numbers."""
    import threading

    from attnx.runtime.core.batcher import BatcherConfig
    from conftest_runtime import request

    session = load(exported("metaphor", metaphor_input="token_type", **EXPORT_KW).path, device="cpu")
    assert session.input("metaphor").range == (0, 16)
    feeds = [request(session, rows=1, length=6, seed=i) for i in range(8)]
    bad = {3: 16, 6: -1}
    for i, value in bad.items():
        feeds[i]["metaphor"] = feeds[i]["metaphor"].copy()
        feeds[i]["metaphor"][0, 2] = value
    results: dict = {}
    batching = BatcherConfig(max_batch_size=8, max_queue_delay_ms=200, max_length_ratio=None)
    with running_server({"metaphor": session.path}, batching=batching) as srv:
        barrier = threading.Barrier(len(feeds))

        def call(i):
            body = json_body(*(json_tensor(k, v) for k, v in feeds[i].items()))
            barrier.wait(30)
            r = httpx.post(f"{srv.url}/v2/models/metaphor/infer", content=body, timeout=60)
            results[i] = (r.status_code, r.json())

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(feeds))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    for i, f in enumerate(feeds):
        status, payload = results[i]
        if i in bad:
            assert status == 400, payload
            assert f"value {bad[i]} at [0, 2] is outside the model's range [0, 16)" in payload["error"], payload
            continue
        assert status == 200, payload
        out = {o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in payload["outputs"]}
        np.testing.assert_allclose(out["output"], session.run(f)["output"], atol=1e-5, rtol=0)
