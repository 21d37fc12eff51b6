"""What TensorRT parses: an attnx file with each coarse op replaced by its TensorRT form.

A custom op whose fast form ONNX Runtime runs (its ``attnx`` function body, e.g. smal's whole attention
as one fused ``Attention``) but which has no plugin of its own carries a second model-local function of
the same name in domain :data:`attnx.contract.ENGINE_DOMAIN`: the op in ops that have plugins (smal:
``TtaDistance`` and a softmax). :func:`engine_form` inlines that form in place of each such node, so the
network gets the plugin layers; the file itself stays what every ONNX Runtime (attnx's session, a plain
``InferenceSession``, Triton's ONNX Runtime backend) runs fast. Files without such ops, and attnx 0.1 files
whose nodes are the plugins themselves, are parsed as they are.
"""

from __future__ import annotations

import onnx

from attnx.contract import DOMAIN, ENGINE_DOMAIN


def forms_of(model: onnx.ModelProto) -> dict[str, onnx.FunctionProto]:
    """The TensorRT forms the file carries, by op name."""
    return {f.name: f for f in model.functions if f.domain == ENGINE_DOMAIN}


def engine_form(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """A copy of ``model`` with every node that has a TensorRT form inlined into it (its other custom nodes,
    the plugins, left as nodes with their bodies); None when no node has one (parse the file as it is)."""
    import onnx.inliner

    forms = forms_of(model)
    used = sorted({n.op_type for n in model.graph.node if n.domain == DOMAIN and n.op_type in forms})
    if not used:
        return None
    out = onnx.ModelProto()
    out.CopyFrom(model)
    kept = [f for f in out.functions if f.domain != ENGINE_DOMAIN and not (f.domain == DOMAIN and f.name in used)]
    for name in used:
        form = onnx.FunctionProto()
        form.CopyFrom(forms[name])
        form.domain = DOMAIN  # called as the op itself
        kept.append(form)
    del out.functions[:]
    out.functions.extend(kept)
    out = onnx.inliner.inline_selected_functions(out, [(DOMAIN, name) for name in used])
    still = {n.op_type for n in out.graph.node if n.domain == DOMAIN}
    functions = [f for f in out.functions if f.domain == DOMAIN and f.name in still]
    del out.functions[:]
    out.functions.extend(functions)
    return out
