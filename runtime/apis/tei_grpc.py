"""Hugging Face text-embeddings-inference's gRPC API (``tei.v1``) on ``attnx serve --grpc-port``, beside
KServe's ``inference.GRPCInferenceService`` on the same port: a client generated from TEI's ``tei.proto``
works unchanged.

Services and what attnx answers:

- ``Info/Info``: TEI's model description (the server's embedding model, else its first text classifier).
- ``Embed/Embed`` and ``EmbedStream``: one text -> its sentence embedding (``normalize`` defaults to true,
  ``dimensions`` cuts where ``attnx serve --dimensions`` allows it). ``EmbedAll``/``EmbedAllStream``: the
  text's token embeddings (``last_hidden_state``). ``EmbedSparse*``: ``UNIMPLEMENTED`` (no SPLADE model).
- ``Predict/Predict``, ``PredictPair`` and their streams: a sequence classifier's scores, best first.
- ``Rerank/Rerank`` (query and texts) and ``RerankStream`` (one (query, text) a message; the first
  message's flags count): ranks, best first.
- ``Tokenize/Tokenize``, ``Decode`` and their streams: the served model's tokenizer.

Streams are answered in order while their requests run concurrently, so a stream's texts meet other
requests in the batchers. TEI serves one model; with several, the gRPC metadata key ``model`` names one
(an attnx extension). Errors are one-line statuses: invalid input ``INVALID_ARGUMENT``, an unknown model
``NOT_FOUND``, overload ``RESOURCE_EXHAUSTED``, shutting down ``UNAVAILABLE``.

The messages are declared in :data:`MESSAGES` (field names and numbers as TEI numbers them: that is the
wire format) and built with protobuf's descriptor API into a private pool, so nothing is generated or
compiled and TEI's own generated classes can live in the same process. :func:`proto_text` writes the
declaration back out as a ``.proto`` file for clients to generate stubs from (docs/serving.md).
"""

from __future__ import annotations

import asyncio
import functools
import time

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from attnx.runtime.apis import kserve_tensors as proto
from attnx.runtime.apis.embeddings import EmbeddingApi, InputProblem, embed, embedding_models, full_size, normalize, \
    parse_inputs, pick_model, run_encoded
from attnx.runtime.wire.grpc import status_code
from attnx.runtime.core.pooling import HIDDEN
from attnx.runtime.apis.scoring import check_text, pick, ranking, score, scoring_models
from attnx.runtime.core.session import public_message
from attnx.runtime.apis.tei import info_fields

PACKAGE = "tei.v1"
ENUMS = {"ModelType": ["MODEL_TYPE_EMBEDDING", "MODEL_TYPE_CLASSIFIER", "MODEL_TYPE_RERANKER"],
         "TruncationDirection": ["TRUNCATION_DIRECTION_RIGHT", "TRUNCATION_DIRECTION_LEFT"]}
#: EmbedSparseRequest's and EmbedAllRequest's fields (TEI numbers them alike).
_TEXT_REQUEST = [("inputs", 1, "string"), ("truncate", 2, "bool"), ("truncation_direction", 3, "TruncationDirection"),
                 ("prompt_name", 4, "string?")]
