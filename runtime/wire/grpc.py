"""The gRPC server (``attnx serve --grpc-port``) on its own thread and event loop (``grpc.aio``), beside the HTTP
server: it starts, binds (port 0 picks one) and stops independently of uvicorn, and its requests meet the
HTTP ones in the batchers. The services it carries (KServe v2's ``inference.GRPCInferenceService``:
:mod:`attnx.runtime.apis.kserve_grpc`; TEI's ``tei.v1``: :mod:`attnx.runtime.apis.tei_grpc`) add
themselves to it; every call goes through the server's one envelope
(:meth:`attnx.runtime.wire.envelope.Envelope.grpc_unary`).
"""

from __future__ import annotations

import asyncio
import threading

import grpc

from attnx.runtime.wire.limits import Limits


class GrpcFrontEnd:
    """The gRPC server on its own thread and event loop; :meth:`start` returns once it is bound."""

    def __init__(self, services: list, limits: Limits, *, host: str = "127.0.0.1", port: int = 8001,
                 interceptors: list | None = None):
        self.services = list(services)  # each adds itself to the server: ``service.add_to(server)``
        self.interceptors = list(interceptors or [])  # e.g. the API-key check (attnx.runtime.wire.auth)
        self.host, self.requested_port, self.limits = host, port, limits
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._grace = 30.0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "GrpcFrontEnd":
        self._thread = threading.Thread(target=self._main, name="attnx-grpc", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the gRPC server did not start in time")
        if self._error is not None:
            raise self._error
        return self

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._error = e
            self._ready.set()

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        size = max(self.limits.max_body_bytes, 4 << 20)
        server = grpc.aio.server(interceptors=self.interceptors,
                                 options=[("grpc.max_receive_message_length", size),
                                          ("grpc.max_send_message_length", -1),
                                          ("grpc.so_reuseport", 0)])
        for service in self.services:
            service.add_to(server)
        target = f"[{self.host}]:{self.requested_port}" if ":" in self.host else f"{self.host}:{self.requested_port}"
        try:
            self.port = server.add_insecure_port(target)
        except RuntimeError as e:
            raise OSError(f"gRPC cannot listen on {target}: the address is in use ({e})") from None
        if not self.port:
            raise OSError(f"gRPC cannot listen on {target}: the address is in use")
        await server.start()
        self._ready.set()
        await self._stop.wait()
        await server.stop(self._grace)  # in-flight calls finish; new ones are refused

    def stop(self, grace: float = 30.0) -> None:
        """Stop taking calls, let in-flight ones finish (up to ``grace`` seconds), and join the thread."""
        if self._loop is None or self._stop is None or self._thread is None:  # never started (set together)
            return
        self._grace = grace
        try:
            self._loop.call_soon_threadsafe(self._stop.set)
        except RuntimeError:  # the loop already ended
            pass
        self._thread.join(grace + 10)
        self._thread = None
