"""Text classification on ``attnx serve`` in Infinity's shape: ``POST /classify``.

Infinity (``infinity_emb``) serves ``/classify`` beside its OpenAI embeddings; TEI has no such route (its
``/predict`` is in :mod:`attnx.runtime.apis.tei`). So a body with Infinity's ``input`` gets Infinity's answer,
and a body with TEI's ``inputs`` is answered as ``/predict`` (TEI's shape and errors), for clients that
guess the route.

Request: ``input`` (a non-empty string or list of strings), ``model`` (a served classifier's name; may be
left out when the server has one), ``raw_scores`` (default false: softmax over the labels, sigmoid for one
label or a multi-label problem, as transformers' pipeline; true: the logits). attnx extensions: ``truncate``
(default true) and ``context`` (a placed variant's per-example context inputs, one row per input).

Response: ``{"object": "classify", "data": [[{"score", "label"}, ...], ...], "model", "usage": {"prompt_tokens",
"total_tokens"}, "id", "created"}``, one list per input, best first, labels from the export's ``id2label``.
Errors are OpenAI's shape (Infinity's), with the statuses of :mod:`attnx.runtime.apis.openai`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from attnx.runtime.apis.embeddings import EmbeddingApi, InputProblem, parse_context
from attnx.runtime.apis.openai import error_response
from attnx.runtime.apis.scoring import check_count, check_text, flag, pick, score
from attnx.runtime.apis.tei import error_response as tei_error
from attnx.runtime.apis.tei import predict_request, predictions


async def classify_request(api: EmbeddingApi, call, body: Any) -> Response:
    """One Infinity-shaped classify request, its body already read."""
    if not isinstance(body, dict):
        raise InputProblem("the body must be a JSON object", param=None)
    if "input" not in body:
        raise InputProblem("'input' is required", param="input")
    model, labels = pick(api.registry, body.get("model"), rerank=False)
    call.label = model.name
    value = body["input"]
    items = value if isinstance(value, list) else [value]
    if not items:
        raise InputProblem("'input' is an empty list", param="input", code="empty_input")
    check_count(len(items), model.limits, "input")
    items = [check_text(t, f"input[{i}]", "input") for i, t in enumerate(items)]
    raw = flag(body, "raw_scores", False)
    context = parse_context(body.get("context"), model)
    result = await score(model, items, truncate=flag(body, "truncate", True), context=context, param="input")
    data = [predictions(row, labels.names) for row in labels.scores(result.logits, raw)]
    usage = {"prompt_tokens": result.tokens, "total_tokens": result.tokens}
    payload = {"object": "classify", "data": data, "model": model.name, "usage": usage,
               "id": f"classify-{uuid.uuid4().hex}", "created": int(time.time())}
    return Response(json.dumps(payload), media_type="application/json")


def add_classify_routes(app: FastAPI, api: EmbeddingApi) -> None:
    """``POST /classify``."""

    @app.post("/classify")
    async def classify(request: Request) -> Response:
        shape = [error_response]

        async def run(call) -> Response:
            body = await api.read_json(request)
            if isinstance(body, dict) and "inputs" in body and "input" not in body:
                shape[0] = tei_error
                return await predict_request(api, call, body)
            return await classify_request(api, call, body)

        return await api.answer(run, lambda e: shape[0](e))