#: message -> fields (name, number, type): ``*type`` repeated, ``type?`` proto3 ``optional``.
MESSAGES: dict[str, list[tuple[str, int, str]]] = {
    "InfoRequest": [],
    "InfoResponse": [("version", 1, "string"), ("sha", 2, "string?"), ("docker_label", 3, "string?"),
                     ("model_id", 4, "string"), ("model_sha", 5, "string?"), ("model_dtype", 6, "string"),
                     ("model_type", 7, "ModelType"), ("max_concurrent_requests", 8, "uint32"),
                     ("max_input_length", 9, "uint32"), ("max_batch_tokens", 10, "uint32"),
                     ("max_batch_requests", 11, "uint32?"), ("max_client_batch_size", 12, "uint32"),
                     ("tokenization_workers", 13, "uint32")],
    "Metadata": [("compute_chars", 1, "uint32"), ("compute_tokens", 2, "uint32"), ("total_time_ns", 3, "uint64"),
                 ("tokenization_time_ns", 4, "uint64"), ("queue_time_ns", 5, "uint64"),
                 ("inference_time_ns", 6, "uint64")],
    "EmbedRequest": [("inputs", 1, "string"), ("truncate", 2, "bool"), ("normalize", 3, "bool?"),
                     ("truncation_direction", 4, "TruncationDirection"), ("prompt_name", 5, "string?"),
                     ("dimensions", 6, "uint32?")],
    "EmbedResponse": [("embeddings", 1, "*float"), ("metadata", 2, "Metadata")],
    "EmbedSparseRequest": _TEXT_REQUEST,
    "SparseValue": [("index", 1, "uint32"), ("value", 2, "float")],
    "EmbedSparseResponse": [("sparse_embeddings", 1, "*SparseValue"), ("metadata", 2, "Metadata")],
    "EmbedAllRequest": _TEXT_REQUEST,
    "TokenEmbedding": [("embeddings", 1, "*float")],
    "EmbedAllResponse": [("token_embeddings", 1, "*TokenEmbedding"), ("metadata", 2, "Metadata")],
    "PredictRequest": [("inputs", 1, "string"), ("truncate", 2, "bool"), ("raw_scores", 3, "bool"),
                       ("truncation_direction", 4, "TruncationDirection")],
    "PredictPairRequest": [("inputs", 1, "*string"), ("truncate", 2, "bool"), ("raw_scores", 3, "bool"),
                           ("truncation_direction", 4, "TruncationDirection")],
    "Prediction": [("score", 1, "float"), ("label", 2, "string")],
    "PredictResponse": [("predictions", 1, "*Prediction"), ("metadata", 2, "Metadata")],
    "RerankRequest": [("query", 1, "string"), ("texts", 2, "*string"), ("truncate", 3, "bool"),
                      ("raw_scores", 4, "bool"), ("return_text", 5, "bool"),
                      ("truncation_direction", 6, "TruncationDirection")],
    "RerankStreamRequest": [("query", 1, "string"), ("text", 2, "string"), ("truncate", 3, "bool"),
                            ("raw_scores", 4, "bool"), ("return_text", 5, "bool"),
                            ("truncation_direction", 6, "TruncationDirection")],
    "Rank": [("index", 1, "uint32"), ("text", 2, "string?"), ("score", 3, "float")],
    "RerankResponse": [("ranks", 1, "*Rank"), ("metadata", 2, "Metadata")],
    "EncodeRequest": [("inputs", 1, "string"), ("add_special_tokens", 2, "bool"), ("prompt_name", 3, "string?")],
    "SimpleToken": [("id", 1, "uint32"), ("text", 2, "string"), ("special", 3, "bool"), ("start", 4, "uint32?"),
                    ("stop", 5, "uint32?")],
    "EncodeResponse": [("tokens", 1, "*SimpleToken")],
    "DecodeRequest": [("ids", 1, "*uint32"), ("skip_special_tokens", 2, "bool")],
    "DecodeResponse": [("text", 1, "string")],
}
#: service -> method -> (request, response, kind): unary, stream (both ways) or stream_unary.
SERVICES = {
    "Info": {"Info": ("InfoRequest", "InfoResponse", "unary")},
    "Embed": {"Embed": ("EmbedRequest", "EmbedResponse", "unary"),
              "EmbedStream": ("EmbedRequest", "EmbedResponse", "stream"),
              "EmbedSparse": ("EmbedSparseRequest", "EmbedSparseResponse", "unary"),
              "EmbedSparseStream": ("EmbedSparseRequest", "EmbedSparseResponse", "stream"),
              "EmbedAll": ("EmbedAllRequest", "EmbedAllResponse", "unary"),
              "EmbedAllStream": ("EmbedAllRequest", "EmbedAllResponse", "stream")},
    "Predict": {"Predict": ("PredictRequest", "PredictResponse", "unary"),
                "PredictPair": ("PredictPairRequest", "PredictResponse", "unary"),
                "PredictStream": ("PredictRequest", "PredictResponse", "stream"),
                "PredictPairStream": ("PredictPairRequest", "PredictResponse", "stream")},
    "Rerank": {"Rerank": ("RerankRequest", "RerankResponse", "unary"),
               "RerankStream": ("RerankStreamRequest", "RerankResponse", "stream_unary")},
    "Tokenize": {"Tokenize": ("EncodeRequest", "EncodeResponse", "unary"),
                 "TokenizeStream": ("EncodeRequest", "EncodeResponse", "stream"),
                 "Decode": ("DecodeRequest", "DecodeResponse", "unary"),
                 "DecodeStream": ("DecodeRequest", "DecodeResponse", "stream")},
}
_SCALARS = {"string": "TYPE_STRING", "bool": "TYPE_BOOL", "float": "TYPE_FLOAT", "uint32": "TYPE_UINT32",
            "uint64": "TYPE_UINT64"}
