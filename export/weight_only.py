"""Weight-only block-wise quantization of a with-past decoder: every ``MatMul(x, W)`` with a constant ``W``
becomes ONNX Runtime's ``MatMulNBits`` (domain ``com.microsoft``), as onnxruntime-genai's builder writes.

    attnx export --from-pretrained DIR --with-past --weights int4     # or int8

``W [K, N]`` is stored per output column in blocks of :data:`BLOCK_SIZE` along ``K``, one fp32 scale per block,
round to nearest, nothing calibrated (so any placed variant works: its custom ops and their function bodies are
not touched, only top-level MatMuls with a constant weight are):

- ``int8``: asymmetric blocks, ``q = round(w / scale) + zero_point`` with a uint8 zero point per block.
- ``int4``: symmetric 4-bit blocks (no zero points) for every projection but the lm_head (the MatMul whose
  result is the output ``logits``, :func:`lm_head`), which is stored as the int8 blocks above
  (:data:`LM_HEAD_BITS`); llama.cpp also keeps the output matrix at more bits for its 4-bit types.

Why, measured on SmolLM2-135M (perplexity over 256 tokens, against fp32): int8 symmetric +1.5%, asymmetric +0.6%
at the same speed; int4 with a 4-bit lm_head +14.4%, with the int8 one +8.4% for ~12% more decode time (still
~2.9x faster than fp32). ORT's asymmetric 4-bit rounds the zero point (+28%), HQQ's float zero points take its
slow kernel (12x).

``accuracy_level`` :data:`ACCURACY_LEVEL`: the CPU kernel quantizes each row of ``x`` to int8 per block of ``K``
(one scale per block) and runs an integer dot product (what onnxruntime-genai's CPU int4 models use); without
it, it dequantizes ``W`` to fp32 every call (~80x slower at int8). Inputs and outputs stay fp32.

Why this and not ``--int8``: decode at batch 1 reads every weight once per token, so it is bound by memory
bandwidth, and bytes per weight are what count (fp32 4, int8 ~1.2 with scales and zero points, int4 ~0.6).
``--int8`` quantizes activations too (calibrated, per token) for prefill- and batch-heavy encoders.

The embedding (``Gather``) stays fp32: it reads one row per token. A tied ``lm_head`` is exported as
``MatMul(x, Transpose(embedding))``, which the quantizer would leave fp32, and for a small model it is the
largest weight read per token (SmolLM2-135M: 113 MB of its fp32 179 MB). So it gets its own transposed copy
(:func:`untie_transposed_weights`), quantized at 8 bits as above: the file grows by that copy (~1/3.5 of the
table), each token reads that much of it.
"""

from __future__ import annotations

import logging
from pathlib import Path

#: Weight bits ``--weights`` offers, by name.
WEIGHTS = {"int4": 4, "int8": 8}
#: Elements of ``K`` that share one scale (onnxruntime-genai's CPU int4 default).
BLOCK_SIZE = 32
#: MatMulNBits' ``accuracy_level``: 4 = int8 compute (the CPU kernel's fast path).
ACCURACY_LEVEL = 4
#: Bits of the lm_head of an ``int4`` export (asymmetric blocks, as ``int8``'s).
LM_HEAD_BITS = 8
#: The graph output the lm_head computes.
LOGITS = "logits"
#: Ops :func:`lm_head` walks back through along their first (data) input.
_DATA_FIRST = {"Reshape", "Slice", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Cast", "Gather", "Tanh",
               "Transpose", "Expand"}
#: Ops :func:`lm_head` walks back through when all but one input are constants (a bias, a scale, a cap).
_ONE_OPERAND = {"Add", "Sub", "Mul", "Div"}


def precision_of(bits: int) -> str:
    """The ``attnx.precision`` of a weight-only quantized export."""
    return f"int{bits}-weights"


