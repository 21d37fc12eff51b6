"""The server under load (issue 15, items 3, 4, 5, 9): health never waits on request parsing, overload
is refused before the body is read, bytes being decoded are bounded, client disconnects are not
internal errors, long JSON lists decode to exactly the numbers plain JSON gives, and NaN never goes
out as JSON. Mechanisms are shown with gates and events, not timings (benchmarks/bench_server_load.py
measures the latencies and memory)."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx
import numpy as np
import pytest

import attnx.runtime.apis.kserve_json as codec
from attnx.runtime import load
from attnx.runtime.core.batcher import BatcherConfig
from attnx.runtime.wire.errors import ProtocolError
from attnx.runtime.wire.limits import Limits
from conftest_runtime import EXPORT_KW, GatedSession, request, running_server


@pytest.fixture(scope="module")
def session(exported):
    return load(exported("maw", **EXPORT_KW).path, device="cpu")


def json_request(feeds) -> bytes:
    inputs = [{"name": k, "datatype": {"float32": "FP32", "int64": "INT64"}[v.dtype.name], "shape": list(v.shape),
               "data": v.ravel().tolist()} for k, v in feeds.items()]
    return json.dumps({"inputs": inputs}).encode()


def big_feeds(session, seed: int, kib: int = 200):
    """Valid feeds whose JSON body is about ``kib`` KiB (the issue's ~250 KB bodies)."""
    d = session.input("hidden_states").shape[2]
    length = max(2, kib * 1024 // 20 // d // 4)  # ~20 characters a float, 4 rows
    return request(session, rows=4, length=length, seed=seed)


def metric(srv, reason: str, model: str = "maw") -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    m = re.search(rf'attnx_request_failures_total\{{model="{model}",reason="{reason}"\}} (\S+)', text)
    return float(m.group(1)) if m else 0.0


class GatedParse:
    """Replaces the codec's request parser: each parse announces itself, then waits for the gate."""

    def __init__(self, monkeypatch):
        self.inside = threading.Semaphore(0)
        self.gate = threading.Event()
        self.active = self.peak = 0
        self._lock = threading.Lock()
        real = codec.parse_infer_request

        def parse(*args, **kwargs):
            with self._lock:
                self.active += 1
                self.peak = max(self.peak, self.active)
            self.inside.release()
            try:
                self.gate.wait(30)
                return real(*args, **kwargs)
            finally:
                with self._lock:
                    self.active -= 1

        monkeypatch.setattr(codec, "parse_infer_request", parse)


def post_all(url: str, bodies: list[bytes], results: dict, first: int = 0) -> list[threading.Thread]:
    """POST each body from its own thread; ``results[first + i] = (status, JSON)``."""
    def call(i):
        try:
            r = httpx.post(url, content=bodies[i], timeout=60)
            results[first + i] = (r.status_code, r.json())
        except httpx.HTTPError as e:
            results[first + i] = (None, repr(e))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    return threads


# --- item 4: health and overload ------------------------------------------------------------


def test_health_answers_while_json_bodies_are_being_parsed(session, monkeypatch):
    """Two ~200 KB JSON bodies: one held inside the parser, one waiting for it; live and ready still
    answer, then both requests finish with the model's numbers. (Before: bodies under 256 KB were parsed on the event
    loop, so a slow parse froze every route, health included.)"""
    gated = GatedParse(monkeypatch)
    feeds = [big_feeds(session, seed) for seed in range(2)]
    results: dict = {}
    with running_server({"maw": session.path}) as srv:
        threads = post_all(f"{srv.url}/v2/models/maw/infer", [json_request(f) for f in feeds], results)
        try:
            assert gated.inside.acquire(timeout=20), "the parse never started"
            time.sleep(0.5)  # let the second body arrive too (it waits for the one decoding thread)
            for route in ("/v2/health/live", "/v2/health/ready", "/v2/models/maw/ready"):
                r = httpx.get(srv.url + route, timeout=5)  # raises on a stuck loop
                assert r.status_code == 200, (route, r.text)
            assert gated.active == 1 and not results  # still parsing while health answered
        finally:
            gated.gate.set()
            for t in threads:
                t.join(60)
    for i, f in enumerate(feeds):
        status, payload = results[i]
        assert status == 200, payload
        out = {o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in payload["outputs"]}
        np.testing.assert_allclose(out["output"], session.run(f)["output"], atol=1e-5, rtol=0)


def _hold_queue_full(session):
    """A server whose one worker is held in a run and whose one queue slot is taken."""
    gated = GatedSession(session)
    batching = BatcherConfig(max_batch_size=1, max_queue_delay_ms=0, max_queue_size=1)
    return gated, batching


def test_overload_is_refused_before_the_body_is_read(session):
    """Queue full: a request announcing an 8 MiB body gets 503 + Retry-After having sent none of it."""
    gated, batching = _hold_queue_full(session)
    feeds = [request(session, rows=1, length=4, seed=i) for i in range(2)]
    results: dict = {}
    with running_server({"maw": gated}, batching=batching) as srv:
        url = f"{srv.url}/v2/models/maw/infer"
        threads = post_all(url, [json_request(feeds[0])], results)
        assert gated.running.acquire(timeout=20)  # request 0 is running, held
        threads += post_all(url, [json_request(feeds[1])], results, first=1)  # takes the one queue slot
        deadline = time.monotonic() + 20
        while srv.models["maw"].batcher.queue_depth < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            with socket.create_connection((srv.host, srv.port), timeout=10) as sock:
                sock.sendall(b"POST /v2/models/maw/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % (8 << 20))
                reply = _read_response(sock)  # times out (fails) if the server waits for the body
            head, _, body = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503"), head
            assert b"retry-after: 1" in head.lower(), head
            assert "queue full" in json.loads(body)["error"]
            assert metric(srv, "overloaded") == 1
        finally:
            gated.gate.set()
            for t in threads:
                t.join(60)
    assert [results[i][0] for i in (0, 1)] == [200, 200], results
    for i in (0, 1):
        np.testing.assert_allclose(results[i][1]["outputs"][0]["data"],
                                   session.run(feeds[i])["output"].ravel(), atol=1e-5, rtol=0)


def _read_response(sock) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head = data.partition(b"\r\n\r\n")[0].lower()
    length = int(re.search(rb"content-length: (\d+)", head).group(1))
    while len(data.partition(b"\r\n\r\n")[2]) < length:
        data += sock.recv(65536)
    return data


def test_grpc_overload_is_resource_exhausted(session):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    gated, batching = _hold_queue_full(session)
    feeds = [request(session, rows=1, length=4, seed=i) for i in range(3)]
    with running_server({"maw": gated}, batching=batching, grpc_port=0) as srv:
        client = grpcclient.InferenceServerClient(srv.grpc_address)

        def inputs(f):
            out = []
            for name, arr in f.items():
                item = grpcclient.InferInput(name, list(arr.shape), {"float32": "FP32", "int64": "INT64"}[arr.dtype.name])
                item.set_data_from_numpy(arr)
                out.append(item)
            return out

        results: dict = {}

        def call(i):
            results[i] = client.infer("maw", inputs(feeds[i])).as_numpy("output")

        threads = [threading.Thread(target=call, args=(0,))]
        threads[0].start()
        assert gated.running.acquire(timeout=20)
        threads.append(threading.Thread(target=call, args=(1,)))
        threads[1].start()
        deadline = time.monotonic() + 20
        while srv.models["maw"].batcher.queue_depth < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            with pytest.raises(InferenceServerException) as info:
                client.infer("maw", inputs(feeds[2]))
            assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED", info.value
            assert "queue full" in info.value.message()
        finally:
            gated.gate.set()
            for t in threads:
                t.join(60)
    for i in (0, 1):
        np.testing.assert_allclose(results[i], session.run(feeds[i])["output"], atol=1e-5, rtol=0)


# --- item 5: bounded decoding ---------------------------------------------------------------


def test_bytes_being_decoded_are_bounded_and_excess_waits_then_gets_503(session, monkeypatch):
    """Budget = 1.5 bodies (all of them big: the small-body reserve is set to 1 KiB): while one body is decoded,
    the next is read as far as the budget allows and the third waits; all succeed. With a short wait, a request
    that cannot get the budget is refused with 503 instead of piling up."""
    monkeypatch.setattr("attnx.runtime.wire.budget.SMALL_BODY", 1 << 10)
    gated = GatedParse(monkeypatch)
    feeds = [big_feeds(session, seed, kib=100) for seed in range(3)]
    bodies = [json_request(f) for f in feeds]
    budget = int(max(map(len, bodies)) * 1.5)
    results: dict = {}
    with running_server({"maw": session.path}, limits=Limits(max_decode_bytes=budget)) as srv:
        threads = post_all(f"{srv.url}/v2/models/maw/infer", bodies, results)
        try:
            assert gated.inside.acquire(timeout=20)
            assert not gated.inside.acquire(timeout=1.0)  # the others wait for the budget, not in the parser
            assert srv.budget.in_use <= budget and len(srv.budget._waiters) == 2
        finally:
            gated.gate.set()
            for t in threads:
                t.join(60)
        assert gated.peak == 1
        assert srv.budget.in_use == 0
    for i, f in enumerate(feeds):
        assert results[i][0] == 200, results[i]
        got = np.array(results[i][1]["outputs"][0]["data"])
        np.testing.assert_allclose(got, session.run(f)["output"].ravel(), atol=1e-5, rtol=0)

    gated.gate.clear()
    gated.inside = threading.Semaphore(0)
    results.clear()
    limits = Limits(max_decode_bytes=budget, decode_wait_s=0.2)
    with running_server({"maw": session.path}, limits=limits) as srv:
        threads = post_all(f"{srv.url}/v2/models/maw/infer", bodies[:1], results)
        try:
            assert gated.inside.acquire(timeout=20)  # body 0 holds the budget until the gate opens
            r = httpx.post(f"{srv.url}/v2/models/maw/infer", content=bodies[1], timeout=30)
            assert r.status_code == 503 and "request bodies are being decoded" in r.json()["error"], r.text[:300]
            assert r.headers["retry-after"] == "1"
        finally:
            gated.gate.set()
            for t in threads:
                t.join(60)
    assert results[0][0] == 200


N = 80_000  # > 1 MB of JSON: smaller bodies are parsed in one go
NUMBER_LISTS = {
    "floats": lambda rng: rng.standard_normal(N).astype(np.float32).tolist(),
    "ints": lambda rng: rng.integers(-2**62, 2**62, N).tolist(),
    "mixed-int-first": lambda rng: list(range(N // 2)) + rng.standard_normal(N // 2).tolist(),
    "exponents": lambda rng: (rng.standard_normal(N) * 10.0 ** rng.integers(-300, 300, N)).tolist(),
}


@pytest.mark.parametrize("kind", sorted(NUMBER_LISTS))
def test_long_json_lists_decode_to_the_same_numbers_as_plain_json(kind):
    values = NUMBER_LISTS[kind](np.random.default_rng(0))
    text = json.dumps({"id": "a", "inputs": [{"name": "x", "data": values}, {"name": "y", "data": [1, 2]}],
                       "parameters": {"data": [3]}}, indent=1).encode()  # whitespace and newlines too
    tree = codec.parse_json(text)
    got = tree["inputs"][0]["data"]
    assert isinstance(got, np.ndarray)  # decoded without a Python object per element
    want = np.array(values)
    assert got.dtype == want.dtype and np.array_equal(got, want)
    assert tree["inputs"][1]["data"] == [1, 2] and tree["parameters"] == {"data": [3]} and tree["id"] == "a"


BAD_LISTS = {
    "double-comma": b"1.5,,2", "trailing-comma": b"1,2,", "leading-plus": b"+1,2", "leading-zero": b"01,2",
    "bare-dot": b".5,1", "overflow": b"1e999,1", "no-comma": b"1 2", "lone-minus": b"-,1",
}


@pytest.mark.parametrize("case", sorted(BAD_LISTS))
def test_malformed_long_lists_are_refused_as_plain_json_refuses_them(case):
    numbers = b", ".join([b"0.125"] * 100_000)
    body = b'{"inputs": [{"name": "x", "data": [' + numbers + b", " + BAD_LISTS[case] + b", " + numbers + b"]}]}"
    with pytest.raises(ProtocolError, match="malformed request JSON"):
        codec.parse_json(body)


def test_integers_past_int64_in_a_long_list_fall_back_to_the_exact_check():
    body = b'{"inputs": [{"name": "x", "data": [' + b", ".join([b"1"] * 400_000 + [b"18446744073709551616"]) + b"]}]}"
    data = codec.parse_json(body)["inputs"][0]["data"]
    assert not isinstance(data, np.ndarray) or data.dtype.kind == "f"  # never silently wrapped to an int64


def test_a_long_token_id_list_to_minilm_gives_the_binary_numbers_and_bad_ids_get_400(minilm_export, monkeypatch):
    """The sliced JSON decode on a real text model (forced on for this ~27 KB body): 16 x 256 token ids
    equal the same ids sent as binary; an id past the vocabulary anywhere in it is a 400 naming the range."""
    monkeypatch.setattr(codec, "_SMALL_BODY", 0)
    monkeypatch.setattr(codec, "_SLICE", 4096)  # several slices, so their seams are crossed too
    path = minilm_export("mha").path
    rng = np.random.default_rng(1)
    ids = rng.integers(1000, 30000, (16, 256)).astype(np.int64)
    with running_server({"minilm": path}) as srv:
        url = f"{srv.url}/v2/models/minilm/infer"
        body = json.dumps({"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [16, 256],
                                       "data": ids.ravel().tolist()}],
                           "outputs": [{"name": "sentence_embedding"}]}).encode()
        assert len(body) > 16 << 10
        r = httpx.post(url, content=body, timeout=60)
        assert r.status_code == 200, r.text[:300]
        got = np.array(r.json()["outputs"][0]["data"], np.float32).reshape(16, -1)
        header = json.dumps({"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [16, 256],
                                         "parameters": {"binary_data_size": ids.nbytes}}],
                             "outputs": [{"name": "sentence_embedding", "parameters": {"binary_data": True}}]}
                            ).encode()
        r = httpx.post(url, content=header + ids.tobytes(), timeout=60,
                       headers={"Inference-Header-Content-Length": str(len(header))})
        assert r.status_code == 200, r.text[:300]
        n = int(r.headers["inference-header-content-length"])
        want = np.frombuffer(r.content[n:], np.float32).reshape(16, -1)
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
        for bad in (30522, -3):
            wrong = ids.copy()
            wrong[5, 200] = bad
            body = json.dumps({"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [16, 256],
                                           "data": wrong.ravel().tolist()}]}).encode()
            r = httpx.post(url, content=body, timeout=60)
            assert r.status_code == 400 and f"value {bad} at [5, 200]" in r.json()["error"], r.text
            assert "[0, 30522)" in r.json()["error"]


