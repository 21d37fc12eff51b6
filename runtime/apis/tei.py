"""Hugging Face text-embeddings-inference's routes on ``attnx serve``, so TEI clients work unchanged.

- ``POST /embed`` (and ``POST /``, TEI's route for its model's task, where ``huggingface_hub``'s
  ``InferenceClient(model="http://host:8000")`` posts): ``{"inputs", "normalize", "truncate",
  "truncation_direction", "prompt_name", "dimensions"}`` -> ``[[float, ...], ...]``, one row per input
  (a single string gives one row too).
- ``POST /predict`` (a sequence classifier; :mod:`attnx.runtime.apis.scoring`): ``{"inputs", "raw_scores",
  "truncate", "truncation_direction"}``, ``inputs`` a string, a pair ``[a, b]`` or a batch ``[[a], [a, b], ...]``
  -> ``[{"score", "label"}, ...]`` best first, labels from the export's ``id2label`` (a batch: one list per
  input). Scores are the softmax over the labels (sigmoid for one label), ``raw_scores`` the logits. A body
  with ``parameters`` is the Hugging Face Inference API's text-classification request (what
  ``InferenceClient.text_classification`` sends) and gets that API's answer, one list per input.
- ``POST /rerank`` (a reranker: one label): ``{"query", "texts", "raw_scores", "return_text", "truncate",
  "truncation_direction"}`` -> ``[{"index", "score", "text"?}, ...]`` best first, ``score`` the sigmoid of the
  (query, text) pair's logit. A body with ``documents`` instead of ``texts`` is Cohere's/Infinity's rerank
  (:mod:`attnx.runtime.apis.rerank`). A classifier with several labels is refused (TEI: "not a re-ranker").
- ``POST /``: TEI's route for its model's task; attnx picks it per request (:func:`_root_handler`).
- ``GET /info``: TEI's model description, for the server's embedding model (else its first classifier).
- ``GET /health``: 200 when every model is ready, else 503 (no API key needed, like the KServe health routes).

As in TEI: ``normalize`` defaults to true (unit length; false gives the model's own sentence embedding,
which all-MiniLM-L6-v2's pipeline already normalises), ``truncate`` to true (TEI's ``--auto-truncate``
default), ``dimensions`` cuts to the first ``k`` values (where ``attnx serve --dimensions`` allows it), and
errors are ``{"error", "error_type"}``: 413 for too many inputs (over ``--max-inputs``) or tokens, 422 for
invalid input, 400 for an empty batch, 429 when overloaded, 503 when shutting down. TEI serves one model;
with several embedding models served, a request names one with ``"model"`` (an attnx extension, as is
``"context"``, a placed variant's per-example inputs: see :mod:`attnx.runtime.apis.openai`).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np
import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response

import attnx
from attnx.runtime.apis import kserve_tensors as proto
from attnx.runtime.apis.embeddings import (
    EmbeddingApi,
    InputProblem,
    TooManyInputs,
    embed,
    embedding_models,
    encode_response,
    full_size,
    normalize,
    parse_context,
    parse_inputs,
)
from attnx.runtime.apis.openai import error_response as openai_error
from attnx.runtime.apis.rerank import rerank_request as cohere_rerank
from attnx.runtime.apis.scoring import (
    check_count,
    check_text,
    flag,
    labels_of,
    pick,
    ranking,
    score,
    scoring_models,
    sigmoid,
    softmax,
    top_n,
)

DIRECTIONS = {"right": "right", "Right": "right", "left": "left", "Left": "left"}


def error_response(e: proto.ProtocolError) -> Response:
    """A :class:`~attnx.runtime.apis.kserve_tensors.ProtocolError` in TEI's error shape and status."""
    if isinstance(e, (TooManyInputs, proto.TooLarge)):
        status, kind = 413, "Validation"  # TEI's "batch size error"
    elif isinstance(e, InputProblem) and e.code == "empty_input":
        status, kind = 400, "Empty"
    elif isinstance(e, proto.Overloaded):
        status, kind = (503, "Unhealthy") if e.reason == "shutting_down" else (429, "Overloaded")
    elif isinstance(e, proto.NotFound):
        status, kind = 404, "Validation"
    elif e.status >= 500:
        status, kind = e.status, "Backend"
    elif e.status == 400:
        status, kind = 422, "Validation"
    else:
        status, kind = e.status, "Validation"
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return Response(json.dumps({"error": e.message, "error_type": kind}), status_code=status,
                    media_type="application/json", headers=headers)


