"""OpenAI's completions on ``attnx serve``: ``POST /v1/completions`` and ``/v1/chat/completions``, streaming too.

For the unmodified ``openai`` client (:class:`~attnx.runtime.apis.requests.CompletionRequest`,
:class:`~attnx.runtime.apis.requests.ChatRequest`): ``prompt`` (strings or token ids) or ``messages`` and
``tools`` (rendered by the model's chat template as transformers renders it: :mod:`attnx.runtime.core.chat`),
OpenAI's sampling fields and defaults (``max_tokens`` 16 for completions, the model's positions for chat;
``temperature`` 1; 0 is greedy), ``n``, ``stop``, ``seed``, ``echo``, ``stream`` with
``stream_options.include_usage``, ``presence_penalty`` / ``frequency_penalty``, ``logprobs`` (completions: the
number of alternatives; chat: ``logprobs`` + ``top_logprobs``; the model's own log-softmax, before penalties and
temperature, as vLLM reports by default), ``response_format`` (``json_object``, ``json_schema``: constrained
decoding, :mod:`attnx.runtime.core.guided`), ``tools`` with ``tool_choice`` (calls read back in the template's form,
:mod:`attnx.runtime.core.tools`; ``required`` or a named function: the call's grammar). ``max_tokens`` past the
positions left after the prompt is a 400, as vLLM answers. attnx's ``top_k``, ``repetition_penalty``,
``ignore_eos`` and ``context`` go in ``extra_body``. ``logit_bias`` is added to the logits before the penalties and
the choice (OpenAI's definition); ``functions`` / ``function_call`` (the legacy form) are ``tools`` / ``tool_choice``
answered as ``message.function_call``; ``parallel_tool_calls`` false keeps the first call; ``user`` and
``safety_identifier`` are logged with the request id (what OpenAI keeps them for); the fields attnx cannot honour
are a 400 naming them (:data:`~attnx.runtime.apis.requests.REFUSED`). ``attnx serve --max-new-tokens`` is the
default ``max_tokens`` and clamps larger ones. The prompt's logprobs, OpenAI's legacy ``echo`` + ``logprobs``
(``max_tokens`` 0: the prompt alone) and vLLM's ``prompt_logprobs``, come from a chunked prefill
(:mod:`attnx.runtime.apis.prompt_logprobs`). Streams are server-sent events ending with ``data: [DONE]``;
every choice joins the model's step-level batch on its own.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from typing import Any, AsyncGenerator

from fastapi import APIRouter, Request
from starlette.responses import Response, StreamingResponse

from attnx.runtime.apis import prompt_logprobs
from attnx.runtime.apis.requests import ChatRequest, CompletionRequest, items, openapi_body, parse
from attnx.runtime.serving.generation import (Completion, GenerationModel, check_choices, check_max_tokens, complete,
                                              pieces, response_grammar, sampling)
from attnx.runtime.serving.model import GENERATE
from attnx.runtime.serving.state import Serving, serving
from attnx.runtime.wire.envelope import Call
from attnx.runtime.core import tools
from attnx.runtime.wire.errors import OPENAI_SHAPE, ProtocolError, bad_input

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
router = APIRouter(tags=["OpenAI"])
log = logging.getLogger("attnx.serve")


@router.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
async def completions(request: Request):
    return await _serve(request, CompletionRequest)


@router.post("/v1/chat/completions", openapi_extra=openapi_body(ChatRequest))
async def chat_completions(request: Request):
    return await _serve(request, ChatRequest)


async def _serve(request: Request, kind: type) -> Response:
    s = serving(request)

    async def work(call: Call) -> Response:
        body = await s.envelope.body(request, call, lambda raw: parse(kind, raw, s.string_cap),
                                     counts="chat" if kind is ChatRequest else "prompts")
        model = call.named(s.registry.resolve(body.model, GENERATE))
        if kind is ChatRequest:  # counted before anything is rendered or tokenised
            s.limits.check_messages(len(body.messages))
        else:
            check_choices(model, body.n * len(items(body.prompt)))
        return await _answer(s, request, model, body)

    return await s.envelope.http(request, OPENAI_SHAPE, work)


async def _answer(s: Serving, request: Request, model: GenerationModel, body) -> Response:
    chat, workers, form, grammar = isinstance(body, ChatRequest), s.envelope.workers, None, response_grammar(body)
    if chat:
        messages, tool_list = [m.model_dump(exclude_none=False) for m in body.messages], body.tool_dicts()
        if tool_list:
            form, grammar = _tool_form(model, body, tool_list, grammar)
        text = await model.render(s.chat, messages, tool_list, workers)
        prompts = [await model.prompt_ids(text, workers, "messages", special=False)]
        max_key = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens or body.max_tokens
        top = (body.top_logprobs or 0) if body.logprobs else None
    else:
        prompts = [await model.prompt_ids(p, workers) for p in items(body.prompt)]
        max_key, max_tokens, top = "max_tokens", body.max_tokens, body.logprobs
    check_max_tokens(model, max(map(len, prompts)), body, max_key)
    check_choices(model, body.n * len(prompts))
    model.check_logit_bias(body.logit_bias)
    echo, (echoed, asked, scoring_key) = getattr(body, "echo", False), prompt_logprobs.asked(body)
    scoring = None if echoed is None and asked is None else max(echoed or 0, asked or 0)
    generate = max_tokens != 0  # completions' 0: the prompt alone, echoed
    if not generate and not echo:
        raise bad_input("'max_tokens' 0 generates nothing: it needs 'echo': true (the prompt alone)", "max_tokens")
    if scoring is not None and body.stream:
        raise bad_input(f"'{scoring_key}': the prompt's logprobs cannot be streamed", "stream")
    if scoring is not None:
        prompt_logprobs.check(model, scoring_key)
    base = sampling(body, model.new_tokens(max_tokens), names={"max_new_tokens": max_key}, logprobs=top) \
        if generate else None
    # each prompt's n choices together, in OpenAI's order; a seed gives choice j the seed + j
    choices = [(ids, base if base is None or body.seed is None or j == 0 else base.with_(seed=body.seed + j))
               for ids in prompts for j in range(body.n)]
    guides = await model.guides(grammar, len(choices), workers, "response_format" if body.response_format else "tools")
    context = model.context(body.context)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model.name}
    for who in ("user", "safety_identifier"):  # end-user ids, kept to trace abuse: the request's log line
        if getattr(body, who, None):
            log.info("%s: %s %.200r", rid, who, getattr(body, who))
    legacy, single = chat and body.functions is not None, chat and body.parallel_tool_calls is False
    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return await _stream(model, choices, guides, context, head, chat, echo, include_usage, form, legacy, single)
    scored, *done = await asyncio.gather(
        _scored(model, prompts, scoring, context, request, scoring_key),
        *(complete(model, ids, params, context, request, guide) if params is not None else _nothing(ids)
          for (ids, params), guide in zip(choices, guides)))
    word, out = functools.partial(_token_text, model.tokenizer), []
    for i, ((ids, _), c) in enumerate(zip(choices, done)):
        text = (model.tokenizer.decode(ids) + c.text) if echo else c.text
        item = {"index": i, "finish_reason": c.finish_reason, "logprobs": _logprobs(model, c.logprobs, chat, 0)
                if top is not None else None}
        if echoed is not None:  # OpenAI's legacy echo: the prompt's tokens first
            item["logprobs"] = prompt_logprobs.joined(prompt_logprobs.legacy(scored[i // body.n], word, echoed),
                                                      item["logprobs"])
        if asked is not None and not chat:  # vLLM's, on each choice
            item["prompt_logprobs"] = prompt_logprobs.vllm(scored[i // body.n], word, asked)
        if chat:
            content, calls = tools.parse(form, text) if form else (text, [])
            item["message"] = {"role": "assistant", "content": content}
            if calls:
                item["message"].update(_calls(calls, legacy, single))
                item["finish_reason"] = "function_call" if legacy else "tool_calls"
        else:
            item["text"] = text
        out.append(item)
    usage = _usage(sum(len(ids) for ids in prompts), sum(len(c.tokens) for c in done))
    answer: dict[str, Any] = {**head, "choices": out, "usage": usage}
    if chat and asked is not None:  # vLLM's chat: one list, at the top level
        answer["prompt_logprobs"] = prompt_logprobs.vllm(scored[0], word, asked)
    return Response(json.dumps(answer), media_type="application/json")


async def _scored(model: GenerationModel, prompts, top: int | None, context, request, key: str):
    """Each prompt's logprobs (None: not asked for)."""
    if top is None:
        return None
    return await prompt_logprobs.score(model, prompts, top, context, request, key)


