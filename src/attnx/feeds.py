"""Valid random inputs for a model's declared inputs: what int8 calibration (a model without a
tokenizer) and the load generator of ``attnx bench`` feed it.

Any input description with ``name``, ``dtype``, ``shape`` (dims of ints and the axis names
``batch`` / ``seq``) and ``role`` will do: a file's :class:`~attnx.contract.TensorEntry` or a
session's ``TensorSpec``. numpy only.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np
import numpy.typing as npt

from attnx.contract import BATCH, SEQ, Role


class InputSpec(Protocol):
    """What a feed is made from: a runtime ``TensorSpec`` or the contract's ``TensorEntry``."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> npt.DTypeLike: ...
    @property
    def shape(self) -> Sequence[int | str | None]: ...
    @property
    def role(self) -> str: ...


def synthetic_feeds(inputs: Sequence[InputSpec], batch: int, seq: int, rng: np.random.Generator, *,
                    length: int | None = None) -> dict[str, np.ndarray]:
    """Valid random inputs for a model: unit-scale floats, a mask of ``length`` ones then padding.

    Integer context inputs (type ids) are zeros, always in range. Unnamed dynamic
    dims get size 1.
    """
    feeds: dict[str, np.ndarray] = {}
    for spec in inputs:
        shape = [batch if d == BATCH else seq if d == SEQ else d if isinstance(d, int) else 1 for d in spec.shape]
        dtype = np.dtype(spec.dtype)
        if spec.role == Role.ATTENTION_MASK:
            arr = np.zeros(shape, dtype=dtype)
            arr[..., : (length or seq)] = 1
        elif spec.role == Role.HEAD_MASK:
            arr = np.ones(shape, dtype=dtype)  # no head ablated
        elif dtype.kind == "f":
            scale = 1.0 if spec.role == Role.HIDDEN_STATES else (0.05 if "trace" in spec.name else 0.5)
            arr = (rng.standard_normal(shape) * scale).astype(dtype)
        elif dtype.kind == "b":
            arr = np.ones(shape, dtype=dtype)
        else:
            arr = np.zeros(shape, dtype=dtype)
        feeds[spec.name] = arr
    return feeds
