"""Sequence-classification exports and their references, shared by the rerank and classify API tests.

Folders are ``tests/hf_folders.py``'s (random weights saved by transformers): ``bert-cross-encoder`` (one
relevance logit, an ms-marco cross-encoder's shape), ``bert-classifier`` (three sentiment labels with
``id2label``) and ``qwen2-classifier`` (a decoder with one logit, pooled at the last token). The BERT
folders' ``tokenizer_config.json`` names ``BertTokenizer``, as real BERT folders do, so
transformers' tokenizer gives segment ids for a pair (a generic ``PreTrainedTokenizerFast`` gives none in
transformers 5, and the reference would then differ from every BERT cross-encoder on the hub). Folders and
exports come from the shared export cache (``tests/support``), so each is made once however many modules use them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import hf_folders  # noqa: E402
from support import exports  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
MAX_LENGTH = hf_folders.POSITIONS  # the folders' model_max_length, which the export and CrossEncoder keep


def _bert_tokenizer_class(path: Path) -> None:
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "BertTokenizer"
    config_file.write_text(json.dumps(config))


def folder(name: str) -> Path:
    """The family's folder (shared: don't change it); WordPiece folders name ``BertTokenizer``."""
    if hf_folders.FAMILIES[name].tokenizer == "wordpiece":
        return exports.hf_folder(name, edit=_bert_tokenizer_class, tag="BertTokenizer")
    return exports.hf_folder(name)


def export(name: str, variant: str = "mha") -> Path:
    """``attnx export --from-pretrained`` of the folder with ``variant`` placed (its ``.onnx``)."""
    return exports.pretrained(folder(name), variant, name=f"{name}-{variant}.onnx").path


def neutral_context(path: Path, rows: int) -> dict[str, list]:
    """The export's context inputs, ``rows`` rows of ones (the placed variants tested here are neutral at
    any context, so the model equals transformers' own), as a request's ``"context"`` carries them."""
    from attnx.contract import Role
    from attnx.runtime import load

    out = {}
    for spec in load(path, device="cpu").inputs:
        if spec.role == Role.CONTEXT:
            shape = [rows if d == "batch" else d for d in spec.shape]
            out[spec.name] = np.ones(shape, np.float32).tolist()
    return out


class Reference:
    """transformers' AutoModelForSequenceClassification and tokenizer on a folder: logits for texts and
    (a, b) pairs, tokenised as sentence-transformers' CrossEncoder does (longest-first to the max length)."""

    def __init__(self, path: Path):
        import transformers

        transformers.logging.set_verbosity_error()
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
        self.model = transformers.AutoModelForSequenceClassification.from_pretrained(
            str(path), attn_implementation="eager").eval()

    def tokens(self, item) -> int:
        batch = [item] if isinstance(item, str) else [list(item)]
        return len(self.tokenizer(batch, truncation="longest_first", max_length=MAX_LENGTH)["input_ids"][0])

    def logits(self, items) -> np.ndarray:
        import torch

        rows = []
        with torch.no_grad():
            for item in items:
                # A batch of one, as CrossEncoder calls it: called with one pair, transformers takes an
                # empty second text for no pair at all.
                batch = [item] if isinstance(item, str) else [list(item)]
                enc = self.tokenizer(batch, truncation="longest_first", max_length=MAX_LENGTH, return_tensors="pt")
                rows.append(self.model(**enc).logits[0].numpy())
        return np.stack(rows).astype(np.float32)


def reference(name: str) -> Reference:
    return Reference(folder(name))


def cross_encoder(name: str):
    """sentence-transformers' CrossEncoder on the folder (it loads a plain transformers folder)."""
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(folder(name)), device="cpu")


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))


def softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x.astype(np.float64) - x.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)