_STREAM_WINDOW = 64  # a stream's requests in flight at once (the rest wait to be read)


def file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """:data:`MESSAGES`, :data:`ENUMS` and :data:`SERVICES` as a proto3 file descriptor."""
    F = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="attnx/tei.proto", package=PACKAGE, syntax="proto3")
    for name, values in ENUMS.items():
        enum = fdp.enum_type.add(name=name)
        for number, value in enumerate(values):
            enum.value.add(name=value, number=number)
    for name, fields in MESSAGES.items():
        message = fdp.message_type.add(name=name)
        for field_name, number, kind in fields:
            base = kind.strip("*?")
            field = message.field.add(name=field_name, number=number, json_name=field_name,
                                      label=F.LABEL_REPEATED if kind.startswith("*") else F.LABEL_OPTIONAL)
            if base in _SCALARS:
                field.type = getattr(F, _SCALARS[base])
            else:
                field.type = F.TYPE_ENUM if base in ENUMS else F.TYPE_MESSAGE
                field.type_name = f".{PACKAGE}.{base}"
            if kind.endswith("?"):  # proto3 optional: a synthetic one-field oneof
                field.proto3_optional = True
                field.oneof_index = len(message.oneof_decl)
                message.oneof_decl.add(name=f"_{field_name}")
    for name, methods in SERVICES.items():
        service = fdp.service.add(name=name)
        for method, (request, response, kind) in methods.items():
            service.method.add(name=method, input_type=f".{PACKAGE}.{request}", output_type=f".{PACKAGE}.{response}",
                               client_streaming=kind != "unary", server_streaming=kind == "stream")
    return fdp


@functools.cache
def messages() -> dict[str, type]:
    """The message classes, from a private descriptor pool."""
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file_descriptor())
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))
            for name in MESSAGES}


