"""A served model's tensors in KServe v2's words: the protocol's datatypes, a tensor's metadata entry, and the
:class:`ModelSignature` a request is checked against (:mod:`attnx.runtime.apis.kserve_tensors`), which every encoder
states (:attr:`attnx.runtime.serving.encoder.EncoderModel.signature`) and the encoding service reads too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attnx.contract import Role
from attnx.runtime.core.session import OPTIONAL_ROLES, TensorSpec
from attnx.runtime.core.text import TEXT_ROLES


#: Protocol datatype strings <-> numpy (little-endian on the wire). ``BYTES`` is text, handled apart.
TRITON_TO_NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
BYTES = "BYTES"
#: Valid in the protocol, but no attnx model takes them.
UNSUPPORTED_DATATYPES = {"BF16"}


def triton_dtype(dtype: np.dtype) -> str:
    """numpy dtype -> protocol datatype string ("FP32", "INT64", ...)."""
    d = np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).byteorder == ">" else np.dtype(dtype)
    for name, np_dtype in TRITON_TO_NUMPY.items():
        if np_dtype == d:
            return name
    raise ValueError(f"no protocol datatype for {dtype}")


def tensor_metadata(spec: TensorSpec) -> dict:
    """A tensor in model metadata: dims -1 where dynamic (batch included, as Triton does)."""
    return {"name": spec.name, "datatype": triton_dtype(spec.dtype),
            "shape": [d if isinstance(d, int) else -1 for d in spec.shape]}


@dataclass
class TextInput:
    """A model's text input: its name and how it is tokenised (what clients are told)."""

    name: str
    max_length: int | None
    truncation_side: str
    #: the model scores text pairs (a cross-encoder or classifier): it takes ``text_pair`` beside ``text``
    pairs: bool = False


@dataclass
class ModelSignature:
    """What the protocol layer needs to know about a model."""

    name: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    max_batch_size: int
    max_seq: int | None = None
    text: TextInput | None = None

    def input(self, name: str) -> TensorSpec | None:
        return next((s for s in self.inputs if s.name == name), None)

    @property
    def optional_inputs(self) -> set[str]:
        # The attention mask, segment ids and a head mask may be omitted: all ones / zeros / all ones
        # (no head ablated) then, and so may an input whose metadata gives it a default (see session.py).
        return {s.name for s in self.inputs
                if s.role in OPTIONAL_ROLES or s.role == Role.HEAD_MASK or s.default is not None}

    @property
    def text_filled(self) -> set[str]:
        """Inputs a text request fills in itself (token ids, mask, segment ids)."""
        return {s.name for s in self.inputs if s.role in TEXT_ROLES}