# --- item 3: client disconnects -------------------------------------------------------------


def test_a_client_that_disconnects_mid_body_is_not_an_internal_error(session):
    with running_server({"maw": session.path}) as srv:
        for _ in range(3):
            with socket.create_connection((srv.host, srv.port), timeout=10) as sock:
                sock.sendall(b"POST /v2/models/maw/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n"
                             + b'{"inputs": [' + b" " * 5000)
        deadline = time.monotonic() + 20
        while metric(srv, "client_gone") < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric(srv, "client_gone") == 3
        assert metric(srv, "internal") == 0
        r = httpx.post(f"{srv.url}/v2/models/maw/infer", content=json_request(request(session, 1, 4, 0)), timeout=30)
        assert r.status_code == 200


def test_a_grpc_call_cancelled_by_its_deadline_is_a_client_disconnect(session):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    gated = GatedSession(session)
    feeds = request(session, rows=1, length=4, seed=0)
    with running_server({"maw": gated}, grpc_port=0) as srv:
        client = grpcclient.InferenceServerClient(srv.grpc_address)
        item = grpcclient.InferInput("hidden_states", list(feeds["hidden_states"].shape), "FP32")
        item.set_data_from_numpy(feeds["hidden_states"])
        try:
            with pytest.raises(InferenceServerException) as info:
                client.infer("maw", [item], client_timeout=0.5)  # the worker is held: the deadline passes
            assert "DEADLINE_EXCEEDED" in str(info.value.status())
            deadline = time.monotonic() + 20
            while metric(srv, "client_gone") < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            gated.gate.set()
        assert metric(srv, "client_gone") == 1 and metric(srv, "internal") == 0