def proto_text() -> str:
    """The API as a ``.proto`` file (what a client generates its stubs from)."""
    lines = ['syntax = "proto3";', "", f"package {PACKAGE};", ""]
    for name, methods in SERVICES.items():
        lines.append(f"service {name} {{")
        for method, (request, response, kind) in methods.items():
            arg = f"stream {request}" if kind != "unary" else request
            out = f"stream {response}" if kind == "stream" else response
            lines.append(f"    rpc {method} ({arg}) returns ({out});")
        lines += ["}", ""]
    for name, values in ENUMS.items():
        lines += [f"enum {name} {{", *(f"    {v} = {i};" for i, v in enumerate(values)), "}", ""]
    for name, fields in MESSAGES.items():
        body = [f"    {'repeated ' if k.startswith('*') else 'optional ' if k.endswith('?') else ''}"
                f"{k.strip('*?')} {f} = {n};" for f, n, k in fields]
        lines += [f"message {name} {{", *body, "}", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# The handlers
# --------------------------------------------------------------------------------------


def _direction(model, request) -> None:
    side = "left" if request.truncation_direction == 1 else "right"
    if model.tokenizer is not None and side != model.tokenizer.truncation_side:
        raise InputProblem(f"model {model.name!r} truncates on the {model.tokenizer.truncation_side} (its export "
                           f"says so); truncation_direction {side} is not available", param="truncation_direction")


def _no_prompt(model, request) -> None:
    if "prompt_name" in request.DESCRIPTOR.fields_by_name and request.HasField("prompt_name"):
        raise InputProblem(f"model {model.name!r} has no prompts; leave prompt_name unset", param="prompt_name")


def _metadata(started: float, chars: int, tokens: int):
    M = messages()["Metadata"]
    return M(compute_chars=chars, compute_tokens=tokens, total_time_ns=int((time.perf_counter() - started) * 1e9))


class TeiHandlers:
    """The ``tei.v1`` services over the server's models (:class:`EmbeddingApi`: registry, limits, metrics)."""

    def __init__(self, api: EmbeddingApi):
        self.api = api

    # --- model choice ------------------------------------------------------------------
    @staticmethod
    def _named(context) -> str | None:
        return next((v for k, v in (context.invocation_metadata() or ()) if k == "model"), None)

    def _embedder(self, context):
        return pick_model(self.api.registry, self._named(context))

    def _tokenizing(self, context):
        name = self._named(context)
        if name is None:
            models = embedding_models(self.api.registry) or scoring_models(self.api.registry)
            if not models:
                raise proto.NotFound("this server has no model with a tokenizer")
            return models[0]
        model = self.api.registry.get(name, "")
        if model.tokenizer is None:
            raise InputProblem(f"model {name!r} has no tokenizer", param="model")
        return model

    # --- Info --------------------------------------------------------------------------
    async def Info(self, request, context):
        models = embedding_models(self.api.registry) or scoring_models(self.api.registry)
        if not models:
            raise proto.NotFound("this server has no embedding model or text classifier")
        info = info_fields(models[0], self.api)
        kind = next(iter(info["model_type"]))
        return messages()["InfoResponse"](
            version=info["version"], model_id=info["model_id"], model_dtype=info["model_dtype"],
            model_type=["embedding", "classifier", "reranker"].index(kind),
            max_concurrent_requests=info["max_concurrent_requests"], max_input_length=info["max_input_length"] or 0,
            max_batch_tokens=info["max_batch_tokens"], max_batch_requests=info["max_batch_requests"],
            max_client_batch_size=info["max_client_batch_size"], tokenization_workers=1)

    # --- Embed -------------------------------------------------------------------------
    async def Embed(self, request, context):
        started, model = time.perf_counter(), self._embedder(context)
        _direction(model, request)
        _no_prompt(model, request)
        items = parse_inputs(request.inputs, model.limits, param="inputs")
        requested = request.dimensions if request.HasField("dimensions") else None
        full = full_size(model)
        if full is not None:
            self.api.dimensions.size(model.name, full, requested)
        result = await embed(model, items, truncate=request.truncate, param="inputs")
        vectors = result.vectors[:, :self.api.dimensions.size(model.name, result.vectors.shape[1], requested)]
        if not request.HasField("normalize") or request.normalize:
            vectors = normalize(vectors)
        return messages()["EmbedResponse"](embeddings=vectors[0].tolist(),
                                           metadata=_metadata(started, len(request.inputs), result.tokens))

    async def EmbedAll(self, request, context):
        started, model = time.perf_counter(), self._embedder(context)
        _direction(model, request)
        _no_prompt(model, request)
        if HIDDEN not in model.session.output_names:
            raise InputProblem(f"model {model.name!r} gives no token embeddings ({HIDDEN})", param="inputs")
        text = check_text(request.inputs, "'inputs'", "inputs")
        try:
            (encoded,) = model.tokenizer.tokenize([text], truncate=True)
        except ValueError as e:
            raise InputProblem(f"'inputs': {e}", param="inputs") from None
        if encoded.truncated and not request.truncate:
            raise InputProblem(f"inputs is longer than the model's max length {model.tokenizer.max_length} tokens "
                               "(and truncation is off)", param="inputs")
        hidden = (await run_encoded(model, [encoded], None, HIDDEN))[0, :encoded.length]  # [tokens, d]
        T = messages()["TokenEmbedding"]
        return messages()["EmbedAllResponse"](token_embeddings=[T(embeddings=row.tolist()) for row in hidden],
                                              metadata=_metadata(started, len(text), encoded.length))

    async def EmbedSparse(self, request, context):
        raise _Unimplemented("sparse embeddings need a SPLADE model; attnx serves none")

    # --- Predict and Rerank -------------------------------------------------------------
    async def _predict(self, context, item, request, chars: int):
        started = time.perf_counter()
        model, labels = pick(self.api.registry, self._named(context), rerank=False)
        _direction(model, request)
        result = await score(model, [item], truncate=request.truncate)
        row = labels.scores(result.logits, request.raw_scores)[0]
        P = messages()["Prediction"]
        return messages()["PredictResponse"](
            predictions=[P(score=float(row[i]), label=labels.names[i]) for i in ranking(row)],
            metadata=_metadata(started, chars, result.tokens))

    async def Predict(self, request, context):
        return await self._predict(context, check_text(request.inputs, "'inputs'", "inputs"), request,
                                   len(request.inputs))

    async def PredictPair(self, request, context):
        if len(request.inputs) != 2:
            raise InputProblem(f"'inputs' must be a pair of two texts, got {len(request.inputs)}", param="inputs")
        pair = tuple(check_text(t, f"inputs[{i}]", "inputs", allow_empty=True) for i, t in enumerate(request.inputs))
        return await self._predict(context, pair, request, sum(map(len, pair)))

    async def Rerank(self, request, context):
        return await self._rerank(context, request.query, list(request.texts), request)

    async def RerankStream(self, requests, context):
        first, texts = None, []
        async for request in requests:
            first = first or request
            if request.query != first.query:
                raise InputProblem("every message of a rerank stream must carry the same query", param="query")
            texts.append(request.text)
        if first is None:
            raise InputProblem("the rerank stream sent no message", param="texts", code="empty_input")
        return await self._rerank(context, first.query, texts, first)

    async def _rerank(self, context, query: str, texts: list[str], flags):
        started = time.perf_counter()
        if not texts:
            raise InputProblem("`texts` cannot be empty", param="texts", code="empty_input")
        model, labels = pick(self.api.registry, self._named(context), rerank=True)
        _direction(model, flags)
        query = check_text(query, "'query'", "query")
        texts = [check_text(t, f"texts[{i}]", "texts", allow_empty=True) for i, t in enumerate(texts)]
        result = await score(model, [(query, t) for t in texts], truncate=flags.truncate, param="texts")
        scores = labels.relevance(result.logits, flags.raw_scores)
        R = messages()["Rank"]
        ranks = [R(index=i, score=float(scores[i]), **({"text": texts[i]} if flags.return_text else {}))
                 for i in ranking(scores)]
        return messages()["RerankResponse"](ranks=ranks, metadata=_metadata(
            started, len(query) * len(texts) + sum(map(len, texts)), result.tokens))

    # --- Tokenize -----------------------------------------------------------------------
    async def Tokenize(self, request, context):
        model = self._tokenizing(context)
        _no_prompt(model, request)
        S = messages()["SimpleToken"]
        tokens = [S(id=i, text=t, special=s, **({} if s else {"start": a, "stop": b}))
                  for i, t, s, a, b in model.tokenizer.tokens(request.inputs, request.add_special_tokens)]
        return messages()["EncodeResponse"](tokens=tokens)

    async def Decode(self, request, context):
        model = self._tokenizing(context)
        vocab = model.tokenizer.vocab_size
        bad = next((i for i in request.ids if i >= vocab), None)
        if bad is not None:
            raise InputProblem(f"token id {bad} is outside the vocabulary (size {vocab})", param="ids")
        return messages()["DecodeResponse"](text=model.tokenizer.decode(request.ids, request.skip_special_tokens))


class _Unimplemented(proto.ProtocolError):
    status = 501  # grpc_server.status_code: UNIMPLEMENTED
    reason = "unimplemented"


def _guarded(api: EmbeddingApi, fn, method: str):
    """``fn`` with the server's metrics, and every failure a one-line status (the server never dies)."""

    async def fail(context, e: BaseException, label: str):
        if isinstance(e, proto.ProtocolError):
            api.metrics.failure(label, e.reason)
            await context.abort(status_code(e), e.message)
        api.metrics.failure(label, "internal")
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: "
                                                      f"{public_message(str(e))}")

    label = f"tei.{method}"

    async def unary(request, context):
        started = time.perf_counter()
        try:
            response = await fn(request, context)
        except asyncio.CancelledError:
            api.metrics.failure(label, "client_disconnect")
            raise
        except Exception as e:  # noqa: BLE001
            await fail(context, e, label)
        api.metrics.success(label, time.perf_counter() - started)
        return response

    async def stream(requests, context):
        """Each request runs as soon as it is read (up to a window), answers go back in order."""
        pending: asyncio.Queue = asyncio.Queue(_STREAM_WINDOW)

        async def read():
            async for request in requests:
                await pending.put(asyncio.ensure_future(fn(request, context)))
            await pending.put(None)

        reader = asyncio.ensure_future(read())
        try:
            while True:
                getter = asyncio.ensure_future(pending.get())
                await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():  # the reader ended first: with an error, or it queued its None
                    if reader.exception() is not None:
                        getter.cancel()
                        raise reader.exception()
                    await getter
                task = getter.result()
                if task is None:
                    break
                started = time.perf_counter()
                yield await task
                api.metrics.success(label, time.perf_counter() - started)
        except asyncio.CancelledError:
            api.metrics.failure(label, "client_disconnect")
            raise
        except Exception as e:  # noqa: BLE001
            await fail(context, e, label)
        finally:
            reader.cancel()
            while not pending.empty():
                task = pending.get_nowait()
                if task is not None:
                    task.cancel()

    return unary, stream


def generic_handlers(api: EmbeddingApi) -> list[grpc.GenericRpcHandler]:
    """One generic handler per ``tei.v1`` service, for ``server.add_generic_rpc_handlers``."""
    handlers = TeiHandlers(api)
    classes = messages()
    out = []
    for service, methods in SERVICES.items():
        table = {}
        for method, (request, response, kind) in methods.items():
            # a stream of requests that the unary method answers one by one (EmbedStream -> Embed, ...)
            unary_name = method[:-len("Stream")] if kind == "stream" else method
            unary, stream = _guarded(api, getattr(handlers, unary_name), method)
            codec = dict(request_deserializer=classes[request].FromString,
                         response_serializer=classes[response].SerializeToString)
            if kind == "unary":
                table[method] = grpc.unary_unary_rpc_method_handler(unary, **codec)
            elif kind == "stream":
                table[method] = grpc.stream_stream_rpc_method_handler(stream, **codec)
            else:  # RerankStream: the whole stream is one request
                table[method] = grpc.stream_unary_rpc_method_handler(unary, **codec)
        out.append(grpc.method_handlers_generic_handler(f"{PACKAGE}.{service}", table))
    return out