async def _nothing(ids: list[int]) -> Completion:
    """``max_tokens`` 0: no token generated (the prompt is echoed)."""
    return Completion("", [], "length", len(ids), [])


def _tool_form(model: GenerationModel, body: ChatRequest, tool_list: list[dict], grammar):
    """The tool-call form calls are read in (None: ``tool_choice`` "none") and the grammar a forced call follows."""
    source = model.chat.pick(tool_list) if model.chat is not None else ""
    form = tools.convention(source)
    if "tools" not in source or form is None:
        field = "functions" if body.functions is not None else "tools"  # the field the request used
        raise bad_input(f"model {model.name!r}: its chat template " + (f"does not render '{field}'" if "tools" not in
                        source else "shows no tool-call form attnx reads (<tool_call> JSON, Llama 3.x JSON)"), field)
    choice = body.tool_choice or "auto"
    if choice in ("none", "auto"):
        return (None if choice == "none" else form), grammar
    if grammar is not None:
        raise bad_input("'response_format' and a forced 'tool_choice' cannot both hold", "tool_choice")
    name = choice.function.name if not isinstance(choice, str) else None
    return form, functools.partial(tools.forced_grammar, form, tool_list, name)  # built where it compiles


def _calls(calls: list[dict], legacy: bool, single: bool) -> dict:
    """A message's calls: ``tool_calls``, or the legacy ``function_call`` (one call, as OpenAI's legacy form has)."""
    listed = tools.openai_calls(calls[:1] if single or legacy else calls)
    return {"function_call": listed[0]["function"]} if legacy else {"tool_calls": listed}


