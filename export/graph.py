"""The exporter's optimise step, on the onnx-ir model torch's exporter returns: no weight is copied.

The weights are views of the PyTorch parameters. A pass that needs a weight in another form (a
transposed Linear weight, Q/K/V packed into one, fp16) records how to compute it (``ir.LazyTensor``)
and the file writer computes it when it writes that tensor (:mod:`attnx.export.onnx_file`), one at a
time. So nothing here grows with the model's size but the graph itself.

- :func:`fold_constants`: onnxscript's constant folding and dead-code removal, for everything but
  large weights (folding those would copy them now); :func:`fold_weight_transposes` then folds each
  ``Transpose`` of a weight read once into a lazily transposed weight. A weight read twice (an input
  embedding tied to the output projection) stays one tensor: its ``Transpose`` stays in the graph
  (ONNX Runtime and TensorRT fold it into the MatMul), the file holds it once.
- :func:`attach_functions` / :func:`inline_functions`: the attnx custom ops' function bodies
  (:mod:`attnx.export.ops`); the ``rewrite`` lowering inlines them.
- :func:`batch_rotary_caches`, :func:`name_dims`: what ONNX Runtime and attnx's contract need.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import onnx
import onnx_ir as ir

from attnx.export import ops

#: A constant input larger than this (elements) is never folded eagerly (onnxscript's own default limit).
EAGER_FOLD_ELEMENTS = 8192


def _onnx_domain(node: ir.Node) -> bool:
    return node.domain in ("", "ai.onnx")


def _large_constant_input(node: ir.Node) -> bool | None:
    """onnxscript's ``should_fold``: never fold a node reading a large constant (False), else its rules (None)."""
    for value in node.inputs:
        if value is not None and value.const_value is not None and value.const_value.size > EAGER_FOLD_ELEMENTS:
            return False
    return None


def fold_constants(model: ir.Model, inline: bool = True) -> None:
    """onnxscript's optimizer (constant folding, its rewrite rules, dead nodes and functions, common
    subexpressions) with large weights left alone; then :func:`fold_weight_transposes`."""
    from onnxscript.optimizer import optimize_ir

    quiet = logging.getLogger("onnxscript")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its notes about what it did not fold are about the weights left to us
    try:
        optimize_ir(model, should_fold=_large_constant_input, inline=inline)
    finally:
        quiet.setLevel(level)
    fold_weight_transposes(model)


def _lazy(source: ir.TensorProtocol, make, dtype: ir.DataType, shape: Sequence[int], name: str,
          make_torch=None) -> ir.LazyTensor:
    """A tensor computed from ``source`` (``make(np.ndarray) -> np.ndarray``) when it is written; with
    ``make_torch`` and a source streamed from a checkpoint, its ``attnx_torch`` too (:mod:`attnx.export.streaming`)."""
    def evaluate():
        return ir.Tensor(np.ascontiguousarray(make(source.numpy())), dtype=dtype, name=name)

    lazy = ir.LazyTensor(evaluate, dtype=dtype, shape=ir.Shape(list(shape)), name=name)
    read = getattr(source, "attnx_torch", None)
    if make_torch is not None and read is not None:
        lazy.attnx_torch = lambda: make_torch(read())
    return lazy


def _transposed_rows(lazy: ir.LazyTensor, source: ir.TensorProtocol, perm) -> None:
    """A 2-D transpose of a streamed tensor reads its transpose's rows (the source's) a chunk at a time, and
    its transpose's blocks where the source has them."""
    if list(perm) != [1, 0]:
        return
    rows = getattr(source, "attnx_read_rows", None)
    if rows is not None:
        lazy.attnx_transposed_rows = rows
    if hasattr(source, "attnx_blocks"):  # its transpose's blocks: the source's own (GGUF Q4_0 / Q8_0)
        lazy.attnx_transposed_blocks, lazy.attnx_transposed_blocks_bits = source.attnx_blocks, source.attnx_blocks_bits


def add_initializer(graph: ir.Graph, name: str, tensor: ir.TensorProtocol) -> ir.Value:
    """Register ``tensor`` as an initializer named ``name`` (or ``name_<n>`` when that is taken)."""
    if name in graph.initializers:
        i = 1
        while f"{name}_{i}" in graph.initializers:
            i += 1
        name = f"{name}_{i}"
    tensor.name = name
    value = ir.Value(name=name, shape=ir.Shape(list(tensor.shape)), type=ir.TensorType(tensor.dtype),
                     const_value=tensor)
    graph.register_initializer(value)
    return value


def fold_weight_transposes(model: ir.Model) -> int:
    """``Transpose(W)`` of a weight only it reads -> the transposed weight (computed when written)."""
    graph = model.graph
    folded = 0
    for node in list(graph):
        if node.op_type != "Transpose" or not _onnx_domain(node) or len(node.inputs) != 1:
            continue
        w, out = node.inputs[0], node.outputs[0]
        if w is None or not w.is_initializer() or w.const_value is None or len(w.uses()) != 1 or \
                w.is_graph_output() or out.is_graph_output():
            continue
        tensor = w.const_value
        perm = node.attributes.get_ints("perm", None)
        perm = list(perm) if perm is not None else list(reversed(range(len(tensor.shape))))
        shape = [tensor.shape[p] for p in perm]
        lazy = _lazy(tensor, lambda a, perm=perm: np.transpose(a, perm), tensor.dtype, shape, w.name,
                     make_torch=lambda t, perm=perm: t.permute(*perm))
        _transposed_rows(lazy, tensor, perm)
        name = w.name
        graph.remove(node, safe=False)
        node.replace_input_with(0, None)
        graph.initializers.pop(name)
        new = ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(tensor.dtype), const_value=lazy)
        graph.register_initializer(new)
        out.replace_all_uses_with(new)
        folded += 1
    return folded


