"""Hugging Face text-embeddings-inference's gRPC API (``tei.v1``) on ``attnx serve --grpc-port``, beside KServe's
service on the same port: a client generated from TEI's ``tei.proto`` works unchanged. ``Info``; ``Embed`` (one
text: its sentence embedding, ``normalize`` true unless set false, ``dimensions`` where allowed), ``EmbedAll``
(its token embeddings); ``Predict``, ``PredictPair``; ``Rerank`` and ``RerankStream`` (one (query, text) a
message); ``Tokenize``, ``Decode`` (at most ``--max-request-tokens`` ids, decoded on the worker thread); the
``...Stream`` forms answer in order while their requests run concurrently (a window of them in flight, the whole
stream one source to the batcher, so it takes turns with other clients: ``Envelope.grpc_stream``). ``EmbedSparse``
is UNIMPLEMENTED (no SPLADE model). With several models, the gRPC metadata key ``model`` names one (an attnx
extension). Every call goes through the server's envelope.

The messages come from ``tei.proto`` beside this module (TEI's published interface, written out here), read into
protoc's descriptor by :mod:`~attnx.runtime.apis.proto_schema` when the gRPC port opens (no compiler at run time);
the classes live in a private descriptor pool, so TEI's own generated classes can be imported in the same process.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from google.protobuf import descriptor_pool, message_factory
from pydantic_core import PydanticCustomError

from attnx.runtime.apis.proto_schema import file_descriptor
from attnx.runtime.apis.requests import text
from attnx.runtime.apis.scoring import ranking
from attnx.runtime.apis.tei import described, info_fields
from attnx.runtime.core.pooling import HIDDEN
from attnx.runtime.core.session import InputError
from attnx.runtime.serving.encoding import encode, full_size, unit_rows
from attnx.runtime.serving.encoder import LOGITS
from attnx.runtime.serving.model import EMBED, RERANK, SCORE, TOKENIZE
from attnx.runtime.serving.state import Serving
from attnx.runtime.wire.envelope import Call
from attnx.runtime.wire.errors import TEI_GRPC_SHAPE, Kind, ProtocolError, bad_input

#: The API's interface definition (messages and services), read at first use.
PROTO = Path(__file__).with_name("tei.proto")


@functools.cache
def api() -> tuple[dict[str, Any], dict]:
    """``(message classes by name, service descriptors by name)`` of :data:`PROTO` (classes made at run time:
    protobuf's generated message types, which no stub describes)."""
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file_descriptor(PROTO))
    file = pool.FindFileByName(PROTO.name)
    return ({name: message_factory.GetMessageClass(d) for name, d in file.message_types_by_name.items()},
            dict(file.services_by_name))


def messages() -> dict[str, Any]:
    return api()[0]  # by name: messages()["EmbedResponse"]


def _direction(model, request) -> None:
    side = "left" if request.truncation_direction == 1 else "right"
    if model.tokenizer is not None and side != model.tokenizer.truncation_side:
        raise bad_input(f"model {model.name!r} truncates on the {model.tokenizer.truncation_side} (its export "
                        f"says so); truncation_direction {side} is not available", "truncation_direction")


def _no_prompt(model, request) -> None:
    if "prompt_name" in request.DESCRIPTOR.fields_by_name and request.HasField("prompt_name"):
        raise bad_input(f"model {model.name!r} has no prompts; leave prompt_name unset", "prompt_name")


def _metadata(started: float, chars: int, tokens: int):
    return messages()["Metadata"](compute_chars=chars, compute_tokens=tokens,
                                  total_time_ns=int((time.perf_counter() - started) * 1e9))


def _checked(value, where: str, param: str, empty: bool = False) -> str:
    try:
        return text(value, where, empty=empty)
    except PydanticCustomError as e:
        raise bad_input(e.message(), param) from None


