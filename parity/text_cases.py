"""The real-text inputs of a pretrained export's parity check.

- :func:`default_texts`: attnx's built-in real sentences (:data:`attnx.pretrained.sentences.SENTENCES`)
  plus two passages joined from them, one of 129-256 tokens (where a tokenizer file that truncates
  at 128 by itself, as all-MiniLM-L6-v2's does, would differ from sentence-transformers) and one
  past the export's maximum length (truncation);
- :class:`ExportTokenizer`: the tokenizer files that travel beside the export (``attnx.tokenizer``),
  read with the ``tokenizers`` library, truncating at the export's ``max_length`` on its recorded
  side, the file's own padding switched off (the batch is padded here, with ``pad_id``, and masked);
- :func:`text_cases`: the texts in batches that fit the profiles (:class:`TextCase`);
- :class:`TextDataLoader`: a Polygraphy data loader, one feed dict per batch (context inputs from
  the variant's example values, a head mask of ones).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from attnx.contract import BATCH, SEQ, ContractError, ModelInfo, Role, TensorEntry, contained
from attnx.parity.cases import ParityError

#: Rows per batch at most (then the profile's own maximum): two batches of the built-in texts,
#: each padded to its longest row.
BATCH_ROWS = 8


def default_texts() -> list[str]:
    from attnx.pretrained.sentences import SENTENCES

    return [*SENTENCES, " ".join(SENTENCES), " ".join(SENTENCES * 2)]


@dataclass(frozen=True)
class Encoded:
    ids: tuple[int, ...]
    type_ids: tuple[int, ...]
    truncated: bool


class ExportTokenizer:
    """The export's own tokenizer (see the module doc); ``max_length`` and ``pad_id`` from its metadata."""

    def __init__(self, model_path: str | os.PathLike, info: ModelInfo):
        from tokenizers import Tokenizer

        meta = info.tokenizer or {}
        if not meta.get("dir"):
            raise ParityError(f"{Path(model_path).name} names no tokenizer (attnx.tokenizer): re-export it with "
                              "`attnx export --from-pretrained`")
        try:
            folder = contained(Path(model_path).parent, str(meta["dir"]), "the tokenizer folder named by attnx.tokenizer")
            path = contained(folder, str(meta.get("file") or "tokenizer.json"), "the tokenizer file named by attnx.tokenizer")
            self.max_length = int(meta["max_length"])
            self.pad_id = int(meta.get("pad_id", 0))
        except ContractError as e:
            raise ParityError(str(e)) from None
        except (KeyError, TypeError, ValueError) as e:
            raise ParityError(f"bad attnx.tokenizer metadata in {Path(model_path).name} ({e!r})") from None
        side = str(meta.get("truncation_side", "right"))
        if side not in ("left", "right") or self.max_length < 1:
            raise ParityError(f"bad attnx.tokenizer metadata in {Path(model_path).name}: truncation_side {side!r}, "
                              f"max_length {self.max_length}")
        if not path.is_file():
            raise ParityError(f"the tokenizer file {path} named by {Path(model_path).name} is missing (it is written "
                              "beside the export by `attnx export --from-pretrained`)")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception type on bad JSON
            raise ParityError(f"cannot read the tokenizer {path}: {' '.join(str(e).split())[:160]}") from None
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(self.max_length, direction=side)
        self.path, self.side = path, side

    def encode(self, texts: Sequence[str]) -> list[Encoded]:
        return [Encoded(tuple(e.ids), tuple(e.type_ids), bool(e.overflowing))
                for e in self.tokenizer.encode_batch(list(texts))]

    def to_json(self) -> dict:
        return {"path": str(self.path), "max_length": self.max_length, "truncation_side": self.side,
                "pad_id": self.pad_id}


@dataclass(frozen=True)
class TextCase:
    """One batch: the indices of its texts (into the checked text list) and their token counts."""

    indices: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def batch(self) -> int:
        return len(self.indices)

    @property
    def seq(self) -> int:
        return max(self.lengths)

    def label(self) -> str:
        return f"{self.batch}x{self.seq}"


