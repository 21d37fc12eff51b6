"""Triton's generate extension on ``attnx serve``: ``POST /v2/models/{m}/generate`` and ``generate_stream``.

What Triton (with TensorRT-LLM or vLLM behind it) answers, for a with-past export:

- request: a JSON object with ``text_input`` and, at the top level or under ``parameters`` (both
  appear in the wild), ``max_tokens``, ``temperature`` (0 or absent: greedy), ``top_k``, ``top_p``,
  ``repetition_penalty``, ``stop`` / ``stop_words``, ``seed`` / ``random_seed``, ``ignore_eos``, and a
  placed variant's context inputs under ``context`` (``{name: one row}``);
- ``generate``: ``{"model_name", "model_version", "text_output", "finish_reason", "prompt_tokens",
  "completion_tokens"}``;
- ``generate_stream``: server-sent events, one ``data: {...}`` per piece of text (``text_output`` is the
  new piece), the last with ``finish_reason``; a failure mid-stream is an event ``{"error": "..."}``.

Errors are ``{"error": "..."}``: 400 bad parameters (a negative ``max_tokens``, ``top_p`` > 1, a prompt
longer than the model's positions...), 404 an unknown model, 503 a full queue or shutting down.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import numpy as np
from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse

from attnx.runtime.apis import kserve_tensors as proto
from attnx.runtime.apis.generation import (GenerationModel, ParamProblem, complete, number, pieces, sampling)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def parse_context(value: Any, model: GenerationModel) -> dict[str, np.ndarray] | None:
    """``{name: one row}`` -> arrays of the model's context inputs (checked again by the decoder)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ParamProblem("'context' must be an object {input name: value}", "context")
    specs = {s.name: s for s in model.decoder.context_inputs}
    out = {}
    for name, v in value.items():
        if name not in specs:
            raise ParamProblem(f"'context': unknown input {name!r}; the model takes {sorted(specs) or 'none'}",
                               "context")
        try:
            out[name] = np.asarray(v, dtype=specs[name].dtype)
        except (TypeError, ValueError):
            raise ParamProblem(f"'context': {name!r} is not a (nested) list of numbers", "context") from None
    return out


def _params(body: Mapping) -> dict:
    inner = body.get("parameters") or {}
    if not isinstance(inner, dict):
        raise ParamProblem("'parameters' must be an object", "parameters")
    return {**inner, **{k: v for k, v in body.items() if k != "parameters"}}


def add_generate_routes(app: FastAPI, service) -> None:
    """``service``: :class:`attnx.runtime.apis.completions.GenerationApi` (models, body limits, metrics)."""

    def error(e: proto.ProtocolError) -> Response:
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return Response(json.dumps({"error": e.message}), status_code=e.status, media_type="application/json",
                        headers=headers)

    async def parse(name: str, request: Request):
        model = service.model(name)
        body = await service.read_json(request)
        if not isinstance(body, dict):
            raise ParamProblem("the body must be a JSON object")
        fields = _params(body)
        text = fields.get("text_input")
        if isinstance(text, list) and len(text) == 1:  # a batch of one, as tritonclient sends a [1] tensor
            text = text[0]
        if not isinstance(text, str):
            raise ParamProblem("'text_input' must be a string", "text_input")
        ids = model.prompt_ids(text, "text_input")
        model.check_prompt(ids, "text_input")
        stop = fields.get("stop", fields.get("stop_words"))
        seed = number(fields, "seed", integer=True)
        seed = number(fields, "random_seed", integer=True) if seed is None else seed
        params = sampling(number(fields, "max_tokens", integer=True), number(fields, "temperature", 0.0),
                          number(fields, "top_p"), number(fields, "top_k", integer=True),
                          number(fields, "repetition_penalty"), stop or None, seed, bool(fields.get("ignore_eos")))
        return model, ids, params, parse_context(fields.get("context"), model)

    def answer(model: GenerationModel, **fields) -> dict:
        return {"model_name": model.name, "model_version": "1", **fields}

    @app.post("/v2/models/{name}/generate")
    @app.post("/v2/models/{name}/versions/{version}/generate")
    async def generate(name: str, request: Request, version: str | None = None):
        async def run():
            model, ids, params, context = await parse(name, request)
            done = await complete(model, ids, params, context, request)
            return Response(json.dumps(answer(model, text_output=done.text, finish_reason=done.finish_reason,
                                              prompt_tokens=done.prompt_tokens,
                                              completion_tokens=len(done.tokens))),
                            media_type="application/json")

        return await service.answer(name, run, error)

    @app.post("/v2/models/{name}/generate_stream")
    @app.post("/v2/models/{name}/versions/{version}/generate_stream")
    async def generate_stream(name: str, request: Request, version: str | None = None):
        async def run():
            model, ids, params, context = await parse(name, request)
            stream = pieces(model, ids, params, context)
            first = await service.first(stream)  # a refused request is a status code, not an event

            async def events():
                try:
                    piece = first
                    while piece is not None:
                        if piece.text or piece.finish_reason:
                            event = answer(model, text_output=piece.text)
                            if piece.finish_reason:
                                event["finish_reason"] = piece.finish_reason
                            yield f"data: {json.dumps(event)}\n\n"
                        piece = await anext(stream, None)
                except proto.ProtocolError as e:
                    yield f"data: {json.dumps({'error': e.message})}\n\n"
                finally:
                    await stream.aclose()

            return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

        return await service.answer(name, run, error)
