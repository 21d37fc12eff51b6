"""Triton's ``ModelConfig`` of a served model, as a dict (field names as in model_config.proto).

``GET /v2/models/{m}/config`` answers with it (:meth:`attnx.runtime.serving.encoder.EncoderModel.config`),
and the Triton model repository writes it as ``config.pbtxt`` (:mod:`attnx.deploy.triton` writes
and checks it with Triton's own schema). numpy only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attnx.contract import BATCH
from attnx.runtime.core.session import Session, TensorSpec

#: numpy dtype -> Triton ``DataType`` enum name.
TRITON_TYPES = {
    "bool": "TYPE_BOOL",
    "uint8": "TYPE_UINT8",
    "uint16": "TYPE_UINT16",
    "uint32": "TYPE_UINT32",
    "uint64": "TYPE_UINT64",
    "int8": "TYPE_INT8",
    "int16": "TYPE_INT16",
    "int32": "TYPE_INT32",
    "int64": "TYPE_INT64",
    "float16": "TYPE_FP16",
    "float32": "TYPE_FP32",
    "float64": "TYPE_FP64",
    "bfloat16": "TYPE_BF16",
    "object": "TYPE_STRING",  # BYTES tensors (texts) are numpy object arrays
}


class ConfigError(ValueError):
    """A config.pbtxt that Triton's schema (or a basic sanity check) rejects."""


def triton_type(dtype) -> str:
    """Triton's ``DataType`` name of a numpy dtype (one clear error for a type Triton has not)."""
    name = np.dtype(dtype).name
    if name not in TRITON_TYPES:
        raise ConfigError(f"Triton has no data type for numpy {name}")
    return TRITON_TYPES[name]


class Enum(str):
    """A protobuf enum value: written bare in text format (``TYPE_FP32``, not ``"TYPE_FP32"``)."""


def _tensor_config(spec: TensorSpec, batched: bool) -> dict[str, Any]:
    dims = [d if isinstance(d, int) else -1 for axis, d in enumerate(spec.shape) if not (batched and axis == 0)]
    entry: dict[str, Any] = {"name": spec.name, "data_type": Enum(triton_type(spec.dtype))}
    if dims:
        entry["dims"] = dims
    else:
        # A [batch] tensor has no dims left once batch is implicit; Triton's idiom for it is
        # dims [1] reshaped to [] (the model sees [batch]).
        entry["dims"] = [1]
        entry["reshape"] = {"shape": []}
    return entry


def model_config(
    name: str,
    model: Session | tuple[list[TensorSpec], list[TensorSpec]],
    *,
    platform: str | None = None,
    max_batch_size: int = 32,
    max_queue_delay_us: int = 2000,
    max_queue_size: int | None = None,
    instance_kind: str = "KIND_AUTO",
    instance_count: int = 1,
    default_model_filename: str | None = None,
    parameters: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Triton's ModelConfig for a model, as a dict (field names as in model_config.proto).

    Batch is implicit (``max_batch_size`` > 0) when every input and output has it
    as its first dim; otherwise ``max_batch_size`` is 0 and dims include it.
    """
    if isinstance(model, Session):
        inputs, outputs = model.inputs, model.outputs
        platform = platform or model.platform
    else:
        inputs, outputs = model
    platform = platform or "onnxruntime_onnx"
    batched = max_batch_size > 0 and all(s.shape[:1] == (BATCH,) for s in list(inputs) + list(outputs))
    config: dict[str, Any] = {
        "name": name,
        "platform": platform,
        "max_batch_size": max_batch_size if batched else 0,
        "input": [_tensor_config(s, batched) for s in inputs],
        "output": [_tensor_config(s, batched) for s in outputs],
    }
    if batched:
        dyn: dict[str, Any] = {"max_queue_delay_microseconds": int(max_queue_delay_us)}
        if max_queue_size:
            dyn["default_queue_policy"] = {"max_queue_size": int(max_queue_size)}
        config["dynamic_batching"] = dyn
    config["instance_group"] = [{"kind": Enum(instance_kind), "count": int(instance_count)}]
    if default_model_filename:
        config["default_model_filename"] = default_model_filename
    if parameters:
        config["parameters"] = {k: {"string_value": v} for k, v in parameters.items()}
    return config
