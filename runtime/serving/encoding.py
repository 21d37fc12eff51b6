"""Texts through an encoder, for every API that embeds or scores (OpenAI, TEI, Cohere/Jina, Infinity; HTTP and gRPC).

Strings, token-id lists (the model's own vocabulary, used as given) or (query, document) pairs (the tokenizer's
pair template, cut longest-first) are tokenised on the worker thread when large, a long text from a prefix of it
(:meth:`~attnx.runtime.core.text.TextTokenizer.tokenize`: the same tokens), else cut to the model's character cap, 64
at a time; the request's tokens are held to ``--max-request-tokens`` and its compute to
what can start before the queue deadline (both checked after each group, so a request far over either is refused
before all of it is tokenised); each input joins the model's
batcher on its own (:meth:`~attnx.runtime.serving.encoder.EncoderModel.run_rows`), as a KServe text request's texts
do. ``dimensions``: the Matryoshka convention, allowed per model by the operator (:class:`Dimensions`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Mapping, NamedTuple, Sequence

import numpy as np

from attnx.contract import Role
from attnx.runtime.core import pacing
from attnx.runtime.core.session import InputError, TensorSpec
from attnx.runtime.core.text import Encoded, TextTokenizer, context_rows, text_feeds
from attnx.runtime.serving.encoder import EMBEDDING, LOGITS, EncoderModel
from attnx.runtime.serving.registry import check_queue_room
from attnx.runtime.wire.errors import Kind, ProtocolError, bad_input
from attnx.runtime.wire.limits import Workers

Item = str | list[int] | tuple[str, str]  # a text, token ids, or a (first, second) pair such as (query, document)


class Result(NamedTuple):
    values: np.ndarray  # [inputs, d] float32: sentence embeddings or label logits
    tokens: int  # summed over the inputs, after truncation, special tokens included


async def encode(model: EncoderModel, items: Sequence[Item], workers: Workers, *, output: str = EMBEDDING,
                 truncate: bool = True, context: Any = None, param: str = "input") -> Result:
    """Tokenise, check the limits, run every input through the model's batcher: ``output`` of each, stacked."""
    model.limits.check_count(len(items), param)
    tok = model.text_tokenizer()
    check_queue_room(model, len(items))  # before any tokenising
    context = context_arrays(context, [s for s in model.session.inputs if s.name not in model.signature.text_filled],
                             model.name)
    encoded = await _tokenize(model, tok, items, workers, param)
    if not truncate:
        cut = next((i for i, e in enumerate(encoded) if e.truncated), None)
        if cut is not None:
            raise bad_input(f"{param}[{cut}] is longer than the model's max length {tok.max_length} "
                            f"tokens (and truncation is off)", param)
    model.limits.check_tokens(sum(e.length for e in encoded))
    try:
        contexts = context_rows(model.session.inputs, context, len(encoded))
        rows = [text_feeds(model.session.inputs, e, c) for e, c in zip(encoded, contexts)]
    except InputError as e:
        raise e.refused(param="context" if context else param) from None
    missing = [s.name for s in model.session.inputs if s.name not in rows[0] and s.name not in model.signature.optional_inputs]
    if missing:
        raise bad_input(f"model {model.name!r} also needs its context inputs {missing}, one row per input: send them "
                        f"as \"context\": {{name: rows}}", "context")
    parts = await model.run_rows(rows, [output])
    values = np.concatenate([p[output] for p in parts], axis=0).astype(np.float32, copy=False)
    if output == LOGITS and not np.isfinite(values).all():
        raise ProtocolError(Kind.UNPROCESSABLE, f"model {model.name!r} gave NaN or infinite logits for these inputs "
                                                f"(context values far out of range?)")
    return Result(values, sum(e.length for e in encoded))


