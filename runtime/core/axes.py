"""Which axis of each input and output is the batch axis and which the sequence axis, for any ONNX file.

The batcher pads and merges requests only along axes it knows (``"batch"`` / ``"seq"`` in a
:class:`~attnx.runtime.core.session.TensorSpec`'s shape). attnx exports name them so (or say so in their metadata);
other exporters name them ``batch_size`` / ``sequence_length`` (transformers, Optimum, torch.onnx), ``N``,
``seq_len``, ... or leave them anonymous. :func:`resolve_axes` decides, per tensor and in this order:

1. flags (``attnx serve --batch-axis input_ids=0 --seq-axis 1``; a bare axis applies to every tensor whose dim there
   is dynamic);
2. the names attnx writes (``batch`` / ``seq``, from the file or its ``attnx.*`` metadata);
3. common names (:data:`BATCH_NAMES`, :data:`SEQ_NAMES`, case-insensitive);
4. for outputs, a dim with the same name as an input's batch or sequence dim.

Whatever stays undecided is left as it is; :class:`~attnx.runtime.core.batcher.BatchLayout` then serves the model
unbatched (a tensor without a batch axis) or without padding (an output with an unknown dynamic dim), never wrongly.
:func:`describe_axes` prints the decisions (``attnx serve --describe``).

:func:`infer_id_ranges` gives token-id inputs of foreign files their ``[0, vocab)`` range from the embedding table
they index, so a bad id is refused before it joins a batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

from attnx.contract import BATCH, SEQ, Role
from attnx.runtime.core.session import ID_ROLES, Session, TensorSpec

#: Dynamic dim names read as the batch axis (compared lower-case).
BATCH_NAMES = frozenset({"batch", "batch_size", "batchsize", "bs", "b", "n", "num_sequences"})
#: Dynamic dim names read as the sequence axis (compared lower-case).
SEQ_NAMES = frozenset({"seq", "sequence", "sequence_length", "sequence_len", "seq_len", "seq_length", "seqlen",
                       "length", "len", "l", "num_tokens", "tokens", "text_length"})


class AxisError(ValueError):
    """A ``--batch-axis`` / ``--seq-axis`` flag that does not fit the model (one line)."""


@dataclass
class AxisFlags:
    """Axes given by the user: ``{tensor name or None (every tensor): axis}`` for each kind."""

    batch: dict[str | None, int] = field(default_factory=dict)
    seq: dict[str | None, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, batch: list[str] | None = None, seq: list[str] | None = None) -> "AxisFlags":
        """``["input_ids=0", "1"]`` -> ``{"input_ids": 0, None: 1}`` for each flag."""
        return cls(_parse_flag(batch or [], "--batch-axis"), _parse_flag(seq or [], "--seq-axis"))

    def __bool__(self) -> bool:
        return bool(self.batch or self.seq)


def _parse_flag(items: list[str], flag: str) -> dict[str | None, int]:
    out: dict[str | None, int] = {}
    for item in items:
        for part in str(item).split(","):
            part = part.strip()
            if not part:
                continue
            name, sep, axis = part.rpartition("=")
            if not axis.strip().isdigit():
                raise AxisError(f"{flag} {part!r}: expected AXIS or NAME=AXIS with a non-negative integer axis")
            out[name.strip() if sep else None] = int(axis)
    return out


@dataclass(frozen=True)
class AxisDecision:
    """What :func:`resolve_axes` decided for one tensor, and why (for ``--describe``)."""

    name: str
    is_input: bool
    file_shape: tuple
    batch: int | None
    batch_why: str
    seq: int | None
    seq_why: str


def _dynamic(d) -> bool:
    return not isinstance(d, int)


def _pick(spec: TensorSpec, kind: str, flags: Mapping[str | None, int], own: str, aliases: frozenset,
          linked: Mapping[str, str], taken: int | None) -> tuple[int | None, str]:
    """The axis of one kind (batch or seq) for one tensor, and the reason."""
    dims = spec.shape
    if spec.name in flags:
        axis = flags[spec.name]
        if axis >= len(dims):
            raise AxisError(f"--{kind}-axis {spec.name}={axis}: {spec.name} has rank {len(dims)}")
        if not _dynamic(dims[axis]):
            raise AxisError(f"--{kind}-axis {spec.name}={axis}: that dim of {spec.name} is fixed ({dims[axis]})")
        if axis == taken:
            raise AxisError(f"--{kind}-axis {spec.name}={axis}: that dim is already the other axis")
        return axis, "flag"
    if None in flags:
        axis = flags[None]
        if axis < len(dims) and _dynamic(dims[axis]) and axis != taken:
            return axis, "flag"
    candidates = [(i, "attnx axis name") for i, d in enumerate(dims) if d == own]
    if not candidates:
        candidates = [(i, f"dim name {d!r}") for i, d in enumerate(dims)
                      if isinstance(d, str) and d.lower() in aliases]
    if not candidates:
        candidates = [(i, f"same dim as input {linked[d]!r}") for i, d in enumerate(dims)
                      if isinstance(d, str) and d in linked]
    candidates = [c for c in candidates if c[0] != taken]
    if len(candidates) == 1:
        return candidates[0]
    if len(candidates) > 1 and all(why == "attnx axis name" for _, why in candidates):
        return candidates[0][0], "attnx axis name (every such dim is the sequence, e.g. an attention map)"
    if len(candidates) > 1:
        return None, f"ambiguous: dims {[c[0] for c in candidates]} all look like the {kind} axis"
    return None, "none found"


def resolve_axes(inputs: list[TensorSpec], outputs: list[TensorSpec], flags: AxisFlags | None = None
                 ) -> tuple[list[TensorSpec], list[TensorSpec], list[AxisDecision]]:
    """Specs with their batch and sequence dims renamed ``"batch"`` / ``"seq"``, and the decisions."""
    flags = flags or AxisFlags()
    known = {s.name for s in inputs + outputs}
    for kind, given in (("batch", flags.batch), ("seq", flags.seq)):
        unknown = sorted(n for n in given if n is not None and n not in known)
        if unknown:
            raise AxisError(f"--{kind}-axis names {unknown}, which the model does not have; it has {sorted(known)}")
    linked: dict[str, dict[str, str]] = {BATCH: {}, SEQ: {}}  # an input's original dim name -> that input
    decisions: list[AxisDecision] = []
    resolved: list[list[TensorSpec]] = [[], []]
    for group, specs in enumerate((inputs, outputs)):
        for spec in specs:
            b, b_why = _pick(spec, "batch", flags.batch, BATCH, BATCH_NAMES, linked[BATCH] if group else {}, None)
            s, s_why = _pick(spec, "seq", flags.seq, SEQ, SEQ_NAMES, linked[SEQ] if group else {}, b)
            shape = list(spec.shape)
            for axis, role in ((b, BATCH), (s, SEQ)):
                if axis is None:
                    continue
                dim = shape[axis]
                if group == 0 and isinstance(dim, str) and dim not in (BATCH, SEQ, "?"):
                    linked[role].setdefault(dim, spec.name)
                shape[axis] = role
            # A name the file used for another dim must not read as batch/seq any more.
            shape = [d if i in (b, s) or d not in (BATCH, SEQ) or (d == SEQ and s is not None
                                                                  and spec.shape[i] == SEQ == spec.shape[s])
                     else "?" for i, d in enumerate(shape)]
            resolved[group].append(dataclasses.replace(spec, shape=tuple(shape)))
            decisions.append(AxisDecision(spec.name, group == 0, tuple(spec.shape), b, b_why, s, s_why))
    return resolved[0], resolved[1], decisions


def apply_axes(session: Session, flags: AxisFlags | None = None) -> Session:
    """Resolve ``session``'s axes in place (its specs), record the decisions on it, and give the token-id
    inputs of a file without attnx metadata their table's range. Returns the session."""
    inputs, outputs, decisions = resolve_axes(session.inputs, session.outputs, flags)
    if session.info is None and str(session.path).lower().endswith(".onnx"):
        ranges = infer_id_ranges(session.path, [s.name for s in inputs if s.role in ID_ROLES and s.range is None])
        inputs = [dataclasses.replace(s, range=ranges[s.name]) if s.name in ranges else s for s in inputs]
    session.inputs, session.outputs = inputs, outputs
    session.axis_decisions = decisions
    return session


