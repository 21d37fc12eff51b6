"""ONNX Runtime's fused operators in a with-past decoder, applied when ONNX Runtime loads it on the CPU.

A decoding step at batch 1 reads every weight once (the MatMuls), and around them runs ~1,500 small nodes per
token (SmolLM2-135M: each RMS norm 7 nodes, each rotary 7 per Q and K, the cache's Concat and the heads'
Reshape/Transpose), each a kernel launch and a pass over a tiny tensor. These rewrites replace them with the fused
kernels ONNX Runtime has for exactly these functions:

- :func:`rms_norms`: ``Pow(x, 2) -> ReduceMean(-1) -> Add(eps) -> Sqrt -> Reciprocal -> Mul(x) -> Mul(w)``
  becomes ``SimplifiedLayerNormalization`` (ONNX Runtime's RMS norm), and when ``x`` is a residual
  ``Add(a, b)``, ``SkipSimplifiedLayerNormalization(a, b, w)`` (``com.microsoft``), whose fourth output is the
  sum the next residual reads.
- :func:`rotary`: ``x * cos + rotate_half(x) * sin`` (the half-split form transformers' Llama family traces)
  becomes ONNX's ``RotaryEmbedding`` (opset 23) with ``position_ids`` and cos/sin caches over every position,
  computed once here by running the graph's own cos/sin nodes on positions ``0..max-1`` (so a family's
  scaling is whatever its graph computes). Where Q/K came from the heads' ``Reshape``+``Transpose``, the
  rotary runs on the 3-D projection before them.
- the cache's attention (:mod:`attnx.runtime.core.ort_attention`): ``Concat(past, k|v)`` + ``Attention`` on
  heads-transposed Q/K/V becomes one 3-D ``Attention`` with past inputs, and that, with the rotary and a packed
  Q/K/V projection's ``Split``, one ``com.microsoft.GroupQueryAttention`` where ONNX Runtime's kernel takes it.

A placed variant keeps its own ops and gains the norms and the rotary (and the attention rewrites in a host's
plain layers).

All of them compute the same function in other kernels (not bit for bit: a kernel's own order of sums; fp32
logits stay within 1e-4, ``tests/test_fuse_ort.py``). The file on disk stays standard ONNX, for TensorRT: the
rewrite is applied by :class:`attnx.runtime.core.backends.onnxrt.OnnxRuntimeSession` to the graph it hands ONNX
Runtime (:func:`session_graph`, external data read in place from the export's folder), on the CPU only
(CUDA's fused kernels want fp16). Patterns are matched conservatively; anything else is left as it is. It lives
in the runtime, not beside :mod:`attnx.export.fuse`: serving never imports torch, which the export package does.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import onnx_ir as ir

from attnx.runtime.core.ort_attention import (
    attention_with_past, cache_in_place, grouped_query_attention, padding_bias)
from attnx.runtime.core.ort_match import (
    HEADS_PERM, MS, add_constant, const_array, drop, heads_of, is_op, like, other_input, producer, scalar, single_consumer,
    take_over)

#: Metadata key that marks a graph already rewritten (never rewritten twice).
FUSED_KEY = "attnx.ort_fused"


# ---- RMS norm (+ residual) --------------------------------------------------------------------------------

def _rms(reduce: ir.Node):
    """``(x, weight, eps, nodes)`` of the RMS norm whose ``ReduceMean`` is ``reduce``, or None."""
    pw = producer(reduce.inputs[0])
    if not is_op(pw, "Pow") or scalar(pw.inputs[1]) != 2.0 or single_consumer(pw.outputs[0]) is not reduce:
        return None
    axes = const_array(reduce.inputs[1]) if len(reduce.inputs) > 1 else None
    if axes is None or axes.reshape(-1).tolist() != [-1] or reduce.attributes.get_int("keepdims", 1) != 1:
        return None
    x = pw.inputs[0]
    chain, cur = [pw, reduce], reduce
    for op in ("Add", "Sqrt", "Reciprocal"):
        after = single_consumer(cur.outputs[0])
        if not is_op(after, op):
            return None
        chain.append(after)
        cur = after
    eps = scalar(other_input(chain[2], reduce.outputs[0]))
    scale = single_consumer(cur.outputs[0])
    if eps is None or not is_op(scale, "Mul") or other_input(scale, cur.outputs[0]) is not x:
        return None
    weigh = single_consumer(scale.outputs[0])
    if not is_op(weigh, "Mul"):
        return None
    weight = other_input(weigh, scale.outputs[0])
    w = const_array(weight)
    if x is None or weight is None or w is None or w.ndim != 1 or x.shape is None or w.shape[0] != x.shape[-1]:
        return None
    return x, weight, eps, chain + [scale, weigh]


def rms_norms(graph: ir.Graph) -> dict[str, int]:
    """RMS norms -> ``SimplifiedLayerNormalization``; after a residual ``Add``: ``SkipSimplifiedLayerNormalization``."""
    plain = skip = 0
    for reduce in [n for n in graph if is_op(n, "ReduceMean")]:
        found = _rms(reduce)
        if found is None:
            continue
        x, weight, eps, chain = found
        add = x.producer()
        residual = is_op(add, "Add") and len(add.inputs) == 2 and all(
            v is not None and v.const_value is None and v.shape is not None and v.shape == x.shape
            and len(v.shape) == 3 for v in add.inputs) and not x.is_graph_output()
        if residual:
            fused = ir.node("SkipSimplifiedLayerNormalization", [add.inputs[0], add.inputs[1], weight],
                            {"epsilon": eps}, domain=MS, num_outputs=4, name=f"{reduce.name}__skip_rms")
            for extra in fused.outputs[1:3]:  # mean and 1/std: not read, so not computed (omitted outputs)
                extra.name = ""
            graph.insert_before(add, [fused])
            take_over(chain[-1].outputs[0], fused.outputs[0])
            take_over(x, fused.outputs[3])  # the sum: the next residual reads it
            drop(graph, chain[::-1] + [add])
            skip += 1
        else:
            fused = ir.node("SimplifiedLayerNormalization", [x, weight], {"axis": -1, "epsilon": eps, "stash_type": 1},
                            num_outputs=1, name=f"{reduce.name}__rms")
            graph.insert_before(chain[0], [fused])
            take_over(chain[-1].outputs[0], fused.outputs[0])
            drop(graph, chain[::-1])
            plain += 1
    return {"rms_norm": plain, "skip_rms_norm": skip}


# ---- rotary -----------------------------------------------------------------------------------------------

def _slice_bounds(node: ir.Node, x: ir.Value) -> tuple[int, int] | None:
    if not is_op(node, "Slice") or node.inputs[0] is not x or len(node.inputs) < 4:
        return None
    starts, ends, axes = (scalar(v) for v in node.inputs[1:4])
    steps = scalar(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else 1
    if starts is None or ends is None or axes is None or steps != 1 or x.shape is None:
        return None
    if int(axes) not in (-1, len(x.shape) - 1):
        return None
    return int(starts), int(ends)


def _rotary(add: ir.Node):
    """``(x, cos, sin, nodes)`` of ``x * cos + rotate_half(x) * sin`` ending at ``add`` (cos/sin before their
    ``Unsqueeze`` over heads), or None."""
    if not is_op(add, "Add") or len(add.inputs) != 2:
        return None
    muls = [m for m in (producer(v) for v in add.inputs) if is_op(m, "Mul") and single_consumer(m.outputs[0]) is add]
    if len(muls) != 2:
        return None
    for direct, rotated in (muls, muls[::-1]):
        cat = next((c for c in (producer(v) for v in rotated.inputs) if is_op(c, "Concat")), None)
        if cat is None or len(cat.inputs) != 2 or cat.attributes.get_int("axis", 0) not in (-1, 3):
            continue
        neg, low = (producer(v) for v in cat.inputs)
        if not is_op(neg, "Neg") or not is_op(low, "Slice"):
            continue
        high, x = producer(neg.inputs[0]), low.inputs[0]
        if not is_op(high, "Slice") or x is None or x.shape is None or len(x.shape) != 4 or \
                not isinstance(x.shape[3], int):
            continue
        head = x.shape[3]
        lo, hi = _slice_bounds(low, x), _slice_bounds(high, x)
        if lo is None or hi is None or lo != (0, head // 2) or hi[0] != head // 2 or hi[1] < head:
            continue
        cos_u, sin_u = other_input(direct, x), other_input(rotated, cat.outputs[0])
        if cos_u is None or sin_u is None or x not in direct.inputs:
            continue
        caches = []
        for value in (cos_u, sin_u):
            unsq = value.producer()
            if not is_op(unsq, "Unsqueeze") or len(unsq.inputs) < 2 or scalar(unsq.inputs[1]) != 1 or \
                    unsq.inputs[0] is None:
                break
            caches.append(unsq.inputs[0])
        if len(caches) != 2 or any(single_consumer(v.outputs[0]) is not cat for v in (neg, low)) or \
                single_consumer(high.outputs[0]) is not neg or single_consumer(cat.outputs[0]) is not rotated:
            continue
        return x, caches[0], caches[1], [add, direct, rotated, cat, neg, low, high]
    return None


def _cos_sin_tables(graph: ir.Graph, cos: ir.Value, sin: ir.Value, positions: ir.Value,
                    count: int) -> list[np.ndarray] | None:
    """cos/sin ``[count, head/2]`` for positions ``0..count-1``: the graph's own nodes from ``positions`` to
    ``cos``/``sin`` run once in ONNX Runtime; None unless they read nothing else and repeat each half."""
    import onnx
    import onnxruntime as ort

    nodes, seen, stack = [], set(), [cos, sin]
    while stack:
        value = stack.pop()
        if value is positions or value.const_value is not None and value.producer() is None:
            continue
        node = value.producer()
        if node is None:  # a graph input other than position_ids
            return None
        if id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        stack.extend(v for v in node.inputs if v is not None)
    if len(nodes) > 40 or not positions.name or not cos.name or not sin.name:
        return None
    order = [n for n in graph if id(n) in seen]
    inits = {v.name: v.const_value for n in order for v in n.inputs
             if v is not None and v.producer() is None and v is not positions and v.const_value is not None and v.name}
    proto = onnx.helper.make_graph(
        [ir.serde.serialize_node(n) for n in order], "rotary_tables",
        [onnx.helper.make_tensor_value_info(positions.name, onnx.TensorProto.INT64, [1, count])],
        [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in (cos.name, sin.name)],
        [ir.serde.serialize_tensor(t) for t in inits.values()])
    for tensor, name in zip(proto.initializer, inits):
        tensor.name = name
    model = onnx.helper.make_model(proto, opset_imports=[onnx.helper.make_opsetid("", 23)], ir_version=10)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out = sess.run([cos.name, sin.name], {positions.name: np.arange(count, dtype=np.int64)[None]})
    half = out[0].shape[-1] // 2
    tables = []
    for table in out:
        table = table.reshape(count, -1)
        if table.dtype != np.float32 or not np.array_equal(table[:, :half], table[:, half:]):
            return None
        tables.append(np.ascontiguousarray(table[:, :half]))
    return tables


def rotary(graph: ir.Graph, max_positions: int) -> int:
    """Half-split rotary of Q/K -> ONNX ``RotaryEmbedding`` (module docstring); returns how many."""
    positions = next((v for v in graph.inputs if v.name == "position_ids"), None)
    if positions is None or max_positions < 1:
        return 0
    tables: dict[tuple[int, int], list[ir.Value] | None] = {}
    done = 0
    for add in [n for n in graph if is_op(n, "Add")]:
        if add.graph is None:  # removed by an earlier match
            continue
        found = _rotary(add)
        if found is None:
            continue
        x, cos, sin, nodes = found
        key = (id(cos), id(sin))
        if key not in tables:
            made = _cos_sin_tables(graph, cos, sin, positions, max_positions)
            tables[key] = None if made is None else [
                add_constant(graph, f"{cos.name}__rotary_{kind}", arr) for kind, arr in zip(("cos", "sin"), made)]
        pair = tables[key]
        if pair is None:
            continue
        cos_table, sin_table = pair
        heads = heads_of(x)
        inside = {id(n) for n in nodes}
        if heads is not None and isinstance(x.shape[1], int) and all(id(u.node) in inside for u in x.uses()) \
                and not x.is_graph_output():  # rotate the 3-D projection, then split the heads as before
            x3d, reshape, transpose = heads
            rope = ir.node("RotaryEmbedding", [x3d, cos_table, sin_table, positions], {"num_heads": int(x.shape[1])},
                           name=f"{add.name}__rotary")
            like(rope.outputs[0], x3d)
            split = ir.node("Reshape", [rope.outputs[0], reshape.inputs[1]],
                            {"allowzero": reshape.attributes.get_int("allowzero", 0)})
            like(split.outputs[0], x3d, shape=False)
            back = ir.node("Transpose", [split.outputs[0]], {"perm": HEADS_PERM})
            graph.insert_before(add, [rope, split, back])
            take_over(add.outputs[0], back.outputs[0])
            drop(graph, nodes + [transpose, reshape])
        else:
            rope = ir.node("RotaryEmbedding", [x, cos_table, sin_table, positions], name=f"{add.name}__rotary")
            graph.insert_before(add, [rope])
            take_over(add.outputs[0], rope.outputs[0])
            drop(graph, nodes)
        done += 1
    return done


# ---- the whole rewrite ------------------------------------------------------------------------------------

def fuse_for_onnxruntime(model: ir.Model, max_positions: int, gqa: bool = True) -> dict[str, int]:
    """Every rewrite above on a with-past decoder (in place): ``{fusion: times applied}``. ``gqa``: the cache's
    ``Attention`` goes on to ``GroupQueryAttention`` where it can (:func:`grouped_query_attention`)."""
    from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

    graph = model.graph
    counts = rms_norms(graph)
    standard_23 = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0)) >= 23
    counts["rotary"] = rotary(graph, max_positions) if standard_23 else 0  # ops of opset 23
    counts["attention_with_past"] = attention_with_past(graph) if standard_23 else 0
    counts["grouped_query_attention"] = grouped_query_attention(graph) if gqa else 0
    counts["padding_bias"] = int(bool(counts["grouped_query_attention"]) and causal_only(model) and padding_bias(graph))
    counts["cache_in_place"] = int(bool(counts["grouped_query_attention"]) and cache_in_place(graph))
    if counts["skip_rms_norm"] or counts["grouped_query_attention"]:
        model.opset_imports.setdefault(MS, 1)
    RemoveUnusedNodesPass()(model)
    TopologicalSortPass()(model)
    model.metadata_props[FUSED_KEY] = ",".join(f"{k}={v}" for k, v in counts.items())
    return counts


def causal_only(model: ir.Model) -> bool:
    """The model's attention masks padding and the future only: no sliding window, chunked or per-layer attention
    in its transformers config (``attnx.config``), which GroupQueryAttention's own causality would not honour
    without the graph's mask. False where the metadata does not say."""
    import json

    try:
        config = json.loads(model.metadata_props.get("attnx.config") or "{}").get("hf_config") or {}
    except (ValueError, AttributeError):
        return False
    if not isinstance(config, dict) or not config:
        return False
    windowed = config.get("sliding_window") and config.get("use_sliding_window", True)
    layers = config.get("layer_types") or []
    return not windowed and not config.get("attention_chunk_size") and all(t == "full_attention" for t in layers)


