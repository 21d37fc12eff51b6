"""A decoder's KV cache held in place between steps, on ONNX Runtime's CPU kernels (no torch).

As written, a with-past file's ``present`` is ``past`` + the new slots: each step copies every layer's whole
cache into a new tensor, a cost that grows with the context (SmolLM2-135M at 1,000 positions: 46 MB a token).
Where the load-time rewrite made every cached tensor a ``GroupQueryAttention`` 's past
(:func:`attnx.runtime.core.ort_attention.cache_in_place`), :class:`InPlaceKv` keeps each one in a buffer
``[rows, heads, capacity, head]`` bound through ONNX Runtime's IOBinding as both the ``past`` input and the
``present`` output: the kernel writes only the new slots. The bindings stay between steps, so a step binds just
the ids, the mask and the positions (not 2 tensors a layer).

A :class:`~attnx.runtime.core.decoding.DecodeState` still sees its cache as ``[rows, heads, slots, head]``: views of
the first ``slots`` of the buffers, sliced when read (:class:`CacheViews`: a step makes none). States that follow one
another share one :class:`KvBuffers`; its ``used``
says how far it is written, so a state stepped a second time (a fork), a batch that changed
(:meth:`~attnx.runtime.core.decoding.Decoder.merge` / ``select`` copy), or a full buffer gets new buffers with its
cache copied in; an earlier state's slots are never written. Capacity doubles (at least
:data:`FIRST_CAPACITY`), so a sequence copies its cache O(log n) times and holds at most twice what it uses.

A step's other inputs keep their bindings too where their shape does not change (the new ids and positions of a
decode step: their values are written into the bound arrays), and so does the logits buffer: after ONNX Runtime's
run, cold caches made each bind and each of a 30-layer model's 60 cache views cost 20-30 µs, ~0.4 ms a step of
SmolLM2-135M int4's ~5.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Protocol, Sequence

import numpy as np


class _Cached(Protocol):  # a CacheLayout's tensor
    @property
    def input(self) -> str: ...
    @property
    def output(self) -> str: ...
    @property
    def axis(self) -> int | None: ...


class _State(Protocol):  # what a DecodeState holds
    cache: Mapping[str, np.ndarray]
    buffers: "KvBuffers | None"

    @property
    def slots(self) -> int: ...

#: Slots of the first buffers (doubled as a sequence outgrows them).
FIRST_CAPACITY = 128
_SLOTS = 2  # the axis that grows: [rows, heads, slots, head]


class KvBuffers:
    """One chain of states' cache: per cached input a buffer whose first ``used`` slots are written, the
    ``OrtValue`` s over them and the IOBinding binding each as its ``past`` and its ``present``."""

    __slots__ = ("arrays", "values", "binding", "used", "logits", "logits_value", "bound")

    def __init__(self, arrays: dict[str, np.ndarray], values: dict[str, Any], binding, used: int):
        self.arrays, self.values, self.binding, self.used = arrays, values, binding, used
        self.logits: np.ndarray | None = None  # the bound logits buffer [rows, kept, vocab]
        self.logits_value: Any = None
        self.bound: dict[str, np.ndarray] = {}  # the other inputs' arrays as bound (ids, mask, positions)

    @property
    def rows(self) -> int:
        return next(iter(self.arrays.values())).shape[0]

    @property
    def capacity(self) -> int:
        return next(iter(self.arrays.values())).shape[_SLOTS]


class CacheViews(Mapping[str, np.ndarray]):
    """A state's cache: the first ``slots`` of each buffer ``[rows, heads, capacity, head]``, sliced when read."""

    __slots__ = ("_arrays", "_slots")

    def __init__(self, arrays: dict[str, np.ndarray], slots: int):
        self._arrays, self._slots = arrays, slots

    def __getitem__(self, name: str) -> np.ndarray:
        return self._arrays[name][:, :, :self._slots]

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)


