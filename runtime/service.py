"""What the HTTP and gRPC front ends share: the served models and running one checked request.

:class:`ServedModel` is one model behind the server (session, batcher, tokenizer, how it presents
itself in metadata); :class:`ModelRegistry` finds models by name and version; :func:`infer` runs an
:class:`~attnx.runtime.protocol.InferRequest`: token-id requests go to the batcher as they are, text
requests are tokenised (off the event loop when large) and each text joins the batcher on its own,
so texts of similar length from different clients share a batch, and the per-text results come back
together (:func:`attnx.runtime.text.stack_rows`). Errors come out as
:class:`~attnx.runtime.protocol.ProtocolError` with the status both transports map.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attnx.runtime import pacing
from attnx.runtime import protocol as proto
from attnx.runtime.batcher import BatcherClosedError, DynamicBatcher, QueueFullError, RequestTimeoutError
from attnx.runtime.session import InputError, Session
from attnx.runtime.text import TextTokenizer, context_rows, stack_rows, text_feeds

#: Tokenise in a worker thread beyond this many characters, so a big text request does not stall the loop.
_OFFLOAD_CHARS = 64 << 10


@dataclass
class ServedModel:
    """One model behind the server: its session, its batcher, its tokenizer, and how it presents itself."""

    name: str
    session: Session
    batcher: DynamicBatcher
    version: str = "1"
    limits: proto.Limits = field(default_factory=proto.Limits)
    tokenizer: TextTokenizer | None = None

    @functools.cached_property
    def scores_pairs(self) -> bool:
        """A text classifier (a cross-encoder among them): KServe requests may give ``text_pair`` beside ``text``."""
        from attnx.runtime.scoring import labels_of

        return labels_of(self) is not None

    @functools.cached_property
    def signature(self) -> proto.ModelSignature:
        profiles = self.session.profiles or {}
        seq_profile = profiles.get("seq")
        # Declared profile max for seq bounds requests unless --max-seq says otherwise (engines
        # cannot run past it; ONNX Runtime could, but the model was never meant to see it).
        profile_max = seq_profile[-1] if isinstance(seq_profile, list) and seq_profile else None
        text = None
        if self.tokenizer is not None:
            text = proto.TextInput(proto.TEXT_INPUT, self.tokenizer.max_length, self.tokenizer.truncation_side,
                                   pairs=self.scores_pairs)
        return proto.ModelSignature(
            self.name,
            self.session.inputs,
            self.session.outputs,
            self.batcher.config.max_batch_size,
            self.limits.max_seq or (profile_max if isinstance(profile_max, int) and profile_max > 0 else None),
            text,
        )

    def metadata(self) -> dict[str, Any]:
        """KServe v2 model metadata; dims are -1 where dynamic (batch included, as Triton does). A text
        model lists its ``text`` input first, and says how it tokenises under ``parameters``."""

        def tensor(spec):
            return {"name": spec.name, "datatype": proto.triton_dtype(spec.dtype),
                    "shape": [d if isinstance(d, int) else -1 for d in spec.shape]}

        inputs = [tensor(s) for s in self.session.inputs]
        out: dict[str, Any] = {"name": self.name, "versions": [self.version], "platform": self.session.platform}
        if self.tokenizer is not None:
            texts = [proto.TEXT_INPUT, proto.TEXT_PAIR_INPUT] if self.scores_pairs else [proto.TEXT_INPUT]
            inputs[:0] = [{"name": name, "datatype": proto.BYTES, "shape": [-1]} for name in texts]
            out["parameters"] = {"text_input": proto.TEXT_INPUT, **self.tokenizer.describe()}
            if self.scores_pairs:
                out["parameters"]["text_pair_input"] = proto.TEXT_PAIR_INPUT
        defaults = {s.name: s.default for s in self.session.inputs if s.default is not None}
        if defaults:  # inputs a request may leave out, and what they are then (the metadata's word)
            out.setdefault("parameters", {})["input_defaults"] = defaults
        out["inputs"] = inputs
        out["outputs"] = [tensor(s) for s in self.session.outputs]
        return out

    def config(self) -> dict[str, Any]:
        """A Triton model configuration (JSON form), as ``GET .../config`` returns."""
        from attnx.runtime.model_config import model_config

        params = None
        if self.tokenizer is not None:
            params = {k: str(v) for k, v in {"text_input": proto.TEXT_INPUT, **self.tokenizer.describe()}.items()}
        config = model_config(
            self.name,
            self.session,
            max_batch_size=self.batcher.config.max_batch_size,
            max_queue_delay_us=int(self.batcher.config.max_queue_delay_ms * 1000),
            parameters=params,
        )
        defaults = {s.name for s in self.session.inputs if s.default is not None}
        for entry in config["input"]:  # Triton's own word for an input a request may omit
            if entry["name"] in defaults:
                entry["optional"] = True
        return config


class ModelRegistry:
    """The served models by name (and their one version, "1")."""

    def __init__(self) -> None:
        self.models: dict[str, ServedModel] = {}

    def add(self, model: ServedModel) -> None:
        if model.name in self.models:
            raise ValueError(f"two models named {model.name!r} (use name=path to rename one)")
        self.models[model.name] = model

    def get(self, name: str, version: str | None = None) -> ServedModel:
        model = self.models.get(name)
        if model is None:
            raise proto.NotFound(f"unknown model {name!r}; this server has {sorted(self.models)}")
        if version not in (None, "", model.version):
            raise proto.NotFound(f"model {name!r} has no version {version!r} (versions: [{model.version!r}])")
        return model

    @property
    def ready(self) -> bool:
        return all(not m.batcher.closed for m in self.models.values())

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        for m in self.models.values():
            m.batcher.close(drain=drain, timeout=timeout)


async def infer(model: ServedModel, request: proto.InferRequest) -> dict[str, np.ndarray]:
    """Run one checked request through the model's batcher; its outputs (only those asked for)."""
    if request.texts is None:
        return await _submit_all(model, [request.feeds], request.outputs, request.timeout_ms, per_row=False)
    texts = request.texts
    if request.pairs is not None:  # (text, text_pair) rows: a cross-encoder's (query, document)
        tokenize = functools.partial(model.tokenizer.tokenize_pairs, list(zip(texts, request.pairs)),
                                     truncate=request.truncate)
    else:
        tokenize = functools.partial(model.tokenizer.tokenize, texts, truncate=request.truncate)
    try:
        if sum(len(t) for t in texts) + sum(len(t) for t in request.pairs or ()) > _OFFLOAD_CHARS:
            encoded = await asyncio.to_thread(tokenize)
        else:
            encoded = tokenize()
        check_token_budget(sum(e.length for e in encoded), model.limits)
        contexts = context_rows(model.session.inputs, request.feeds, len(texts))
        feeds = [text_feeds(model.session.inputs, e, c) for e, c in zip(encoded, contexts)]
    except InputError as e:
        raise proto.BadRequest(f"input {proto.TEXT_INPUT!r}: {e}") from None
    parts = await _submit_all(model, feeds, request.outputs, request.timeout_ms, per_row=True)
    return stack_rows(parts, model.session.outputs)


