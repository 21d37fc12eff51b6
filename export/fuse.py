"""Graph fusions every backend gains from, in standard ONNX (no vendor domain).

Two rewrites, run by the exporter's optimise step on every file (``--no-fuse`` skips them):

- :func:`pack_projections`: MatMuls that read the same activation with constant weights (Q, K and
  V; a variant's extra projections of the same input) become one MatMul over the concatenated
  weight, one bias Add and a Split. One GEMM of width 3D instead of three of width D: fewer passes
  over the activation, fewer kernel launches, better use of the CPU's cache blocking.
- :func:`attention_3d`: ``Reshape [B, L, H, Dh] -> Transpose(0, 2, 1, 3) -> Attention`` on each of
  Q, K, V and ``Transpose -> Reshape [B, L, D]`` after it become one ``Attention`` on 3-D inputs
  with ``q_num_heads`` / ``kv_num_heads`` (opset 23 allows both layouts): four transposes (memory
  copies of every activation) per layer gone.

Both are exact: the same arithmetic in another order of nodes, not another order of sums. They work
on the onnx-ir graph of the exporter; a packed weight is computed when the file is written
(:mod:`attnx.export.graph`), never held beside the weights it packs. They
match conservative patterns only (constant weights of one shape family, the exact perms and
shapes); anything else is left as it is. What ONNX Runtime's own ``transformers.optimizer`` does
with vendor ops (``com.microsoft.Attention`` and friends) is not wanted here: the same file must
build as a TensorRT engine.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx_ir as ir

from attnx.export.graph import add_initializer

_HEADS_PERM = [0, 2, 1, 3]


def _onnx(node: ir.Node, op: str) -> bool:
    return node is not None and node.op_type == op and node.domain in ("", "ai.onnx")


def _single_consumer(value: ir.Value) -> ir.Node | None:
    uses = value.uses()
    if len(uses) != 1 or value.is_graph_output():
        return None
    return next(iter(uses)).node


def _bias_add(matmul: ir.Node) -> tuple[ir.Node, ir.Value] | None:
    """The ``Add(matmul_out, const[N])`` right after a MatMul, if that is its only consumer."""
    add = _single_consumer(matmul.outputs[0])
    if not _onnx(add, "Add"):
        return None
    other = [v for v in add.inputs if v is not matmul.outputs[0]]
    if len(other) != 1 or other[0] is None or other[0].const_value is None or len(other[0].const_value.shape) != 1:
        return None
    return add, other[0]


def _concat(tensors: list[ir.TensorProtocol], axis: int, name: str) -> ir.LazyTensor:
    """The tensors joined along ``axis``, computed when written."""
    shape = list(tensors[0].shape)
    shape[axis] = sum(t.shape[axis] for t in tensors)
    dtype = tensors[0].dtype

    def evaluate():
        return ir.Tensor(np.concatenate([t.numpy() for t in tensors], axis), dtype=dtype, name=name)

    lazy = ir.LazyTensor(evaluate, dtype=dtype, shape=ir.Shape(shape), name=name)
    if all(hasattr(t, "attnx_torch") for t in tensors):  # streamed from a checkpoint: its own dtype too
        def in_source_dtype():
            import torch

            return torch.cat([t.attnx_torch() for t in tensors], axis)

        lazy.attnx_torch = in_source_dtype
    if axis == 1 and len(shape) == 2 and all(hasattr(t, "attnx_transposed_rows") for t in tensors):
        lazy.attnx_transposed_rows = _joined_rows(tensors)
    bits = {getattr(t, "attnx_transposed_blocks_bits", None) for t in tensors}
    if axis == 1 and len(shape) == 2 and len(bits) == 1 and None not in bits:
        lazy.attnx_transposed_blocks, lazy.attnx_transposed_blocks_bits = _joined_blocks(tensors), bits.pop()
    return lazy


def _joined_blocks(tensors: list[ir.TensorProtocol]):
    """The blocks of the transpose of weights joined along their columns: each member's, stacked (None if one
    has none)."""
    def read():
        from dataclasses import replace

        parts = [t.attnx_transposed_blocks() for t in tensors]
        if any(p is None for p in parts) or len({(p.bits, p.block_size, p.zero_points is None) for p in parts}) != 1 \
                or parts[0].zero_points is not None:
            return None
        return replace(parts[0], data=np.concatenate([p.data for p in parts]),
                       scales=np.concatenate([p.scales for p in parts]))

    return read


def _joined_rows(tensors: list[ir.TensorProtocol]):
    """Rows ``start:stop`` of the transpose of weights joined along their columns: each member's own rows."""
    bounds = np.cumsum([0] + [t.shape[1] for t in tensors])

    def read(start: int, stop: int):
        import torch

        parts = [t.attnx_transposed_rows(max(start, lo) - lo, min(stop, hi) - lo)
                 for t, lo, hi in zip(tensors, bounds[:-1], bounds[1:]) if start < hi and stop > lo]
        return parts[0] if len(parts) == 1 else torch.cat(parts, 0)

    return read