# --- item 9: NaN / Inf never goes out as JSON -----------------------------------------------


class NaNSession(GatedSession):
    """A real session whose ``output`` gets a NaN and an infinity (a model that overflowed)."""

    def _run(self, feeds, output_names):
        out = dict(self.inner._run(feeds, output_names))
        if "output" in out:
            out["output"] = out["output"].copy()
            out["output"].flat[0], out["output"].flat[1] = np.nan, np.inf
        return out


def test_non_finite_outputs_are_refused_as_json_and_sent_as_binary(session):
    nan = NaNSession(session)
    nan.gate.set()
    feeds = request(session, rows=1, length=4, seed=0)
    want = nan._run(feeds, ["output", "maw_depth"])
    with running_server({"maw": nan}) as srv:
        url = f"{srv.url}/v2/models/maw/infer"
        r = httpx.post(url, content=json_request(feeds), timeout=30)
        assert r.status_code == 422, r.text[:300]  # the request's own values did it (issue 26, item 13)
        error = json.loads(r.text, parse_constant=lambda c: pytest.fail(f"non-JSON token {c}"))["error"]
        assert "output 'output' holds NaN or infinite values" in error and "binary_data" in error
        assert metric(srv, "unprocessable") == 1 and metric(srv, "internal") == 0
        body = json.loads(json_request(feeds))
        body["outputs"] = [{"name": "output", "parameters": {"binary_data": True}}, {"name": "maw_depth"}]
        r = httpx.post(url, content=json.dumps(body), timeout=30)
        assert r.status_code == 200, r.text[:300]
        n = int(r.headers["inference-header-content-length"])
        header = json.loads(r.content[:n], parse_constant=lambda c: pytest.fail(f"non-JSON token {c}"))
        got = np.frombuffer(r.content[n:], np.float32).reshape(header["outputs"][0]["shape"])
        np.testing.assert_array_equal(got, want["output"])  # NaN and inf where the model put them
        assert header["outputs"][1]["data"] == want["maw_depth"].ravel().tolist()
