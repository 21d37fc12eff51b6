"""Weight-only block-wise quantization of a with-past decoder, inside the export: every ``MatMul(x, W)`` with a
constant 2-D ``W`` becomes ONNX Runtime's ``MatMulNBits`` (domain ``com.microsoft``), as onnxruntime-genai's
builder writes, and the embedding's ``Gather`` becomes ``GatherBlockQuantized``.

    attnx export --from-pretrained DIR --with-past --weights int4     # or int8

``W [K, N]`` is stored per output column in blocks along ``K`` (:data:`LARGE_BLOCK_SIZE` where that divides every
``K``, else :data:`BLOCK_SIZE`: :func:`block_size_for`; ``--block-size`` chooses), one fp32 scale per block,
round to nearest, nothing calibrated (so any placed variant works: its custom ops and their function bodies are
not touched, only top-level MatMuls with a constant weight are):

- ``int8``: asymmetric blocks, ``q = round(w / scale) + zero_point`` with a uint8 zero point per block.
- ``int4``: symmetric 4-bit blocks (no zero points) for every projection but the lm_head (the MatMul whose
  result is the output ``logits``, :func:`lm_head`), which is stored as the int8 blocks above
  (:data:`LM_HEAD_BITS`; ``--lm-head-bits 4`` stores it as the projections, as onnxruntime-genai's int4 and GGUF's
  ``--pure`` Q4_0 do); llama.cpp's own 4-bit types also keep the output matrix at more bits.

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

The embedding table is block-quantized too, along the hidden axis, and read by ``GatherBlockQuantized``
(``gather_axis`` 0, ``quantize_axis`` 2 of the table's ``[vocab, blocks, bytes]`` form, a ``Reshape`` of the
rows after it): a tied lm_head (``MatMul(x, Transpose(embedding))``) and the Gather share ONE table, the head's
``MatMulNBits`` weight, at the head's bits (8 in an int4 export); an untied embedding is quantized at the
projections' bits. So the file's size follows the bits (SmolLM2-135M's fp32 table was 113 MB of its int4 file).

Nothing is quantized before the file is written: each ``MatMulNBits`` weight, scales and zero points are lazy
tensors (``ir.LazyTensor``) computed from their one source tensor when the writer reaches them (:func:`quantize_graph`,
one quantized weight cached while its two or three initializers are written), in chunks of rows, with ONNX
Runtime's own packers (``quantize_matmul_4bits`` / ``quantize_matmul_8bits``: the bytes MatMulNBitsQuantizer
writes). A weight streamed from its checkpoint (:mod:`attnx.export.streaming`) is read in its own dtype and
widened a chunk at a time: no fp32 copy of the model, and no second pass over a written file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir

#: Weight bits ``--weights`` offers, by name.
WEIGHTS = {"int4": 4, "int8": 8}
#: Elements of ``K`` that share one scale (onnxruntime-genai's CPU int4 default, GGUF's Q4_0 / Q8_0).
BLOCK_SIZE = 32
#: The blocks where they divide every weight's ``K`` and no weight carries a source's own blocks at the export's
#: bits (:func:`block_size_for`). On SmolLM2-135M against 32: int4 0.83x the decode time, a 9% smaller file,
#: perplexity +7.4% against fp32 where 32 gives +8.2%; int8 0.95x, 7% smaller, +0.35% where 32 gives +0.68%
#: (docs/performance.md, issue 48).
LARGE_BLOCK_SIZE = 64
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



#: Rows of a weight quantized at once (chunks keep the fp32 working set small whatever the tensor's size).
CHUNK_ELEMENTS = 1 << 22
_MS = "com.microsoft"


def _blocks(bits: int, symmetric: bool, block_size: int) -> str:
    zero = "symmetric (no zero points)" if symmetric else "asymmetric (a uint8 zero point per block)"
    return f"int{bits}, {zero}, blocks of {block_size} along K per output column, one fp32 scale per block"


def quantize_rows(rows, bits: int, symmetric: bool, block_size: int = BLOCK_SIZE, shape=None):
    """``rows [N, K]`` as MatMulNBits' ``(B [N, blocks, bytes], scales [N, blocks], zero_points [N, ceil(blocks *
    bits / 8)])`` with ONNX Runtime's own packers (the bytes MatMulNBitsQuantizer writes for the weight ``rows.T``),
    a chunk of rows at a time. ``rows``: a torch tensor of any float dtype or a numpy array, or (with ``shape``)
    ``rows(start, stop)`` reading a chunk, so the weight is never whole in fp32 (or at all)."""
    import torch
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    if callable(rows):
        n, k = shape
        read = rows
    else:
        if not isinstance(rows, torch.Tensor):
            import warnings

            with warnings.catch_warnings():  # a read-only view (a memory-mapped weight): only ever read here
                warnings.simplefilter("ignore", UserWarning)
                rows = torch.from_numpy(np.asarray(rows))
        n, k = (int(d) for d in rows.shape)
        read = lambda start, stop: rows[start:stop]  # noqa: E731
    blocks = -(-k // block_size)
    per_byte = 8 // bits
    packed = np.empty((n, blocks, block_size * bits // 8), np.uint8)
    scales = np.empty((n, blocks), np.float32)
    zero_points = np.empty((n, -(-blocks // per_byte)), np.uint8)
    pack = quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits
    step = max(1, CHUNK_ELEMENTS // max(1, k))
    for start in range(0, n, step):
        chunk = read(start, min(n, start + step)).T.contiguous().to(torch.float32).numpy()  # [K, c]: ORT's layout
        cols = chunk.shape[1]
        if blocks * block_size != k:
            chunk = np.pad(chunk, ((0, blocks * block_size - k), (0, 0)))
        p = np.zeros((cols, blocks, packed.shape[2]), np.uint8)
        sc = np.zeros((cols, blocks), np.float32)
        zp = np.zeros((cols, zero_points.shape[1]), np.uint8)
        pack(p, chunk, sc, zp, block_size, cols, k, symmetric)
        packed[start:start + cols], scales[start:start + cols], zero_points[start:start + cols] = p, sc, zp
    return packed, scales, zero_points


def _rows(tensor: ir.TensorProtocol, transposed: bool):
    """The weight as ``[N, K]`` rows, in the source's own dtype where it is streamed: ``tensor`` itself
    (``transposed`` False: an embedding table, or a tied head's ``W`` before its Transpose) or ``tensor.T``;
    a reader of row chunks where the source reads ranges of rows."""
    import torch

    reader = getattr(tensor, "attnx_transposed_rows" if transposed else "attnx_read_rows", None)
    if reader is not None:
        return reader
    read = getattr(tensor, "attnx_torch", None)
    if read is not None:
        t = read()
    else:
        import warnings

        with warnings.catch_warnings():  # a read-only view (a memory-mapped weight): only ever read here
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(np.asarray(tensor.numpy()))
    return t.T if transposed else t


class _Quantized:
    """One weight's MatMulNBits initializers as lazy tensors, computed together once (one cached at a time)."""

    current: dict = {}  # {"key": owner, "value": (B, scales, zero_points)}: the one weight being written

    def __init__(self, tensor: ir.TensorProtocol, transposed: bool, bits: int, symmetric: bool, block_size: int,
                 name: str):
        self.tensor, self.transposed, self.bits, self.symmetric, self.block = tensor, transposed, bits, symmetric, \
            block_size
        # A source holding MatMulNBits' own blocks at these bits (GGUF Q4_0 / Q8_0): carried over as they are,
        # with the format's zero point (the default: 8, 128), so no zero-point input
        prefix = "attnx_transposed_blocks" if transposed else "attnx_blocks"
        self.carried = getattr(tensor, prefix, None) if getattr(tensor, f"{prefix}_bits", None) == bits and \
            block_size == 32 else None
        if self.carried is not None and not self._carries(self.carried()):  # (read now and dropped: the node's
            self.carried = None                                              # inputs depend on it)
        if self.carried is not None:
            self.symmetric = True
        shape = list(tensor.shape)
        self.n, self.k = (shape[1], shape[0]) if transposed else (shape[0], shape[1])
        blocks = -(-self.k // block_size)
        self.shapes = ([self.n, blocks, block_size * bits // 8], [self.n, blocks],
                       [self.n, -(-blocks // (8 // bits))])
        self.name = name

    def _carries(self, blocks) -> bool:
        return blocks is not None and (blocks.bits, blocks.block_size, blocks.zero_points) == (self.bits, self.block,
                                                                                               None)

    def _value(self, i: int) -> ir.Tensor:
        cache = _Quantized.current
        if cache.get("key") is not self:
            cache.clear()  # the previous weight's result goes before this one is computed
            blocks = self.carried() if self.carried is not None else None
            if self._carries(blocks):
                cache["value"] = (blocks.data, blocks.scales, None)
            else:
                cache["value"] = quantize_rows(_rows(self.tensor, self.transposed), self.bits, self.symmetric,
                                               self.block, shape=(self.n, self.k))
            cache["key"] = self
        return ir.Tensor(cache["value"][i], name=f"{self.name}{('_Q%d' % self.bits, '_scales', '_zero_points')[i]}")

    def lazy(self, i: int) -> ir.LazyTensor:
        dtype = ir.DataType.FLOAT if i == 1 else ir.DataType.UINT8
        return ir.LazyTensor(lambda: self._value(i), dtype=dtype, shape=ir.Shape(self.shapes[i]),
                             name=f"{self.name}{('_Q%d' % self.bits, '_scales', '_zero_points')[i]}")


def _onnx(node, op: str) -> bool:
    return node is not None and node.op_type == op and node.domain in ("", "ai.onnx")


def _constant_2d(value) -> ir.TensorProtocol | None:
    if value is None or not value.is_initializer() or value.const_value is None:
        return None
    t = value.const_value
    return t if len(t.shape) == 2 and t.dtype == ir.DataType.FLOAT else None


def _head_node(graph: ir.Graph, output: str = LOGITS):
    """:func:`lm_head` on the onnx-ir graph: the MatMul computing ``output`` through reshapes, selections and
    one-operand rescales, with a constant 2-D weight or ``Transpose`` of one (a tied head)."""
    outs = {v.name: v for v in graph.outputs}
    value, seen = outs.get(output), set()
    while value is not None and value.producer() is not None and id(value) not in seen:
        seen.add(id(value))
        node = value.producer()
        if _onnx(node, "MatMul"):
            w = node.inputs[1]
            t = w.producer() if w is not None else None
            if _constant_2d(w) is not None or (_onnx(t, "Transpose") and _constant_2d(t.inputs[0]) is not None):
                return node
            return None
        if node.op_type in _DATA_FIRST and node.domain in ("", "ai.onnx"):
            value = node.inputs[0]
        elif node.op_type in _ONE_OPERAND and node.domain in ("", "ai.onnx"):
            computed = [v for v in node.inputs if v is not None and v.const_value is None]
            if len(computed) != 1:
                return None
            value = computed[0]
        else:
            return None
    return None


def _initializers(graph: ir.Graph, q: _Quantized, with_zero_points: bool):
    from attnx.export.graph import add_initializer

    lazies = [q.lazy(i) for i in range(2 + with_zero_points)]
    return [add_initializer(graph, t.name, t) for t in lazies]


def _matmul_nbits(graph: ir.Graph, node: ir.Node, weights: list[ir.Value], q: _Quantized) -> ir.Node:
    attrs = {"K": q.k, "N": q.n, "bits": q.bits, "block_size": q.block, "accuracy_level": ACCURACY_LEVEL}
    new = ir.node("MatMulNBits", [node.inputs[0], *weights], attrs, domain=_MS,
                  name=f"{node.name or 'matmul'}_Q{q.bits}")
    out = new.outputs[0]
    old = node.outputs[0]
    out.type, out.shape = old.type, old.shape
    graph.insert_before(node, new)
    name = old.name  # the MatMul's output name stays (as MatMulNBitsQuantizer keeps it)
    old.replace_all_uses_with(out, replace_graph_outputs=True)
    old.name = None
    out.name = name
    graph.remove(node, safe=True)
    return new


def _gather_block_quantized(graph: ir.Graph, gather: ir.Node, weights: list[ir.Value], q: _Quantized) -> bool:
    """``Gather(table, ids)`` -> ``GatherBlockQuantized`` over the ``[vocab, blocks, bytes]`` table ``weights[0]``
    (scales and zero points viewed as ``[vocab, blocks, 1]``), its rows reshaped back to ``[..., hidden]``."""
    from attnx.export.graph import add_initializer

    ids = gather.inputs[1]
    if gather.attributes.get_int("axis", 0) != 0 or ids is None or ids.shape is None or q.k % q.block:
        return False
    rank = len(ids.shape)
    three = add_initializer(graph, f"{q.name}_blocks_shape", ir.tensor(np.array([q.n, q.k // q.block, 1], np.int64)))
    flat = add_initializer(graph, f"{q.name}_rows_shape", ir.tensor(np.array([0] * rank + [-1], np.int64)))
    if len(weights) > 2 and q.bits != 8:
        return False  # 4-bit zero points pack two blocks a byte: no [vocab, blocks, 1] view of them
    new, extra = [], []
    for w in weights[1:]:  # scales, zero points: [vocab, blocks] -> [vocab, blocks, 1]
        r = ir.node("Reshape", [w, three])
        r.outputs[0].dtype = w.dtype
        new.append(r)
        extra.append(r.outputs[0])
    attrs = {"bits": q.bits, "block_size": q.block, "gather_axis": 0, "quantize_axis": 2}
    gbq = ir.node("GatherBlockQuantized", [weights[0], ids, *extra], attrs, domain=_MS,
                  name=f"{gather.name or 'embed'}_Q{q.bits}")
    old = gather.outputs[0]
    gbq.outputs[0].dtype = old.dtype
    rows = ir.node("Reshape", [gbq.outputs[0], flat])
    rows.outputs[0].dtype, rows.outputs[0].shape = old.dtype, old.shape
    new += [gbq, rows]
    graph.insert_before(gather, new)
    name = old.name
    old.replace_all_uses_with(rows.outputs[0], replace_graph_outputs=True)
    old.name = None
    rows.outputs[0].name = name
    graph.remove(gather, safe=True)
    return True


def _embedding_gather(table: ir.Value) -> ir.Node | None:
    users = [u.node for u in table.uses() if _onnx(u.node, "Gather") and u.idx == 0]
    return users[0] if len(users) == 1 else None


def block_size_for(graph: ir.Graph, bits: int) -> int:
    """The default blocks: :data:`LARGE_BLOCK_SIZE` where they divide the ``K`` of every constant weight a MatMul or
    the embedding reads (whole blocks: no padding, and the tied table stays shared with the Gather) and no weight
    holds a source's own blocks at ``bits`` (GGUF Q4_0 / Q8_0, carried as they are at 32); else :data:`BLOCK_SIZE`."""
    for node in graph:
        if not _onnx(node, "MatMul") and not _onnx(node, "Gather") or len(node.inputs) != 2:
            continue
        w = node.inputs[1] if node.op_type == "MatMul" else node.inputs[0]
        t = w.producer() if w is not None else None
        transposed = _onnx(t, "Transpose") and t is not None
        value = t.inputs[0] if transposed and t is not None else w
        tensor = value.const_value if value is not None else None
        if tensor is None or len(tensor.shape) != 2:
            continue
        k = tensor.shape[1] if transposed or node.op_type == "Gather" else tensor.shape[0]
        carries = any(getattr(tensor, f"{p}_bits", None) == bits for p in ("attnx_blocks", "attnx_transposed_blocks"))
        if int(k) % LARGE_BLOCK_SIZE or carries:
            return BLOCK_SIZE
    return LARGE_BLOCK_SIZE


def quantize_graph(model: ir.Model, bits: int, block_size: int | None = None, lm_head_bits: int | None = None) -> dict:
    """Every top-level ``MatMul`` with a constant 2-D fp32 weight -> ``MatMulNBits``, the embedding ``Gather``
    -> ``GatherBlockQuantized`` (see the module doc), in place; returns the metadata's ``quantization``.
    ``block_size``: elements of ``K`` per scale (default :func:`block_size_for`). ``lm_head_bits``: the lm_head's
    (default :data:`LM_HEAD_BITS` in an int4 export, else ``bits``); at the projections' bits it is stored as they
    are (int4: symmetric)."""
    from attnx.export.graph import remove_dead

    if bits not in WEIGHTS.values():
        raise ValueError(f"weight-only quantization takes 4 or 8 bits, got {bits}")
    if lm_head_bits not in (None, *WEIGHTS.values()):
        raise ValueError(f"the lm_head takes 4 or 8 bits, got {lm_head_bits}")
    block_size = block_size or block_size_for(model.graph, bits)
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block size must be a power of 2 >= 16, got {block_size}")
    graph = model.graph
    symmetric = bits == 4  # ORT's asymmetric 4-bit rounds the zero point: worse (module doc)
    head = _head_node(graph)
    head_bits = (lm_head_bits or (LM_HEAD_BITS if bits == 4 else bits)) if head is not None else None
    count, carried, tied, embedding = 0, 0, False, "fp32 (Gather)"
    for node in [n for n in graph if _onnx(n, "MatMul") and len(n.inputs) == 2]:
        w = node.inputs[1]
        t = w.producer() if w is not None else None
        is_head = node is head
        node_bits = head_bits if is_head else bits
        sym = symmetric and node_bits == bits
        if _constant_2d(w) is not None:
            q = _Quantized(w.const_value, True, node_bits, sym, block_size, w.name)
            _matmul_nbits(graph, node, _initializers(graph, q, not q.symmetric), q)
            count += 1
            carried += q.carried is not None
        elif is_head and _onnx(t, "Transpose") and list(t.attributes.get_ints("perm", [1, 0])) == [1, 0]:
            table = t.inputs[0]  # a tied head: the table [vocab, hidden] is the weight's rows
            q = _Quantized(table.const_value, False, node_bits, sym, block_size, table.name)
            weights = _initializers(graph, q, not q.symmetric)
            _matmul_nbits(graph, node, weights, q)
            count += 1
            carried += q.carried is not None
            gather = _embedding_gather(table)
            if gather is not None and _gather_block_quantized(graph, gather, weights, q):
                tied = True
                embedding = f"shared with the tied lm_head: GatherBlockQuantized over its {node_bits}-bit table"
    if not tied:  # an untied embedding: quantized as the projections
        for value in list(graph.initializers.values()):
            gather = _embedding_gather(value) if _constant_2d(value) is not None and value.uses() else None
            if gather is None or len(value.uses()) != 1:
                continue
            q = _Quantized(value.const_value, False, bits, symmetric, block_size, value.name)
            weights = _initializers(graph, q, not q.symmetric)
            if _gather_block_quantized(graph, gather, weights, q):
                embedding = f"GatherBlockQuantized, {_blocks(bits, symmetric, block_size)} along the hidden axis"
            else:
                for w in weights:
                    graph.initializers.pop(w.name)
    if count == 0:
        raise ValueError("the graph has no MatMul with a constant 2-D weight to quantize")
    for value in list(graph.initializers.values()):  # the float weights nothing reads any more
        if not value.uses() and not value.is_graph_output():
            graph.initializers.pop(value.name)
    model.opset_imports.setdefault(_MS, 1)
    remove_dead(model)
    quantization = {
        "method": "weight-only, com.microsoft MatMulNBits, round to nearest, no calibration",
        "weights": _blocks(bits, symmetric, block_size) + (
            f"; the lm_head {_blocks(head_bits, False, block_size)}" if head_bits not in (None, bits) else ""),
        "bits": bits, "symmetric": symmetric, "block_size": block_size, "accuracy_level": ACCURACY_LEVEL,
        "matmuls": count, "lm_head_bits": head_bits,
        "lm_head_symmetric": None if head_bits is None else symmetric if head_bits == bits else False,
        "activations": f"fp32 in and out; each MatMulNBits (accuracy_level {ACCURACY_LEVEL}, CPU) quantizes "
        f"each row of its input to int8, one scale per block of {block_size} along K, for an integer dot "
        "product with the weight blocks",
        "embedding": embedding,
    }
    if head is None:
        quantization["lm_head"] = f"not found (no MatMul with a constant weight computes {LOGITS!r}): " \
                                  f"every MatMul at {bits} bits"
    if carried:
        quantization["source_blocks"] = f"{carried} of the {count} weights' blocks taken from the source as they are " \
                                        "(GGUF Q4_0 / Q8_0: no re-rounding, the format's zero point)"
    if tied:
        quantization["tied_lm_head"] = "one table shared by the lm_head's MatMulNBits and the embedding's " \
                                       "GatherBlockQuantized"
    return quantization


def quantize_weights(src, dst, bits: int, block_size: int | None = None) -> int:
    """Quantize the fp32 ONNX file ``src`` into ``dst`` (:func:`quantize_graph`; its weights memory-mapped, each
    quantized as it is written); returns how many MatMuls became MatMulNBits."""
    from attnx.contract import ModelInfo
    from attnx.export import onnx_file
    from attnx.export.saving import save_model, write_info

    model = onnx_file.load(src)
    info = ModelInfo.from_props(dict(model.metadata_props))
    if info is not None and info.precision != "fp32":
        raise ValueError(f"{Path(src).name} is {info.precision}: weight-only quantization takes an fp32 export")
    quantization = quantize_graph(model, bits, block_size)
    if info is not None:
        info.precision, info.quantization = precision_of(bits), quantization
        write_info(model, info)
    save_model(model, Path(dst), external=True if info is None or info.cache else None)
    return quantization["matmuls"]