def pack_projections(graph: ir.Graph) -> int:
    """Merge MatMuls sharing an input and a constant 2-D weight of one row count; returns how many
    groups were packed. With biases, all or none of a group must have one (they are packed too)."""
    groups: dict[tuple, list[ir.Node]] = defaultdict(list)
    for node in graph:
        if not _onnx(node, "MatMul") or len(node.inputs) != 2:
            continue
        x, w = node.inputs
        tensor = w.const_value if w is not None else None
        if x is not None and tensor is not None and len(tensor.shape) == 2 and \
                tensor.dtype in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
            groups[(id(x), tensor.shape[0], tensor.dtype)].append(node)
    packed = 0
    for members in groups.values():
        if len(members) < 2:
            continue
        biases = [_bias_add(m) for m in members]
        with_bias = [b is not None for b in biases]
        if any(with_bias) and not all(with_bias):
            biases = [None] * len(members)  # mixed: pack the MatMuls, leave the Adds
        first = members[0]
        base = first.name or first.outputs[0].name
        widths = [m.inputs[1].const_value.shape[1] for m in members]
        x = first.inputs[0]
        weight = add_initializer(graph, f"{base}__packed_w", _concat([m.inputs[1].const_value for m in members], 1,
                                                                     f"{base}__packed_w"))
        matmul = ir.node("MatMul", [x, weight], name=f"{base}__packed")
        new = [matmul]
        y = matmul.outputs[0]
        y.dtype = first.outputs[0].dtype
        if biases[0] is not None:
            bias = add_initializer(graph, f"{base}__packed_b", _concat([b[1].const_value for b in biases], 0,
                                                                       f"{base}__packed_b"))
            add = ir.node("Add", [y, bias], name=f"{base}__packed_bias")
            add.outputs[0].dtype = y.dtype
            new.append(add)
            y = add.outputs[0]
        # the split's outputs take over the values the old nodes produced, so consumers are untouched
        outs = [b[0].outputs[0] if b is not None else m.outputs[0] for m, b in zip(members, biases)]
        sizes = add_initializer(graph, f"{base}__packed_sizes", ir.tensor(np.array(widths, np.int64)))
        split = ir.node("Split", [y, sizes], {"axis": -1}, num_outputs=len(outs), name=f"{base}__split")
        graph.insert_before(first, new + [split])
        for old, new_out in zip(outs, split.outputs):
            new_out.dtype, new_out.shape = old.dtype, old.shape
            was_output = old.is_graph_output()
            name = old.name
            old.replace_all_uses_with(new_out, replace_graph_outputs=True)
            if was_output:
                old.name = None
                new_out.name = name
        _drop(graph, [n for m, b in zip(members, biases) for n in ([m] if b is None else [m, b[0]])])
        packed += 1
    return packed


def _drop(graph: ir.Graph, nodes: list[ir.Node]) -> None:
    """Remove nodes nothing reads any more, and the initializers only they read."""
    inputs = [v for n in nodes for v in n.inputs if v is not None]
    graph.remove(nodes, safe=True)
    for value in inputs:
        if value.is_initializer() and not value.uses() and not value.is_graph_output():
            graph.initializers.pop(value.name)


def _heads_in(value: ir.Value) -> tuple[ir.Value, int] | None:
    """``value = Transpose(Reshape(x3d, [B, L, H, Dh]), (0, 2, 1, 3))`` with ``value`` only feeding
    attention: ``(x3d, H)``."""
    transpose = value.producer()
    if not _onnx(transpose, "Transpose") or list(transpose.attributes.get_ints("perm", [])) != _HEADS_PERM:
        return None
    reshaped = transpose.inputs[0]
    reshape = reshaped.producer() if reshaped is not None else None
    if not _onnx(reshape, "Reshape") or _single_consumer(reshaped) is not transpose:
        return None
    shape = value.shape
    x3d = reshape.inputs[0]
    if shape is None or len(shape) != 4 or not all(isinstance(d, int) for d in (shape[1], shape[3])) or \
            x3d.shape is None or len(x3d.shape) != 3 or not isinstance(x3d.shape[2], int) or \
            x3d.shape[2] != shape[1] * shape[3]:
        return None  # heads must split the last axis of a [B, L, H*Dh] tensor
    return x3d, int(shape[1])