def add_tei_routes(app: FastAPI, api: EmbeddingApi) -> None:
    """``POST /embed``, ``/predict``, ``/rerank`` and ``/``; ``GET /info``, ``GET /health``."""

    @app.get("/health")
    async def health():
        if api.registry.ready:
            return Response(status_code=200)
        return Response(json.dumps({"error": "unhealthy", "error_type": "Unhealthy"}), status_code=503,
                        media_type="application/json")

    @app.get("/info")
    async def info():
        models = embedding_models(api.registry) or scoring_models(api.registry)
        if not models:
            return error_response(proto.NotFound("this server has no embedding model or text classifier"))
        return Response(json.dumps(info_fields(models[0], api)), media_type="application/json")

    def route(handler):
        async def run_route(request: Request) -> Response:
            async def run(call) -> Response:
                return await handler(api, call, await api.read_json(request))

            return await api.answer(run, error_response)

        return run_route

    async def shared(request: Request, pick_handler) -> Response:
        """A path two APIs share: the body says which one it is, and errors come in that API's shape."""
        shape = [error_response]

        async def run(call) -> Response:
            body = await api.read_json(request)
            handler, shape[0] = pick_handler(body)
            return await handler(api, call, body)

        return await api.answer(run, lambda e: shape[0](e))

    async def rerank_route(request: Request) -> Response:
        return await shared(request, _rerank_handler)

    async def root_request(api: EmbeddingApi, call, body: Any) -> Response:
        return await _root_handler(api, body)(api, call, body)

    app.post("/embed")(route(embed_request))
    app.post("/predict")(route(predict_request))
    app.post("/rerank")(rerank_route)
    app.post("/")(route(root_request))


def _rerank_handler(body: Any):
    """``/rerank``: TEI's (``texts``) or, with ``documents``, Cohere's/Infinity's (OpenAI error shape)."""
    if isinstance(body, dict) and "documents" in body and "texts" not in body:
        return cohere_rerank, openai_error
    return rerank_request, error_response


def _root_handler(api: EmbeddingApi, body: Any):
    """TEI answers ``POST /`` with its one model's own route (embed, predict or rerank). attnx may serve
    several: a rerank body (``query``, ``texts``) reranks; a body naming a classifier, or carrying
    ``parameters`` (the Hugging Face Inference API's text-classification request, what ``InferenceClient``'s
    ``text_classification`` sends), or on a server with classifiers and no embedding model, predicts; the
    rest embeds."""
    if not isinstance(body, dict):
        return embed_request
    if "query" in body and "texts" in body:
        return rerank_request
    name = body.get("model")
    model = api.registry.models.get(name) if isinstance(name, str) else None
    if model is not None:
        return predict_request if labels_of(model) is not None else embed_request
    if "parameters" in body or (name in (None, "") and not embedding_models(api.registry)
                                and scoring_models(api.registry)):
        return predict_request
    return embed_request


def _check_direction(model, body: dict) -> None:
    direction = body.get("truncation_direction") or model.tokenizer.truncation_side
    if DIRECTIONS.get(direction) != model.tokenizer.truncation_side:
        raise InputProblem(f"model {model.name!r} truncates on the {model.tokenizer.truncation_side} (its "
                           f"export says so); 'truncation_direction' {direction!r} is not available",
                           param="truncation_direction")


def _object_with(body: Any, *keys: str) -> dict:
    if not isinstance(body, dict):
        raise InputProblem("the body must be a JSON object", param=None)
    for key in keys:
        if key not in body:
            raise InputProblem(f"'{key}' is required", param=key)
    return body