def infer_id_ranges(path, names: list[str]) -> dict[str, tuple[int, int]]:
    """``{input: (0, rows)}`` for each of ``names`` that a ``Gather`` uses directly as indices into an
    initializer (an embedding table of ``rows`` rows). The file is read without its weights."""
    if not names:
        return {}
    from attnx.runtime.core.onnx_outline import graph_outline

    tables, gathers = graph_outline(path)
    found: dict[str, tuple[int, int]] = {}
    for data, indices, axis in gathers:
        if indices in names and axis == 0 and data in tables:
            found.setdefault(indices, (0, tables[data]))
    return found


def describe_axes(decisions: list[AxisDecision], specs: list[TensorSpec]) -> list[str]:
    """One line per tensor: its dims in the file, then the batch and sequence axes and why."""
    by_name = {s.name: s for s in specs}
    lines = []
    for d in decisions:
        spec = by_name[d.name]
        dims = ", ".join(str(x) for x in d.file_shape)
        batch = f"batch={d.batch} ({d.batch_why})" if d.batch is not None else f"batch: - ({d.batch_why})"
        seq = f"seq={d.seq} ({d.seq_why})" if d.seq is not None else "seq: -"
        extra = ""
        if spec.range is not None:
            extra = f"  ids in [{spec.range[0]}, {spec.range[1]})"
        if spec.role == Role.ATTENTION_MASK:
            extra += "  (attention mask)"
        lines.append(f"  {'in ' if d.is_input else 'out'} {d.name} [{dims}]: {batch}, {seq}{extra}")
    return lines
