"""The OpenAI embeddings API on ``attnx serve``: ``POST /v1/embeddings`` and ``GET /v1/models``.

What the unmodified ``openai`` client (``OpenAI(base_url="http://host:8000/v1")``) and the OpenAI-compatible
embedders of LangChain, LlamaIndex and most RAG tools send. ``POST /embeddings`` is the same route (TEI
serves it too, for clients given a base URL without ``/v1``).

Request: ``input`` (a string, a list of strings, a list of token ids or a list of such lists; ids are the
model's own vocabulary, used as given), ``model`` (a served model's name; may be left out when the server
has one embedding model), ``encoding_format`` (``float``, the default, or ``base64``: little-endian float32,
which the ``openai`` client asks for unless told otherwise), ``dimensions`` (fewer dimensions, Matryoshka
style, where ``attnx serve --dimensions`` allows it), ``user`` (ignored). attnx extensions (``extra_body``
in the ``openai`` client): ``truncate`` (default true: inputs past the model's max length are cut, as
sentence-transformers cuts them; false refuses them) and ``context`` (a placed variant's per-example
context inputs, ``{name: one row per input}``).

Response: ``{"object": "list", "data": [{"object": "embedding", "index": i, "embedding": ...}], "model",
"usage": {"prompt_tokens", "total_tokens"}}``, tokens counted by the export's own tokenizer after truncation.

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 bad input (too many inputs
too), 401 a wrong or missing API key (:mod:`attnx.runtime.wire.auth`), 404 an unknown model, 413 a body over
``--max-body-mb`` or more tokens than ``--max-request-tokens``, 429 the queue or the decode budget is full
(with ``Retry-After``; the ``openai`` client retries it), 503 shutting down, 500 a bug.
"""

from __future__ import annotations

import base64
import functools
import json

import numpy as np
import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response

from attnx.runtime.apis import kserve_tensors as proto
from attnx.runtime.apis.embeddings import (
    EmbeddingApi,
    InputProblem,
    UnknownModel,
    cut,
    embed,
    embedding_models,
    encode_response,
    full_size,
    parse_context,
    parse_inputs,
    pick_model,
)

ENCODINGS = ("float", "base64")


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


def error_response(e: proto.ProtocolError) -> Response:
    """A :class:`~attnx.runtime.apis.kserve_tensors.ProtocolError` in OpenAI's error shape and status."""
    status, type_, code = e.status, "invalid_request_error", getattr(e, "code", None)
    if isinstance(e, proto.NotFound):
        code = "model_not_found"
    elif isinstance(e, proto.TooLarge):
        code = "request_too_large"
    elif isinstance(e, proto.Overloaded):
        # A full queue or decode budget is the client's cue to back off: 429, as OpenAI answers an
        # overloaded engine (its client retries 429 after Retry-After); shutting down stays 503.
        if e.reason == "shutting_down":
            type_, code = "service_unavailable_error", "shutting_down"
        else:
            status, type_, code = 429, "rate_limit_error", "server_is_overloaded"
    elif status >= 500:
        type_ = "server_error"
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return Response(error_body(e.message, type_, getattr(e, "param", None), code), status_code=status,
                    media_type="application/json", headers=headers)


def add_openai_routes(app: FastAPI, api: EmbeddingApi) -> None:
    """``POST /v1/embeddings`` (and ``/embeddings``), ``GET /v1/models``, ``GET /v1/models/{id}``."""

    def card(name: str) -> dict:
        return {"id": name, "object": "model", "created": api.started, "owned_by": "attnx"}

    @app.get("/v1/models")
    async def list_models():
        cards = [card(m.name) for m in embedding_models(api.registry)]
        cards += [card(name) for name in getattr(api, "generation_models", {})]  # text generation models
        return Response(json.dumps({"object": "list", "data": cards}), media_type="application/json")

    @app.get("/v1/models/{model_id}")
    async def get_model(model_id: str):
        if model_id in getattr(api, "generation_models", {}):
            return Response(json.dumps(card(model_id)), media_type="application/json")
        try:
            model = pick_model(api.registry, model_id)
        except (UnknownModel, InputProblem) as e:  # a model that does not embed is not listed either
            return error_response(UnknownModel(e.message))
        return Response(json.dumps(card(model.name)), media_type="application/json")

    async def create(request: Request) -> Response:
        async def run(call) -> Response:
            body = await api.read_json(request)
            if not isinstance(body, dict):
                raise InputProblem("the body must be a JSON object", param=None)
            if "input" not in body:
                raise InputProblem("'input' is required", param="input")
            model = api.model(call, body.get("model"))
            fmt = body.get("encoding_format") or "float"
            if fmt not in ENCODINGS:
                raise InputProblem(f"'encoding_format' must be one of {list(ENCODINGS)}, got {fmt!r}",
                                   param="encoding_format")
            truncate = body.get("truncate", True)
            if not isinstance(truncate, bool):
                raise InputProblem("'truncate' must be a boolean", param="truncate")
            items = parse_inputs(body["input"], model.limits)
            requested, full = body.get("dimensions"), full_size(model)
            if full is not None:  # refuse a bad size before running anything
                api.dimensions.size(model.name, full, requested)
            context = parse_context(body.get("context"), model)
            result = await embed(model, items, truncate=truncate, context=context)
            vectors = cut(result.vectors, api.dimensions.size(model.name, result.vectors.shape[1], requested))
            encode = functools.partial(_encode, model.name, vectors, fmt, result.tokens)
            return Response(await encode_response(vectors.nbytes, encode), media_type="application/json")

        return await api.answer(run, error_response)

    app.post("/v1/embeddings")(create)
    app.post("/embeddings")(create)


def _encode(model: str, vectors: np.ndarray, fmt: str, tokens: int) -> bytes:
    little = np.ascontiguousarray(vectors, dtype="<f4")
    if fmt == "base64":
        rows = [base64.b64encode(row.tobytes()).decode("ascii") for row in little]
    else:
        rows = list(little)  # orjson writes float32 arrays itself, shortest round-trip digits (27x json's speed)
    data = [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(rows)]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return orjson.dumps({"object": "list", "data": data, "model": model, "usage": usage},
                        option=orjson.OPT_SERIALIZE_NUMPY)
