"""Rerank routes (issue 24, part 2): Cohere/Jina's ``/v1/rerank`` (and ``/v2/rerank``, Infinity's ``/rerank``
with ``documents``) and TEI's ``/rerank``, sent as those clients send them (plain JSON over httpx) to a real
server on loopback, serving exports of a random-weight ms-marco-shaped cross-encoder (mha, and cultural
placed at its neutral values). Scores and order are held against sentence-transformers' CrossEncoder and
transformers' AutoModelForSequenceClassification on the same pairs; bad requests get one-line errors in
each API's shape; the per-request limits, the API key and the metrics apply as on every other route."""

from __future__ import annotations

import re

import httpx
import numpy as np
import pytest

from attnx.runtime.wire.limits import Limits
from conftest_runtime import long_text, running_server
from scoring_fixtures import cross_encoder, export, neutral_context, reference, sigmoid

QUERY = "how do dogs play in the snow"
DOCS = ["two dogs play in the snow near a frozen lake", "a man is eating food", "the stock market fell today",
        "", "children build a snowman while their dog runs around the garden in the cold morning"]
LIMITS = Limits(max_texts=8, max_request_tokens=400)
KEY = "sk-attnx-rerank-test"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {"ce": export("bert-cross-encoder"),
            "ce-cultural": export("bert-cross-encoder", "cultural"),
            "sentiment": export("bert-classifier")}


@pytest.fixture(scope="module")
def http(models):
    with running_server(models, limits=LIMITS) as server, httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def ce(tmp_path_factory):
    return cross_encoder("bert-cross-encoder")


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return reference("bert-cross-encoder")


def body_for(model: str, models, docs=DOCS, **extra) -> dict:
    body = {"model": model, "query": QUERY, "documents": docs, **extra}
    if model != "ce":  # a placed variant takes its context inputs, one row per document
        body["context"] = neutral_context(models[model], len(docs))
    return body


@pytest.mark.parametrize("model", ["ce", "ce-cultural"])
def test_v1_rerank_equals_cross_encoder(http, models, ce, hf, model):
    r = http.post("/v1/rerank", json=body_for(model, models, return_documents=True))
    assert r.status_code == 200, r.text
    got = r.json()
    want = ce.rank(QUERY, DOCS, return_documents=True)  # sorted best first: corpus_id, score, text
    assert [x["index"] for x in got["results"]] == [w["corpus_id"] for w in want]
    np.testing.assert_allclose([x["relevance_score"] for x in got["results"]], [w["score"] for w in want],
                               rtol=0, atol=1e-5)
    assert [x["document"] for x in got["results"]] == [{"text": w["text"]} for w in want]
    logits = hf.logits([(QUERY, d) for d in DOCS])[:, 0]  # transformers itself: sigmoid of the one logit
    np.testing.assert_allclose([x["relevance_score"] for x in sorted(got["results"], key=lambda x: x["index"])],
                               sigmoid(logits), rtol=0, atol=1e-5)
    assert got["model"] == model and set(got["usage"]) == {"prompt_tokens", "total_tokens"}
    assert got["usage"]["total_tokens"] == sum(hf.tokens((QUERY, d)) for d in DOCS)
    assert got["id"].startswith("rerank-")


def test_top_n_raw_scores_and_document_objects(http, models, ce, hf):
    want = ce.rank(QUERY, DOCS, top_k=2)
    objects = [{"text": d, "id": f"doc-{i}"} for i, d in enumerate(DOCS)]  # Cohere v1 and Jina take objects
    for route in ("/v1/rerank", "/v2/rerank", "/rerank"):  # Cohere v2's client; Infinity's path
        got = http.post(route, json=body_for("ce", models, docs=objects, top_n=2)).json()
        assert [x["index"] for x in got["results"]] == [w["corpus_id"] for w in want]
        assert all("document" not in x for x in got["results"])  # return_documents defaults to false
    many = http.post("/v1/rerank", json=body_for("ce", models, top_n=99)).json()  # past the end: all of them
    assert len(many["results"]) == len(DOCS)
    raw = http.post("/v1/rerank", json=body_for("ce", models, raw_scores=True)).json()
    logits = hf.logits([(QUERY, d) for d in DOCS])[:, 0]
    np.testing.assert_allclose([logits[x["index"]] for x in raw["results"]],
                               [x["relevance_score"] for x in raw["results"]], rtol=0, atol=1e-4)


