"""The HTTP app: one FastAPI application whose routes come from the API modules' routers.

Every route reaches the server through ``request.app.state.serving`` (the registry, the envelope, the limits...:
:class:`attnx.runtime.serving.state.Serving`, which the wire knows only as :class:`AppState`). What fails before a
route runs is answered here in the shape of the API its path belongs to
(:func:`attnx.runtime.wire.errors.shape_of_path`): an unknown route or method (404/405), a query parameter of the
wrong type (400: ``/explain?layer=abc``), a bug (500, one line; the traceback is logged). ``/openapi.json``
documents every route, JSON bodies included (:mod:`attnx.runtime.apis.requests`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import Callable, Iterable, Protocol

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from attnx.runtime.core.session import public_message
from attnx.runtime.wire.envelope import error_response
from attnx.runtime.wire.errors import Kind, ProtocolError, shape_of_path

log = logging.getLogger("attnx.serve")


class AppState(Protocol):
    """What the app keeps for its routes (:class:`attnx.runtime.serving.state.Serving`), as the wire sees it."""

    @property
    def version(self) -> str: ...

    def close(self) -> None:
        """Once no request is in flight: the models and the worker threads."""
        ...


def create_app(state: AppState, routers: Iterable[APIRouter], on_shutdown: Callable[[], None] | None = None,
               openapi: Callable[[FastAPI], dict] | None = None) -> FastAPI:
    """The ASGI app over ``state``. ``on_shutdown`` runs once uvicorn stopped accepting and in-flight requests
    finished, before the models close (the gRPC front end stops there, so its calls finish too)."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        loop = asyncio.get_running_loop()  # drain off the loop: a slow batch blocks nothing else
        if on_shutdown is not None:
            await loop.run_in_executor(None, on_shutdown)
        await loop.run_in_executor(None, state.close)

    app = FastAPI(title="attnx", version=state.version, docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.serving = state
    for router in routers:
        app.include_router(router)
    if openapi is not None:
        # FastAPI's documented hook for a custom schema is replacing the method on the instance.
        app.openapi = functools.cache(lambda: openapi(app))  # type: ignore[method-assign]

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
