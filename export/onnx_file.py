"""ONNX files whose weights are never held twice: written one tensor at a time, checked without them.

An export's graph is an onnx-ir model whose initializers are views of the PyTorch parameters
(``TorchTensor``: no copy), tensors computed from them when they are written (``ir.LazyTensor``:
a transposed, packed, fp16 or block-quantized weight; for a streamed decoder, a weight read from its
checkpoint, :mod:`attnx.export.streaming`) or memory-mapped from a file (``ir.ExternalTensor``).
:func:`save` streams each to disk in turn, so the peak is the model plus its largest tensor:

- up to :data:`INLINE_LIMIT` of weights, one self-contained ``.onnx`` (protobuf's 2 GiB limit bounds
  a file); the weights are written into the protobuf stream directly (the graph message's length is
  computed from the tensors' sizes, then each tensor's bytes follow its header), never serialised
  into one in-memory message;
- beyond it, the graph in ``<name>.onnx`` and the weights in ``<name>.onnx.data`` (ONNX external data,
  large tensors at page-aligned offsets so ONNX Runtime can memory-map them). A with-past decoder is
  always written so (``external=True``; onnxruntime-genai's layout): a mapped file loads without a second
  copy of its weights.

:func:`check` runs onnx's full checker and strict shape inference on the graph with the large weights
standing in as typed inputs (their values are never read by either; the small ones stay, shape
computations fold through them).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable

import onnx
import onnx_ir as ir

#: Weights up to this many bytes stay inside the ``.onnx`` file (protobuf refuses messages over 2 GiB).
INLINE_LIMIT = 1_800_000_000
#: Tensors larger than this are streamed (and go to external data); smaller ones are serialised with the graph.
STREAM_BYTES = 1024
#: Tensors from this size on start at a page boundary in external data (ONNX Runtime memory-maps those).
ALIGN_FROM, ALIGN = 1 << 16, 4096
#: Tensors up to this size keep their values for :func:`check` (shape constants fold through them).
CHECK_KEEP_BYTES = 1 << 16

Progress = Callable[[int, int], None]  # (bytes written, bytes to write)


def weight_bytes(model: ir.Model) -> int:
    """Bytes of the main graph's initializers (what :func:`save` writes)."""
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def _streamed(model: ir.Model) -> list[ir.Value]:
    return [v for v in model.graph.initializers.values()
            if v.const_value is not None and v.const_value.dtype != ir.DataType.STRING
            and v.const_value.nbytes > STREAM_BYTES]


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _tag(message, field: str) -> bytes:
    """The wire tag of a length-delimited field (numbers read from onnx's own descriptors)."""
    return _varint(message.DESCRIPTOR.fields_by_name[field].number << 3 | 2)