async def embed_request(api: EmbeddingApi, call, body: Any) -> Response:
    """``POST /embed``, its body already read."""
    body = _object_with(body, "inputs")
    model = api.model(call, body.get("model"))
    flags = {k: body.get(k, d) for k, d in (("normalize", True), ("truncate", True))}
    flags["truncate"] = True if flags["truncate"] is None else flags["truncate"]
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise InputProblem(f"'{key}' must be a boolean", param=key)
    _check_direction(model, body)
    if body.get("prompt_name") is not None:
        raise InputProblem(f"model {model.name!r} has no prompts; 'prompt_name' must be null",
                           param="prompt_name")
    items = parse_inputs(body["inputs"], model.limits, param="inputs")
    requested, full = body.get("dimensions"), full_size(model)
    if full is not None:
        api.dimensions.size(model.name, full, requested)
    context = parse_context(body.get("context"), model)
    result = await embed(model, items, truncate=flags["truncate"], context=context, param="inputs")
    vectors = result.vectors[:, :api.dimensions.size(model.name, result.vectors.shape[1], requested)]
    if flags["normalize"]:
        vectors = normalize(vectors)
    encode = functools.partial(_encode, vectors)
    return Response(await encode_response(vectors.nbytes, encode), media_type="application/json")


async def predict_request(api: EmbeddingApi, call, body: Any) -> Response:
    """``POST /predict``: TEI's ``inputs`` (a string, a pair ``[a, b]``, or a batch ``[[a], [a, b], ...]``)
    -> ``[{"score", "label"}]`` per input, best first (a batch: one list per input). A body with
    ``parameters`` is the Hugging Face Inference API's text-classification request instead (``inputs``: a
    string or a list of strings; ``parameters.top_k``, ``parameters.function_to_apply``), answered in its
    shape, one list per input even for one string (what ``InferenceClient.text_classification`` reads)."""
    body = _object_with(body, "inputs")
    model, labels = pick(api.registry, body.get("model"), rerank=False)
    call.label = model.name
    truncate = flag(body, "truncate", True)
    _check_direction(model, body)
    hub = "parameters" in body
    if hub:
        items, single = hub_inputs(body["inputs"], model.limits), False
        params = body["parameters"] if body["parameters"] is not None else {}
        if not isinstance(params, dict):
            raise InputProblem("'parameters' must be an object", param="parameters")
        best, function = top_n(params, "top_k"), params.get("function_to_apply")
        if function not in (None, *FUNCTIONS):
            raise InputProblem(f"'function_to_apply' must be one of {list(FUNCTIONS)}, got {function!r}",
                               param="parameters")
    else:
        (items, single), best, function = predict_inputs(body["inputs"], model.limits), None, None
    raw = flag(body, "raw_scores", False)
    context = parse_context(body.get("context"), model)
    result = await score(model, items, truncate=truncate, context=context)
    scores = FUNCTIONS[function](result.logits) if function else labels.scores(result.logits, raw)
    answer = [predictions(row, labels.names)[:best] for row in scores]
    return Response(json.dumps(answer[0] if single else answer), media_type="application/json")


#: The Hugging Face Inference API's ``function_to_apply`` values.
FUNCTIONS = {"sigmoid": sigmoid, "softmax": softmax, "none": lambda x: x}


def predictions(row: np.ndarray, names) -> list[dict]:
    """One input's ``[{"score", "label"}]``, best first (equal scores in label order)."""
    return [{"score": float(row[i]), "label": names[i]} for i in ranking(row)]


def predict_inputs(value: Any, limits) -> tuple[list, bool]:
    """TEI's ``inputs``: (items, whether it was a single input). As TEI reads it, a list of strings is one
    input (one string, or a pair of two); a list of lists is a batch of such inputs."""
    shapes = "a string, a pair of strings [string, string] or a batch [[string], [string, string], ...]"
    if isinstance(value, str):
        return [check_text(value, "'inputs'", "inputs")], True
    if not isinstance(value, list):
        raise InputProblem(f"'inputs' must be {shapes}, got {type(value).__name__}", param="inputs")
    if not value:
        raise InputProblem("'inputs' is an empty list", param="inputs", code="empty_input")
    if not isinstance(value[0], list):
        return [_sequence(value, "'inputs'", shapes)], True
    check_count(len(value), limits, "inputs")
    return [_sequence(v, f"inputs[{i}]", shapes) for i, v in enumerate(value)], False


