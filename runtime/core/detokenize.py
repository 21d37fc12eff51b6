"""Generated tokens -> text as it streams: whole characters only, and stop strings cut exactly.

A byte-level tokenizer (GPT-2, Llama 3, Qwen) splits a character over several tokens: decoding the tokens so far
would end in U+FFFD until the last byte arrives. :class:`TextStream` decodes a short window of recent tokens and
releases text only when it no longer ends in an incomplete character (the method of Hugging Face's streamers and
vLLM's incremental detokenizer), so the pieces joined equal the tokens decoded at once.

Stop strings (OpenAI's ``stop``): generation ends at the first occurrence, which is not part of the text. Text that
could still be the start of a stop string is held back until it cannot be, so a streamed stop string never reaches
the client.
"""

from __future__ import annotations

from typing import Sequence

_INCOMPLETE = "\ufffd"


class TextStream:
    """Feed tokens one at a time (:meth:`add`); get the new text each time (possibly ``""``)."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True):
        self._decode = tokenizer.decode
        self.skip = skip_special_tokens
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self._prefix = 0  # tokens before this one are already text
        self._read = 0  # tokens before this one are decoded into `released` or `pending`
        self.text = ""  # everything released so far
        self._pending = ""  # decoded, held back because a stop string might start in it
        self.stopped = False  # a stop string was found (the text ends just before it)

    def _text(self, ids: list[int]) -> str:
        return self._decode(ids, skip_special_tokens=self.skip) if ids else ""

    def add(self, token: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(int(token))
        before = self._text(self.ids[self._prefix:self._read])
        after = self._text(self.ids[self._prefix:])
        if len(after) <= len(before) or after.endswith(_INCOMPLETE):
            return ""  # an incomplete character: wait for its next byte
        self._pending += after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """What is still held back, once no token will follow (an incomplete last character included, as
        decoding every token at once gives it)."""
        if self.stopped:
            return ""
        if self._read < len(self.ids):
            before = self._text(self.ids[self._prefix:self._read])
            after = self._text(self.ids[self._prefix:])
            self._pending += after[len(before):]
            self._prefix = self._read = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        # Released text never ends with the start of a stop string (that end is held back), so a stop
        # string, when it comes, begins in what is pending.
        pending = self._pending
        if self.stop:
            found = [i for i in (pending.find(s) for s in self.stop) if i >= 0]
            if found:
                out = pending[:min(found)]
                self.text += out
                self._pending, self.stopped = "", True
                return out
            if not final:
                hold = _longest_stop_prefix(pending, self.stop)
                out, self._pending = pending[:len(pending) - hold], pending[len(pending) - hold:]
                self.text += out
                return out
        self.text += pending
        self._pending = ""
        return pending


def _longest_stop_prefix(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that begins some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if s.startswith(text[len(text) - n:]):
                best = n
                break
    return best
