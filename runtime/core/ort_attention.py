"""Attention over a decoder's KV cache, rewritten for ONNX Runtime's CPU kernels (a step of
:mod:`attnx.runtime.core.ort_fusions`).

- :func:`attention_with_past`: ``Concat(past, k|v)`` (the ``present`` outputs) feeding ``Attention`` on
  heads-transposed Q/K/V, then the inverse transpose+reshape, becomes ONE opset-23 ``Attention`` on 3-D Q/K/V
  with ``past_key``/``past_value`` inputs and ``present`` outputs; the mask (``attention_mask`` and causality as
  an additive bias) is passed as it was.
- :func:`grouped_query_attention`: that ``Attention``, with the two ``RotaryEmbedding`` s before it and the
  ``Split`` of a packed Q/K/V projection, becomes one ``com.microsoft.GroupQueryAttention``: the packed
  projection read as it is, the rotary inside (``do_rotary`` with the graph's ``position_ids``, so a left-padded
  row keeps its own positions), the same additive mask as ``attention_bias`` (the cache's masked slots), each row's
  cache length in ``seqlens_k``. Three to four nodes fewer per layer. ONNX Runtime 1.31's CPU kernel needs a head
  size that is a multiple of 16 and refuses several new tokens over a past for more than one row: a session with
  this rewrite runs such a call row by row (:class:`attnx.runtime.core.backends.onnxrt.OnnxRuntimeSession`), which
  attnx's own decoding never makes (a prompt is prefilled alone; a batch steps one token at a time).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from attnx.runtime.core.ort_match import (
    HEADS_PERM, MS, const_array, drop, heads_of, is_op, producer, single_consumer, take_over)


def _cache_concat(value: ir.Value | None) -> tuple[ir.Value, ir.Value, ir.Node] | None:
    """``value = Concat(past, new, axis=2)``, ``past`` a graph input ``[batch, heads, past, head]`` with ``heads`` and
    ``head`` known and ``new`` read by the Concat alone: ``(past, new, concat)``."""
    cat = producer(value)
    if not is_op(cat, "Concat") or len(cat.inputs) != 2 or cat.attributes.get_int("axis", 0) not in (-2, 2):
        return None
    past, new = cat.inputs
    if past is None or new is None or not past.is_graph_input() or past.shape is None or len(past.shape) != 4 or \
            not isinstance(past.shape[1], int) or not isinstance(past.shape[3], int) or \
            single_consumer(new) is not cat:
        return None
    return past, new, cat
def attention_with_past(graph: ir.Graph) -> int:
    """``Attention`` over ``Concat(past, k|v)`` -> one 3-D ``Attention`` with past inputs (module docstring)."""
    done = 0
    for attn in [n for n in graph if is_op(n, "Attention")]:
        if len(attn.outputs) != 1 or len(attn.inputs) != 4 or attn.attributes.get_int("is_causal") or \
                attn.attributes.get_float("softcap"):
            continue
        q4, k_all, v_all, bias = attn.inputs
        kc, vc = _cache_concat(k_all), _cache_concat(v_all)
        q = heads_of(q4) if q4 is not None and single_consumer(q4) is attn else None
        if kc is None or vc is None or q is None or bias is None or k_all is None or v_all is None or \
                len(k_all.uses()) != 1 or len(v_all.uses()) != 1:  # read by the attention (and as graph outputs)
            continue
        k, v = heads_of(kc[1]), heads_of(vc[1])
        back = single_consumer(attn.outputs[0])
        if k is None or v is None or not is_op(back, "Transpose") or \
                list(back.attributes.get_ints("perm", [])) != HEADS_PERM:
            continue
        merge = single_consumer(back.outputs[0])
        q_heads = q4.shape[1] if q4 is not None and q4.shape is not None else None
        kv_heads = kc[0].shape[1] if kc[0].shape is not None else None
        if not is_op(merge, "Reshape") or merge.outputs[0].shape is None or len(merge.outputs[0].shape) != 3 or \
                not isinstance(q_heads, int) or not isinstance(kv_heads, int):
            continue
        attrs = {a.name: a.value for a in attn.attributes.values() if a.name in ("scale", "qk_matmul_output_mode")}
        fused = ir.node("Attention", [q[0], k[0], v[0], bias, kc[0], vc[0]],
                        {**attrs, "q_num_heads": q_heads, "kv_num_heads": kv_heads}, num_outputs=3,
                        name=f"{attn.name}__with_past")
        graph.insert_before(attn, [fused])
        take_over(merge.outputs[0], fused.outputs[0])
        take_over(k_all, fused.outputs[1])
        take_over(v_all, fused.outputs[2])
        drop(graph, [merge, back, attn, kc[2], vc[2]] + [n for h in (q, k, v) for n in (h[2], h[1])])
        done += 1
    return done

def _rotary_of(value: ir.Value | None) -> ir.Node | None:
    """The ONNX ``RotaryEmbedding`` (half-split, over the whole head) that computes ``value`` for one reader."""
    node = producer(value)
    if node is None or node.op_type != "RotaryEmbedding" or node.domain not in ("", "ai.onnx") or \
            len(node.inputs) != 4 or node.attributes.get_int("interleaved") or \
            node.attributes.get_int("rotary_embedding_dim", 0) or single_consumer(value) is None:
        return None
    return node


def _packed(q: ir.Value, k: ir.Value, v: ir.Value, sizes: list[int]) -> ir.Node | None:
    """The ``Split`` of one projection into exactly ``q``, ``k``, ``v`` (last axis, ``sizes``), each read once."""
    split = producer(q)
    if not is_op(split, "Split") or list(split.outputs) != [q, k, v] or \
            split.attributes.get_int("axis", 0) not in (-1, 2) or len(split.inputs) != 2:
        return None
    given = const_array(split.inputs[1])
    if given is None or given.reshape(-1).tolist() != sizes or any(single_consumer(o) is None for o in split.outputs):
        return None
    return split


def _cache_lengths(graph: ir.Graph, before: ir.Node, past: ir.Value, ids: ir.Value) -> tuple[ir.Value, ir.Value]:
    """``(seqlens_k [batch] int32, total_sequence_length int32)`` of every row: the past's slots + the new tokens
    (all rows span the same slots; the masked ones are the bias's to hide), computed once before ``before``."""
    past_len = ir.node("Shape", [past], {"start": 2, "end": 3})
    rows = ir.node("Shape", [past], {"start": 0, "end": 1})
    new = ir.node("Shape", [ids], {"start": 1, "end": 2})
    total = ir.node("Add", [past_len.outputs[0], new.outputs[0]])
    total32 = ir.node("Cast", [total.outputs[0]], {"to": ir.DataType.INT32})
    one = ir.Value(name="gqa__one", const_value=ir.tensor(np.array([1], np.int32), name="gqa__one"),
                   shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.INT32))
    graph.register_initializer(one)
    last = ir.node("Sub", [total32.outputs[0], one])
    seqlens = ir.node("Expand", [last.outputs[0], rows.outputs[0]])
    scalar = ir.node("Squeeze", [total32.outputs[0]])
    graph.insert_before(before, [past_len, rows, new, total, total32, last, seqlens, scalar])
    return seqlens.outputs[0], scalar.outputs[0]