def _sequence(value: Any, where: str, shapes: str):
    if not isinstance(value, list) or len(value) not in (1, 2):
        raise InputProblem(f"{where} must be one string or a pair of two ('inputs' takes {shapes})", param="inputs")
    if len(value) == 1:
        return check_text(value[0], f"{where}[0]", "inputs")
    return tuple(check_text(v, f"{where}[{j}]", "inputs", allow_empty=True) for j, v in enumerate(value))


def hub_inputs(value: Any, limits) -> list:
    """The Inference API's ``inputs``: a string, ``{"text", "text_pair"}``, or a list of them."""
    items = value if isinstance(value, list) else [value]
    if not items:
        raise InputProblem("'inputs' is an empty list", param="inputs", code="empty_input")
    check_count(len(items), limits, "inputs")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, dict) and "text" in item:
            pair = item.get("text_pair")
            text = check_text(item["text"], f"inputs[{i}].text", "inputs", allow_empty=pair is not None)
            out.append(text if pair is None else (text, check_text(pair, f"inputs[{i}].text_pair", "inputs",
                                                                    allow_empty=True)))
        else:
            out.append(check_text(item, f"inputs[{i}]", "inputs"))
    return out


async def rerank_request(api: EmbeddingApi, call, body: Any) -> Response:
    """``POST /rerank`` (TEI's): ``query`` and ``texts`` -> ``[{"index", "score", "text"?}]``, best first."""
    body = _object_with(body, "query", "texts")
    texts = body["texts"]
    if not isinstance(texts, list):
        raise InputProblem(f"'texts' must be a list of strings, got {type(texts).__name__}", param="texts")
    if not texts:
        raise InputProblem("`texts` cannot be empty", param="texts", code="empty_input")
    model, labels = pick(api.registry, body.get("model"), rerank=True)
    call.label = model.name
    query = check_text(body["query"], "'query'", "query")
    check_count(len(texts), model.limits, "texts")
    texts = [check_text(t, f"texts[{i}]", "texts", allow_empty=True) for i, t in enumerate(texts)]
    raw, with_text = flag(body, "raw_scores", False), flag(body, "return_text", False)
    _check_direction(model, body)
    context = parse_context(body.get("context"), model)
    result = await score(model, [(query, t) for t in texts], truncate=flag(body, "truncate", True),
                         context=context, param="texts")
    scores = labels.relevance(result.logits, raw)
    ranks = [{"index": i, **({"text": texts[i]} if with_text else {}), "score": float(scores[i])}
             for i in ranking(scores)]
    return Response(json.dumps(ranks), media_type="application/json")


def _encode(vectors: np.ndarray) -> bytes:
    # orjson writes float32 arrays itself, with the shortest digits that read back to the same float32.
    return orjson.dumps(np.ascontiguousarray(vectors, dtype=np.float32), option=orjson.OPT_SERIALIZE_NUMPY)


def info_fields(model, api: EmbeddingApi) -> dict:
    """TEI's ``/info`` fields, filled with what attnx knows of the model and the server's limits."""
    info = model.session.info
    st = ((info.config or {}).get("sentence_transformers") or {}) if info is not None else {}
    labels = labels_of(model)
    model_type = {"embedding": {"pooling": st.get("pooling", "unknown")}}
    if labels is not None:  # TEI's words: a reranker has one label, a classifier several
        id2label = {str(i): name for i, name in enumerate(labels.names)}
        model_type = {"reranker" if labels.reranker else "classifier": {
            "id2label": id2label, "label2id": {name: int(i) for i, name in id2label.items()}}}
    batching = model.batcher.config
    return {
        "model_id": model.name,
        "model_sha": None,
        "model_dtype": {"fp16": "float16", "int8": "int8"}.get(getattr(info, "precision", None), "float32"),
        "served_model_name": model.name,
        "model_type": model_type,
        "max_concurrent_requests": batching.max_queue_size,
        "max_input_length": model.tokenizer.max_length,
        "max_batch_tokens": batching.max_batch_tokens or 0,
        "max_batch_requests": batching.max_batch_size,
        "max_client_batch_size": model.limits.max_texts,
        "auto_truncate": True,
        "tokenization_workers": 1,
        "version": getattr(attnx, "__version__", "0"),
        "sha": None,
        "docker_label": None,
    }
