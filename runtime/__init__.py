"""attnx runtime, the serving stack: load a model once, run it many times, batch concurrent requests, serve it.

Four layers, each a package (bottom first; checked: pyproject's ``runtime-layers`` contract):

- ``core/``: running models, no network: sessions and their backends (``session``, ``backends/``, ``axes``,
  ``model_checks``), the dynamic batcher (``batcher``, ``layout``, ``pacing``), text (``text``, ``pooling``,
  ``labels``, ``encode``: embedded use), generation (``decoding``, ``sampling``, ``generate``, ``detokenize``,
  ``scheduler``, ``chat``: chat templates in a worker process), the error taxonomy its refusals carry (``errors``).
- ``wire/``: what every request goes through: one status table per wire shape
  (``errors``), the one envelope (``envelope``), limits and the worker policy (``limits``), the byte budget
  (``budget``), raw-JSON counts (``counts``), the HTTP app (``http``), the gRPC front end (``grpc``), connection
  bounds (``http_guard``), ``auth``, ``metrics``.
- ``serving/``: the served models: what each provides (``model``: the ``ServedModel`` protocol), the one registry
  and its admission rules (``registry``), the encoder model (``encoder``), its KServe signature (``signature``) and
  Triton config (``model_config``), the encoding service of every embedding and scoring API (``encoding``), the
  text generator model and its prompts, parameters and streams (``generation``), and what the routes share
  (``state``).
- ``apis/``: the served APIs over the registry, with typed requests (``requests``): KServe v2 over HTTP and gRPC
  (``kserve``, ``kserve_grpc``, ``kserve_tensors``, ``kserve_json``), OpenAI (``openai``, ``completions``), TEI
  (``tei``, ``tei_grpc`` with ``tei.proto``), rerank and classify (``scoring``), Triton generate (``generate``),
  vLLM's tokenize (``tokenize``), attention pages (``explain``).

``server`` assembles them (:class:`InferenceServer`, ``attnx serve``) from ``config``
(:class:`~attnx.runtime.config.ServingConfig`). Offline tooling lives elsewhere: engines in :mod:`attnx.engine`,
parity in :mod:`attnx.parity`, Triton repositories and load tests in :mod:`attnx.deploy`.

Public names (see docs/embedding.md for a service embedding them):

- ``load(path, device="auto", threads=None)`` -> :class:`Session` (``.onnx`` on ONNX Runtime, ``.engine`` through
  :mod:`attnx.engine`); ``.inputs``, ``.outputs`` (:class:`TensorSpec`), ``.run(feeds) -> outputs``; thread-safe.
- :class:`DynamicBatcher` / :class:`BatcherConfig`: pad-and-mask dynamic batching;
  :class:`BatchLayout`: its pad / merge / split alone (for a host that forms batches itself, like Triton).
- :class:`TextModel`: a text model with its tokenizer, ``encode(sentences, ...)`` as sentence-transformers has it,
  ``logits(texts)`` for causal LMs, ``generate(prompt)`` for with-past exports.
- :class:`InferenceServer`: the server of ``attnx serve`` (KServe v2 HTTP + gRPC, OpenAI, TEI, rerank); needs
  the ``serve`` extra.
"""

if not __name__.startswith("attnx."):  # one file, one module: src/attnx links this folder as attnx.runtime
    raise ImportError(f"import attnx.runtime, not {__name__}: the package is attnx (pip install -e .)")

from attnx.runtime.core.encode import TextModel
from attnx.runtime.core.layout import BatchLayout
from attnx.runtime.core.loading import load
from attnx.runtime.core.session import InputError, Session, TensorSpec

__all__ = ["load", "Session", "TensorSpec", "InputError", "DynamicBatcher", "BatchLayout", "BatcherConfig",
           "QueueFullError", "RequestTimeoutError", "BatcherClosedError", "InferenceServer", "TextModel"]


_BATCHER = ("DynamicBatcher", "BatcherConfig", "QueueFullError", "RequestTimeoutError", "BatcherClosedError")


def __getattr__(name: str):
    # Imported when asked for: the server pulls in FastAPI/uvicorn/prometheus, the batcher asyncio (and with it
    # ssl, sockets, subprocess: ~6 MB and 0.2 s that a process which only loads and runs a model never uses).
    if name == "InferenceServer":
        from attnx.runtime.server import InferenceServer

        return InferenceServer
    if name in _BATCHER:
        from attnx.runtime.core import batcher

        return getattr(batcher, name)
    raise AttributeError(f"module 'attnx.runtime' has no attribute {name!r}")
