"""KServe v2 over gRPC (``attnx serve --grpc-port``): the ``inference.GRPCInferenceService`` that
``tritonclient.grpc`` talks to, beside the HTTP server, over the same models and batchers.

The protocol's messages and service stubs are the generated ones ``tritonclient`` ships
(``tritonclient.grpc.service_pb2`` / ``service_pb2_grpc``, Triton's ``grpc_service.proto``), so
nothing is hand-written on the wire. Implemented: ``ServerLive``, ``ServerReady``, ``ModelReady``,
``ServerMetadata``, ``ModelMetadata``, ``ModelConfig``, ``RepositoryIndex`` and ``ModelInfer`` with
``raw_input_contents`` or typed ``contents`` (``BYTES`` text too); outputs go back as
``raw_output_contents``, as Triton sends them. The rest answer ``UNIMPLEMENTED``.

Every request is checked by :func:`attnx.runtime.apis.kserve_tensors.build_infer_request`, exactly as over HTTP,
and errors map to status codes: 400 -> ``INVALID_ARGUMENT``, 404 -> ``NOT_FOUND``, 413 and overload (a
full queue, too many bytes being decoded) -> ``RESOURCE_EXHAUSTED``, a queue time-out ->
``DEADLINE_EXCEEDED``, shutting down -> ``UNAVAILABLE``, anything else -> ``INTERNAL``. A call the client
cancels is counted as ``client_disconnect``, not as an error of ours. The decode budget
(:class:`~attnx.runtime.wire.limits.ByteBudget`) is the HTTP server's, so both share one bound.

TEI's gRPC services (``tei.v1``, :mod:`attnx.runtime.apis.tei_grpc`) are served on the same port.

The gRPC server runs on its own thread and event loop (``grpc.aio``), so it starts, binds (port 0
picks one) and stops independently of uvicorn; requests meet the HTTP ones in the batchers.
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

import attnx
from attnx.runtime.apis import kserve_tensors as proto
from attnx.runtime.apis import registry as service
from attnx.runtime.wire.limits import ByteBudget
from attnx.runtime.wire.metrics import ServerMetrics
from attnx.runtime.core.session import public_message

#: Protocol datatype -> the typed field of ``InferTensorContents`` that carries it (FP16: raw only).
CONTENTS_FIELD = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
                  "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
                  "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
                  "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}
STATUS_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
                413: grpc.StatusCode.RESOURCE_EXHAUSTED, 501: grpc.StatusCode.UNIMPLEMENTED,
                503: grpc.StatusCode.UNAVAILABLE}
#: 503s by reason: overload is the client's cue to back off (as Triton answers a full queue).
OVERLOAD_CODES = {"overload": grpc.StatusCode.RESOURCE_EXHAUSTED, "timeout": grpc.StatusCode.DEADLINE_EXCEEDED}


def status_code(error: proto.ProtocolError) -> grpc.StatusCode:
    if error.status == 503 and error.reason in OVERLOAD_CODES:
        return OVERLOAD_CODES[error.reason]
    return STATUS_CODES.get(error.status, grpc.StatusCode.INTERNAL)


def _parameters(params) -> dict:
    """A protobuf ``map<string, InferParameter>`` as plain Python values."""
    out = {}
    for key, value in params.items():
        which = value.WhichOneof("parameter_choice")
        out[key] = getattr(value, which) if which else None
    return out


def wire_tensors(request) -> list[proto.WireTensor]:
    """A ``ModelInferRequest``'s inputs as transport-neutral tensors."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise proto.BadRequest(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs")
    tensors = []
    for i, item in enumerate(request.inputs):
        tensor = proto.WireTensor(item.name, item.datatype, list(item.shape), _parameters(item.parameters))
        if raw:
            if item.HasField("contents"):
                raise proto.BadRequest(f"input {item.name!r}: both contents and raw_input_contents given")
            tensor.raw = raw[i]
        elif item.HasField("contents"):
            field = CONTENTS_FIELD.get(item.datatype)
            if field is None:
                raise proto.BadRequest(f"input {item.name!r}: datatype {item.datatype!r} has no typed contents "
                                       f"(send raw_input_contents)")
            tensor.contents = getattr(item.contents, field)
        tensors.append(tensor)
    return tensors


def requested_outputs(request) -> list[proto.RequestedOutput] | None:
    if not request.outputs:
        return None
    return [proto.RequestedOutput(o.name, _parameters(o.parameters)) for o in request.outputs]


