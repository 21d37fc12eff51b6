"""attnx's runtime as a KServe custom predictor (:mod:`attnx.deploy.kserve_predictor`): kserve 0.21's own
``ModelServer`` in a subprocess (kserve's copy of the v2 protos clashes with tritonclient's in one process),
queried with the unmodified tritonclient. Its model metadata declares the model's tensors, and its answers
are attnx's session run alone: over gRPC (``as_numpy`` reads ``raw_output_contents``) and over HTTP with binary
and JSON tensors each way (issue 46: JSON inputs were a 400, gRPC outputs came in ``contents``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from attnx.runtime import load
from conftest_runtime import EXPORT_KW


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def predictor(exported, tmp_path_factory):
    path = exported("maw", **EXPORT_KW).path
    port, grpc_port = free_port(), free_port()
    log = tmp_path_factory.mktemp("kserve") / "predictor.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "attnx.deploy.kserve_predictor", "--model_name", "maw",
                                    "--model_path", str(path), "--http_port", str(port), "--enable_grpc", "true",
                                    "--grpc_port", str(grpc_port),
                                    "--device", "cpu"], stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the predictor did not start in 120 s:\n" + log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
        yield path, f"127.0.0.1:{port}", f"127.0.0.1:{grpc_port}"
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_metadata_declares_the_tensors_and_answers_are_attnx(predictor):
    path, address, _ = predictor
    session = load(path, device="cpu")
    client = httpclient.InferenceServerClient(address)
    try:
        metadata = client.get_model_metadata("maw")
        d = session.input("hidden_states").shape[2]
        assert metadata["inputs"] == [{"name": "hidden_states", "datatype": "FP32", "shape": [-1, -1, d]},
                                      {"name": "attention_mask", "datatype": "INT64", "shape": [-1, -1]}]
        assert [o["name"] for o in metadata["outputs"]] == session.output_names
        rng = np.random.default_rng(0)
        x = rng.standard_normal((2, 5, d)).astype(np.float32)
        mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], np.int64)
        # Plain Open Inference Protocol JSON, as curl or httpx send it (with a Content-Type).
        body = {"inputs": [{"name": "hidden_states", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()},
                           {"name": "attention_mask", "shape": list(mask.shape), "datatype": "INT64",
                            "data": mask.ravel().tolist()}]}
        answer = httpx.post(f"http://{address}/v2/models/maw/infer", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        want = session.run({"hidden_states": x, "attention_mask": mask})
        got = {o["name"]: np.array(o["data"], dtype=np.float32).reshape(o["shape"]) for o in answer.json()["outputs"]}
        assert set(got) == set(want)
        for name, array in want.items():
            assert np.array_equal(got[name], array.astype(np.float32)), name
        body["inputs"][0]["shape"] = [1, 5, d + 1]
        body["inputs"][0]["data"] = [0.0] * (5 * (d + 1))
        del body["inputs"][1]
        bad = httpx.post(f"http://{address}/v2/models/maw/infer", json=body, timeout=60)
        assert bad.status_code == 400 and f"dim 2 is {d + 1}, expected {d}" in bad.text
    finally:
        client.close()


def _feeds(d: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {"hidden_states": rng.standard_normal((2, 4, d)).astype(np.float32),
            "attention_mask": np.array([[1, 1, 1, 1], [1, 1, 0, 0]], np.int64)}


@pytest.mark.parametrize("binary_in,binary_out", [(False, False), (False, True), (True, False), (True, True)])
def test_tritonclient_http_in_json_and_binary(predictor, binary_in, binary_out):
    path, address, _ = predictor
    session = load(path, device="cpu")
    feeds = _feeds(session.input("hidden_states").shape[2])
    want = session.run(feeds)
    client = httpclient.InferenceServerClient(address)
    try:
        inputs = []
        for name, array in feeds.items():
            item = httpclient.InferInput(name, list(array.shape), "FP32" if array.dtype == np.float32 else "INT64")
            item.set_data_from_numpy(array, binary_data=binary_in)
            inputs.append(item)
        outputs = [httpclient.InferRequestedOutput(name, binary_data=binary_out) for name in want]
        result = client.infer("maw", inputs, outputs=outputs)
        for name, array in want.items():
            assert np.array_equal(result.as_numpy(name), array), name
        sent = {o["name"]: o for o in result.get_response()["outputs"]}
        assert all(("data" in sent[name]) is (not binary_out) for name in want)  # JSON when asked, bytes otherwise
    finally:
        client.close()


def test_tritonclient_grpc_reads_raw_output_contents(predictor):
    path, _, grpc_address = predictor
    session = load(path, device="cpu")
    feeds = _feeds(session.input("hidden_states").shape[2])
    want = session.run(feeds)
    client = grpcclient.InferenceServerClient(grpc_address)
    try:
        inputs = []
        for name, array in feeds.items():
            item = grpcclient.InferInput(name, list(array.shape), "FP32" if array.dtype == np.float32 else "INT64")
            item.set_data_from_numpy(array)
            inputs.append(item)
        result = client.infer("maw", inputs)
        assert len(result.get_response().raw_output_contents) == len(want)
        for name, array in want.items():
            assert np.array_equal(result.as_numpy(name), array), name
        assert client.get_model_metadata("maw").inputs[0].name == "hidden_states"
    finally:
        client.close()
