"""The one envelope around every request, HTTP and gRPC: admission, bodies, metrics, disconnects, errors, logs.

Every route hands its work to :class:`Envelope` (``await envelope.http(request, shape, work)``, or a gRPC handler
from :meth:`Envelope.grpc_unary` / :meth:`Envelope.grpc_stream`). It reads bodies under the server's rules
(:meth:`Envelope.body`: 413 before reading, the shared byte budget charged as bytes arrive, 408 for a body that
arrives too slowly, a route's bounds on what its raw JSON holds checked before parsing, decoding on the worker
thread when large), admits by queue room (:meth:`Envelope.admitted`: a full queue refuses before the body is
read), counts each request once in the metrics (by :class:`Kind` when refused, under the model's name once the work
names it), turns a client that left into ``client_gone`` and any other exception into one ``internal`` line (the
traceback goes to the log): the server never dies on a request. Refusals go out in the route's wire shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from attnx.runtime.core.batcher import SOURCE
from attnx.runtime.core.session import public_message
from attnx.runtime.wire.counts import check_json
from attnx.runtime.wire.errors import Kind, ProtocolError, Shape, overloaded
from attnx.runtime.wire.limits import ByteBudget, Limits, Workers, declared_length, read_body
from attnx.runtime.wire.metrics import ServerMetrics

log = logging.getLogger("attnx.serve")
#: A gRPC stream's requests in flight at once (the rest wait to be read), and their bytes (one request always fits):
#: a stream of long texts has one or two in the model's queue at a time, paced by its own answers, and the batcher
#: counts the whole stream as one source, so a neighbour's row takes the next turn (issue 45: 1,024 texts of 20 KB
#: put 64 long rows ahead of every neighbour); a stream of short ones keeps 64 going.
STREAM_WINDOW = 64
STREAM_WINDOW_BYTES = 8 << 10


class Queued(Protocol):
    """A served model as the envelope sees it: a name and a queue (every
    :class:`~attnx.runtime.serving.model.ServedModel` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def queue_depth(self) -> int: ...

    @property
    def max_queue(self) -> int: ...


QueuedModel = TypeVar("QueuedModel", bound=Queued)


@dataclass
class Call:
    """One request as the envelope sees it: when it began, its metrics label, the bytes of its body."""

    started: float = field(default_factory=time.perf_counter)
    label: str = "_unknown_"
    size: int = 0

    def named(self, model: QueuedModel) -> QueuedModel:
        """``model`` is what this request runs on: the label its metrics are counted under."""
        self.label = model.name
        return model


def _counted(body, bound, where: str, decode: Callable[[bytes], Any]) -> Any:
    check_json(body, bound, where)
    return decode(body)


def error_response(shape: Shape, error: ProtocolError) -> Response:
    status, body, headers = shape.http(error)
    return Response(body, status_code=status, media_type="application/json", headers=headers)


class Envelope:
    """What every request goes through (module doc); one per server, shared by HTTP and gRPC."""

    def __init__(self, metrics: ServerMetrics, limits: Limits, budget: ByteBudget, workers: Workers):
        self.metrics, self.limits, self.budget, self.workers = metrics, limits, budget, workers
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
    async def body(self, request: Request, call: Call, decode: Callable[[bytes], Any],
                   counts: str | None = None) -> Any:
        """``decode(body)`` of the request's body, read under the body limit, the body deadline and the byte budget
        (charged chunk by chunk), then decoded on the worker policy's thread when it is large. ``counts``: the
        route's kind (:meth:`~attnx.runtime.wire.limits.Limits.json_bound`): the raw JSON is first checked against
        its bounds (:func:`~attnx.runtime.wire.counts.check_json`), so no huge count of values is ever parsed."""
        size = declared_length(request, self.limits.max_body_bytes)
        share = self.budget.share(size)
        try:
            body = await read_body(request, self.limits, size, share)
            call.size = len(body)
            if counts is not None:
                bound, where = self.limits.json_bound(counts), f"{request.method} {request.url.path}"
                return await self.workers.run(_counted, body, bound, where, decode, cost=len(body))
            return await self.workers.run(decode, body, cost=len(body))
        finally:
            share.release()

    @contextlib.asynccontextmanager
    async def admitted(self, model: Queued):
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
        """A stream-stream gRPC handler: each request runs as soon as it is read (up to a window: :class:`_Window`),
        each through the envelope on its own, all as one source to the batcher (:data:`SOURCE`), and the answers go
        back in order; the first refusal ends the stream."""

        async def handler(requests, context):
            pending: asyncio.Queue = asyncio.Queue(STREAM_WINDOW)
            window, stream = _Window(), object()

            async def read():
                async for request in requests:
                    size = request.ByteSize() if hasattr(request, "ByteSize") else 0
                    await window.enter(size)
                    task = asyncio.ensure_future(self.run(Call(), functools.partial(fn, request, context)))
                    task.add_done_callback(window.leaver(size))
                    await pending.put(task)
                await pending.put(None)

            own = contextvars.copy_context()  # the reader and the tasks it starts: one source to the batcher
            own.run(SOURCE.set, stream)
            reader = asyncio.get_running_loop().create_task(read(), context=own)
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


class _Window:
    """One stream's requests in flight: at most :data:`STREAM_WINDOW` of them and :data:`STREAM_WINDOW_BYTES` of
    their bytes, though one always fits (its reader is the only one waiting)."""

    def __init__(self) -> None:
        self.count = self.size = 0
        self._freed = asyncio.Event()

    async def enter(self, size: int) -> None:
        while self.count and (self.count >= STREAM_WINDOW or self.size + size > STREAM_WINDOW_BYTES):
            self._freed.clear()
            await self._freed.wait()
        self.count, self.size = self.count + 1, self.size + size

    def leave(self, size: int) -> None:
        self.count, self.size = self.count - 1, self.size - size
        self._freed.set()

    def leaver(self, size: int) -> Callable[[object], None]:
        """A done-callback that frees a request's ``size`` bytes."""
        return lambda _: self.leave(size)


async def _next(pending: asyncio.Queue, reader: asyncio.Future):
    """The next task a stream's reader queued, or its error once it failed (a malformed message)."""
    getter = asyncio.ensure_future(pending.get())
    await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
    if not getter.done():  # the reader ended first: with an error, or it queued its None
        error = reader.exception()
        if error is not None:
            getter.cancel()
            raise error
        await getter
    return getter.result()
