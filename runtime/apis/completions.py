"""OpenAI's completions on ``attnx serve``: ``POST /v1/completions`` and ``/v1/chat/completions``, streaming too.

For the unmodified ``openai`` client (:class:`~attnx.runtime.apis.requests.CompletionRequest`,
:class:`~attnx.runtime.apis.requests.ChatRequest`): ``prompt`` (strings or token ids) or ``messages`` and
``tools`` (rendered by the model's chat template as transformers renders it: :mod:`attnx.runtime.core.chat`),
OpenAI's sampling fields and defaults (``max_tokens`` 16 for completions, the model's positions for chat;
``temperature`` 1; 0 is greedy), ``n``, ``stop``, ``seed``, ``echo``, ``stream`` with
``stream_options.include_usage``; ``logprobs`` and presence/frequency penalties are refused, not ignored.
attnx's ``top_k``, ``repetition_penalty``, ``ignore_eos`` and ``context`` go in ``extra_body``. Streams are
server-sent events ending with ``data: [DONE]``; every choice joins the model's step-level batch on its own.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from starlette.responses import Response, StreamingResponse

from attnx.runtime.apis.generation import GenerationModel, check_choices, complete, pieces, sampling
from attnx.runtime.apis.registry import GENERATE
from attnx.runtime.apis.requests import ChatRequest, CompletionRequest, items, openapi_body, parse
from attnx.runtime.wire.envelope import Call
from attnx.runtime.wire.errors import OPENAI_SHAPE, ProtocolError
from attnx.runtime.wire.http import Serving, serving

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
router = APIRouter(tags=["OpenAI"])


@router.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
async def completions(request: Request):
    return await _serve(request, CompletionRequest)


@router.post("/v1/chat/completions", openapi_extra=openapi_body(ChatRequest))
async def chat_completions(request: Request):
    return await _serve(request, ChatRequest)


async def _serve(request: Request, kind: type) -> Response:
    s = serving(request)

    async def work(call: Call) -> Response:
        body = await s.envelope.body(request, call, lambda raw: parse(kind, raw, s.string_cap))
        model = call.named(s.registry.pick(body.model, GENERATE))
        return await _answer(s, request, model, body)

    return await s.envelope.http(request, OPENAI_SHAPE, work)


async def _answer(s: Serving, request: Request, model: GenerationModel, body) -> Response:
    chat, workers = isinstance(body, ChatRequest), s.envelope.workers
    if chat:
        messages = [m.model_dump(exclude_none=False) for m in body.messages]
        text = await model.render(s.chat, messages, body.tools, workers)
        prompts = [await model.prompt_ids(text, workers, "messages", special=False)]
        max_key = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens or body.max_tokens or model.decoder.max_positions or 4096
    else:
        prompts = [await model.prompt_ids(p, workers) for p in items(body.prompt)]
        max_key, max_tokens = "max_tokens", body.max_tokens or model.decoder.max_positions or 4096
    check_choices(model, body.n * len(prompts))
    base = sampling(body, max_tokens, names={"max_new_tokens": max_key})
    # each prompt's n choices together, in OpenAI's order; a seed gives choice j the seed + j
    choices = [(ids, base if body.seed is None or j == 0 else base.with_(seed=body.seed + j))
               for ids in prompts for j in range(body.n)]
    context = model.context(body.context)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model.name}
    echo = getattr(body, "echo", False)
    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return await _stream(model, choices, context, head, chat, echo, include_usage)
    done = await asyncio.gather(*(complete(model, ids, params, context, request) for ids, params in choices))
    out = []
    for i, ((ids, _), c) in enumerate(zip(choices, done)):
        text = (model.tokenizer.decode(ids) + c.text) if echo else c.text
        item = {"index": i, "finish_reason": c.finish_reason, "logprobs": None}
        item.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        out.append(item)
    usage = _usage(sum(len(ids) for ids in prompts), sum(len(c.tokens) for c in done))
    return Response(json.dumps({**head, "choices": out, "usage": usage}), media_type="application/json")


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _stream(model: GenerationModel, choices, context, head: dict, chat: bool, echo: bool,
                  include_usage: bool) -> Response:
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    merged = _merged(model, choices, context)
    first = await anext(merged)  # a refused request is a status code, not an event

    def chunk(i, text=None, reason=None, role=False):
        if chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            return {**head, "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}]}
        return {**head, "choices": [{"index": i, "text": text or "", "logprobs": None, "finish_reason": reason}]}

    async def events():
        counts = [0] * len(choices)
        try:
            for i, (ids, _) in enumerate(choices):
                if chat or echo:
                    yield _sse(chunk(i, role=True) if chat else chunk(i, model.tokenizer.decode(ids)))
            item = first
            while item is not None:
                i, piece = item
                counts[i] += piece.token is not None
                if piece.text:
                    yield _sse(chunk(i, piece.text))
                if piece.finish_reason:
                    yield _sse(chunk(i, "" if chat else None, piece.finish_reason))
                item = await anext(merged, None)
            if include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(sum(len(ids) for ids, _ in choices), sum(counts))})
            yield "data: [DONE]\n\n"
        except ProtocolError as e:
            status, body, _ = OPENAI_SHAPE.http(e)
            yield f"data: {body.decode()}\n\n"
        finally:
            await merged.aclose()

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


async def _merged(model: GenerationModel, choices, context) -> AsyncIterator[tuple[int, Any]]:
    """``(choice index, piece)`` of every choice as they come; a failure ends the stream with it."""
    if len(choices) == 1:
        async for piece in pieces(model, choices[0][0], choices[0][1], context):
            yield 0, piece
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for piece in stream:
                await queue.put((i, piece))
        except Exception as e:  # noqa: BLE001 - handed to the reader
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, pieces(model, ids, params, context))) for i, (ids, params) in
             enumerate(choices)]
    try:
        open_ = len(tasks)
        while open_:
            i, item = await queue.get()
            if item is None:
                open_ -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
