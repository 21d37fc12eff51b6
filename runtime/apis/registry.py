"""The served models, one registry for every API: which model a request means, and what each model can do.

Encoders (:class:`ServedModel`: a session and its batcher) and text generators
(:class:`~attnx.runtime.apis.generation.GenerationModel`) alike, so every route, probe and gauge sees them all.
Each states its capabilities; :meth:`ModelRegistry.pick` finds the model a JSON request names, or the only one
that can do what it asks, with one wording of the refusal (404 an unknown name, 400 a model that cannot).
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attnx.runtime.core import pacing
from attnx.runtime.core.batcher import BatcherClosedError, DynamicBatcher, QueueFullError, RequestTimeoutError
from attnx.runtime.core.labels import Labels, read_labels
from attnx.runtime.core.session import InputError, Session
from attnx.runtime.core.text import TEXT_INPUT, TEXT_PAIR_INPUT, TextTokenizer, TooLong
from attnx.runtime.wire.errors import Kind, ProtocolError, bad_input, not_found, overloaded, too_large
from attnx.runtime.wire.limits import Limits

INFER, EMBED, SCORE, RERANK, GENERATE, TOKENIZE = "infer", "embed", "score", "rerank", "generate", "tokenize"
#: The pooled output the embedding APIs serve, and the label logits the scoring APIs read.
EMBEDDING, LOGITS = "sentence_embedding", "logits"
#: How a refusal names each capability: (one, several, what it takes).
WORDS = {EMBED: ("embedding model", "embedding models", "a tokenizer and a sentence_embedding output"),
         SCORE: ("text classifier", "text classifiers", "a sequence classifier with a tokenizer"),
         RERANK: ("reranker", "rerankers", "a sequence classifier with a tokenizer and one label"),
         GENERATE: ("text generation model", "text generation models", "a with-past export"),
         TOKENIZE: ("model with a tokenizer", "models with a tokenizer", "a tokenizer"),
         INFER: ("model", "models", "a model")}


@dataclass
class ServedModel:
    """One encoder behind the server: its session, its batcher, its tokenizer, and how it presents itself."""

    name: str
    session: Session
    batcher: DynamicBatcher
    version: str = "1"
    limits: Limits = field(default_factory=Limits)
    tokenizer: TextTokenizer | None = None

    @functools.cached_property
    def labels(self) -> Labels | None:
        """A text classifier's labels (a tokenizer and ``logits [batch, labels]``), else None."""
        spec = next((s for s in self.session.outputs if s.name == LOGITS), None)
        if self.tokenizer is None or spec is None or spec.rank != 2 or spec.batch_axis != 0 or spec.seq_axis is not None:
            return None  # no logits, or a language model's [batch, seq, vocab]
        return read_labels(self.session.info, self.tokenizer.file.parent, spec.shape[1])

    @functools.cached_property
    def signature(self):
        """What KServe requests are checked against (:mod:`attnx.runtime.apis.kserve_tensors`)."""
        from attnx.runtime.apis.kserve_tensors import ModelSignature, TextInput

        t = self.tokenizer
        text = TextInput(TEXT_INPUT, t.max_length, t.truncation_side, SCORE in self.capabilities) if t else None
        return ModelSignature(self.name, self.session.inputs, self.session.outputs, self.batcher.config.max_batch_size,
                              self.max_seq, text)

    @functools.cached_property
    def capabilities(self) -> frozenset[str]:
        found = {INFER}
        if self.tokenizer is not None:
            found.add(TOKENIZE)
            if EMBEDDING in self.session.output_names:
                found.add(EMBED)
        if self.labels is not None:
            found |= {SCORE, RERANK} if self.labels.reranker else {SCORE}
        return frozenset(found)

    def unfit(self, capability: str) -> str:
        """Why this model cannot do ``capability`` (one line)."""
        what = WORDS[capability][0]
        if self.tokenizer is None:
            return f"model {self.name!r} has no tokenizer (serve it with --tokenizer DIR to take text)"
        if capability == EMBED:
            return (f"model {self.name!r} gives no {EMBEDDING!r} output (its outputs: {self.session.output_names}); "
                    f"use KServe v2 (/v2/models/{self.name}/infer) for it")
        if capability == RERANK and self.labels is not None:
            return (f"model {self.name!r} is a classifier with {len(self.labels.names)} labels "
                    f"{list(self.labels.names)}, not a reranker (one relevance logit); use /predict or /classify "
                    f"for it")
        if capability == GENERATE:
            return f"model {self.name!r} does not generate text (serve a with-past export for that)"
        return (f"model {self.name!r} is not a {what}: it gives no {LOGITS!r} [batch, labels] output (its outputs: "
                f"{self.session.output_names})")

    @property
    def ready(self) -> bool:
        return not self.batcher.closed

    @property
    def queue_depth(self) -> int:
        return self.batcher.queue_depth

    @property
    def max_queue(self) -> int:
        return self.batcher.config.max_queue_size

    @property
    def max_seq(self) -> int | None:
        # Declared profile max for seq bounds requests unless --max-seq says otherwise (engines cannot run past
        # it; ONNX Runtime could, but the model was never meant to see it).
        seq = (self.session.profiles or {}).get("seq")
        top = seq[-1] if isinstance(seq, list) and seq else None
        return self.limits.max_seq or (top if isinstance(top, int) and top > 0 else None)

    def metadata(self) -> dict[str, Any]:
        """KServe v2 model metadata; dims are -1 where dynamic (batch included, as Triton does). A text model
        lists its ``text`` input first, and says how it tokenises under ``parameters``."""
        from attnx.runtime.apis.kserve_tensors import tensor_metadata

        out: dict[str, Any] = {"name": self.name, "versions": [self.version], "platform": self.session.platform}
        texts = [TEXT_INPUT, TEXT_PAIR_INPUT] if SCORE in self.capabilities else [TEXT_INPUT]
        inputs = [{"name": name, "datatype": "BYTES", "shape": [-1]} for name in texts if self.tokenizer is not None]
        inputs += [tensor_metadata(s) for s in self.session.inputs]
        if self.tokenizer is not None:
            out["parameters"] = {"text_input": TEXT_INPUT, **self.tokenizer.describe(),
                                 **({"text_pair_input": TEXT_PAIR_INPUT} if SCORE in self.capabilities else {})}
        defaults = {s.name: s.default for s in self.session.inputs if s.default is not None}
        if defaults:  # inputs a request may leave out, and what they are then (the metadata's word)
            out.setdefault("parameters", {})["input_defaults"] = defaults
        out["inputs"] = inputs
        out["outputs"] = [tensor_metadata(s) for s in self.session.outputs]
        return out

    def config(self) -> dict[str, Any]:
        """A Triton model configuration (JSON form), as ``GET .../config`` returns."""
        from attnx.runtime.apis.model_config import model_config

        params = None
        if self.tokenizer is not None:
            params = {k: str(v) for k, v in {"text_input": TEXT_INPUT, **self.tokenizer.describe()}.items()}
        config = model_config(self.name, self.session, max_batch_size=self.batcher.config.max_batch_size,
                              max_queue_delay_us=int(self.batcher.config.max_queue_delay_ms * 1000),
                              parameters=params)
        defaults = {s.name for s in self.session.inputs if s.default is not None}
        for entry in config["input"]:  # Triton's own word for an input a request may omit
            if entry["name"] in defaults:
                entry["optional"] = True
        return config

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        self.batcher.close(drain=drain, timeout=timeout)

    # --- running -------------------------------------------------------------------------------------
    async def run_rows(self, rows: list[dict[str, np.ndarray]], outputs: list[str] | None,
                       timeout_ms: float | None = None, texts: bool = True) -> list[dict[str, np.ndarray]]:
        """Each row (one text's feeds, or one whole tensor request) joins the batcher on its own, so rows of
        similar length from different clients share a batch; their outputs, in order. What cannot start
        before its deadline is refused first (:mod:`attnx.runtime.core.pacing`); all rows queue, or none."""

        async def submit(part: list[dict[str, np.ndarray]]) -> list:
            futures = []
            try:
                for feeds in part:
                    futures.append(self.batcher.submit(feeds, output_names=outputs, timeout_ms=timeout_ms))
            except Exception as e:
                _cancel(futures)
                raise _batcher_error(e, f"text {len(futures)}: " if texts else "") from None
            try:
                results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures), return_exceptions=True)
            finally:
                _cancel(futures)
            failed = next((r for r in results if isinstance(r, BaseException)), None)
            if failed is not None:
                raise _batcher_error(failed)
            return results

        return await pacing.run(self.batcher, rows, timeout_ms, submit)

    def describe(self) -> list[str]:
        """How this model is served, for ``attnx serve --describe``."""
        from attnx.runtime.core.axes import describe_axes

        s, cfg, layout = self.session, self.batcher.config, self.batcher.layout
        lines = [f"model {self.name}: {s.path} ({s.provider})", *describe_axes(s.axis_decisions, s.inputs + s.outputs)]
        if self.tokenizer is not None:
            t = self.tokenizer
            lines.append(f"  text input {TEXT_INPUT!r} (BYTES [-1]): {t.file}, max length {t.max_length}, "
                         f"truncation {t.truncation_side}, pad id {t.pad_id}")
        if getattr(s, "pooling", None) is not None:
            lines.append(f"  sentence_embedding: last_hidden_state, {s.pooling.describe()}")
        lines.append(f"  -> {layout.verdict()}")
        lines.append(f"  -> at most {cfg.max_batch_size} rows and "
                     f"{cfg.max_batch_tokens if cfg.max_batch_tokens else 'any number of'} tokens a batch")
        if layout.can_batch:
            lines.append(f"  -> outputs cut back to each request's length: "
                         f"{[o.name for o in s.outputs if o.seq_axis is not None] or '-'}; split by row: "
                         f"{[o.name for o in s.outputs if o.seq_axis is None and o.batch_axis is not None] or '-'}")
        return lines


