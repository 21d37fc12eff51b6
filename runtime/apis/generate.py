"""Triton's generate extension on ``attnx serve``: ``POST /v2/models/{m}/generate`` and ``generate_stream``.

As Triton (TensorRT-LLM, vLLM behind it) answers (:class:`~attnx.runtime.apis.requests.GenerateRequest`: fields at
the top level or under ``parameters``; ``temperature`` 0 greedy by default): ``{"model_name", "model_version",
"text_output", "finish_reason", "prompt_tokens", "completion_tokens"}``, or server-sent events, one per piece of
text (the last with ``finish_reason``; a failure mid-stream is an event ``{"error": "..."}``).
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from starlette.responses import Response, StreamingResponse

from attnx.runtime.apis.completions import SSE_HEADERS
from attnx.runtime.apis.requests import GenerateRequest, openapi_body, parse
from attnx.runtime.core.generate import Piece
from attnx.runtime.serving.generation import GenerationModel, check_choices, check_max_tokens, complete, pieces, \
    sampling
from attnx.runtime.serving.model import GENERATE
from attnx.runtime.serving.state import Serving, serving
from attnx.runtime.wire.envelope import Call
from attnx.runtime.wire.errors import KSERVE, ProtocolError, bad_input

router = APIRouter(tags=["Triton generate"])


async def _parse(s: Serving, call: Call, request: Request, name: str, version: str | None):
    model = call.named(s.registry.resolve(name, GENERATE, version, path=True))
    body = await s.envelope.body(request, call, lambda raw: parse(GenerateRequest, raw, s.string_cap),
                                 counts="prompts")
    text = body.text_input
    if isinstance(text, list):  # a batch of one, as tritonclient sends a [1] tensor
        if len(text) != 1:
            raise bad_input(f"'text_input' must be one string, got {len(text)}", "text_input")
        text = text[0]
    ids = await model.prompt_ids(text, s.envelope.workers, "text_input")
    check_max_tokens(model, len(ids), body, "max_tokens")
    check_choices(model, 1)
    return model, ids, sampling(body, model.new_tokens(body.max_tokens or 16)), model.context(body.context)


def _answer(model: GenerationModel, **fields) -> dict:
    return {"model_name": model.name, "model_version": model.version, **fields}


@router.post("/v2/models/{name}/generate", openapi_extra=openapi_body(GenerateRequest))
@router.post("/v2/models/{name}/versions/{version}/generate", openapi_extra=openapi_body(GenerateRequest))
async def generate(name: str, request: Request, version: str | None = None):
    s = serving(request)

    async def work(call: Call) -> Response:
        model, ids, params, context = await _parse(s, call, request, name, version)
        done = await complete(model, ids, params, context, request)
        return Response(json.dumps(_answer(model, text_output=done.text, finish_reason=done.finish_reason,
                                           prompt_tokens=done.prompt_tokens, completion_tokens=len(done.tokens))),
                        media_type="application/json")

    return await s.envelope.http(request, KSERVE, work)


@router.post("/v2/models/{name}/generate_stream", openapi_extra=openapi_body(GenerateRequest))
@router.post("/v2/models/{name}/versions/{version}/generate_stream", openapi_extra=openapi_body(GenerateRequest))
async def generate_stream(name: str, request: Request, version: str | None = None):
    s = serving(request)

    async def work(call: Call) -> Response:
        model, ids, params, context = await _parse(s, call, request, name, version)
        stream = pieces(model, ids, params, context)
        first = await anext(stream)  # a refused request is a status code, not an event

        async def events():
            try:
                piece: Piece | None = first
                while piece is not None:
                    if piece.text or piece.finish_reason:
                        event = _answer(model, text_output=piece.text)
                        if piece.finish_reason:
                            event["finish_reason"] = piece.finish_reason
                        yield f"data: {json.dumps(event)}\n\n"
                    piece = await anext(stream, None)
            except ProtocolError as e:
                yield f"data: {json.dumps({'error': e.message})}\n\n"
            finally:
                await stream.aclose()

        return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

    return await s.envelope.http(request, KSERVE, work)