def grouped_query_attention(graph: ir.Graph) -> int:
    """:func:`attention_with_past` 's ``Attention`` (with its rotary and packed Q/K/V, where they are) -> one
    ``GroupQueryAttention`` (module docstring); returns how many."""
    ids = next((v for v in graph.inputs if v.name == "input_ids"), None)
    if ids is None:
        return 0
    lengths: tuple[ir.Value, ir.Value] | None = None
    done = 0
    for attn in [n for n in graph if is_op(n, "Attention") and len(n.inputs) == 6 and len(n.outputs) == 3]:
        q, k, v, bias, past_k, past_v = attn.inputs
        heads, kv_heads = attn.attributes.get_int("q_num_heads", 0), attn.attributes.get_int("kv_num_heads", 0)
        if q is None or k is None or v is None or past_k is None or past_k.shape is None or \
                not isinstance(past_k.shape[3], int) or bias is None or bias.dtype != ir.DataType.FLOAT or \
                bias.shape is None or len(bias.shape) != 4 or q.dtype != ir.DataType.FLOAT or not heads or \
                not kv_heads or attn.attributes.get_int("qk_matmul_output_mode"):
            continue
        head = past_k.shape[3]
        if head % 16:  # ONNX Runtime's CPU kernel
            continue
        q_rope, k_rope = _rotary_of(q), _rotary_of(k)
        rotary = q_rope is not None and k_rope is not None and \
            all(a is b for a, b in zip(q_rope.inputs[1:], k_rope.inputs[1:])) and \
            q_rope.inputs[1] is not None and q_rope.inputs[1].shape is not None and \
            q_rope.inputs[1].shape[-1] * 2 == head
        q_in, k_in = (q_rope.inputs[0], k_rope.inputs[0]) if rotary and q_rope and k_rope else (q, k)
        if q_in is None or k_in is None:
            continue
        split = _packed(q_in, k_in, v, [heads * head, kv_heads * head, kv_heads * head])
        if lengths is None:
            lengths = _cache_lengths(graph, attn, past_k, ids)
        attrs: dict[str, int | float] = {"num_heads": heads, "kv_num_heads": kv_heads, "do_rotary": int(rotary),
                                         "rotary_interleaved": 0}
        if attn.attributes.get_float("scale", 0.0):
            attrs["scale"] = attn.attributes.get_float("scale")
        inputs = [split.inputs[0], None, None] if split is not None else [q_in, k_in, v]
        inputs += [past_k, past_v, *lengths]
        inputs += list(q_rope.inputs[1:]) if rotary and q_rope else [None, None, None]
        fused = ir.node("GroupQueryAttention", [*inputs, bias], attrs, domain=MS, num_outputs=3,
                        name=f"{attn.name}__gqa")
        graph.insert_before(attn, [fused])
        for old, new in zip(attn.outputs, fused.outputs):
            take_over(old, new)
        drop(graph, [attn] + ([q_rope, k_rope] if rotary and q_rope and k_rope else []) +
             ([split] if split is not None else []))
        done += 1
    return done


