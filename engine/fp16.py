"""``--fp16``: the fp16 ONNX an engine is built from.

TensorRT 11 and TensorRT-RTX are strongly typed (no FP16 builder flag), so an fp16 engine comes
from an fp16 ONNX: the given file when it already is one, else ``<stem>-fp16.onnx`` written
beside it by :func:`attnx.export.to_fp16` (softmax, LayerNorm and reductions kept in fp32;
metadata precision and I/O dtypes updated; reused while the source file is unchanged).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from attnx.contract import ModelInfo, graph_io, load_onnx, sha256_file


def fp16_path(path: Path) -> Path:
    return path.with_name(f"{path.stem}-fp16{path.suffix}")


def read_model_info(path: str | os.PathLike):
    """``(ModelInfo | None, ModelProto without weights)``; an unreadable file is a ContractError."""
    proto = load_onnx(path)
    return ModelInfo.read(proto), proto


def precision_of(info: ModelInfo | None, proto) -> str:
    """``fp16`` or ``fp32``: the metadata's, else whether a graph input is float16."""
    if info is not None and info.precision:
        return info.precision
    return "fp16" if any(dtype == "float16" for _name, dtype, _dims in graph_io(proto)[0]) else "fp32"


def _same_fp16(dst: Path, src: Path, info: ModelInfo | None, source_sha: str) -> bool:
    """Whether ``dst`` is an fp16 version of ``src``: converted from it (its sha256 recorded), or
    an fp16 export (``attnx export --fp16``) of the same variant, config, lowering and weights."""
    try:
        existing = ModelInfo.read(dst)
    except Exception:
        return False
    if existing is None or existing.precision != "fp16":
        return False
    if existing.extra.get("fp16_source_sha256") == source_sha:
        return True
    if info is None or not info.weights or not existing.weights:
        return False
    if (existing.variant, existing.config, existing.lowering, existing.profiles, existing.reference) != \
            (info.variant, info.config, info.lowering, info.profiles, info.reference):
        return False
    a, b = src.parent / info.weights, dst.parent / existing.weights
    return a.is_file() and b.is_file() and sha256_file(a) == sha256_file(b)


def _fp16_info(info: ModelInfo, converted, src: Path, dst: Path, source_sha: str) -> ModelInfo:
    """The metadata of the converted file (an onnx-ir model): precision, its new I/O dtypes, its source."""
    from attnx.export.graph import io_entries

    dtypes = {name: dtype for name, dtype, _dims in io_entries([*converted.graph.inputs, *converted.graph.outputs])}
    weights = info.weights
    # The weights file (safetensors, fp32) stays the reference: name it relative to the new file.
    if weights and dst.parent.resolve() != src.parent.resolve():
        weights = os.path.relpath(src.parent / weights, dst.parent)
    return dataclasses.replace(
        info, precision="fp16", weights=weights,
        inputs=[dataclasses.replace(e, dtype=dtypes.get(e.name, e.dtype)) for e in info.inputs],
        outputs=[dataclasses.replace(e, dtype=dtypes.get(e.name, e.dtype)) for e in info.outputs],
        extra={**info.extra, "fp16_source": src.name, "fp16_source_sha256": source_sha})


def ensure_fp16(path: str | os.PathLike, output: str | os.PathLike | None = None) -> tuple[Path, bool]:
    """An fp16 version of ``path``: ``(path, False)`` when it already is fp16, else
    ``(<stem>-fp16.onnx, True)`` converted with :func:`attnx.export.to_fp16` and its metadata
    updated. An existing conversion of the same source (sha256 recorded in
    ``attnx.fp16_source_sha256``) is reused."""
    from attnx.export import onnx_file
    from attnx.export.saving import save_model, write_info
    from attnx.export.fp16 import FP32_OPS, FP32_OPS_WITH_CACHE, to_fp16

    src = Path(path)
    info, proto = read_model_info(src)
    if precision_of(info, proto) == "fp16":
        return src, False
    dst = Path(output) if output else fp16_path(src)
    source_sha = sha256_file(src)
    if dst.is_file() and _same_fp16(dst, src, info, source_sha):
        return dst, False
    keep = FP32_OPS_WITH_CACHE if info is not None and info.cache else FP32_OPS
    converted = to_fp16(onnx_file.load(src), keep)  # the weights converted one at a time as they are written
    if info is not None:
        write_info(converted, _fp16_info(info, converted, src, dst, source_sha))
    save_model(converted, dst)
    return dst, True


def unbounded_clips(path: str | os.PathLike) -> list[str]:
    """The ``Clip`` nodes of an fp16 graph that have no upper bound (sentence pooling's ``clamp(min=...)``).

    TensorRT fills a missing bound with float32's largest value, which fp16 cannot hold, and TensorRT-RTX
    then prints ``WARNING: in op <node>_min, operand <node>_beta payload type requires precision-lose
    casting`` for each, on every fp16 build. The bound it loses is one no fp16 value reaches, so the engine
    clamps exactly as the graph says; `attnx build-engine` says so beside the warnings."""
    graph = load_onnx(path).graph
    return [n.name or n.output[0] for n in graph.node
            if n.op_type == "Clip" and (len(n.input) < 3 or not n.input[2])]
