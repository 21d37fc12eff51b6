"""INT8 for CPU: weights of every MatMul/Gemm in int8, activations quantized per row at run time.

    attnx export --from-pretrained DIR --int8 -o model-int8.onnx

Each ``MatMul(x, W)`` whose ``W`` is a float initializer becomes::

    s_x = max|x| / 127 over the last axis (one scale per token)    ReduceMax, ReduceMin, Neg, Max, Mul
    x_u8 = round(x / s_x) + 128                                     QuantizeLinear (blocked: one block per row)
    y = (x_u8 - 128) (W_u8 - 128) * s_x * s_W                       MatMulIntegerToFloat (com.microsoft)

``W_u8 = round(W / s_W) + 128`` with one symmetric scale per output column. Softmax, LayerNorm,
GELU, attention, the embeddings and the attnx custom ops (domain ``attnx``, with their function
bodies) stay in float: only top-level MatMul/Gemm with a constant weight are touched.

Why not ``onnxruntime.quantization.quantize_dynamic``: it quantizes activations with one scale
per *tensor* (``DynamicQuantizeLinear``). BERT-family models carry a few huge activations on
[CLS]/[SEP]; with one scale they swamp every other token, and on all-MiniLM-L6-v2 a 4-token
sentence's embedding drops to cosine 0.971 (0.973 with per-channel uint8 weights) against
sentence-transformers. One scale per token lifts it to 0.983 (every other built-in sentence >= 0.99,
mean 0.996; docs/performance.md).
Both weights and activations are uint8 around 128 (U8U8): ONNX Runtime's AVX2 U8S8 kernel can
saturate its 16-bit pair sums, which is why ORT recommends ``reduce_range`` there.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

QUANT_OPS = ("MatMul", "Gemm")
ORT_DOMAIN = "com.microsoft"
_ZERO = 128  # uint8 zero point of both operands: symmetric int8 stored as uint8


def _weight_u8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(W_u8, scale[N])``: symmetric per output column, stored as uint8 around 128."""
    scale = np.abs(w).max(axis=0) / 127.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q = np.clip(np.round(w / scale), -127, 127) + _ZERO
    return q.astype(np.uint8), scale


class _Rewriter:
    def __init__(self, graph: onnx.GraphProto):
        self.graph = graph
        self.inits = {t.name: t for t in graph.initializer}
        self.new_inits: list[onnx.TensorProto] = []
        self.rows: dict[str, tuple[str, str]] = {}  # activation -> (x_u8, s_x): q, k, v share one
        self.weights: dict[tuple[str, bool], tuple[str, str, int]] = {}  # (weight, transposed) -> (W_u8, s_W, K)
        self.count = 0

    def const(self, name: str, value: np.ndarray) -> str:
        self.new_inits.append(numpy_helper.from_array(value, name))
        return name

    def weight(self, name: str, transposed: bool) -> tuple[str, str, int] | None:
        init = self.inits.get(name)
        if init is None or init.data_type != TensorProto.FLOAT or len(init.dims) != 2:
            return None
        key = (name, transposed)
        if key not in self.weights:
            w = numpy_helper.to_array(init)
            q, scale = _weight_u8(w.T if transposed else w)
            tag = f"{name}{'_T' if transposed else ''}"
            self.weights[key] = (self.const(f"{tag}__u8", q), self.const(f"{tag}__scale", scale), q.shape[0])
        return self.weights[key]

    def rows_of(self, x: str, width: int, nodes: list) -> tuple[str, str]:
        """Per-row symmetric quantization of activation ``x`` (last axis ``width`` long): ``(x_u8, s_x)``."""
        if x not in self.rows:
            p = f"{x}__q8"
            if not self.rows:  # shared constants, once per graph
                self.const("attnx_q8__axis", np.array([-1], np.int64))
                self.const("attnx_q8__inv127", np.array(1.0 / 127.0, np.float32))
                self.const("attnx_q8__tiny", np.array(1e-12, np.float32))
                self.const("attnx_q8__zero_f", np.array(0.0, np.float32))
                self.const("attnx_q8__zero_f128", np.array(float(_ZERO), np.float32))
                self.const("attnx_q8__zero", np.array(_ZERO, np.uint8))
            nodes += [  # max |x| per row without writing |x|: max(max x, -min x)
                helper.make_node("ReduceMax", [x, "attnx_q8__axis"], [f"{p}_hi"], keepdims=1, name=f"{p}_hi"),
                helper.make_node("ReduceMin", [x, "attnx_q8__axis"], [f"{p}_lo"], keepdims=1, name=f"{p}_lo"),
                helper.make_node("Neg", [f"{p}_lo"], [f"{p}_nlo"], name=f"{p}_nlo"),
                helper.make_node("Max", [f"{p}_hi", f"{p}_nlo", "attnx_q8__tiny"], [f"{p}_max"], name=f"{p}_max"),
                helper.make_node("Mul", [f"{p}_max", "attnx_q8__inv127"], [f"{p}_scale"], name=f"{p}_scale"),
                # the zero point must have the scale's shape: 128 per row
                helper.make_node("Mul", [f"{p}_scale", "attnx_q8__zero_f"], [f"{p}_z0"], name=f"{p}_z0"),
                helper.make_node("Add", [f"{p}_z0", "attnx_q8__zero_f128"], [f"{p}_z1"], name=f"{p}_z1"),
                helper.make_node("Cast", [f"{p}_z1"], [f"{p}_zp"], to=TensorProto.UINT8, name=f"{p}_zp"),
                # blocked quantization, one block = the whole last axis: one scale per row
                helper.make_node("QuantizeLinear", [x, f"{p}_scale", f"{p}_zp"], [f"{p}_u8"], axis=-1,
                                 block_size=width, name=f"{p}_u8"),
            ]
            self.rows[x] = (f"{p}_u8", f"{p}_scale")
        return self.rows[x]

    def rewrite(self, node: onnx.NodeProto, nodes: list) -> bool:
        """Append ``node``'s integer form to ``nodes``; False when it is not a constant-weight MatMul/Gemm."""
        if node.domain not in ("", "ai.onnx") or node.op_type not in QUANT_OPS:
            return False
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Gemm" and (attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0
                                       or attrs.get("beta", 1.0) != 1.0):
            return False
        weight = self.weight(node.input[1], transposed=bool(attrs.get("transB", 0)))
        if weight is None:
            return False
        w_u8, s_w, width = weight
        x_u8, s_x = self.rows_of(node.input[0], width, nodes)
        bias = [node.input[2]] if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2] else []
        if bias and (bias[0] not in self.inits or len(self.inits[bias[0]].dims) != 1):
            return False  # the fused op takes a [N] bias only
        # MatMulIntegerToFloat (ONNX Runtime's contrib op): the integer product, its scales and bias in one
        # pass; the standard MatMulInteger + Cast + Mul + Mul writes the [M, N] result three more times
        nodes.append(helper.make_node("MatMulIntegerToFloat", [x_u8, w_u8, s_x, s_w, "attnx_q8__zero", "attnx_q8__zero",
                                                               *bias], [node.output[0]], domain=ORT_DOMAIN,
                                      name=f"{node.name or node.output[0]}__q8"))
        self.count += 1
        return True