def attention_3d(graph: ir.Graph) -> int:
    """Feed ``Attention`` 3-D Q/K/V where each came from the heads reshape+transpose and the output
    goes (through an optional row-validity ``Mul``) into the inverse transpose+reshape."""
    done = 0
    squeezed: dict[int, ir.Value] = {}  # one row-validity mask serves every layer
    for attn in [n for n in graph if _onnx(n, "Attention")]:
        if len(attn.outputs) != 1 or len(attn.inputs) < 3 or attn.attributes.get_int("is_causal", 0):
            continue
        if any(v is None for v in attn.inputs[:3]):
            continue
        heads = [_heads_in(v) for v in attn.inputs[:3]]
        if any(h is None for h in heads) or len({h[1] for h in heads}) != 1:
            continue
        if any(_single_consumer(v) is not attn for v in attn.inputs[:3]):
            continue
        # after: [Mul(z, row_valid [B, 1, 1, 1])] -> Transpose(0, 2, 1, 3) -> Reshape to 3-D
        z = attn.outputs[0]
        cur, mul = _single_consumer(z), None
        if _onnx(cur, "Mul"):
            other = [v for v in cur.inputs if v is not z]
            if len(other) != 1 or other[0] is None or other[0].shape is None or len(other[0].shape) != 4 or \
                    any(d != 1 for d in other[0].shape[1:]):
                continue
            mul, cur = cur, _single_consumer(cur.outputs[0])
        if not _onnx(cur, "Transpose") or list(cur.attributes.get_ints("perm", [])) != _HEADS_PERM:
            continue
        merge = _single_consumer(cur.outputs[0])
        if not _onnx(merge, "Reshape") or merge.outputs[0].shape is None or len(merge.outputs[0].shape) != 3:
            continue
        h = heads[0][1]
        out3d = merge.outputs[0]
        attrs = {a.name: a for a in attn.attributes.values()}
        attrs["q_num_heads"] = ir.AttrInt64("q_num_heads", h)
        attrs["kv_num_heads"] = ir.AttrInt64("kv_num_heads", h)
        fused = ir.Node("", "Attention", [hd[0] for hd in heads] + list(attn.inputs[3:]), attributes=list(attrs.values()),
                        name=attn.name)
        z3 = fused.outputs[0]
        z3.dtype = z.dtype
        new = [fused]
        if mul is not None:  # row validity [B, 1, 1, 1] -> [B, 1, 1]
            valid = [v for v in mul.inputs if v is not z][0]
            if id(valid) not in squeezed:
                axes = add_initializer(graph, f"{valid.name}__squeeze_axes", ir.tensor(np.array([1], np.int64)))
                squeeze = ir.node("Squeeze", [valid, axes])
                squeeze.outputs[0].dtype = valid.dtype
                new.insert(0, squeeze)
                squeezed[id(valid)] = squeeze.outputs[0]
            last = ir.node("Mul", [z3, squeezed[id(valid)]], name=mul.name)
        else:
            last = ir.node("Identity", [z3])
        last.outputs[0].dtype = out3d.dtype
        last.outputs[0].shape = out3d.shape
        new.append(last)
        graph.insert_before(attn, new)
        name, was_output = out3d.name, out3d.is_graph_output()
        out3d.replace_all_uses_with(last.outputs[0], replace_graph_outputs=True)
        if was_output:
            out3d.name = None
            last.outputs[0].name = name
        old = [attn, cur, merge] + ([mul] if mul is not None else [])
        old += [v.producer() for v in attn.inputs[:3]] + [v.producer().inputs[0].producer() for v in attn.inputs[:3]]
        graph.remove(old, safe=True)
        done += 1
    return done


def fuse(model: ir.Model) -> dict[str, int]:
    """Run every fusion on ``model`` (in place, then cleaned up): ``{fusion: times applied}``."""
    from attnx.export.graph import remove_dead

    counts = {"pack_projections": pack_projections(model.graph), "attention_3d": attention_3d(model.graph)}
    remove_dead(model)
    return counts
