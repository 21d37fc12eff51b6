"""``attnx serve`` in process: :class:`InferenceServer` loads the models, builds the one request path and runs it.

``core/`` runs models (sessions, the dynamic batcher, tokenising, generation); ``wire/`` is what every request
goes through (the error taxonomy and its status tables, the envelope, limits and the worker policy, the HTTP
app, the gRPC front end, API key, metrics); ``serving/`` is the served models (their protocol, the registry, the
encoder model, the encoding service, the routes' shared state); ``apis/`` are the served APIs over them. Shutdown
(Ctrl-C, SIGTERM or :meth:`InferenceServer.stop`) stops accepting connections, lets in-flight requests
finish, then drains and closes the models.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import uvicorn
from fastapi.openapi.utils import get_openapi

from attnx.runtime.apis import completions, explain, generate, kserve, openai, scoring, tei, tokenize
from attnx.runtime.apis.requests import openapi_schemas
from attnx.runtime.config import ServingConfig
from attnx.runtime.core.batcher import DynamicBatcher
from attnx.runtime.core.chat import Renderer
from attnx.runtime.core.loading import load
from attnx.runtime.core.session import Session
from attnx.runtime.core.text import TextTokenizer, prepare_text_model
from attnx.runtime.serving.encoder import EncoderModel
from attnx.runtime.serving.encoding import Dimensions
from attnx.runtime.serving.generation import GenerationModel, is_generator
from attnx.runtime.serving.model import ServedModel
from attnx.runtime.serving.registry import ModelRegistry
from attnx.runtime.serving.state import Serving
from attnx.runtime.wire.auth import ApiKey, ApiKeyMiddleware, GrpcApiKeyInterceptor
from attnx.runtime.wire.envelope import Envelope
from attnx.runtime.wire.http import create_app
from attnx.runtime.wire.http_guard import protocol_class
from attnx.runtime.wire.limits import ByteBudget, Workers
from attnx.runtime.wire.metrics import ServerMetrics

#: Protocol extensions we implement (Triton names).
EXTENSIONS = ["binary_tensor_data", "model_repository(index)", "statistics(prometheus)", "generate"]
ROUTERS = [kserve.router, openai.router, completions.router, tokenize.router, tei.router, scoring.router,
           generate.router, explain.router]


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


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``; a busy port is an OSError naming it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and without it
    # Nagle + delayed ACKs add ~40 ms to every response in two writes.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise OSError(e.errno, f"cannot listen on {where}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def check_ports(host: str, *ports: int | None) -> None:
    """Refuse a busy port before any model loads (``attnx serve`` binds for real once they have)."""
    for port in ports:
        if port:  # 0 and None: any free port, none
            listen_socket(host, port).close()


class _QuietExitServer(uvicorn.Server):
    """uvicorn, minus re-raising the stop signal after its graceful shutdown (a server stopped on purpose exits
    0, not 130/143). A second Ctrl-C still forces the exit (``should_exit`` is already set)."""

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()


class InferenceServer:
    """Models + the request path + uvicorn, runnable in the foreground or a background thread.

    >>> server = InferenceServer({"encoder": "attnx-out/model.onnx"}, ServingConfig(port=0))
    >>> server.start()          # background thread; returns when it accepts connections
    >>> server.url              # 'http://127.0.0.1:43817'
    >>> server.stop()           # graceful: in-flight requests finish first

    ``models``: names -> model files or loaded sessions (with-past exports generate text). ``config``
    (:class:`~attnx.runtime.config.ServingConfig`, default ``attnx serve``'s): every setting; ``port=0`` takes a
    free port (bound here: no race). Per model, beside it: ``tokenizers`` (model names, or ``None``: every model
    -> a tokenizer folder, for files that carry none), ``axes`` (:class:`~attnx.runtime.core.axes.AxisFlags`:
    axes the file does not name), ``dimensions`` (:class:`~attnx.runtime.serving.encoding.Dimensions`: which
    embedders may be cut shorter). ``on_warning`` hears start-up warnings (default: the ``attnx.serve`` logger).
    :attr:`app` is the ASGI app (Ray Serve and other hosts mount it).
    """

    def __init__(self, models: Mapping[str, str | os.PathLike | Session], config: ServingConfig | None = None, *,
                 tokenizers: Mapping[str | None, str | os.PathLike] | None = None, axes=None, dimensions=None,
                 on_warning: Callable[[str], None] | None = None):
        if not models:
            raise ValueError("no models to serve")
        self.config = config = config or ServingConfig()  # checked on construction: an empty API key is refused
        key = ApiKey(config.api_key) if config.api_key is not None else None
        self.host, self.requested_port, self.graceful_timeout_s = config.host, config.port, config.graceful_timeout_s
        self.http_limits, self.batching, self.limits = config.http_limits, config.batching, config.limits
        self.metrics = ServerMetrics()
        self.registry = ModelRegistry()
        self.budget = ByteBudget(self.limits.decode_budget)  # shared by HTTP and gRPC
        self.warnings: list[str] = []
        self.chat = Renderer()
        try:
            self._load(models, dict(tokenizers or {}), axes)
        except BaseException:
            self.registry.close(drain=False)
            self.chat.close()
            raise
        for message in self.warnings:
            (on_warning or logging.getLogger("attnx.serve").warning)(message)
        self.state = Serving(self.registry, Envelope(self.metrics, self.limits, self.budget, Workers()), self.metrics,
                             self.limits, self.chat, dimensions or Dimensions(), list(EXTENSIONS),
                             string_cap=_string_cap(self.registry))
        self.app = create_app(self.state, ROUTERS, on_shutdown=self._on_shutdown, openapi=_openapi)
        if key is not None:
            self.app.add_middleware(ApiKeyMiddleware, key=key)
        self.grpc = None
        if config.grpc_port is not None:  # KServe v2 and TEI's tei.v1 on one port
            from attnx.runtime.apis.kserve_grpc import Servicer
            from attnx.runtime.apis.tei_grpc import TeiService
            from attnx.runtime.wire.grpc import GrpcFrontEnd

            self.grpc = GrpcFrontEnd([Servicer(self.state), TeiService(self.state)], self.limits, host=self.host,
                                     port=config.grpc_port, interceptors=[GrpcApiKeyInterceptor(key)] if key else [])
        self._socket: socket.socket | None = None
        self._bound_port: int | None = None
        self._uvicorn: _QuietExitServer | None = None
        self._thread: threading.Thread | None = None

    def _load(self, models, tokenizers, axes) -> None:
        device, threads = self.config.device, self.config.threads
        for name, model in models.items():
            session = model if isinstance(model, Session) else load(model, device=device, threads=threads, axes=axes)
            folder = tokenizers.get(name, tokenizers.get(None))
            tokenizer = (TextTokenizer.from_folder(folder, self.limits.max_seq) if folder is not None
                         else TextTokenizer.from_export(session.path, session.info))
            if is_generator(session):  # batched per decoding step, not per request: its own scheduler
                generator = GenerationModel.load(name, session, tokenizer, max_batch=self.batching.max_batch_size,
                                                 max_queue=self.batching.max_queue_size,
                                                 max_positions=self.limits.max_positions)
                generator.configure(max_new_tokens=self.config.max_new_tokens)
                self.registry.add(generator)
                if generator.chat is not None:
                    self.chat.warm(name)  # its own render pool
            else:
                if tokenizer is not None:  # refused at load if it cannot feed this model; pooled as its folder says
                    session = prepare_text_model(session, tokenizer, folder, self.warnings.append)
                batcher = DynamicBatcher(session, self.batching, observer=self.metrics.observer(name), name=name,
                                         pad_id=tokenizer.pad_id if tokenizer is not None else None)
                self.registry.add(EncoderModel(name, session, batcher, limits=self.limits, tokenizer=tokenizer))
                if not batcher.layout.can_batch and self.batching.max_batch_size > 1:
                    self.warnings.append(f"model {name!r}: {batcher.layout.verdict()}")
            served = self.registry.models[name]
            self.metrics.queue_depth.labels(model=name).set_function(functools.partial(_queue_depth, served))

    def _on_shutdown(self) -> None:
        """Before the models close: gRPC stops, generations in progress finish."""
        if self.grpc is not None:
            self.grpc.stop(self.graceful_timeout_s)
        for g in self.generators.values():
            g.close(drain=True, timeout=self.graceful_timeout_s)
        self.chat.close()

    def describe(self) -> str:
        """What each model takes and gives, and how its requests are batched (``attnx serve --describe``)."""
        return "\n".join(line for m in self.registry.models.values() for line in m.describe())

    @property
    def models(self) -> dict[str, ServedModel]:
        """Every served model by name (encoders and text generators)."""
        return self.registry.models

    @property
    def generators(self) -> dict[str, GenerationModel]:
        return {n: m for n, m in self.registry.models.items() if isinstance(m, GenerationModel)}

    # --- listening ---------------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        """The port it listens on (the chosen one when constructed with port 0)."""
        return self._bound_port or self.requested_port

    @property
    def address(self) -> str:
        """``host:port``, the form ``tritonclient`` takes."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def grpc_address(self) -> str | None:
        """``host:port`` of the gRPC service (what ``tritonclient.grpc`` takes), once bound."""
        return self.grpc.address if self.grpc is not None and self.grpc.port else None

    def bind(self) -> "InferenceServer":
        """Bind the listening sockets now (so ``url`` and ``grpc_address`` know a port 0 choice before
        serving); the gRPC service starts answering here."""
        if self._socket is None:
            self._socket = listen_socket(self.host, self.requested_port)
            self._bound_port = self._socket.getsockname()[1]
            if self.grpc is not None:
                try:
                    self.grpc.start()
                except BaseException:
                    self._socket.close()
                    self._socket = None
                    raise
        return self

    def _make_uvicorn(self):
        config = uvicorn.Config(self.app, log_level=self.config.log_level, access_log=False, lifespan="on",
                                # uvicorn annotates an int; it hands the seconds to asyncio.wait_for (a float).
                                timeout_graceful_shutdown=self.graceful_timeout_s,  # type: ignore[arg-type]
                                # Header size/count, idle heads and descriptors are bounded per connection.
                                http=protocol_class(self.http_limits),
                                h11_max_incomplete_event_size=self.http_limits.max_header_bytes)
        self._uvicorn = _QuietExitServer(config)
        return self._uvicorn

    def serve(self) -> None:
        """Run in the foreground until Ctrl-C / SIGTERM (uvicorn handles the signals gracefully)."""
        self.bind()
        sock = self._socket
        assert sock is not None  # bind() made it
        try:
            self._make_uvicorn().run(sockets=[sock])
        finally:
            self._on_shutdown()
            self.registry.close()
            sock.close()

    def start(self, timeout: float = 30.0) -> "InferenceServer":
        """Run in a background thread; return once it accepts connections."""
        self.bind()
        server = self._make_uvicorn()
        self._thread = threading.Thread(target=server.run, kwargs={"sockets": [self._socket]}, name="attnx-server",
                                        daemon=True)
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
        """Graceful stop: no new connections, in-flight requests finish, models drain."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout if timeout is not None else self.graceful_timeout_s + 10)
            self._thread = None
        self._on_shutdown()
        self.registry.close()
        if self._socket is not None:
            self._socket.close()

    def __enter__(self) -> "InferenceServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _queue_depth(model: ServedModel) -> int:
    return model.queue_depth


def _string_cap(registry: ModelRegistry) -> int | None:
    """The most characters any served model reads of one text (None: some model states no limit)."""
    caps = [m.tokenizer.char_cap for m in registry.models.values() if m.tokenizer is not None]
    known = [c for c in caps if c is not None]
    return max(known) if known and len(known) == len(caps) else None


def _openapi(app) -> dict:
    """The OpenAPI document: every route, and the schema of every JSON body (read by the envelope)."""
    schema = get_openapi(title="attnx", version=app.version, routes=app.routes,
                         description="attnx serve: KServe v2, OpenAI, TEI, Cohere/Jina rerank, Infinity classify, "
                                     "Triton generate, over one model registry.")
    schema.setdefault("components", {}).setdefault("schemas", {}).update(openapi_schemas(tokenize.BODIES))
    return schema
