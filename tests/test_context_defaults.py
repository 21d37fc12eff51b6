"""A variant's context inputs say, in the export's metadata, what they default to (``TensorEntry.default``,
declared by the variant's ``InputSpec``: zeros for smal, cultural and metaphor; issue 26, friction): a
text-only request then runs, over HTTP, gRPC and ``TextModel``, exactly as one sending zeros; a file
without the field (exported before it existed) keeps requiring them."""

from __future__ import annotations

import dataclasses
import shutil

import httpx
import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from attnx.contract import ContractError, ModelInfo, TensorEntry
from attnx.runtime import TextModel
from conftest_runtime import running_server
from support import exports

TEXTS = ["Will it rain tomorrow?", "Heavy rain is expected tomorrow, with winds from the north."]
ZEROS = {"self_state": np.zeros((2, 32), np.float32), "trace": np.zeros((2, 32, 32), np.float32)}


@pytest.fixture(scope="module")
def smal(tmp_path_factory):
    return exports.minilm("smal").path


@pytest.fixture(scope="module")
def defaulted(smal):
    """The smal export as written: its context inputs default to zeros (smal declares them so)."""
    assert {e.name: e.default for e in ModelInfo.read(smal).inputs if e.role == "context"} == {
        "self_state": "zeros", "trace": "zeros"}
    return smal


@pytest.fixture(scope="module")
def old(smal, tmp_path_factory):
    """A copy without the field, as a file exported before it existed (stripped with the contract's own API)."""
    folder = tmp_path_factory.mktemp("old")
    shutil.copytree(smal.with_suffix(".tokenizer"), folder / smal.with_suffix(".tokenizer").name)
    model = onnx.load(str(smal))
    info = ModelInfo.read(model)
    info.inputs = [dataclasses.replace(e, default=None) for e in info.inputs]
    info.write(model)
    onnx.save(model, str(folder / smal.name))
    return folder / smal.name


@pytest.fixture(scope="module")
def server(old, defaulted):
    with running_server({"old": old, "new": defaulted}, grpc_port=0) as s:
        yield s


@pytest.fixture(scope="module")
def want(smal):
    return TextModel(smal).encode(TEXTS, context=ZEROS)


def _text_inputs(lib, with_context: bool):
    item = lib.InferInput("text", [len(TEXTS)], "BYTES")
    item.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object))
    inputs = [item]
    if with_context:
        for name, arr in ZEROS.items():
            extra = lib.InferInput(name, list(arr.shape), "FP32")
            extra.set_data_from_numpy(arr)
            inputs.append(extra)
    return inputs


@pytest.mark.parametrize("lib", [httpclient, grpcclient], ids=["http", "grpc"])
def test_a_text_only_request_gets_zeros_for_defaulted_context(server, want, lib):
    address = server.address if lib is httpclient else server.grpc_address
    client = lib.InferenceServerClient(address)
    try:
        out = [lib.InferRequestedOutput("sentence_embedding")]
        got = client.infer("new", _text_inputs(lib, False), outputs=out).as_numpy("sentence_embedding")
        sent = client.infer("new", _text_inputs(lib, True), outputs=out).as_numpy("sentence_embedding")
        np.testing.assert_array_equal(got, sent)
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)
        with pytest.raises(Exception, match=r"missing input\(s\) \['self_state', 'trace'\]"):
            client.infer("old", _text_inputs(lib, False), outputs=out)  # no default in its metadata: today's 400
    finally:
        client.close()


def test_token_ids_without_context_and_the_metadata_says_so(server, want, defaulted):
    ids = TextModel(defaulted).tokenize(TEXTS[:1])[0]
    body = {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, len(ids)], "data": ids.tolist()}],
            "outputs": [{"name": "sentence_embedding"}]}
    r = httpx.post(f"{server.url}/v2/models/new/infer", json=body, timeout=60)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["outputs"][0]["data"], want[0], atol=2e-6, rtol=0)
    meta = httpx.get(f"{server.url}/v2/models/new", timeout=10).json()
    assert meta["parameters"]["input_defaults"] == {"self_state": "zeros", "trace": "zeros"}
    config = httpx.get(f"{server.url}/v2/models/new/config", timeout=10).json()
    assert {i["name"]: i.get("optional", False) for i in config["input"]} == {
        "input_ids": False, "attention_mask": False, "token_type_ids": False, "self_state": True, "trace": True}
    assert "input_defaults" not in httpx.get(f"{server.url}/v2/models/old", timeout=10).json().get("parameters", {})


def test_text_model_fills_defaulted_context(defaulted, want):
    np.testing.assert_allclose(TextModel(defaulted).encode(TEXTS), want, atol=2e-6, rtol=0)


def test_the_contract_field_round_trips_and_refuses_unknown_values():
    entry = TensorEntry("trace", "context", "float32", ("batch", 32, 32), default="zeros")
    assert TensorEntry.from_json(entry.to_json(), True) == entry
    assert "default" not in TensorEntry("x", "context", "float32", ("batch",)).to_json()  # old files unchanged
    assert TensorEntry.from_json({**entry.to_json(), "default": "ones"}, True).default == "ones"  # the toy's
    for bad, is_input in (("twos", True), ("zeros", False), (0, True)):
        with pytest.raises(ContractError, match="bad default"):
            TensorEntry.from_json({**entry.to_json(), "default": bad}, is_input)
