"""Classifier routes (issue 24, part 2): TEI's ``/predict`` (through ``huggingface_hub``'s unmodified
``InferenceClient.text_classification`` too), Infinity's ``/classify`` and KServe text requests, against a
real server on loopback serving exports of a random-weight 3-label sentiment classifier (mha, and smal placed
at its neutral values). Scores are held against transformers' AutoModelForSequenceClassification (and
sentence-transformers' CrossEncoder for pairs), labels against the folder's ``id2label``."""

from __future__ import annotations

import re
import types

import httpx
import numpy as np
import pytest

from attnx.runtime.wire.limits import Limits
from attnx.runtime.core.labels import read_labels as _labels
from conftest_runtime import running_server
from scoring_fixtures import cross_encoder, export, neutral_context, reference, sigmoid, softmax

TEXTS = ["a man is eating food", "two dogs play in the snow near a frozen lake", "the stock market fell today"]
LABELS = ["negative", "neutral", "positive"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {"sentiment": export("bert-classifier"),
            "sentiment-smal": export("bert-classifier", "smal"),
            "ce": export("bert-cross-encoder")}


@pytest.fixture(scope="module")
def server(models):
    with running_server(models, limits=Limits(max_texts=8)) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return reference("bert-classifier")


def expected(probs: np.ndarray) -> list[list[tuple[str, float]]]:
    """Per input, (label, score) best first."""
    return [[(LABELS[i], float(row[i])) for i in np.argsort(-row, kind="stable")] for row in probs]


def assert_predictions(got, want) -> None:
    assert [[p["label"] for p in row] for row in got] == [[label for label, _ in row] for row in want]
    np.testing.assert_allclose([[p["score"] for p in row] for row in got], [[s for _, s in row] for row in want],
                               rtol=0, atol=1e-5)


def with_context(body: dict, model: str, models, rows: int) -> dict:
    if model != "sentiment":  # the placed variant's context inputs, one row per input
        body["context"] = neutral_context(models[model], rows)
    return body


@pytest.mark.parametrize("model", ["sentiment", "sentiment-smal"])
def test_predict_equals_transformers(http, models, hf, model):
    one = http.post("/predict", json=with_context({"model": model, "inputs": TEXTS[0]}, model, models, 1)).json()
    assert_predictions([one], expected(softmax(hf.logits(TEXTS[:1]))))  # one input: one flat list, as TEI
    items = [[TEXTS[0]], [TEXTS[1], TEXTS[2]], [TEXTS[2]]]  # TEI's batch: strings and pairs mixed
    batch = http.post("/predict", json=with_context({"model": model, "inputs": items}, model, models, 3)).json()
    assert_predictions(batch, expected(softmax(hf.logits([TEXTS[0], (TEXTS[1], TEXTS[2]), TEXTS[2]]))))
    pair = http.post("/predict", json=with_context({"model": model, "inputs": TEXTS[1:]}, model, models, 1)).json()
    assert_predictions([pair], expected(softmax(hf.logits([tuple(TEXTS[1:])]))))  # [a, b]: one pair, as TEI
    raw = http.post("/predict", json=with_context({"model": model, "inputs": TEXTS[0], "raw_scores": True},
                                                  model, models, 1)).json()
    assert_predictions([raw], expected(hf.logits(TEXTS[:1])))


def test_predict_on_pairs_equals_cross_encoder(http, tmp_path_factory):
    ce = cross_encoder("bert-classifier")
    pairs = [(TEXTS[0], TEXTS[1]), (TEXTS[2], "")]
    got = http.post("/predict", json={"model": "sentiment", "inputs": [list(p) for p in pairs]}).json()
    want = ce.predict(pairs, apply_softmax=True)
    assert_predictions(got, expected(np.asarray(want)))


def test_a_reranker_predicts_its_one_label_with_a_sigmoid(http, tmp_path_factory):
    ce = cross_encoder("bert-cross-encoder")
    got = http.post("/predict", json={"model": "ce", "inputs": [["how do dogs play", TEXTS[1]]]}).json()
    assert got[0][0]["label"] == "LABEL_0"
    np.testing.assert_allclose(got[0][0]["score"], ce.predict([("how do dogs play", TEXTS[1])])[0], atol=1e-5)


@pytest.fixture(scope="module")
def hub_server(models):
    """A classifier beside a reranker: what ``InferenceClient`` (which names no model) gets is the classifier."""
    with running_server({"sentiment": models["sentiment"], "ce": models["ce"]}) as s:
        yield s


@pytest.fixture()
def client(hub_server, monkeypatch):
    """``InferenceClient(model=URL)`` posts to that URL only; its offline switch blocks loopback too, so it is
    lifted for this client (nothing here names a Hub model)."""
    from huggingface_hub import InferenceClient, constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return lambda route: InferenceClient(model=hub_server.url + route, timeout=120)


@pytest.mark.parametrize("route", ["/predict", ""], ids=["predict", "root"])
def test_the_inference_client_text_classification_equals_transformers(client, hf, route):
    want = expected(softmax(hf.logits(TEXTS[:1])))
    got = client(route).text_classification(TEXTS[0])
    assert_predictions([[{"label": x.label, "score": x.score} for x in got]], want)
    top = client(route).text_classification(TEXTS[0], top_k=1)
    assert_predictions([[{"label": x.label, "score": x.score} for x in top]], [want[0][:1]])
    logits = client(route).text_classification(TEXTS[0], function_to_apply="none")
    raw = dict(zip(LABELS, hf.logits(TEXTS[:1])[0].tolist()))
    assert {x.label: x.score for x in logits} == pytest.approx(raw, abs=1e-4)


def test_info_describes_the_classifier(hub_server):
    info = httpx.get(hub_server.url + "/info", timeout=60).json()
    assert info["model_type"] == {"classifier": {"id2label": {str(i): k for i, k in enumerate(LABELS)},
                                                 "label2id": {k: i for i, k in enumerate(LABELS)}}}


@pytest.mark.parametrize("model", ["sentiment", "sentiment-smal"])
def test_classify_in_infinitys_shape(http, models, hf, model):
    body = with_context({"model": model, "input": TEXTS}, model, models, 3)
    got = http.post("/classify", json=body).json()
    assert got["object"] == "classify" and got["model"] == model and got["id"].startswith("classify-")
    assert_predictions(got["data"], expected(softmax(hf.logits(TEXTS))))
    assert got["usage"]["total_tokens"] == sum(hf.tokens(t) for t in TEXTS)
    raw = http.post("/classify", json={**body, "raw_scores": True}).json()
    assert_predictions(raw["data"], expected(hf.logits(TEXTS)))
    tei = http.post("/classify", json=with_context({"model": model, "inputs": TEXTS[0]}, model, models, 1)).json()
    assert_predictions([tei], expected(softmax(hf.logits(TEXTS[:1]))))  # TEI's body: answered as /predict


def test_kserve_text_requests_to_a_classifier_give_logits(http, hf):
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [3], "data": TEXTS}]}
    out = http.post("/v2/models/sentiment/infer", json=body).json()["outputs"]
    logits = next(o for o in out if o["name"] == "logits")
    assert logits["shape"] == [3, 3]
    np.testing.assert_allclose(np.reshape(logits["data"], (3, 3)), hf.logits(TEXTS), rtol=0, atol=1e-4)


