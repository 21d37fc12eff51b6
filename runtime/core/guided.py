"""Constrained decoding: the tokens a grammar allows next (JSON, a JSON schema, a tool call), with llguidance.

llguidance (the Rust library behind vLLM's and onnxruntime-genai's structured output; no torch) compiles a grammar
against the model's own tokenizer and gives, per step, a bitmask of the tokens that keep the text inside it.
:class:`Grammars` is one model's compiler: its llguidance tokenizer is built when the model loads (~0.2-2 s for a
50k vocabulary), its compiles and masks run on its own threads (llguidance drops the GIL in both, so neither the
event loop nor the scheduler's thread computes them). A request's grammar is bounded three ways:

- before anything compiles, :func:`check_schema` walks the schema (on the compile thread) and stops at the first of
  :data:`MAX_SCHEMA_BYTES`, :data:`MAX_SCHEMA_PROPERTIES`, :data:`MAX_ENUM_VALUES`, :data:`MAX_SCHEMA_DEPTH`;
- llguidance's own fuel (:data:`LIMITS`) bounds the lexer and parser work of the compile and of every mask; past it
  the grammar is refused (``x{1000000}``, a ``$ref`` that recurses forever);
- :meth:`Grammars.compile` takes the first mask and walks the forced prefix, so a grammar that matches nothing or
  breaks at once is a 400 before the request joins a batch; later masks are computed beside the model's decoding
  run, each under :data:`MASK_TIME_BUDGET_S` (past it that request alone fails, with a 400-class error).

:meth:`Grammars.guides` gives a request's choices their :class:`Guide` (one compile, copied), which
:class:`~attnx.runtime.core.generate.Generation` asks for the mask before each choice and tells each token chosen.
A grammar that ends (a JSON object closed) ends the generation (``finish_reason`` ``"stop"``); the model's
end-of-sequence token is allowed wherever the grammar may end. llguidance's messages are cut to one line, without its
internal state.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence, TypedDict

import numpy as np

if TYPE_CHECKING:  # a TypedDict of llguidance's stub only (imported lazily below: a serving extra)
    from llguidance import LLTokenizer
    from llguidance._lib import JsonCompileOptions

#: What one request's JSON schema may hold (OpenAI's structured outputs allow 5,000 properties, 1,000 enum values
#: and 10 levels of nesting); checked by :func:`check_schema` before anything compiles.
MAX_SCHEMA_BYTES = 256 << 10  # its JSON text, about (keys and strings as written, 2 bytes for any other value)
MAX_SCHEMA_PROPERTIES = 2000  # entries of every "properties" object, summed over the schema
MAX_ENUM_VALUES = 1000  # "enum" values and "const"s, summed over the schema
MAX_SCHEMA_DEPTH = 32  # objects and lists nested in the schema's JSON
#: llguidance's per-grammar fuel (its defaults: 1,000,000 / 200,000 / 250,000): x{1000000}'s first mask takes ~50 ms
#: instead of ~1 s (a 50k vocabulary) and its next step is refused; schemas at the limits above compile within them
#: (2,000 properties, 1,000 enum values of 200 characters, 200 date-times).
class Fuel(TypedDict):  # the LLParserLimits fields set here (keywords: mypy checks them against llguidance's stub)
    initial_lexer_fuel: int
    step_lexer_fuel: int
    max_lexer_states: int


LIMITS: Fuel = {"initial_lexer_fuel": 200_000, "step_lexer_fuel": 100_000, "max_lexer_states": 50_000}
#: Seconds one grammar may compile, and one request's mask may still take once the step's decoding run is done
#: (then that request alone fails).
COMPILE_TIME_BUDGET_S = 10.0
MASK_TIME_BUDGET_S = 0.5


class GrammarError(ValueError):
    """A grammar (a JSON schema) llguidance cannot compile or follow (a 400 when it comes from a request)."""


def _llg_message(error: str) -> str:
    """llguidance's error as one line, without its internal state (``<non-verbose/>``, parser dumps)."""
    first = " ".join(error.replace("<non-verbose/>", " ").split("\n")[0].split())
    if first and " " not in first:  # a bare stop reason (NoExtensionBias, InternalError, ...)
        return "it matches no text"
    return first[:200] or "llguidance refused it"


