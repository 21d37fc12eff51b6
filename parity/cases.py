"""The inputs of a parity check: :class:`Case` (batch x seq with right-padded rows of different
lengths), the default cases clipped into the profiles, ``--case`` parsing, and
:class:`ParityDataLoader`, a Polygraphy data loader giving one feed dict per case.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from attnx.contract import BATCH, SEQ, ContractError, Role, TensorEntry


class ParityError(ContractError):
    """A user-fixable problem setting up a parity check (one line)."""


@dataclass(frozen=True)
class Case:
    batch: int
    seq: int
    lengths: tuple[int, ...]  # valid tokens per row (right padding)

    def label(self) -> str:
        return f"{self.batch}x{self.seq}"

    def to_json(self) -> dict:
        return {"batch": self.batch, "seq": self.seq, "lengths": list(self.lengths)}


#: (batch, seq) tried by default, clipped to the profiles: none is the export example (2x8).
DEFAULT_SHAPES = ((1, 5), (2, 16), (3, 33), (4, 64), (1, 1))


def _lengths(batch: int, seq: int) -> tuple[int, ...]:
    # Row 0 full; the others shorter and different from each other (>= 1 token each).
    return tuple([seq] + [max(1, (seq * (batch - i)) // (batch + 1)) for i in range(1, batch)])


def check_in_profile(batch: int, seq: int, profiles: Mapping[str, Sequence[int]], where: str) -> None:
    for axis, value in ((BATCH, batch), (SEQ, seq)):
        rng = profiles.get(axis)
        if rng is not None and not int(rng[0]) <= value <= int(rng[2]):
            raise ParityError(f"case {batch}x{seq}: {axis} {value} is outside the {where} profile "
                              f"{axis}={rng[0]}..{rng[2]}")


def _clip(value: int, axis: str, profiles: Mapping[str, Sequence[int]]) -> int:
    rng = profiles.get(axis)
    return value if rng is None else min(max(value, int(rng[0])), int(rng[2]))


def default_cases(profiles: Mapping[str, Sequence[int]] | None) -> list[Case]:
    """The default cases clipped into ``profiles`` (``{"batch": (min, opt, max), "seq": ...}``)."""
    profiles = profiles or {}
    out: list[Case] = []
    for b, s in DEFAULT_SHAPES:
        b, s = _clip(b, BATCH, profiles), _clip(s, SEQ, profiles)
        case = Case(b, s, _lengths(b, s))
        if case not in out:
            out.append(case)
    return out


def parse_cases(items: Iterable[str], profiles: Mapping[str, Sequence[int]] | None = None,
                where: str = "model's") -> list[Case]:
    """``["2x16", "3x33"]`` (batch x seq) -> cases; each must lie inside ``profiles``."""
    out = []
    for item in items:
        for part in str(item).replace(",", " ").split():
            b, sep, s = part.lower().partition("x")
            if not sep or not b.isdigit() or not s.isdigit() or int(b) < 1 or int(s) < 1:
                raise ParityError(f"--case {part!r}: expected BATCHxSEQ with positive integers, e.g. 2x16")
            if profiles:
                check_in_profile(int(b), int(s), profiles, where)
            out.append(Case(int(b), int(s), _lengths(int(b), int(s))))
    return out


class ParityDataLoader:
    """A Polygraphy data loader: one feed dict per :class:`Case` (values from
    ``attnx.export.exporter.example_inputs``, the attention mask right-padded to each row's length,
    floats in the file's dtype). Random access, so Polygraphy can reload inputs."""

    def __init__(self, model, inputs: Sequence[TensorEntry], cases: Sequence[Case], seed: int = 0):
        self.model = model
        self.inputs = list(inputs)
        self.cases = list(cases)
        self.seed = seed
        self._cache: dict[int, OrderedDict] = {}

    def __len__(self) -> int:
        return len(self.cases)

    def __getitem__(self, index: int) -> OrderedDict:
        if index >= len(self.cases) or index < -len(self.cases):
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
        feeds = example_inputs(self.model, batch=case.batch, seq=case.seq, seed=self.seed + 1000 + index)
        out: OrderedDict[str, np.ndarray] = OrderedDict()
        for entry in self.inputs:
            arr: Any = feeds[entry.name].numpy()
            if entry.role == Role.ATTENTION_MASK:
                arr = np.zeros((case.batch, case.seq), dtype=np.int64)
                for row, n in enumerate(case.lengths):
                    arr[row, :n] = 1
            out[entry.name] = np.ascontiguousarray(arr.astype(np.dtype(entry.dtype)))
        return out