def input_error(e: InputError, where: str = "", param: str | None = None) -> ProtocolError:
    """A refusal of the inputs (a tokenizer's, a session's) in the server's words: past what the model reads
    at all is ``too_large``, anything else ``bad_input``."""
    return ProtocolError(Kind.TOO_LARGE if isinstance(e, TooLong) else Kind.BAD_INPUT, where + str(e), param)


def _batcher_error(e: BaseException, where: str = "") -> BaseException:
    """A batcher's refusal in the server's words (anything else is passed on as it is: an internal error)."""
    if isinstance(e, InputError):
        return bad_input(where + str(e))
    if isinstance(e, QueueFullError):
        return overloaded(str(e))
    if isinstance(e, RequestTimeoutError):
        return ProtocolError(Kind.TIMEOUT, str(e))
    if isinstance(e, BatcherClosedError):
        return ProtocolError(Kind.SHUTTING_DOWN, str(e))
    return e


def check_room(model, count: int) -> None:
    """Refuse, before any work, ``count`` parts the model's queue cannot take: more than it ever holds is
    ``too_large`` (a retry never helps), more than it holds now is ``overloaded``."""
    if count > model.max_queue:
        raise too_large(f"{count} inputs, but model {model.name!r} queues at most {model.max_queue} at once: "
                        f"send at most {model.max_queue} per request")
    if model.queue_depth + count > model.max_queue:
        raise overloaded(f"model {model.name!r}: queue full ({model.max_queue} inputs waiting at most); "
                         f"retry later")