async def infer_rows(model: ServedModel, rows: list[dict[str, np.ndarray]], outputs: list[str] | None,
                     timeout_ms: float | None = None) -> list[dict[str, np.ndarray]]:
    """Each row (one text's feeds) joins the batcher on its own, as a text request's texts do; their outputs
    in order. The OpenAI and TEI routes (:mod:`attnx.runtime.embeddings`) run their inputs through here."""
    return await _submit_all(model, rows, outputs, timeout_ms, per_row=True)


async def _submit_all(model: ServedModel, feeds: list[dict[str, np.ndarray]], outputs: list[str] | None,
                      timeout_ms: float | None, per_row: bool, paced: bool = False):
    """Queue every part of a request (all or none), then await them; one result, or (``per_row``) a list.
    What cannot start before its deadline is refused first (:mod:`attnx.runtime.pacing`)."""
    if not paced:
        async def submit(part):
            found = await _submit_all(model, part, outputs, timeout_ms, per_row, paced=True)
            return found if per_row else [found]

        results = await pacing.run(model.batcher, feeds, timeout_ms, submit)
        return results if per_row else results[0]
    futures = []
    try:
        for f in feeds:
            futures.append(model.batcher.submit(f, output_names=outputs, timeout_ms=timeout_ms))
    except InputError as e:
        _cancel(futures)
        where = f"text {len(futures)}: " if per_row else ""
        raise proto.BadRequest(where + str(e)) from None
    except QueueFullError as e:
        _cancel(futures)
        raise proto.Overloaded(str(e)) from None
    except BatcherClosedError as e:
        _cancel(futures)
        raise proto.Overloaded(str(e), "shutting_down") from None
    try:
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures), return_exceptions=True)
    finally:
        _cancel(futures)
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if isinstance(failed, InputError):
        raise proto.BadRequest(str(failed)) from None
    if isinstance(failed, RequestTimeoutError):
        raise proto.Overloaded(str(failed), "timeout") from None
    if isinstance(failed, BatcherClosedError):
        raise proto.Overloaded(str(failed), "shutting_down") from None
    if failed is not None:
        raise failed
    return results if per_row else results[0]


def check_token_budget(tokens: int, limits: proto.Limits) -> None:
    """413 for a request whose texts come to more tokens than ``limits.max_request_tokens``."""
    if limits.max_request_tokens is not None and tokens > limits.max_request_tokens:
        raise proto.TooLarge(f"the request's inputs come to {tokens} tokens, over the limit of "
                             f"{limits.max_request_tokens} tokens per request; send fewer or shorter inputs")


def _cancel(futures) -> None:
    for f in futures:
        f.cancel()  # a no-op once running or done; a queued one leaves the queue unrun
