"""`attnx serve --api-key` (issue 24): one bearer key on every route but the health checks, over HTTP (KServe
v2, OpenAI, TEI, metrics) and gRPC, driven by the unmodified openai, tritonclient.http and tritonclient.grpc
clients; the key from ATTNX_API_KEY through the real CLI."""

from __future__ import annotations

import re
import signal
import subprocess
import time

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from attnx.runtime import load
from attnx.runtime.wire import auth
from conftest_runtime import cosine_rows, running_server
from support import exports
from support.cli import one_line_error, subprocess_popen
from support.cli import run as attnx

KEY = "sk-attnx-test-0123456789"
GOOD = {"Authorization": f"Bearer {KEY}"}
TEXT_BODY = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hello"]}]}

#: (method, path, JSON body): every route that needs the key.
GUARDED = [
    ("GET", "/v2", None), ("GET", "/v2/models/minilm", None), ("GET", "/v2/models/minilm/config", None),
    ("POST", "/v2/repository/index", None), ("POST", "/v2/models/minilm/infer", TEXT_BODY),
    ("GET", "/metrics", None), ("GET", "/explain", None),
    ("GET", "/v1/models", None), ("GET", "/v1/models/minilm", None),
    ("POST", "/v1/embeddings", {"input": "hello", "model": "minilm"}),
    ("POST", "/embeddings", {"input": "hello", "model": "minilm"}),
    ("POST", "/embed", {"inputs": "hello"}), ("POST", "/", {"inputs": "hello"}), ("GET", "/info", None),
]
OPEN = ["/v2/health/live", "/v2/health/ready", "/v2/models/minilm/ready", "/v2/models/minilm/versions/1/ready",
        "/health"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    session = load(exports.minilm().path, device="cpu")
    with running_server({"minilm": session}, grpc_port=0, api_key=KEY) as s:
        yield s


@pytest.mark.parametrize("method, path, body", GUARDED, ids=[f"{m} {p}" for m, p, _ in GUARDED])
def test_every_route_but_health_needs_the_key(server, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": f"Bearer {KEY}x"}, {"Authorization": "Bearer"}):
        r = httpx.request(method, server.url + path, json=body, headers=headers, timeout=60)
        assert r.status_code == 401, (path, headers, r.status_code)
        assert r.headers["www-authenticate"].startswith("Bearer")
        error = r.json()["error"]
        if path.startswith("/v1/") or path == "/embeddings":  # OpenAI's shape where OpenAI clients call
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        else:
            assert isinstance(error, str) and "API key" in error
    ok = httpx.request(method, server.url + path, json=body, headers=GOOD, timeout=60)
    assert ok.status_code == 200, (path, ok.status_code, ok.text[:200])
    lower = httpx.request(method, server.url + path, json=body, timeout=60,
                          headers={"authorization": f"bearer {KEY}"})  # header and scheme are case-insensitive
    assert lower.status_code == 200


@pytest.mark.parametrize("path", OPEN)
def test_health_routes_answer_without_a_key(server, path):
    assert httpx.get(server.url + path, timeout=10).status_code == 200


def test_the_openai_client_with_and_without_the_key(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="not-the-key", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError) as info:
            c.embeddings.create(input="hello", model="minilm")
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as c:
        got = np.array(c.embeddings.create(input=["hello world"], model="minilm").data[0].embedding, np.float32)
    assert cosine_rows(got[None], exports.minilm_reference().encode(["hello world"])).min() >= 0.9999


def test_tritonclient_http_sends_the_key_as_a_header(server):
    c = httpclient.InferenceServerClient(server.address, network_timeout=60)
    try:
        assert c.is_server_live() and c.is_model_ready("minilm")  # probes need no key
        item = httpclient.InferInput("text", [1], "BYTES")
        item.set_data_from_numpy(np.array([b"hello world"], dtype=object))
        with pytest.raises(InferenceServerException, match="API key"):
            c.infer("minilm", [item])
        got = c.infer("minilm", [item], headers=dict(GOOD)).as_numpy("sentence_embedding")  # it adds to the dict
        assert cosine_rows(got, exports.minilm_reference().encode(["hello world"])).min() >= 0.9999
    finally:
        c.close()


def test_grpc_needs_the_key_in_metadata_but_not_for_health(server):
    c = grpcclient.InferenceServerClient(server.grpc_address)
    try:
        assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("minilm")
        for headers in (None, {"authorization": "Bearer wrong"}):
            with pytest.raises(InferenceServerException) as info:
                c.get_model_metadata("minilm", headers=headers)
            assert info.value.status() == "StatusCode.UNAUTHENTICATED"
        item = grpcclient.InferInput("text", [1], "BYTES")
        item.set_data_from_numpy(np.array([b"hello world"], dtype=object))
        with pytest.raises(InferenceServerException) as info:
            c.infer("minilm", [item])
        assert info.value.status() == "StatusCode.UNAUTHENTICATED"
        got = c.infer("minilm", [item], headers={"authorization": f"Bearer {KEY}"}).as_numpy("sentence_embedding")
        assert cosine_rows(got, exports.minilm_reference().encode(["hello world"])).min() >= 0.9999
    finally:
        c.close()


def test_the_comparison_is_over_fixed_length_digests(monkeypatch):
    """hmac.compare_digest runs for every header, missing or not, on two 32-byte SHA-256 digests, so its time
    tells nothing of the key's content or length."""
    seen = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: seen.append((len(a), len(b))) or real(a, b))
    key = auth.ApiKey(KEY)
    assert key.accepts(f"Bearer {KEY}") and key.accepts(f"bearer {KEY}".encode())
    for header in (None, "", "Bearer", "Bearer x", f"Bearer {KEY * 3}", f"Token {KEY}", f"Bearer {KEY[:-1]}"):
        assert not key.accepts(header)
    assert seen == [(32, 32)] * 9
    with pytest.raises(ValueError):
        auth.ApiKey(" padded ")


def test_the_cli_takes_the_key_from_attnx_api_key(tmp_path_factory, tmp_path):
    model = exports.minilm().path
    proc = subprocess_popen("serve", f"minilm={model}", "--port", "0", stdout=subprocess.DEVNULL,
                            env={"ATTNX_API_KEY": KEY, "ATTNX_WORKDIR": str(tmp_path)})
    try:
        url, lines = None, []
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            found = re.search(r"listening on (http://\S+)", line)
            url = found.group(1) if found else None
        assert url, "".join(lines)
        assert any("API key required" in line for line in lines)
        body = {"input": "hello", "model": "minilm"}
        assert httpx.post(url + "/v1/embeddings", json=body, timeout=60).status_code == 401
        assert httpx.post(url + "/v1/embeddings", json=body, headers=GOOD, timeout=60).status_code == 200
        assert httpx.get(url + "/v2/health/ready", timeout=10).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stderr.close()


def test_the_cli_refuses_a_bad_dimensions_flag_in_one_line():
    model = exports.minilm().path
    for flag, message in ((["--dimensions", "other=64"], "no model named 'other'"),
                          (["--dimensions", "64,abc"], "takes 'any' or comma-separated sizes"),
                          (["--max-inputs", "0"], "--max-inputs must be >= 1")):
        one_line_error(attnx("serve", f"minilm={model}", "--port", "0", *flag), message)


def test_an_unknown_models_open_ready_route_names_no_served_model(server):
    """Issue 32: /v2/models/{m}/ready answers without the key, so its 404 must not list what the server serves."""
    r = httpx.get(server.url + "/v2/models/secret-guess/ready", timeout=10)
    assert r.status_code == 404 and "minilm" not in r.text and r.json() == {"error": "unknown model 'secret-guess'"}
    assert httpx.get(server.url + "/v2/models/secret-guess", headers=GOOD, timeout=10).status_code == 404


def test_an_empty_api_key_is_refused_in_one_line():
    """Issue 32: ``--api-key ''`` or ``ATTNX_API_KEY=`` (set, empty) would serve every route open: refused, in the
    library and by the CLI (one line, before any model loads)."""
    from attnx.runtime.config import ServingConfig
    from attnx.runtime.server import InferenceServer

    model = exports.minilm().path
    with pytest.raises(ValueError, match="the API key is empty"):
        InferenceServer({"minilm": model}, ServingConfig(api_key=""))
    for args, env in ((["--api-key", ""], {}), ([], {auth.ENV_VAR: ""}), (["--api-key", "  "], {})):
        one_line_error(attnx("serve", f"minilm={model}", "--port", "0", *args, env=env), "the API key is empty",
                       alone=True)
