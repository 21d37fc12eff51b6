"""A sequence classifier's labels and the activation each answer applies (cross-encoders, sentiment classifiers).

A model with one label is a reranker (a relevance logit, as ms-marco cross-encoders); with several, a
classifier. Activations follow the references: a reranker's score is the sigmoid of its logit
(sentence-transformers' CrossEncoder default for one label; identity when the folder's config names
``torch.nn.Identity`` as its CrossEncoder ``activation_fn``), a classifier's scores are the softmax over its
labels (sigmoid per label when ``problem_type`` is ``multi_label_classification``, as transformers'
text-classification pipeline does), and ``raw_scores`` gives the logits themselves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: What the folder's config may name as CrossEncoder's activation (``sentence_transformers.activation_fn``).
_IDENTITY = "torch.nn.modules.linear.Identity"


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


def read_labels(info, tokenizer_folder: Path, width: Any) -> Labels | None:
    """A classifier's labels from the export's recorded config (a foreign file: ``config.json`` beside its
    tokenizer), ``LABEL_i`` where it names none, as transformers does; None when nothing states a width."""
    recorded = (info.config or {}).get("hf_config") if info is not None else None
    hf: dict[str, Any] = recorded if isinstance(recorded, dict) else _json_object(tokenizer_folder / "config.json")
    stated = hf.get("id2label")
    id2label: dict[Any, Any] = stated if isinstance(stated, dict) else {}
    count = width if isinstance(width, int) else len(id2label) or hf.get("num_labels")
    if not isinstance(count, int) or count < 1:
        return None  # a width nothing states: not servable as labels
    names = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count))
    stated = hf.get("sentence_transformers")
    st: dict[str, Any] = stated if isinstance(stated, dict) else {}
    activation = st.get("activation_fn") or hf.get("sbert_ce_default_activation_function") or ""
    return Labels(names, hf.get("problem_type") == "multi_label_classification", activation == _IDENTITY)


def _json_object(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # labels then default to LABEL_i; the model still serves
    return data if isinstance(data, dict) else {}
