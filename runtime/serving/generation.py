"""Served text generation: the decoders in the registry, their prompts, parameters and streams.

A with-past export served by ``attnx serve`` is a :class:`GenerationModel` (a session, its
:class:`~attnx.runtime.core.decoding.Decoder`, tokenizer, chat template and step-level
:class:`~attnx.runtime.core.scheduler.GenerationScheduler`), in the server's one registry beside the encoders:
KServe's metadata, ready, config and index, gRPC's ModelReady, health, ``/v1/models`` and the queue gauges see
it. Triton's generate (:mod:`attnx.runtime.apis.generate`) and OpenAI's completions
(:mod:`attnx.runtime.apis.completions`) turn a request into :class:`~attnx.runtime.core.sampling.SamplingParams`
here, tokenise its prompt off the loop (cut at the character cap first: a prompt longer than the positions can
hold is refused without reading it all), render chat in the template worker, and read tokens with
:func:`pieces`, which cancels the generation when the client goes away.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Callable, Mapping

import numpy as np

from attnx.runtime.core.chat import ChatError, ChatTemplate, Renderer
from attnx.runtime.core.decoding import Decoder, source_info
from attnx.runtime.core.generate import Piece
from attnx.runtime.core.guided import GrammarError, Grammars, json_schema
from attnx.runtime.core.sampling import SamplingError, SamplingParams
from attnx.runtime.core.scheduler import GenerationScheduler, RequestFault, SchedulerClosed, SchedulerFull
from attnx.runtime.core.session import InputError, Session
from attnx.runtime.core.text import CHARS_PER_TOKEN, TextTokenizer
from attnx.runtime.serving.encoding import context_arrays
from attnx.runtime.serving.model import EMBED, GENERATE, INFER, TOKENIZE, WORDS
from attnx.runtime.wire.errors import Kind, ProtocolError, bad_input, overloaded, too_large
from attnx.runtime.wire.limits import Workers

#: Most completions one request may ask for (prompts x n).
MAX_CHOICES = 16


def is_generator(session: Session) -> bool:
    """A with-past export or its engine (``attnx.cache`` in the metadata): served by the generation routes."""
    info, _ = source_info(session)
    return bool(info is not None and info.cache)


@dataclass
class GenerationModel:
    """A text generator behind the server (a :class:`~attnx.runtime.serving.model.ServedModel`): a with-past
    session, its decoder and step-level scheduler, its tokenizer, chat template and grammars."""

    name: str
    session: Session
    decoder: Decoder
    tokenizer: TextTokenizer
    scheduler: GenerationScheduler
    chat: ChatTemplate | None = None
    grammars: Grammars | None = None
    version: str = "1"
    capabilities: frozenset = frozenset({GENERATE, TOKENIZE})
    max_new_tokens: int | None = None  # ``attnx serve --max-new-tokens``: the default and the bound of every request
    prompt_chunk: int | None = None  # new tokens per run when a prompt is scored (None: PROMPT_CHUNK)
    scoring: Any = None  # the thread prompts are scored on, off the loop and the scheduler (made on first use)

    @classmethod
    def load(cls, name: str, session: Session, tokenizer: TextTokenizer | None, *, max_batch: int,
             max_queue: int, max_positions: int | None = None) -> "GenerationModel":
        if tokenizer is None:  # an engine: the ONNX its sidecar names carries the tokenizer
            info, source = source_info(session)
            tokenizer = TextTokenizer.from_export(source, info) if info is not None else None
        if tokenizer is None:
            raise ValueError(f"model {name!r} generates text but carries no tokenizer (serve it with --tokenizer DIR)")
        decoder = Decoder(session, max_positions=max_positions, bound_by="--max-positions")
        if decoder.max_positions:  # a prompt is read up to what the positions can hold, never past it
            tokenizer.char_cap = decoder.max_positions * CHARS_PER_TOKEN
        profiles = session.profiles or {}
        if isinstance(profiles.get("batch"), list) and str(session.path).endswith((".engine", ".plan")):
            max_batch = min(max_batch, int(profiles["batch"][2]))  # an engine runs no more rows than its profile
        grammars = Grammars(tokenizer.file, decoder.vocab_size or tokenizer.vocab_size, decoder.layout.eos)
        grammars.load()  # its llguidance tokenizer now, not on the first guided request
        return cls(name, session, decoder, tokenizer,
                   GenerationScheduler(decoder, tokenizer, max_batch=max_batch, max_queue=max_queue, name=name),
                   ChatTemplate.from_folder(tokenizer.file.parent), grammars)

    # --- what the registry asks of every model ---------------------------------------------------------
    @property
    def ready(self) -> bool:
        return not self.scheduler.closed

    @property
    def queue_depth(self) -> int:
        return self.scheduler.queue_depth

    @property
    def max_queue(self) -> int:
        return self.scheduler.max_queue

    def unfit(self, capability: str) -> str:
        if capability == INFER:  # KServe's infer, HTTP or gRPC: its generate extension is the way in
            return f"model {self.name!r} generates text: use /v2/models/{self.name}/generate"
        what = "an embedding" if capability == EMBED else f"a {WORDS[capability][0]}"
        return f"model {self.name!r} generates text (a with-past export); it is not {what}"

    def metadata(self) -> dict[str, Any]:
        """KServe v2 metadata as Triton's generate-extension models describe themselves: a text in, text out."""
        return {"name": self.name, "versions": [self.version], "platform": self.session.platform,
                "parameters": {"generate": f"/v2/models/{self.name}/generate",
                               "max_positions": self.decoder.max_positions, "chat_template": self.chat is not None},
                "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1]}],
                "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}]}

    def config(self) -> dict[str, Any]:
        """A Triton model configuration (JSON form): decoupled, as Triton's streaming generate models are."""
        return {"name": self.name, "platform": self.session.platform, "max_batch_size": self.scheduler.max_batch,
                "input": [{"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]}],
                "output": [{"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]}],
                "model_transaction_policy": {"decoupled": True}}

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        self.scheduler.close(drain=drain, timeout=timeout)
        if self.scoring is not None:
            self.scoring.shutdown(wait=False, cancel_futures=True)
        if self.grammars is not None:
            self.grammars.close()

    def describe(self) -> list[str]:
        cache = self.decoder.layout
        names = ", ".join(sorted({t.input.split(".", 2)[-1] for t in cache.tensors}))
        return [f"model {self.name}: {self.session.path} ({self.session.provider}) generates text",
                f"  KV cache: {len(cache.tensors)} tensors ({names}), {self.decoder.positions_text}, "
                f"end of sequence {list(cache.eos) or '-'}",
                f"  {self.decoder.kv_footprint().describe(self.scheduler.max_batch)}",
                f"  -> batched per decoding step: at most {self.scheduler.max_batch} sequences, "
                f"{self.scheduler.max_queue} waiting; chat template: {'yes' if self.chat else 'no'}"]

    def configure(self, *, max_new_tokens: int | None = None, chat_template: ChatTemplate | None = None) -> None:
        """The serve options that are the deployment's, not the export's (``--max-new-tokens``, ``--chat-template``)."""
        if max_new_tokens is not None:
            self.max_new_tokens = max_new_tokens
        if chat_template is not None:
            self.chat = chat_template

    # --- requests --------------------------------------------------------------------------------------
    def new_tokens(self, asked: int | None) -> int:
        """Tokens a request may generate: what it asked for, else the server's ``--max-new-tokens``, else until the
        positions run out; a request asking for more than ``--max-new-tokens`` is clamped to it (vLLM's
        ``max_new_tokens`` override clamps the same way; ``finish_reason`` "length" says so)."""
        cap = self.max_new_tokens
        wanted = asked or cap or self.decoder.max_positions or 1 << 30
        return min(wanted, cap) if cap else wanted

    def check_logit_bias(self, bias) -> None:
        """``logit_bias``'s token ids are this model's (a 400 naming the first that is not)."""
        vocab = self.decoder.vocab_size or self.tokenizer.vocab_size
        bad = next((t for t, _ in bias or () if vocab is not None and t >= vocab), None)
        if bad is not None:
            raise bad_input(f"'logit_bias': token id {bad} is outside model {self.name!r}'s vocabulary [0, {vocab})",
                            "logit_bias")

    async def prompt_ids(self, prompt: str | list[int], workers: Workers, param: str = "prompt",
                         special: bool = True, positions: bool = True) -> list[int]:
        """A text (tokenised off the loop; ``special``: its BOS and the like added) or token ids, checked
        against the vocabulary and (``positions``) the positions: the prompt of one generation."""
        if isinstance(prompt, str):
            if not prompt:
                raise bad_input(f"'{param}' is empty", param)
            tokenize = functools.partial(self.tokenizer.tokenize, [prompt], truncate=False, allow_empty=True,
                                         add_special_tokens=special)
            try:
                ids = [int(i) for i in (await workers.run(tokenize, cost=len(prompt)))[0].ids]
            except InputError as e:
                raise e.refused(f"'{param}': ", param) from None
        else:
            vocab = self.decoder.vocab_size
            bad = next((t for t in prompt if t < 0 or (vocab is not None and t >= vocab)), None)
            if bad is not None:
                raise bad_input(f"'{param}': token id {bad} is outside the model's vocabulary [0, {vocab})", param)
            ids = list(prompt)
        limit = self.decoder.max_positions
        if positions and limit and len(ids) >= limit:
            raise bad_input(f"'{param}' has {len(ids)} tokens; the model has {self.decoder.positions_text}, so a "
                            f"prompt must be shorter than {limit} tokens", param)
        return ids

    async def render(self, renderer: Renderer, messages: list[dict], tools, workers: Workers,
                     generation_prompt: bool = True) -> str:
        """The conversation as the chat template writes it, ending where the assistant's turn begins (in this model's
        own render pool: another model's slow template never delays it)."""
        if self.chat is None:
            raise bad_input(f"model {self.name!r} has no chat template (its tokenizer folder has none): use "
                            "/v1/completions", "messages")
        cap = self.tokenizer.char_cap or (1 << 22)
        try:
            return await asyncio.wrap_future(renderer.submit(self.name, self.chat, messages, tools=tools,
                                                             max_chars=cap, add_generation_prompt=generation_prompt))
        except ChatError as e:
            raise ProtocolError(Kind.TOO_LARGE if e.too_large else Kind.BAD_INPUT, str(e), "messages") from None

    async def guides(self, grammar: str | Callable[[], str] | None, count: int, workers: Workers,
                     param: str) -> list:
        """``count`` fresh guides of ``grammar`` (compiled once, on the model's grammar threads, under its time and
        fuel budgets: :mod:`attnx.runtime.core.guided`), or ``[None] * count`` without one."""
        if grammar is None:
            return [None] * count
        if self.grammars is None:  # a model made without one (from_files always makes it)
            raise bad_input(f"'{param}': model {self.name!r} cannot constrain its output", param)
        try:
            return await self.grammars.guides(grammar, count)
        except GrammarError as e:
            raise bad_input(f"'{param}': {e}", param) from None

    def context(self, value: Mapping[str, Any] | None) -> dict[str, np.ndarray] | None:
        """A request's ``context`` (``{name: one row}``) as the decoder's context inputs (checked again there)."""
        return context_arrays(value, self.decoder.context_inputs, self.name) if value is not None else None


def sampling(body, max_tokens: int | None, names: Mapping[str, str] | None = None,
             logprobs: int | None = None) -> SamplingParams:
    """A request's sampling fields -> :class:`SamplingParams` (``temperature`` 0: greedy; ``max_tokens`` None:
    until the positions run out), with the request's own field names in the errors."""
    names = dict(names or {})
    temperature = 1.0 if body.temperature is None else body.temperature
    try:
        return SamplingParams(max_new_tokens=max_tokens if max_tokens is not None else 1 << 30,
                              temperature=temperature, top_p=1.0 if body.top_p is None else body.top_p,
                              top_k=body.top_k or 0,
                              repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                              do_sample=temperature > 0, stop=(body.stop,) if isinstance(body.stop, str) else
                              tuple(body.stop or ()), seed=body.seed, ignore_eos=body.ignore_eos,
                              presence_penalty=getattr(body, "presence_penalty", None) or 0.0,
                              frequency_penalty=getattr(body, "frequency_penalty", None) or 0.0, logprobs=logprobs,
                              logit_bias=getattr(body, "logit_bias", None) or ())
    except SamplingError as e:
        key = names.get(e.param or "", e.param)
        raise bad_input(str(e).replace(f"{e.param} ", f"'{key}' ", 1) if e.param else str(e), key) from None


def check_choices(model: GenerationModel, count: int) -> None:
    """``count`` generations for one request: never more than the queue holds (413: a retry cannot help), nor
    more than :data:`MAX_CHOICES`; more than it holds now is overloaded (429/503)."""
    if count > model.max_queue:
        raise too_large(f"{count} generations (n x prompts), but model {model.name!r} queues at most "
                        f"{model.max_queue}: ask for at most {model.max_queue} per request", "n")
    if count > MAX_CHOICES:
        raise bad_input(f"'n' times the prompts must be 1..{MAX_CHOICES}, got {count}", "n")
    if model.queue_depth + count > model.max_queue:
        raise overloaded(f"model {model.name!r}: {model.queue_depth} generations waiting (the queue holds "
                         f"{model.max_queue}); retry later")


def check_max_tokens(model: GenerationModel, prompt_tokens: int, body, key: str) -> None:
    """A ``max_tokens`` the request set that the prompt leaves no room for is a one-line 400 naming it, as vLLM and
    OpenAI answer (a default is cut at the positions instead)."""
    positions, asked = model.decoder.max_positions, getattr(body, key)
    if positions and asked and key in body.model_fields_set and prompt_tokens + asked > positions:
        raise bad_input(f"model {model.name!r} has {model.decoder.positions_text}, but {prompt_tokens} prompt tokens + "
                        f"'{key}' {asked} need more: ask for at most {max(positions - prompt_tokens, 0)}", key)


def response_grammar(body) -> Callable[[], str] | None:
    """What builds the grammar of a request's ``response_format`` (None: free text); it runs where the grammar
    compiles, off the loop (checking a schema's size walks it)."""
    fmt = getattr(body, "response_format", None)
    if fmt is None or fmt.type == "text":
        return None
    return functools.partial(json_schema, fmt.json_schema.schema_ if fmt.type == "json_schema" else None)


async def pieces(model: GenerationModel, prompt: list[int], params: SamplingParams,
                 context: Mapping[str, np.ndarray] | None = None, guide=None) -> AsyncGenerator[Piece, None]:
    """One generation's pieces as the scheduler makes them; leaving early (a client gone, an error)
    cancels it, which frees its batch row at the next step."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Piece | ProtocolError] = asyncio.Queue()  # from the scheduler's thread to this loop

    def deliver(item: Piece | ProtocolError) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, item)

    try:
        handle = model.scheduler.submit(prompt, params, deliver, lambda message: deliver(ProtocolError(
            Kind.BAD_INPUT if isinstance(message, RequestFault) else Kind.INTERNAL, message)), context, guide)
    except InputError as e:
        raise e.refused(param="context" if context else "prompt") from None
    except (SchedulerFull, SchedulerClosed) as e:
        raise e.refused() from None
    try:
        while True:
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            yield item
            if item.finish_reason is not None:
                return
    finally:
        if not handle.finished:
            model.scheduler.cancel(handle)


@dataclass
class Completion:
    text: str
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    logprobs: list[tuple[int, Any]]  # (token, Piece.logprob) of each token, where asked


async def complete(model: GenerationModel, prompt: list[int], params: SamplingParams, context=None,
                   request=None, guide=None) -> Completion:
    """The whole generation; a client that disconnects meanwhile (``request``) cancels it."""

    async def run() -> Completion:
        texts, tokens, logprobs, reason = [], [], [], "length"
        async for piece in pieces(model, prompt, params, context, guide):
            texts.append(piece.text)
            if piece.token is not None:  # an end-of-sequence token counts, as OpenAI and vLLM count it
                tokens.append(piece.token)
                if piece.logprob is not None:
                    logprobs.append((piece.token, piece.logprob))
            reason = piece.finish_reason or reason
        return Completion("".join(texts), tokens, reason, len(prompt), logprobs)

    task = asyncio.ensure_future(run())
    if request is None:
        return await task
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise ProtocolError(Kind.CLIENT_GONE, "client disconnected")
    except asyncio.CancelledError:
        task.cancel()
        raise
