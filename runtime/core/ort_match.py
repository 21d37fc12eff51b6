"""Graph matching for the load-time rewrites of :mod:`attnx.runtime.core.ort_fusions` (onnx_ir): who produces
and who reads a value, constants, and replacing nodes and values."""

from __future__ import annotations

from typing import TypeGuard

import numpy as np
import onnx_ir as ir

MS = "com.microsoft"
HEADS_PERM = [0, 2, 1, 3]


def is_op(node: ir.Node | None, op: str) -> TypeGuard[ir.Node]:
    return node is not None and node.op_type == op and node.domain in ("", "ai.onnx")


def producer(value: ir.Value | None) -> ir.Node | None:
    return value.producer() if value is not None else None


def single_consumer(value: ir.Value | None) -> ir.Node | None:
    if value is None:
        return None
    uses = value.uses()
    return None if len(uses) != 1 or value.is_graph_output() else next(iter(uses)).node


def drop(graph: ir.Graph, nodes: list[ir.Node]) -> None:
    """Remove nodes nothing reads any more, and the initializers only they read."""
    inputs = [v for n in nodes for v in n.inputs if v is not None]
    graph.remove(nodes, safe=True)
    for value in inputs:
        if value.is_initializer() and not value.uses() and not value.is_graph_output() and value.name:
            graph.initializers.pop(value.name)


def const_array(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.const_value is None:
        return None
    return value.const_value.numpy()


def scalar(value: ir.Value | None) -> float | None:
    arr = const_array(value)
    return float(arr.reshape(-1)[0]) if arr is not None and arr.size == 1 else None


def other_input(node: ir.Node, value: ir.Value) -> ir.Value | None:
    """The input of a two-input node that is not ``value``."""
    others = [v for v in node.inputs if v is not value]
    return others[0] if len(others) == 1 else None


def like(value: ir.Value, model: ir.Value, shape: bool = True) -> None:
    """``value`` takes ``model``'s dtype (and shape)."""
    if model.dtype is not None:
        value.dtype = model.dtype
    if shape:
        value.shape = model.shape


def take_over(old: ir.Value, new: ir.Value) -> None:
    """``new`` replaces ``old`` everywhere, graph outputs included (and takes a graph output's name)."""
    like(new, old)
    was_output, name = old.is_graph_output(), old.name
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    if was_output:
        old.name = None
        new.name = name


def heads_of(x: ir.Value) -> tuple[ir.Value, ir.Node, ir.Node] | None:
    """``x = Transpose(Reshape(x3d, shape), (0, 2, 1, 3))``: ``(x3d, reshape, transpose)``."""
    transpose = x.producer()
    if not is_op(transpose, "Transpose") or list(transpose.attributes.get_ints("perm", [])) != HEADS_PERM:
        return None
    reshape = producer(transpose.inputs[0])
    if not is_op(reshape, "Reshape") or single_consumer(transpose.inputs[0]) is not transpose:
        return None
    x3d = reshape.inputs[0]
    if x3d is None or x3d.shape is None or len(x3d.shape) != 3:
        return None
    return x3d, reshape, transpose


def add_constant(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    value = ir.Value(name=name, const_value=ir.tensor(array, name=name), shape=ir.Shape(array.shape),
                     type=ir.TensorType(ir.DataType.FLOAT))
    graph.register_initializer(value)
    return value


__all__ = ["HEADS_PERM", "MS", "add_constant", "const_array", "drop", "heads_of", "is_op", "like", "other_input", "producer", "scalar", "single_consumer", "take_over"]
