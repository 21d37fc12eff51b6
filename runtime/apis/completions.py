"""OpenAI's completions on ``attnx serve``: ``POST /v1/completions`` and ``/v1/chat/completions``, streaming too.

What the unmodified ``openai`` client sends (``client.completions.create``, ``client.chat.completions.create``,
``stream=True``), for a with-past export:

- ``/v1/completions``: ``prompt`` (a string, a list of them, token ids or a list of such lists), ``max_tokens``
  (default 16), ``temperature`` (default 1: sampled; 0: greedy), ``top_p``, ``n``, ``stop``, ``seed``,
  ``echo``, ``stream`` and ``stream_options.include_usage``; ``logprobs``, ``presence_penalty`` and
  ``frequency_penalty`` other than off are refused (400), not ignored;
- ``/v1/chat/completions``: ``messages`` rendered by the model's chat template (its tokenizer folder's
  ``chat_template``; a model without one answers 400), ``max_tokens`` / ``max_completion_tokens``;
- attnx's extensions (``extra_body``): ``top_k``, ``repetition_penalty``, ``ignore_eos``, ``context`` (a
  placed variant's context inputs, ``{name: one row}``).

Streams are server-sent events of ``text_completion`` / ``chat.completion.chunk`` objects ending with
``data: [DONE]``. Every choice of every request joins the model's step-level batch on its own
(:mod:`attnx.runtime.core.scheduler`). Errors are OpenAI's shape (:func:`attnx.runtime.apis.openai.error_response`):
400 with ``param``, 404 unknown model, 429 queue full, 503 shutting down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse

from attnx.runtime.apis import kserve_tensors as proto
from attnx.runtime.apis.generate import SSE_HEADERS, parse_context
from attnx.runtime.apis.generation import (MAX_CHOICES, GenerationModel, ParamProblem, complete, number, pieces,
                                              render_chat, sampling)
from attnx.runtime.apis.openai import error_response
from attnx.runtime.core.session import public_message

log = logging.getLogger("attnx.serve")


class _Internal(proto.ProtocolError):
    status = 500
    reason = "internal"


class GenerationApi:
    """The served decoders, with the server's body limits and metrics (shared with the embedding routes)."""

    def __init__(self, models: dict[str, GenerationModel], embeddings):
        self.models = models
        self._embeddings = embeddings  # attnx.runtime.apis.embeddings.EmbeddingApi: read_json, metrics
        self.started = int(time.time())

    async def read_json(self, request: Request) -> Any:
        return await self._embeddings.read_json(request)

    def model(self, name: Any) -> GenerationModel:
        if name is None or name == "":
            if len(self.models) == 1:
                return next(iter(self.models.values()))
            raise ParamProblem(f"this server has several text generation models {sorted(self.models)}: name one in "
                               "'model'" if self.models else "this server has no text generation model", "model")
        if not isinstance(name, str):
            raise ParamProblem("'model' must be a string", "model")
        model = self.models.get(name)
        if model is None:
            raise proto.NotFound(f"The model {name!r} does not exist on this server or does not generate text; its "
                                 f"text generation models are {sorted(self.models)}")
        return model

    async def answer(self, label: str | Callable[[], str], run: Callable[[], Awaitable[Response]],
                     error: Callable[[proto.ProtocolError], Response]) -> Response:
        """Run one request with the server's metrics (``label``: the model's name, or a function giving it once
        the body named it); every failure becomes ``error(...)``, never a crash."""
        metrics = self._embeddings.metrics
        started = time.perf_counter()

        def name() -> str:
            found = label() if callable(label) else label
            return found if found in self.models else "_unknown_"  # bounded label cardinality

        try:
            response = await run()
        except proto.ProtocolError as e:
            metrics.failure(name(), e.reason)
            return error(e)
        except Exception as e:  # noqa: BLE001 - the server never dies on a request
            log.exception("internal error in a generation request")
            metrics.failure(name(), "internal")
            return error(_Internal(f"internal error: {type(e).__name__}: {public_message(str(e))}"))
        metrics.success(name(), time.perf_counter() - started)
        return response

    @staticmethod
    async def first(stream: AsyncIterator):
        """The first piece of a stream: a refused request raises here, before any event is sent."""
        return await anext(stream)


def _prompts(value: Any) -> list[Any]:
    if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(t, int) for t in value)):
        return [value]
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        return list(value)
    raise ParamProblem("'prompt' must be a string, a list of strings, token ids or a list of token-id lists",
                       "prompt")


def _unsupported(body: dict) -> None:
    for key in ("presence_penalty", "frequency_penalty"):
        if number(body, key, 0.0) != 0.0:
            raise ParamProblem(f"'{key}' is not supported (use 'repetition_penalty')", key)
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise ParamProblem("'logprobs' is not supported", "logprobs")
    if body.get("best_of") not in (None, 1):
        raise ParamProblem("'best_of' is not supported", "best_of")


