"""Hugging Face text-embeddings-inference's routes on ``attnx serve``, so TEI clients work unchanged.

``POST /embed`` (:class:`~attnx.runtime.apis.requests.EmbedRequest`) -> one row per input; ``/predict`` and
``/rerank`` (a ``/rerank`` body with ``documents`` is Cohere's): :mod:`attnx.runtime.apis.scoring`; ``POST /``: TEI's
route for its model's task, picked per request (:func:`_root`); ``GET /info``; ``GET /health`` (open without the API
key). As in TEI: ``normalize`` true, ``truncate`` true (``--auto-truncate``), ``dimensions`` cuts where allowed;
errors are ``{"error", "error_type"}`` with the TEI table of :mod:`attnx.runtime.wire.errors`. With several models
served, a request names one with ``"model"`` (an attnx extension, as is ``"context"``).
"""

from __future__ import annotations

import json

import numpy as np
import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from attnx.runtime.apis.requests import EmbedRequest, PredictRequest, RerankRequest, TeiRerankRequest, items, \
    openapi_body
from attnx.runtime.apis.scoring import check_direction, predict, rerank, run_body, tei_rerank
from attnx.runtime.serving.encoding import encode, full_size, unit_rows
from attnx.runtime.serving.model import EMBED, SCORE
from attnx.runtime.serving.state import Serving, serving
from attnx.runtime.wire.envelope import Call, error_response
from attnx.runtime.wire.errors import OPENAI_SHAPE, TEI, ProtocolError, bad_input, not_found

router = APIRouter(tags=["TEI"])


@router.get("/health")
async def health(request: Request):
    if serving(request).registry.ready:
        return Response(status_code=200)
    return Response(json.dumps({"error": "unhealthy", "error_type": "Unhealthy"}), status_code=503,
                    media_type="application/json")


def described(s: Serving):
    """The model TEI's ``/info`` describes: the server's embedding model, else its first text classifier."""
    models = s.registry.able(EMBED) or s.registry.able(SCORE)
    if not models:
        raise not_found("this server has no embedding model or text classifier")
    return models[0]


@router.get("/info")
async def info(request: Request):
    s = serving(request)
    try:
        return Response(json.dumps(info_fields(described(s), s)), media_type="application/json")
    except ProtocolError as e:
        return error_response(TEI, e)


@router.post("/embed", openapi_extra=openapi_body(EmbedRequest))
async def embed_route(request: Request) -> Response:
    return await run_body(request, lambda s, body: (EmbedRequest, embed, TEI))


@router.post("/predict", openapi_extra=openapi_body(PredictRequest))
async def predict_route(request: Request) -> Response:
    return await run_body(request, lambda s, body: (PredictRequest, predict, TEI))


@router.post("/rerank", openapi_extra=openapi_body(TeiRerankRequest))
async def rerank_route(request: Request) -> Response:
    def choose(s, body):  # Cohere's/Infinity's body (``documents``) on TEI's path: that API, its error shape
        if isinstance(body, dict) and "documents" in body and "texts" not in body:
            return RerankRequest, rerank, OPENAI_SHAPE
        return TeiRerankRequest, tei_rerank, TEI

    return await run_body(request, choose)


@router.post("/", openapi_extra=openapi_body(EmbedRequest))
async def root_route(request: Request) -> Response:
    return await run_body(request, _root)


def _root(s: Serving, body):
    """TEI answers ``POST /`` with its one model's own route (embed, predict or rerank). attnx may serve several:
    a rerank body (``query``, ``texts``) reranks; a body naming a classifier, or carrying ``parameters`` (the
    Hugging Face Inference API's text-classification request), or on a server with classifiers and no embedding
    model, predicts; the rest embeds."""
    if not isinstance(body, dict):
        return EmbedRequest, embed, TEI
    if "query" in body and "texts" in body:
        return TeiRerankRequest, tei_rerank, TEI
    model_name = body.get("model")
    named = s.registry.models.get(model_name) if isinstance(model_name, str) else None
    if named is not None:
        return (PredictRequest, predict, TEI) if SCORE in named.capabilities else (EmbedRequest, embed, TEI)
    if "parameters" in body or (not body.get("model") and not s.registry.able(EMBED) and s.registry.able(SCORE)):
        return PredictRequest, predict, TEI
    return EmbedRequest, embed, TEI


async def embed(s: Serving, call: Call, body: EmbedRequest) -> Response:
    """``POST /embed``: one row per input."""
    model = call.named(s.registry.resolve(body.model, EMBED))
    check_direction(model, body.truncation_direction)
    if body.prompt_name is not None:
        raise bad_input(f"model {model.name!r} has no prompts; 'prompt_name' must be null", "prompt_name")
    s.dimensions.size(model.name, full_size(model), body.dimensions)
    result = await encode(model, items(body.inputs), s.envelope.workers, truncate=body.truncate is not False,
                          context=body.context, param="inputs")
    vectors = s.dimensions.cut(model, result.values, body.dimensions)
    vectors = unit_rows(vectors) if body.normalize else vectors
    # orjson writes float32 arrays itself, with the shortest digits that read back to the same float32.
    payload = await s.envelope.workers.run(orjson.dumps, np.ascontiguousarray(vectors, dtype=np.float32),
                                           None, orjson.OPT_SERIALIZE_NUMPY, cost=vectors.nbytes)
    return Response(payload, media_type="application/json")


def info_fields(model, s: Serving) -> dict:
    """TEI's ``/info`` fields, filled with what attnx knows of the model and the server's limits."""
    info = model.session.info
    st = ((info.config or {}).get("sentence_transformers") or {}) if info is not None else {}
    labels = model.labels
    model_type = {"embedding": {"pooling": st.get("pooling", "unknown")}}
    if labels is not None:  # TEI's words: a reranker has one label, a classifier several
        id2label = {str(i): name for i, name in enumerate(labels.names)}
        model_type = {"reranker" if labels.reranker else "classifier": {
            "id2label": id2label, "label2id": {name: int(i) for i, name in id2label.items()}}}
    batching = model.batcher.config
    return {"model_id": model.name, "model_sha": None, "served_model_name": model.name, "model_type": model_type,
            "model_dtype": {"fp16": "float16", "int8": "int8"}.get(str(getattr(info, "precision", None)), "float32"),
            "max_concurrent_requests": batching.max_queue_size, "max_input_length": model.tokenizer.max_length,
            "max_batch_tokens": batching.max_batch_tokens or 0, "max_batch_requests": batching.max_batch_size,
            "max_client_batch_size": model.limits.max_texts, "auto_truncate": True, "tokenization_workers": 1,
            "version": s.version, "sha": None, "docker_label": None}
