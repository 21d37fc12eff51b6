"""Constrained decoding: the tokens a grammar allows next (JSON, a JSON schema, a tool call), with llguidance.

llguidance (the Rust library behind vLLM's and onnxruntime-genai's structured output; no torch) compiles a grammar
against the model's own tokenizer and gives, per step, a bitmask of the tokens that keep the text inside it.
:class:`Grammars` is one model's compiler (its llguidance tokenizer is built once, on first use: ~1-2 s for a 50k
vocabulary); :meth:`Grammars.guide` a request's :class:`Guide`, which :class:`~attnx.runtime.core.generate.Generation`
asks for the mask before each choice and tells each token chosen. A grammar that ends (a JSON object closed) ends
the generation (``finish_reason`` ``"stop"``); the model's end-of-sequence token is allowed wherever the grammar may
end.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Sequence

import numpy as np


class GrammarError(ValueError):
    """A grammar (a JSON schema) llguidance cannot compile (a 400 when it comes from a request)."""


class Grammars:
    def __init__(self, tokenizer_file: Path, vocab: int, eos: Sequence[int]):
        self.tokenizer_file, self.vocab, self.eos = Path(tokenizer_file), int(vocab), [int(e) for e in eos]
        self._tokenizer = None
        self._lock = threading.Lock()

    def _llg_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance
                from tokenizers import Tokenizer

                tok = Tokenizer.from_file(str(self.tokenizer_file))
                tok.no_padding()
                tok.no_truncation()
                self._tokenizer = llguidance.LLTokenizer(tok.to_str(), n_vocab=self.vocab,
                                                         eos_token=self.eos or None)
            return self._tokenizer

    def guide(self, grammar: str) -> "Guide":
        """A fresh matcher of ``grammar`` (llguidance's form: :func:`json_schema`, :func:`lark`); blocking (it
        compiles): call it off the event loop."""
        import llguidance

        tokenizer = self._llg_tokenizer()
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(" ".join(matcher.get_error().split())[:300])
        return Guide(matcher, self.vocab)


#: JSON written compactly (no whitespace between items, ``{"city":"Paris"}``): a small model cannot loop on
#: whitespace, and a real one still writes any JSON value (SmolLM2-135M-Instruct: a schema-valid object in 27 tokens).
JSON_OPTIONS = {"whitespace_flexible": False}


def json_schema(schema: dict | None) -> str:
    """The grammar of JSON text following ``schema`` (None: any JSON object, OpenAI's ``json_object``)."""
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema or {"type": "object"}),
                                                              defaults=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(f"the JSON schema cannot be compiled: {e}") from None


def lark(source: str) -> str:
    """A grammar in llguidance's Lark dialect (``%json {...}`` embeds a JSON schema)."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(source)


class Guide:
    """One request's grammar state (used by the scheduler's thread only)."""

    def __init__(self, matcher, vocab: int):
        self.matcher, self.vocab = matcher, vocab

    def allowed(self) -> np.ndarray:
        """``bool [vocab]``: the tokens the grammar allows next."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[:self.vocab].astype(bool)

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise GrammarError(f"token {token} breaks the grammar: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """The grammar allows nothing more: the text is whole."""
        return self.matcher.is_stopped()
