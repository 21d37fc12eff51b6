"""Type promotion from the trace's own values: torch's exporter re-runs the whole program to insert a handful
of casts.

``torch.onnx.export`` makes implicit type promotion explicit (``x_f32 * 2`` -> ``x_f32 * tensor(2.0)``, a cast
for "op math") with an interpreter that runs every node of the program again on fake tensors with symbolic
shapes: as long as translating the whole program to ONNX (~70% of that step on a small decoder). It only needs
the dtypes and shapes of each node's inputs, and every node already holds its value from ``torch.export``'s
trace (``node.meta["val"]``, in the same fake mode). Here the same interpreter reads those values and runs
only the nodes it changes or inserts, so the program it leaves is the one torch's pass leaves (the same nodes,
the same values; tests/test_export_decompose.py compares the two).
"""

from __future__ import annotations

import contextlib
import threading

import torch

_LOCK = threading.Lock()


def _interpreter_class():
    from torch.onnx._internal.fx.passes import type_promotion

    class FromTrace(type_promotion._TypePromotionInterpreter):
        """torch's interpreter, each node's value read from the trace unless promotion changed the node."""

        def run_node(self, n):
            with self._set_current_node(n):
                if rule := type_promotion.get_type_promotion_rule(n, self.type_promotion_table):
                    self._maybe_promote_node(n, rule)  # re-runs the node (and runs its new casts) if it changes
            if n.op == "call_function" and "val" in n.meta:
                return n.meta["val"]
            return torch.fx.Interpreter.run_node(self, n)  # placeholders, attributes, the output

    return FromTrace


def insert_type_promotion_nodes(graph_module: torch.fx.GraphModule) -> None:
    """As ``torch.onnx._internal.exporter._fx_passes.insert_type_promotion_nodes``, without the re-run."""
    from torch.onnx._internal.fx.passes import type_promotion

    FromTrace = _interpreter_class()
    for module in graph_module.modules():
        promote = type_promotion.InsertTypePromotion(module)
        promote.interpreter = FromTrace(module, promote.interpreter.type_promotion_table)
        promote.run()


@contextlib.contextmanager
def promotion_from_the_trace():
    """Within it, ``torch.onnx.export`` promotes types without running the program again."""
    try:
        from torch.onnx._internal.exporter import _fx_passes
        from torch.onnx._internal.fx.passes import type_promotion
    except ImportError:  # another torch: its own exporter as it is
        yield
        return
    full = _fx_passes.__dict__.get("insert_type_promotion_nodes")
    if full is None or not hasattr(type_promotion, "_TypePromotionInterpreter"):
        yield
        return
    with _LOCK:
        _fx_passes.insert_type_promotion_nodes = insert_type_promotion_nodes
        try:
            yield
        finally:
            _fx_passes.insert_type_promotion_nodes = full
