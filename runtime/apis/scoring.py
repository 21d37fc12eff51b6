"""Scores from sequence classifiers (cross-encoders, sentiment classifiers) for the rerank and classify routes.

What :mod:`attnx.runtime.apis.rerank` (Cohere/Jina ``/v1/rerank``), :mod:`attnx.runtime.apis.tei` (``/predict``,
``/rerank``) and :mod:`attnx.runtime.apis.classify` (Infinity's ``/classify``) share: which served models score (a
tokenizer and a ``logits [batch, labels]`` output, as ``attnx export --from-pretrained`` writes for a
``...ForSequenceClassification`` folder), their labels (the export's ``id2label``), the activation each
answer applies, and the run itself: texts and (query, document) pairs are tokenised by the export's own
tokenizer (pairs in its pair template, truncated longest-first: :meth:`TextTokenizer.tokenize_pairs
<attnx.runtime.core.text.TextTokenizer.tokenize_pairs>`), and each input joins the model's batcher on its own
(:func:`attnx.runtime.apis.embeddings.run_encoded`), so these routes share one queue, one set of limits and
metrics with KServe and the embedding routes.

A model with one label is a reranker (a relevance logit, as ms-marco cross-encoders); with several, a
classifier. Activations follow the references: a reranker's score is the sigmoid of its logit
(sentence-transformers' CrossEncoder default for one label; identity when the folder's config names
``torch.nn.Identity`` as its CrossEncoder ``activation_fn``), a classifier's scores are the softmax over its
labels (sigmoid per label when ``problem_type`` is ``multi_label_classification``, as transformers'
text-classification pipeline does), and ``raw_scores`` gives the logits themselves.
"""

from __future__ import annotations

import asyncio
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from attnx.runtime.apis import kserve_tensors as proto
from attnx.runtime.apis.embeddings import InputProblem, TooManyInputs, UnknownModel, check_room, run_encoded
from attnx.runtime.apis.kserve_json import NonFiniteOutput
from attnx.runtime.apis.registry import ModelRegistry, ServedModel
from attnx.runtime.core.session import InputError

#: The output these routes read: one row of label logits per input.
OUTPUT = "logits"
#: Tokenise beyond this many characters off the event loop, so other requests keep flowing.
_OFFLOAD_CHARS = 64 << 10
#: What the folder's config may name as CrossEncoder's activation (``sentence_transformers.activation_fn``).
_IDENTITY = "torch.nn.modules.linear.Identity"

Item = str | tuple[str, str]  # a text, or a (first, second) pair such as (query, document)


@dataclass(frozen=True)
class Labels:
    """A classifier's labels, in logit order, and how its logits become scores."""

    names: tuple[str, ...]
    multi_label: bool = False  # problem_type multi_label_classification: independent sigmoids
    identity: bool = False  # a reranker whose CrossEncoder activation is the identity (relevance = logit)

    @property
    def reranker(self) -> bool:
        return len(self.names) == 1

    def scores(self, logits: np.ndarray, raw: bool = False) -> np.ndarray:
        """``[N, labels]`` logits -> per-label scores as transformers' text-classification pipeline and TEI's
        ``/predict`` give them: softmax over the labels, sigmoid for one label or a multi-label problem
        (``raw``: the logits)."""
        if raw:
            return logits
        if self.reranker or self.multi_label:
            return sigmoid(logits)
        return softmax(logits)

    def relevance(self, logits: np.ndarray, raw: bool = False) -> np.ndarray:
        """A reranker's ``[N, 1]`` logits -> one relevance score each, as CrossEncoder's ``rank``/``predict``
        give it: its activation (sigmoid, or the identity its config names), or (``raw``) the logit."""
        column = logits[:, 0]
        return column if raw or self.identity else sigmoid(column)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return (1.0 / (1.0 + np.exp(-x.astype(np.float64)))).astype(np.float32)


def softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x.astype(np.float64) - x.max(axis=-1, keepdims=True))
    return (z / z.sum(axis=-1, keepdims=True)).astype(np.float32)


# --------------------------------------------------------------------------------------
# Which models score, with which labels
# --------------------------------------------------------------------------------------


def labels_of(model: ServedModel) -> Labels | None:
    """The model's labels when it classifies text (a tokenizer and ``logits [batch, labels]``), else None.
    Labels come from the export's recorded config (a foreign file: ``config.json`` beside its tokenizer),
    ``LABEL_i`` where it names none, as transformers does."""
    if model.tokenizer is None:
        return None
    spec = next((s for s in model.session.outputs if s.name == OUTPUT), None)
    if spec is None or spec.rank != 2 or spec.batch_axis != 0 or spec.seq_axis is not None:
        return None  # no logits, or a language model's [batch, seq, vocab]
    return _labels(model.session.info, model.tokenizer.file.parent, spec.shape[1])


def _labels(info, tokenizer_folder: Path, width: Any) -> Labels | None:
    hf = (info.config or {}).get("hf_config") if info is not None else None
    if not isinstance(hf, dict):
        hf = _json_object(tokenizer_folder / "config.json")
    id2label = hf.get("id2label") if isinstance(hf.get("id2label"), dict) else {}
    count = width if isinstance(width, int) else len(id2label) or hf.get("num_labels")
    if not isinstance(count, int) or count < 1:
        return None  # a width nothing states: not servable as labels
    names = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count))
    st = hf.get("sentence_transformers") if isinstance(hf.get("sentence_transformers"), dict) else {}
    activation = st.get("activation_fn") or hf.get("sbert_ce_default_activation_function") or ""
    return Labels(names, hf.get("problem_type") == "multi_label_classification", activation == _IDENTITY)


@functools.lru_cache(maxsize=64)
def _json_object_cached(path: str, mtime: float) -> dict:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # labels then default to LABEL_i; the model still serves
    return data if isinstance(data, dict) else {}


def _json_object(path: Path) -> dict:
    try:
        return _json_object_cached(str(path), path.stat().st_mtime)
    except OSError:
        return {}


def scoring_models(registry: ModelRegistry, rerank: bool = False) -> list[ServedModel]:
    """The served models that classify text (``rerank``: those with one label only)."""
    out = []
    for m in registry.models.values():
        labels = labels_of(m)
        if labels is not None and (labels.reranker or not rerank):
            out.append(m)
    return out


def pick(registry: ModelRegistry, name: Any, *, rerank: bool) -> tuple[ServedModel, Labels]:
    """The model a request names (``model``), or with no name the server's only one that fits (for a
    classifier, its only one with several labels, when it also serves rerankers); its labels. A model that
    does not fit is a 400 saying why, an unknown name a 404."""
    what, kinds = ("reranker", "rerankers") if rerank else ("text classifier", "text classifiers")
    if name is None or name == "":
        models = scoring_models(registry, rerank)
        if not rerank and len(models) > 1:  # a reranker predicts too, but a client naming none means the classifier
            models = [m for m in models if not labels_of(m).reranker] or models
        if len(models) == 1:
            return models[0], labels_of(models[0])
        names = [m.name for m in models]
        raise InputProblem(f"this server has several {kinds} {names}: name one in 'model'" if names
                           else f"this server has no {what} (a sequence classifier with a tokenizer"
                                f"{' and one label' if rerank else ''})", param="model")
    if not isinstance(name, str):
        raise InputProblem("'model' must be a string", param="model")
    model = registry.models.get(name)
    if model is None:
        raise UnknownModel(f"The model {name!r} does not exist on this server; its {kinds} are "
                           f"{[m.name for m in scoring_models(registry, rerank)]}")
    labels = labels_of(model)
    if labels is None:
        outputs = model.session.output_names
        why = ("has no tokenizer" if model.tokenizer is None
               else f"gives no {OUTPUT!r} [batch, labels] output (its outputs: {outputs})")
        raise InputProblem(f"model {name!r} is not a {what}: it {why}", param="model")
    if rerank and not labels.reranker:
        raise InputProblem(f"model {name!r} is a classifier with {len(labels.names)} labels "
                           f"{list(labels.names)}, not a reranker (one relevance logit); use /predict or "
                           f"/classify for it", param="model")
    return model, labels


