"""TEI-compatible /embed (issue 24): huggingface_hub's InferenceClient, a TEI client, unchanged against attnx
serving the real all-MiniLM-L6-v2, compared with sentence-transformers; TEI's fields, errors and /info."""

from __future__ import annotations

import re

import httpx
import numpy as np
import pytest

from attnx.runtime import load
from attnx.runtime.serving.encoding import Dimensions
from attnx.runtime.wire.limits import Limits
from conftest_runtime import EXPORT_KW, cosine_rows, long_text, running_server
from support import exports

TEXTS = ["A man is eating food.", "Two dogs play in the snow near a frozen lake this morning.", "Hi"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, exported):
    """One embedding model, as TEI serves (maw beside it takes no text, so /embed needs no "model")."""
    models = {"minilm": load(exports.minilm().path, device="cpu"), "maw": exported("maw", **EXPORT_KW).path}
    with running_server(models, limits=Limits(max_texts=64), dimensions=Dimensions.parse(["any"], models)) as s:
        yield s


@pytest.fixture()
def tei(server, monkeypatch):
    """``InferenceClient(model=URL)``: it posts to that URL only. Its offline switch blocks every URL, loopback
    included, so it is lifted for this client; nothing here names a Hub model."""
    from huggingface_hub import InferenceClient, constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return lambda route="": InferenceClient(model=server.url + route, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def st():
    return exports.minilm_reference()


def assert_matches(got, want) -> None:
    got = np.asarray(got, np.float32)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert cosine_rows(got, want).min() >= 0.9999 and np.abs(got - want).max() < 3e-5


@pytest.mark.parametrize("route", ["", "/embed"], ids=["root", "embed"])
def test_the_inference_client_equals_sentence_transformers(tei, st, route):
    client = tei(route)
    assert_matches(client.feature_extraction(TEXTS), st.encode(TEXTS))
    assert_matches(client.feature_extraction(TEXTS[0]), st.encode(TEXTS[:1]))  # one string: one row too
    assert_matches(client.feature_extraction(TEXTS, normalize=False, truncate=True), st.encode(TEXTS))


def test_dimensions_and_token_ids(http, st):
    r = http.post("/embed", json={"inputs": TEXTS, "dimensions": 128})
    want = st.encode(TEXTS, truncate_dim=128)
    assert_matches(r.json(), want / np.linalg.norm(want, axis=1, keepdims=True))
    ids = [st.tokenizer(t)["input_ids"] for t in TEXTS]
    assert_matches(http.post("/embed", json={"inputs": ids}).json(), st.encode(TEXTS))
    mixed = http.post("/embed", json={"inputs": [TEXTS[0], ids[1]]}).json()  # TEI lets strings and ids mix
    assert_matches(mixed, st.encode(TEXTS[:2]))


def test_truncation_follows_tei(http, st):
    text = long_text(600, seed=2)
    assert_matches(http.post("/embed", json={"inputs": text}).json(), st.encode([text]))  # --auto-truncate default
    r = http.post("/embed", json={"inputs": [text], "truncate": False})
    assert r.status_code == 422 and r.json() == {
        "error": "inputs[0] is longer than the model's max length 256 tokens (and truncation is off)",
        "error_type": "Validation"}
    ok = http.post("/embed", json={"inputs": TEXTS[:1], "truncation_direction": "Right"})
    assert ok.status_code == 200


def test_too_many_inputs_through_the_client_is_413(tei):
    from huggingface_hub.errors import HfHubHTTPError

    with pytest.raises(HfHubHTTPError) as info:
        tei("/embed").feature_extraction([f"text {i}" for i in range(5000)])
    assert info.value.response.status_code == 413
    assert info.value.response.json() == {"error": "'inputs' has 5000 inputs, over the limit of 64 per request; "
                                                   "send them in several requests", "error_type": "Validation"}


BAD = {
    "empty-batch": ({"inputs": []}, 400, "Empty", "empty list"),
    "empty-string": ({"inputs": ["ok", ""]}, 422, "Validation", r"inputs\[1\] is an empty string"),
    "no-inputs": ({"normalize": True}, 422, "Validation", "'inputs' is required"),
    "normalize-not-bool": ({"inputs": "x", "normalize": "yes"}, 422, "Validation", "'normalize' must be a boolean"),
    "left-truncation": ({"inputs": "x", "truncation_direction": "left"}, 422, "Validation", "truncates on the right"),
    "prompt-name": ({"inputs": "x", "prompt_name": "query"}, 422, "Validation", "has no prompts"),
    "dims-too-big": ({"inputs": "x", "dimensions": 999}, 422, "Validation", "from 1 to 384"),
    "unknown-model": ({"inputs": "x", "model": "nope"}, 404, "Validation", "does not exist"),
    "not-json": (b"inputs=x", 422, "Validation", "not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_requests_get_teis_error_shape(case, http, st):
    body, status, kind, message = BAD[case]
    r = http.post("/embed", **({"content": body} if isinstance(body, bytes) else {"json": body}))
    assert r.status_code == status, (case, r.status_code, r.text[:300])
    payload = r.json()
    assert set(payload) == {"error", "error_type"} and payload["error_type"] == kind
    assert re.search(message, payload["error"]) and "\n" not in payload["error"]
    assert_matches(http.post("/embed", json={"inputs": TEXTS[:1]}).json(), st.encode(TEXTS[:1]))


def test_info_and_health(http):
    info = http.get("/info").json()
    assert info["model_id"] == info["served_model_name"] == "minilm"
    assert info["model_type"] == {"embedding": {"pooling": "mean"}} and info["model_dtype"] == "float32"
    assert info["max_input_length"] == 256 and info["max_client_batch_size"] == 64 and info["auto_truncate"] is True
    r = http.get("/health")
    assert r.status_code == 200 and r.content == b""
