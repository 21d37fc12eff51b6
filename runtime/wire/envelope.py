"""The one envelope around every request, HTTP and gRPC: admission, bodies, metrics, disconnects, errors, logs.

Every route hands its work to :class:`Envelope` (``await envelope.http(request, shape, work)``, or a gRPC handler
from :meth:`Envelope.grpc_unary` / :meth:`Envelope.grpc_stream`). It reads bodies under the server's rules
(:meth:`Envelope.body`: 413 before reading, the shared byte budget, decoding on the worker thread when large),
admits by queue room (:meth:`Envelope.admitted`: a full queue refuses before the body is read), counts each
request once in the metrics (by :class:`Kind` when refused, under the model's name once the work names it),
turns a client that left into ``client_gone`` and any other exception into one ``internal`` line (the traceback
goes to the log): the server never dies on a request. Refusals go out in the route's wire shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from attnx.runtime.core.session import public_message
from attnx.runtime.wire.errors import Kind, ProtocolError, Shape, overloaded
from attnx.runtime.wire.limits import ByteBudget, Limits, Workers, declared_length, read_body
from attnx.runtime.wire.metrics import ServerMetrics

log = logging.getLogger("attnx.serve")
#: A gRPC stream's requests in flight at once (the rest wait to be read).
STREAM_WINDOW = 64


@dataclass
class Call:
    """One request as the envelope sees it: when it began, its metrics label, the bytes of its body."""

    started: float = field(default_factory=time.perf_counter)
    label: str = "_unknown_"
    size: int = 0

    def named(self, model):
        """``model`` is what this request runs on: the label its metrics are counted under."""
        self.label = model.name
        return model


def error_response(shape: Shape, error: ProtocolError) -> Response:
    status, body, headers = shape.http(error)
    return Response(body, status_code=status, media_type="application/json", headers=headers)


class Envelope:
    """What every request goes through (module doc); one per server, shared by HTTP and gRPC."""

    def __init__(self, registry, metrics: ServerMetrics, limits: Limits, budget: ByteBudget, workers: Workers):
        self.registry, self.metrics, self.limits, self.budget, self.workers = registry, metrics, limits, budget, workers
        self._admitted: dict[str, int] = {}  # per model: requests let in whose body is not queued yet

    async def run(self, call: Call, work: Callable[[Call], Awaitable[Any]]) -> Any:
        """``work(call)`` with the server's metrics and error policy; refusals come out as ProtocolError."""
        try:
            result = await work(call)
        except ProtocolError as e:
            error = e
        except ClientDisconnect:  # the client went away mid-body: its time-out, not our error
            error = ProtocolError(Kind.CLIENT_GONE, "client disconnected")
        except asyncio.CancelledError:  # a gRPC client cancelled, or the connection dropped
            self.metrics.failure(call.label, Kind.CLIENT_GONE.value)
            raise
        except Exception as e:  # noqa: BLE001 - the server never dies on a request
            log.exception("internal error in a request (model %s)", call.label)
            error = ProtocolError(Kind.INTERNAL, f"internal error: {type(e).__name__}: {public_message(str(e))}")
        else:
            self.metrics.success(call.label, time.perf_counter() - call.started)
            return result
        finally:
            self.workers.trim(call.size)
        self.metrics.failure(call.label, error.kind.value)
        raise error

    async def http(self, request: Request, shape: Shape, work: Callable[[Call], Awaitable[Response]]) -> Response:
        """An HTTP route's answer: ``work``'s response, or its refusal in ``shape``."""
        try:
            return await self.run(Call(), work)
        except ProtocolError as e:
            return error_response(shape, e)

    # --- bodies and admission ------------------------------------------------------------------------
    async def body(self, request: Request, call: Call, decode: Callable[[bytes], Any]) -> Any:
        """``decode(body)`` of the request's body, read and decoded under the body limit and the byte budget,
        on the worker policy's thread when it is large."""
        size = declared_length(request, self.limits.max_body_bytes)
        async with self.budget.hold(self.limits.max_body_bytes if size is None else size, self.limits.decode_wait_s):
            body = await read_body(request, self.limits.max_body_bytes, size)
            call.size = len(body)
            return await self.workers.run(decode, body, cost=len(body))

    @contextlib.asynccontextmanager
    async def admitted(self, model):
        """Let a request for ``model`` in only while its queue has room for it and for those already let in
        whose bodies are still being read (a full queue refuses before a byte of the body is read)."""
        name = model.name
        if model.queue_depth + self._admitted.get(name, 0) >= model.max_queue:
            raise overloaded(f"model {name!r}: queue full ({model.max_queue} requests)")
        self._admitted[name] = self._admitted.get(name, 0) + 1
        try:
            yield
        finally:
            self._admitted[name] -= 1

    # --- gRPC ------------------------------------------------------------------------------------------
    def grpc_unary(self, shape: Shape, fn: Callable[[Any, Any, Call], Awaitable[Any]]):
        """A unary (or stream-in, unary-out) gRPC handler running ``fn(request, context, call)``."""

        async def handler(request, context):
            try:
                return await self.run(Call(), lambda call: fn(request, context, call))
            except ProtocolError as e:
                await context.abort(shape.status(e), e.message)

        return handler

    def grpc_stream(self, shape: Shape, fn: Callable[[Any, Any, Call], Awaitable[Any]]):
        """A stream-stream gRPC handler: each request runs as soon as it is read (up to a window), each through
        the envelope on its own, and the answers go back in order; the first refusal ends the stream."""

        async def handler(requests, context):
            pending: asyncio.Queue = asyncio.Queue(STREAM_WINDOW)

            async def read():
                async for request in requests:
                    await pending.put(asyncio.ensure_future(self.run(Call(), lambda c, r=request: fn(r, context, c))))
                await pending.put(None)

            reader = asyncio.ensure_future(read())
            try:
                while (task := await _next(pending, reader)) is not None:
                    yield await task
            except ProtocolError as e:
                await context.abort(shape.status(e), e.message)
            finally:
                reader.cancel()
                while not pending.empty():
                    if (task := pending.get_nowait()) is not None:
                        task.cancel()

        return handler


async def _next(pending: asyncio.Queue, reader: asyncio.Future):
    """The next task a stream's reader queued, or its error once it failed (a malformed message)."""
    getter = asyncio.ensure_future(pending.get())
    await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
    if not getter.done():  # the reader ended first: with an error, or it queued its None
        if reader.exception() is not None:
            getter.cancel()
            raise reader.exception()
        await getter
    return getter.result()