def _graph_proto(model: ir.Model, streamed: list[ir.Value], location: str) -> onnx.ModelProto:
    """The model as a protobuf whose streamed initializers are external-data references into
    ``location`` (offsets in order, large tensors aligned); nothing is read from the tensors."""
    originals = {}
    offset = 0
    try:
        for value in streamed:
            tensor = value.const_value
            if tensor.nbytes >= ALIGN_FROM:
                offset = -(-offset // ALIGN) * ALIGN
            originals[value.name] = tensor
            value.const_value = ir.ExternalTensor(location, offset, tensor.nbytes, tensor.dtype, shape=tensor.shape,
                                                  name=value.name, doc_string=tensor.doc_string,
                                                  metadata_props=dict(tensor.metadata_props))
            offset += tensor.nbytes
        return ir.serde.serialize_model(model)
    finally:
        for value in streamed:
            if value.name in originals:
                value.const_value = originals[value.name]


def _write_tensor(f, tensor: ir.TensorProtocol) -> None:
    start = f.tell()
    tensor.tofile(f)
    if f.tell() - start != tensor.nbytes:
        raise RuntimeError(f"tensor {tensor.name}: wrote {f.tell() - start} bytes, expected {tensor.nbytes}")


def save(model: ir.Model, path: str | os.PathLike, *, external: bool | None = None,
         progress: Progress | None = None) -> list[Path]:
    """Write ``model`` to ``path`` (see the module doc); ``external`` forces the weights into
    ``<name>.data`` (True) or into the file (False). Returns the files written. The caller stages
    ``path`` (:mod:`attnx.export.staging`): a failed write leaves files to remove, not a final name."""
    if sys.byteorder != "little":
        raise RuntimeError("ONNX files hold little-endian tensors; writing them on a big-endian machine is not "
                           "supported")
    path = Path(path)
    streamed = _streamed(model)
    total = sum(v.const_value.nbytes for v in streamed)
    if external is None:
        external = total > INLINE_LIMIT
    elif not external and total > INLINE_LIMIT:
        raise ValueError(f"{total / 1e9:.1f} GB of weights cannot be inside one .onnx file (protobuf's 2 GiB "
                         "limit): they go to external data")
    data_path = path.with_name(path.name + ".data")
    proto = _graph_proto(model, streamed, data_path.name)
    report = progress or (lambda done, total: None)
    done = 0
    if external:
        with open(data_path, "wb") as f:
            for value, entry in zip(streamed, _entries(proto, streamed)):
                offset = int(next(e.value for e in entry.external_data if e.key == "offset"))
                if f.tell() < offset:
                    f.write(b"\0" * (offset - f.tell()))
                _write_tensor(f, value.const_value)
                done += value.const_value.nbytes
                report(done, total)
        path.write_bytes(proto.SerializeToString())
        return [path, data_path]
    # One file: the graph message is the graph without the streamed tensors, then each tensor as an
    # `initializer` field (its header, then `raw_data`), its length known from the header and nbytes.
    entries = _entries(proto, streamed)
    heads = []
    for entry in entries:
        entry.ClearField("external_data")
        entry.ClearField("data_location")
        heads.append(entry.SerializeToString())
    keep = [t for t in proto.graph.initializer if t.name not in {v.name for v in streamed}]
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(keep)
    graph = proto.graph.SerializeToString()
    proto.ClearField("graph")
    init_tag, raw_tag = _tag(onnx.GraphProto, "initializer"), _tag(onnx.TensorProto, "raw_data")
    items = []
    for head, value in zip(heads, streamed):
        n = value.const_value.nbytes
        body = len(head) + len(raw_tag) + len(_varint(n)) + n
        items.append((init_tag + _varint(body) + head + raw_tag + _varint(n), value.const_value))
    graph_len = len(graph) + sum(len(prefix) + t.nbytes for prefix, t in items)
    with open(path, "wb") as f:
        f.write(proto.SerializeToString())
        f.write(_tag(onnx.ModelProto, "graph") + _varint(graph_len) + graph)
        for prefix, tensor in items:
            f.write(prefix)
            _write_tensor(f, tensor)
            done += tensor.nbytes
            report(done, total)
    return [path]


def _entries(proto: onnx.ModelProto, streamed: list[ir.Value]) -> list[onnx.TensorProto]:
    by_name = {t.name: t for t in proto.graph.initializer}
    return [by_name[v.name] for v in streamed]


def check(model: ir.Model) -> None:
    """onnx's full checker and strict shape inference (every graph output must get a shape), on the
    graph with its large weights as typed inputs."""
    big = [v for v in model.graph.initializers.values() if v.const_value is not None
           and v.const_value.dtype != ir.DataType.STRING and v.const_value.nbytes > CHECK_KEEP_BYTES]
    proto = _graph_proto(model, big, "unused.data")
    names = {v.name for v in big}
    inputs = [onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
              for t in proto.graph.initializer if t.name in names]
    keep = [t for t in proto.graph.initializer if t.name not in names]
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(keep)
    proto.graph.input.extend(inputs)
    onnx.checker.check_model(proto, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True, data_prop=True)
    for out in inferred.graph.output:
        if not out.type.tensor_type.HasField("shape"):
            raise RuntimeError(f"shape inference gave output {out.name!r} no shape")


def load(path: str | os.PathLike) -> ir.Model:
    """An ONNX file as an onnx-ir model: external data memory-mapped, inline weights viewed in the
    parsed protobuf (no copy)."""
    return ir.load(str(path))


def from_proto(proto: onnx.ModelProto) -> ir.Model:
    """A protobuf model as onnx-ir, its tensors viewing the protobuf's bytes (no copy)."""
    return ir.serde.deserialize_model(proto)
