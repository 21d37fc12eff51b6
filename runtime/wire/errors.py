"""One error taxonomy for every API, and one status table per wire shape: the only place a kind becomes a status.

Everything the serving stack refuses is a :class:`ProtocolError` (:mod:`attnx.runtime.core.errors`): a :class:`Kind`,
a one-line message and, when there is one, the request field at fault (``param``). Overload carries ``Retry-After: 1``; what can never fit
(``too_large``) does not. ``too_many``: more inputs than ``--max-inputs`` (OpenAI 400, TEI 413);
``unprocessable``: a result JSON cannot carry (NaN in an output); ``body_timeout``: an HTTP body that
arrived too slowly (408, and the connection is closed). The kind is the ``reason`` label of
``attnx_request_failures_total``. docs/serving.md shows the tables side by side.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

# The taxonomy lives in the core, which raises these too (it never imports the wire); re-exported for the wire and APIs.
from attnx.runtime.core.errors import Kind, ProtocolError, bad_input, not_found, overloaded, too_large  # noqa: F401


K = Kind
#: KServe v2 over HTTP (and Triton's generate extension, the explain pages): ``{"error": message}``.
KSERVE_HTTP = {K.BAD_INPUT: 400, K.EMPTY: 400, K.TOO_MANY: 400, K.TOO_LARGE: 413, K.UNPROCESSABLE: 422,
               K.NOT_FOUND: 404, K.UNAUTHENTICATED: 401, K.OVERLOADED: 503, K.TIMEOUT: 503, K.SHUTTING_DOWN: 503,
               K.UNIMPLEMENTED: 501, K.CLIENT_GONE: 499, K.INTERNAL: 500, K.BODY_TIMEOUT: 408}
#: KServe v2 over gRPC (``inference.GRPCInferenceService``), ``grpc.StatusCode`` names (grpc is imported only by
#: a server with a gRPC port): a full queue is RESOURCE_EXHAUSTED, as Triton says it.
KSERVE_GRPC = {K.BAD_INPUT: "INVALID_ARGUMENT", K.EMPTY: "INVALID_ARGUMENT", K.TOO_MANY: "INVALID_ARGUMENT",
               K.TOO_LARGE: "RESOURCE_EXHAUSTED", K.UNPROCESSABLE: "INVALID_ARGUMENT", K.NOT_FOUND: "NOT_FOUND",
               K.UNAUTHENTICATED: "UNAUTHENTICATED", K.OVERLOADED: "RESOURCE_EXHAUSTED", K.TIMEOUT: "DEADLINE_EXCEEDED",
               K.SHUTTING_DOWN: "UNAVAILABLE", K.UNIMPLEMENTED: "UNIMPLEMENTED", K.CLIENT_GONE: "CANCELLED",
               K.INTERNAL: "INTERNAL", K.BODY_TIMEOUT: "DEADLINE_EXCEEDED"}
#: OpenAI (and Cohere/Jina rerank, Infinity classify): status, ``type``, ``code``. Overload is 429, which the
#: ``openai`` client retries after ``Retry-After``.
OPENAI = {K.BAD_INPUT: (400, "invalid_request_error", None), K.EMPTY: (400, "invalid_request_error", "empty_input"),
          K.TOO_MANY: (400, "invalid_request_error", "too_many_inputs"),
          K.TOO_LARGE: (413, "invalid_request_error", "request_too_large"),
          K.UNPROCESSABLE: (422, "invalid_request_error", None),
          K.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
          K.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
          K.OVERLOADED: (429, "rate_limit_error", "server_is_overloaded"),
          K.TIMEOUT: (429, "rate_limit_error", "server_is_overloaded"),
          K.SHUTTING_DOWN: (503, "service_unavailable_error", "shutting_down"),
          K.UNIMPLEMENTED: (501, "invalid_request_error", "unsupported"),
          K.CLIENT_GONE: (499, "invalid_request_error", None), K.INTERNAL: (500, "server_error", None),
          K.BODY_TIMEOUT: (408, "invalid_request_error", "request_timeout")}
#: Hugging Face text-embeddings-inference over HTTP: status and ``error_type`` (TEI's own words).
TEI_HTTP = {K.BAD_INPUT: (422, "Validation"), K.EMPTY: (400, "Empty"), K.TOO_MANY: (413, "Validation"),
            K.TOO_LARGE: (413, "Validation"), K.UNPROCESSABLE: (422, "Validation"), K.NOT_FOUND: (404, "Validation"),
            K.UNAUTHENTICATED: (401, "Unauthorized"), K.OVERLOADED: (429, "Overloaded"), K.TIMEOUT: (429, "Overloaded"),
            K.SHUTTING_DOWN: (503, "Unhealthy"), K.UNIMPLEMENTED: (501, "Validation"),
            K.CLIENT_GONE: (499, "Validation"), K.INTERNAL: (500, "Backend"), K.BODY_TIMEOUT: (408, "Validation")}
#: TEI's ``tei.v1`` over gRPC: its validation errors (too many inputs among them) are INVALID_ARGUMENT.
TEI_GRPC = {**KSERVE_GRPC, K.TOO_LARGE: "INVALID_ARGUMENT"}


@dataclass(frozen=True)
class Shape:
    """A wire shape: its name, its status table, and (HTTP) how an error's body is written."""

    name: str
    table: dict
    body: Callable[[ProtocolError, Any], dict] | None = None  # (error, its row of the table) -> JSON body

    def status(self, error: ProtocolError):
        """The HTTP status, or the ``grpc.StatusCode``, of ``error`` in this shape."""
        row = self.table[error.kind]
        if isinstance(row, str):
            import grpc

            return getattr(grpc.StatusCode, row)
        return row[0] if isinstance(row, tuple) else row

    def http(self, error: ProtocolError) -> tuple[int, bytes, dict]:
        """``(status, JSON body, headers)`` of ``error`` in this shape."""
        row = self.table[error.kind]
        status = self.status(error)
        headers = {"Retry-After": "1"} if error.kind in (K.OVERLOADED, K.TIMEOUT, K.SHUTTING_DOWN) else {}
        if error.kind == K.UNAUTHENTICATED:
            headers["WWW-Authenticate"] = 'Bearer realm="attnx"'
        if error.kind == K.BODY_TIMEOUT:  # the rest of its body is never read: the connection cannot be reused
            headers["Connection"] = "close"
        if self.body is None:
            raise TypeError(f"the {self.name} shape is not an HTTP one")
        return status, json.dumps(self.body(error, row)).encode(), headers


def _openai_body(e: ProtocolError, row) -> dict:
    return {"error": {"message": e.message, "type": row[1], "param": e.param, "code": row[2]}}


KSERVE = Shape("kserve", KSERVE_HTTP, lambda e, row: {"error": e.message})
GRPC = Shape("kserve-grpc", KSERVE_GRPC)
OPENAI_SHAPE = Shape("openai", OPENAI, _openai_body)
TEI = Shape("tei", TEI_HTTP, lambda e, row: {"error": e.message, "error_type": row[1]})
TEI_GRPC_SHAPE = Shape("tei-grpc", TEI_GRPC)


def shape_of_path(path: str) -> Shape:
    """The wire shape of an HTTP path, for errors raised before a route runs (auth, unknown routes)."""
    if path.startswith(("/v1/", "/v2/rerank", "/classify")) or path == "/embeddings":
        return OPENAI_SHAPE
    if path in ("/embed", "/predict", "/rerank", "/info", "/health", "/"):
        return TEI
    return KSERVE