def _logprobs(model: GenerationModel, entries, chat: bool, offset: int) -> dict:
    """OpenAI's ``logprobs`` of a choice (or of one chunk): chat's ``content`` list, or completions' columns."""
    word = functools.partial(_token_text, model.tokenizer)
    if chat:
        def one(token, logprob):
            text = word(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**one(token, lp), "top_logprobs": [one(t, v) for t, v in top]}
                            for token, (lp, top) in entries], "refusal": None}
    texts = [word(token) for token, _ in entries]
    offsets = [offset + sum(map(len, texts[:i])) for i in range(len(texts))]
    return {"tokens": texts, "token_logprobs": [lp for _, (lp, _) in entries],
            "top_logprobs": [{word(t): v for t, v in (*top, (token, lp))} for token, (lp, top) in entries],
            "text_offset": offsets}


@functools.lru_cache(maxsize=1 << 16)
def _token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _stream(model: GenerationModel, choices, guides, context, head: dict, chat: bool, echo: bool,
                  include_usage: bool, form: str | None, legacy: bool = False, single: bool = False) -> Response:
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    merged = _merged(model, choices, guides, context)
    first = await anext(merged)  # a refused request is a status code, not an event

    def chunk(i, text=None, reason=None, role=False, logprobs=None, calls=None):
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            if calls:
                message = _calls(calls, legacy, single)
                delta.update(message if legacy else {"tool_calls": [{"index": j, **c} for j, c in
                                                                    enumerate(message["tool_calls"])]})
            return {**head, "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}
        return {**head, "choices": [{"index": i, "text": text or "", "logprobs": logprobs, "finish_reason": reason}]}

    async def events():
        counts, sent = [0] * len(choices), [0] * len(choices)
        readers = [tools.Calls(form) if form else None for _ in choices]
        try:
            for i, (ids, _) in enumerate(choices):
                if chat or echo:
                    yield _sse(chunk(i, role=True) if chat else chunk(i, model.tokenizer.decode(ids)))
            item: tuple[int, Any] | None = first
            while item is not None:
                i, piece = item
                reader = readers[i]
                counts[i] += piece.token is not None
                text = reader.feed(piece.text) if reader is not None else piece.text
                logprobs = _logprobs(model, [(piece.token, piece.logprob)], chat, sent[i]) if piece.logprob else None
                if text or logprobs:
                    yield _sse(chunk(i, text, logprobs=logprobs))
                sent[i] += len(text)
                if piece.finish_reason:
                    rest, calls = reader.finish() if reader is not None else ("", [])
                    if rest:
                        yield _sse(chunk(i, rest))
                    reason = ("function_call" if legacy else "tool_calls") if calls else piece.finish_reason
                    yield _sse(chunk(i, "" if chat else None, reason, calls=calls))
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


async def _merged(model: GenerationModel, choices, guides, context) -> AsyncGenerator[tuple[int, Any], None]:
    """``(choice index, piece)`` of every choice as they come; a failure ends the stream with it."""
    if len(choices) == 1:
        async for piece in pieces(model, choices[0][0], choices[0][1], context, guides[0]):
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

    tasks = [asyncio.ensure_future(pump(i, pieces(model, ids, params, context, guide)))
             for i, ((ids, params), guide) in enumerate(zip(choices, guides))]
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
