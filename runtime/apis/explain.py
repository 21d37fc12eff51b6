"""The server's attention pages: ``/explain`` computed with the deployed model.

- ``GET /explain``: the served models that return attention patterns, with a text box each.
- ``GET /explain/{model}?text=...``: the attention page (:mod:`attnx.explain.page`) for that text,
  computed by the model's own batcher (the request names the ``attentions.{i}`` outputs, so it
  is one more request in the queue, batched with the others).
- ``GET /explain/{model}/info``: the model's attnx metadata and tokenizer file, what
  ``attnx explain http://...`` needs to tokenise and then infer over KServe v2.

Errors are ``{"error": ...}`` like the rest of the server: 404 an unknown model, 400 a model
without attention outputs or tokenizer, an empty or over-long text. numpy only (no torch).
"""

from __future__ import annotations

import asyncio
import html
import weakref

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse

from attnx.contract import ContractError
from attnx.explain.source import Source
from attnx.runtime.core.batcher import BatcherClosedError, QueueFullError, RequestTimeoutError
from attnx.runtime.core.decoding import source_info
from attnx.runtime.core.session import InputError
from attnx.runtime.serving.model import INFER
from attnx.runtime.serving.registry import ModelRegistry
from attnx.runtime.serving.state import serving
from attnx.runtime.wire.envelope import error_response
from attnx.runtime.wire.errors import KSERVE, ProtocolError, bad_input

#: Longest text the page accepts (characters); the tokenizer truncates to the model's max length anyway.
MAX_TEXT_CHARS = 20_000


class _Explainable:
    """What the page needs of one served model, built once: its facts and its tokenizer."""

    def __init__(self, model):
        from attnx.explain.source import ExplainError, TextEncoder, model_facts

        info, source = source_info(model.session)  # an engine: the ONNX its sidecar names, beside it
        if info is None:
            raise ExplainError(f"model {model.name!r} has no attnx metadata: nothing to explain")
        self.info = info
        self.facts = model_facts(info, model.name)
        self.facts.require_patterns()
        if info.tokenizer is None:
            raise ExplainError(f"model {model.name!r} takes {', '.join(info.input_names)}, not text: the page "
                               "needs a model exported with its tokenizer (--from-pretrained)")
        self.tokenizer_path = info.tokenizer.path(source.parent)
        self.encoder = TextEncoder.from_file(self.tokenizer_path, info.tokenizer, info.input_names)


class _BatcherSource(Source):
    """:class:`attnx.explain.source.Source` over a served model's batcher (the deployed model itself)."""

    def __init__(self, model, explainable: _Explainable):
        super().__init__(explainable.facts, explainable.encoder, f"served {model.session.provider}")
        self.model = model

    def run(self, feeds, outputs):
        return self.model.batcher.infer(dict(feeds), output_names=list(outputs))


router = APIRouter(tags=["Attention pages"])
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # registry -> {model name: _Explainable}


def explainable(registry: ModelRegistry, name: str) -> _Explainable:
    from attnx.explain.source import ExplainError

    model = registry.resolve(name, INFER, path=True)  # 404 for an unknown model, 400 for a text generator
    cache = _CACHE.setdefault(registry, {})
    if name not in cache:
        try:
            cache[name] = _Explainable(model)
        except (ExplainError, ContractError, FileNotFoundError) as e:
            raise bad_input(str(e)) from None
    return cache[name]


@router.get("/explain")
async def explain_index(request: Request):
    registry = serving(request).registry
    items = []
    for name in registry.models:
        try:
            explainable(registry, name)
            items.append(f'<li><form method="get" action="/explain/{html.escape(name)}"><b>{html.escape(name)}'
                         f'</b> <input name="text" size="60" value="The cat sat on the mat."> '
                         f'<button type="submit">explain</button></form></li>')
        except ProtocolError as e:
            items.append(f"<li><b>{html.escape(name)}</b>: {html.escape(e.message)}</li>")
    body = "\n".join(items) or "<li>no models</li>"
    return HTMLResponse(f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>attnx explain"
                        f"</title></head><body><h1>attnx: attention of the served models</h1><ul>{body}</ul>"
                        "</body></html>")


@router.get("/explain/{name}/info")
async def explain_info(name: str, request: Request):
    try:
        ex = explainable(serving(request).registry, name)
    except ProtocolError as e:
        return error_response(KSERVE, e)
    return JSONResponse({"metadata": ex.info.to_props(),
                         "tokenizer_json": ex.tokenizer_path.read_text(encoding="utf-8")})


@router.get("/explain/{name}")
async def explain_page(name: str, request: Request, text: str = "The cat sat on the mat.", layer: int | None = None):
    s = serving(request)

    async def work(call):
        from attnx.explain.explanation import explain
        from attnx.explain.page import explanation_page
        from attnx.explain.source import ExplainError

        ex = explainable(s.registry, name)
        call.named(s.registry.get(name))
        if not text.strip():
            raise bad_input("text is empty", "text")
        if len(text) > MAX_TEXT_CHARS:
            raise bad_input(f"text of {len(text)} characters is over the page's limit of {MAX_TEXT_CHARS}", "text")
        source = _BatcherSource(s.registry.get(name), ex)
        try:
            result = await asyncio.to_thread(explain, source, [text], layers=None if layer is None else [layer])
        except (ExplainError, InputError) as e:
            raise bad_input(str(e)) from None
        except (QueueFullError, BatcherClosedError, RequestTimeoutError) as e:
            raise e.refused() from None  # its own kind: all 503 on this page's KServe shape
        page = await asyncio.to_thread(explanation_page, result, title=f"attention: {name} (served)",
                                       form_action=f"/explain/{name}")
        return HTMLResponse(page)

    return await s.envelope.http(request, KSERVE, work)
