"""``attnx serve --api-key``: one bearer key on every route but the health checks, over HTTP and gRPC.

Clients send ``Authorization: Bearer KEY`` (what the ``openai`` client sends from ``api_key``, TEI clients and
``huggingface_hub`` from ``token``, ``tritonclient`` from ``headers=``; gRPC: the ``authorization`` metadata key). The
key comes from ``--api-key`` or, kept out of ``ps`` and shell history, the ``ATTNX_API_KEY`` environment variable.

The comparison is :func:`hmac.compare_digest` over SHA-256 digests of the sent and the configured key, so its time
depends on neither the key's content nor its length. Health routes stay open (a Kubernetes probe carries no key):
KServe's ``/v2/health/live``, ``/v2/health/ready`` and ``/v2/models/{m}[/versions/{v}]/ready``, TEI's ``/health``, and
gRPC's ``ServerLive``, ``ServerReady``, ``ModelReady``. Everything else, ``/metrics`` included, answers 401 without
the key (gRPC: ``UNAUTHENTICATED``), in the error shape of the API asked
(:func:`attnx.runtime.wire.errors.shape_of_path`).
"""

from __future__ import annotations

import hashlib
import hmac
import re

import grpc

from attnx.runtime.wire.errors import GRPC, Kind, ProtocolError, shape_of_path

#: The environment variable ``attnx serve`` reads the key from when ``--api-key`` is not given.
ENV_VAR = "ATTNX_API_KEY"
#: Routes that answer without a key: liveness and readiness, as probes call them.
OPEN_PATHS = re.compile(r"^/(v2/health/(live|ready)|v2/models/[^/]+(/versions/[^/]+)?/ready|health)$")
OPEN_GRPC_METHODS = frozenset(f"/inference.GRPCInferenceService/{m}" for m in ("ServerLive", "ServerReady",
                                                                               "ModelReady"))


class ApiKey:
    """A configured key; :meth:`accepts` checks an ``Authorization`` header value in constant time. An empty key
    (``--api-key ''``, ``ATTNX_API_KEY=`` set but empty) is refused: it would leave every route open."""

    def __init__(self, key: str):
        if not isinstance(key, str) or not key.strip():
            raise ValueError("the API key is empty: give a key, or leave out --api-key and ATTNX_API_KEY to serve "
                             "without one")
        if key != key.strip():
            raise ValueError("the API key must not have leading or trailing spaces")
        self._digest = hashlib.sha256(key.encode("utf-8")).digest()

    def accepts(self, header: str | bytes | None) -> bool:
        if isinstance(header, str):
            header = header.encode("latin-1", "replace")
        scheme, _, token = (header or b"").partition(b" ")
        given = hashlib.sha256(token.strip()).digest()
        # Always compare, so a missing or malformed header takes the same time as a wrong key.
        return hmac.compare_digest(given, self._digest) and scheme.lower() == b"bearer"


class ApiKeyMiddleware:
    """Pure ASGI (no per-request task or body buffering, unlike Starlette's ``BaseHTTPMiddleware``)."""

    def __init__(self, app, key: ApiKey):
        self.app = app
        self.key = key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or OPEN_PATHS.match(scope["path"]):
            return await self.app(scope, receive, send)
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if self.key.accepts(header):
            return await self.app(scope, receive, send)
        message = ("Incorrect API key provided" if header else
                   "No API key provided: send the header 'Authorization: Bearer KEY'")
        status, payload, headers = shape_of_path(scope["path"]).http(ProtocolError(Kind.UNAUTHENTICATED, message))
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                *((k.lower().encode(), v.encode()) for k, v in headers.items())]})
        await send({"type": "http.response.body", "body": payload})


class GrpcApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """The same check on gRPC calls (``authorization`` metadata), health methods exempt."""

    _MESSAGE = "missing or incorrect API key: send the metadata 'authorization: Bearer KEY'"

    def __init__(self, key: ApiKey):
        self.key = key

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)  # looks the method up; runs nothing
        if handler is None or details.method in OPEN_GRPC_METHODS:
            return handler
        header = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        if self.key.accepts(header):
            return handler
        return self._denial(handler)

    def _denial(self, handler):
        """A handler of the method's own kind (unary or streaming) that answers UNAUTHENTICATED."""

        async def deny(request_or_iterator, context):
            await context.abort(GRPC.status(ProtocolError(Kind.UNAUTHENTICATED, self._MESSAGE)), self._MESSAGE)

        if handler.request_streaming or handler.response_streaming:
            make = {(True, True): grpc.stream_stream_rpc_method_handler,
                    (True, False): grpc.stream_unary_rpc_method_handler,
                    (False, True): grpc.unary_stream_rpc_method_handler}
            return make[(handler.request_streaming, handler.response_streaming)](deny)
        return grpc.unary_unary_rpc_method_handler(deny)
