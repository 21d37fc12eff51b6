"""Generating text from a with-past export, one request: prompt in, text out as it is made.

    from attnx.runtime import TextModel

    model = TextModel("attnx-out/llama-smal-with-past")          # the export's folder, file, or engine
    for piece in model.generate("Once upon a time", max_new_tokens=32):
        print(piece, end="", flush=True)                          # greedy; temperature=0.8 samples

:class:`Generation` is one request's state (its tokens, its text so far, why it ended), shared with the server's
step-level batching (:mod:`attnx.runtime.core.scheduler`); :func:`stream` runs one request on its own (``attnx
generate``, :meth:`TextModel.generate <attnx.runtime.core.encode.TextModel.generate>`). A request ends at an
end-of-sequence token (not part of the text), a stop string (not part of the text either), after ``max_new_tokens``,
or when the model's positions are used up (``finish_reason`` ``"stop"`` or ``"length"``, as OpenAI's API says).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import numpy as np

from attnx.runtime.core.decoding import Decoder
from attnx.runtime.core.detokenize import TextStream
from attnx.runtime.core.sampling import SamplingParams, logprobs, next_token


@dataclass(frozen=True)
class Piece:
    """One step of a stream: the token chosen, the text it completes (may be ``""``), on the last piece why
    generation ended, and where asked (``SamplingParams.logprobs``) the token's log-probability with the most
    likely alternatives ``((id, logprob), ...)`` (:func:`~attnx.runtime.core.sampling.logprobs`)."""

    token: int | None
    text: str
    finish_reason: str | None = None
    logprob: tuple[float, tuple[tuple[int, float], ...]] | None = None


class Generation:
    """One request: its prompt, its parameters and random stream, the tokens and text so far."""

    def __init__(self, prompt: Sequence[int], params: SamplingParams, tokenizer, eos: Sequence[int] = (),
                 max_positions: int | None = None, guide=None):
        self.prompt = [int(t) for t in prompt]
        self.params = params
        self.rng = params.rng()
        self.eos = () if params.ignore_eos else tuple(int(e) for e in eos)
        self.limit = params.max_new_tokens
        if max_positions:
            self.limit = max(0, min(self.limit, max_positions - len(self.prompt)))
        self.tokens: list[int] = []
        self.text = TextStream(tokenizer, params.stop)
        self.finish_reason: str | None = None if self.limit > 0 else "length"
        self._seen = list(self.prompt)
        self.guide = guide  # a grammar the text must follow (attnx.runtime.core.guided.Guide), or None
        self._logprob: tuple[float, tuple[tuple[int, float], ...]] | None = None  # the chosen token's (choose)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def prefetch(self) -> None:
        """Start computing the grammar's next mask (on its model's mask threads) while the model runs."""
        if self.guide is not None and not self.done:
            self.guide.prefetch()

    def choose(self, logits: np.ndarray) -> int:
        p = self.params
        token = next_token(logits, p, self.rng, self._seen if p.repetition_penalty != 1.0 else (), self.tokens,
                           self.guide.allowed() if self.guide is not None else None)
        self._logprob = logprobs(logits, token, p.logprobs) if p.logprobs is not None else None
        return token

    def accept(self, token: int) -> Piece:
        """Take the chosen token: the text it adds, and whether the request ends here."""
        token, logprob = int(token), self._logprob
        if token in self.eos:
            self.finish_reason = "stop"
            return Piece(token, self.text.finish(), "stop", logprob)
        self.tokens.append(token)
        self._seen.append(token)
        text = self.text.add(token)
        if self.guide is not None:
            self.guide.accept(token)
        if self.text.stopped or (self.guide is not None and self.guide.complete):
            self.finish_reason = "stop"
            text += self.text.finish()
        elif len(self.tokens) >= self.limit:
            self.finish_reason = "length"
            text += self.text.finish()
        return Piece(token, text, self.finish_reason, logprob)


def stream(decoder: Decoder, tokenizer, prompt: Sequence[int], params: SamplingParams,
           context: Mapping[str, np.ndarray] | None = None) -> Iterator[Piece]:
    """Generate for one prompt (token ids), a :class:`Piece` per token; the last one has ``finish_reason``."""
    gen = Generation(prompt, params, tokenizer, decoder.layout.eos, decoder.max_positions)
    if gen.done:  # the prompt fills every position
        yield Piece(None, "", gen.finish_reason)
        return
    logits, state = decoder.start(gen.prompt, context)
    while True:
        token = gen.choose(logits)
        piece = gen.accept(token)
        yield piece
        if gen.done:
            return
        logits, state = decoder.step(state, [token])
        logits = logits[0]