def _cancel(futures) -> None:
    for f in futures:
        f.cancel()  # a no-op once running or done; a queued one leaves the queue unrun


class ModelRegistry:
    """Every served model by name (each has one version, "1"), encoders and generators alike."""

    def __init__(self) -> None:
        self.models: dict[str, Any] = {}

    def add(self, model) -> None:
        if model.name in self.models:
            raise ValueError(f"two models named {model.name!r} (use name=path to rename one)")
        self.models[model.name] = model

    def get(self, name: str, version: str | None = None, *, private: bool = False):
        """The model of a path (``/v2/models/{name}``); 404 otherwise. ``private``: the refusal does not list
        the served names (an open route, such as a readiness probe, answers clients without the key)."""
        model = self.models.get(name)
        if model is None:
            names = "" if private else f"; this server has {sorted(self.models)}"
            raise not_found(f"unknown model {name!r}{names}")
        if version not in (None, "", model.version):
            raise not_found(f"model {name!r} has no version {version!r} (versions: [{model.version!r}])")
        return model

    def able(self, capability: str) -> list:
        return [m for m in self.models.values() if capability in m.capabilities]

    def pick(self, name: Any, capability: str):
        """The model a JSON request names (``model``), or with no name the server's only one that can do
        ``capability`` (for a classifier, its only one with several labels when it serves rerankers too)."""
        one, several, needs = WORDS[capability]
        fit = self.able(capability)
        if name is None or name == "":
            if capability == SCORE and len(fit) > 1:  # a reranker predicts too; naming none means the classifier
                fit = [m for m in fit if RERANK not in m.capabilities] or fit
            if len(fit) == 1:
                return fit[0]
            names = [m.name for m in fit]
            raise bad_input(f"this server has several {several} {names}: name one in 'model'" if names
                            else f"this server has no {one} ({needs})", "model")
        model = self.models.get(name)
        if model is None:
            raise not_found(f"The model {name!r} does not exist on this server; its {several} are "
                            f"{[m.name for m in self.able(capability)]}")
        if capability not in model.capabilities:
            raise bad_input(model.unfit(capability), "model")
        return model

    @property
    def ready(self) -> bool:
        return all(m.ready for m in self.models.values())

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        for m in self.models.values():
            m.close(drain=drain, timeout=timeout)