class TeiHandlers:
    """The ``tei.v1`` methods over the server's models; each takes ``(request, context, call)``."""

    def __init__(self, state: Serving):
        self.s = state

    def _model(self, context, call: Call, capability: str):
        named = next((v for k, v in (context.invocation_metadata() or ()) if k == "model"), None)
        if named is None and capability == TOKENIZE:  # TEI's one model: the one /info describes
            return call.named(described(self.s))
        return call.named(self.s.registry.resolve(named, capability))

    async def Info(self, request, context, call):
        info = info_fields(described(self.s), self.s)
        kind = ["embedding", "classifier", "reranker"].index(next(iter(info["model_type"])))
        keep = ("version", "model_id", "model_dtype", "max_concurrent_requests", "max_batch_tokens",
                "max_batch_requests", "max_client_batch_size", "tokenization_workers")
        return messages()["InfoResponse"](model_type=kind, max_input_length=info["max_input_length"] or 0,
                                          **{k: info[k] for k in keep})

    async def Embed(self, request, context, call):
        started, model = time.perf_counter(), self._model(context, call, EMBED)
        _direction(model, request)
        _no_prompt(model, request)
        item = _checked(request.inputs, "inputs[0]", "inputs")
        requested = request.dimensions if request.HasField("dimensions") else None
        self.s.dimensions.size(model.name, full_size(model), requested)
        result = await encode(model, [item], self.s.envelope.workers, truncate=request.truncate, param="inputs")
        vectors = self.s.dimensions.cut(model, result.values, requested)
        if not request.HasField("normalize") or request.normalize:
            vectors = unit_rows(vectors)
        return messages()["EmbedResponse"](embeddings=vectors[0].tolist(),
                                           metadata=_metadata(started, len(item), result.tokens))

    async def EmbedAll(self, request, context, call):
        started, model = time.perf_counter(), self._model(context, call, EMBED)
        _direction(model, request)
        _no_prompt(model, request)
        if HIDDEN not in model.session.output_names:
            raise bad_input(f"model {model.name!r} gives no token embeddings ({HIDDEN})", "inputs")
        item = _checked(request.inputs, "'inputs'", "inputs")
        result = await encode(model, [item], self.s.envelope.workers, output=HIDDEN, truncate=request.truncate,
                              param="inputs")
        T = messages()["TokenEmbedding"]
        return messages()["EmbedAllResponse"](
            token_embeddings=[T(embeddings=row.tolist()) for row in result.values[0, :result.tokens]],
            metadata=_metadata(started, len(item), result.tokens))

    async def EmbedSparse(self, request, context, call):
        raise ProtocolError(Kind.UNIMPLEMENTED, "sparse embeddings need a SPLADE model; attnx serves none")

    async def _predict(self, context, call, item, request, chars: int):
        started, model = time.perf_counter(), self._model(context, call, SCORE)
        _direction(model, request)
        result = await encode(model, [item], self.s.envelope.workers, output=LOGITS, truncate=request.truncate)
        row = model.labels.scores(result.values, request.raw_scores)[0]
        P = messages()["Prediction"]
        return messages()["PredictResponse"](
            predictions=[P(score=float(row[i]), label=model.labels.names[i]) for i in ranking(row)],
            metadata=_metadata(started, chars, result.tokens))

    async def Predict(self, request, context, call):
        item = _checked(request.inputs, "'inputs'", "inputs")
        return await self._predict(context, call, item, request, len(item))

    async def PredictPair(self, request, context, call):
        if len(request.inputs) != 2:
            raise bad_input(f"'inputs' must be a pair of two texts, got {len(request.inputs)}", "inputs")
        pair = tuple(_checked(t, f"inputs[{i}]", "inputs", empty=True) for i, t in enumerate(request.inputs))
        return await self._predict(context, call, pair, request, sum(map(len, pair)))

    async def Rerank(self, request, context, call):
        return await self._rerank(context, call, request.query, list(request.texts), request)

    async def RerankStream(self, requests, context, call):
        first, texts = None, []
        async for request in requests:
            first = first or request
            if request.query != first.query:
                raise bad_input("every message of a rerank stream must carry the same query", "query")
            texts.append(request.text)
        if first is None:
            raise ProtocolError(Kind.EMPTY, "the rerank stream sent no message", "texts")
        return await self._rerank(context, call, first.query, texts, first)

    async def _rerank(self, context, call, query: str, texts: list[str], flags):
        started = time.perf_counter()
        if not texts:
            raise ProtocolError(Kind.EMPTY, "`texts` cannot be empty", "texts")
        model = self._model(context, call, RERANK)
        _direction(model, flags)
        query = _checked(query, "'query'", "query")
        texts = [_checked(t, f"texts[{i}]", "texts", empty=True) for i, t in enumerate(texts)]
        result = await encode(model, [(query, t) for t in texts], self.s.envelope.workers, output=LOGITS,
                              truncate=flags.truncate, param="texts")
        scores = model.labels.relevance(result.values, flags.raw_scores)
        R = messages()["Rank"]
        ranks = [R(index=i, score=float(scores[i]), **({"text": texts[i]} if flags.return_text else {}))
                 for i in ranking(scores)]
        return messages()["RerankResponse"](ranks=ranks, metadata=_metadata(
            started, len(query) * len(texts) + sum(map(len, texts)), result.tokens))

    async def Tokenize(self, request, context, call):
        model = self._model(context, call, TOKENIZE)
        _no_prompt(model, request)
        try:
            found = await self.s.envelope.workers.run(model.tokenizer.tokens, request.inputs,
                                                      request.add_special_tokens, cost=len(request.inputs))
        except InputError as e:
            raise e.refused(param="inputs") from None
        S = messages()["SimpleToken"]
        return messages()["EncodeResponse"](tokens=[S(id=i, text=t, special=s, **({} if s else {"start": a, "stop": b}))
                                                    for i, t, s, a, b in found])

    async def Decode(self, request, context, call):
        model = self._model(context, call, TOKENIZE)
        count, most = len(request.ids), self.s.limits.max_request_tokens
        if most is not None and count > most:  # counted before a single id is read
            raise ProtocolError(Kind.TOO_MANY, f"'ids' has {count} token ids, over the limit of {most} per request "
                                               f"(--max-request-tokens)", "ids")
        return messages()["DecodeResponse"](text=await self.s.envelope.workers.run(
            _decode, model.tokenizer, request.ids, request.skip_special_tokens, cost=count * 8))