class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The KServe v2 gRPC service over a :class:`~attnx.runtime.apis.registry.ModelRegistry`."""

    def __init__(self, registry: service.ModelRegistry, metrics: ServerMetrics, limits: proto.Limits,
                 extensions: list[str], budget: ByteBudget | None = None):
        self.registry = registry
        self.metrics = metrics
        self.limits = limits
        self.extensions = extensions
        self.budget = budget or ByteBudget(limits.decode_budget)

    async def _model(self, request, context) -> service.ServedModel:
        try:
            return self.registry.get(request.name, request.version)
        except proto.ProtocolError as e:
            await context.abort(STATUS_CODES[e.status], e.message)

    async def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=self.registry.ready)

    async def ModelReady(self, request, context):
        model = self.registry.models.get(request.name)
        ok = model is not None and request.version in ("", model.version) and not model.batcher.closed
        return service_pb2.ModelReadyResponse(ready=ok)

    async def ServerMetadata(self, request, context):
        return service_pb2.ServerMetadataResponse(name="attnx", version=getattr(attnx, "__version__", "0"),
                                                  extensions=self.extensions)

    async def ModelMetadata(self, request, context):
        meta = (await self._model(request, context)).metadata()
        tensor = service_pb2.ModelMetadataResponse.TensorMetadata
        return service_pb2.ModelMetadataResponse(
            name=meta["name"], versions=meta["versions"], platform=meta["platform"],
            inputs=[tensor(**t) for t in meta["inputs"]], outputs=[tensor(**t) for t in meta["outputs"]])

    async def ModelConfig(self, request, context):
        config = (await self._model(request, context)).config()
        parsed = json_format.ParseDict(config, model_config_pb2.ModelConfig(), ignore_unknown_fields=True)
        return service_pb2.ModelConfigResponse(config=parsed)

    async def RepositoryIndex(self, request, context):
        index = service_pb2.RepositoryIndexResponse.ModelIndex
        return service_pb2.RepositoryIndexResponse(
            models=[index(name=m.name, version=m.version, state="READY") for m in self.registry.models.values()])

    async def ModelInfer(self, request, context):
        started = time.perf_counter()
        label = request.model_name if request.model_name in self.registry.models else "_unknown_"
        try:
            model = self.registry.get(request.model_name, request.model_version)
            queue = model.batcher
            if queue.queue_depth >= queue.config.max_queue_size:  # before decoding anything
                raise proto.Overloaded(f"model {model.name!r}: queue full ({queue.config.max_queue_size} requests)")
            async with self.budget.hold(request.ByteSize(), self.limits.decode_wait_s):
                parsed = proto.build_infer_request(request.id or None, _parameters(request.parameters),
                                                   wire_tensors(request), requested_outputs(request),
                                                   model.signature, self.limits)
            outputs = await service.infer(model, parsed)
            response = encode_response(model, parsed, outputs)
        except proto.ProtocolError as e:
            self.metrics.failure(label, e.reason)
            await context.abort(status_code(e), e.message)
        except asyncio.CancelledError:  # the client cancelled or went away
            self.metrics.failure(label, "client_disconnect")
            raise
        except Exception as e:  # noqa: BLE001 - the server never dies on a request
            self.metrics.failure(label, "internal")
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: "
                                                          f"{public_message(str(e))}")
        self.metrics.success(label, time.perf_counter() - started)
        return response


def encode_response(model: service.ServedModel, request: proto.InferRequest, outputs: dict[str, np.ndarray]):
    """A ``ModelInferResponse`` with the asked-for outputs as ``raw_output_contents``."""
    names = request.outputs if request.outputs is not None else [n for n in model.session.output_names
                                                                 if n in outputs]
    tensor = service_pb2.ModelInferResponse.InferOutputTensor
    entries, raw = [], []
    for name in names:
        arr = np.asarray(outputs[name])
        entries.append(tensor(name=name, datatype=proto.triton_dtype(arr.dtype), shape=list(arr.shape)))
        raw.append(np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes())
    return service_pb2.ModelInferResponse(model_name=model.name, model_version=model.version,
                                          id=request.id or "", outputs=entries, raw_output_contents=raw)


class GrpcFrontEnd:
    """The gRPC server on its own thread and event loop; :meth:`start` returns once it is bound."""

    def __init__(self, registry: service.ModelRegistry, metrics: ServerMetrics, limits: proto.Limits, *,
                 host: str = "127.0.0.1", port: int = 8001, extensions: list[str] | None = None,
                 budget: ByteBudget | None = None, interceptors: list | None = None, handlers: list | None = None):
        self.servicer = Servicer(registry, metrics, limits, extensions or [], budget)
        self.handlers = list(handlers or [])  # more services on the same port (TEI's: attnx.runtime.apis.tei_grpc)
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
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(self.servicer, server)
        if self.handlers:
            server.add_generic_rpc_handlers(self.handlers)
        target = f"[{self.host}]:{self.requested_port}" if ":" in self.host else f"{self.host}:{self.requested_port}"
        try:
            self.port = server.add_insecure_port(target)
        except RuntimeError as e:
            raise OSError(f"gRPC cannot listen on {target}: {e}") from None
        if not self.port:
            raise OSError(f"gRPC cannot listen on {target} (address in use?)")
        await server.start()
        self._ready.set()
        await self._stop.wait()
        await server.stop(self._grace)  # in-flight calls finish; new ones are refused

    def stop(self, grace: float = 30.0) -> None:
        """Stop taking calls, let in-flight ones finish (up to ``grace`` seconds), and join the thread."""
        if self._loop is None or self._thread is None:
            return
        self._grace = grace
        try:
            self._loop.call_soon_threadsafe(self._stop.set)
        except RuntimeError:  # the loop already ended
            pass
        self._thread.join(grace + 10)
        self._thread = None
