"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` on ``attnx serve``, for clients that count and budget tokens.

``/tokenize`` takes ``{"model", "prompt"}`` or ``{"model", "messages"}`` (rendered by the model's chat template, with
``tools`` and ``add_generation_prompt``) and ``add_special_tokens`` (vLLM's defaults: true for a prompt, false for
messages), and answers ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` with
``return_token_strs``); ``/detokenize`` takes ``{"model", "tokens"}`` and answers ``{"prompt"}``. The text models
serve it (those ``/v1/completions`` serves); a prompt is not refused for being longer than the positions (``count``
against ``max_model_len`` is what a client budgets with), but one past the model's character cap is (never read).
Bodies go through the envelope's count-first checks like chat's; tokenising and decoding run off the loop.
``GET /tokenizer_info`` (vLLM's, for lm-evaluation-harness' ``tokenizer_backend=remote``) names the model's special
tokens, its chat template and ``model_max_length`` (``?model=`` picks one when several generate).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar

from fastapi import APIRouter, Request
from pydantic import BeforeValidator, Field, field_validator, model_validator
from starlette.responses import Response

from attnx.runtime.apis.requests import MAX_INT, Body, ChatMessage, Model, fail, openapi_body, parse, text
from attnx.runtime.apis.tool_requests import MAX_TOOLS, Tool
from attnx.runtime.serving.model import GENERATE
from attnx.runtime.serving.state import serving
from attnx.runtime.wire.envelope import Call, error_response
from attnx.runtime.wire.errors import OPENAI_SHAPE, ProtocolError, bad_input

router = APIRouter(tags=["vLLM tokenize"])


class TokenizeRequest(Body):
    """vLLM's ``POST /tokenize``: a ``prompt``, or ``messages`` rendered by the model's chat template (with ``tools``)
    as chat renders them. ``add_special_tokens`` defaults as vLLM's: true for a prompt, false for messages (their
    template writes them)."""

    model: Model = None
    prompt: Annotated[str | None, BeforeValidator(lambda v: v if v is None else text(v, "'prompt'"))] = None
    messages: Annotated[list[ChatMessage] | None, Field(min_length=1)] = None
    tools: Annotated[list[Tool] | None, Field(max_length=MAX_TOOLS)] = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    continue_final_message: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    paths: ClassVar = frozenset({"tools"})

    @field_validator("continue_final_message", "chat_template", "chat_template_kwargs", mode="before")
    @classmethod
    def _unsupported(cls, value, info):
        if value not in (None, False, {}):
            fail(f"'{info.field_name}' is not supported: the model's own template renders the messages")
        return value

    @model_validator(mode="after")
    def _one_form(self):
        if (self.prompt is None) == (self.messages is None):
            fail("give 'prompt' or 'messages' (one of them)")
        return self


class DetokenizeRequest(Body):
    """vLLM's ``POST /detokenize``: token ids back to text."""

    model: Model = None
    tokens: list[Annotated[int, Field(ge=0, le=MAX_INT)]]


BODIES = (TokenizeRequest, DetokenizeRequest)  # in the OpenAPI document beside the others (server.py)


@router.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest))
async def tokenize(request: Request):
    s = serving(request)

    async def work(call: Call) -> Response:
        body = await s.envelope.body(request, call, lambda raw: parse(TokenizeRequest, raw, s.string_cap),
                                     counts="chat")
        model = call.named(s.registry.resolve(body.model, GENERATE))
        if body.messages is not None:
            s.limits.check_messages(len(body.messages))
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            messages = [m.model_dump(exclude_none=False) for m in body.messages]
            source = await model.render(s.chat, messages, tools, s.envelope.workers, body.add_generation_prompt)
            special, param = bool(body.add_special_tokens), "messages"
        else:
            source, param = body.prompt, "prompt"
            special = True if body.add_special_tokens is None else body.add_special_tokens
        cap = model.tokenizer.char_cap
        if cap and len(source) > cap:  # past what the positions could hold at any tokenisation: not read
            raise bad_input(f"'{param}' has {len(source)} characters, more than model {model.name!r} can hold "
                            f"({model.decoder.positions_text})", param)
        ids = await s.envelope.workers.run(_encode, model.tokenizer, source, special, cost=len(source))
        strs = None
        if body.return_token_strs:
            strs = await s.envelope.workers.run(_token_strings, model.tokenizer, ids, cost=len(ids))
        answer = {"count": len(ids), "max_model_len": model.decoder.max_positions, "tokens": ids, "token_strs": strs}
        return Response(json.dumps(answer), media_type="application/json")

    return await s.envelope.http(request, OPENAI_SHAPE, work)


@router.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest))
async def detokenize(request: Request):
    s = serving(request)

    async def work(call: Call) -> Response:
        body = await s.envelope.body(request, call, lambda raw: parse(DetokenizeRequest, raw, s.string_cap),
                                     counts="prompts")
        model = call.named(s.registry.resolve(body.model, GENERATE))
        ids = await model.prompt_ids(body.tokens, s.envelope.workers, "tokens", positions=False) if body.tokens else []
        prompt = await s.envelope.workers.run(model.tokenizer.decode, ids, False, cost=len(ids))
        return Response(json.dumps({"prompt": prompt}), media_type="application/json")

    return await s.envelope.http(request, OPENAI_SHAPE, work)


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request, model: str | None = None):
    s = serving(request)
    try:
        served = s.registry.resolve(model, GENERATE)
    except ProtocolError as e:
        return error_response(OPENAI_SHAPE, e)
    chat, vocab, layout = served.chat, served.tokenizer._full, served.decoder.layout
    info: dict[str, Any] = dict(chat.specials) if chat is not None else {}
    if "eos_token" not in info and layout.eos:  # the file's own end-of-text id names it otherwise
        info["eos_token"] = vocab.id_to_token(layout.eos[0])
    if "bos_token" not in info and layout.bos is not None:
        info["bos_token"] = vocab.id_to_token(layout.bos)
    info["chat_template"] = chat.templates.get("default") if chat is not None else None
    info["model_max_length"] = served.decoder.max_positions
    return Response(json.dumps(info), media_type="application/json")


def _encode(tokenizer, text: str, special: bool) -> list[int]:
    """The untruncated ids (the text model's ``tokenize`` refuses what the positions cannot hold: here that is
    counted, not refused)."""
    return tokenizer._full.encode(text, add_special_tokens=special).ids


def _token_strings(tokenizer, ids: list[int]) -> list[str]:
    """Each id's vocabulary entry (transformers' ``convert_ids_to_tokens``, as vLLM's ``token_strs``)."""
    return [tokenizer._full.id_to_token(i) for i in ids]
