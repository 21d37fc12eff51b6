"""The OpenAI embeddings API on ``attnx serve``: ``POST /v1/embeddings`` (and ``/embeddings``), ``GET /v1/models``.

What the unmodified ``openai`` client and the OpenAI-compatible embedders of LangChain, LlamaIndex and most RAG
tools send (:class:`~attnx.runtime.apis.requests.EmbeddingRequest`): ``input`` (strings, or token ids in the
model's own vocabulary), ``model`` (may be left out when one model embeds), ``encoding_format`` (``float`` or
``base64``, little-endian float32, which the client asks for unless told otherwise), ``dimensions`` (Matryoshka
style, where ``attnx serve --dimensions`` allows it), ``user`` (ignored); attnx's ``truncate`` (default true, as
sentence-transformers cuts) and ``context`` (a placed variant's per-example inputs) go in ``extra_body``. Usage
counts the export's own tokens after truncation. ``/v1/models`` lists every served model (a text generator with its
context, ``max_model_len``, as vLLM lists it). Errors are OpenAI's
``{"error": {"message", "type", "param", "code"}}`` with the OpenAI table of :mod:`attnx.runtime.wire.errors`.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from attnx.runtime.apis.requests import EmbeddingRequest, items, openapi_body, parse
from attnx.runtime.serving.encoding import encode, full_size, unit_rows
from attnx.runtime.serving.model import EMBED
from attnx.runtime.serving.state import serving
from attnx.runtime.wire.envelope import error_response
from attnx.runtime.wire.errors import OPENAI_SHAPE, not_found

router = APIRouter(tags=["OpenAI"])


def card(name: str, created: int, model=None) -> dict:
    """A model's entry; a text generator's says its context (``max_model_len``, as vLLM's cards do)."""
    out = {"id": name, "object": "model", "created": created, "owned_by": "attnx"}
    decoder = getattr(model, "decoder", None)
    if decoder is not None:
        out["max_model_len"] = decoder.max_positions
    return out


@router.get("/v1/models")
async def list_models(request: Request):
    s = serving(request)
    cards = [card(name, s.started, model) for name, model in s.registry.models.items()]
    return Response(json.dumps({"object": "list", "data": cards}), media_type="application/json")


@router.get("/v1/models/{model_id}")
async def get_model(model_id: str, request: Request):
    s = serving(request)
    if model_id not in s.registry.models:
        return error_response(OPENAI_SHAPE, not_found(f"The model {model_id!r} does not exist on this server"))
    answer = card(model_id, s.started, s.registry.models[model_id])
    return Response(json.dumps(answer), media_type="application/json")


@router.post("/v1/embeddings", openapi_extra=openapi_body(EmbeddingRequest))
@router.post("/embeddings", openapi_extra=openapi_body(EmbeddingRequest), include_in_schema=False)
async def embeddings(request: Request):
    s = serving(request)

    async def work(call) -> Response:
        body = await s.envelope.body(request, call, lambda raw: parse(EmbeddingRequest, raw, s.string_cap),
                                     counts="texts")
        model = call.named(s.registry.resolve(body.model, EMBED))
        full = full_size(model)
        s.dimensions.size(model.name, full, body.dimensions)  # a bad size is refused before anything runs
        result = await encode(model, items(body.input), s.envelope.workers, truncate=body.truncate,
                              context=body.context)
        vectors = s.dimensions.cut(model, result.values, body.dimensions)
        if vectors.shape[1] != result.values.shape[1]:  # cut: renormalised, as OpenAI's shortened embeddings are
            vectors = unit_rows(vectors)
        payload = await s.envelope.workers.run(_encode, model.name, vectors, body.encoding_format or "float",
                                               result.tokens, cost=vectors.nbytes)
        return Response(payload, media_type="application/json")

    return await s.envelope.http(request, OPENAI_SHAPE, work)


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