BAD_PREDICT = {
    "empty-list": ({"model": "sentiment", "inputs": []}, 400, "Empty", "empty list"),
    "empty-string": ({"model": "sentiment", "inputs": ""}, 422, "Validation", "'inputs' is an empty string"),
    "three-strings": ({"model": "sentiment", "inputs": ["a", "b", "c"]}, 422, "Validation",
                      r"one string or a pair of two"),
    "not-strings": ({"model": "sentiment", "inputs": [[1, 2]]}, 422, "Validation",
                    r"inputs\[0\]\[0\] must be a string"),
    "too-many": ({"model": "sentiment", "inputs": [["t"]] * 9}, 413, "Validation", "9 inputs, over the limit of 8"),
    "unknown-model": ({"model": "nope", "inputs": "x"}, 404, "Validation", "does not exist"),
    "no-model": ({"inputs": "x"}, 422, "Validation", "several text classifiers"),
    "no-inputs": ({"model": "sentiment"}, 422, "Validation", "'inputs' is required"),
    "raw-not-bool": ({"model": "sentiment", "inputs": "x", "raw_scores": 1}, 422, "Validation", "must be a boolean"),
    "bad-function": ({"model": "sentiment", "inputs": "x", "parameters": {"function_to_apply": "relu"}}, 422,
                     "Validation", "'function_to_apply' must be one of"),
    "bad-top-k": ({"model": "sentiment", "inputs": "x", "parameters": {"top_k": 0}}, 422, "Validation",
                  "'top_k' must be a positive integer"),
}