def _decode(tokenizer, ids, skip_special_tokens: bool) -> str:
    """Token ids back to text, on the worker thread (its cost grows with the ids), checked against the vocabulary."""
    ids = np.asarray(ids, dtype=np.int64)
    bad = ids[ids >= tokenizer.vocab_size]
    if bad.size:
        raise bad_input(f"token id {int(bad[0])} is outside the vocabulary (size {tokenizer.vocab_size})", "ids")
    return tokenizer.decode(ids.tolist(), skip_special_tokens)


class TeiService:
    """The ``tei.v1`` services as generic handlers on the gRPC server, every call through the envelope."""

    def __init__(self, state: Serving):
        self.state = state

    def add_to(self, server) -> None:
        classes, services = api()
        handlers, envelope = TeiHandlers(self.state), self.state.envelope
        for service in services.values():
            table = {}
            for method in service.methods:
                codec = dict(request_deserializer=classes[method.input_type.name].FromString,
                             response_serializer=classes[method.output_type.name].SerializeToString)
                if method.client_streaming and method.server_streaming:  # a stream the unary method answers
                    fn = getattr(handlers, method.name.removesuffix("Stream"))
                    table[method.name] = grpc.stream_stream_rpc_method_handler(
                        envelope.grpc_stream(TEI_GRPC_SHAPE, fn), **codec)
                elif method.client_streaming:  # RerankStream: the whole stream is one request
                    table[method.name] = grpc.stream_unary_rpc_method_handler(
                        envelope.grpc_unary(TEI_GRPC_SHAPE, getattr(handlers, method.name)), **codec)
                else:
                    table[method.name] = grpc.unary_unary_rpc_method_handler(
                        envelope.grpc_unary(TEI_GRPC_SHAPE, getattr(handlers, method.name)), **codec)
            server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service.full_name, table)])
