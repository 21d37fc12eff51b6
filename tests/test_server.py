"""The KServe v2 server, driven by the unmodified tritonclient.http on loopback."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from attnx.runtime import BatcherConfig, load
from attnx.runtime.wire.metrics import histogram_counts
from conftest_runtime import EXPORT_KW, GatedSession, assert_outputs_equal, request, running_server, triton_infer
from support.cli import run as attnx
from support.cli import subprocess_popen


@pytest.fixture(scope="module")
def paths(exported):
    return {v: exported(v, **EXPORT_KW).path for v in ("maw", "smal")}


@pytest.fixture(scope="module")
def sessions(paths):
    return {v: load(p, device="cpu") for v, p in paths.items()}


@pytest.fixture(scope="module")
def server(paths):
    with running_server(paths) as s:
        yield s


@pytest.fixture()
def client(server):
    c = httpclient.InferenceServerClient(server.address, network_timeout=60)
    yield c
    c.close()


def metrics_text(server) -> str:
    return httpx.get(server.url + "/metrics", timeout=10).text


def test_health_and_metadata(client, server, sessions):
    assert server.url.startswith("http://127.0.0.1:")
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("maw") and client.is_model_ready("smal", "1")
    assert not client.is_model_ready("nope")
    meta = client.get_server_metadata()
    assert meta["name"] == "attnx" and "binary_tensor_data" in meta["extensions"]
    m = client.get_model_metadata("smal")
    assert m["name"] == "smal" and m["versions"] == ["1"] and m["platform"] == "onnxruntime_onnx"
    spec = sessions["smal"].input("trace")
    assert {"name": "trace", "datatype": "FP32", "shape": [-1, *spec.shape[1:]]} in m["inputs"]
    assert [o["name"] for o in client.get_model_metadata("maw", "1")["outputs"]] == ["output", "maw_depth"]
    assert {"name": "maw", "version": "1", "state": "READY"} in client.get_model_repository_index()
    config = client.get_model_config("maw")
    assert config["max_batch_size"] == 32 and config["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.get_model_metadata("nope")


@pytest.mark.parametrize("variant", ["maw", "smal"])
@pytest.mark.parametrize("binary_in, binary_out", [(True, True), (False, False), (True, False), (False, True)],
                         ids=["binary", "json", "binary-in", "binary-out"])
def test_infer_gives_the_runtime_numbers(client, sessions, variant, binary_in, binary_out):
    session = sessions[variant]
    feeds = request(session, rows=2, length=11, seed=7, pad_to=13)
    want = session.run(feeds)
    got, response = triton_infer(client, variant, feeds, binary_in=binary_in, binary_out=binary_out)
    assert_outputs_equal(got, want, atol=1e-5)
    has_binary = all("parameters" in o and "binary_data_size" in o["parameters"] for o in response["outputs"])
    assert has_binary == binary_out
    assert response["model_name"] == variant and response["model_version"] == "1"


def test_request_id_version_selected_outputs_and_omitted_mask(client, sessions):
    session = sessions["maw"]
    feeds = request(session, rows=1, length=9, seed=3, with_mask=False)
    want = session.run(feeds)
    got, response = triton_infer(client, "maw", feeds, outputs=["maw_depth"], request_id="req-42",
                                 model_version="1", parameters={"anything_else": 5})
    assert response["id"] == "req-42" and list(got) == ["maw_depth"]
    np.testing.assert_array_equal(got["maw_depth"], want["maw_depth"])


def test_concurrent_variable_length_requests_are_batched_over_http(paths, sessions):
    session = sessions["maw"]
    lengths = [5, 31, 12, 20, 2, 27, 9, 16]
    requests = [request(session, rows=1, length=L, seed=50 + i) for i, L in enumerate(lengths)]
    alone = [session.run(r) for r in requests]
    results: dict[int, dict] = {}
    errors: list = []
    batching = BatcherConfig(max_batch_size=32, max_queue_delay_ms=300, max_length_ratio=None)
    with running_server({"maw": paths["maw"]}, batching=batching) as srv:
        barrier = threading.Barrier(len(requests))

        def call(i: int) -> None:
            c = httpclient.InferenceServerClient(srv.address, network_timeout=60)
            try:
                barrier.wait(10)
                results[i], _ = triton_infer(c, "maw", requests[i])
            except Exception as e:  # noqa: BLE001
                errors.append(e)
            finally:
                c.close()

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        text = metrics_text(srv)
    assert not errors, errors
    for i, L in enumerate(lengths):
        assert results[i]["output"].shape == (1, L, alone[i]["output"].shape[2])
        assert_outputs_equal(results[i], alone[i], atol=1e-5)
    buckets = histogram_counts(text, "attnx_batch_size", "maw")
    total = buckets["+Inf"]
    assert total < len(requests)  # fewer batches than requests...
    assert buckets["1.0"] < total  # ...and some batch had more than one row


def test_small_requests_are_not_held_back_by_nagle(server, client, sessions):
    """A response goes out in two writes; without TCP_NODELAY each one waited ~40 ms for a delayed ACK."""
    feeds = request(sessions["maw"], rows=1, length=4, seed=1)
    times = []
    for _ in range(20):
        started = time.perf_counter()
        triton_infer(client, "maw", feeds)
        times.append(time.perf_counter() - started)
    assert float(np.median(times)) < 0.035, times


def test_metrics_histograms_and_counters(server, client, sessions):
    feeds = request(sessions["smal"], rows=1, length=4, seed=1)
    triton_infer(client, "smal", feeds)
    with pytest.raises(InferenceServerException):
        triton_infer(client, "nope", feeds)
    with pytest.raises(InferenceServerException):
        triton_infer(client, "smal", {**feeds, "trace": feeds["trace"][..., :3]})
    text = metrics_text(server)
    for name in ("attnx_request_latency_seconds", "attnx_queue_time_seconds", "attnx_compute_time_seconds",
                 "attnx_batch_size"):
        assert histogram_counts(text, name, "smal")["+Inf"] >= 1, name
    assert re.search(r'attnx_request_success_total\{model="smal"\} [1-9]', text)
    assert re.search(r'attnx_request_failures_total\{model="_unknown_",reason="not_found"\} [1-9]', text)
    assert re.search(r'attnx_request_failures_total\{model="smal",reason="bad_input"\} [1-9]', text)
    assert 'attnx_queue_depth{model="maw"}' in text


def test_load_64_clients_no_lost_or_mismatched_responses(server, sessions):
    session = sessions["maw"]
    pool = [request(session, rows=1, length=[4, 8, 16, 32][i % 4], seed=200 + i) for i in range(16)]
    expected = [session.run(r) for r in pool]
    counts = [0] * 64
    failures: list = []
    before = histogram_counts(metrics_text(server), "attnx_request_latency_seconds", "maw").get("+Inf", 0)

    def client_loop(k: int) -> None:
        c = httpclient.InferenceServerClient(server.address, network_timeout=60, connection_timeout=60)
        deadline = time.monotonic() + 4
        i = k
        try:
            while time.monotonic() < deadline and counts[k] < 25:
                got, _ = triton_infer(c, "maw", pool[i % 16])
                assert_outputs_equal(got, expected[i % 16], atol=1e-5)
                counts[k] += 1
                i += 5
        except Exception as e:  # noqa: BLE001 - any error is a failure of this test
            failures.append(repr(e))
        finally:
            c.close()

    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures, failures[:3]
    assert all(n >= 1 for n in counts)
    after = histogram_counts(metrics_text(server), "attnx_request_latency_seconds", "maw")["+Inf"]
    assert after - before == sum(counts)  # every request answered exactly once, all 200s


def test_over_limit_queue_gives_503_and_everything_else_succeeds(sessions):
    session = sessions["maw"]
    gated = GatedSession(session)
    batching = BatcherConfig(max_batch_size=1, max_queue_delay_ms=0, max_queue_size=4)
    feeds = [request(session, rows=1, length=3 + i % 5, seed=i) for i in range(16)]
    statuses: dict[int, int] = {}
    with running_server({"maw": gated}, batching=batching) as srv:

        def call(i: int) -> None:
            body = httpclient.InferenceServerClient.generate_request_body(_inputs(feeds[i]))
            statuses[i] = _post_infer(srv, "maw", *body)

        first = threading.Thread(target=call, args=(0,))
        first.start()
        assert gated.running.acquire(timeout=10)  # the worker is held inside request 0
        threads = [threading.Thread(target=call, args=(i,)) for i in range(1, 16)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while sum(1 for s in statuses.values() if s[0] == 503) < 11 and time.monotonic() < deadline:
            time.sleep(0.02)
        gated.gate.set()
        for t in [first, *threads]:
            t.join(60)
        text = metrics_text(srv)
    codes = sorted(s[0] for s in statuses.values())
    assert codes.count(200) == 5 and codes.count(503) == 11, codes
    for i, (status, payload) in statuses.items():
        if status == 503:
            assert "queue full" in payload["error"]
        else:
            np.testing.assert_allclose(payload["output"], session.run(feeds[i])["output"], atol=1e-5, rtol=0)
    assert re.search(r'attnx_request_failures_total\{model="maw",reason="overloaded"\} 11', text)


def test_graceful_shutdown_finishes_in_flight_requests(sessions):
    session = sessions["smal"]
    gated = GatedSession(session)
    feeds = [request(session, rows=1, length=4 + i, seed=i) for i in range(5)]
    statuses: dict[int, tuple] = {}
    with running_server({"smal": gated}, batching=BatcherConfig(max_batch_size=1, max_queue_delay_ms=0)) as server:

        def call(i: int) -> None:
            body = httpclient.InferenceServerClient.generate_request_body(_inputs(feeds[i]))
            statuses[i] = _post_infer(server, "smal", *body)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
        assert gated.running.acquire(timeout=10)
        batcher = server.models["smal"].batcher
        deadline = time.monotonic() + 10
        while batcher.queue_depth < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert batcher.queue_depth == 4  # one request running, four queued: all in flight
        stopper = threading.Thread(target=server.stop)
        stopper.start()
        time.sleep(0.3)
        assert stopper.is_alive()  # stop waits for the in-flight requests
        gated.gate.set()
        stopper.join(60)
        assert not stopper.is_alive()
        for t in threads:
            t.join(60)
    assert sorted(s[0] for s in statuses.values()) == [200] * 5
    for i, (_, payload) in statuses.items():
        np.testing.assert_allclose(payload["output"], session.run(feeds[i])["output"], atol=1e-5, rtol=0)
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/v2/health/live", timeout=2)


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_cli_serve_then_signal_stops_cleanly(paths, sessions, tmp_path, stop_signal):
    proc = subprocess_popen("serve", f"m1={paths['maw']}", paths["smal"], "--port", "0", "--max-batch", "8",
                            "--max-delay-ms", "1", env={"ATTNX_WORKDIR": str(tmp_path)})
    try:
        url = None
        lines = []
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            found = re.search(r"listening on (http://\S+)", line)
            url = found.group(1) if found else None
        assert url, "".join(lines)
        assert url.startswith("http://127.0.0.1:")
        c = httpclient.InferenceServerClient(url.split("//", 1)[1])
        assert c.is_server_ready() and c.is_model_ready("m1") and c.is_model_ready(paths["smal"].stem)
        feeds = request(sessions["maw"], rows=1, length=6, seed=1)
        got, _ = triton_infer(c, "m1", feeds)
        assert_outputs_equal(got, sessions["maw"].run(feeds))
        c.close()
        proc.send_signal(stop_signal)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stderr.close()
        proc.stdout.close()


def test_cli_bench_in_process_and_against_a_server(paths, server, tmp_path):
    report = tmp_path / "bench.json"
    local = attnx("bench", paths["maw"], "--concurrency", "4", "--duration", "1", "--seq", "4,8", "--report", report)
    assert local.returncode == 0, local.stderr
    numbers = json.loads(report.read_text())
    assert numbers["ok"] > 0 and numbers["errors"] == {} and numbers["p99_ms"] >= numbers["p50_ms"] > 0
    remote = attnx("bench", "smal", "--url", server.url, "--concurrency", "3", "--duration", "1", "--seq", "5",
                   "--report", report)
    assert remote.returncode == 0, remote.stderr
    numbers = json.loads(report.read_text())
    assert numbers["ok"] > 0 and numbers["errors"] == {}
    assert "p99" in remote.stdout


# --- helpers -------------------------------------------------------------------------------


def _inputs(feeds):
    from tritonclient.utils import np_to_triton_dtype

    items = []
    for name, arr in feeds.items():
        item = httpclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        item.set_data_from_numpy(arr, binary_data=True)
        items.append(item)
    return items


def _post_infer(server, model: str, body: bytes, json_size: int | None) -> tuple[int, dict]:
    """POST a prepared request body; JSON outputs are asked for so the payload is easy to read."""
    header = json.loads(body[:json_size] if json_size else body)
    header["outputs"] = [{"name": "output", "parameters": {"binary_data": False}}]
    new_header = json.dumps(header).encode()
    payload = new_header + (body[json_size:] if json_size else b"")
    headers = {"Inference-Header-Content-Length": str(len(new_header))} if json_size else {}
    r = httpx.post(f"{server.url}/v2/models/{model}/infer", content=payload, headers=headers, timeout=60)
    data = r.json()
    if r.status_code == 200:
        out = data["outputs"][0]
        data = {"output": np.array(out["data"], dtype=np.float32).reshape(out["shape"])}
    return r.status_code, data


def test_serve_takes_the_latest_export_and_names_models(tmp_path, monkeypatch):
    from attnx.cli._common import UserError
    from attnx.cli.serve_cmd import _model_files
    from attnx.runtime.server import parse_model_args

    monkeypatch.setenv("ATTNX_WORKDIR", str(tmp_path))
    with pytest.raises(UserError, match="no ONNX export"):
        _model_files(None)
    old, new = tmp_path / "old.onnx", tmp_path / "new.onnx"
    old.write_bytes(b"x")
    new.write_bytes(b"x")
    os.utime(old, (1, 1))
    assert _model_files(None) == {"new": new}
    assert parse_model_args(["a/b/maw.onnx", "fast=a/smal.onnx"]) == [("maw", Path("a/b/maw.onnx")),
                                                                      ("fast", Path("a/smal.onnx"))]
    with pytest.raises(UserError, match="two models named"):
        _model_files([str(old), f"old={new}"])


def test_fp16_model_over_json_and_binary(exported):
    session = load(exported("maw", fp16=True).path, device="cpu")
    assert session.input("hidden_states").dtype == np.float16
    feeds = request(session, rows=2, length=6, seed=3, pad_to=8)
    want = session.run(feeds)
    with running_server({"half": session}) as srv:
        c = httpclient.InferenceServerClient(srv.address)
        try:
            assert c.get_model_metadata("half")["inputs"][0]["datatype"] == "FP16"
            for binary in (True, False):
                got, response = triton_infer(c, "half", feeds, binary_in=binary, binary_out=binary)
                assert response["outputs"][0]["datatype"] == "FP16"
                assert_outputs_equal(got, want, atol=1e-3)
        finally:
            c.close()


@pytest.mark.parametrize("flags, message", [
    (["--max-body-mb", "-1"], "--max-body-mb must be positive, got -1.0"),
    (["--max-body-mb", "0"], "--max-body-mb must be positive, got 0.0"),
    (["--max-seq", "-5"], "--max-seq must be >= 1, got -5"),
    (["--max-seq", "0"], "--max-seq must be >= 1, got 0"),
    (["--port", "99999"], "--port must be 0..65535, got 99999"),
    (["--port", "-1"], "--port must be 0..65535, got -1"),
    (["--grpc-port", "70000"], "--grpc-port must be 0..65535, got 70000"),
], ids=["body-negative", "body-zero", "seq-negative", "seq-zero", "port-high", "port-negative", "grpc-port-high"])
def test_serve_refuses_limits_that_would_fail_every_request(paths, flags, message):
    """Before: --max-body-mb -1 served and answered every request 413, --max-seq -5 every one 400."""
    proc = attnx("serve", paths["maw"], *flags)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "listening" not in proc.stderr + proc.stdout


def test_limits_that_refuse_every_request_are_a_value_error():
    from attnx.runtime.wire.limits import Limits

    for field in ("max_body_bytes", "max_seq", "max_tensor_elements", "max_texts", "max_decode_bytes"):
        with pytest.raises(ValueError, match=f"{field} must be a positive integer"):
            Limits(**{field: 0})
    assert Limits(max_body_bytes=1 << 20).decode_budget == 64 << 20
    assert Limits(max_body_bytes=100 << 20).decode_budget == 100 << 20
