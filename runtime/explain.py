"""The server's attention pages: ``/explain`` computed with the deployed model.

    add_explain_routes(app, registry)      # in create_app

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
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse

from attnx.contract import ContractError, ModelInfo, contained, read_sidecar
from attnx.runtime import protocol as proto
from attnx.runtime.batcher import BatcherClosedError, QueueFullError, RequestTimeoutError
from attnx.runtime.session import InputError

#: Longest text the page accepts (characters); the tokenizer truncates to the model's max length anyway.
MAX_TEXT_CHARS = 20_000


def model_info(model) -> ModelInfo | None:
    """A served model's attnx metadata: the ONNX file's own, or for an engine the source ONNX its sidecar names."""
    info = model.session.info
    if info is not None:
        return info
    try:
        side = read_sidecar(model.session.path)
        onnx_path = Path(side["onnx"]) if side and side.get("onnx") else None
        return ModelInfo.read(onnx_path) if onnx_path is not None and onnx_path.is_file() else None
    except (ContractError, OSError, KeyError, TypeError):
        return None


class _Explainable:
    """What the page needs of one served model, built once: its facts and its tokenizer."""

    def __init__(self, model):
        from attnx.explain.source import ExplainError, TextEncoder, model_facts

        info = model_info(model)
        if info is None:
            raise ExplainError(f"model {model.name!r} has no attnx metadata: nothing to explain")
        self.info = info
        self.facts = model_facts(info, model.name)
        self.facts.require_patterns()
        if not info.tokenizer:
            raise ExplainError(f"model {model.name!r} takes {', '.join(info.input_names)}, not text: the page "
                               "needs a model exported with its tokenizer (--from-pretrained)")
        tok_dir = contained(_model_folder(model), info.tokenizer["dir"], "the tokenizer folder named by attnx.tokenizer")
        self.tokenizer_path = tok_dir / info.tokenizer.get("file", "tokenizer.json")
        self.encoder = TextEncoder.from_file(self.tokenizer_path, info.tokenizer, info.input_names)


def _model_folder(model) -> Path:
    path = Path(model.session.path)
    if path.suffix.lower() in (".engine", ".plan"):
        side = read_sidecar(path) or {}
        if side.get("onnx"):
            return Path(side["onnx"]).parent
    return path.parent


class _BatcherSource:
    """:class:`attnx.explain.source.Source` over a served model's batcher (the deployed model itself)."""

    def __init__(self, model, explainable: _Explainable):
        self.model, self.facts, self.encoder = model, explainable.facts, explainable.encoder
        self.label = f"served {model.session.provider}"

    def run(self, feeds, outputs):
        return self.model.batcher.infer(dict(feeds), output_names=list(outputs))

    def require_text(self):
        return self.encoder


def add_explain_routes(app: FastAPI, registry) -> None:
    """Add the ``/explain`` routes for the models of ``registry`` (see the module docstring)."""
    cache: dict[str, _Explainable] = {}

    def explainable(name: str) -> _Explainable:
        from attnx.explain.source import ExplainError

        model = registry.get(name)  # 404 for an unknown model
        if name not in cache:
            try:
                cache[name] = _Explainable(model)
            except (ExplainError, ContractError, FileNotFoundError) as e:
                raise proto.BadRequest(str(e)) from None
        return cache[name]

    @app.get("/explain")
    async def explain_index():
        items = []
        for name, model in registry.models.items():
            try:
                explainable(name)
                items.append(f'<li><form method="get" action="/explain/{html.escape(name)}"><b>{html.escape(name)}'
                             f'</b> <input name="text" size="60" value="The cat sat on the mat."> '
                             f'<button type="submit">explain</button></form></li>')
            except proto.ProtocolError as e:
                items.append(f"<li><b>{html.escape(name)}</b>: {html.escape(e.message)}</li>")
        body = "\n".join(items) or "<li>no models</li>"
        return HTMLResponse(f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>attnx explain"
                            f"</title></head><body><h1>attnx: attention of the served models</h1><ul>{body}</ul>"
                            "</body></html>")

    @app.get("/explain/{name}/info")
    async def explain_info(name: str):
        ex = explainable(name)
        return JSONResponse({"metadata": ex.info.to_props(),
                             "tokenizer_json": ex.tokenizer_path.read_text(encoding="utf-8")})

    @app.get("/explain/{name}")
    async def explain_page(name: str, text: str = "The cat sat on the mat.", layer: int | None = None):
        from attnx.explain.explanation import explain
        from attnx.explain.page import explanation_page
        from attnx.explain.source import ExplainError

        ex = explainable(name)
        if not text.strip():
            raise proto.BadRequest("text is empty")
        if len(text) > MAX_TEXT_CHARS:
            raise proto.BadRequest(f"text of {len(text)} characters is over the page's limit of {MAX_TEXT_CHARS}")
        source = _BatcherSource(registry.get(name), ex)
        try:
            layers = None if layer is None else [layer]
            result = await asyncio.to_thread(explain, source, [text], layers=layers)
        except (ExplainError, InputError) as e:
            raise proto.BadRequest(str(e)) from None
        except (QueueFullError, BatcherClosedError, RequestTimeoutError) as e:
            raise _Busy(str(e)) from None
        page = await asyncio.to_thread(explanation_page, result, title=f"attention: {name} (served)",
                                       form_action=f"/explain/{name}")
        return HTMLResponse(page)


class _Busy(proto.ProtocolError):
    status = 503
    reason = "overload"
