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

Between steps the cache goes back to the runtime as the runtime left it, so a step copies no cache outside the
graph itself (whose ``present`` is ``past`` + the new position): on the CPU ONNX Runtime returns its own output
buffers as numpy arrays and runs numpy feeds where they lie (no copy either way; ``tests/test_generation.py``
checks the addresses); on a GPU the decoder runs through ONNX Runtime's IOBinding
(:meth:`~attnx.runtime.core.backends.onnxrt.OnnxRuntimeSession.run_keeping`): ``present.*`` stay ``OrtValue`` s on
the device and are bound as the next step's ``past_key_values.*``, only the last position's logits cross to the
host. Only a batch that changes (:meth:`Decoder.merge`, :meth:`Decoder.select`) brings the cache to the host.
Where the load-time rewrite made the attention ONNX Runtime's ``GroupQueryAttention`` (CPU), the graph copies none
either: the cache stays in buffers the kernel writes the new slots into (:mod:`attnx.runtime.core.kv_in_place`).

That is the step-level batching of :mod:`attnx.runtime.core.scheduler`: a batch of rows decodes one token each
per run, a row that finishes leaves, a request that arrives joins after its prefill.

:func:`attnx.runtime.core.prompt_logprobs.score` scores a prompt instead, by a prefill in chunks that feed ``logits_to_keep``
(:mod:`attnx.runtime.core.prompt_logprobs`); the steps above never feed it (the file's default: the last position).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from pathlib import Path

from attnx.contract import ContractError, ModelInfo, Role, contained
from attnx.runtime.core.kv_in_place import InPlaceKv, KvBuffers
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
    logits_to_keep: str | None = None  # the input choosing the positions with logits (None: the last only)

    @classmethod
    def of(cls, session: Session) -> "CacheLayout":
        info, _ = source_info(session)
        cache = info.cache if info is not None else None
        if not cache:
            raise NotAGenerator(_why_not_a_generator(session, info))
        tensors = tuple(CacheTensor(e["input"], e["output"], e.get("axis")) for e in cache.get("entries", []))
        names = set(session.input_names)
        missing = [t.input for t in tensors if t.input not in names]
        if missing or "logits" not in session.output_names:
            raise NotAGenerator(f"{session.path.name}: its attnx.cache metadata names {missing[:1] or ['logits']}, "
                                "which the file does not have (the metadata was changed; re-export it)")
        keep = cache.get("logits_to_keep")
        return cls(tensors, bool(cache.get("position_ids")), tuple(int(e) for e in cache.get("eos_token_id") or ()),
                   cache.get("bos_token_id"), int(cache.get("max_positions") or 0),
                   keep if isinstance(keep, str) else None)


def _why_not_a_generator(session: Session, info) -> str:
    """One line for a file without a KV cache: a causal LM exported without it, or no language model at all."""
    name = session.path.name
    task = ((info.config or {}).get("task") if info is not None else None)
    logits = next((s for s in session.outputs if s.name == "logits"), None)
    if task == "causal-lm" or (task is None and logits is not None and logits.rank == 3):
        return (f"{name} has no KV cache in its signature, so it cannot generate: export it with `attnx export "
                "--from-pretrained DIR --with-past`")
    what = f"a {task} model" if task else "not a causal language model"
    return (f"{name} is {what} (outputs: {', '.join(session.output_names)}), so it cannot generate text: "
            "`attnx generate` runs a causal language model (a ...ForCausalLM folder, or its with-past export)")


#: ONNX Runtime settings for a with-past export (``attnx.runtime.load`` applies them; a caller's options win).
#: Decoding runs one short step after another, so pool threads that spin between ops are never idle for
#: long, and ORT's own fusions of the decoder's RMSNorm + residual help: measured on the 8-layer Llama of
#: ``benchmarks/bench_generation.py`` (2 threads, interleaved), 6.08 -> 5.26 ms/token, onnxruntime-genai's
#: 5.28 on the same file (which runs ORT with its defaults too). ORT's warnings are off (errors stay): the two it
#: gives a with-past export are expected (``logits_to_keep``, an initializer that is also an input, at load; its
#: logits declared ``[batch, 1, vocab]`` for onnxruntime-genai when a prompt is scored: :mod:`attnx.pretrained.cached`).
DECODING_ORT_OPTIONS = {"spin": True, "disabled_optimizers": (), "log_severity": 3}
#: A longer prompt is prefilled this many tokens a run, each over the cache so far (ONNX Runtime sessions): ORT's
#: CPU attention holds [heads, new tokens, all tokens] of scores at once; SmolLM2-135M int4 prefilling 8,000 tokens
#: peaked at 1.29 GB whole, 0.78 GB in runs of 512, and no slower (llama.cpp's n_ubatch is 512 too).
PREFILL_CHUNK = 512


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
    position (its real tokens so far) and its context inputs ``[rows, ...]``. A cached tensor is numpy, or
    on ONNX Runtime the ``OrtValue`` its last run left on its device (:meth:`host_cache` gives numpy)."""

    cache: Mapping[str, np.ndarray]
    mask: np.ndarray
    positions: np.ndarray
    context: dict[str, np.ndarray] = field(default_factory=dict)
    buffers: "KvBuffers | None" = field(default=None, repr=False, compare=False)  # the cache's, held in place

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def slots(self) -> int:
        return int(self.mask.shape[1])

    def host_cache(self) -> dict[str, np.ndarray]:
        return {name: host(value) for name, value in self.cache.items()}


def _fixed_bytes(shape, axis: int | None, dtype: np.dtype) -> int | None:
    """Bytes of one row (and, for a growing tensor, one position) of a cached tensor; None when a dim is not fixed."""
    count = 1
    for i, d in enumerate(shape):
        if i == 0 or i == axis:
            continue
        if not isinstance(d, int):
            return None
        count *= d
    return count * np.dtype(dtype).itemsize


@dataclass(frozen=True)
class KvFootprint:
    """What a decoder's cache holds: ``token_bytes`` per position of one sequence (every layer's key and value;
    None when the file's dims do not say), ``row_bytes`` per sequence whatever its length (carried summaries), at
    most ``positions`` positions per sequence (None: no stated limit). The cache grows a position at a time, so
    these are bounds, reached by a sequence that uses every position."""

    token_bytes: int | None
    row_bytes: int
    positions: int | None
    tensors: int

    def bytes(self, rows: int = 1, positions: int | None = None) -> int | None:
        """The cache of ``rows`` sequences at ``positions`` each (default: every position served)."""
        positions = positions if positions is not None else self.positions
        if self.token_bytes is None or positions is None:
            return None
        return rows * (positions * self.token_bytes + self.row_bytes)

    def describe(self, rows: int = 1) -> str:
        """One line: bytes per token, and the cache at the positions and sequences served."""
        if self.token_bytes is None:
            return f"KV cache: {self.tensors} tensors whose per-token size the file does not fix"
        line = f"KV cache: {self.token_bytes:,} bytes per token ({self.tensors} tensors)"
        if self.positions is None:
            return line + ", no position limit stated (set max_positions to bound it)"
        one, many = self.bytes(1), self.bytes(rows)
        assert one is not None and many is not None  # token_bytes and positions are known here
        line += f"; at {self.positions:,} positions {_mb(one)} per sequence"
        if rows > 1:
            line += f", {_mb(many)} for {rows} sequences at once"
        return line


def memory_warning(footprint: KvFootprint, rows: int, flag: str = "max_positions") -> str | None:
    """A line when the cache at every position served would not fit the memory available now (it grows a position
    at a time, so this is a warning, not a refusal)."""
    need = footprint.bytes(rows)
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    if need is None or need <= available:
        return None
    return (f"the KV cache at {footprint.positions:,} positions x {rows} sequence(s) would take {_mb(need)}, more "
            f"than the {_mb(available)} of memory available: bound it with {flag}")


def _mb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} KB"


def host(value) -> np.ndarray:
    """A cached tensor as numpy: an ``OrtValue`` is wrapped where it lies on the CPU (no copy), copied from a GPU."""
    return value if isinstance(value, np.ndarray) else value.numpy()


class Decoder:
    """One with-past model, run by prefill and decode steps (module docstring). Thread-safe as its session
    is; a :class:`DecodeState` belongs to one caller at a time."""

    def __init__(self, session: Session, bind: bool | None = None, max_positions: int | None = None,
                 bound_by: str = "max_positions"):
        """``max_positions``: serve at most this many positions per sequence (prompt + generated tokens), which
        bounds the KV cache (:meth:`kv_footprint`); None or more than the model's: the model's own. ``bound_by``
        names the setting in messages (a command's flag)."""
        self.session = session
        self.bound_by = bound_by
        # ONNX Runtime's IOBinding where it saves copies: a GPU session (module docstring). On the CPU plain runs
        # already pass numpy buffers both ways without a copy, and binding 2 tensors a layer costs more Python.
        if bind is None:
            bind = bool(getattr(session, "on_device", False))
        self._keeping = getattr(session, "run_keeping", None) if bind else None
        if bind and self._keeping is None:
            raise ValueError(f"{type(session).__name__} cannot keep outputs on its device (ONNX Runtime sessions can)")
        self.layout = CacheLayout.of(session)
        specs = {s.name: s for s in session.inputs}
        self._dtypes = {t.input: np.dtype(specs[t.input].dtype) for t in self.layout.tensors}
        self._shapes = {t.input: specs[t.input].shape for t in self.layout.tensors}
        self._ids = next(s for s in session.inputs if s.role == Role.INPUT_IDS)
        self._mask = next(s for s in session.inputs if s.role == Role.ATTENTION_MASK)
        self.context_inputs = [s for s in session.inputs if s.role == Role.CONTEXT]
        self._present = frozenset(t.output for t in self.layout.tensors)
        self._outputs = ["logits"] + [t.output for t in self.layout.tensors]
        vocab = next(s for s in session.outputs if s.name == "logits").shape[-1]
        self.vocab_size = vocab if isinstance(vocab, int) else None
        self.model_positions = self.layout.max_positions or None
        if max_positions is not None and max_positions < 2:
            raise ValueError(f"max_positions must be >= 2 (a prompt token and a generated one), got {max_positions}")
        limits = [p for p in (max_positions, self.model_positions) if p]
        self.max_positions = min(limits) if limits else None
        self._cached_bytes = {t.input: (_fixed_bytes(self._shapes[t.input], t.axis, self._dtypes[t.input]), t.axis)
                              for t in self.layout.tensors}
        # the cache held in place between steps where the session can (kv_in_place; ONNX Runtime on the CPU)
        self._in_place = InPlaceKv(session, self.layout.tensors, self.vocab_size, self._ids.name, self._mask.name,
                                   self.max_positions) \
            if not bind and self.vocab_size and InPlaceKv.usable(session, self.layout.tensors) else None

    # ---- the KV cache's size ----------------------------------------------------------------------
    @property
    def bounded(self) -> bool:
        """Whether ``max_positions`` was set below the model's own positions."""
        return bool(self.max_positions and self.max_positions != self.model_positions)

    @property
    def positions_text(self) -> str:
        """The positions served, for messages: ``"2048 positions"``, or with a bound, where it comes from."""
        if not self.max_positions:
            return "unbounded positions"
        if self.bounded:
            return (f"{self.max_positions} positions ({self.bound_by} {self.max_positions}; the model has "
                    f"{self.model_positions or 'no stated limit'})")
        return f"{self.max_positions} positions"

    def kv_footprint(self) -> "KvFootprint":
        """Bytes of the cache per position and per sequence, from the file's own cache inputs (dims and dtypes)."""
        per_token = per_row = 0
        known = True
        for size, axis in self._cached_bytes.values():
            if size is None:
                known = False
            elif axis is None:
                per_row += size
            else:
                per_token += size
        return KvFootprint(per_token if known else None, per_row, self.max_positions, len(self._cached_bytes))

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
                if not all(isinstance(d, int) for d in dims):  # (a dim name left: below, ints only)
                    raise InputError(f"context input {spec.name!r} has a per-token axis, which generation cannot "
                                     "extend to the tokens it generates")
                value = np.full([int(d) for d in dims], 0 if spec.default == "zeros" else 1, dtype=spec.dtype)
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

    def _feeds(self, state: DecodeState, ids: np.ndarray, new_mask: np.ndarray,
               cache: bool = True) -> dict[str, np.ndarray]:
        """A run's inputs over ``state``; ``cache=False`` leaves the cached ones out (held in place: InPlaceKv)."""
        n = ids.shape[1]
        feeds = {self._ids.name: ids.astype(self._ids.dtype, copy=False),
                 self._mask.name: np.concatenate([state.mask, new_mask], axis=1).astype(self._mask.dtype, copy=False)}
        if self.layout.position_ids:
            feeds["position_ids"] = (state.positions[:, None] + np.arange(n, dtype=np.int64)[None]).astype(np.int64)
        if cache:
            feeds.update(state.cache)
        feeds.update(state.context)
        return feeds

    def _advance(self, state: DecodeState, feeds, new_tokens: np.ndarray, validate: bool):
        if validate:
            feeds = self.session.check_feeds(feeds)
        if self._in_place is not None:
            logits, cache, buffers = self._in_place.run(state, feeds)
            return logits, DecodeState(cache, feeds[self._mask.name], state.positions + new_tokens, state.context,
                                       buffers)
        out = self._keeping(feeds, self._outputs, self._present) if self._keeping is not None else \
            self.session._run(feeds, self._outputs)
        cache = {t.input: out[t.output] for t in self.layout.tensors}
        mask = feeds[self._mask.name]
        return out["logits"][:, -1], DecodeState(cache, mask, state.positions + new_tokens, state.context)

    # ---- the steps -------------------------------------------------------------------------------
    def start(self, prompt: Sequence[int], context: Mapping[str, np.ndarray] | None = None):
        """Prefill one sequence: ``(logits of its next token [vocab], its state)``."""
        ids, state = self.fresh(prompt, context)
        chunk = PREFILL_CHUNK if self.session.platform == "onnxruntime_onnx" else ids.shape[1]
        for begin in range(0, ids.shape[1], chunk):
            part = ids[:, begin:begin + chunk]
            feeds = self._feeds(state, part, np.ones_like(part), cache=begin == 0 or self._in_place is None)
            logits, state = self._advance(state, feeds, np.array([part.shape[1]]), validate=begin == 0)
        return logits[0], state

    def fresh(self, prompt: Sequence[int], context: Mapping[str, np.ndarray] | None = None):
        """A prompt's ids ``[1, n]`` (checked against the positions and the vocabulary) and the state before it."""
        ids = np.asarray(prompt, dtype=np.int64).reshape(1, -1)
        if ids.shape[1] == 0:
            raise InputError("the prompt has no tokens")
        if self.max_positions and ids.shape[1] > self.max_positions:
            raise InputError(f"the prompt has {ids.shape[1]} tokens, more than the {self.positions_text} served")
        if self.vocab_size is not None and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise InputError(f"token id {int(ids.max() if ids.max() >= self.vocab_size else ids.min())} is outside "
                             f"the model's vocabulary [0, {self.vocab_size})")
        return ids, DecodeState(self._empty(1), np.zeros((1, 1), np.int64), np.zeros(1, np.int64),
                                self.context_row(context))

    def step(self, state: DecodeState, tokens: Sequence[int]):
        """One new token per row: ``(logits [rows, vocab], the state after it)``."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1, 1)
        feeds = self._feeds(state, ids, np.ones_like(ids), cache=self._in_place is None)
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
            parts = [host(s.cache[t.input]) if t.axis is None else pad(host(s.cache[t.input]), t.axis, slots - s.slots)
                     for s in states]
            cache[t.input] = np.concatenate(parts, axis=0)
        mask = np.concatenate([pad(s.mask, 1, slots - s.slots) for s in states], axis=0)
        context = {name: np.concatenate([s.context[name] for s in states], axis=0) for name in states[0].context}
        return DecodeState(cache, mask, np.concatenate([s.positions for s in states]), context)

    def select(self, state: DecodeState, rows: Sequence[int]) -> DecodeState:
        """Only ``rows`` of a batch, without the leading slots none of them uses (at least one slot stays)."""
        index = np.asarray(rows, dtype=np.int64)
        mask = state.mask[index]
        used = np.flatnonzero(mask.any(axis=0))
        first = min(int(used[0]) if used.size else mask.shape[1] - 1, mask.shape[1] - 1)
        cache = {}
        for t in self.layout.tensors:
            arr = host(state.cache[t.input])[index]
            if t.axis is not None and first:
                arr = np.take(arr, np.arange(first, arr.shape[t.axis]), axis=t.axis)
            cache[t.input] = arr
        return DecodeState(cache, mask[:, first:], state.positions[index],
                           {k: v[index] for k, v in state.context.items()})
