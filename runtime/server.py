"""An inference server speaking KServe v2 / the Open Inference Protocol as Triton does, over HTTP and gRPC.

The unmodified ``tritonclient.http`` and ``tritonclient.grpc`` clients work against it. HTTP endpoints:

- ``GET  /v2/health/live``, ``/v2/health/ready``, ``/v2`` (server metadata)
- ``GET  /v2/models/{m}[/versions/{v}]`` (model metadata), ``.../ready``, ``.../config``
- ``POST /v2/models/{m}[/versions/{v}]/infer``: JSON tensors and the binary tensor data extension
- ``POST /v2/repository/index``; ``GET /metrics`` (Prometheus)
- the OpenAI embeddings API (``/v1/embeddings``, ``/v1/models``: :mod:`attnx.runtime.apis.openai`) and TEI's
  ``/embed``, ``/predict``, ``/rerank``, ``/info``, ``/health`` (:mod:`attnx.runtime.apis.tei`), Cohere/Jina's
  ``/v1/rerank`` (:mod:`attnx.runtime.apis.rerank`) and Infinity's ``/classify``
  (:mod:`attnx.runtime.apis.classify`), on the same batchers and limits; with
  ``api_key``, a bearer key on everything but health (:mod:`attnx.runtime.wire.auth`)

The gRPC service (:mod:`attnx.runtime.wire.grpc`) runs beside it when a gRPC port is given.
Models that carry a tokenizer (or get one with ``tokenizers=``) take text as a ``BYTES`` input.

Each model has a :class:`~attnx.runtime.core.batcher.DynamicBatcher` (one worker
thread), so the event loop never waits on compute; bodies over 32 KB are decoded
and big responses encoded in one codec thread, so it never waits on parsing
either (health probes stay fast under JSON load). Admission, before the body is
read: a full queue answers 503 at once, and the bytes of bodies being read and
decoded are bounded (:class:`~attnx.runtime.wire.limits.ByteBudget`, shared with
gRPC). Errors are ``{"error": "..."}``: 400 bad input, 404 unknown model or
version, 413 body over the limit (or more work than can start before the
queue deadline, :mod:`~attnx.runtime.core.pacing`), 422 for a JSON output the request's
inputs drove to NaN/Inf (which JSON cannot carry; binary can), 431 / 408 for a
request head too large or too slow (:mod:`~attnx.runtime.wire.http_guard`), 503
overload (queue full, decode budget, queue timeout, shutting down; with
``Retry-After``), 500 for bugs. A client
that disconnects mid-body is counted as ``client_disconnect``, not an error.

Shutdown (Ctrl-C, SIGTERM or :meth:`InferenceServer.stop`) stops accepting
connections, lets in-flight requests finish, then drains and closes the batchers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

import attnx
import attnx.runtime.apis.kserve_json as codec
import attnx.runtime.apis.kserve_tensors as proto
from attnx.runtime.apis import registry as service
from attnx.runtime.wire.limits import ByteBudget, declared_length, read_body
from attnx.runtime.wire.auth import ApiKey, ApiKeyMiddleware, GrpcApiKeyInterceptor
from attnx.runtime.core.batcher import BatcherConfig, BatchLayout, DynamicBatcher
from attnx.runtime.wire.http_guard import HttpLimits, protocol_class
from attnx.runtime.apis.embeddings import Dimensions, EmbeddingApi
from attnx.runtime.wire.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from attnx.runtime.apis.openai import add_openai_routes
from attnx.runtime.apis.registry import ModelRegistry, ServedModel
from attnx.runtime.core.session import Session, load, public_message
from attnx.runtime.apis.tei import add_tei_routes
from attnx.runtime.apis.rerank import add_rerank_routes
from attnx.runtime.apis.classify import add_classify_routes
from attnx.runtime.apis.completions import GenerationApi, add_completion_routes
from attnx.runtime.apis.generate import add_generate_routes
from attnx.runtime.apis.generation import GenerationModel, is_generator
from attnx.runtime.core.text import TextTokenizer, prepare_text_model

SERVER_NAME = "attnx"
#: Protocol extensions we implement (Triton names).
EXTENSIONS = ["binary_tensor_data", "model_repository(index)", "statistics(prometheus)", "generate"]
#: Parse/encode bodies larger than this in a worker thread, so big JSON does not stall the loop.
_OFFLOAD_PARSE_BYTES = 32 << 10
#: All-JSON answers with more output bytes than this are streamed in pieces (http_codec.stream_json_response).
_STREAM_JSON_BYTES = 1 << 20
log = logging.getLogger("attnx.serve")

Overloaded = proto.Overloaded  # kept importable from here


@dataclass
class ServerConfig:
    """Network and lifecycle settings (the batching and size limits live with each model)."""

    host: str = "127.0.0.1"
    port: int = 8000
    graceful_timeout_s: float = 30.0
    log_level: str = "warning"
    grpc_port: int | None = None


def create_app(registry: ModelRegistry, metrics: ServerMetrics, limits: proto.Limits,
               on_shutdown: Callable[[], None] | None = None, budget: ByteBudget | None = None):
    """The ASGI app (FastAPI) over a set of models. ``on_shutdown`` runs before the batchers close
    (the gRPC front end stops there, so its in-flight calls finish too); ``budget`` bounds the bytes of
    bodies being read and decoded at once (shared with gRPC; default: its own, of ``limits.decode_budget``)."""
    budget = budget or ByteBudget(limits.decode_budget)
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        # Runs after uvicorn stopped accepting and in-flight requests finished: drain the
        # batchers off the loop so a slow batch does not block anything else.
        loop = asyncio.get_running_loop()
        if on_shutdown is not None:
            await loop.run_in_executor(None, on_shutdown)
        await loop.run_in_executor(None, registry.close)
        codec_pool.shutdown(wait=False)

    app = FastAPI(title="attnx", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.registry = registry
    app.state.metrics = metrics

    def error(status: int, message: str) -> Response:
        headers = {"Retry-After": "1"} if status == 503 else None  # overload is temporary: say when to retry
        return Response(codec.error_body(message), status_code=status, media_type="application/json",
                        headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return error(exc.status_code, f"{detail}: {request.method} {request.url.path}")

    @app.exception_handler(proto.ProtocolError)
    async def _protocol_error(request: Request, exc: proto.ProtocolError):
        return error(exc.status, exc.message)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        return error(500, f"internal error: {type(exc).__name__}: {public_message(str(exc))}")

    # --- health and metadata ---------------------------------------------------
    @app.get("/v2/health/live")
    async def live():
        return JSONResponse({"live": True})

    @app.get("/v2/health/ready")
    async def ready():
        ok = registry.ready
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
    # Decoding JSON and encoding big outputs hold the GIL in C code: in one thread, so the event loop
    # (health probes, other requests' I/O) competes with one such thread only. (Two threads decode no
    # faster under the GIL, and doubled health-probe latency under 40 JSON clients in
    # benchmarks/bench_server_load.py.)
    codec_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="attnx-codec")
    admitted: dict[str, int] = {}  # per model: requests let in whose body is not queued yet

    async def off_loop(fn):
        return await asyncio.get_running_loop().run_in_executor(codec_pool, fn)

    @app.post("/v2/models/{name}/infer")
    @app.post("/v2/models/{name}/versions/{version}/infer")
    async def infer(name: str, request: Request, version: str | None = None):
        started = time.perf_counter()
        label = name if name in registry.models else "_unknown_"  # bounded label cardinality
        try:
            model = registry.get(name, version)
            size = declared_length(request, limits.max_body_bytes)
            # Overload is refused before a byte of the body is read, whatever its size.
            queue = model.batcher
            if queue.queue_depth + admitted.get(name, 0) >= queue.config.max_queue_size:
                raise proto.Overloaded(f"model {name!r}: queue full ({queue.config.max_queue_size} requests)")
            admitted[name] = admitted.get(name, 0) + 1
            try:
                async with budget.hold(limits.max_body_bytes if size is None else size, limits.decode_wait_s):
                    parsed = await read_and_parse(request, model, size)
            finally:
                admitted[name] -= 1
            outputs = await service.infer(model, parsed)
            if sum(a.nbytes for a in outputs.values()) > _STREAM_JSON_BYTES:
                pieces = codec.stream_json_response(model.name, model.version, parsed, outputs,
                                                    model.session.output_names)
                if pieces is not None:  # a big all-JSON answer goes out a piece at a time, never whole
                    metrics.success(label, time.perf_counter() - started)
                    return StreamingResponse(pieces, media_type="application/json")
            encode = functools.partial(
                codec.encode_infer_response, model.name, model.version, parsed, outputs, model.session.output_names
            )
            big = sum(a.nbytes for a in outputs.values()) > _OFFLOAD_PARSE_BYTES
            payload, json_len = await off_loop(encode) if big else encode()
        except proto.ProtocolError as e:
            metrics.failure(label, e.reason)
            return error(e.status, e.message)
        except ClientDisconnect:  # the client went away mid-body: its time-out, not our error
            metrics.failure(label, "client_disconnect")
            return error(499, "client disconnected")
        except Exception as e:  # noqa: BLE001 - the server never dies on a request
            metrics.failure(label, "internal")
            log.exception("internal error in an infer request")
            return error(500, f"internal error: {type(e).__name__}: {public_message(str(e))}")
        metrics.success(label, time.perf_counter() - started)
        if json_len is None:
            return Response(payload, media_type="application/json")
        return Response(
            payload,
            media_type="application/octet-stream",
            headers={"Inference-Header-Content-Length": str(json_len)},
        )

    async def read_and_parse(request: Request, model: ServedModel, size: int | None) -> proto.InferRequest:
        body = await read_body(request, limits.max_body_bytes, size)
        encoding = request.headers.get("content-encoding")
        header_length = request.headers.get("inference-header-content-length")
        parse = functools.partial(_decode, body, encoding, header_length, model.signature, limits)
        return await off_loop(parse) if len(body) > _OFFLOAD_PARSE_BYTES or encoding else parse()

    from attnx.runtime.apis.explain import add_explain_routes

    add_explain_routes(app, registry)  # /explain: attention pages computed by the served models
    return app


def _decode(body, encoding, header_length, sig, limits) -> proto.InferRequest:
    body = codec.decompress(body, encoding, limits.max_body_bytes)
    return codec.parse_infer_request(body, header_length, sig, limits)


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
    takes a free port (the socket is bound here, so there is no race); ``grpc_port`` (0: any free
    one) adds the gRPC service. ``tokenizers`` maps model names (or ``None``: every model) to a
    tokenizer folder, for files that carry none; ``axes`` (an :class:`~attnx.runtime.core.axes.AxisFlags`)
    names batch/sequence axes the file does not. ``on_warning`` hears each start-up warning (a model
    served unbatched), by default the ``attnx.serve`` logger. The OpenAI (``/v1/embeddings``) and TEI
    (``/embed``) routes serve every model with a tokenizer and a sentence embedding; ``dimensions`` (an
    :class:`~attnx.runtime.apis.embeddings.Dimensions`) says which may be cut shorter. ``api_key``: every route
    but the health checks, HTTP and gRPC, then needs ``Authorization: Bearer KEY`` (:mod:`attnx.runtime.wire.auth`).
    ``http_limits`` (:class:`~attnx.runtime.wire.http_guard.HttpLimits`) bounds each connection's request head
    (431), the time to send it (408) and the descriptors idle connections may hold.
    """

    def __init__(
        self,
        models: Mapping[str, str | os.PathLike | Session],
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        grpc_port: int | None = None,
        batching: BatcherConfig | None = None,
        limits: proto.Limits | None = None,
        device: str = "auto",
        threads: int | None = None,
        graceful_timeout_s: float = 30.0,
        log_level: str = "warning",
        tokenizers: Mapping[str | None, str | os.PathLike] | None = None,
        axes=None,
        on_warning: Callable[[str], None] | None = None,
        api_key: str | None = None,
        dimensions=None,
        http_limits: HttpLimits | None = None,
    ):
        if not models:
            raise ValueError("no models to serve")
        self.http_limits = http_limits or HttpLimits()
        self.config = ServerConfig(host, port, graceful_timeout_s, log_level, grpc_port)
        self.batching = batching or BatcherConfig()
        self.limits = limits or proto.Limits()
        self.metrics = ServerMetrics()
        self.registry = ModelRegistry()
        self.budget = ByteBudget(self.limits.decode_budget)  # shared by HTTP and gRPC
        self.warnings: list[str] = []
        tokenizers = dict(tokenizers or {})
        self.generators: dict = {}  # with-past exports: text generation (attnx.runtime.apis.generation)
        for name, model in models.items():
            session = model if isinstance(model, Session) else load(model, device=device, threads=threads, axes=axes)
            folder = tokenizers.get(name, tokenizers.get(None))
            tokenizer = (TextTokenizer.from_folder(folder, self.limits.max_seq) if folder is not None
                         else TextTokenizer.from_export(session.path, session.info))
            if is_generator(session):  # batched per decoding step, not per request: its own scheduler
                if name in self.generators:
                    raise ValueError(f"two models named {name!r} (use name=path to rename one)")
                self.generators[name] = GenerationModel.load(name, session, tokenizer,
                                                             max_batch=self.batching.max_batch_size,
                                                             max_queue=self.batching.max_queue_size)
                continue
            if tokenizer is not None:  # refused at load if it cannot feed this model; pooled as its folder says
                session = prepare_text_model(session, tokenizer, folder, self.warnings.append)
            batcher = DynamicBatcher(session, self.batching, observer=self.metrics.observer(name), name=name,
                                     pad_id=tokenizer.pad_id if tokenizer is not None else None)
            self.metrics.queue_depth.labels(model=name).set_function(lambda b=batcher: b.queue_depth)
            self.registry.add(ServedModel(name, session, batcher, limits=self.limits, tokenizer=tokenizer))
            if not batcher.layout.can_batch and self.batching.max_batch_size > 1:
                self.warnings.append(f"model {name!r}: {batcher.layout.verdict()}")
        for message in self.warnings:
            (on_warning or log.warning)(message)
        self.app = create_app(self.registry, self.metrics, self.limits, on_shutdown=self._on_shutdown,
                              budget=self.budget)
        # The OpenAI and TEI embedding routes: the same models, batchers, limits, budget and metrics.
        api = EmbeddingApi(self.registry, self.metrics, self.limits, self.budget, dimensions or Dimensions())
        self.grpc = None
        key = ApiKey(api_key) if api_key else None
        if grpc_port is not None:  # KServe v2 and TEI's tei.v1 on one port
            from attnx.runtime.wire.grpc import GrpcFrontEnd
            from attnx.runtime.apis.tei_grpc import generic_handlers

            self.grpc = GrpcFrontEnd(self.registry, self.metrics, self.limits, host=host, port=grpc_port,
                                     extensions=EXTENSIONS, budget=self.budget,
                                     interceptors=[GrpcApiKeyInterceptor(key)] if key else [],
                                     handlers=generic_handlers(api))
        add_openai_routes(self.app, api)
        add_tei_routes(self.app, api)
        add_rerank_routes(self.app, api)  # sequence classifiers: Cohere/Jina rerank, Infinity classify
        add_classify_routes(self.app, api)
        # Text generation (with-past exports): Triton's generate extension and OpenAI's completions.
        generation = GenerationApi(self.generators, api)
        api.generation_models = self.generators  # listed by /v1/models too
        add_generate_routes(self.app, generation)
        add_completion_routes(self.app, generation)
        if key:
            self.app.add_middleware(ApiKeyMiddleware, key=key)
        self._socket: socket.socket | None = None
        self._bound_port: int | None = None
        self._uvicorn = None
        self._thread: threading.Thread | None = None

    def _stop_grpc(self) -> None:
        if self.grpc is not None:
            self.grpc.stop(self.config.graceful_timeout_s)

    def _on_shutdown(self) -> None:
        """Before the batchers close: gRPC stops, generations in progress finish."""
        self._stop_grpc()
        for g in self.generators.values():
            g.close(drain=True, timeout=self.config.graceful_timeout_s)

    def describe(self) -> str:
        """What each model takes and gives, and how its requests are batched (``attnx serve --describe``)."""
        from attnx.runtime.core.axes import describe_axes

        lines = []
        for name, m in self.models.items():
            layout: BatchLayout = m.batcher.layout
            lines.append(f"model {name}: {m.session.path} ({m.session.provider})")
            lines += describe_axes(m.session.axis_decisions, m.session.inputs + m.session.outputs)
            if m.tokenizer is not None:
                t = m.tokenizer
                lines.append(f"  text input {proto.TEXT_INPUT!r} (BYTES [-1]): {t.file}, max length {t.max_length}, "
                             f"truncation {t.truncation_side}, pad id {t.pad_id}")
            pooling = getattr(m.session, "pooling", None)
            if pooling is not None:
                lines.append(f"  sentence_embedding: last_hidden_state, {pooling.describe()}")
            lines.append(f"  -> {layout.verdict()}")
            cfg = m.batcher.config
            lines.append(f"  -> at most {cfg.max_batch_size} rows and "
                         f"{cfg.max_batch_tokens if cfg.max_batch_tokens else 'any number of'} tokens a batch")
            unpadded = [s.name for s in m.session.outputs if s.seq_axis is not None]
            split = [s.name for s in m.session.outputs if s.seq_axis is None and s.batch_axis is not None]
            if layout.can_batch:
                lines.append(f"  -> outputs cut back to each request's length: {unpadded or '-'}; "
                             f"split by row: {split or '-'}")
        for name, g in self.generators.items():
            cache = g.decoder.layout
            lines.append(f"model {name}: {g.session.path} ({g.session.provider}) generates text")
            lines.append(f"  KV cache: {len(cache.tensors)} tensors ({', '.join(sorted({t.input.split('.', 2)[-1] for t in cache.tensors}))}), "
                         f"{g.decoder.max_positions or '?'} positions, end of sequence {list(cache.eos) or '-'}")
            lines.append(f"  -> batched per decoding step: at most {g.scheduler.max_batch} sequences, "
                         f"{g.scheduler.max_queue} waiting; chat template: {'yes' if g.chat_template else 'no'}")
        return "\n".join(lines)

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
            # Header size/count, idle heads and descriptors are bounded per connection (runtime/http_guard.py).
            http=protocol_class(self.http_limits),
            h11_max_incomplete_event_size=self.http_limits.max_header_bytes,
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
        """Bind the listening sockets now (so ``url`` and ``grpc_address`` know a port 0 choice before
        serving); the gRPC service starts answering here."""
        if self._socket is None:
            self._socket = self._bind()
            self._bound_port = self._socket.getsockname()[1]
            if self.grpc is not None:
                try:
                    self.grpc.start()
                except BaseException:
                    self._socket.close()
                    self._socket = None
                    raise
        return self

    @property
    def grpc_address(self) -> str | None:
        """``host:port`` of the gRPC service (what ``tritonclient.grpc`` takes), once bound."""
        return self.grpc.address if self.grpc is not None and self.grpc.port else None

    def serve(self) -> None:
        """Run in the foreground until Ctrl-C / SIGTERM (uvicorn handles the signals gracefully)."""
        self.bind()
        server = self._make_uvicorn()
        try:
            server.run(sockets=[self._socket])
        finally:
            self._stop_grpc()
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
        self._on_shutdown()
        self.registry.close()
        if self._socket is not None:
            self._socket.close()

    def __enter__(self) -> "InferenceServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
