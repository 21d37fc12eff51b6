"""attnx runtime, the serving stack: load a model once, run it many times, batch concurrent requests, serve it.

Modules: ``session`` (the :class:`Session` interface, feed checks, :func:`load`), ``axes`` (batch and
sequence axes of any ONNX file), ``backends/`` (ONNX Runtime, TensorRT engines), ``batcher``, ``text``
(tokenising), ``encode`` (embedded text use), ``protocol`` (KServe v2 requests), ``http_codec``,
``service`` (what both front ends share), ``server`` (HTTP), ``grpc_server``, ``metrics``,
``embeddings`` / ``openai_api`` / ``tei_api`` (the OpenAI and TEI embedding routes), ``auth`` (``--api-key``),
``pooling`` (a sentence embedding for files with token embeddings only), ``model_checks`` (what a file's
metadata promises, checked at load), ``pacing`` (refusing what cannot start before its deadline),
``http_guard`` (header size and count, idle heads, file descriptors).
Offline tooling lives elsewhere: engines in :mod:`attnx.engine`, parity in :mod:`attnx.parity`,
Triton repositories and load tests in :mod:`attnx.deploy`.

Public names (see docs/embedding.md for a service embedding them):

- ``load(path, device="auto", threads=None)`` -> :class:`Session` (``.onnx`` on
  ONNX Runtime, ``.engine`` through :mod:`attnx.engine`); ``.inputs``,
  ``.outputs`` (:class:`TensorSpec`), ``.run(feeds) -> outputs``; thread-safe.
- :class:`DynamicBatcher` / :class:`BatcherConfig`: pad-and-mask dynamic batching.
- :class:`TextModel`: a text model with its tokenizer, ``encode(sentences, ...)`` as
  sentence-transformers has it, ``logits(texts)`` for causal LMs (``encode``).
- :class:`InferenceServer`: the KServe v2 HTTP server (``attnx serve``); needs the
  ``serve`` extra (fastapi, uvicorn, prometheus-client).
"""

from attnx.runtime.core.batcher import (
    BatcherClosedError,
    BatcherConfig,
    DynamicBatcher,
    QueueFullError,
    RequestTimeoutError,
)
from attnx.runtime.core.encode import TextModel
from attnx.runtime.core.session import InputError, Session, TensorSpec, load

__all__ = [
    "load",
    "Session",
    "TensorSpec",
    "InputError",
    "DynamicBatcher",
    "BatcherConfig",
    "QueueFullError",
    "RequestTimeoutError",
    "BatcherClosedError",
    "InferenceServer",
    "TextModel",
]


def __getattr__(name: str):
    # The server pulls in FastAPI/uvicorn/prometheus: import it only when asked for.
    if name == "InferenceServer":
        from attnx.runtime.server import InferenceServer

        return InferenceServer
    raise AttributeError(f"module 'attnx.runtime' has no attribute {name!r}")