def _requests(model: GenerationModel, body: dict, prompts: list[list[int]], max_key: str):
    """(prompt ids, params) per choice, in OpenAI's order: each prompt's ``n`` choices together."""
    n = number(body, "n", 1, integer=True)
    if n < 1 or n * len(prompts) > MAX_CHOICES:
        raise ParamProblem(f"'n' times the prompts must be 1..{MAX_CHOICES}, got {n * len(prompts)}", "n")
    seed = number(body, "seed", integer=True)
    base = sampling(number(body, max_key, integer=True), number(body, "temperature"), number(body, "top_p"),
                    number(body, "top_k", integer=True), number(body, "repetition_penalty"), body.get("stop"), seed,
                    bool(body.get("ignore_eos")), names={"max_new_tokens": max_key})
    out = []
    for ids in prompts:
        for j in range(n):
            out.append((ids, base if seed is None or j == 0 else base.with_(seed=seed + j)))
    return out


async def _merged(model: GenerationModel, choices, context) -> AsyncIterator[tuple[int, Any]]:
    """``(choice index, piece)`` of every choice as they come; a failure ends the stream with it."""
    if len(choices) == 1:
        async for piece in pieces(model, choices[0][0], choices[0][1], context):
            yield 0, piece
        return
    queue: asyncio.Queue = asyncio.Queue()
    streams = [pieces(model, ids, params, context) for ids, params in choices]

    async def pump(i, stream):
        try:
            async for piece in stream:
                await queue.put((i, piece))
        except Exception as e:  # noqa: BLE001 - handed to the reader
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
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


def add_completion_routes(app: FastAPI, service: GenerationApi) -> None:
    async def body_of(request: Request) -> dict:
        body = await service.read_json(request)
        if not isinstance(body, dict):
            raise ParamProblem("the body must be a JSON object")
        _unsupported(body)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ParamProblem("'stream' must be a boolean", "stream")
        return body

    def usage(prompt: int, completion: int) -> dict:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    async def serve(request: Request, chat: bool) -> Response:
        label = "_unknown_"

        async def run() -> Response:
            nonlocal label
            body = await body_of(request)
            model = service.model(body.get("model"))
            label = model.name
            if chat:
                text = render_chat(model, body.get("messages"), body.get("tools"))
                prompts = [model.prompt_ids(text, "messages", special=False)]
                max_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
            else:
                prompts = [model.prompt_ids(p) for p in _prompts(body.get("prompt"))]
                max_key = "max_tokens"
            for ids in prompts:
                model.check_prompt(ids, "messages" if chat else "prompt")
            choices = _requests(model, body, prompts, max_key)
            context = parse_context(body.get("context"), model)
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            created, kind = int(time.time()), "chat.completion" if chat else "text_completion"
            echo = bool(body.get("echo")) and not chat
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                return await stream(model, choices, context, rid, created, chat, echo, include_usage)
            done = await asyncio.gather(*(complete(model, ids, params, context, request) for ids, params in choices))
            out = []
            for i, ((ids, _), c) in enumerate(zip(choices, done)):
                text = (model.tokenizer.decode(ids) + c.text) if echo else c.text
                item = {"index": i, "finish_reason": c.finish_reason}
                if chat:
                    item["message"] = {"role": "assistant", "content": text}
                    item["logprobs"] = None
                else:
                    item.update(text=text, logprobs=None)
                out.append(item)
            prompt_tokens = sum(len(ids) for ids in prompts)
            body_out = {"id": rid, "object": kind, "created": created, "model": model.name, "choices": out,
                        "usage": usage(prompt_tokens, sum(len(c.tokens) for c in done))}
            return Response(json.dumps(body_out), media_type="application/json")

        return await service.answer(lambda: label, run, error_response)

    async def stream(model, choices, context, rid, created, chat, echo, include_usage) -> Response:
        kind = "chat.completion.chunk" if chat else "text_completion"
        merged = _merged(model, choices, context)
        first = await service.first(merged)  # a refused request is a status code, not an event

        def chunk(i, text=None, reason=None, role=False):
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": i, "text": text or "", "logprobs": None, "finish_reason": reason}
            return {"id": rid, "object": kind, "created": created, "model": model.name, "choices": [choice]}

        async def events():
            counts = [0] * len(choices)
            try:
                for i, (ids, _) in enumerate(choices):
                    if chat:
                        yield sse(chunk(i, role=True))
                    elif echo:
                        yield sse(chunk(i, model.tokenizer.decode(ids)))
                item = first
                while item is not None:
                    i, piece = item
                    counts[i] += piece.token is not None
                    if piece.text or piece.finish_reason:
                        if piece.text:
                            yield sse(chunk(i, piece.text))
                        if piece.finish_reason:
                            yield sse(chunk(i, "" if chat else None, piece.finish_reason))
                    item = await anext(merged, None)
                if include_usage:
                    prompt = sum(len(ids) for ids, _ in choices)
                    yield sse({"id": rid, "object": kind, "created": created, "model": model.name, "choices": [],
                               "usage": usage(prompt, sum(counts))})
                yield "data: [DONE]\n\n"
            except proto.ProtocolError as e:
                yield sse({"error": {"message": e.message, "type": "server_error" if e.status >= 500 else
                                     "invalid_request_error", "param": getattr(e, "param", None), "code": None}})
            finally:
                await merged.aclose()

        return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)
