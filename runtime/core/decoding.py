"""Running a with-past export step by step, for one sequence or a batch of them (no torch).

A with-past file (``attnx export --with-past``) names every cached tensor in its ``attnx.cache`` metadata:
its input ``past_key_values.{i}.<name>``, its output ``present.{i}.<name>`` and the axis that grows
(None for a carried summary such as maw's pool). :class:`Decoder` drives any :class:`Session` of such a
file (ONNX Runtime or a TensorRT engine) with :class:`DecodeState` s:

- :meth:`Decoder.start` runs a prompt (prefill) from a cache of one masked slot (``attention_mask`` 0
  there: it is never attended, and no tensor is ever empty, as engine profiles need);
- :meth:`Decoder.step` runs one new token per row of a batch;
- :meth:`Decoder.merge` puts sequences of different lengths in one batch: each row's cache is padded on
  the left with masked slots (exact: a masked key gets no weight, positions come from each row's own
  count), and :meth:`Decoder.select` takes rows out again, dropping slots no row uses any more.

That is the step-level batching of :mod:`attnx.runtime.core.scheduler`: a batch of rows decodes one token each
per run, a row that finishes leaves, a request that arrives joins after its prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from pathlib import Path

from attnx.contract import ContractError, ModelInfo, Role, contained
from attnx.runtime.core.session import InputError, Session


class NotAGenerator(ValueError):
    """A file that cannot generate (no KV cache in its signature)."""


@dataclass(frozen=True)
class CacheTensor:
    input: str
    output: str
    axis: int | None  # the axis that grows (None: a carried summary)


@dataclass(frozen=True)
class CacheLayout:
    """What ``attnx.cache`` says about a with-past file."""

    tensors: tuple[CacheTensor, ...]
    position_ids: bool
    eos: tuple[int, ...]
    bos: int | None
    max_positions: int

    @classmethod
    def of(cls, session: Session) -> "CacheLayout":
        info, _ = source_info(session)
        cache = info.cache if info is not None else None
        if not cache:
            raise NotAGenerator(f"{session.path.name} has no KV cache in its signature, so it cannot generate: "
                                "export it with `attnx export --from-pretrained DIR --with-past`")
        tensors = tuple(CacheTensor(e["input"], e["output"], e.get("axis")) for e in cache.get("entries", []))
        names = set(session.input_names)
        missing = [t.input for t in tensors if t.input not in names]
        if missing or "logits" not in session.output_names:
            raise NotAGenerator(f"{session.path.name}: its attnx.cache metadata names {missing[:1] or ['logits']}, "
                                "which the file does not have (the metadata was changed; re-export it)")
        return cls(tensors, bool(cache.get("position_ids")), tuple(int(e) for e in cache.get("eos_token_id") or ()),
                   cache.get("bos_token_id"), int(cache.get("max_positions") or 0))


#: ONNX Runtime settings for a with-past export (``attnx.runtime.load`` applies them; a caller's options win).
#: Decoding runs one short step after another, so pool threads that spin between ops are never idle for
#: long, and ORT's own fusions of the decoder's RMSNorm + residual help: measured on the 8-layer Llama of
#: ``benchmarks/bench_generation.py`` (2 threads, interleaved), 6.08 -> 5.26 ms/token, onnxruntime-genai's
#: 5.28 on the same file (which runs ORT with its defaults too).
DECODING_ORT_OPTIONS = {"spin": True, "disabled_optimizers": ()}


def decoding_options(path: Path) -> dict:
    """:data:`DECODING_ORT_OPTIONS` when ``path`` is a with-past export: the ``genai_config.json`` attnx writes
    beside one names it (a settings choice only, so the file's own word is enough; read without the model)."""
    config = path.parent / "genai_config.json"
    if not config.is_file():
        return {}
    try:
        import json

        named = json.loads(config.read_text())["model"]["decoder"]["filename"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return dict(DECODING_ORT_OPTIONS) if named == path.name else {}


def source_info(session: Session):
    """``(ModelInfo, the file it came from)``: the session's own metadata, or for an engine, whose sidecar holds
    no ``attnx.*`` keys, that of the ONNX its sidecar names (beside it: file contents never lead elsewhere)."""
    if session.info is not None:
        return session.info, session.path
    sidecar = getattr(session, "sidecar", None) or {}
    for name in (sidecar.get("onnx_name"), sidecar.get("onnx")):
        if not name:
            continue
        try:
            path = contained(session.path.parent, Path(str(name)).name, "the ONNX named by the engine's sidecar")
        except ContractError:
            continue
        if path.is_file():
            return ModelInfo.read(path), path
    return None, session.path


@dataclass
class DecodeState:
    """Rows mid-generation: each cached tensor ``[rows, ...]``, ``mask [rows, slots]``, each row's next
    position (its real tokens so far) and its context inputs ``[rows, ...]``."""

    cache: dict[str, np.ndarray]
    mask: np.ndarray
    positions: np.ndarray
    context: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def slots(self) -> int:
        return int(self.mask.shape[1])


class Decoder:
    """One with-past model, run by prefill and decode steps (module docstring). Thread-safe as its session
    is; a :class:`DecodeState` belongs to one caller at a time."""

    def __init__(self, session: Session):
        self.session = session
        self.layout = CacheLayout.of(session)
        specs = {s.name: s for s in session.inputs}
        self._dtypes = {t.input: np.dtype(specs[t.input].dtype) for t in self.layout.tensors}
        self._shapes = {t.input: specs[t.input].shape for t in self.layout.tensors}
        self._ids = next(s for s in session.inputs if s.role == Role.INPUT_IDS)
        self._mask = next(s for s in session.inputs if s.role == Role.ATTENTION_MASK)
        self.context_inputs = [s for s in session.inputs if s.role == Role.CONTEXT]
        self._outputs = ["logits"] + [t.output for t in self.layout.tensors]
        vocab = next(s for s in session.outputs if s.name == "logits").shape[-1]
        self.vocab_size = vocab if isinstance(vocab, int) else None
        self.max_positions = self.layout.max_positions or None

    # ---- building inputs ------------------------------------------------------------------------
    def _empty(self, rows: int) -> dict[str, np.ndarray]:
        """One masked slot per row (zeros), or a zero summary."""
        out = {}
        for t in self.layout.tensors:
            dims = [rows if i == 0 else 1 if i == t.axis else int(d) for i, d in enumerate(self._shapes[t.input])]
            out[t.input] = np.zeros(dims, dtype=self._dtypes[t.input])
        return out

    def context_row(self, context: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        """A request's context inputs as one batch row each (omitted ones at their declared default)."""
        given = dict(context or {})
        unknown = sorted(set(given) - {s.name for s in self.context_inputs})
        if unknown:
            raise InputError(f"unknown context input(s) {unknown}; the model takes "
                             f"{[s.describe() for s in self.context_inputs] or 'none'}")
        out = {}
        for spec in self.context_inputs:
            value = given.get(spec.name)
            if value is None:
                if spec.default not in ("zeros", "ones"):
                    raise InputError(f"missing context input {spec.describe()}")
                dims = [1 if d == "batch" else d for d in spec.shape]
                if not all(isinstance(d, int) for d in dims):
                    raise InputError(f"context input {spec.name!r} has a per-token axis, which generation cannot "
                                     "extend to the tokens it generates")
                value = np.full(dims, 0 if spec.default == "zeros" else 1, dtype=spec.dtype)
            value = np.asarray(value)
            if value.dtype != spec.dtype:
                if value.dtype.kind == np.dtype(spec.dtype).kind or value.dtype.kind in "iu" and \
                        np.dtype(spec.dtype).kind == "f":
                    value = value.astype(spec.dtype)
                else:
                    raise InputError(f"context input {spec.name!r}: dtype {value.dtype}, expected "
                                     f"{np.dtype(spec.dtype).name}")
            if value.ndim == len(spec.shape) - 1:
                value = value[None]
            if value.ndim != len(spec.shape) or value.shape[0] != 1 or any(
                    isinstance(d, int) and d != g for d, g in zip(spec.shape[1:], value.shape[1:])):
                raise InputError(f"context input {spec.name!r}: shape {list(value.shape)}, expected one row of "
                                 f"{spec.describe()}")
            out[spec.name] = value
        return out

    def _feeds(self, state: DecodeState, ids: np.ndarray, new_mask: np.ndarray) -> dict[str, np.ndarray]:
        n = ids.shape[1]
        feeds = {self._ids.name: ids.astype(self._ids.dtype, copy=False),
                 self._mask.name: np.concatenate([state.mask, new_mask], axis=1).astype(self._mask.dtype, copy=False)}
        if self.layout.position_ids:
            feeds["position_ids"] = (state.positions[:, None] + np.arange(n, dtype=np.int64)[None]).astype(np.int64)
        feeds.update(state.cache)
        feeds.update(state.context)
        return feeds

    def _advance(self, state: DecodeState, feeds, new_tokens: np.ndarray, validate: bool):
        out = self.session.run(feeds, self._outputs) if validate else self.session._run(feeds, self._outputs)
        cache = {t.input: out[t.output] for t in self.layout.tensors}
        mask = feeds[self._mask.name]
        return out["logits"][:, -1], DecodeState(cache, mask, state.positions + new_tokens, state.context)

    # ---- the steps -------------------------------------------------------------------------------
    def start(self, prompt: Sequence[int], context: Mapping[str, np.ndarray] | None = None):
        """Prefill one sequence: ``(logits of its next token [vocab], its state)``."""
        ids = np.asarray(prompt, dtype=np.int64).reshape(1, -1)
        if ids.shape[1] == 0:
            raise InputError("the prompt has no tokens")
        if self.max_positions and ids.shape[1] > self.max_positions:
            raise InputError(f"the prompt has {ids.shape[1]} tokens, more than the model's {self.max_positions} "
                             "positions")
        if self.vocab_size is not None and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise InputError(f"token id {int(ids.max() if ids.max() >= self.vocab_size else ids.min())} is outside "
                             f"the model's vocabulary [0, {self.vocab_size})")
        state = DecodeState(self._empty(1), np.zeros((1, 1), np.int64), np.zeros(1, np.int64),
                            self.context_row(context))
        feeds = self._feeds(state, ids, np.ones_like(ids))
        logits, state = self._advance(state, feeds, np.array([ids.shape[1]]), validate=True)
        return logits[0], state

    def step(self, state: DecodeState, tokens: Sequence[int]):
        """One new token per row: ``(logits [rows, vocab], the state after it)``."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1, 1)
        feeds = self._feeds(state, ids, np.ones_like(ids))
        return self._advance(state, feeds, np.ones(state.rows, np.int64), validate=False)

    # ---- batches ---------------------------------------------------------------------------------
    def merge(self, states: Sequence[DecodeState]) -> DecodeState:
        """One batch of every row of ``states``, each row's cache left-padded with masked slots."""
        states = [s for s in states if s.rows]
        if len(states) == 1:
            return states[0]
        slots = max(s.slots for s in states)

        def pad(arr: np.ndarray, axis: int, by: int) -> np.ndarray:
            if by == 0:
                return arr
            widths = [(0, 0)] * arr.ndim
            widths[axis] = (by, 0)
            return np.pad(arr, widths)

        cache = {}
        for t in self.layout.tensors:
            parts = [s.cache[t.input] if t.axis is None else pad(s.cache[t.input], t.axis, slots - s.slots)
                     for s in states]
            cache[t.input] = np.concatenate(parts, axis=0)
        mask = np.concatenate([pad(s.mask, 1, slots - s.slots) for s in states], axis=0)
        context = {name: np.concatenate([s.context[name] for s in states], axis=0) for name in states[0].context}
        return DecodeState(cache, mask, np.concatenate([s.positions for s in states]), context)

    def select(self, state: DecodeState, rows: Sequence[int]) -> DecodeState:
        """Only ``rows`` of a batch, without the leading slots none of them uses (at least one slot stays)."""
        rows = np.asarray(rows, dtype=np.int64)
        mask = state.mask[rows]
        used = np.flatnonzero(mask.any(axis=0))
        first = min(int(used[0]) if used.size else mask.shape[1] - 1, mask.shape[1] - 1)
        cache = {}
        for t in self.layout.tensors:
            arr = state.cache[t.input][rows]
            if t.axis is not None and first:
                arr = np.take(arr, np.arange(first, arr.shape[t.axis]), axis=t.axis)
            cache[t.input] = arr
        return DecodeState(cache, mask[:, first:], state.positions[rows],
                           {k: v[rows] for k, v in state.context.items()})
