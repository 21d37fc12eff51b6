"""Scores from sequence classifiers (cross-encoders, sentiment classifiers): every API that reranks or classifies.

``/v1/rerank`` and ``/v2/rerank`` (Cohere's, Jina's; also Infinity's ``/rerank`` with ``documents``), ``/classify``
(Infinity's; a body with TEI's ``inputs`` is answered as ``/predict``), and TEI's ``/predict`` (:func:`predict`,
the Inference API's text classification with ``parameters``) and ``/rerank`` (:func:`tei_rerank`). Labels and
activations: :mod:`attnx.runtime.core.labels`. attnx extensions: ``truncate`` (default true: a pair loses tokens
from its longer text first, as CrossEncoder cuts it) and ``context``.
"""

from __future__ import annotations

import json
import time
import uuid

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import Response

from attnx.runtime.apis.requests import ClassifyRequest, PredictRequest, RerankRequest, TeiRerankRequest, \
    openapi_body, parse, predict_items
from attnx.runtime.core.labels import sigmoid, softmax
from attnx.runtime.serving.encoder import LOGITS
from attnx.runtime.serving.encoding import encode
from attnx.runtime.serving.model import RERANK, SCORE
from attnx.runtime.serving.state import Serving, serving
from attnx.runtime.wire.envelope import Call, error_response
from attnx.runtime.wire.errors import OPENAI_SHAPE, TEI, ProtocolError, bad_input
from attnx.runtime.wire.limits import cut_long_strings

router = APIRouter(tags=["Rerank and classify"])
#: The Hugging Face Inference API's ``function_to_apply`` values.
FUNCTIONS = {"sigmoid": sigmoid, "softmax": softmax, "none": lambda x: x}


def ranking(scores: np.ndarray) -> list[int]:
    """Indices by descending score; equal scores keep their request order."""
    return [int(i) for i in np.argsort(-scores, kind="stable")]


def predictions(row: np.ndarray, names) -> list[dict]:
    """One input's ``[{"score", "label"}]``, best first (equal scores in label order)."""
    return [{"score": float(row[i]), "label": names[i]} for i in ranking(row)]


def check_direction(model, direction: str | None) -> None:
    """TEI's ``truncation_direction``: the export truncates on one side only."""
    if direction is not None and direction.lower() != model.tokenizer.truncation_side:
        raise bad_input(f"model {model.name!r} truncates on the {model.tokenizer.truncation_side} (its export says "
                        f"so); 'truncation_direction' {direction!r} is not available", "truncation_direction")


async def run_body(request: Request, choose) -> Response:
    """A route whose body says which API it is: ``choose(serving, body)`` gives ``(request model, handler,
    shape)``; errors come in that API's shape (TEI's until the body has been read)."""
    s, shape = serving(request), [TEI]

    async def work(call: Call) -> Response:
        body = await s.envelope.body(request, call, lambda raw: _json(cut_long_strings(raw, s.string_cap)),
                                     counts="texts")
        model, handler, shape[0] = choose(s, body)
        return await handler(s, call, parse(model, body))

    try:
        return await s.envelope.run(Call(), work)
    except ProtocolError as e:
        return error_response(shape[0], e)


def _json(raw: bytes):
    from pydantic_core import from_json

    try:
        return from_json(raw)
    except ValueError as e:
        raise bad_input(f"the body is not valid JSON ({e})") from None


# --- Cohere/Jina rerank, Infinity classify -----------------------------------------------------------------

@router.post("/v1/rerank", openapi_extra=openapi_body(RerankRequest))
@router.post("/v2/rerank", openapi_extra=openapi_body(RerankRequest))
async def rerank_route(request: Request) -> Response:
    return await run_body(request, lambda s, body: (RerankRequest, rerank, OPENAI_SHAPE))


async def rerank(s: Serving, call: Call, body: RerankRequest) -> Response:
    """Cohere's/Jina's rerank: documents by relevance to the query, best first."""
    model = call.named(s.registry.resolve(body.model, RERANK))
    docs = [d["text"] if isinstance(d, dict) else d for d in body.documents]
    result = await encode(model, [(body.query, d) for d in docs], s.envelope.workers, output=LOGITS,
                          truncate=body.truncate, context=body.context, param="documents")
    scores = model.labels.relevance(result.values, body.raw_scores)
    results = [{"index": i, "relevance_score": float(scores[i]), **({"document": {"text": docs[i]}}
                                                                   if body.return_documents else {})}
               for i in ranking(scores)[:body.top_n]]
    usage = {"prompt_tokens": result.tokens, "total_tokens": result.tokens}
    return _json_response({"id": f"rerank-{uuid.uuid4().hex}", "results": results, "model": model.name,
                           "usage": usage})


@router.post("/classify", openapi_extra=openapi_body(ClassifyRequest))
async def classify_route(request: Request) -> Response:
    def choose(s, body):  # TEI's ``inputs`` (and not Infinity's ``input``): answered as /predict
        if isinstance(body, dict) and "inputs" in body and "input" not in body:
            return PredictRequest, predict, TEI
        return ClassifyRequest, classify, OPENAI_SHAPE

    return await run_body(request, choose)


async def classify(s: Serving, call: Call, body: ClassifyRequest) -> Response:
    """Infinity's classify: each input's labels, best first."""
    model = call.named(s.registry.resolve(body.model, SCORE))
    result = await encode(model, body.input, s.envelope.workers, output=LOGITS, truncate=body.truncate,
                          context=body.context, param="input")
    data = [predictions(row, model.labels.names) for row in model.labels.scores(result.values, body.raw_scores)]
    usage = {"prompt_tokens": result.tokens, "total_tokens": result.tokens}
    return _json_response({"object": "classify", "data": data, "model": model.name, "usage": usage,
                           "id": f"classify-{uuid.uuid4().hex}", "created": int(time.time())})


# --- TEI's predict and rerank (routes in attnx.runtime.apis.tei) -----------------------------------------------

async def predict(s: Serving, call: Call, body: PredictRequest) -> Response:
    """TEI's ``/predict`` (or, with ``parameters``, the Inference API's text classification: one list per input,
    even for one string, what ``InferenceClient.text_classification`` reads)."""
    model = call.named(s.registry.resolve(body.model, SCORE))
    check_direction(model, body.truncation_direction)
    items, single = predict_items(body.inputs, hub=body.parameters is not None)
    result = await encode(model, items, s.envelope.workers, output=LOGITS, truncate=body.truncate is not False,
                          context=body.context, param="inputs")
    hub = body.parameters
    if hub is not None and hub.function_to_apply:
        scores = FUNCTIONS[hub.function_to_apply](result.values)
    else:
        scores = model.labels.scores(result.values, body.raw_scores)
    answer = [predictions(row, model.labels.names)[:hub.top_k if hub else None] for row in scores]
    return _json_response(answer[0] if single else answer)


async def tei_rerank(s: Serving, call: Call, body: TeiRerankRequest) -> Response:
    """TEI's ``/rerank``: ``[{"index", "score", "text"?}]``, best first."""
    model = call.named(s.registry.resolve(body.model, RERANK))
    check_direction(model, body.truncation_direction)
    result = await encode(model, [(body.query, t) for t in body.texts], s.envelope.workers, output=LOGITS,
                          truncate=body.truncate is not False, context=body.context, param="texts")
    scores = model.labels.relevance(result.values, body.raw_scores)
    return _json_response([{"index": i, **({"text": body.texts[i]} if body.return_text else {}),
                            "score": float(scores[i])} for i in ranking(scores)])


def _json_response(value) -> Response:
    return Response(json.dumps(value), media_type="application/json")