def padding_bias(graph: ir.Graph) -> bool:
    """Where every reader of the attention's mask is a ``GroupQueryAttention`` (causal by itself, from each row's
    cache length), the mask the graph computes (``attention_mask`` and causality, ~40 small nodes run every step)
    becomes the padding alone: ``attention_mask == 0`` -> the lowest float32, 0 elsewhere, ``[batch, 1, new,
    slots]``. False, and the graph unchanged, where anything else reads it."""
    mask = next((v for v in graph.inputs if v.name == "attention_mask"), None)
    ids = next((v for v in graph.inputs if v.name == "input_ids"), None)
    gqa = [n for n in graph if n.op_type == "GroupQueryAttention" and n.domain == MS]
    biases = {id(n.inputs[10]): n.inputs[10] for n in gqa if len(n.inputs) > 10 and n.inputs[10] is not None}
    if mask is None or ids is None or not gqa or len(biases) != 1:
        return False
    (bias,) = biases.values()
    if bias.is_graph_input() or bias.is_graph_output() or \
            any(u.node.op_type != "GroupQueryAttention" or u.node.domain != MS for u in bias.uses()):
        return False

    def constant(name: str, array: np.ndarray) -> ir.Value:
        value = ir.Value(name=name, const_value=ir.tensor(array, name=name), shape=ir.Shape(array.shape),
                         type=ir.TensorType(ir.DataType.from_numpy(array.dtype)))
        graph.register_initializer(value)
        return value

    padded = ir.node("Equal", [mask, constant("padding__zero", np.array(0, np.int64))])
    lowest = constant("padding__lowest", np.array(np.finfo(np.float32).min, np.float32))
    added = ir.node("Where", [padded.outputs[0], lowest, constant("padding__none", np.array(0, np.float32))])
    rows = ir.node("Unsqueeze", [added.outputs[0], constant("padding__axes", np.array([1, 2], np.int64))])
    dims = [ir.node("Shape", [ids], {"start": 0, "end": 1}), ir.node("Shape", [ids], {"start": 1, "end": 2}),
            ir.node("Shape", [mask], {"start": 1, "end": 2})]
    shape = ir.node("Concat", [dims[0].outputs[0], constant("padding__one", np.array([1], np.int64)),
                               dims[1].outputs[0], dims[2].outputs[0]], {"axis": 0})
    full = ir.node("Expand", [rows.outputs[0], shape.outputs[0]])
    graph.insert_before(gqa[0], [padded, added, rows, *dims, shape, full])
    full.outputs[0].dtype = ir.DataType.FLOAT
    for node in gqa:
        node.replace_input_with(10, full.outputs[0])
    return True


def cache_in_place(graph: ir.Graph) -> bool:
    """Let the cache be held in place: every cached input is a ``GroupQueryAttention`` 's past (or read for its
    batch size), and where the graph reads the past's length it reads ``attention_mask`` 's length less the new
    tokens instead (the same number when ``present`` is ``past`` + the new slots, as the file is written). Then a
    caller may bind each ``past`` and its ``present`` to one buffer with room for more slots, which
    ``GroupQueryAttention`` writes the new keys/values into (:mod:`attnx.runtime.core.kv_in_place`). False, and
    the graph unchanged, unless every cached input qualifies."""
    mask = next((v for v in graph.inputs if v.name == "attention_mask"), None)
    ids = next((v for v in graph.inputs if v.name == "input_ids"), None)
    cached = [v for v in graph.inputs if v.name and v.name.startswith("past_key_values.")]
    gqa = [n for n in graph if n.op_type == "GroupQueryAttention" and n.domain == MS]
    if mask is None or ids is None or not cached or len(cached) != 2 * len(gqa):
        return False
    lengths = []
    for past in cached:
        for use in past.uses():
            node = use.node
            if node.op_type == "GroupQueryAttention" and node.domain == MS and use.idx in (3, 4):
                continue
            span = (node.attributes.get_int("start"), node.attributes.get_int("end"))
            if not is_op(node, "Shape") or span not in ((0, 1), (2, 3)):
                return False
            if span == (2, 3):
                lengths.append(node)
    if any(not o.is_graph_output() for n in gqa for o in n.outputs[1:]):
        return False
    for node in lengths:  # the past's slots = the mask's slots - the new tokens
        slots = ir.node("Shape", [mask], {"start": 1, "end": 2})
        new = ir.node("Shape", [ids], {"start": 1, "end": 2})
        past_len = ir.node("Sub", [slots.outputs[0], new.outputs[0]])
        graph.insert_before(node, [slots, new, past_len])
        node.outputs[0].replace_all_uses_with(past_len.outputs[0])
        graph.remove(node, safe=True)
    return True


__all__ = ["attention_with_past", "cache_in_place", "grouped_query_attention", "padding_bias"]
