"""Decompose only what ONNX lacks: torch's exporter retraces every program to decompose it, even one that
needs nothing decomposed.

``torch.onnx.export`` runs ``ExportedProgram.run_decompositions`` on every program: a second trace of the whole
model under fake tensors with symbolic shapes, about half of a small model's export and as long as
``torch.export`` itself on a large one. The programs attnx traces (under ``torch.no_grad``) mostly hold only
operators torchlib translates already, bar a few that are such an operator under another name: ``x.to(dtype)``
(a cast, or nothing), ``a & b`` (``bitwise_and``), ``c - x`` (``-x + c``, the same bits), ``x.square()``
(``x ** 2``, as torch decomposes it), ``torch.eye(n)`` of a fixed ``n`` (``arange(n)[:, None] == arange(n)``)
and the asserts the exporter drops anyway. Those are rewritten in place and the retrace is skipped. A program
holding anything else (an in-place operator, one torchlib lacks, a higher-order one) gets torch's full
decomposition, as before. Both give the same ONNX operators, bar a shape read with ``Shape`` instead of
rebuilt with ``Concat``, and the same outputs to the bit (every family of the support matrix;
tests/test_export_decompose.py). ``attnx.export.decompose`` logs at DEBUG why a program took the full one.
"""

from __future__ import annotations

import contextlib
import logging
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
log = logging.getLogger(__name__)


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
            if op in translated or op in _RENAMED or op in _CASTS or op in _ASSERTS or op is aten.square.default:
                continue
            if op is aten.rsub.Scalar and _plain_rsub(node) or op is aten.eye.default and _static_eye(node):
                continue
            return f"{op} has no ONNX translation"
    return None


def _plain_rsub(node) -> bool:
    """``c - x`` with alpha 1 on a floating ``x`` of the result's dtype."""
    x, alpha = node.args[0], node.kwargs.get("alpha", node.args[2] if len(node.args) > 2 else 1)
    want = node.meta["val"].dtype
    return alpha == 1 and want.is_floating_point and x.meta["val"].dtype == want


def _static_eye(node) -> bool:
    """``torch.eye(n)`` of a fixed ``n`` (a variant's ``eye(head_dim)``)."""
    return len(node.args) == 1 and isinstance(node.args[0], int)


def _call(graph, op, args: tuple, kwargs: dict | None = None):
    """A new node ``op(*args, **kwargs)`` with its fake value (what the exporter reads its type and shape from)."""
    import torch.fx
    from torch._guards import detect_fake_mode

    node = graph.call_function(op, args, kwargs or {})
    values = torch.fx.node.map_arg((args, kwargs or {}), lambda n: n.meta["val"])
    tensors = [v for v in torch.utils._pytree.tree_leaves(values) if isinstance(v, torch.Tensor)]
    with (detect_fake_mode(tensors) if tensors else None) or contextlib.nullcontext():
        node.meta["val"] = op(*values[0], **values[1])
    return node


def rename(program: torch.export.ExportedProgram) -> None:
    """Each operator of ``_RENAMED``, ``_CASTS``, ``square``, ``rsub`` and ``eye`` as torchlib's (in place)."""
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
            elif node.target is aten.square.default:  # as torch decomposes it
                node.target, node.args = aten.pow.Tensor_Scalar, (node.args[0], 2)
            elif node.target is aten.rsub.Scalar:  # c - x is -x + c, to the bit
                x, c = node.args[0], node.args[1]
                with graph.inserting_before(node):
                    neg = _call(graph, aten.neg.default, (x,))
                node.target, node.args, node.kwargs = aten.add.Tensor, (neg, c), {}
            elif node.target is aten.eye.default:  # eye(n): arange(n)[:, None] == arange(n), cast
                n, want = node.args[0], node.meta["val"].dtype
                with graph.inserting_before(node), fake_mode(program):
                    index = _call(graph, aten.arange.default, (n,), {"dtype": torch.int64})
                    same = _call(graph, aten.eq.Tensor, (_call(graph, aten.unsqueeze.default, (index, -1)), index))
                    eye = _call(graph, aten._to_copy.default, (same,), {"dtype": want})
                node.replace_all_uses_with(eye)
                graph.erase_node(node)
        gm.recompile()


def fake_mode(program: torch.export.ExportedProgram):
    """The fake mode of ``program``'s values (a node made with no tensor argument runs in it)."""
    from torch._guards import detect_fake_mode

    values = [n.meta["val"] for n in program.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    return detect_fake_mode(values) or contextlib.nullcontext()


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
        why = why_not_ready(program, set(_decomp.get_onnx_implemented_overloads(registry)))
        if why is not None:
            log.debug("torch's full decomposition: %s", why)
            return full(program, registry)
        rename(program)
        return program

    with _LOCK:
        _fx_passes.decompose_with_registry = decompose_with_registry
        try:
            yield
        finally:
            _fx_passes.decompose_with_registry = full