def text_cases(encoded: Sequence[Encoded], profiles: Mapping[str, Sequence[int]],
               where: str = "model's") -> tuple[list[TextCase], list[int]]:
    """``(batches, left_out)``: the texts in order, at most ``min(BATCH_ROWS, batch max)`` rows per
    batch; texts longer than the profile's ``seq`` max (an engine built for shorter inputs) are left
    out and listed. Padding makes every batch shorter than its longest row's."""
    max_rows = min(BATCH_ROWS, int(profiles.get(BATCH, (1, 1, BATCH_ROWS))[2]))
    seq_lo, seq_hi = (int(v) for v in (profiles.get(SEQ, (1, 1, 1 << 30))[0], profiles.get(SEQ, (1, 1, 1 << 30))[2]))
    batch_lo = int(profiles.get(BATCH, (1, 1, 1))[0])
    fit = [i for i, e in enumerate(encoded) if len(e.ids) <= seq_hi]
    left_out = [i for i in range(len(encoded)) if i not in fit]
    if not fit:
        raise ParityError(f"no text fits the {where} profile seq<={seq_hi}")
    cases = []
    for start in range(0, len(fit), max_rows):
        rows = fit[start:start + max_rows]
        cases.append(TextCase(tuple(rows), tuple(len(encoded[i].ids) for i in rows)))
    for case in cases:
        if case.batch < batch_lo or max(case.seq, seq_lo) > seq_hi:
            raise ParityError(f"the texts cannot be batched inside the {where} profile (batch>={batch_lo}, "
                              f"seq {seq_lo}..{seq_hi})")
    return cases, left_out


class TextDataLoader:
    """A Polygraphy data loader: one feed per :class:`TextCase`. Token ids right-padded with the
    tokenizer's ``pad_id`` (seq padded up to the profile's minimum where it has one), mask 1 on real
    tokens, the other inputs from ``attnx.export.exporter.example_inputs`` (the variant's context
    at its example values, seeded; a head mask of ones), floats in the file's dtype."""

    def __init__(self, model, inputs: Sequence[TensorEntry], cases: Sequence[TextCase], encoded: Sequence[Encoded],
                 pad_id: int, seq_min: int = 1, seed: int = 0):
        self.model, self.inputs, self.cases = model, list(inputs), list(cases)
        self.encoded, self.pad_id, self.seq_min, self.seed = list(encoded), int(pad_id), int(seq_min), seed
        self._cache: dict[int, OrderedDict] = {}

    def __len__(self) -> int:
        return len(self.cases)

    def __getitem__(self, index: int) -> OrderedDict:
        if not -len(self.cases) <= index < len(self.cases):
            raise IndexError(index)
        index %= len(self.cases)
        if index not in self._cache:
            self._cache[index] = self._make(index)
        return OrderedDict((k, v.copy()) for k, v in self._cache[index].items())

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def _make(self, index: int) -> OrderedDict:
        from attnx.export.exporter import example_inputs

        case = self.cases[index]
        batch, seq = case.batch, max(case.seq, self.seq_min)
        feeds = example_inputs(self.model, batch=batch, seq=seq, seed=self.seed + 1000 + index)
        ids = np.full((batch, seq), self.pad_id, dtype=np.int64)
        types = np.zeros((batch, seq), dtype=np.int64)
        mask = np.zeros((batch, seq), dtype=np.int64)
        for row, i in enumerate(case.indices):
            n = len(self.encoded[i].ids)
            ids[row, :n], types[row, :n], mask[row, :n] = self.encoded[i].ids, self.encoded[i].type_ids, 1
        text_inputs = {Role.INPUT_IDS: ids, Role.TOKEN_TYPE_IDS: types, Role.ATTENTION_MASK: mask}
        out: OrderedDict[str, np.ndarray] = OrderedDict()
        for entry in self.inputs:
            arr = text_inputs[entry.role] if entry.role in text_inputs else feeds[entry.name].numpy()
            out[entry.name] = np.ascontiguousarray(arr.astype(np.dtype(entry.dtype)))
        return out
