"""Reranking on ``attnx serve`` in the shape Cohere, Jina and Infinity clients send: ``POST /v1/rerank``.

``POST /v2/rerank`` (Cohere's v2 client, ``cohere.ClientV2(base_url=...)``) is the same route, and so is
``POST /rerank`` for a body with ``documents`` (Infinity's path; with TEI's ``texts`` it is TEI's rerank,
:mod:`attnx.runtime.apis.tei`). What LangChain's ``CohereRerank``/``JinaRerank``, LlamaIndex's rerankers and
most RAG tools send, given a base URL.

Request: ``query`` (a non-empty string), ``documents`` (strings, or objects with a ``text`` string, as
Cohere v1 and Jina take them; an empty document scores like any other), ``model`` (a served reranker's
name; may be left out when the server has one), ``top_n`` (the best ``n``; absent: all), ``return_documents``
(default false, as Cohere and Infinity; true adds each ``document`` as ``{"text": ...}``, Cohere's and Jina's
form). attnx extensions: ``raw_scores`` (Infinity's: the logit instead of its sigmoid), ``truncate`` (default
true: a (query, document) pair past the model's max length loses tokens from its longer text first, as
sentence-transformers' CrossEncoder; false refuses it) and ``context`` (a placed variant's per-example context
inputs, one row per document). Other fields (``max_tokens_per_doc``, ``rank_fields``, ``max_chunks_per_doc``)
are ignored: each pair is cut to the model's own max length.

Response: ``{"id", "results": [{"index", "relevance_score", "document"?}], "model", "usage": {"prompt_tokens",
"total_tokens"}}``, results best first (equal scores in request order); ``relevance_score`` is
CrossEncoder's: the sigmoid of the model's one logit (:mod:`attnx.runtime.apis.scoring`). A classifier with
several labels is not a reranker: 400, pointing at ``/predict`` and ``/classify``.

Errors are OpenAI's shape (as vLLM and Infinity answer their rerank routes): 400 bad input, too many
documents (over ``--max-inputs``) included, 401 without the API key, 404 an unknown model, 413 more tokens
than ``--max-request-tokens``, 429 overloaded (``Retry-After``), 503 shutting down.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from attnx.runtime.apis.embeddings import EmbeddingApi, InputProblem, parse_context
from attnx.runtime.apis.openai import error_response
from attnx.runtime.apis.scoring import check_count, check_text, flag, pick, ranking, score, top_n


def documents(value: Any, limits) -> list[str]:
    """``documents``: strings, or objects with a ``text`` string."""
    if not isinstance(value, list):
        raise InputProblem(f"'documents' must be a list of strings (or of objects with a 'text' string), got "
                           f"{type(value).__name__}", param="documents")
    if not value:
        raise InputProblem("'documents' is an empty list: send at least one document", param="documents",
                           code="empty_input")
    check_count(len(value), limits, "documents")
    out = []
    for i, doc in enumerate(value):
        if isinstance(doc, dict):
            if "text" not in doc:
                raise InputProblem(f"documents[{i}] is an object without a 'text' field", param="documents")
            doc = doc["text"]
        out.append(check_text(doc, f"documents[{i}]", "documents", allow_empty=True))
    return out


async def rerank_request(api: EmbeddingApi, call, body: Any) -> Response:
    """One Cohere/Jina-shaped rerank request, its body already read."""
    if not isinstance(body, dict):
        raise InputProblem("the body must be a JSON object", param=None)
    for key in ("query", "documents"):
        if key not in body:
            raise InputProblem(f"'{key}' is required", param=key)
    model, labels = pick(api.registry, body.get("model"), rerank=True)
    call.label = model.name
    query = check_text(body["query"], "'query'", "query")
    docs = documents(body["documents"], model.limits)
    best = top_n(body, "top_n")
    with_docs, raw = flag(body, "return_documents", False), flag(body, "raw_scores", False)
    context = parse_context(body.get("context"), model)
    result = await score(model, [(query, d) for d in docs], truncate=flag(body, "truncate", True),
                         context=context, param="documents")
    scores = labels.relevance(result.logits, raw)
    results = []
    for i in ranking(scores)[:best]:
        item = {"index": i, "relevance_score": float(scores[i])}
        if with_docs:
            item["document"] = {"text": docs[i]}
        results.append(item)
    usage = {"prompt_tokens": result.tokens, "total_tokens": result.tokens}
    payload = {"id": f"rerank-{uuid.uuid4().hex}", "results": results, "model": model.name, "usage": usage}
    return Response(json.dumps(payload), media_type="application/json")


def add_rerank_routes(app: FastAPI, api: EmbeddingApi) -> None:
    """``POST /v1/rerank`` and ``POST /v2/rerank`` (``/rerank`` is registered by TEI's routes, which
    hand Cohere-shaped bodies here)."""

    async def route(request: Request) -> Response:
        async def run(call) -> Response:
            return await rerank_request(api, call, await api.read_json(request))

        return await api.answer(run, error_response)

    app.post("/v1/rerank")(route)
    app.post("/v2/rerank")(route)