# --------------------------------------------------------------------------------------
# Inputs and the run
# --------------------------------------------------------------------------------------


def check_count(count: int, limits: proto.Limits, param: str) -> None:
    if count > limits.max_texts:
        raise TooManyInputs(f"'{param}' has {count} inputs, over the limit of {limits.max_texts} per request; "
                            f"send them in several requests", param=param, code="too_many_inputs")


def check_text(value: Any, where: str, param: str, *, allow_empty: bool = False) -> str:
    """A request string: a str, valid UTF-8, and (unless ``allow_empty``) not empty."""
    if not isinstance(value, str):
        raise InputProblem(f"{where} must be a string, got {type(value).__name__}", param=param)
    if not value and not allow_empty:
        raise InputProblem(f"{where} is an empty string", param=param)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputProblem(f"{where} is not valid UTF-8 (a lone surrogate at position {e.start})",
                           param=param) from None
    return value


@dataclass
class Scored:
    logits: np.ndarray  # [inputs, labels] float32
    tokens: int  # summed over the inputs, after truncation, special tokens included


async def score(model: ServedModel, items: list[Item], *, truncate: bool = True,
                context: Mapping[str, np.ndarray] | None = None, param: str = "inputs") -> Scored:
    """Tokenise each text or pair, check the limits, run every input through the model's batcher."""
    check_room(model, len(items))  # before any tokenising
    singles = [(i, s) for i, s in enumerate(items) if isinstance(s, str)]
    pairs = [(i, p) for i, p in enumerate(items) if not isinstance(p, str)]

    def tokenize():
        found = {}
        tok = model.tokenizer
        if singles:
            found.update(zip((i for i, _ in singles), tok.tokenize([s for _, s in singles], allow_empty=True)))
        if pairs:
            found.update(zip((i for i, _ in pairs), tok.tokenize_pairs([p for _, p in pairs])))
        return [found[i] for i in range(len(items))]

    chars = sum(len(s) if isinstance(s, str) else len(s[0]) + len(s[1]) for s in items)
    try:  # always cut (the Encoded says whether it was), so a refusal names the input at fault
        encoded = await asyncio.to_thread(tokenize) if chars > _OFFLOAD_CHARS else tokenize()
    except InputError as e:
        raise InputProblem(f"'{param}': {e}", param=param) from None
    if not truncate:
        cut = next((i for i, e in enumerate(encoded) if e.truncated), None)
        if cut is not None:
            raise InputProblem(f"{param}[{cut}] is longer than the model's max length {model.tokenizer.max_length} "
                               f"tokens (and truncation is off)", param=param)
    logits = (await run_encoded(model, encoded, context, OUTPUT)).astype(np.float32, copy=False)
    if not np.isfinite(logits).all():
        raise NonFiniteOutput(f"model {model.name!r} gave NaN or infinite logits for these inputs (context "
                              f"values far out of range?)")
    return Scored(logits, sum(e.length for e in encoded))


def flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    """A boolean field (null: its default)."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InputProblem(f"'{key}' must be a boolean", param=key)
    return value


def top_n(body: Mapping[str, Any], key: str) -> int | None:
    """``top_n`` / ``top_k``: a positive integer, or absent/null for all."""
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputProblem(f"'{key}' must be a positive integer, got {value!r}", param=key)
    return value


def ranking(scores: np.ndarray) -> list[int]:
    """Indices by descending score; equal scores keep their request order."""
    return [int(i) for i in np.argsort(-scores, kind="stable")]
