"""The served-model domain without a server: the registry's one lookup (``resolve``), its admission of parts, and
the core's refusals carrying their kind (runtime/serving, runtime/core/errors.py; docs/architecture.md).

The models here are plain stand-ins of the :class:`ServedModel` protocol; the API tests (test_openai_api.py,
test_tei_api.py, test_server.py, ...) cover the same refusals through real models and every wire shape.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

import pytest

from attnx.runtime.core.batcher import BatcherClosedError, QueueFullError, RequestTimeoutError
from attnx.runtime.core.errors import Kind, ProtocolError, Refusal
from attnx.runtime.core.scheduler import SchedulerClosed, SchedulerFull
from attnx.runtime.core.session import InputError
from attnx.runtime.core.text import TooLong
from attnx.runtime.serving.model import EMBED, GENERATE, INFER, RERANK, SCORE, ServedModel
from attnx.runtime.serving.registry import ModelRegistry, check_queue_room


@dataclass
class Stand:
    """A served model as the registry sees it."""

    name: str
    capabilities: frozenset[str]
    version: str = "1"
    tokenizer: None = None
    ready: bool = True
    queue_depth: int = 0
    max_queue: int = 8

    def unfit(self, capability: str) -> str:
        return f"model {self.name!r} cannot {capability}"

    def metadata(self) -> dict:
        return {"name": self.name}

    def config(self) -> dict:
        return {"name": self.name}

    def describe(self) -> list[str]:
        return [self.name]

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        self.ready = False


def registry(*models: Stand) -> ModelRegistry:
    found = ModelRegistry()
    for m in models:
        found.add(m)
    return found


def refusal(fn) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        fn()
    return info.value


EMBEDDER = Stand("emb", frozenset({INFER, EMBED}))
CLASSIFIER = Stand("cls", frozenset({INFER, SCORE}))
RERANKER = Stand("rr", frozenset({INFER, SCORE, RERANK}))
GENERATOR = Stand("gen", frozenset({GENERATE}))


def test_resolve_finds_the_named_or_the_only_able_model():
    models = registry(EMBEDDER, CLASSIFIER, RERANKER, GENERATOR)
    assert models.resolve("emb", EMBED) is EMBEDDER
    assert models.resolve(None, EMBED) is EMBEDDER and models.resolve("", GENERATE) is GENERATOR
    # Naming none for scoring means the classifier, though the reranker scores too.
    assert models.resolve(None, SCORE) is CLASSIFIER and models.resolve(None, RERANK) is RERANKER
    assert models.resolve("gen", GENERATE, "1", path=True) is GENERATOR


@pytest.mark.parametrize("call, kind, message, param", [
    # a JSON request's unknown name: the able models listed
    (lambda m: m.resolve("nope", EMBED), Kind.NOT_FOUND,
     "The model 'nope' does not exist on this server; its embedding models are ['emb']", None),
    # a path's unknown name or version: get()'s words
    (lambda m: m.resolve("nope", INFER, path=True), Kind.NOT_FOUND,
     "unknown model 'nope'; this server has ['cls', 'emb', 'gen', 'rr']", None),
    (lambda m: m.resolve("emb", INFER, "2", path=True), Kind.NOT_FOUND,
     "model 'emb' has no version '2' (versions: ['1'])", None),
    # a named model that cannot: its own words, on the 'model' field, from a path or a body alike
    (lambda m: m.resolve("gen", INFER, path=True), Kind.BAD_INPUT, "model 'gen' cannot infer", "model"),
    (lambda m: m.resolve("emb", GENERATE), Kind.BAD_INPUT, "model 'emb' cannot generate", "model"),
    # no name and not exactly one able model
    (lambda m: m.resolve(None, INFER), Kind.BAD_INPUT,
     "this server has several models ['emb', 'cls', 'rr']: name one in 'model'", "model"),
    (lambda m: registry().resolve(None, EMBED), Kind.BAD_INPUT,
     "this server has no embedding model (a tokenizer and a sentence_embedding output)", "model"),
])
def test_resolve_refuses_in_one_wording(call, kind, message, param):
    error = refusal(lambda: call(registry(EMBEDDER, CLASSIFIER, RERANKER, GENERATOR)))
    assert (error.kind, error.message, error.param) == (kind, message, param)


def test_parts_past_the_queue_are_too_large_and_past_its_room_overloaded():
    busy = Stand("busy", frozenset({INFER}), queue_depth=6, max_queue=8)
    check_queue_room(busy, 2)  # exactly fills it
    assert refusal(lambda: check_queue_room(busy, 9)).kind == Kind.TOO_LARGE  # never fits: a retry cannot help
    assert refusal(lambda: check_queue_room(busy, 3)).kind == Kind.OVERLOADED  # fits once the queue drains


def test_the_registry_is_typed_with_the_protocol():
    """The registry takes and gives ServedModels (mypy checks both model kinds against it where the server adds
    them: tests/test_types.py)."""
    assert typing.get_type_hints(ModelRegistry.add)["model"] is ServedModel
    assert typing.get_type_hints(ModelRegistry.get)["return"] is ServedModel


@pytest.mark.parametrize("error, kind", [
    (InputError("bad feeds"), Kind.BAD_INPUT), (TooLong("too long"), Kind.TOO_LARGE),
    (QueueFullError("full"), Kind.OVERLOADED), (RequestTimeoutError("late"), Kind.TIMEOUT),
    (BatcherClosedError("closed"), Kind.SHUTTING_DOWN), (SchedulerFull("full"), Kind.OVERLOADED),
    (SchedulerClosed("closed"), Kind.SHUTTING_DOWN),
])
def test_core_refusals_carry_their_kind(error, kind):
    """Each core exception that refuses a request says how (its kind), and is translated one way: its message
    after ``where``, on ``param``; each is still what callers catch it as (a ValueError, a TimeoutError...)."""
    assert isinstance(error, Refusal) and error.kind == kind
    answer = error.refused("text 3: ", "input")
    assert (answer.kind, answer.message, answer.param) == (kind, f"text 3: {error}", "input")
    assert isinstance(TooLong("x"), InputError) and isinstance(RequestTimeoutError("x"), TimeoutError)