def check_schema(schema: Any, where: str = "the JSON schema") -> None:
    """Refuse a schema past any of the size limits above (one line naming the limit); stops at the first one, so
    the walk costs at most about :data:`MAX_SCHEMA_BYTES`, whatever the schema's size."""
    size = properties = values = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"{where} nests deeper than {MAX_SCHEMA_DEPTH} levels (the limit)")
        inner: Iterable[Any] = ()
        if isinstance(value, dict):
            size += 2 + (sum(len(k) + 3 for k in value) if len(value) <= MAX_SCHEMA_BYTES else len(value))
            props, enum = value.get("properties"), value.get("enum")
            properties += len(props) if isinstance(props, dict) else 0
            values += (len(enum) if isinstance(enum, list) else 0) + ("const" in value)
            inner = value.values()
        elif isinstance(value, list):
            size, inner = size + 2 + len(value), value
        else:
            size += len(value) + 2 if isinstance(value, str) else 2
        if size > MAX_SCHEMA_BYTES:
            raise GrammarError(f"{where} is larger than {MAX_SCHEMA_BYTES // 1024} KiB (the limit)")
        if properties > MAX_SCHEMA_PROPERTIES:
            raise GrammarError(f"{where} has more than {MAX_SCHEMA_PROPERTIES} properties (the limit)")
        if values > MAX_ENUM_VALUES:
            raise GrammarError(f"{where} has more than {MAX_ENUM_VALUES} enum and const values (the limit)")
        stack.extend((v, depth + 1) for v in inner)  # only once the counts above hold: at most ~the byte limit


class Grammars:
    """One model's grammar compiler (module docstring); ``close()`` stops its threads."""

    def __init__(self, tokenizer_file: Path, vocab: int, eos: Sequence[int]):
        self.tokenizer_file, self.vocab, self.eos = Path(tokenizer_file), int(vocab), [int(e) for e in eos]
        self._tokenizer: LLTokenizer | None = None
        self._tokenizer_error: str | None = None
        self._lock = threading.Lock()
        self.compiles = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="attnx-grammar")
        self.masks = concurrent.futures.ThreadPoolExecutor(max(2, os.cpu_count() or 2),
                                                           thread_name_prefix="attnx-mask")

    def load(self) -> None:
        """Build the model's llguidance tokenizer now (at load); one it cannot build refuses guided requests."""
        try:
            self._llg_tokenizer()
        except GrammarError:
            pass

    def _llg_tokenizer(self):
        with self._lock:
            if self._tokenizer is None and self._tokenizer_error is None:
                try:
                    import llguidance
                    from tokenizers import Tokenizer

                    tok = Tokenizer.from_file(str(self.tokenizer_file))
                    tok.no_padding()
                    tok.no_truncation()
                    self._tokenizer = llguidance.LLTokenizer(tok.to_str(), n_vocab=self.vocab,
                                                             eos_token=self.eos or None)
                except Exception as e:  # noqa: BLE001 - a tokenizer llguidance does not read
                    self._tokenizer_error = " ".join(str(e).split())[:200]
            if self._tokenizer is None:
                raise GrammarError(f"this model's tokenizer cannot drive constrained decoding: {self._tokenizer_error}")
            return self._tokenizer

    def compile(self, grammar: str) -> "Guide":
        """A request's grammar compiled and checked (module docstring); blocking: :meth:`guides` runs it on the
        compile threads. Raises :class:`GrammarError`."""
        import llguidance

        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0,
                                       limits=llguidance.LLParserLimits(verbose_errors=False, **LIMITS))
        if matcher.is_error():
            raise GrammarError(f"it cannot be compiled: {_llg_message(matcher.get_error())}")
        first = _allowed(matcher, self.vocab)
        if matcher.is_error() or not (matcher.is_accepting() or np.delete(first, self.eos).any()):
            raise GrammarError("it matches no text" if not matcher.is_error() else
                               f"it cannot be followed: {_llg_message(matcher.get_error())}")
        probe = matcher.deep_copy()  # the text every answer starts with: a grammar that breaks there breaks always
        forced = probe.compute_ff_tokens()
        if forced and probe.consume_tokens(forced) and not probe.is_stopped():
            probe.compute_bitmask()
        if probe.is_error():
            raise GrammarError(f"it cannot be followed: {_llg_message(probe.get_error())}")
        return Guide(matcher, self.vocab, self.masks, first)

    async def guides(self, grammar: str | Callable[[], str], count: int) -> list["Guide"]:
        """``count`` fresh guides of ``grammar`` (or of what a callable builds: :func:`json_schema`), built and
        compiled once on this model's compile threads (never on the event loop) within
        :data:`COMPILE_TIME_BUDGET_S`."""
        import asyncio

        build = grammar if callable(grammar) else (lambda: grammar)
        future = asyncio.wrap_future(self.compiles.submit(lambda: self.compile(build())))
        try:
            guide = await asyncio.wait_for(future, COMPILE_TIME_BUDGET_S)
        except asyncio.TimeoutError:
            raise GrammarError(f"it did not compile within {COMPILE_TIME_BUDGET_S:g} s (the limit)") from None
        return [guide] + [guide.copy() for _ in range(count - 1)]

    def close(self) -> None:
        self.compiles.shutdown(wait=False, cancel_futures=True)
        self.masks.shutdown(wait=False, cancel_futures=True)


