"""fp32 -> fp16 ONNX conversion that keeps softmax, LayerNorm and reductions in fp32.

TensorRT 11 and TensorRT-RTX are strongly typed (no FP16 builder flag), so
precision lives in the file: every float tensor becomes fp16 except around the
ops in ``FP32_OPS``, which get fp32 inputs (a Cast in front) and hand fp16 on
(a Cast behind). Float constants are clamped to fp16's finite range first, so an
additive mask of float32-min becomes -65504 rather than -inf (no NaN rows).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

# Softmax lives inside Attention; reductions accumulate; LayerNorm normalises.
FP32_OPS = frozenset({"Softmax", "LogSoftmax", "LayerNormalization", "Attention", "ReduceSum", "ReduceMean",
                      "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2", "ReduceLogSumExp", "ReduceSumSquare"})
#: A decoder with its KV cache keeps its attention in fp16 (TensorRT's fused attention accumulates its softmax
#: in fp32 itself): kept in fp32, TensorRT-RTX 1.7's Myelin cannot fuse an attention whose k/v are also graph
#: outputs (``present.*``) and refuses the build ("Fusing attention ops must leave the graph in a well-formed state").
FP32_OPS_WITH_CACHE = FP32_OPS - {"Attention"}
_FP16_MAX = float(np.finfo(np.float16).max)


def _to_fp16_array(values: np.ndarray) -> np.ndarray:
    return np.clip(values, -_FP16_MAX, _FP16_MAX).astype(np.float16)


def to_fp16(model: onnx.ModelProto, keep_fp32: frozenset[str] = FP32_OPS) -> onnx.ModelProto:
    """Return an fp16 copy of ``model`` (graph inputs/outputs included) with ``keep_fp32`` ops in fp32."""
    graph = gs.import_onnx(model)
    fp32_nodes = [n for n in graph.nodes if n.op in keep_fp32 and n.domain in (None, "", "ai.onnx")]
    fp32_ids = {id(n) for n in fp32_nodes}

    # 1. Constants and Constant nodes / typed attributes -> fp16.
    for tensor in graph.tensors().values():
        if isinstance(tensor, gs.Constant) and tensor.values.dtype == np.float32:
            consumers = tensor.outputs
            if consumers and all(id(c) in fp32_ids for c in consumers):
                continue  # e.g. LayerNorm scale/bias: only ever read in fp32
            tensor.values = _to_fp16_array(tensor.values)
    for node in graph.nodes:
        if node.op == "Cast" and node.attrs.get("to") == onnx.TensorProto.FLOAT and id(node) not in fp32_ids:
            node.attrs["to"] = onnx.TensorProto.FLOAT16
        if node.op in ("Constant", "ConstantOfShape"):
            for key in ("value",):
                val = node.attrs.get(key)
                if isinstance(val, gs.Constant) and val.values.dtype == np.float32:
                    val.values = _to_fp16_array(val.values)
            if isinstance(node.attrs.get("value_float"), float):
                node.attrs["value_float"] = float(np.clip(node.attrs["value_float"], -_FP16_MAX, _FP16_MAX))
        if node.op in ("EyeLike", "RandomNormal", "RandomUniform") and node.attrs.get("dtype") == onnx.TensorProto.FLOAT:
            node.attrs["dtype"] = onnx.TensorProto.FLOAT16

    # 2. Every float32 variable becomes fp16 (shapes kept; inference re-derives the rest).
    for tensor in graph.tensors().values():
        if isinstance(tensor, gs.Variable) and tensor.dtype is not None and np.dtype(tensor.dtype) == np.float32:
            tensor.dtype = np.float16

    # 3. fp32 islands: cast float inputs up and outputs back down.
    for node in fp32_nodes:
        for i, inp in enumerate(list(node.inputs)):
            if isinstance(inp, gs.Constant) and inp.values.dtype == np.float32:
                continue
            if isinstance(inp, gs.Constant) and inp.values.dtype == np.float16 or \
                    isinstance(inp, gs.Variable) and inp.dtype is not None and np.dtype(inp.dtype) == np.float16:
                up = gs.Variable(f"{inp.name}__fp32_{node.name or node.op}_{i}", dtype=np.float32, shape=inp.shape)
                graph.nodes.append(gs.Node("Cast", inputs=[inp], outputs=[up], attrs={"to": onnx.TensorProto.FLOAT}))
                node.inputs[i] = up
        for i, out in enumerate(list(node.outputs)):
            if out.dtype is not None and np.dtype(out.dtype) == np.float16:
                wide = gs.Variable(f"{out.name}__fp32", dtype=np.float32, shape=out.shape)
                node.outputs[i] = wide
                graph.nodes.append(gs.Node("Cast", inputs=[wide], outputs=[out], attrs={"to": onnx.TensorProto.FLOAT16}))

    graph.cleanup().toposort()
    out = gs.export_onnx(graph)
    out.ir_version = model.ir_version
    del out.functions[:]
    out.functions.extend(model.functions)  # custom-op bodies are type-generic (T = float or float16)
    del out.metadata_props[:]
    out.metadata_props.extend(model.metadata_props)
    del out.graph.value_info[:]
    return out

