"""What a tensor source gives (:class:`TensorSource`): each tensor's :class:`TensorInfo` without reading it, the
tensor, or its :class:`Blocks` carried over as they are.

A leaf of :mod:`attnx.pretrained`: the sources of :mod:`attnx.pretrained.tensors` (safetensors, ``.bin``) and of
:mod:`attnx.pretrained.gguf_tensors` (a GGUF) both implement it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]  # as transformers' model holds it (a Linear weight [out, in])
    dtype: str  # the source's storage type: "F32" | "F16" | "BF16" | a GGUF type name ("Q4_0", "Q8_0", ...)


@dataclass(frozen=True)
class Blocks:
    """Weights already in MatMulNBits' layout, carried over without re-rounding."""

    bits: int  # 4 or 8
    block_size: int  # 32
    data: np.ndarray  # uint8 [N, K // block_size, block_size * bits // 8] (N: the Linear weight's rows)
    scales: np.ndarray  # float32 [N, K // block_size]
    zero_points: np.ndarray | None  # packed uint8 zero points, or None for the default (8 at 4 bits, 128 at 8)


class TensorSource(Protocol):
    def infos(self) -> dict[str, TensorInfo]: ...

    def read(self, name: str): ...  # torch.Tensor in fresh memory, the source's own float dtype

    def blocks(self, name: str) -> Blocks | None: ...

    def close(self) -> None: ...
