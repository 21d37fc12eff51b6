"""An encoder served: a session, its dynamic batcher and (for text) its tokenizer, as the registry serves it.

Its capabilities follow from what the export gives: ``infer`` always, ``tokenize`` and ``embed`` with a tokenizer
(and a ``sentence_embedding`` output), ``score`` and ``rerank`` with a tokenizer and ``logits [batch, labels]``.
:meth:`EncoderModel.run_rows` is how every API's rows reach the batcher (:mod:`attnx.runtime.serving.encoding` for
texts, :mod:`attnx.runtime.apis.kserve` for tensors).
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attnx.runtime.core import pacing
from attnx.runtime.core.batcher import DynamicBatcher
from attnx.runtime.core.errors import Refusal
from attnx.runtime.core.labels import Labels, read_labels
from attnx.runtime.core.session import InputError, Session
from attnx.runtime.core.text import TEXT_INPUT, TEXT_PAIR_INPUT, TextTokenizer
from attnx.runtime.serving.model_config import model_config
from attnx.runtime.serving.model import EMBED, GENERATE, INFER, RERANK, SCORE, TOKENIZE, WORDS
from attnx.runtime.serving.signature import ModelSignature, TextInput, tensor_metadata
from attnx.runtime.wire.errors import bad_input
from attnx.runtime.wire.limits import Limits

#: The pooled output the embedding APIs serve, and the label logits the scoring APIs read.
EMBEDDING, LOGITS = "sentence_embedding", "logits"


@dataclass
class EncoderModel:
    """One encoder behind the server (a :class:`~attnx.runtime.serving.model.ServedModel`): its session, its batcher,
    its tokenizer, and how it presents itself."""

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
    def signature(self) -> ModelSignature:
        """What KServe requests are checked against (:mod:`attnx.runtime.apis.kserve_tensors`)."""
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

    def text_tokenizer(self) -> TextTokenizer:
        """The tokenizer, for what takes text: every capability but infer has one, so a route's pick refused a
        model without it already; this says so again in one line rather than failing on None."""
        if self.tokenizer is None:
            raise bad_input(self.unfit(TOKENIZE))
        return self.tokenizer

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
        pooling = getattr(s, "pooling", None)  # a session wrapped with its pooling (core.pooling.with_pooling)
        if pooling is not None:
            lines.append(f"  sentence_embedding: last_hidden_state, {pooling.describe()}")
        lines.append(f"  -> {layout.verdict()}")
        lines.append(f"  -> at most {cfg.max_batch_size} rows and "
                     f"{cfg.max_batch_tokens if cfg.max_batch_tokens else 'any number of'} tokens a batch")
        if layout.can_batch:
            lines.append(f"  -> outputs cut back to each request's length: "
                         f"{[o.name for o in s.outputs if o.seq_axis is not None] or '-'}; split by row: "
                         f"{[o.name for o in s.outputs if o.seq_axis is None and o.batch_axis is not None] or '-'}")
        return lines


def _batcher_error(e: BaseException, where: str = "") -> BaseException:
    """A batcher's refusal in the server's words, by its kind; ``where`` (the text at fault) names a bad input only.
    Anything else is passed on as it is: an internal error."""
    if isinstance(e, Refusal):
        return e.refused(where if isinstance(e, InputError) else "")
    return e


def _cancel(futures) -> None:
    for f in futures:
        f.cancel()  # a no-op once running or done; a queued one leaves the queue unrun
