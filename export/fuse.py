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

Both are exact: the same arithmetic in another order of nodes, not another order of sums. They
match conservative patterns only (constant weights of one shape family, the exact perms and
shapes); anything else is left as it is. What ONNX Runtime's own ``transformers.optimizer`` does
with vendor ops (``com.microsoft.Attention`` and friends) is not wanted here: the same file must
build as a TensorRT engine.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx_graphsurgeon as gs

_HEADS_PERM = [0, 2, 1, 3]


def _single_consumer(tensor: gs.Variable) -> gs.Node | None:
    return tensor.outputs[0] if len(tensor.outputs) == 1 else None


def _bias_add(matmul: gs.Node) -> tuple[gs.Node, np.ndarray] | None:
    """The ``Add(matmul_out, const[N])`` right after a MatMul, if that is its only consumer."""
    add = _single_consumer(matmul.outputs[0])
    if add is None or add.op != "Add":
        return None
    other = [t for t in add.inputs if t is not matmul.outputs[0]]
    if len(other) != 1 or not isinstance(other[0], gs.Constant) or other[0].values.ndim != 1:
        return None
    return add, other[0].values


def pack_projections(graph: gs.Graph) -> int:
    """Merge MatMuls sharing an input and a constant 2-D weight of one row count; returns how many
    groups were packed. With biases, all or none of a group must have one (they are packed too)."""
    groups: dict[tuple, list[gs.Node]] = defaultdict(list)
    for node in graph.nodes:
        if node.op != "MatMul" or len(node.inputs) != 2:
            continue
        x, w = node.inputs
        if isinstance(w, gs.Constant) and w.values.ndim == 2 and w.values.dtype in (np.float32, np.float16):
            groups[(x.name, w.values.shape[0], w.values.dtype.str)].append(node)
    packed = 0
    for members in groups.values():
        if len(members) < 2:
            continue
        biases = [_bias_add(m) for m in members]
        with_bias = [b is not None for b in biases]
        if any(with_bias) and not all(with_bias):
            biases = [None] * len(members)  # mixed: pack the MatMuls, leave the Adds
        widths = [m.inputs[1].values.shape[1] for m in members]
        x = members[0].inputs[0]
        weight = gs.Constant(f"{members[0].name}__packed_w", np.concatenate([m.inputs[1].values for m in members], 1))
        y = gs.Variable(f"{members[0].name}__packed", dtype=members[0].outputs[0].dtype)
        new = [gs.Node("MatMul", name=f"{members[0].name}__packed", inputs=[x, weight], outputs=[y])]
        if biases[0] is not None:
            bias = gs.Constant(f"{members[0].name}__packed_b", np.concatenate([b[1] for b in biases]).astype(weight.values.dtype))
            yb = gs.Variable(f"{y.name}_biased", dtype=y.dtype)
            new.append(gs.Node("Add", name=f"{y.name}_bias", inputs=[y, bias], outputs=[yb]))
            y = yb
        # the split's outputs take over the tensors the old nodes produced, so consumers are untouched
        outs = [b[0].outputs[0] if b is not None else m.outputs[0] for m, b in zip(members, biases)]
        for m, b in zip(members, biases):
            m.outputs.clear()
            if b is not None:
                b[0].outputs.clear()
        sizes = gs.Constant(f"{members[0].name}__packed_sizes", np.array(widths, np.int64))
        new.append(gs.Node("Split", name=f"{members[0].name}__split", inputs=[y, sizes], outputs=outs, attrs={"axis": -1}))
        graph.nodes.extend(new)
        packed += 1
    return packed


