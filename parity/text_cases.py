"""The real-text inputs of a pretrained export's parity check.

- :func:`default_texts`: attnx's built-in real sentences (:data:`attnx.pretrained.sentences.SENTENCES`)
  plus two passages joined from them, one of 129-256 tokens (where a tokenizer file that truncates
  at 128 by itself, as all-MiniLM-L6-v2's does, would differ from sentence-transformers) and one
  past the export's maximum length (truncation);
- the texts are tokenised by the export's own tokenizer (:class:`attnx.export.tokenizer.ExportTokenizer`);
  the batch is padded here, with its ``pad_id``, and masked;
- :func:`text_cases`: the texts in batches that fit the profiles (:class:`TextCase`);
- :class:`TextDataLoader`: a Polygraphy data loader, one feed dict per batch (context inputs from
  the variant's example values, a head mask of ones).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

from attnx.contract import BATCH, SEQ, Role, TensorEntry
from attnx.parity.cases import ParityError

if TYPE_CHECKING:  # the export's tokenizer; imported where it runs (attnx.export pulls in torch)
    from attnx.export.tokenizer import TokenizedText

#: Rows per batch at most (then the profile's own maximum): two batches of the built-in texts,
#: each padded to its longest row.
BATCH_ROWS = 8


def default_texts() -> list[str]:
    from attnx.pretrained.sentences import SENTENCES

    return [*SENTENCES, " ".join(SENTENCES), " ".join(SENTENCES * 2)]


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


def text_cases(encoded: Sequence[TokenizedText], profiles: Mapping[str, Sequence[int]],
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

    def __init__(self, model, inputs: Sequence[TensorEntry], cases: Sequence[TextCase], encoded: Sequence[TokenizedText],
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