def untie_transposed_weights(graph) -> int:
    """Each top-level ``MatMul(x, Transpose(W))`` with a constant 2-D ``W`` (a tied ``lm_head``) reads its own
    initializer ``W.T`` instead; a Transpose nothing reads any more goes. Returns how many MatMuls were rewired."""
    import numpy as np
    from onnx import helper, numpy_helper

    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    transposed: dict[str, str] = {}  # W -> W.T's initializer
    count = 0
    for node in graph.node:
        t = producer.get(node.input[1]) if node.op_type == "MatMul" else None
        if t is None or t.op_type != "Transpose" or t.input[0] not in inits or len(inits[t.input[0]].dims) != 2:
            continue
        perm = next((list(helper.get_attribute_value(a)) for a in t.attribute if a.name == "perm"), [1, 0])
        if perm != [1, 0]:
            continue
        if t.input[0] not in transposed:
            name = f"{t.input[0]}.T"
            while name in inits:
                name += "_"
            weight = numpy_helper.to_array(inits[t.input[0]])
            graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(weight.T), name))
            inits[name] = graph.initializer[-1]
            transposed[t.input[0]] = name
        node.input[1] = transposed[t.input[0]]
        count += 1
    read = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    unused = [n for n in graph.node if n.op_type == "Transpose" and n.input[0] in transposed
              and not read & set(n.output)]
    for n in unused:
        graph.node.remove(n)
    return count


