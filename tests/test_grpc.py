"""KServe v2 over gRPC, driven by the unmodified tritonclient.grpc (and its generated stubs) on loopback."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from attnx.runtime import TextModel, load
from conftest_runtime import EXPORT_KW, assert_outputs_equal, request, running_server
from support import exports

TEXTS = ["A man is eating food.", "Someone is riding a horse on the beach at sunset.", "ok"]


@pytest.fixture(scope="module")
def sessions(exported, tmp_path_factory):
    return {"maw": load(exported("maw", **EXPORT_KW).path, device="cpu"),
            "minilm": load(exports.minilm().path, device="cpu")}


@pytest.fixture(scope="module")
def server(sessions):
    with running_server({"maw": sessions["maw"].path, "minilm": sessions["minilm"].path}, grpc_port=0) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    c = grpcclient.InferenceServerClient(server.grpc_address)
    yield c
    c.close()


@pytest.fixture(scope="module")
def stub(server):
    channel = grpc.insecure_channel(server.grpc_address)
    yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


def grpc_inputs(feeds):
    from tritonclient.utils import np_to_triton_dtype

    items = []
    for name, arr in feeds.items():
        item = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        item.set_data_from_numpy(arr)  # raw_input_contents
        items.append(item)
    return items


def test_health_metadata_config_and_index(client, server):
    assert server.grpc_address.startswith("127.0.0.1:")
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("maw") and client.is_model_ready("minilm", "1")
    assert not client.is_model_ready("nope")
    assert client.get_server_metadata(as_json=True)["name"] == "attnx"
    meta = client.get_model_metadata("minilm", as_json=True)
    assert meta["inputs"][0] == {"name": "text", "datatype": "BYTES", "shape": ["-1"]}
    assert [o["name"] for o in meta["outputs"]] == ["last_hidden_state", "sentence_embedding"]
    config = client.get_model_config("minilm", as_json=True)["config"]
    assert config["max_batch_size"] == 32 and config["parameters"]["max_length"]["string_value"] == "256"
    names = {m["name"] for m in client.get_model_repository_index(as_json=True)["models"]}
    assert names == {"maw", "minilm"}
    with pytest.raises(InferenceServerException, match="unknown model") as info:
        client.get_model_metadata("nope")
    assert info.value.status() == "StatusCode.NOT_FOUND"


def test_infer_with_raw_contents_gives_the_runtime_numbers(client, sessions):
    session = sessions["maw"]
    feeds = request(session, rows=2, length=9, seed=4, pad_to=12)
    result = client.infer("maw", grpc_inputs(feeds), request_id="g-1")
    got = {name: result.as_numpy(name) for name in session.output_names}
    assert_outputs_equal(got, session.run(feeds), atol=1e-5)
    assert result.get_response().id == "g-1"
    only = client.infer("maw", grpc_inputs(feeds), outputs=[grpcclient.InferRequestedOutput("maw_depth")])
    assert [o.name for o in only.get_response().outputs] == ["maw_depth"]


def test_infer_with_typed_contents(stub, sessions):
    session = sessions["maw"]
    feeds = request(session, rows=1, length=5, seed=8)
    req = service_pb2.ModelInferRequest(model_name="maw")
    for name, arr in feeds.items():
        tensor = req.inputs.add(name=name, datatype="FP32" if arr.dtype == np.float32 else "INT64",
                                shape=list(arr.shape))
        field = tensor.contents.fp32_contents if arr.dtype == np.float32 else tensor.contents.int64_contents
        field.extend(arr.ravel().tolist())
    response = stub.ModelInfer(req)
    out = {o.name: (o, raw) for o, raw in zip(response.outputs, response.raw_output_contents)}
    meta, raw = out["output"]
    got = np.frombuffer(raw, dtype=np.float32).reshape(list(meta.shape))
    np.testing.assert_allclose(got, session.run(feeds)["output"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("typed", [False, True], ids=["raw", "typed"])
def test_text_over_grpc_equals_sentence_transformers(client, stub, typed):
    want = exports.minilm_reference().encode(TEXTS)
    if typed:
        req = service_pb2.ModelInferRequest(model_name="minilm")
        req.inputs.add(name="text", datatype="BYTES", shape=[len(TEXTS)]).contents.bytes_contents.extend(
            [t.encode() for t in TEXTS])
        req.outputs.add(name="sentence_embedding")
        response = stub.ModelInfer(req)
        assert [o.name for o in response.outputs] == ["sentence_embedding"]
        got = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(len(TEXTS), 384)
    else:
        item = grpcclient.InferInput("text", [len(TEXTS)], "BYTES")
        item.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object))
        result = client.infer("minilm", [item], outputs=[grpcclient.InferRequestedOutput("sentence_embedding")])
        assert [o.name for o in result.get_response().outputs] == ["sentence_embedding"]
        got = result.as_numpy("sentence_embedding")
    assert np.abs(got - want).max() < 2e-5


def test_http_and_grpc_and_encode_give_the_same_numbers(client, server, sessions):
    import tritonclient.http as httpclient

    item = httpclient.InferInput("text", [len(TEXTS)], "BYTES")
    item.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object))
    h = httpclient.InferenceServerClient(server.address)
    try:
        over_http = h.infer("minilm", [item]).as_numpy("sentence_embedding")
    finally:
        h.close()
    g = grpcclient.InferInput("text", [len(TEXTS)], "BYTES")
    g.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object))
    over_grpc = client.infer("minilm", [g]).as_numpy("sentence_embedding")
    embedded = TextModel(sessions["minilm"]).encode(TEXTS)
    assert np.abs(over_http - over_grpc).max() < 1e-6 and np.abs(over_http - embedded).max() < 1e-5


BAD = {
    "non-utf8": (lambda: [_text([b"\xff\xfeabc"])], "not valid UTF-8"),
    "empty": (lambda: [_text([b""])], "empty"),
    "wrong-shape": (lambda: [_text([b"a", b"b"], shape=[1, 2])], "expected \\[N\\]"),
    "mixed": (lambda: [_text([b"a"]), _ids([[101, 102]])], "either text"),
    "bad-id": (lambda: [_ids([[101, 30522, 102]])], "outside the model's range"),
    "negative-id": (lambda: [_ids([[101, -3, 102]])], "outside"),
    "wrong-datatype": (lambda: [_ids([[101.5, 102.0]], "FP32")], "datatype FP32"),
}


def _text(values, shape=None):
    item = grpcclient.InferInput("text", shape or [len(values)], "BYTES")
    item.set_data_from_numpy(np.array(values, dtype=object).reshape(shape or [len(values)]))
    return item


def _ids(rows, datatype="INT64"):
    arr = np.array(rows, dtype=np.int64 if datatype == "INT64" else np.float32)
    item = grpcclient.InferInput("input_ids", list(arr.shape), datatype)
    item.set_data_from_numpy(arr)
    return item


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_invalid_argument_and_the_server_stays_up(case, client):
    make, message = BAD[case]
    with pytest.raises(InferenceServerException, match=message) as info:
        client.infer("minilm", make())
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert client.is_server_live()
    result = client.infer("minilm", [_text([TEXTS[0].encode()])])
    assert np.abs(result.as_numpy("sentence_embedding") - exports.minilm_reference().encode(TEXTS[:1])).max() < 2e-5


def test_text_to_a_model_without_a_tokenizer_and_unknown_models(client):
    with pytest.raises(InferenceServerException, match="has no tokenizer") as info:
        client.infer("maw", [_text([b"hello"])])
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException, match="unknown model") as info:
        client.infer("nope", [_text([b"hello"])])
    assert info.value.status() == "StatusCode.NOT_FOUND"


def test_cli_serve_with_grpc_then_sigterm_stops_cleanly(sessions, tmp_path):
    import re
    import signal
    import time

    from support.cli import subprocess_popen

    proc = subprocess_popen("serve", f"m={sessions['minilm'].path}", "--port", "0", "--grpc-port", "0",
                            env={"ATTNX_WORKDIR": str(tmp_path)})
    try:
        address, lines = None, []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            found = re.search(r"gRPC listening on (\S+)", line)
            address = found.group(1) if found else address
            if "listening on http" in line:
                break
        assert address, "".join(lines)
        c = grpcclient.InferenceServerClient(address)
        result = c.infer("m", [_text([TEXTS[0].encode()])])
        assert np.abs(result.as_numpy("sentence_embedding") - exports.minilm_reference().encode(TEXTS[:1])).max() < 2e-5
        c.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stderr.close()
        proc.stdout.close()