def strip_metadata(model: ir.Model) -> None:
    """Drop the translator's per-node and per-value notes (its stack traces, module paths: ~2 KB a node)."""
    from onnx_ir.passes.common import ClearMetadataAndDocStringPass

    ClearMetadataAndDocStringPass()(model)
    for value in [*model.graph.initializers.values(), *model.graph.inputs, *model.graph.outputs,
                  *(o for n in model.graph for o in n.outputs)]:
        value.metadata_props.clear()
        if value.const_value is not None:
            value.const_value.metadata_props.clear()


def remove_dead(model: ir.Model) -> None:
    from onnx_ir.passes.common import RemoveUnusedNodesPass, RemoveUnusedOpsetsPass, TopologicalSortPass

    RemoveUnusedNodesPass()(model)
    RemoveUnusedOpsetsPass()(model)
    TopologicalSortPass()(model)


# --------------------------------------------------------------------------- the attnx custom ops

def attach_functions(model: ir.Model) -> None:
    """The function bodies of the attnx ops the graph uses (:func:`attnx.export.ops.attach_functions`)."""
    skeleton = onnx.ModelProto()
    skeleton.graph.node.extend(onnx.helper.make_node(n.op_type, [], [], domain=n.domain) for n in model.graph
                               if n.domain == ops.DOMAIN)
    skeleton.opset_import.extend(onnx.helper.make_opsetid(d, v) for d, v in model.opset_imports.items())
    ops.attach_functions(skeleton)
    for opset in skeleton.opset_import:
        model.opset_imports.setdefault(opset.domain, opset.version)
    for proto in skeleton.functions:
        function = ir.serde.deserialize_function(proto)
        for node in function:  # a body using another attnx op imports its domain (onnx's checker wants it)
            if node.domain not in function.opset_imports and node.domain in model.opset_imports:
                function.opset_imports[node.domain] = model.opset_imports[node.domain]
        model.functions.setdefault(function.identifier(), function)


def inline_functions(model: ir.Model) -> None:
    """Every attnx node replaced by its body (the ``rewrite`` lowering: standard ops only)."""
    from onnx_ir.passes.common import InlinePass

    InlinePass(criteria=lambda f: f.domain in (ops.DOMAIN, ops.ENGINE_DOMAIN))(model)
    for key in [k for k in model.functions if k[0] in (ops.DOMAIN, ops.ENGINE_DOMAIN)]:
        del model.functions[key]
    model.opset_imports.pop(ops.DOMAIN, None)
    model.opset_imports.pop(ops.ENGINE_DOMAIN, None)


# --------------------------------------------------------------------------- ONNX Runtime and the contract

def batch_rotary_caches(model: ir.Model) -> int:
    """ONNX ``RotaryEmbedding`` without ``position_ids`` wants cos/sin caches ``[B, L, D/2]``; the exporter's
    fusion of an encoder's RoPE (positions ``[1, L]``, e.g. ModernBERT) feeds ``[1, L, D/2]``, which ONNX
    Runtime refuses for B > 1. Expand them to the batch of the input (exact: the rows are the same)."""
    graph = model.graph
    fixed = 0
    for node in list(graph):
        if node.op_type != "RotaryEmbedding" or not _onnx_domain(node) or len(node.inputs) > 3:
            continue
        batch = ir.node("Shape", [node.inputs[0]], {"start": 0, "end": 1}, name=f"{node.name}__batch")
        new = [batch]
        for slot in (1, 2):
            cache = node.inputs[slot]
            rest = ir.node("Shape", [cache], {"start": 1})
            shape = ir.node("Concat", [batch.outputs[0], rest.outputs[0]], {"axis": 0})
            expand = ir.node("Expand", [cache, shape.outputs[0]])
            expand.outputs[0].dtype = cache.dtype
            new += [rest, shape, expand]
            node.replace_input_with(slot, expand.outputs[0])
        graph.insert_before(node, new)
        fixed += 1
    return fixed


def name_dims(model: ir.Model, specs: dict[str, tuple]) -> None:
    """Give graph inputs/outputs the dim names of the contract (``batch``, ``seq``)."""
    for value in [*model.graph.inputs, *model.graph.outputs]:
        want = specs.get(value.name)
        if want is None or value.shape is None:
            continue
        dims = list(value.shape)
        for i, d in enumerate(want[:len(dims)]):
            dims[i] = ir.SymbolicDim(d) if isinstance(d, str) else int(d)
        value.shape = ir.Shape(dims)


def io_entries(values: Sequence[ir.Value]) -> list[tuple[str, str, tuple]]:
    """``(name, numpy dtype name, dims)`` of graph inputs/outputs (dims: ints or dim names)."""
    out = []
    for value in values:
        dims = tuple(d.value if isinstance(d, ir.SymbolicDim) else int(d) for d in (value.shape or ()))
        out.append((value.name, np.dtype(value.dtype.numpy()).name, dims))
    return out


def give_defaults(model: ir.Model, defaults) -> None:
    """Each ``(spec, value)`` as an initializer of the graph input of that name (ONNX's overridable initializer:
    ONNX Runtime uses it when the input is not fed; TensorRT reads it as a constant)."""
    by_name = {spec.name: value for spec, value in defaults}
    for value in model.graph.inputs:
        if value.name in by_name:
            value.const_value = ir.tensor(by_name[value.name].numpy(), name=value.name)
            model.graph.register_initializer(value)


def required_inputs(model: ir.Model) -> list:
    """The graph inputs a caller must feed (those with a default left out, as ``attnx.contract.graph_io`` does)."""
    return [v for v in model.graph.inputs if v.name not in model.graph.initializers]