def _heads_in(t: gs.Tensor) -> tuple[gs.Tensor, int] | None:
    """``t = Transpose(Reshape(x3d, [B, L, H, Dh]), (0, 2, 1, 3))`` with ``t`` only feeding attention:
    ``(x3d, H)``."""
    if not t.inputs or t.inputs[0].op != "Transpose" or t.inputs[0].attrs.get("perm") != _HEADS_PERM:
        return None
    reshape = t.inputs[0].inputs[0].inputs[0] if t.inputs[0].inputs[0].inputs else None
    if reshape is None or reshape.op != "Reshape" or len(t.inputs[0].inputs[0].outputs) != 1:
        return None
    shape = t.shape
    x3d = reshape.inputs[0]
    if shape is None or len(shape) != 4 or not all(isinstance(d, int) for d in shape[1::2]) or \
            x3d.shape is None or len(x3d.shape) != 3 or x3d.shape[2] != shape[1] * shape[3]:
        return None  # heads must split the last axis of a [B, L, H*Dh] tensor
    return x3d, int(shape[1])


def attention_3d(graph: gs.Graph) -> int:
    """Feed ``Attention`` 3-D Q/K/V where each came from the heads reshape+transpose and the output
    goes (through an optional row-validity ``Mul``) into the inverse transpose+reshape."""
    done = 0
    squeezed: dict[str, gs.Variable] = {}  # one row-validity mask serves every layer
    for attn in [n for n in graph.nodes if n.op == "Attention" and n.domain in (None, "", "ai.onnx")]:
        if len(attn.outputs) != 1 or len(attn.inputs) < 3 or attn.attrs.get("is_causal", 0):
            continue
        heads = [_heads_in(t) for t in attn.inputs[:3]]
        if any(h is None for h in heads) or len({h[1] for h in heads}) != 1:
            continue
        if any(len(t.outputs) != 1 for t in attn.inputs[:3]):
            continue
        # after: [Mul(z, row_valid [B, 1, 1, 1])] -> Transpose(0, 2, 1, 3) -> Reshape to 3-D
        z = attn.outputs[0]
        cur, mul = _single_consumer(z), None
        if cur is not None and cur.op == "Mul":
            other = [t for t in cur.inputs if t is not z]
            if len(other) != 1 or other[0].shape is None or len(other[0].shape) != 4 or \
                    any(d != 1 for d in other[0].shape[1:]):
                continue
            mul, cur = cur, _single_consumer(cur.outputs[0])
        if cur is None or cur.op != "Transpose" or cur.attrs.get("perm") != _HEADS_PERM:
            continue
        merge = _single_consumer(cur.outputs[0])
        if merge is None or merge.op != "Reshape" or merge.outputs[0].shape is None or len(merge.outputs[0].shape) != 3:
            continue
        h = heads[0][1]
        out3d = merge.outputs[0]
        merge.outputs.clear()
        z3 = gs.Variable(f"{z.name}__3d", dtype=z.dtype)
        for i, hd in enumerate(heads):
            attn.inputs[i] = hd[0]
        attn.outputs[0] = z3
        attn.attrs["q_num_heads"] = h
        attn.attrs["kv_num_heads"] = h
        if mul is not None:  # row validity [B, 1, 1, 1] -> [B, 1, 1]
            valid = [t for t in mul.inputs if t is not z][0]
            if valid.name not in squeezed:
                squeezed[valid.name] = gs.Variable(f"{valid.name}__3d", dtype=valid.dtype)
                axes = gs.Constant(f"{valid.name}__squeeze_axes", np.array([1], np.int64))
                graph.nodes.append(gs.Node("Squeeze", inputs=[valid, axes], outputs=[squeezed[valid.name]]))
            valid3 = squeezed[valid.name]
            mul.inputs[0], mul.inputs[1] = z3, valid3
            mul.outputs[0] = out3d
        else:
            graph.nodes.append(gs.Node("Identity", inputs=[z3], outputs=[out3d]))
        done += 1
    return done


def fuse(graph: gs.Graph) -> dict[str, int]:
    """Run every fusion on ``graph`` (in place, then cleaned up): ``{fusion: times applied}``."""
    counts = {"pack_projections": pack_projections(graph), "attention_3d": attention_3d(graph)}
    graph.cleanup().toposort()
    return counts
