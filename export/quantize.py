"""INT8 for CPU: weights of every MatMul/Gemm in int8, activations quantized per row at run time.

    attnx export --from-pretrained DIR --int8 -o model-int8.onnx

Each ``MatMul(x, W)`` whose ``W`` is a float initializer becomes::

    s_x = max|x| / 127 over the last axis (one scale per token)    ReduceMax, ReduceMin, Neg, Max, Mul
    x_u8 = round(x / s_x) + 128                                     QuantizeLinear (blocked: one block per row)
    y = (x_u8 - 128) W_s8 * s_x * s_W                               MatMulIntegerToFloat (com.microsoft)

``W_s8 = round(W / s_W)`` in [-63, 63], one symmetric scale per output column. Softmax, LayerNorm,
GELU, attention, the embeddings and the attnx custom ops (domain ``attnx``, with their function
bodies) stay in float: only top-level MatMul/Gemm with a constant weight are touched.

Why not ``onnxruntime.quantization.quantize_dynamic``: it quantizes activations with one scale
per *tensor* (``DynamicQuantizeLinear``). BERT-family models carry a few huge activations on
[CLS]/[SEP]; with one scale they swamp every other token, and on all-MiniLM-L6-v2 a 4-token
sentence's embedding drops to cosine 0.971 (0.973 with per-channel uint8 weights) against
sentence-transformers. One scale per token lifts it to 0.983 (every other built-in sentence >= 0.99,
mean 0.996). What is left is a few activation *channels* 5-25x larger than the rest (GELU outputs,
LayerNorm outputs): a token's one scale spans them, and every other channel gets a few levels.

**Smoothing** (SmoothQuant, Xiao et al. 2023) moves that range into the weights, exactly in float:
``x W = (x / s) (diag(s) W)`` with ``s_j = max|x_j|^a / max|W_j|^(1-a)`` per input channel, ``a =``
:data:`ALPHA`. ``max|x_j|`` is calibrated by running the fp32 file on :data:`CALIBRATION` sentences
(real text, none of them among the sentences ``attnx check`` measures). ``1/s`` folds into the
LayerNorm that produces ``x`` where it can (packed Q/K/V, FFN in), else one ``Mul``. On
all-MiniLM-L6-v2 the worst built-in sentence goes from cosine 0.983 to 0.995 (mean 0.999);
docs/performance.md. A model without a tokenizer calibrates on its synthetic example inputs.

**Weight bits.** Activations uint8, weights int8 (U8S8) is ONNX Runtime's fast integer GEMM. On
x86 with AVX2 but no VNNI it adds two u8 x s8 products into a saturating int16, and full-range
weights clip (255 * 127 * 2 > 32767: cosine 0.987 on "Ok."); weights in [-63, 63] cannot (ORT's
``reduce_range``). So the default is 7-bit weights, exact on every CPU. ``weight_bits=8`` (CLI
``--int8-weight-bits 8``) is for CPUs whose integer dot product accumulates in int32 (VNNI, AMX,
ARM): same speed, about half the weight rounding error (MiniLM worst sentence 0.991 -> 0.995);
:mod:`attnx.runtime.core.cpu` says which CPU is which, and the runtime warns when such a file is loaded
on one that clips. Measured (8x128, docs/performance.md): AVX2 without VNNI 1.4-1.55x fp32 (U8U8
8-bit, which cannot saturate there, 1.20x: a slower kernel); AMX / AVX-512 VNNI 1.9x.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

QUANT_OPS = ("MatMul", "Gemm")
#: SmoothQuant's migration strength: 0.6 was best on held-out MiniLM text (0.5: min cosine 0.994,
#: 0.6: 0.995, 0.7: 0.994, 0.8: 0.989).
ALPHA = 0.6
ORT_DOMAIN = "com.microsoft"
_ZERO = 128  # uint8 zero point of the activations: symmetric int8 stored as uint8
#: Weight bits a file may have: 7 (default; no int16 saturation in AVX2's u8 x s8 pair sums) or 8
#: (int32-accumulating CPUs only; module doc).
WEIGHT_BITS = (7, 8)


def _weight_s8(w: np.ndarray, bits: int = 7) -> tuple[np.ndarray, np.ndarray]:
    """``(W_s8, scale[N])``: symmetric per output column in [-(2^(bits-1) - 1), 2^(bits-1) - 1]."""
    levels = 2 ** (bits - 1) - 1
    scale = np.abs(w).max(axis=0) / levels
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q = np.clip(np.round(w / scale), -levels, levels)
    return q.astype(np.int8), scale


class _Rewriter:
    def __init__(self, graph: onnx.GraphProto, weight_bits: int):
        self.graph = graph
        self.weight_bits = weight_bits
        self.inits = {t.name: t for t in graph.initializer}
        self.new_inits: list[onnx.TensorProto] = []
        self.rows: dict[str, tuple[str, str]] = {}  # activation -> (x_u8, s_x): q, k, v share one
        self.weights: dict[tuple[str, bool], tuple[str, str, int]] = {}  # (weight, transposed) -> (W_s8, s_W, K)
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
            q, scale = _weight_s8(w.T if transposed else w, self.weight_bits)
            tag = f"{name}{'_T' if transposed else ''}"
            self.weights[key] = (self.const(f"{tag}__s8", q), self.const(f"{tag}__scale", scale), q.shape[0])
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
                self.const("attnx_q8__zero_s8", np.array(0, np.int8))
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
        w_s8, s_w, width = weight
        bias = [node.input[2]] if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2] else []
        if bias and (bias[0] not in self.inits or len(self.inits[bias[0]].dims) != 1):
            return False  # the fused op takes a [N] bias only
        x_u8, s_x = self.rows_of(node.input[0], width, nodes)
        # MatMulIntegerToFloat (ONNX Runtime's contrib op): the integer product and its scales in one pass;
        # the standard MatMulInteger + Cast + Mul + Mul writes the [M, N] result three more times. Its own
        # bias input is not used: with per-row activation scales ORT 1.31 adds it wrongly (measured), so a
        # Gemm's bias stays a separate Add.
        name = f"{node.name or node.output[0]}__q8"
        product = f"{node.output[0]}__q8" if bias else node.output[0]
        nodes.append(helper.make_node("MatMulIntegerToFloat", [x_u8, w_s8, s_x, s_w, "attnx_q8__zero", "attnx_q8__zero_s8"],
                                      [product], domain=ORT_DOMAIN, name=name))
        if bias:
            nodes.append(helper.make_node("Add", [product, bias[0]], [node.output[0]], name=f"{name}_bias"))
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


# --------------------------------------------------------------------------- smoothing


def _smoothable(graph: onnx.GraphProto, skip: set[str]) -> dict[str, list[onnx.NodeProto]]:
    """``{activation: [MatMul, ...]}``: top-level MatMuls with a 2-D float constant weight that will
    be quantized, grouped by the activation they read."""
    inits = {t.name: t for t in graph.initializer}
    groups: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or node.name in skip or node.output[0] in skip:
            continue
        w = inits.get(node.input[1])
        if w is not None and w.data_type == TensorProto.FLOAT and len(w.dims) == 2:
            groups.setdefault(node.input[0], []).append(node)
    return groups


def calibrate(model: onnx.ModelProto, activations: list[str], feeds: list[dict]) -> dict[str, np.ndarray]:
    """Per-channel ``max |x|`` of each activation over the calibration ``feeds`` (ONNX Runtime, fp32)."""
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    known = {o.name for o in probe.graph.output}
    probe.graph.output.extend(helper.make_empty_tensor_value_info(a) for a in activations if a not in known)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(probe.SerializeToString(), so, providers=["CPUExecutionProvider"])
    amax = {a: None for a in activations}
    for feed in feeds:
        for a, out in zip(activations, sess.run(activations, feed)):
            m = np.abs(out.reshape(-1, out.shape[-1])).max(axis=0)
            amax[a] = m if amax[a] is None else np.maximum(amax[a], m)
    return amax


def smooth(model: onnx.ModelProto, feeds: list[dict], exclude=(), alpha: float = ALPHA) -> int:
    """SmoothQuant in place (see the module doc): weights scaled by ``s`` per input row, activations
    by ``1/s`` (folded into a producing LayerNormalization when it feeds only these MatMuls, else a
    ``Mul``). Exact in float. Returns the number of activations smoothed."""
    graph = model.graph
    groups = _smoothable(graph, set(exclude) | decision_inputs(graph))
    if not groups or not feeds:
        return 0
    amax = calibrate(model, list(groups), feeds)
    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, int] = {}
    for n in graph.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    graph_outputs = {o.name for o in graph.output}
    inserted: list[tuple[onnx.NodeProto, onnx.NodeProto]] = []  # (after this node, insert this)
    for x, nodes in groups.items():
        weights = [numpy_helper.to_array(inits[n.input[1]]) for n in nodes]
        w_max = np.max([np.abs(w).max(axis=1) for w in weights], axis=0)
        s = np.maximum(amax[x], 1e-5) ** alpha / np.maximum(w_max, 1e-5) ** (1 - alpha)
        s = np.clip(s, 1e-2, 1e2).astype(np.float32)  # dead channels and zero rows stay sane
        for n, w in zip(nodes, weights):  # a new initializer: the weight may be shared (a tied embedding)
            scaled = f"{n.input[1]}__smooth_{x}"
            graph.initializer.append(numpy_helper.from_array((w * s[:, None]).astype(np.float32), scaled))
            n.input[1] = scaled
        src = producer.get(x)
        foldable = (src is not None and src.op_type == "LayerNormalization" and src.domain in ("", "ai.onnx")
                    and len(src.output) == 1 and readers.get(x, 0) == len(nodes) and x not in graph_outputs
                    and all(i in inits for i in src.input[1:3]) and len(src.input) >= 2)
        if foldable:  # LN(x) * g / s + b / s: new initializers (a LayerNorm's parameters may be shared)
            for k, name in enumerate(src.input[1:3], start=1):
                v = numpy_helper.to_array(inits[name]) / s
                new = f"{name}__smooth_{x}"
                graph.initializer.append(numpy_helper.from_array(v.astype(np.float32), new))
                src.input[k] = new
        else:
            inv = f"{x}__smooth_inv"
            graph.initializer.append(numpy_helper.from_array((1.0 / s).astype(np.float32), inv))
            mul = helper.make_node("Mul", [x, inv], [f"{x}__smooth"], name=f"{x}__smooth")
            for n in nodes:
                n.input[0] = mul.output[0]
            inserted.append((src, mul))
    if inserted:  # keep the node list topologically sorted: each Mul right after its producer
        after = {id(src): [] for src, _ in inserted}
        for src, mul in inserted:
            after[id(src)].append(mul)
        first = [mul for src, mul in inserted if src is None]  # graph inputs
        nodes = first + [m for n in graph.node for m in (n, *after.get(id(n), []))]
        del graph.node[:]
        graph.node.extend(nodes)
    return len(groups)


def _check_bits(weight_bits: int) -> None:
    if weight_bits not in WEIGHT_BITS:
        raise ValueError(f"int8 weight bits {weight_bits!r}: valid: 7 (every CPU) or 8 (VNNI, AMX, ARM)")


def quantize_int8(model: onnx.ModelProto, exclude=(), weight_bits: int = 7) -> tuple[onnx.ModelProto, int]:
    """An int8 copy of an fp32 ``model`` (see the module doc) and the number of MatMul/Gemm quantized;
    nodes named in ``exclude`` and those feeding a decision (:func:`decision_inputs`) stay float.
    Metadata, functions and opsets are kept; the caller marks the precision."""
    _check_bits(weight_bits)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    rw = _Rewriter(graph, weight_bits)
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


def calibration_feeds(path, info) -> list[dict]:
    """One feed per :data:`CALIBRATION` sentence through the export's own tokenizer (batch 1, no
    padding); a model without a tokenizer: eight synthetic batches. Context inputs are random but valid."""
    from attnx.contract import Role
    from attnx.export.tokenizer import ExportTokenizer
    from attnx.feeds import synthetic_feeds
    from attnx.pretrained.sentences import CALIBRATION

    specs = list(info.inputs)
    rng = np.random.default_rng(0)
    if not info.tokenizer:  # synthetic batches; token ids drawn over the whole vocabulary
        seq_max = int((info.profiles or {}).get("seq", (1, 1, 128))[2])  # a model's positions cap it
        feeds = [synthetic_feeds(specs, 2, min(16 * (1 + i), seq_max), rng) for i in range(8)]
        for feed in feeds:
            for spec in specs:
                if spec.role == Role.INPUT_IDS and spec.range is not None:
                    feed[spec.name] = rng.integers(*spec.range, size=feed[spec.name].shape).astype(spec.dtype)
        return feeds
    feeds = []
    for enc in ExportTokenizer(path, info).encode(CALIBRATION):
        if info.cache:  # a decoder with its KV cache: the prefill a generation starts with
            feeds.append(prefill_feed(specs, enc.ids))
            continue
        feed = synthetic_feeds(specs, 1, len(enc.ids), rng)
        text = {Role.INPUT_IDS: enc.ids, Role.TOKEN_TYPE_IDS: enc.type_ids}
        for spec in specs:
            if spec.role in text:
                feed[spec.name] = np.asarray([text[spec.role]], dtype=spec.dtype)
        feeds.append(feed)
    return feeds


def prefill_feed(specs, ids) -> dict:
    """A with-past file's first step on ``ids`` (batch 1), as attnx's decoder feeds it: every cached tensor one
    masked slot of zeros (the ``past`` axis 1, other dynamic axes 1), the mask ``[0, 1 * len]`` over slot and
    tokens, positions ``0 .. len-1``. (Unnamed dynamic axes at 1 and a mask as long as the ids, which
    :func:`attnx.feeds.synthetic_feeds` gives, is a past of 1 with a mask that does not cover it: ONNX Runtime
    fails inside the attention's gather.)"""
    from attnx.contract import BATCH, SEQ, Role

    n = len(ids)
    feed = {}
    for spec in specs:
        dtype = np.dtype(spec.dtype)
        if spec.role == Role.INPUT_IDS:
            feed[spec.name] = np.asarray([ids], dtype=dtype)
        elif spec.role == Role.ATTENTION_MASK:
            feed[spec.name] = np.asarray([[0] + [1] * n], dtype=dtype)
        elif spec.role == Role.POSITION_IDS:
            feed[spec.name] = np.arange(n, dtype=dtype).reshape(1, n)
        else:
            shape = [1 if d == BATCH else n if d == SEQ else d if isinstance(d, int) else 1 for d in spec.shape]
            feed[spec.name] = (np.ones if spec.default == "ones" else np.zeros)(shape, dtype=dtype)  # cache: zeros
    return feed


def quantize_file(src, dst, smoothing: bool = True, weight_bits: int = 7) -> int:
    """Quantize the fp32 export ``src`` into ``dst`` (atomically), its metadata marked ``precision=int8``
    with how (``quantization``); ``smoothing``: calibrate and smooth first (:func:`smooth`; needs the
    file's attnx metadata); ``weight_bits``: 7 or 8 (module doc)."""
    from pathlib import Path

    from attnx.contract import ModelInfo, load_onnx
    from attnx.export.saving import save_model

    _check_bits(weight_bits)
    model = load_onnx(src, with_data=True)
    info = ModelInfo.read(model)
    if info is not None and info.precision != "fp32":
        raise ValueError(f"{Path(src).name} is {info.precision}: int8 quantizes an fp32 export")
    smoothed, feeds = 0, []
    if smoothing and info is not None:
        feeds = calibration_feeds(src, info)
        smoothed = smooth(model, feeds)
    out, count = quantize_int8(model, weight_bits=weight_bits)
    if info is not None:
        info.precision = "int8"
        info.quantization = {
            "weights": "int8, symmetric per output column", "weight_bits": weight_bits,
            "activations": "uint8, symmetric per token at run time", "matmuls": count,
            "smoothing_alpha": ALPHA if smoothed else None,
            "calibration": None if not smoothed else
            f"{len(feeds)} {'built-in sentences' if info.tokenizer else 'synthetic batches'}",
        }
        info.write(out)
    onnx.checker.check_model(out)
    save_model(out, Path(dst), external=True if info is not None and info.cache else None)
    return count
