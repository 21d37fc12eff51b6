"""KServe v2 / the Open Inference Protocol over HTTP, as Triton speaks it (the unmodified ``tritonclient.http``).

Health, server and model metadata, ready and config for every served model (text generators too: the generate
extension's ``text_input``/``text_output``), the repository index, ``/metrics``, and ``infer`` (JSON tensors and
the binary tensor extension; ``BYTES`` text for a model with a tokenizer, each text its own row in the batcher,
more texts than the queue holds a 413). Bodies go through the envelope; big all-JSON answers stream in pieces.
"""

from __future__ import annotations

import functools

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from attnx.runtime.apis import kserve_json as codec
from attnx.runtime.apis.kserve_tensors import InferRequest
from attnx.runtime.apis.requests import InferBody, openapi_body
from attnx.runtime.core.session import InputError
from attnx.runtime.core.text import TEXT_INPUT, context_rows, stack_rows, text_feeds
from attnx.runtime.serving.encoder import EncoderModel
from attnx.runtime.serving.model import INFER
from attnx.runtime.serving.registry import check_queue_room
from attnx.runtime.serving.state import Serving, serving
from attnx.runtime.wire.envelope import error_response
from attnx.runtime.wire.errors import KSERVE, ProtocolError
from attnx.runtime.wire.metrics import CONTENT_TYPE_LATEST

#: All-JSON answers with more output bytes than this are streamed in pieces.
_STREAM_JSON_BYTES = 1 << 20
router = APIRouter(tags=["KServe v2"])


@router.get("/v2/health/live")
async def live():
    return JSONResponse({"live": True})


@router.get("/v2/health/ready")
async def ready(request: Request):
    ok = serving(request).registry.ready
    return JSONResponse({"ready": ok}, status_code=200 if ok else 503)


@router.get("/v2")
async def server_metadata(request: Request):
    s = serving(request)
    return JSONResponse({"name": "attnx", "version": s.version, "extensions": s.extensions})


def _described(fn) -> Response:
    """A description route's answer (metadata, config, ready: no work, so not counted as a request)."""
    try:
        return fn()
    except ProtocolError as e:
        return error_response(KSERVE, e)


@router.get("/v2/models/{name}")
@router.get("/v2/models/{name}/versions/{version}")
async def model_metadata(name: str, request: Request, version: str | None = None):
    return _described(lambda: JSONResponse(serving(request).registry.get(name, version).metadata()))


@router.get("/v2/models/{name}/ready")
@router.get("/v2/models/{name}/versions/{version}/ready")
async def model_ready(name: str, request: Request, version: str | None = None):
    def answer():
        model = serving(request).registry.get(name, version, private=True)  # an open route: it names no other
        return JSONResponse({"name": name, "ready": model.ready}, status_code=200 if model.ready else 503)

    return _described(answer)


@router.get("/v2/models/{name}/config")
@router.get("/v2/models/{name}/versions/{version}/config")
async def model_config(name: str, request: Request, version: str | None = None):
    return _described(lambda: JSONResponse(serving(request).registry.get(name, version).config()))


@router.post("/v2/repository/index")
async def repository_index(request: Request):
    models = serving(request).registry.models.values()
    return JSONResponse([{"name": m.name, "version": m.version, "state": "READY" if m.ready else "UNAVAILABLE"}
                         for m in models])


@router.get("/metrics")
async def prometheus(request: Request):
    return Response(serving(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.post("/v2/models/{name}/infer", openapi_extra=openapi_body(InferBody))
@router.post("/v2/models/{name}/versions/{version}/infer", openapi_extra=openapi_body(InferBody))
async def infer(name: str, request: Request, version: str | None = None):
    async def work(s: Serving, call) -> Response:
        model = call.named(s.registry.resolve(name, INFER, version, path=True))
        encoding = request.headers.get("content-encoding")
        header = request.headers.get("inference-header-content-length")

        def decode(body: bytes) -> InferRequest:
            body = codec.decompress(body, encoding, s.limits.max_body_bytes)
            return codec.parse_infer_request(body, header, model.signature, s.limits, f"POST {request.url.path}")

        async with s.envelope.admitted(model):  # a full queue refuses before a byte of the body is read
            parsed = await s.envelope.body(request, call, decode)
        outputs = await run(s, model, parsed)
        return await _response(s, model, parsed, outputs)

    s = serving(request)
    return await s.envelope.http(request, KSERVE, lambda call: work(s, call))


async def run(s: Serving, model: EncoderModel, request: InferRequest) -> dict[str, np.ndarray]:
    """One checked KServe request through the model's batcher (HTTP and gRPC); the outputs asked for."""
    if request.texts is None:
        (outputs,) = await model.run_rows([request.feeds], request.outputs, request.timeout_ms, texts=False)
        return outputs
    texts, pairs, tok = request.texts, request.pairs, model.text_tokenizer()  # texts: a model with a text input
    check_queue_room(model, len(texts))  # before tokenising: more texts than the queue ever holds is a 413
    if pairs is not None:  # (text, text_pair) rows: a cross-encoder's (query, document)
        tokenize = functools.partial(tok.tokenize_pairs, list(zip(texts, pairs)), truncate=request.truncate)
    else:
        tokenize = functools.partial(tok.tokenize, texts, truncate=request.truncate)
    try:
        encoded = await s.envelope.workers.run(tokenize, cost=sum(map(len, texts)) + sum(map(len, pairs or ())))
        s.limits.check_tokens(sum(e.length for e in encoded))
        contexts = context_rows(model.session.inputs, request.feeds, len(texts))
        feeds = [text_feeds(model.session.inputs, e, c) for e, c in zip(encoded, contexts)]
    except InputError as e:
        raise e.refused(f"input {TEXT_INPUT!r}: ") from None
    parts = await model.run_rows(feeds, request.outputs, request.timeout_ms)
    return stack_rows(parts, model.session.outputs)


async def _response(s: Serving, model: EncoderModel, parsed: InferRequest, outputs: dict) -> Response:
    size = sum(a.nbytes for a in outputs.values())
    if size > _STREAM_JSON_BYTES:
        pieces = codec.stream_json_response(model.name, model.version, parsed, outputs, model.session.output_names)
        if pieces is not None:  # a big all-JSON answer goes out a piece at a time, never whole
            return StreamingResponse(pieces, media_type="application/json")
    encode = functools.partial(codec.encode_infer_response, model.name, model.version, parsed, outputs,
                               model.session.output_names)
    payload, json_len = await s.envelope.workers.run(encode, cost=size)
    if json_len is None:
        return Response(payload, media_type="application/json")
    return Response(payload, media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(json_len)})
