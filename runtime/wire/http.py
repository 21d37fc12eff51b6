"""The HTTP app: one FastAPI application whose routes come from the API modules' routers.

Every route reaches the server through :func:`serving` (``request.app.state.serving``: the registry, the
envelope, the limits...). What fails before a route runs is answered here in the shape of the API its path
belongs to (:func:`attnx.runtime.wire.errors.shape_of_path`): an unknown route or method (404/405), a query
parameter of the wrong type (400: ``/explain?layer=abc``), a bug (500, one line; the traceback is logged).
``/openapi.json`` documents every route, JSON bodies included (:mod:`attnx.runtime.apis.requests`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import attnx
from attnx.runtime.core.session import public_message
from attnx.runtime.wire.envelope import Envelope, error_response
from attnx.runtime.wire.errors import Kind, ProtocolError, shape_of_path
from attnx.runtime.wire.limits import Limits
from attnx.runtime.wire.metrics import ServerMetrics

log = logging.getLogger("attnx.serve")


@dataclass
class Serving:
    """What the routes share: the models, the envelope every request goes through, and the server's policies."""

    registry: Any
    envelope: Envelope
    metrics: ServerMetrics
    limits: Limits
    dimensions: Any = None  # attnx.runtime.apis.encoding.Dimensions: which models may be cut shorter
    extensions: list[str] = field(default_factory=list)
    chat: Any = None  # attnx.runtime.core.chat.Renderer: chat templates, in worker processes
    #: JSON strings past this many characters are read as their two ends (the largest character cap of a model)
    string_cap: int | None = None
    started: int = field(default_factory=lambda: int(time.time()))
    version: str = getattr(attnx, "__version__", "0")


def serving(request: Request) -> Serving:
    return request.app.state.serving


def create_app(state: Serving, routers: Iterable[APIRouter], on_shutdown: Callable[[], None] | None = None,
               openapi: Callable[[FastAPI], dict] | None = None) -> FastAPI:
    """The ASGI app over ``state``. ``on_shutdown`` runs once uvicorn stopped accepting and in-flight requests
    finished, before the models close (the gRPC front end stops there, so its calls finish too)."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        loop = asyncio.get_running_loop()  # drain off the loop: a slow batch blocks nothing else
        if on_shutdown is not None:
            await loop.run_in_executor(None, on_shutdown)
        await loop.run_in_executor(None, state.registry.close)
        state.envelope.workers.close()

    app = FastAPI(title="attnx", version=state.version, docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.serving = state
    for router in routers:
        app.include_router(router)
    if openapi is not None:
        app.openapi = functools.cache(lambda: openapi(app))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        kind = {404: Kind.NOT_FOUND, 405: Kind.BAD_INPUT}.get(exc.status_code, Kind.BAD_INPUT)
        response = error_response(shape_of_path(request.url.path),
                                  ProtocolError(kind, f"{detail}: {request.method} {request.url.path}"))
        if exc.status_code == 405:  # a route that exists, asked with another method
            response.status_code = 405
        return response

    @app.exception_handler(RequestValidationError)
    async def _bad_parameter(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or "request"
        return error_response(shape_of_path(request.url.path),
                              ProtocolError(Kind.BAD_INPUT, f"'{where}': {first.get('msg')}", where))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("internal error in %s %s", request.method, request.url.path)
        return error_response(shape_of_path(request.url.path), ProtocolError(
            Kind.INTERNAL, f"internal error: {type(exc).__name__}: {public_message(str(exc))}"))

    return app