def lm_head(graph, output: str = LOGITS):
    """The ``MatMul`` with a constant 2-D weight whose result is the graph output ``output`` (the lm_head), found
    by walking back from that output through ops that only reshape, select or rescale one computed input (a
    Reshape, a Slice of the last positions, a bias Add, a soft-cap's Tanh and Mul...); ``None`` when the walk
    meets anything else first (a norm, an attention, a second computed operand) or there is no such output."""
    inits = {t.name: t for t in graph.initializer}
    constant = set(inits) | {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    producer = {o: n for n in graph.node for o in n.output}
    name, seen = output, set()
    if output not in {o.name for o in graph.output}:
        return None
    while name in producer and name not in seen:
        seen.add(name)
        node = producer[name]
        if node.op_type == "MatMul" and node.domain in ("", "ai.onnx"):
            weight = inits.get(node.input[1])
            return node if weight is not None and len(weight.dims) == 2 else None
        if node.op_type in _DATA_FIRST:  # the other inputs are shapes, indices, axes: follow the data
            name = node.input[0]
        elif node.op_type in _ONE_OPERAND:  # follow the one operand that is not a constant
            computed = [i for i in node.input if i and i not in constant]
            if len(computed) != 1:
                return None
            name = computed[0]
        else:
            return None
    return None


def _quantize(model, bits: int, block_size: int, symmetric: bool, exclude=()):
    """One MatMulNBitsQuantizer pass over every top-level constant 2-D ``MatMul`` of ``model`` not named in
    ``exclude``; returns the quantized ModelProto (the fp32 weights no node reads any more are dropped)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=symmetric,
                                     accuracy_level=ACCURACY_LEVEL, nodes_to_exclude=list(exclude),
                                     op_types_to_quantize=("MatMul",))
    log = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")  # a line per node at INFO
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        quantizer.process()
    finally:
        log.setLevel(level)
    return quantizer.model.model


def _blocks(bits: int, symmetric: bool, block_size: int) -> str:
    zero = "symmetric (no zero points)" if symmetric else "asymmetric (a uint8 zero point per block)"
    return f"int{bits}, {zero}, blocks of {block_size} along K per output column, one fp32 scale per block"


def quantize_weights(src, dst, bits: int, block_size: int = BLOCK_SIZE) -> int:
    """Quantize the fp32 export ``src`` into ``dst`` (atomically); returns how many MatMuls became MatMulNBits.
    ``bits`` 8: every one asymmetric at 8 bits. ``bits`` 4: symmetric at 4 bits but the lm_head
    (:func:`lm_head`), asymmetric at :data:`LM_HEAD_BITS` (every one at 4 bits if there is none).
    The metadata says ``precision`` (:func:`precision_of`) and how (``quantization``)."""
    import onnx
    from onnx import helper

    from attnx.contract import ModelInfo, load_onnx
    from attnx.export.exporter import save_model

    if bits not in WEIGHTS.values():
        raise ValueError(f"weight-only quantization takes 4 or 8 bits, got {bits}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block size must be a power of 2 >= 16, got {block_size}")
    model = load_onnx(src, with_data=True)
    info = ModelInfo.read(model)
    if info is not None and info.precision != "fp32":
        raise ValueError(f"{Path(src).name} is {info.precision}: weight-only quantization takes an fp32 export")
    untied = untie_transposed_weights(model.graph)
    head = lm_head(model.graph)
    if head is not None and (not head.name or sum(n.name == head.name for n in model.graph.node) > 1):
        names = {n.name for n in model.graph.node}
        head.name = next(f"lm_head_{i}" for i in range(len(names) + 1) if f"lm_head_{i}" not in names)
    symmetric = bits == 4  # ORT's asymmetric 4-bit rounds the zero point: worse (module doc)
    if bits == 8 or head is None:
        out = _quantize(model, bits, block_size, symmetric)
        head_bits = bits if head is not None else None
    else:
        out = _quantize(model, bits, block_size, symmetric, exclude=[head.name])
        # ``nodes_to_include`` does not restrict the default algorithm (it adds to ``op_types_to_quantize``):
        # every node but the head is excluded instead
        out = _quantize(out, LM_HEAD_BITS, block_size, False, exclude=[n.name for n in out.graph.node
                                                                       if n.name != head.name])
        head_bits = LM_HEAD_BITS
    nbits = {n.output[0]: {a.name: helper.get_attribute_value(a) for a in n.attribute}["bits"]
             for n in out.graph.node if n.op_type == "MatMulNBits"}
    count = len(nbits)
    if count == 0:
        raise ValueError(f"{Path(src).name} has no MatMul with a constant 2-D weight to quantize")
    wrong = {o: b for o, b in nbits.items() if b != (head_bits if head is not None and o == head.output[0] else bits)}
    if wrong or (head is not None and head.output[0] not in nbits):  # the quantizer's node filters, checked
        raise RuntimeError(f"MatMulNBitsQuantizer did not write the bits asked for: {wrong or 'the lm_head left fp32'}")
    if info is not None:
        info.precision = precision_of(bits)
        info.quantization = {
            "method": "weight-only, com.microsoft MatMulNBits, round to nearest, no calibration",
            "weights": _blocks(bits, symmetric, block_size) + (
                f"; the lm_head {_blocks(LM_HEAD_BITS, False, block_size)}" if head_bits not in (None, bits) else ""),
            "bits": bits, "symmetric": symmetric, "block_size": block_size, "accuracy_level": ACCURACY_LEVEL,
            "matmuls": count, "lm_head_bits": head_bits,
            "lm_head_symmetric": None if head_bits is None else symmetric if head_bits == bits else False,
            "activations": f"fp32 in and out; each MatMulNBits (accuracy_level {ACCURACY_LEVEL}, CPU) quantizes "
            f"each row of its input to int8, one scale per block of {block_size} along K, for an integer dot "
            "product with the weight blocks",
            "embedding": "fp32 (Gather)",
        }
        if head is None:
            info.quantization["lm_head"] = f"not found (no MatMul with a constant weight computes {LOGITS!r}): " \
                                           f"every MatMul at {bits} bits"
        if untied:
            info.quantization["tied_lm_head"] = "quantized as its own transposed copy (the Gather keeps the fp32 table)"
        info.write(out)
    onnx.checker.check_model(out)
    save_model(out, Path(dst), external=True)  # a with-past decoder: weights in <name>.data, as its fp32 file
    return count