def _max_positions(model: ir.Model) -> int | None:
    import json

    try:  # a with-past export's attnx.cache metadata names its positions
        return int(json.loads(model.metadata_props.get("attnx.cache") or "{}").get("max_positions") or 0) or None
    except (ValueError, TypeError, AttributeError):
        return None


def session_graph(path: str | os.PathLike) -> tuple[bytes, dict[str, int]] | None:
    """:func:`fused_model_bytes` for a session: a rewrite that fails warns and returns None (the file runs as
    written: a failed optimisation never stops a load)."""
    try:
        return fused_model_bytes(path)
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"{Path(path).name}: ONNX Runtime's fused operators not applied ({type(e).__name__}: "
                      f"{' '.join(str(e).split())[:200]}); running the file as written", RuntimeWarning, stacklevel=4)
        return None


def fused_model_bytes(path: str | os.PathLike) -> tuple[bytes, dict[str, int]] | None:
    """The with-past export at ``path`` rewritten (:func:`fuse_for_onnxruntime`), serialized with its external
    data still referenced in ``path``'s folder (load it with ``session.model_external_initializers_file_folder_path``
    set there); None for a file that is not a with-past export, already rewritten, or where nothing matched."""
    path = Path(path)
    model = ir.load(str(path))
    positions = _max_positions(model)
    if positions is None or FUSED_KEY in model.metadata_props:
        return None
    counts = fuse_for_onnxruntime(model, positions)
    if not any(counts.values()):
        return None
    return ir.serde.serialize_model(model).SerializeToString(), counts


__all__ = ["attention_with_past", "causal_only", "fuse_for_onnxruntime", "fused_model_bytes", "grouped_query_attention", "rms_norms", "rotary",
           "session_graph"]
