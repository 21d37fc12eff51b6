"""fp32 -> fp16 ONNX conversion that keeps softmax, LayerNorm and reductions in fp32.

TensorRT 11 and TensorRT-RTX are strongly typed (no FP16 builder flag), so
precision lives in the file: every float tensor becomes fp16 except around the
ops in ``FP32_OPS``, which get fp32 inputs (a Cast in front) and hand fp16 on
(a Cast behind). Float constants are clamped to fp16's finite range first, so an
additive mask of float32-min becomes -65504 rather than -inf (no NaN rows). Weights are converted
when the file is written (``ir.LazyTensor``), one at a time.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

# Softmax lives inside Attention; reductions accumulate; LayerNorm normalises.
FP32_OPS = frozenset({"Softmax", "LogSoftmax", "LayerNormalization", "Attention", "ReduceSum", "ReduceMean",
                      "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2", "ReduceLogSumExp", "ReduceSumSquare"})
#: A decoder with its KV cache keeps its attention in fp16 (TensorRT's fused attention accumulates its softmax
#: in fp32 itself): kept in fp32, TensorRT-RTX 1.7's Myelin cannot fuse an attention whose k/v are also graph
#: outputs (``present.*``) and refuses the build ("Fusing attention ops must leave the graph in a well-formed state").
FP32_OPS_WITH_CACHE = FP32_OPS - {"Attention"}
_FP16_MAX = float(np.finfo(np.float16).max)
_F32, _F16 = ir.DataType.FLOAT, ir.DataType.FLOAT16


def _to_fp16_array(values: np.ndarray) -> np.ndarray:
    return np.clip(values, -_FP16_MAX, _FP16_MAX).astype(np.float16)


def _fp16_tensor(tensor: ir.TensorProtocol) -> ir.TensorProtocol:
    """``tensor`` in fp16 (clamped): small ones now, large ones when written."""
    name = tensor.name
    if tensor.size <= 4096:
        return ir.Tensor(_to_fp16_array(tensor.numpy()), name=name)
    return ir.LazyTensor(lambda: ir.Tensor(_to_fp16_array(tensor.numpy()), name=name), dtype=_F16,
                         shape=ir.Shape(list(tensor.shape)), name=name)


def _is_f32(value: ir.Value | None) -> bool:
    return value is not None and value.dtype == _F32


def to_fp16(model, keep_fp32: frozenset[str] = FP32_OPS):
    """``model`` in fp16 (graph inputs/outputs included) with ``keep_fp32`` ops in fp32: an onnx-ir model is
    converted in place and returned; an ``onnx.ModelProto`` gives a new one."""
    if isinstance(model, onnx.ModelProto):
        converted = to_fp16(ir.serde.deserialize_model(model), keep_fp32)
        return ir.serde.serialize_model(converted)
    graph = model.graph
    fp32_nodes = {id(n) for n in graph if n.op_type in keep_fp32 and n.domain in ("", "ai.onnx")}

    # 1. Initializers and constant attributes -> fp16 (a weight only fp32 islands read stays fp32).
    for value in graph.initializers.values():
        if value.const_value is None or value.const_value.dtype != _F32:
            continue
        consumers = value.consumers()
        if consumers and all(id(c) in fp32_nodes for c in consumers):
            continue  # e.g. LayerNorm scale/bias: only ever read in fp32
        value.const_value = _fp16_tensor(value.const_value)
        value.dtype = _F16
    for node in graph:
        if node.op_type == "Cast" and node.attributes.get_int("to") == _F32 and id(node) not in fp32_nodes:
            node.attributes["to"] = ir.AttrInt64("to", _F16)
        if node.op_type in ("Constant", "ConstantOfShape"):
            tensor = node.attributes.get_tensor("value")
            if tensor is not None and tensor.dtype == _F32:
                node.attributes["value"] = ir.AttrTensor("value", _fp16_tensor(tensor))
            value = node.attributes.get_float("value_float")
            if value is not None:
                node.attributes["value_float"] = ir.AttrFloat32("value_float", float(np.clip(value, -_FP16_MAX,
                                                                                          _FP16_MAX)))
        if node.op_type in ("EyeLike", "RandomNormal", "RandomUniform") and node.attributes.get_int("dtype") == _F32:
            node.attributes["dtype"] = ir.AttrInt64("dtype", _F16)

    # 2. Every float32 value becomes fp16 (shapes kept).
    for value in [*graph.inputs, *graph.outputs, *(o for n in graph for o in n.outputs)]:
        if _is_f32(value):
            value.dtype = _F16

    # 3. fp32 islands: cast float inputs up and outputs back down.
    for node in [n for n in graph if id(n) in fp32_nodes]:
        for i, inp in enumerate(node.inputs):
            if inp is None or inp.dtype != _F16:
                continue
            up = ir.node("Cast", [inp], {"to": _F32}, name=f"{inp.name}__fp32_{node.name or node.op_type}_{i}")
            up.outputs[0].dtype, up.outputs[0].shape = _F32, inp.shape
            graph.insert_before(node, up)
            node.replace_input_with(i, up.outputs[0])
        for out in node.outputs:
            if out.dtype != _F16:
                continue
            down = ir.node("Cast", [out], {"to": _F16})
            narrow = down.outputs[0]
            narrow.dtype, narrow.shape = _F16, out.shape
            graph.insert_after(node, down)
            for user, index in list(out.uses()):
                if user is not down:
                    user.replace_input_with(index, narrow)
            if out.is_graph_output():  # the graph's output keeps its name, now on the fp16 value
                outputs = graph.outputs
                outputs[outputs.index(out)] = narrow
                name = out.name
                out.name = f"{name}__fp32"
                narrow.name = name
            out.dtype = _F32
    from attnx.export.graph import remove_dead

    remove_dead(model)
    return model
