"""Sentence embeddings for the OpenAI-compatible and TEI-compatible routes, on the KServe server's own queue.

:mod:`attnx.runtime.apis.openai` (``/v1/embeddings``) and :mod:`attnx.runtime.apis.tei` (``/embed``) differ
only in their wire shapes; what they share is here: which served models embed (a tokenizer and a
``sentence_embedding`` output), the inputs (a string, a list of strings, token ids as one list or a list of
lists, in the model's own vocabulary, used as given), the limits, and the run itself. Each input becomes one
row that joins the model's :class:`~attnx.runtime.core.batcher.DynamicBatcher` on its own
(:func:`attnx.runtime.apis.registry.infer_rows`), exactly as a KServe text request's texts do, so all three APIs
share one queue, one set of limits (:class:`~attnx.runtime.apis.kserve_tensors.Limits`: ``max_texts`` inputs,
``max_request_tokens`` tokens, ``max_body_bytes``, the decode budget) and one set of metrics.

Errors are :class:`~attnx.runtime.apis.kserve_tensors.ProtocolError` subclasses; :class:`InputProblem` also names the
request field at fault (``param``), which OpenAI's error shape carries.

Fewer dimensions (``dimensions``): the Matryoshka convention, the first ``k`` values renormalised to unit
length. A model not trained for it loses quality when cut, so the operator allows it per model
(:class:`Dimensions`, ``attnx serve --dimensions``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Collection, Mapping, Sequence

import numpy as np
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from attnx.contract import Role
from attnx.runtime.apis import kserve_tensors as proto
from attnx.runtime.apis import registry as service
from attnx.runtime.wire.limits import ByteBudget, declared_length, read_body
from attnx.runtime.wire.metrics import ServerMetrics
from attnx.runtime.apis.registry import ModelRegistry, ServedModel
from attnx.runtime.core.session import InputError, public_message
from attnx.runtime.core.text import Encoded, context_rows, text_feeds

#: The output these routes serve: the export's own pooling (and normalisation, when its pipeline has one).
OUTPUT = "sentence_embedding"
#: Parse bodies / tokenise inputs beyond this size off the event loop, so other requests keep flowing.
_OFFLOAD_BYTES = 64 << 10
log = logging.getLogger("attnx.serve")


class InputProblem(proto.BadRequest):
    """A 400 naming the request field at fault (OpenAI's ``param``)."""

    def __init__(self, message: str, param: str | None = "input", code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class TooManyInputs(InputProblem):
    """More inputs than ``Limits.max_texts`` (OpenAI answers 400, TEI 413)."""


class UnknownModel(proto.NotFound):
    """A ``model`` this server does not serve (404)."""


@dataclass
class Embedded:
    vectors: np.ndarray  # [inputs, dims] float32
    tokens: int  # summed over the inputs, after truncation, special tokens included


# --------------------------------------------------------------------------------------
# Which models, which dimensions
# --------------------------------------------------------------------------------------


def unfit_reason(model: ServedModel) -> str | None:
    """Why ``model`` cannot serve embeddings from text, or None when it can."""
    if model.tokenizer is None:
        return f"model {model.name!r} has no tokenizer (serve it with --tokenizer DIR to take text)"
    if OUTPUT not in model.session.output_names:
        return (f"model {model.name!r} gives no {OUTPUT!r} output (its outputs: {model.session.output_names}); "
                f"use KServe v2 (/v2/models/{model.name}/infer) for it")
    return None


def full_size(model: ServedModel) -> int | None:
    """The embedding's size when the file states it (None: known after the first run)."""
    spec = next(s for s in model.session.outputs if s.name == OUTPUT)
    last = spec.shape[-1] if spec.shape else None
    return last if isinstance(last, int) else None


def embedding_models(registry: ModelRegistry) -> list[ServedModel]:
    return [m for m in registry.models.values() if unfit_reason(m) is None]


def pick_model(registry: ModelRegistry, name: Any) -> ServedModel:
    """The model a request names, or (no name) the server's only embedding model."""
    if name is None or name == "":
        models = embedding_models(registry)
        if len(models) == 1:
            return models[0]
        names = [m.name for m in models]
        raise InputProblem(f"this server has several embedding models {names}: name one in 'model'" if names
                           else "this server has no embedding model (a tokenizer and a sentence_embedding output)",
                           param="model")
    if not isinstance(name, str):
        raise InputProblem("'model' must be a string", param="model")
    model = registry.models.get(name)
    if model is None:
        raise UnknownModel(f"The model {name!r} does not exist on this server; it serves "
                           f"{[m.name for m in embedding_models(registry)]}")
    reason = unfit_reason(model)
    if reason is not None:
        raise InputProblem(reason, param="model")
    return model


@dataclass(frozen=True)
class Dimensions:
    """Which models may be cut to fewer dimensions: ``{model name, or None for every model: the sizes
    allowed, or None for any}``. Empty: none may (``dimensions`` equal to the full size is always fine)."""

    allowed: Mapping[str | None, frozenset[int] | None] = field(default_factory=dict)

    @classmethod
    def parse(cls, items: Sequence[str] | None, names: Collection[str]) -> "Dimensions":
        """``attnx serve --dimensions``: ``any`` or ``64,128,256`` for every model, ``NAME=any`` or
        ``NAME=64,128`` for one. Raises ValueError with a one-line message."""
        allowed: dict[str | None, frozenset[int] | None] = {}
        for item in items or ():
            name, sep, spec = item.rpartition("=")
            key = name if sep else None
            if key is not None and key not in names:
                raise ValueError(f"--dimensions {item}: no model named {key!r} (models: {sorted(names)})")
            if spec.strip().lower() == "any":
                allowed[key] = None
                continue
            try:
                sizes = frozenset(int(v) for v in spec.replace(" ", "").split(",") if v)
            except ValueError:
                raise ValueError(f"--dimensions {item}: takes 'any' or comma-separated sizes, "
                                 f"e.g. 64,128,256 (optionally NAME=...)") from None
            if not sizes or min(sizes) < 1:
                raise ValueError(f"--dimensions {item}: sizes must be positive integers")
            allowed[key] = sizes
        return cls(allowed)

    def size(self, model: str, full: int, requested: Any) -> int:
        """The size to answer with: ``requested`` when allowed, ``full`` when not asked."""
        if requested is None or (isinstance(requested, int) and not isinstance(requested, bool)
                                 and requested == full):
            return full
        if not isinstance(requested, int) or isinstance(requested, bool) or not 1 <= requested <= full:
            raise InputProblem(f"'dimensions' must be an integer from 1 to {full} (model {model!r} gives "
                               f"{full}), got {requested!r}", param="dimensions")
        key = model if model in self.allowed else None
        if key not in self.allowed:
            raise InputProblem(f"model {model!r} does not allow 'dimensions' below its {full}: the server "
                               f"operator enables it with --dimensions (for models trained to be cut)",
                               param="dimensions")
        sizes = self.allowed[key]
        if sizes is not None and requested not in sizes:
            raise InputProblem(f"model {model!r} allows 'dimensions' {sorted(sizes)} (or {full}), not {requested}",
                               param="dimensions")
        return requested


def cut(vectors: np.ndarray, dims: int) -> np.ndarray:
    """The first ``dims`` values of each row, renormalised to unit length (the Matryoshka convention)."""
    if dims == vectors.shape[1]:
        return vectors
    return normalize(vectors[:, :dims])


def normalize(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32, copy=False)


# --------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------


def parse_inputs(value: Any, limits: proto.Limits, param: str = "input") -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids, or a list of such lists (strings and id lists may
    mix, as TEI allows) -> one item per input."""
    if isinstance(value, str):
        items: list = [value]
    elif isinstance(value, list):
        if not value:
            raise InputProblem(f"'{param}' is an empty list", param=param, code="empty_input")
        items = [value] if all(_is_int(v) for v in value) else value
    else:
        raise InputProblem(f"'{param}' must be a string, a list of strings or a list of token-id lists, "
                           f"got {type(value).__name__}", param=param)
    if len(items) > limits.max_texts:
        raise TooManyInputs(f"'{param}' has {len(items)} inputs, over the limit of {limits.max_texts} per request; "
                            f"send them in several requests", param=param, code="too_many_inputs")
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise InputProblem(f"{param}[{i}] is an empty string", param=param)
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InputProblem(f"{param}[{i}] is not valid UTF-8 (a lone surrogate at position {e.start})",
                                   param=param) from None
        elif isinstance(item, list):
            if not item:
                raise InputProblem(f"{param}[{i}] is an empty list of token ids", param=param)
            if not all(_is_int(v) for v in item):
                raise InputProblem(f"{param}[{i}] must be a string or a list of integer token ids", param=param)
        else:
            raise InputProblem(f"{param}[{i}] is {type(item).__name__}, not a string or a list of token ids",
                               param=param)
    return items


def parse_context(value: Any, model: ServedModel) -> dict[str, np.ndarray]:
    """A variant's per-example context inputs (an attnx extension, ``"context": {name: rows}``, one row per
    input): checked for names and finite values here, for shapes when split into rows."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InputProblem("'context' must be an object: {input name: one row per input}", param="context")
    specs = {s.name: s for s in model.session.inputs if s.name not in model.signature.text_filled}
    out = {}
    for name, rows in value.items():
        spec = specs.get(name)
        if spec is None:
            raise InputProblem(f"'context' names {name!r}; model {model.name!r} takes {sorted(specs) or 'none'}",
                               param="context")
        try:
            arr = np.asarray(rows, dtype=spec.dtype)
        except (TypeError, ValueError, OverflowError):
            raise InputProblem(f"context {name!r}: not a regular list of {spec.dtype} values",
                               param="context") from None
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise InputProblem(f"context {name!r}: holds NaN or infinite values", param="context")
        out[name] = arr
    return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ids_row(model: ServedModel, ids: list[int], index: int, truncate: bool, param: str) -> Encoded:
    """Token ids as given (the model's vocabulary), checked against its range, cut to its max length."""
    spec = next(s for s in model.session.inputs if s.role == Role.INPUT_IDS)
    low, high = spec.range if spec.range is not None else (0, model.tokenizer.vocab_size)
    bad = next((v for v in ids if not low <= v < high), None)
    if bad is not None:
        raise InputProblem(f"{param}[{index}]: token id {bad} is outside the model's vocabulary [{low}, {high})",
                           param=param)
    arr = np.asarray(ids, dtype=np.int64)
    limit = model.tokenizer.max_length
    cut_it = limit is not None and arr.shape[0] > limit
    if cut_it and not truncate:
        raise InputProblem(f"{param}[{index}] has {arr.shape[0]} tokens, more than the model's max length "
                           f"{limit} (and truncation is off)", param=param)
    if cut_it:
        arr = arr[:limit] if model.tokenizer.truncation_side == "right" else arr[-limit:]
    return Encoded(arr, np.zeros_like(arr), cut_it)


# --------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------


async def embed(model: ServedModel, items: list[str | list[int]], *, truncate: bool = True,
                context: Mapping[str, np.ndarray] | None = None, param: str = "input") -> Embedded:
    """Tokenise, check the limits, run every input through the model's batcher; ``[N, d]`` float32."""
    check_room(model, len(items))  # before any tokenising
    encoded: list[Encoded | None] = [None] * len(items)
    texts = [(i, s) for i, s in enumerate(items) if isinstance(s, str)]
    if texts:
        # Always cut (the Encoded says whether it was), so a refusal below names the input at fault.
        run = functools.partial(model.tokenizer.tokenize, [s for _, s in texts], truncate=True, allow_empty=True)
        try:
            found = await asyncio.to_thread(run) if sum(len(s) for _, s in texts) > _OFFLOAD_BYTES else run()
        except InputError as e:
            raise InputProblem(f"'{param}': {e}", param=param) from None
        for (i, _), enc in zip(texts, found):
            if enc.truncated and not truncate:
                raise InputProblem(f"{param}[{i}] is longer than the model's max length {model.tokenizer.max_length} "
                                   f"tokens (and truncation is off)", param=param)
            encoded[i] = enc
    for i, item in enumerate(items):
        if isinstance(item, list):
            encoded[i] = _ids_row(model, item, i, truncate, param)
    vectors = await run_encoded(model, encoded, context, OUTPUT)
    return Embedded(vectors.astype(np.float32, copy=False), sum(e.length for e in encoded))


def check_room(model: ServedModel, count: int) -> None:
    """Refuse, before any work, a request of ``count`` inputs the model's queue cannot take."""
    queue, room = model.batcher, model.batcher.config.max_queue_size
    if count > room:  # could never be queued: a 429 would only be retried forever
        raise proto.TooLarge(f"{count} inputs, but model {model.name!r} queues at most {room} at once: "
                             f"send at most {room} per request")
    if queue.queue_depth + count > room:
        raise proto.Overloaded(f"model {model.name!r}: queue full ({room} inputs waiting at most); retry later")


async def run_encoded(model: ServedModel, encoded: Sequence[Encoded], context: Mapping[str, np.ndarray] | None,
                      output: str) -> np.ndarray:
    """Each tokenised input (with its context row) through the model's batcher, within the request's token
    budget; ``output`` of every input, stacked along the batch axis (the embedding and scoring routes)."""
    service.check_token_budget(sum(e.length for e in encoded), model.limits)
    try:
        contexts = context_rows(model.session.inputs, dict(context or {}), len(encoded))
        rows = [text_feeds(model.session.inputs, e, c) for e, c in zip(encoded, contexts)]
    except InputError as e:
        raise InputProblem(str(e), param="context" if context else "input") from None
    missing = [s.name for s in model.session.inputs
               if s.name not in rows[0] and s.name not in model.signature.optional_inputs]
    if missing:
        raise InputProblem(f"model {model.name!r} also needs its context inputs {missing}, one row per input: "
                           f"send them as \"context\": {{name: rows}}", param="context")
    parts = await service.infer_rows(model, rows, [output])
    return np.concatenate([p[output] for p in parts], axis=0)


# --------------------------------------------------------------------------------------
# HTTP plumbing the JSON APIs share (embeddings here; rerank and classify: attnx.runtime.apis.scoring)
# --------------------------------------------------------------------------------------


@dataclass
class EmbeddingApi:
    """What the routes need of the server: its models, metrics, limits, decode budget and the dimensions policy."""

    registry: ModelRegistry
    metrics: ServerMetrics
    limits: proto.Limits
    budget: ByteBudget
    dimensions: Dimensions = field(default_factory=Dimensions)
    started: int = field(default_factory=lambda: int(time.time()))

    async def read_json(self, request: Request) -> Any:
        """The body as JSON, read under the same rules as a KServe body: 413 over the body limit before a
        byte is read, the decode budget held while reading and parsing."""
        size = declared_length(request, self.limits.max_body_bytes)
        async with self.budget.hold(self.limits.max_body_bytes if size is None else size, self.limits.decode_wait_s):
            body = await read_body(request, self.limits.max_body_bytes, size)
            try:
                if len(body) > _OFFLOAD_BYTES:
                    return await asyncio.to_thread(json.loads, body)
                return json.loads(body)
            except (ValueError, RecursionError) as e:
                reason = " ".join(str(e).split())[:120]
                raise InputProblem(f"the body is not valid JSON ({reason})", param=None) from None

    async def answer(self, run: Callable[["Call"], Awaitable[Response]],
                     error: Callable[[proto.ProtocolError], Response]) -> Response:
        """Run one request with the server's metrics; every failure becomes ``error(...)``, never a crash."""
        call = Call(time.perf_counter())
        try:
            response = await run(call)
        except proto.ProtocolError as e:
            self.metrics.failure(call.label, e.reason)
            return error(e)
        except ClientDisconnect:  # the client went away mid-body: its time-out, not our error
            self.metrics.failure(call.label, "client_disconnect")
            return error(_Disconnected("client disconnected"))
        except Exception as e:  # noqa: BLE001 - the server never dies on a request
            self.metrics.failure(call.label, "internal")
            log.exception("internal error in an embeddings request")
            return error(Internal(f"internal error: {type(e).__name__}: {public_message(str(e))}"))
        self.metrics.success(call.label, time.perf_counter() - call.started)
        return response

    def model(self, call: "Call", name: Any) -> ServedModel:
        model = pick_model(self.registry, name)
        call.label = model.name
        return model


@dataclass
class Call:
    started: float
    label: str = "_unknown_"  # the metrics label: the model once known (bounded cardinality)


class Internal(proto.ProtocolError):
    status = 500
    reason = "internal"


class _Disconnected(proto.ProtocolError):
    status = 499
    reason = "client_disconnect"


async def encode_response(size: int, encode: Callable[[], bytes]) -> bytes:
    """Big responses are encoded in a worker thread: JSON of floats holds the GIL, but not the event loop."""
    return await asyncio.to_thread(encode) if size > _OFFLOAD_BYTES else encode()
