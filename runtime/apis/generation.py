"""What the generation routes share: the served decoders, their parameters, and the stream of a request.

A with-past export served by ``attnx serve`` is a :class:`GenerationModel`: its session, a
:class:`~attnx.runtime.core.decoding.Decoder`, its tokenizer, a chat template when its tokenizer folder has
one, and a :class:`~attnx.runtime.core.scheduler.GenerationScheduler` that batches its concurrent requests at
the step level. Triton's generate extension (:mod:`attnx.runtime.apis.generate`) and OpenAI's completions
(:mod:`attnx.runtime.apis.completions`) differ only in their wire shapes; both turn a request into
:class:`~attnx.runtime.core.sampling.SamplingParams` here (one-line 400s for anything out of range) and read
its tokens with :func:`pieces`, which cancels the generation when the client goes away.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Mapping

import numpy as np

from attnx.runtime.apis import kserve_tensors as proto
from attnx.runtime.core.decoding import Decoder
from attnx.runtime.core.generate import Piece
from attnx.runtime.core.sampling import SamplingError, SamplingParams
from attnx.runtime.core.scheduler import GenerationScheduler, SchedulerClosed, SchedulerFull
from attnx.runtime.core.session import InputError, Session
from attnx.runtime.core.text import TextTokenizer

#: Most completions one request may ask for (prompts x n).
MAX_CHOICES = 16


class GenerationFailed(proto.ProtocolError):
    status = 500
    reason = "internal"


class ParamProblem(proto.BadRequest):
    """A 400 naming the request field at fault (OpenAI's ``param``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def is_generator(session: Session) -> bool:
    """A with-past export or its engine (``attnx.cache`` in the metadata): served by the generation routes."""
    from attnx.runtime.core.decoding import source_info

    info, _ = source_info(session)
    return bool(info is not None and info.cache)


@dataclass
class GenerationModel:
    name: str
    session: Session
    decoder: Decoder
    tokenizer: TextTokenizer
    scheduler: GenerationScheduler
    chat_template: str | None = None
    special_tokens: dict = field(default_factory=dict)

    @classmethod
    def load(cls, name: str, session: Session, tokenizer: TextTokenizer | None, *, max_batch: int,
             max_queue: int) -> "GenerationModel":
        if tokenizer is None:  # an engine: the ONNX its sidecar names carries the tokenizer
            from attnx.runtime.core.decoding import source_info

            info, source = source_info(session)
            tokenizer = TextTokenizer.from_export(source, info) if info is not None else None
        if tokenizer is None:
            raise ValueError(f"model {name!r} generates text but carries no tokenizer (serve it with --tokenizer DIR)")
        decoder = Decoder(session)
        profiles = session.profiles or {}
        if isinstance(profiles.get("batch"), list) and str(session.path).endswith((".engine", ".plan")):
            max_batch = min(max_batch, int(profiles["batch"][2]))  # an engine runs no more rows than its profile
        template, specials = read_chat_template(tokenizer.file.parent)
        return cls(name, session, decoder, tokenizer,
                   GenerationScheduler(decoder, tokenizer, max_batch=max_batch, max_queue=max_queue, name=name),
                   template, specials)

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        self.scheduler.close(drain=drain, timeout=timeout)

    def prompt_ids(self, prompt: Any, param: str = "prompt", special: bool = True) -> list[int]:
        """A text (tokenised with the model's tokenizer; ``special``: its BOS and the like added) or a list of
        token ids, as the prompt of one generation."""
        if isinstance(prompt, str):
            if not prompt:
                raise ParamProblem(f"'{param}' is empty", param)
            try:
                return [int(i) for i in self.tokenizer.tokenize([prompt], truncate=False, allow_empty=True,
                                                                add_special_tokens=special)[0].ids]
            except InputError as e:
                raise ParamProblem(f"'{param}': {e}", param) from None
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.decoder.vocab_size
            bad = next((t for t in prompt if t < 0 or (vocab is not None and t >= vocab)), None)
            if bad is not None:
                raise ParamProblem(f"'{param}': token id {bad} is outside the model's vocabulary [0, {vocab})", param)
            return list(prompt)
        raise ParamProblem(f"'{param}' must be a string or a list of token ids", param)

    def check_prompt(self, ids: list[int], param: str = "prompt") -> None:
        limit = self.decoder.max_positions
        if limit and len(ids) >= limit:
            raise ParamProblem(f"'{param}' has {len(ids)} tokens; the model has {limit} positions, so a prompt must "
                               f"be shorter than {limit} tokens", param)


def read_chat_template(folder: Path) -> tuple[str | None, dict]:
    """The chat template of a tokenizer folder (``chat_template.jinja``, else ``tokenizer_config.json``'s
    ``chat_template``, the ``default`` one of a list) and the special tokens templates refer to."""
    config = {}
    cfg = folder / "tokenizer_config.json"
    if cfg.is_file():
        try:
            config = json.loads(cfg.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            config = {}
    template = None
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    elif isinstance(config.get("chat_template"), str):
        template = config["chat_template"]
    elif isinstance(config.get("chat_template"), list):
        named = {t.get("name"): t.get("template") for t in config["chat_template"] if isinstance(t, dict)}
        template = named.get("default")
    specials = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            specials[key] = value
    return template, specials


def render_chat(model: GenerationModel, messages: Any, tools: Any = None) -> str:
    """The conversation as the model's chat template writes it, ending where the assistant's turn begins
    (Jinja2 in a sandbox, as transformers' ``apply_chat_template`` renders it)."""
    if model.chat_template is None:
        raise ParamProblem(f"model {model.name!r} has no chat template (its tokenizer folder has none): use "
                           "/v1/completions", "messages")
    if not isinstance(messages, list) or not messages:
        raise ParamProblem("'messages' must be a non-empty list", "messages")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ParamProblem(f"messages[{i}] must be an object with a 'role'", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise ParamProblem(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(texts)
        if content is not None and not isinstance(content, str):
            raise ParamProblem(f"messages[{i}].content must be a string", "messages")
        plain.append({**m, "content": content or ""})
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(model.chat_template).render(messages=plain, add_generation_prompt=True, tools=tools,
                                                           **model.special_tokens)
    except TemplateError as e:
        raise ParamProblem(f"the chat template refused the messages: {' '.join(str(e).split())[:200]}",
                           "messages") from None


def number(body: Mapping, key: str, default=None, *, integer: bool = False, param: str | None = None):
    """A numeric field (None / absent: ``default``), with a one-line 400 for anything else."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not float(value).is_integer()):
        raise ParamProblem(f"'{key}' must be {'an integer' if integer else 'a number'}, got {value!r}", param or key)
    return int(value) if integer else float(value)


def sampling(max_tokens, temperature, top_p, top_k, repetition_penalty, stop, seed, ignore_eos=False,
             names: Mapping[str, str] | None = None) -> SamplingParams:
    """Request fields -> :class:`SamplingParams` (``temperature`` 0: greedy), with the request's own field
    names in the errors."""
    names = dict(names or {})
    if max_tokens is not None and max_tokens < 1:
        key = names.get("max_new_tokens", "max_tokens")
        raise ParamProblem(f"'{key}' must be >= 1, got {max_tokens}", key)
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        raise ParamProblem("'stop' must be a string or a list of strings", "stop")
    try:
        return SamplingParams(max_new_tokens=max_tokens if max_tokens is not None else 16,
                              temperature=1.0 if temperature is None else temperature,
                              top_p=1.0 if top_p is None else top_p, top_k=top_k or 0,
                              repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
                              do_sample=temperature is None or temperature > 0,
                              stop=tuple([stop] if isinstance(stop, str) else stop or ()), seed=seed,
                              ignore_eos=bool(ignore_eos))
    except SamplingError as e:
        key = names.get(e.param or "", e.param)
        message = str(e).replace(f"{e.param} ", f"'{key}' ", 1) if e.param else str(e)
        raise ParamProblem(message, key) from None


class _Receiver:
    """Pieces from the scheduler's thread into this event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def deliver(self, piece: Piece) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, piece)

    def error(self, message: str) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, GenerationFailed(message))


async def pieces(model: GenerationModel, prompt: list[int], params: SamplingParams,
                 context: Mapping[str, np.ndarray] | None = None) -> AsyncIterator[Piece]:
    """One generation's pieces as the scheduler makes them; leaving early (a client gone, an error)
    cancels it, which frees its batch row at the next step."""
    receiver = _Receiver(asyncio.get_running_loop())
    try:
        handle = model.scheduler.submit(prompt, params, receiver.deliver, receiver.error, context)
    except InputError as e:
        raise ParamProblem(str(e), "prompt") from None
    except SchedulerFull as e:
        raise proto.Overloaded(str(e)) from None
    except SchedulerClosed as e:
        raise proto.Overloaded(str(e), reason="shutting_down") from None
    try:
        while True:
            item = await receiver.queue.get()
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


async def complete(model: GenerationModel, prompt: list[int], params: SamplingParams, context=None,
                   request=None) -> Completion:
    """The whole generation; a client that disconnects meanwhile (``request``) cancels it."""

    async def run() -> Completion:
        texts, tokens, reason = [], [], "length"
        async for piece in pieces(model, prompt, params, context):
            texts.append(piece.text)
            if piece.token is not None:  # an end-of-sequence token counts, as OpenAI and vLLM count it
                tokens.append(piece.token)
            reason = piece.finish_reason or reason
        return Completion("".join(texts), tokens, reason, len(prompt))

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
                raise ClientGone("client disconnected")
    except asyncio.CancelledError:
        task.cancel()
        raise


class ClientGone(proto.ProtocolError):
    status = 499
    reason = "client_disconnect"