#: JSON written compactly (no whitespace between items, ``{"city":"Paris"}``): a small model cannot loop on
#: whitespace, and a real one still writes any JSON value (SmolLM2-135M-Instruct: a schema-valid object in 27 tokens).
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


def json_schema(schema: dict | None) -> str:
    """The grammar of JSON text following ``schema`` (None: any JSON object, OpenAI's ``json_object``); a schema
    past the size limits is refused first (:func:`check_schema`)."""
    import llguidance

    if schema is not None:
        check_schema(schema)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema or {"type": "object"}),
                                                              defaults=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(f"the JSON schema cannot be compiled: {_llg_message(str(e))}") from None


def lark(source: str) -> str:
    """A grammar in llguidance's Lark dialect (``%json {...}`` embeds a JSON schema)."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(source)


def _allowed(matcher, vocab: int) -> np.ndarray:
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    return np.unpackbits(bits, bitorder="little")[:vocab].astype(bool)


class Guide:
    """One request's grammar state: used by the scheduler's thread, its masks computed on the model's mask threads
    (:meth:`prefetch` starts the next one while the model runs, :meth:`allowed` waits for it)."""

    def __init__(self, matcher, vocab: int, masks: concurrent.futures.Executor | None = None,
                 first: np.ndarray | None = None):
        self.matcher, self.vocab, self.masks = matcher, vocab, masks
        self._next: concurrent.futures.Future | None = None
        self._first = first  # the first mask, computed by the compile

    def copy(self) -> "Guide":
        return Guide(self.matcher.deep_copy(), self.vocab, self.masks, self._first)

    def prefetch(self) -> None:
        """Start computing the next mask (the tokens so far are all accepted)."""
        if self._first is None and self._next is None and self.masks is not None:
            try:
                self._next = self.masks.submit(self._compute)
            except RuntimeError:  # the model is closing: computed in place by allowed()
                self.masks = None

    def _compute(self) -> np.ndarray:
        allowed = _allowed(self.matcher, self.vocab)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar cannot be followed: {_llg_message(self.matcher.get_error())}")
        return allowed

    def allowed(self, budget_s: float | None = None) -> np.ndarray:
        """``bool [vocab]``: the tokens the grammar allows next. Raises :class:`GrammarError` when the grammar
        breaks or its mask takes longer than ``budget_s`` (its computation is abandoned: llguidance's fuel ends
        it)."""
        if self._first is not None:
            allowed, self._first = self._first, None
            return allowed
        budget_s = MASK_TIME_BUDGET_S if budget_s is None else budget_s
        self.prefetch()
        future, self._next = self._next, None
        if future is None:
            return self._compute()
        try:
            return future.result(timeout=budget_s)
        except concurrent.futures.TimeoutError:
            self.masks = None  # the matcher is still in use there: this guide is done
            raise GrammarError(f"the grammar's next-token mask took longer than {budget_s:g} s (the limit per "
                               "token)") from None

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise GrammarError(f"token {token} breaks the grammar: {_llg_message(self.matcher.get_error())}")

    @property
    def complete(self) -> bool:
        """The grammar allows nothing more: the text is whole."""
        return self.matcher.is_stopped()
