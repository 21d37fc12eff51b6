"""Decompose only what ONNX lacks: torch's exporter retraces every program to decompose it, even one that
needs nothing decomposed.

``torch.onnx.export`` runs ``ExportedProgram.run_decompositions`` on every program: a second trace of the whole
model under fake tensors with symbolic shapes, about half of a small model's export and as long as
``torch.export`` itself on a large one. The programs attnx traces (no mutation, no grad mode, under
``torch.no_grad``) already hold only operators torchlib translates, save a handful that are another such
operator under a second name: ``x.to(dtype)`` (a cast, or nothing), ``a & b`` (``bitwise_and``), ``c - x``
(``rsub``: ``-x + c``, the same bits) and the tensor-metadata asserts the exporter drops anyway. Those are
renamed in place and the retrace is skipped. A program holding anything else (a mutation, an operator
torchlib lacks, a higher-order operator) gets torch's full decomposition, as before. The two give the same
ONNX operators, bar a shape read with ``Shape`` instead of rebuilt with ``Concat``, and the same outputs
to the bit (measured on every family of the support matrix; tests/test_export_decompose.py).
"""

from __future__ import annotations

import contextlib
import operator
import threading

import torch

aten = torch.ops.aten

#: An operator torchlib lacks -> the one it has that computes the same.
_RENAMED = {aten.__and__.Tensor: aten.bitwise_and.Tensor, aten.__or__.Tensor: aten.bitwise_or.Tensor,
            aten.__xor__.Tensor: aten.bitwise_xor.Tensor}
_CASTS = {aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten.to.other}
#: Dropped by the exporter before it translates (``_fx_passes.remove_assertion_nodes``).
_ASSERTS = {aten.sym_constrain_range_for_size.default, aten._assert_async.default, aten._assert_async.msg,
            aten._assert_scalar.default, aten._assert_tensor_metadata.default}

_LOCK = threading.Lock()


def why_not_ready(program: torch.export.ExportedProgram, translated: set) -> str | None:
    """None when every operator of ``program`` is in ``translated`` or renamed here; else the first that is
    not (or the mutation) in a few words."""
    sig = program.graph_signature
    if sig.buffers_to_mutate or sig.user_inputs_to_mutate:
        return "the program mutates an input"
    for gm in program.graph_module.modules():
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target is operator.getitem:
                continue
            op = node.target
            if isinstance(op, torch._ops.HigherOrderOperator):  # its subgraphs may need decomposing
                return f"{op} holds a subgraph"
            if isinstance(op, torch._ops.OpOverload) and op._schema.is_mutable:
                return f"{op} mutates"
            if op in translated or op in _RENAMED or op in _CASTS or op in _ASSERTS:  # sym-int arithmetic too
                continue
            if op is aten.rsub.Scalar and _plain_rsub(node):
                continue
            return f"{op} has no ONNX translation"
    return None


def _plain_rsub(node) -> bool:
    """``c - x`` with alpha 1 on a floating ``x`` of the result's dtype."""
    x, alpha = node.args[0], node.kwargs.get("alpha", node.args[2] if len(node.args) > 2 else 1)
    want = node.meta["val"].dtype
    return alpha == 1 and want.is_floating_point and x.meta["val"].dtype == want


def rename(program: torch.export.ExportedProgram) -> None:
    """Each operator of ``_RENAMED``, ``_CASTS`` and ``rsub`` as the one torchlib translates (in place)."""
    from torch._guards import detect_fake_mode

    for gm in program.graph_module.modules():
        graph = gm.graph
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if node.target in _RENAMED:
                node.target = _RENAMED[node.target]
            elif node.target in _CASTS:
                x, want = node.args[0], node.meta["val"].dtype
                if x.meta["val"].dtype == want:  # no cast: the value itself (nothing in the program mutates)
                    node.replace_all_uses_with(x)
                    graph.erase_node(node)
                else:
                    node.target, node.args, node.kwargs = aten._to_copy.default, (x,), {"dtype": want}
            elif node.target is aten.rsub.Scalar:
                x, c = node.args[0], node.args[1]
                with graph.inserting_before(node):
                    neg = graph.call_function(aten.neg.default, (x,))
                with detect_fake_mode([x.meta["val"]]) or contextlib.nullcontext():
                    neg.meta["val"] = aten.neg.default(x.meta["val"])
                node.target, node.args, node.kwargs = aten.add.Tensor, (neg, c), {}
        gm.recompile()


@contextlib.contextmanager
def only_what_onnx_lacks():
    """Within it, ``torch.onnx.export`` of a program that needs no decomposition skips the retrace."""
    try:
        from torch.onnx._internal.exporter import _decomp, _fx_passes
    except ImportError:  # another torch: its own exporter as it is
        yield
        return
    full = _fx_passes.__dict__.get("decompose_with_registry")
    if full is None or not hasattr(_decomp, "get_onnx_implemented_overloads"):
        yield
        return

    def decompose_with_registry(program, registry):
        if why_not_ready(program, set(_decomp.get_onnx_implemented_overloads(registry))) is not None:
            return full(program, registry)
        rename(program)
        return program

    with _LOCK:
        _fx_passes.decompose_with_registry = decompose_with_registry
        try:
            yield
        finally:
            _fx_passes.decompose_with_registry = full
