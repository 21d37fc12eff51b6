"""KServe v2 over gRPC: the ``inference.GRPCInferenceService`` that ``tritonclient.grpc`` talks to, with the generated
messages ``tritonclient`` ships (Triton's ``grpc_service.proto``). Live, ready, metadata, config, index and
``ModelInfer`` (``raw_input_contents`` or typed ``contents``, ``BYTES`` text too; outputs as
``raw_output_contents``, as Triton sends them); the rest answer UNIMPLEMENTED. Requests are checked and run exactly
as over HTTP (:func:`attnx.runtime.apis.kserve.run`), inside the server's one envelope; a message's bytes are
charged to the byte budget as held while it is decoded (on the worker thread when big).
"""

from __future__ import annotations

import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from attnx.runtime.apis import kserve_tensors as proto
from attnx.runtime.apis.kserve import run
from attnx.runtime.serving.encoder import EncoderModel
from attnx.runtime.serving.model import INFER
from attnx.runtime.serving.signature import triton_dtype
from attnx.runtime.serving.state import Serving
from attnx.runtime.wire.errors import GRPC, bad_input


#: Protocol datatype -> the typed field of ``InferTensorContents`` that carries it (FP16: raw only).
CONTENTS_FIELD = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
                  "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
                  "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
                  "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}
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
        raise bad_input(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs")
    tensors = []
    for i, item in enumerate(request.inputs):
        tensor = proto.WireTensor(item.name, item.datatype, list(item.shape), _parameters(item.parameters))
        if raw:
            if item.HasField("contents"):
                raise bad_input(f"input {item.name!r}: both contents and raw_input_contents given")
            tensor.raw = raw[i]
        elif item.HasField("contents"):
            field = CONTENTS_FIELD.get(item.datatype)
            if field is None:
                raise bad_input(f"input {item.name!r}: datatype {item.datatype!r} has no typed contents "
                                       f"(send raw_input_contents)")
            tensor.contents = getattr(item.contents, field)
        tensors.append(tensor)
    return tensors


def requested_outputs(request) -> list[proto.RequestedOutput] | None:
    if not request.outputs:
        return None
    return [proto.RequestedOutput(o.name, _parameters(o.parameters)) for o in request.outputs]


class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The KServe v2 gRPC service over the server's registry, every call through its envelope."""

    def __init__(self, state: Serving):
        self.s = state
        for name in ("ModelMetadata", "ModelConfig", "ModelInfer"):  # the calls that can be refused
            setattr(self, name, state.envelope.grpc_unary(GRPC, getattr(self, "_" + name)))

    def add_to(self, server) -> None:
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(self, server)

    async def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=self.s.registry.ready)

    async def ModelReady(self, request, context):
        model = self.s.registry.models.get(request.name)
        return service_pb2.ModelReadyResponse(ready=model is not None and request.version in ("", model.version)
                                              and model.ready)

    async def ServerMetadata(self, request, context):
        return service_pb2.ServerMetadataResponse(name="attnx", version=self.s.version, extensions=self.s.extensions)

    async def _ModelMetadata(self, request, context, call):
        meta = self.s.registry.get(request.name, request.version).metadata()
        tensor = service_pb2.ModelMetadataResponse.TensorMetadata
        return service_pb2.ModelMetadataResponse(
            name=meta["name"], versions=meta["versions"], platform=meta["platform"],
            inputs=[tensor(**t) for t in meta["inputs"]], outputs=[tensor(**t) for t in meta["outputs"]])

    async def _ModelConfig(self, request, context, call):
        config = self.s.registry.get(request.name, request.version).config()
        parsed = json_format.ParseDict(config, model_config_pb2.ModelConfig(), ignore_unknown_fields=True)
        return service_pb2.ModelConfigResponse(config=parsed)

    async def RepositoryIndex(self, request, context):
        index = service_pb2.RepositoryIndexResponse.ModelIndex
        return service_pb2.RepositoryIndexResponse(models=[
            index(name=m.name, version=m.version, state="READY" if m.ready else "UNAVAILABLE")
            for m in self.s.registry.models.values()])

    async def _ModelInfer(self, request, context, call):
        model = call.named(self.s.registry.resolve(request.model_name, INFER, request.model_version, path=True))
        async with self.s.envelope.admitted(model):  # a full queue refuses before anything is decoded
            # The message arrived whole before this ran: its bytes are charged as held (never waiting for room, so
            # an HTTP body never waits on a gRPC one that is queued), and decoded on the worker when big.
            size = request.ByteSize()
            async with self.s.envelope.budget.held(size):
                parsed = await self.s.envelope.workers.run(
                    lambda: proto.build_infer_request(request.id or None, _parameters(request.parameters),
                                                      wire_tensors(request), requested_outputs(request),
                                                      model.signature, self.s.limits), cost=size)
        outputs = await run(self.s, model, parsed)
        return encode_response(model, parsed, outputs)


def encode_response(model: EncoderModel, request: proto.InferRequest, outputs: dict[str, np.ndarray]):
    """A ``ModelInferResponse`` with the asked-for outputs as ``raw_output_contents``."""
    names = request.outputs if request.outputs is not None else [n for n in model.session.output_names
                                                                 if n in outputs]
    tensor = service_pb2.ModelInferResponse.InferOutputTensor
    entries, raw = [], []
    for name in names:
        arr = np.asarray(outputs[name])
        entries.append(tensor(name=name, datatype=triton_dtype(arr.dtype), shape=list(arr.shape)))
        raw.append(np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes())
    return service_pb2.ModelInferResponse(model_name=model.name, model_version=model.version,
                                          id=request.id or "", outputs=entries, raw_output_contents=raw)