@pytest.mark.parametrize("model", ["ce", "ce-cultural"])
def test_tei_rerank_equals_cross_encoder(http, models, ce, hf, model):
    body = {"model": model, "query": QUERY, "texts": DOCS, "return_text": True}
    if model != "ce":
        body["context"] = neutral_context(models[model], len(DOCS))
    got = http.post("/rerank", json=body).json()
    want = ce.rank(QUERY, DOCS, return_documents=True)
    assert [(x["index"], x["text"]) for x in got] == [(w["corpus_id"], w["text"]) for w in want]
    np.testing.assert_allclose([x["score"] for x in got], [w["score"] for w in want], rtol=0, atol=1e-5)
    raw = http.post("/rerank", json={**body, "raw_scores": True, "return_text": False}).json()
    logits = hf.logits([(QUERY, d) for d in DOCS])[:, 0]
    assert all(set(x) == {"index", "score"} for x in raw)
    np.testing.assert_allclose([x["score"] for x in raw], logits[[x["index"] for x in raw]], rtol=0, atol=1e-4)


def test_long_pairs_are_cut_longest_first_as_cross_encoder_cuts_them(http, models, ce):
    """Both texts past the max length together: tokens come off the longer one first (a long document
    never pushes the query out), exactly as CrossEncoder's tokenizer call does."""
    query, docs = long_text(40, seed=1), [long_text(90, seed=2), long_text(30, seed=3), "a dog"]
    got = http.post("/rerank", json={"model": "ce", "query": query, "texts": docs}).json()
    want = ce.predict([(query, d) for d in docs])
    np.testing.assert_allclose([x["score"] for x in sorted(got, key=lambda x: x["index"])], want, rtol=0, atol=1e-5)
    r = http.post("/rerank", json={"model": "ce", "query": query, "texts": docs, "truncate": False})
    assert r.status_code == 422 and "texts[0] is longer than the model's max length 64" in r.json()["error"]
    r = http.post("/v1/rerank", json={"model": "ce", "query": query, "documents": docs, "truncate": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents"


def test_a_decoder_reranker_equals_cross_encoder(tmp_path_factory):
    """Qwen2ForSequenceClassification scores the last token: pairs of very different lengths share a padded
    batch and must each be read at their own last token (cultural placed)."""
    ce = cross_encoder("qwen2-classifier")
    docs = [DOCS[0], "hi", long_text(80, seed=4), DOCS[4]]
    path = export("qwen2-classifier", "cultural")
    body = {"query": QUERY, "texts": docs, "context": neutral_context(path, len(docs))}
    with running_server({"qwen": path}) as server:
        got = httpx.post(server.url + "/rerank", json=body, timeout=120).json()
    want = ce.rank(QUERY, docs)
    assert [x["index"] for x in got] == [w["corpus_id"] for w in want]
    np.testing.assert_allclose([x["score"] for x in got], [w["score"] for w in want], rtol=0, atol=1e-5)


#: Cohere/Jina-shaped bad requests: (body, status, param, message pattern).
BAD_V1 = {
    "no-documents": ({"model": "ce", "query": QUERY}, 400, "documents", "'documents' is required"),
    "empty-documents": ({"model": "ce", "query": QUERY, "documents": []}, 400, "documents", "empty list"),
    "documents-not-list": ({"model": "ce", "query": QUERY, "documents": "a doc"}, 400, "documents", "must be a list"),
    "document-without-text": ({"model": "ce", "query": QUERY, "documents": [{"title": "x"}]}, 400, "documents",
                              r"documents\[0\] is an object without a 'text' field"),
    "document-not-string": ({"model": "ce", "query": QUERY, "documents": ["ok", 3]}, 400, "documents",
                            r"documents\[1\] must be a string"),
    "no-query": ({"model": "ce", "documents": DOCS}, 400, "query", "'query' is required"),
    "empty-query": ({"model": "ce", "query": "", "documents": DOCS}, 400, "query", "'query' is an empty string"),
    "top-n-zero": ({"model": "ce", "query": QUERY, "documents": DOCS, "top_n": 0}, 400, "top_n",
                   "'top_n' must be a positive integer"),
    "top-n-string": ({"model": "ce", "query": QUERY, "documents": DOCS, "top_n": "2"}, 400, "top_n",
                     "'top_n' must be a positive integer"),
    "not-a-reranker": ({"model": "sentiment", "query": QUERY, "documents": DOCS}, 400, "model",
                       r"classifier with 3 labels \['negative', 'neutral', 'positive'\], not a reranker"),
    "no-model-named": ({"query": QUERY, "documents": DOCS}, 400, "model", "several rerankers"),
    "unknown-model": ({"model": "rerank-english-v3.0", "query": QUERY, "documents": DOCS}, 404, None,
                      "does not exist"),
    "too-many-documents": ({"model": "ce", "query": QUERY, "documents": ["d"] * 9}, 400, "documents",
                           "9 inputs, over the limit of 8"),
    "too-many-tokens": ({"model": "ce", "query": long_text(40), "documents": [long_text(40, seed=i) for i in range(8)]},
                        413, None, "over the limit of 400 tokens"),
    "context-rows-mismatch": ({"model": "ce-cultural", "query": QUERY, "documents": DOCS,
                               "context": {"cultural": [[1.0] * 32]}}, 400, "context", "needs 5 rows"),
    "context-unknown-input": ({"model": "ce", "query": QUERY, "documents": DOCS, "context": {"nope": [[1.0]]}},
                              400, "context", "'context' names 'nope'"),
    "return-documents-not-bool": ({"model": "ce", "query": QUERY, "documents": DOCS, "return_documents": "yes"},
                                  400, "return_documents", "must be a boolean"),
}


@pytest.mark.parametrize("case", sorted(BAD_V1))
def test_bad_v1_rerank_requests_get_openai_shaped_errors(http, case):
    body, status, param, message = BAD_V1[case]
    r = http.post("/v1/rerank", json=body)
    assert r.status_code == status, (case, r.status_code, r.text[:300])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert re.search(message, error["message"]) and "\n" not in error["message"]
    assert http.post("/v1/rerank", json={"model": "ce", "query": QUERY, "documents": DOCS}).status_code == 200


BAD_TEI = {
    "empty-texts": ({"model": "ce", "query": QUERY, "texts": []}, 400, "Empty", "`texts` cannot be empty"),
    "empty-query": ({"model": "ce", "query": "", "texts": DOCS}, 422, "Validation", "'query' is an empty string"),
    "not-a-reranker": ({"model": "sentiment", "query": QUERY, "texts": DOCS}, 422, "Validation", "not a reranker"),
    "too-many-texts": ({"model": "ce", "query": QUERY, "texts": ["t"] * 9}, 413, "Validation",
                       "9 inputs, over the limit of 8"),
    "left-truncation": ({"model": "ce", "query": QUERY, "texts": DOCS, "truncation_direction": "Left"}, 422,
                        "Validation", "truncates on the right"),
    "not-json": (b"query=x", 422, "Validation", "not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(BAD_TEI))
def test_bad_tei_rerank_requests_get_teis_error_shape(http, case):
    body, status, kind, message = BAD_TEI[case]
    r = http.post("/rerank", **({"content": body} if isinstance(body, bytes) else {"json": body}))
    assert r.status_code == status, (case, r.status_code, r.text[:300])
    payload = r.json()
    assert set(payload) == {"error", "error_type"} and payload["error_type"] == kind
    assert re.search(message, payload["error"]) and "\n" not in payload["error"]


def test_rerank_counts_in_the_servers_metrics(http):
    http.post("/v1/rerank", json={"model": "ce", "query": QUERY, "documents": DOCS})
    http.post("/v1/rerank", json={"model": "ce", "query": "", "documents": DOCS})
    text = http.get("/metrics").text
    assert re.search(r'attnx_request_success_total\{model="ce"\} [1-9]', text)
    assert re.search(r'attnx_request_failures_total\{model="ce",reason="bad_input"\} [1-9]', text)


def test_the_api_key_guards_rerank_and_classify(models):
    routes = [("/v1/rerank", {"model": "ce", "query": QUERY, "documents": DOCS}),
              ("/v2/rerank", {"model": "ce", "query": QUERY, "documents": DOCS}),
              ("/rerank", {"model": "ce", "query": QUERY, "texts": DOCS}),
              ("/predict", {"model": "sentiment", "inputs": "a man is eating food"}),
              ("/classify", {"model": "sentiment", "input": ["a man is eating food"]})]
    served = {"ce": models["ce"], "sentiment": models["sentiment"]}
    with running_server(served, api_key=KEY) as server, httpx.Client(base_url=server.url, timeout=120) as c:
        for path, body in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = c.post(path, json=body, headers=headers)
                assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer"), path
            assert c.post(path, json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200, path
        assert c.post("/v1/rerank", json=routes[0][1]).json()["error"]["code"] == "invalid_api_key"


ODD = [None, [], "text", 3, {"query": None, "documents": None, "texts": None, "inputs": None, "input": None},
       {"query": QUERY, "documents": [None]}, {"query": QUERY, "texts": [["nested"]]}, {"inputs": [[]]},
       {"inputs": ["a", ["b"]]}, {"inputs": [None]}, {"inputs": {"text_pair": "b"}, "parameters": None},
       {"inputs": "x", "parameters": [1]}, {"input": [{"text": "x"}]},
       {"query": QUERY, "documents": DOCS, "top_n": True},
       {"query": QUERY, "documents": DOCS, "context": "x"}, {"query": ["q"], "texts": DOCS}, {"model": ["ce"]}]


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank", "/rerank", "/predict", "/classify", "/"])
def test_odd_bodies_are_one_line_4xx_on_every_scoring_route(http, path):
    for body in ODD:
        r = http.post(path, json={**body, "model": body.get("model", "ce")} if isinstance(body, dict) else body)
        assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text[:300])
        payload = r.json()["error"]
        message = payload["message"] if isinstance(payload, dict) else payload
        assert message and "\n" not in message, (path, body, message)
    assert http.post("/rerank", json={"model": "ce", "query": QUERY, "texts": DOCS}).status_code == 200


def test_kserve_text_pairs_over_http_and_grpc_equal_transformers(models, hf):
    """Triton's clients score (query, document) pairs with ``text`` and ``text_pair`` BYTES inputs, over HTTP and
    gRPC: the logits are transformers' own on the same pairs; a model that scores no pairs refuses the input."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    docs = [d for d in DOCS if d]
    queries = np.array([QUERY.encode()] * len(docs), dtype=object)
    documents = np.array([d.encode() for d in docs], dtype=object)
    want = hf.logits([(QUERY, d) for d in docs])
    with running_server({"ce": models["ce"]}, grpc_port=0) as server:
        got = {}
        for kind, lib, address in (("http", httpclient, server.address), ("grpc", grpcclient, server.grpc_address)):
            client = lib.InferenceServerClient(address)
            try:
                meta = client.get_model_metadata("ce", as_json=True) if kind == "grpc" else client.get_model_metadata("ce")
                assert [i["name"] for i in meta["inputs"][:2]] == ["text", "text_pair"]
                inputs = [lib.InferInput("text", [len(docs)], "BYTES"), lib.InferInput("text_pair", [len(docs)], "BYTES")]
                inputs[0].set_data_from_numpy(queries)
                inputs[1].set_data_from_numpy(documents)
                got[kind] = client.infer("ce", inputs).as_numpy("logits")
                with pytest.raises(Exception, match="one per text"):
                    short = lib.InferInput("text_pair", [len(docs) - 1], "BYTES")
                    short.set_data_from_numpy(documents[:-1])
                    client.infer("ce", [inputs[0], short])
            finally:
                client.close()
    for kind, logits in got.items():
        np.testing.assert_allclose(logits, want, rtol=0, atol=1e-5, err_msg=kind)


def test_a_model_that_scores_no_pairs_refuses_text_pair():
    from attnx.runtime.apis import kserve_tensors as proto
    from attnx.runtime.wire.errors import ProtocolError

    sig = proto.ModelSignature("emb", [], [], 8, None, proto.TextInput("text", 32, "right", pairs=False))
    tensors = [proto.WireTensor("text", "BYTES", [1], {}, data=["a"]),
               proto.WireTensor("text_pair", "BYTES", [1], {}, data=["b"])]
    with pytest.raises(ProtocolError, match="does not score text pairs"):
        proto.build_infer_request(None, {}, tensors, None, sig, Limits())
