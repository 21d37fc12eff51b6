"""Step-level batching of concurrent generations (what vLLM calls continuous batching), on one thread.

The requests decoding at a time share one batch (:class:`~attnx.runtime.core.decoding.DecodeState`): each run of the
model advances every one of them by a token. Between two runs the loop

1. drops the rows whose request finished or was cancelled (a client that disconnected: its slot is free for the next
   run);
2. prefills the requests that arrived meanwhile, each on its own (a prompt is one run of its length), and merges
   them into the batch (their caches left-padded with masked slots: exact);
3. runs one decode step for the whole batch and hands each request its token and text
   (:class:`~attnx.runtime.core.generate.Generation` chooses, a :class:`Handle` delivers). The grammar masks of the
   guided rows are computed on their model's mask threads while the run computes (:mod:`attnx.runtime.core.guided`):
   a row whose mask breaks its grammar or runs past its time budget fails alone (a :class:`RequestFault`).

At most ``max_batch`` rows decode together; more requests wait (``max_queue`` of them, then :class:`SchedulerFull`).
The model's own threads do the arithmetic; this thread only drives it, so the event loop of the server never waits
on compute. A failed run fails the requests in it (with the runtime's message) and the loop goes on.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from attnx.runtime.core.decoding import DecodeState, Decoder
from attnx.runtime.core.errors import Kind, Refusal
from attnx.runtime.core.generate import Generation, Piece
from attnx.runtime.core.guided import GrammarError
from attnx.runtime.core.sampling import SamplingParams
from attnx.runtime.core.session import InputError, public_message

log = logging.getLogger("attnx.serve")


class SchedulerFull(Refusal, RuntimeError):
    """More requests waiting than the queue holds (the server answers 429 / 503)."""

    kind = Kind.OVERLOADED


class SchedulerClosed(Refusal, RuntimeError):
    """The scheduler is shutting down."""

    kind = Kind.SHUTTING_DOWN


class RequestFault(str):
    """A failure message that is about the request itself (its grammar broke or ran past its budget): the server
    answers it as a 400, not a 500. A ``str``, so an ``error`` callback may treat it as any message."""


@dataclass
class Stats:
    steps: int = 0  # decode runs
    rows: int = 0  # rows over all decode runs (rows / steps: the mean batch)
    prefills: int = 0
    tokens: int = 0
    max_rows: int = 0


class Handle:
    """One request in the scheduler: ``deliver(piece)`` hears every token (from the scheduler's thread);
    ``error(message)`` hears a failure; :meth:`cancel` takes it out at the next step."""

    def __init__(self, generation: Generation, context: Mapping[str, np.ndarray] | None,
                 deliver: Callable[[Piece], object], error: Callable[[str], object]):
        self.generation = generation
        self.context = dict(context or {})
        self.deliver, self.error = deliver, error
        self.cancelled = False
        self.reason: str | None = None  # said to the receiver when cancelled by the server (None: the client left)
        self.finished = False
        self.submitted = time.monotonic()

    def cancel(self, reason: str | None = None) -> None:
        self.reason = self.reason or reason
        self.cancelled = True


class GenerationScheduler:
    """Continuous batching over one :class:`~attnx.runtime.core.decoding.Decoder` (module docstring)."""

    def __init__(self, decoder: Decoder, tokenizer, *, max_batch: int = 32, max_queue: int = 256,
                 name: str = "model"):
        if max_batch < 1 or max_queue < 1:
            raise ValueError("max_batch and max_queue must be >= 1")
        self.decoder, self.tokenizer, self.name = decoder, tokenizer, name
        self.max_batch, self.max_queue = max_batch, max_queue
        self.stats = Stats()
        self._waiting: collections.deque[Handle] = collections.deque()
        self._active: list[Handle] = []
        self._state: DecodeState | None = None
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"attnx-generate-{name}", daemon=True)
        self._thread.start()

    # ---- the public side --------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._active)

    def submit(self, prompt: Sequence[int], params: SamplingParams, deliver: Callable[[Piece], object],
               error: Callable[[str], object], context: Mapping[str, np.ndarray] | None = None, guide=None) -> Handle:
        """Queue one request; its pieces go to ``deliver`` as they are made (``guide``: a grammar the text follows,
        :class:`~attnx.runtime.core.guided.Guide`). Raises :class:`InputError` for a prompt the model cannot take,
        :class:`SchedulerFull` / :class:`SchedulerClosed`."""
        decoder = self.decoder
        if decoder.max_positions and len(prompt) >= decoder.max_positions:
            raise InputError(f"the prompt has {len(prompt)} tokens; the model has {decoder.max_positions} positions, "
                             "so it must be shorter to leave room for a generated token")
        context = decoder.context_row(context)  # checked here, in the caller's thread: a 400, not a failed step
        handle = Handle(Generation(prompt, params, self.tokenizer, decoder.layout.eos, decoder.max_positions, guide),
                        context, deliver, error)
        with self._cv:
            if self._closed:
                raise SchedulerClosed(f"model {self.name!r} is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise SchedulerFull(f"model {self.name!r}: {len(self._waiting)} generations waiting (the queue holds "
                                    f"{self.max_queue})")
            self._waiting.append(handle)
            self._cv.notify()
        return handle

    def cancel(self, handle: Handle) -> None:
        handle.cancel()
        with self._cv:
            self._cv.notify()

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; ``drain``: let the running and waiting ones finish first (else cancel them)."""
        with self._cv:
            self._closed = True
            if not drain:
                for h in [*self._waiting, *self._active]:
                    h.cancel(f"model {self.name!r} is shutting down")
            self._cv.notify()
        self._thread.join(timeout)

    # ---- the loop -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._active and not self._closed:
                    self._cv.wait()
                if self._closed and not self._waiting and not self._active:
                    return
                room = self.max_batch - len(self._active)
                admitted = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
            try:
                self._drop_finished()
                joined = [s for s in (self._prefill(h) for h in admitted) if s is not None]
                if joined:
                    self._state = self.decoder.merge(([self._state] if self._state is not None else []) + joined)
                self._drop_finished()
                if self._active:
                    self._step()
            except Exception as e:  # noqa: BLE001 - a failed run fails its requests, never the server
                log.exception("generation step failed")
                self._fail_all(f"the model could not run this step: {public_message(str(e))}")

    def _prefill(self, handle: Handle) -> DecodeState | None:
        if handle.cancelled:
            self._finish(handle, handle.reason)
            return None
        gen = handle.generation
        try:
            logits, state = self.decoder.start(gen.prompt, handle.context)
        except InputError as e:
            self._finish(handle, str(e))
            return None
        self.stats.prefills += 1
        if not self._accept(handle, logits):
            return None
        self._active.append(handle)
        return state

    def _step(self) -> None:
        for handle in self._active:  # grammar masks compute beside the run (llguidance drops the GIL)
            handle.generation.prefetch()
        tokens = [h.generation.tokens[-1] for h in self._active]
        assert self._state is not None, "requests in flight without a decode state"  # merged as they joined
        logits, self._state = self.decoder.step(self._state, tokens)
        self.stats.steps += 1
        self.stats.rows += len(tokens)
        self.stats.max_rows = max(self.stats.max_rows, len(tokens))
        for handle, row in zip(list(self._active), logits):
            if not handle.cancelled:
                self._accept(handle, row)

    def _accept(self, handle: Handle, logits: np.ndarray) -> bool:
        """Choose the request's next token from its row of logits and hand it over; False once it is done (it
        leaves at the next step). A row that cannot be sampled (its logits, or what its parameters make of
        them, are not finite) fails its own request alone: the rest of the batch goes on."""
        try:
            piece = handle.generation.accept(handle.generation.choose(logits))  # a grammar may refuse it too
        except GrammarError as e:  # the request's own grammar: a 400 for it alone
            self._finish(handle, RequestFault(f"the request's grammar failed at token {len(handle.generation.tokens)}"
                                              f": {e}"))
            handle.cancel()
            return False
        except Exception as e:  # noqa: BLE001 - one request's failure is its own
            log.warning("generation of model %s: a request failed choosing its token: %s", self.name, e)
            self._finish(handle, f"the model could not choose this request's next token: {public_message(str(e))}")
            handle.cancel()
            return False
        self.stats.tokens += 1
        try:
            handle.deliver(piece)
        except Exception:  # noqa: BLE001 - a receiver that went away
            handle.cancel()
        if handle.generation.done:
            handle.finished = True
            return False
        return True

    def _drop_finished(self) -> None:
        keep = [i for i, h in enumerate(self._active) if not (h.finished or h.cancelled)]
        if len(keep) == len(self._active):
            return
        for h in self._active:
            if h.cancelled and not h.finished:
                self._finish(h, h.reason)
        self._active = [self._active[i] for i in keep]
        assert self._state is not None, "requests in flight without a decode state"  # merged as they joined
        self._state = self.decoder.select(self._state, keep) if keep else None

    def _finish(self, handle: Handle, message: str | None = None) -> None:
        handle.finished = True
        if message is not None:
            try:
                handle.error(message)
            except Exception:  # noqa: BLE001
                pass

    def _fail_all(self, message: str) -> None:
        for h in self._active:
            if not h.finished:
                self._finish(h, message)
        self._active, self._state = [], None
