"""What the exporter does with the custom ops of domain ``attnx``: register their schemas, attach
their function bodies (and TensorRT forms), inline them for the ``rewrite`` lowering.

The ops themselves live in the variants' files (``VariantSpec.custom_ops``, declared with the
helpers of :mod:`attnx.models.onnx_ops`); this module never names one. Each op has a registered
:class:`onnx.defs.OpSchema` (so the checker and shape inference know it) and a model-local
``FunctionProto`` of standard ops (so ONNX Runtime runs the node by inlining it).
"""

from __future__ import annotations

import onnx
from onnx import helper

from attnx.contract import DOMAIN, DOMAIN_VERSION, ENGINE_DOMAIN
from attnx.models.spec import CustomOp, all_custom_ops


def custom_ops() -> dict[str, CustomOp]:
    return {op.name: op for op in all_custom_ops()}


def register_schemas() -> None:
    """Register every variant's op schemas with onnx (idempotent)."""
    for op in all_custom_ops():
        s = op.schema()
        if not onnx.defs.has(s.name, s.domain):
            onnx.defs.register_schema(s)


def used_ops(model: onnx.ModelProto) -> set[str]:
    return {n.op_type for n in model.graph.node if n.domain == DOMAIN}


def attach_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """Add the function bodies (and the attnx opset import) for every custom op the graph uses; an op
    with a TensorRT form (``CustomOp.engine_function``) also gets that form (domain ``ENGINE_DOMAIN``) and
    the bodies of the ops it uses."""
    known = custom_ops()
    used = used_ops(model)
    unknown = sorted(used - set(known))
    if unknown:
        raise ValueError(f"the graph uses attnx op(s) no registered variant declares: {', '.join(unknown)}")
    have = {(f.domain, f.name) for f in model.functions}
    base = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 23)
    forms = [known[name].engine_function(base) for name in sorted(used) if known[name].engine_function is not None]
    for form in forms:
        form.domain = ENGINE_DOMAIN
        if (ENGINE_DOMAIN, form.name) not in have:
            model.functions.append(form)
        used |= {n.op_type for n in form.node if n.domain == DOMAIN}
    for name in sorted(used):
        if (DOMAIN, name) not in have:
            model.functions.append(known[name].function(base))
    if used and not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    return model


def inline_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """Replace every attnx node by its function body (the ``rewrite`` lowering: standard ops only)."""
    import onnx.inliner

    ids = [(DOMAIN, name) for name in used_ops(model)]
    if not ids:
        return model
    out = onnx.inliner.inline_selected_functions(model, ids)
    del out.functions[:]
    kept = [o for o in out.opset_import if o.domain != DOMAIN]
    del out.opset_import[:]
    out.opset_import.extend(kept)
    return out
