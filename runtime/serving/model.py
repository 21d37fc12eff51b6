"""What every served model provides: the :class:`ServedModel` protocol, and the capabilities a model states.

Two kinds implement it: encoders (:class:`~attnx.runtime.serving.encoder.EncoderModel`: a session and its batcher)
and text generators (:class:`~attnx.runtime.serving.generation.GenerationModel`: a decoder and its scheduler). The
registry, every route's lookup, the readiness probes, the metadata and config routes, the queue gauges and the
envelope's admission read a model through these members only; what one kind alone has (an encoder's batcher, a
generator's decoder) is read by the routes that asked the registry for a capability only that kind has.
"""

from __future__ import annotations

from typing import Any, Protocol

from attnx.runtime.core.text import TextTokenizer
from attnx.runtime.wire.envelope import Queued

INFER, EMBED, SCORE, RERANK, GENERATE, TOKENIZE = "infer", "embed", "score", "rerank", "generate", "tokenize"
#: How a refusal names each capability: (one, several, what it takes).
WORDS = {EMBED: ("embedding model", "embedding models", "a tokenizer and a sentence_embedding output"),
         SCORE: ("text classifier", "text classifiers", "a sequence classifier with a tokenizer"),
         RERANK: ("reranker", "rerankers", "a sequence classifier with a tokenizer and one label"),
         GENERATE: ("text generation model", "text generation models", "a with-past export"),
         TOKENIZE: ("model with a tokenizer", "models with a tokenizer", "a tokenizer"),
         INFER: ("model", "models", "a model")}


class ServedModel(Queued, Protocol):
    """One model behind the server, as the registry, the probes and the admission rules see it (read-only); its
    name and queue (``name``, ``queue_depth``: waiting now, ``max_queue``: the most it holds) are what the envelope
    admits requests by."""

    @property
    def version(self) -> str: ...  # each model has one, "1"

    @property
    def capabilities(self) -> frozenset[str]: ...  # of INFER, EMBED, SCORE, RERANK, GENERATE, TOKENIZE

    @property
    def tokenizer(self) -> TextTokenizer | None: ...

    @property
    def ready(self) -> bool: ...  # False once it closes (readiness probes answer 503)

    def unfit(self, capability: str) -> str:
        """Why this model cannot do ``capability`` (one line, for a 400)."""
        ...

    def metadata(self) -> dict[str, Any]:
        """KServe v2 model metadata."""
        ...

    def config(self) -> dict[str, Any]:
        """A Triton model configuration (JSON form)."""
        ...

    def describe(self) -> list[str]:
        """How it is served, for ``attnx serve --describe``."""
        ...

    def close(self, drain: bool = True, timeout: float | None = None) -> None: ...
