"""An HTTP inference server speaking KServe v2 / the Open Inference Protocol as Triton does.

The unmodified ``tritonclient.http`` client works against it. Endpoints:

- ``GET  /v2/health/live``, ``/v2/health/ready``, ``/v2`` (server metadata)
- ``GET  /v2/models/{m}[/versions/{v}]`` (model metadata), ``.../ready``, ``.../config``
- ``POST /v2/models/{m}[/versions/{v}]/infer``: JSON tensors and the binary tensor data extension
- ``POST /v2/repository/index``; ``GET /metrics`` (Prometheus)

Each model has a :class:`~attnx.runtime.batcher.DynamicBatcher` (one worker
thread), so the event loop only parses, validates and encodes; it never waits
on compute. Errors are ``{"error": "..."}``: 400 bad input, 404 unknown model or
version, 413 body over the limit, 503 overload (queue full, queue timeout,
shutting down), 500 only for a bug.

Shutdown (Ctrl-C, SIGTERM or :meth:`InferenceServer.stop`) stops accepting
connections, lets in-flight requests finish, then drains and closes the batchers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import attnx
import attnx.runtime.protocol as proto
from attnx.runtime.batcher import (
    BatcherClosedError,
    BatcherConfig,
    DynamicBatcher,
    QueueFullError,
    RequestTimeoutError,
)
from attnx.runtime.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from attnx.runtime.session import InputError, Session, load

SERVER_NAME = "attnx"
#: Protocol extensions we implement (Triton names).
EXTENSIONS = ["binary_tensor_data", "model_repository(index)", "statistics(prometheus)"]
#: Parse/encode bodies larger than this in a worker thread, so big JSON does not stall the loop.
_OFFLOAD_PARSE_BYTES = 256 << 10


class Overloaded(proto.ProtocolError):
    status = 503
    reason = "overload"


@dataclass
class ServedModel:
    """One model behind the server: its session, its batcher, and how it presents itself."""

    name: str
    session: Session
    batcher: DynamicBatcher
    version: str = "1"
    limits: proto.Limits = field(default_factory=proto.Limits)

    @functools.cached_property
    def signature(self) -> proto.ModelSignature:
        profiles = self.session.profiles or {}
        seq_profile = profiles.get("seq")
        # Declared profile max for seq bounds requests unless --max-seq says otherwise (engines
        # cannot run past it; ONNX Runtime could, but the model was never meant to see it).
        profile_max = seq_profile[-1] if isinstance(seq_profile, list) and seq_profile else None
        return proto.ModelSignature(
            self.name,
            self.session.inputs,
            self.session.outputs,
            self.batcher.config.max_batch_size,
            self.limits.max_seq or (profile_max if isinstance(profile_max, int) and profile_max > 0 else None),
        )

    def metadata(self) -> dict[str, Any]:
        """KServe v2 model metadata; dims are -1 where dynamic (batch included, as Triton does)."""

        def tensor(spec):
            return {
                "name": spec.name,
                "datatype": proto.triton_dtype(spec.dtype),
                "shape": [d if isinstance(d, int) else -1 for d in spec.shape],
            }

        return {
            "name": self.name,
            "versions": [self.version],
            "platform": self.session.platform,
            "inputs": [tensor(s) for s in self.session.inputs],
            "outputs": [tensor(s) for s in self.session.outputs],
        }

    def config(self) -> dict[str, Any]:
        """A Triton model configuration (JSON form), as ``GET .../config`` returns."""
        from attnx.deploy.triton import model_config

        return model_config(
            self.name,
            self.session,
            max_batch_size=self.batcher.config.max_batch_size,
            max_queue_delay_us=int(self.batcher.config.max_queue_delay_ms * 1000),
        )


@dataclass
class ServerConfig:
    """Network and lifecycle settings (the batching and size limits live with each model)."""

    host: str = "127.0.0.1"
    port: int = 8000
    graceful_timeout_s: float = 30.0
    log_level: str = "warning"


class ModelRegistry:
    """The served models by name (and their one version, "1")."""

    def __init__(self) -> None:
        self.models: dict[str, ServedModel] = {}

    def add(self, model: ServedModel) -> None:
        if model.name in self.models:
            raise ValueError(f"two models named {model.name!r} (use name=path to rename one)")
        self.models[model.name] = model

    def get(self, name: str, version: str | None = None) -> ServedModel:
        model = self.models.get(name)
        if model is None:
            raise proto.NotFound(f"unknown model {name!r}; this server has {sorted(self.models)}")
        if version not in (None, "", model.version):
            raise proto.NotFound(f"model {name!r} has no version {version!r} (versions: [{model.version!r}])")
        return model

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        for m in self.models.values():
            m.batcher.close(drain=drain, timeout=timeout)


def create_app(registry: ModelRegistry, metrics: ServerMetrics, limits: proto.Limits):
    """The ASGI app (FastAPI) over a set of models."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        # Runs after uvicorn stopped accepting and in-flight requests finished: drain the
        # batchers off the loop so a slow batch does not block anything else.
        await asyncio.get_running_loop().run_in_executor(None, registry.close)

    app = FastAPI(title="attnx", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.registry = registry
    app.state.metrics = metrics

    def error(status: int, message: str) -> Response:
        return Response(proto.error_body(message), status_code=status, media_type="application/json")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return error(exc.status_code, f"{detail}: {request.method} {request.url.path}")

    @app.exception_handler(proto.ProtocolError)
    async def _protocol_error(request: Request, exc: proto.ProtocolError):
        return error(exc.status, exc.message)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        return error(500, f"internal error: {type(exc).__name__}: {exc}")

    # --- health and metadata ---------------------------------------------------
    @app.get("/v2/health/live")
    async def live():
        return JSONResponse({"live": True})

    @app.get("/v2/health/ready")
    async def ready():
        ok = all(not m.batcher.closed for m in registry.models.values())
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/v2")
    async def server_metadata():
        version = getattr(attnx, "__version__", "0")
        return JSONResponse({"name": SERVER_NAME, "version": version, "extensions": EXTENSIONS})

    @app.get("/v2/models/{name}")
    @app.get("/v2/models/{name}/versions/{version}")
    async def model_metadata(name: str, version: str | None = None):
        return JSONResponse(registry.get(name, version).metadata())

    @app.get("/v2/models/{name}/ready")
    @app.get("/v2/models/{name}/versions/{version}/ready")
    async def model_ready(name: str, version: str | None = None):
        model = registry.get(name, version)
        ok = not model.batcher.closed
        return JSONResponse({"name": name, "ready": ok}, status_code=200 if ok else 503)

    @app.get("/v2/models/{name}/config")
    @app.get("/v2/models/{name}/versions/{version}/config")
    async def model_config(name: str, version: str | None = None):
        return JSONResponse(registry.get(name, version).config())

    @app.post("/v2/repository/index")
    async def repository_index():
        return JSONResponse(
            [{"name": m.name, "version": m.version, "state": "READY"} for m in registry.models.values()]
        )

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # --- inference ---------------------------------------------------------------
    @app.post("/v2/models/{name}/infer")
    @app.post("/v2/models/{name}/versions/{version}/infer")
    async def infer(name: str, request: Request, version: str | None = None):
        started = time.perf_counter()
        label = name if name in registry.models else "_unknown_"  # bounded label cardinality
        try:
            model = registry.get(name, version)
            body = await _read_body(request, limits.max_body_bytes)
            body = proto.decompress(body, request.headers.get("content-encoding"), limits.max_body_bytes)
            header_length = request.headers.get("inference-header-content-length")
            sig = model.signature
            if len(body) > _OFFLOAD_PARSE_BYTES:
                parsed = await asyncio.to_thread(proto.parse_infer_request, body, header_length, sig, limits)
            else:
                parsed = proto.parse_infer_request(body, header_length, sig, limits)
            outputs = await _run(model, parsed)
            encode = functools.partial(
                proto.encode_infer_response, model.name, model.version, parsed, outputs, model.session.output_names
            )
            # Turning a big output into JSON text takes a while: not on the event loop.
            big = sum(a.nbytes for a in outputs.values()) > _OFFLOAD_PARSE_BYTES
            payload, json_len = await asyncio.to_thread(encode) if big else encode()
        except proto.ProtocolError as e:
            metrics.failure(label, e.reason)
            return error(e.status, e.message)
        except Exception as e:  # noqa: BLE001 - the server never dies on a request
            metrics.failure(label, "internal")
            return error(500, f"internal error: {type(e).__name__}: {e}")
        metrics.success(label, time.perf_counter() - started)
        if json_len is None:
            return Response(payload, media_type="application/json")
        return Response(
            payload,
            media_type="application/octet-stream",
            headers={"Inference-Header-Content-Length": str(json_len)},
        )

    return app


async def _read_body(request, limit: int) -> bytes:
    """The body, refusing (413) as soon as it is known to exceed ``limit``."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise proto.BadRequest("invalid Content-Length")
        if int(declared) > limit:
            raise proto.TooLarge(f"body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise proto.TooLarge(f"body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _run(model: ServedModel, parsed: proto.InferRequest) -> dict[str, np.ndarray]:
    """Hand the request to the model's batcher and await its own result."""
    try:
        future = model.batcher.submit(parsed.feeds, output_names=parsed.outputs, timeout_ms=parsed.timeout_ms)
    except InputError as e:
        raise proto.BadRequest(str(e)) from None
    except QueueFullError as e:
        raise Overloaded(str(e)) from None
    except BatcherClosedError as e:
        err = Overloaded(str(e))
        err.reason = "shutting_down"
        raise err from None
    try:
        return await asyncio.wrap_future(future)
    except RequestTimeoutError as e:
        err = Overloaded(str(e))
        err.reason = "timeout"
        raise err from None
    except BatcherClosedError as e:
        err = Overloaded(str(e))
        err.reason = "shutting_down"
        raise err from None


# --------------------------------------------------------------------------------------
# Building and running a server
# --------------------------------------------------------------------------------------


def parse_model_args(args: list[str]) -> list[tuple[str, Path]]:
    """``["a.onnx", "big=b.onnx"]`` -> ``[("a", a.onnx), ("big", b.onnx)]`` (name = file stem by default)."""
    out = []
    for arg in args:
        name, sep, path = arg.partition("=")
        if sep and name and "/" not in name and os.sep not in name:
            out.append((name, Path(path)))
        else:
            out.append((Path(arg).stem, Path(arg)))
    return out


class _QuietExitServer(uvicorn.Server):
    """uvicorn, minus re-raising the stop signal after its graceful shutdown.

    uvicorn re-raises SIGINT/SIGTERM once it has shut down, which turns a clean,
    intended stop into exit status 130/143; a server stopped on purpose exits 0.
    A second Ctrl-C still forces the exit (``should_exit`` is already set).
    """

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()


class InferenceServer:
    """Models + batchers + metrics + uvicorn, runnable in the foreground or a background thread.

    >>> server = InferenceServer({"encoder": "attnx-out/model.onnx"}, port=0)
    >>> server.start()          # background thread; returns when it accepts connections
    >>> server.url              # 'http://127.0.0.1:43817'
    >>> server.stop()           # graceful: in-flight requests finish first

    ``models`` maps names to model files or already-loaded sessions. ``port=0``
    takes a free port (the socket is bound here, so there is no race).
    """

    def __init__(
        self,
        models: Mapping[str, str | os.PathLike | Session],
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        batching: BatcherConfig | None = None,
        limits: proto.Limits | None = None,
        device: str = "auto",
        threads: int | None = None,
        graceful_timeout_s: float = 30.0,
        log_level: str = "warning",
    ):
        if not models:
            raise ValueError("no models to serve")
        self.config = ServerConfig(host, port, graceful_timeout_s, log_level)
        self.batching = batching or BatcherConfig()
        self.limits = limits or proto.Limits()
        self.metrics = ServerMetrics()
        self.registry = ModelRegistry()
        for name, model in models.items():
            session = model if isinstance(model, Session) else load(model, device=device, threads=threads)
            batcher = DynamicBatcher(session, self.batching, observer=self.metrics.observer(name), name=name)
            self.metrics.queue_depth.labels(model=name).set_function(lambda b=batcher: b.queue_depth)
            self.registry.add(ServedModel(name, session, batcher, limits=self.limits))
        self.app = create_app(self.registry, self.metrics, self.limits)
        self._socket: socket.socket | None = None
        self._bound_port: int | None = None
        self._uvicorn = None
        self._thread: threading.Thread | None = None

    @property
    def models(self) -> dict[str, ServedModel]:
        return self.registry.models

    def _bind(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets that say they are
        # TCP, and without it Nagle + delayed ACKs add ~40 ms to every response in two writes.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.config.host, self.config.port))
        sock.listen(2048)
        sock.set_inheritable(True)
        return sock

    def _make_uvicorn(self):
        config = uvicorn.Config(
            self.app,
            log_level=self.config.log_level,
            access_log=False,
            timeout_graceful_shutdown=self.config.graceful_timeout_s,
            lifespan="on",
        )
        self._uvicorn = _QuietExitServer(config)
        return self._uvicorn

    @property
    def port(self) -> int:
        """The port it listens on (the chosen one when constructed with port 0)."""
        return self._bound_port if self._bound_port is not None else self.config.port

    @property
    def address(self) -> str:
        """``host:port``, the form ``tritonclient`` takes."""
        host = self.config.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def bind(self) -> "InferenceServer":
        """Bind the listening socket now (so ``url`` knows a port 0 choice before serving)."""
        if self._socket is None:
            self._socket = self._bind()
            self._bound_port = self._socket.getsockname()[1]
        return self

    def serve(self) -> None:
        """Run in the foreground until Ctrl-C / SIGTERM (uvicorn handles the signals gracefully)."""
        self.bind()
        server = self._make_uvicorn()
        try:
            server.run(sockets=[self._socket])
        finally:
            self.registry.close()
            self._socket.close()

    def start(self, timeout: float = 30.0) -> "InferenceServer":
        """Run in a background thread; return once it accepts connections."""
        self.bind()
        server = self._make_uvicorn()
        self._thread = threading.Thread(
            target=server.run, kwargs={"sockets": [self._socket]}, name="attnx-server", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread exited during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not start in time")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Graceful stop: no new connections, in-flight requests finish, batchers drain."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout if timeout is not None else self.config.graceful_timeout_s + 10)
            self._thread = None
        self.registry.close()
        if self._socket is not None:
            self._socket.close()

    def __enter__(self) -> "InferenceServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
