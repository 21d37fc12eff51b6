"""Weight-only block-wise quantization of a with-past decoder: every ``MatMul(x, W)`` with a constant ``W``
becomes ONNX Runtime's ``MatMulNBits`` (domain ``com.microsoft``), as onnxruntime-genai's builder writes.

    attnx export --from-pretrained DIR --with-past --weights int4     # or int8

``W [K, N]`` is stored per output column in blocks of :data:`BLOCK_SIZE` along ``K``: ``bits``-bit
integers, symmetric (no zero points), one fp32 scale per block. Activations stay fp32: nothing is
calibrated, so any placed variant works (its custom ops and their function bodies are not touched:
only top-level MatMuls with a constant weight are). ``accuracy_level`` :data:`ACCURACY_LEVEL` lets the
CPU kernel quantize each row of ``x`` to int8 per block and run an integer dot product (what
onnxruntime-genai's CPU int4 models use); without it, the kernel dequantizes ``W`` to fp32 every call.

Why this and not ``--int8``: decode at batch 1 reads every weight once per token, so it is bound by memory
bandwidth, and bytes per weight are what count (fp32 4, int8 ~1.1, int4 ~0.6 with the scales).
``--int8`` quantizes activations too (calibrated, per token) for prefill- and batch-heavy encoders.

The embedding (``Gather``) stays fp32: it reads one row per token. A tied ``lm_head`` is exported as
``MatMul(x, Transpose(embedding))``, which the quantizer would leave fp32, and for a small model it is the
largest weight read per token (SmolLM2-135M: 113 MB of its 179 MB at int4). So it gets its own transposed
copy, quantized like every other projection (:func:`untie_transposed_weights`): the file grows by that copy
(int4 ~1/6 of the table), each token reads ~1/6 of it.
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


def quantize_weights(src, dst, bits: int, block_size: int = BLOCK_SIZE) -> int:
    """Quantize the fp32 export ``src`` into ``dst`` (atomically); returns how many MatMuls became MatMulNBits.
    The metadata says ``precision`` (:func:`precision_of`) and how (``quantization``)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

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
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=True,
                                     accuracy_level=ACCURACY_LEVEL, op_types_to_quantize=("MatMul",))
    log = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")  # a line per node at INFO
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        quantizer.process()  # replaces the nodes and drops the fp32 weights no node reads any more
    finally:
        log.setLevel(level)
    out = quantizer.model.model
    count = sum(n.op_type == "MatMulNBits" for n in out.graph.node)
    if count == 0:
        raise ValueError(f"{Path(src).name} has no MatMul with a constant 2-D weight to quantize")
    if info is not None:
        info.precision = precision_of(bits)
        info.quantization = {
            "method": "weight-only, com.microsoft MatMulNBits", "weights": f"int{bits}, symmetric, per block of "
            f"{block_size} along K per output column, fp32 scales", "bits": bits, "block_size": block_size,
            "accuracy_level": ACCURACY_LEVEL, "matmuls": count, "activations": "fp32",
            "embedding": "fp32 (Gather)",
        }
        if untied:
            info.quantization["tied_lm_head"] = "quantized as its own transposed copy (the Gather keeps the fp32 table)"
        info.write(out)
    onnx.checker.check_model(out)
    save_model(out, Path(dst))
    return count