def capacity_for(slots: int, previous: int = 0, limit: int | None = None) -> int:
    """Slots of new buffers holding ``slots``: double the previous ones (at least :data:`FIRST_CAPACITY`), not past
    ``limit`` (the positions served + the leading masked slot) unless ``slots`` needs it."""
    size = max(FIRST_CAPACITY, 2 * previous)
    while size < slots:
        size *= 2
    return max(slots, min(size, limit)) if limit else size


class InPlaceKv:
    """Runs a decoder's steps with its cache in place (module docstring). ``session``: an
    :class:`~attnx.runtime.core.backends.onnxrt.OnnxRuntimeSession` whose ``in_place_cache`` is true."""

    def __init__(self, session, tensors: Sequence[_Cached], vocab: int, ids: str, mask: str,
                 max_positions: int | None = None):
        self.session = session
        self.pairs = {t.input: t.output for t in tensors}
        self.vocab, self.ids, self.mask = vocab, ids, mask
        logits = next(s for s in session.outputs if s.name == "logits")
        self.keeps_last = logits.shape[1] == 1  # the file gives the last position's logits only (its declared shape)
        self.limit = max_positions + 1 if max_positions else None

    @classmethod
    def usable(cls, session, tensors: Sequence[_Cached]) -> bool:
        """The session holds its cache in place and every cached tensor grows along axis 2."""
        return bool(getattr(session, "in_place_cache", False)) and bool(tensors) and \
            all(t.axis == _SLOTS for t in tensors)

    def _buffers(self, state: _State, slots: int) -> KvBuffers:
        """New buffers for ``slots`` holding ``state`` 's cache (its ``slots`` so far copied in), bound."""
        import onnxruntime as ort

        old = state.buffers
        capacity = capacity_for(slots, old.capacity if old is not None else 0, self.limit)
        binding = self.session.io_binding()
        arrays, values = {}, {}
        for name, output in self.pairs.items():
            cached = np.asarray(state.cache[name])
            shape = list(cached.shape)
            shape[_SLOTS] = capacity
            array = np.zeros(shape, dtype=cached.dtype)
            array[:, :, :cached.shape[_SLOTS]] = cached
            value = ort.OrtValue.ortvalue_from_numpy(array)  # wraps the array: no copy
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(output, value)
            arrays[name], values[name] = array, value
        return KvBuffers(arrays, values, binding, state.slots)

    def run(self, state: _State, feeds: Mapping[str, np.ndarray]):
        """One run of ``feeds`` (a :class:`Decoder` 's; its cached inputs, if there, are not read: the state's are)
        over ``state``: ``(logits of each row's last position [rows, vocab], the cache after it, its KvBuffers)``."""
        import onnxruntime as ort

        rows, slots = feeds[self.mask].shape
        new = feeds[self.ids].shape[1]
        buffers = state.buffers
        if buffers is None or buffers.used != state.slots or buffers.capacity < slots or buffers.rows != rows:
            buffers = self._buffers(state, slots)
        bound = buffers.bound
        for name, value in feeds.items():
            if name in self.pairs:
                continue
            held = bound.get(name)
            if held is not None and held.shape == value.shape and held.dtype == value.dtype:
                np.copyto(held, value)  # the binding reads this array's memory
            else:
                held = bound[name] = np.array(value, copy=True, order="C")  # the binding's own
                buffers.binding.bind_cpu_input(name, held)
        kept = 1 if self.keeps_last or new == 1 else new
        if buffers.logits is None or buffers.logits.shape[:2] != (rows, kept):
            buffers.logits = np.empty((rows, kept, self.vocab), np.float32)
            buffers.logits_value = ort.OrtValue.ortvalue_from_numpy(buffers.logits)
            buffers.binding.bind_ortvalue_output("logits", buffers.logits_value)
        self.session.run_binding(buffers.binding)
        buffers.used = slots
        return buffers.logits[:, -1].copy(), CacheViews(buffers.arrays, slots), buffers


__all__ = ["FIRST_CAPACITY", "CacheViews", "InPlaceKv", "KvBuffers", "capacity_for"]
