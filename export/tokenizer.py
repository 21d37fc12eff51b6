"""Reading the tokenizer an export carries (``attnx.tokenizer``: the folder and settings that
:func:`attnx.export.pretrained.export_pretrained` writes beside it).

:class:`ExportTokenizer` reads the file with the ``tokenizers`` library, truncating at the export's
``max_length`` on its recorded side, the file's own padding switched off (callers pad the batch
with ``pad_id`` and mask it). int8 calibration (:mod:`attnx.export.quantize`) and the parity check
on real text (:mod:`attnx.parity.text_cases`) tokenise through it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from attnx.contract import ContractError, ModelInfo


@dataclass(frozen=True)
class TokenizedText:
    """One text as the export's tokenizer cut it: ids and segment ids as plain int tuples (hashable, written into
    parity reports as they are), and whether it was cut at the max length. Serving's row of the same facts is
    :class:`attnx.runtime.core.text.Encoded` (numpy int64, what the batcher stacks); export cannot import runtime."""

    ids: tuple[int, ...]
    type_ids: tuple[int, ...]
    truncated: bool


class ExportTokenizer:
    """The export's own tokenizer (see the module doc); ``max_length`` and ``pad_id`` from its metadata
    (:class:`~attnx.contract.TokenizerSettings`, checked when read). A missing tokenizer is a
    :class:`~attnx.contract.ContractError` (one line)."""

    def __init__(self, model_path: str | os.PathLike, info: ModelInfo):
        from tokenizers import Tokenizer

        settings = info.tokenizer
        if settings is None:
            raise ContractError(f"{Path(model_path).name} names no tokenizer (attnx.tokenizer): re-export it with "
                                "`attnx export --from-pretrained`")
        path = settings.path(Path(model_path).parent)
        self.max_length, self.pad_id, self.side = settings.max_length, settings.pad_id, settings.truncation_side
        if not path.is_file():
            raise ContractError(f"the tokenizer file {path} named by {Path(model_path).name} is missing (it is written "
                                "beside the export by `attnx export --from-pretrained`)")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception type on bad JSON
            raise ContractError(f"cannot read the tokenizer {path}: {' '.join(str(e).split())[:160]}") from None
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(self.max_length, direction=self.side)
        self.path = path

    def encode(self, texts: Sequence[str]) -> list[TokenizedText]:
        return [TokenizedText(tuple(e.ids), tuple(e.type_ids), bool(e.overflowing))
                for e in self.tokenizer.encode_batch(list(texts))]

    def to_json(self) -> dict:
        return {"path": str(self.path), "max_length": self.max_length, "truncation_side": self.side,
                "pad_id": self.pad_id}
