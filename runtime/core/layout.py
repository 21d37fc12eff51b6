"""How requests merge into one batch and split back: the batch and seq axes of every input and output.

:class:`BatchLayout` is read off a session's specs: which requests may share a run (their "batch key"), whether
shorter ones may be padded (only when padded positions can be masked out and every output's dynamic dims are
known), and how a merged batch's outputs go back to each request, cut to its own length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from attnx.contract import BATCH, SEQ, Role
from attnx.runtime.core.session import InputError, Session, TensorSpec


@dataclass
class Prepared:
    """One request's feeds, checked, with what the batcher needs to place it."""

    feeds: dict[str, np.ndarray]
    rows: int
    length: int | None
    key: tuple


class BatchLayout:
    """Where the batch and seq axes are for every input and output of a session, and what padding is.

    ``pad_values``: the value padded positions of an input get (default 0; token ids take the
    tokenizer's pad id, see :func:`pad_values`)."""

    def __init__(self, inputs: list[TensorSpec], outputs: list[TensorSpec],
                 pad_values: Mapping[str, int | float] | None = None):
        self.inputs = inputs
        self.outputs = outputs
        self.pad_values = dict(pad_values or {})
        self.mask = next((s for s in inputs if s.role == Role.ATTENTION_MASK), None)
        # A head mask has no batch axis: requests with the same value share a run (its bytes join the key).
        self.shared = [s.name for s in inputs if s.batch_axis is None and s.role == Role.HEAD_MASK]
        # Batching is only safe when every other tensor has a batch axis to split along.
        self.unbatchable = [s.name for s in inputs + outputs if s.batch_axis is None and s.name not in self.shared]
        self.can_batch = not self.unbatchable
        # Padding is only safe when padded positions can be masked out, and every output's
        # dynamic dims are known (one that follows the padded length could not be cut back).
        self.unknown_output_dims = [s.name for s in outputs
                                    if any(isinstance(d, str) and d not in (BATCH, SEQ) for d in s.shape)]
        self.can_pad = self.mask is not None and self.mask.seq_axis is not None and not self.unknown_output_dims

    @classmethod
    def of(cls, session: Session, pad_id: int | None = None) -> "BatchLayout":
        return cls(session.inputs, session.outputs, pad_values(session.inputs, pad_id))

    def verdict(self) -> str:
        """How requests to this model are batched, in one sentence (for ``--describe`` and warnings)."""
        if not self.can_batch:
            return (f"served unbatched (one request per run): no batch axis found for {self.unbatchable}; "
                    f"name it with --batch-axis NAME=AXIS to batch")
        if self.can_pad and self.mask is not None:  # can_pad implies a mask
            return f"batched and padded: shorter requests are padded and masked with {self.mask.name!r}"
        if not any(s.seq_axis is not None for s in self.inputs):
            return "batched (no sequence axis)"
        why = (f"outputs {self.unknown_output_dims} have dynamic dims of unknown meaning"
               if self.unknown_output_dims else "the model has no attention-mask input")
        return f"batched across equal lengths only, never padded: {why}"

    def prepare(self, feeds: dict[str, np.ndarray]) -> Prepared:
        """Rows, length and batch key of already-checked feeds."""
        rows = length = None
        key: list[Any] = []
        for spec in self.inputs:
            arr = feeds[spec.name]
            if spec.name in self.shared:
                key.append((spec.name, arr.shape, arr.tobytes()))
                continue
            b, s = spec.batch_axis, spec.seq_axis
            if b is not None:
                rows = arr.shape[b] if rows is None else rows
            if s is not None:
                length = arr.shape[s] if length is None else length
            other = tuple(d for axis, d in enumerate(arr.shape) if axis not in (b, s))
            key.append((spec.name, other))
        if rows is None:
            rows = 1
        if rows < 1:
            raise InputError("a request needs at least one row (batch >= 1)")
        if length is not None and length < 1:
            raise InputError("a request needs at least one token (seq >= 1)")
        if not self.can_pad:
            key.append(("seq", length))
        return Prepared(feeds, rows, length, tuple(key))

    def merge(self, items: list[Prepared]) -> tuple[dict[str, np.ndarray], int | None]:
        """Pad every request to the longest length and concatenate along batch."""
        if len(items) == 1:
            return items[0].feeds, items[0].length
        lengths = [p.length for p in items if p.length is not None]
        longest = max(lengths) if lengths else None
        total = sum(p.rows for p in items)
        merged: dict[str, np.ndarray] = {}
        for spec in self.inputs:
            first = items[0].feeds[spec.name]
            if spec.name in self.shared:  # equal in every request (the batch key)
                merged[spec.name] = first
                continue
            b, s = spec.batch_axis, spec.seq_axis
            assert b is not None, "merged only when every other input has a batch axis (can_batch)"
            shape = list(first.shape)
            shape[b] = total
            if s is not None:
                shape[s] = longest
            # Mask 0 = "not a token"; every other seq input's padded positions only ever meet
            # masked keys or discarded query rows, so any in-range value (the pad id) does.
            out = np.full(shape, self.pad_values.get(spec.name, 0), dtype=first.dtype)
            offset = 0
            for p in items:
                arr = p.feeds[spec.name]
                index: list[slice] = [slice(None)] * arr.ndim
                index[b] = slice(offset, offset + p.rows)
                if s is not None:
                    index[s] = slice(0, arr.shape[s])
                out[tuple(index)] = arr
                offset += p.rows
            merged[spec.name] = out
        return merged, longest

    def split(self, outputs: dict[str, np.ndarray], items: list[Prepared]) -> list[dict[str, np.ndarray]]:
        """Each request's rows back, each seq axis cut back to the request's own length."""
        if len(items) == 1:
            return [outputs]
        results: list[dict[str, np.ndarray]] = [{} for _ in items]
        specs = {s.name: s for s in self.outputs}
        for name, arr in outputs.items():
            spec = specs[name]
            b = spec.batch_axis
            assert b is not None, "split only when every output has a batch axis (can_batch)"
            seq_axes = [axis for axis, d in enumerate(spec.shape) if d == SEQ]  # [.., seq, seq]: both
            offset = 0
            for i, p in enumerate(items):
                index: list[slice] = [slice(None)] * arr.ndim
                index[b] = slice(offset, offset + p.rows)
                for s in seq_axes if p.length is not None else ():
                    index[s] = slice(0, p.length)
                # A copy, so a caller holding its result does not pin the whole batch.
                results[i][name] = np.ascontiguousarray(arr[tuple(index)])
                offset += p.rows
        return results


def pad_values(inputs: list[TensorSpec], pad_id: int | None) -> dict[str, int]:
    """What padded positions hold: ``pad_id`` for token ids (when known), 0 for everything else."""
    if pad_id is None:
        return {}
    from attnx.runtime.core.model_checks import check_pad_id

    ids = [s for s in inputs if s.role == Role.INPUT_IDS]
    for spec in ids:  # every padded batch feeds it to the embedding table
        check_pad_id(spec, int(pad_id), f"input {spec.name!r}")
    return {s.name: int(pad_id) for s in ids}