@pytest.mark.parametrize("case", sorted(BAD_PREDICT))
def test_bad_predict_requests_get_teis_error_shape(http, case):
    body, status, kind, message = BAD_PREDICT[case]
    r = http.post("/predict", json=body)
    assert r.status_code == status, (case, r.status_code, r.text[:300])
    payload = r.json()
    assert set(payload) == {"error", "error_type"} and payload["error_type"] == kind
    assert re.search(message, payload["error"]) and "\n" not in payload["error"]
    assert http.post("/predict", json={"model": "sentiment", "inputs": "ok"}).status_code == 200


BAD_CLASSIFY = {
    "empty-input": ({"model": "sentiment", "input": []}, 400, "input", "empty list"),
    "empty-string": ({"model": "sentiment", "input": ["ok", ""]}, 400, "input", r"input\[1\] is an empty string"),
    "too-many": ({"model": "sentiment", "input": ["t"] * 9}, 400, "input", "9 inputs, over the limit of 8"),
    "unknown-model": ({"model": "nope", "input": ["x"]}, 404, None, "does not exist"),
    "no-input": ({"model": "sentiment"}, 400, "input", "'input' is required"),
}


@pytest.mark.parametrize("case", sorted(BAD_CLASSIFY))
def test_bad_classify_requests_get_openai_shaped_errors(http, case):
    body, status, param, message = BAD_CLASSIFY[case]
    r = http.post("/classify", json=body)
    assert r.status_code == status, (case, r.status_code, r.text[:300])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert re.search(message, error["message"]) and "\n" not in error["message"]


def test_labels_and_activations_follow_the_folders_config(tmp_path):
    """id2label names the labels (LABEL_i where it names none); a CrossEncoder config naming the identity as
    its activation makes relevance the logit; a multi-label problem scores each label with a sigmoid."""
    logits = np.array([[0.5, -1.0, 2.0]], np.float32)
    info = types.SimpleNamespace(config={"hf_config": {"id2label": {"0": "no", "2": "yes"},
                                                        "problem_type": "multi_label_classification"}})
    labels = _labels(info, tmp_path, 3)
    assert labels.names == ("no", "LABEL_1", "yes")
    np.testing.assert_allclose(labels.scores(logits), sigmoid(logits), atol=1e-6)
    identity = {"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}
    ce = _labels(types.SimpleNamespace(config={"hf_config": identity}), tmp_path, 1)
    assert ce.reranker and ce.names == ("LABEL_0",)
    np.testing.assert_allclose(ce.relevance(logits[:, :1]), logits[:, 0])
    plain = _labels(types.SimpleNamespace(config={"hf_config": {}}), tmp_path, 1)
    np.testing.assert_allclose(plain.relevance(logits[:, :1]), sigmoid(logits[:, 0]), atol=1e-6)