def decision_inputs(graph: onnx.GraphProto) -> set[str]:
    """Outputs of the MatMul/Gemm nodes nearest upstream of a discrete decision: an ``ArgMax`` or an
    attnx custom op (MAW's depth choice, SMAL's distances). Those stay float: quantisation noise of
    a few 1e-2 flips a choice whose margin is that small, and a flipped depth is a different model,
    not a slightly noisier one. Walks back through every other op, stopping at the first MatMul/Gemm."""
    from attnx.contract import DOMAIN

    producer = {o: n for n in graph.node for o in n.output}
    keep: set[str] = set()
    seen: set[int] = set()
    stack = [n for n in graph.node if n.domain == DOMAIN or n.op_type == "ArgMax"]
    while stack:
        node = stack.pop()
        for name in node.input:
            src = producer.get(name)
            if src is None or id(src) in seen:
                continue
            seen.add(id(src))
            if src.op_type in QUANT_OPS:
                keep.add(src.output[0])
            else:
                stack.append(src)
    return keep


def quantize_int8(model: onnx.ModelProto, exclude=()) -> tuple[onnx.ModelProto, int]:
    """An int8 copy of an fp32 ``model`` (see the module doc) and the number of MatMul/Gemm quantized;
    nodes named in ``exclude`` and those feeding a decision (:func:`decision_inputs`) stay float.
    Metadata, functions and opsets are kept; the caller marks the precision."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    rw = _Rewriter(graph)
    keep_float = decision_inputs(graph)
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.name in exclude or (node.output and node.output[0] in keep_float) or not rw.rewrite(node, nodes):
            nodes.append(node)
    if rw.count == 0:
        raise ValueError("nothing to quantize: the model has no MatMul/Gemm with a float32 constant weight "
                         "(is it already int8 or fp16?)")
    used = {i for n in nodes for i in n.input}
    kept = [t for t in graph.initializer if t.name in used]  # float weights now unused are dropped
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.initializer[:]
    graph.initializer.extend(kept + [t for t in rw.new_inits if t.name in used])
    del graph.value_info[:]  # stale shapes of rewritten tensors; inference re-derives them
    if not any(o.domain == ORT_DOMAIN for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(ORT_DOMAIN, 1))
    return out, rw.count


def quantize_file(src, dst) -> int:
    """Quantize the fp32 export ``src`` into ``dst`` (atomically), its metadata marked ``precision=int8``."""
    from pathlib import Path

    from attnx.contract import ModelInfo, load_onnx
    from attnx.export.exporter import save_model

    model = load_onnx(src, with_data=True)
    info = ModelInfo.read(model)
    if info is not None and info.precision != "fp32":
        raise ValueError(f"{Path(src).name} is {info.precision}: int8 quantizes an fp32 export")
    out, count = quantize_int8(model)
    if info is not None:
        info.precision = "int8"
        info.write(out)
    onnx.checker.check_model(out)
    save_model(out, Path(dst))
    return count