async def _tokenize(model: EncoderModel, tok: TextTokenizer, items: Sequence[Item], workers: Workers,
                    param: str) -> list[Encoded]:
    """Each item's tokens, always cut to the max length (the Encoded says whether it was, so a refusal can name
    the input at fault); token ids are used as given, checked against the vocabulary."""
    texts = [(i, t) for i, t in enumerate(items) if isinstance(t, str)]
    pairs = [(i, p) for i, p in enumerate(items) if isinstance(p, tuple)]
    ids = [(i, t) for i, t in enumerate(items) if isinstance(t, list)]

    def run() -> dict[int, Encoded]:
        """In groups, the request's tokens and compute checked after each: a request far over
        ``max_request_tokens``, or needing more compute than can start before its queue deadline
        (:func:`~attnx.runtime.core.pacing.check`, on the rates the model has shown), is refused once it is known
        to be, and a group's transient tokenizer state (a long text's overflow) is all that is held at once."""
        found: dict[int, Encoded] = {}
        tokens, parts = 0, []
        for kind, group in _groups(texts, pairs):
            done = tok.tokenize([t for _, t in group], allow_empty=True) if kind == "text" else \
                tok.tokenize_pairs([p for _, p in group])
            found.update(zip((i for i, _ in group), done))
            tokens += sum(e.length for e in done)
            partial = len(found) < len(texts) + len(pairs)
            model.limits.check_tokens(tokens, partial=partial)
            parts += [(1, e.length) for e in done]
            if partial and getattr(model, "batcher", None) is not None:
                pacing.check(model.batcher, parts, None)  # the batcher's own check follows on all of them
        return found

    chars = sum(len(t) for _, t in texts) + sum(len(a) + len(b) for _, (a, b) in pairs)
    try:
        found = await workers.run(run, cost=chars)
    except InputError as e:
        raise e.refused(f"'{param}': ", param) from None
    found.update((i, _ids_row(model, tok, t, i, param)) for i, t in ids)  # in order: the first bad one is named
    return [found[i] for i in range(len(items))]


#: Texts tokenised at once (each group's token count is checked before the next is tokenised).
_GROUP = 64


def _groups(texts: list, pairs: list):
    for kind, items in (("text", texts), ("pair", pairs)):
        for start in range(0, len(items), _GROUP):
            yield kind, items[start:start + _GROUP]


def _ids_row(model: EncoderModel, tok: TextTokenizer, ids: list[int], index: int, param: str) -> Encoded:
    """Token ids as given (the model's vocabulary), checked against its range, cut to its max length."""
    spec = next(s for s in model.session.inputs if s.role == Role.INPUT_IDS)
    low, high = spec.range if spec.range is not None else (0, tok.vocab_size)
    bad = next((v for v in ids if not low <= v < high), None)
    if bad is not None:
        raise bad_input(f"{param}[{index}]: token id {bad} is outside the model's vocabulary [{low}, {high})", param)
    arr = np.asarray(ids, dtype=np.int64)
    limit = tok.max_length
    cut = limit is not None and arr.shape[0] > limit
    if limit is not None and cut:
        arr = arr[:limit] if tok.truncation_side == "right" else arr[-limit:]
    return Encoded(arr, np.zeros_like(arr), cut)


def context_arrays(value: Mapping[str, Any] | None, specs: Sequence[TensorSpec], model: str) -> dict[str, np.ndarray]:
    """A request's ``context`` (a placed variant's per-example inputs, ``{name: rows}``, an attnx extension) as
    arrays: names the model takes, regular lists of its dtype, finite. Shapes are checked where rows are cut."""
    out = {}
    by_name = {s.name: s for s in specs}
    for name, rows in (value or {}).items():
        spec = by_name.get(name)
        if spec is None:
            raise bad_input(f"'context' names {name!r}; model {model!r} takes {sorted(by_name) or 'none'}", "context")
        try:
            arr = np.asarray(rows, dtype=spec.dtype)
        except (TypeError, ValueError, OverflowError):
            raise bad_input(f"context {name!r}: not a regular list of {np.dtype(spec.dtype).name} values",
                            "context") from None
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise bad_input(f"context {name!r}: holds NaN or infinite values", "context")
        out[name] = arr
    return out


def full_size(model: EncoderModel) -> int | None:
    """The embedding's size when the file states it (None: known after the first run)."""
    last = model.session.output(EMBEDDING).shape[-1]
    return last if isinstance(last, int) else None


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

    def size(self, model: str, full: int | None, requested: int | None) -> int | None:
        """The size to answer with: ``requested`` when allowed, ``full`` when not asked (``full`` None: the file
        does not state it, and the range is checked once the first answer shows it)."""
        if requested is None or requested == full:
            return full
        if full is not None and not 1 <= requested <= full:
            raise bad_input(f"'dimensions' must be an integer from 1 to {full} (model {model!r} gives {full}), got "
                            f"{requested!r}", "dimensions")
        key = model if model in self.allowed else None
        if key not in self.allowed:
            raise bad_input(f"model {model!r} does not allow 'dimensions' below its {full}: the server operator "
                            f"enables it with --dimensions (for models trained to be cut)", "dimensions")
        sizes = self.allowed[key]
        if sizes is not None and requested not in sizes:
            raise bad_input(f"model {model!r} allows 'dimensions' {sorted(sizes)} (or {full}), not {requested}",
                            "dimensions")
        return requested

    def cut(self, model: EncoderModel, vectors: np.ndarray, requested: int | None) -> np.ndarray:
        """The first ``requested`` values of each row, where allowed."""
        return vectors[:, :self.size(model.name, vectors.shape[1], requested)]


def unit_rows(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32, copy=False)
