"""Custom ONNX ops of domain ``attnx``: the helpers variants declare theirs with, and what the
exporter does with them (register schemas, attach function bodies, inline them).

The ops themselves live in the variants' files (``VariantSpec.custom_ops``); this module never
names one. Each op has a registered :class:`onnx.defs.OpSchema` (so the checker and shape
inference know it) and a model-local ``FunctionProto`` of standard ops (so ONNX Runtime runs
the node by inlining it), while TensorRT maps the node onto the plugin of the same name
(version and namespace from :data:`attnx.contract.PLUGIN_ATTRIBUTES`).
"""

from __future__ import annotations

import onnx
from onnx import helper
from onnx.defs import OpSchema

from attnx.contract import DOMAIN, DOMAIN_VERSION, ENGINE_DOMAIN, PLUGIN_ATTRIBUTES
from attnx.models.spec import CustomOp, all_custom_ops

FLOAT_TYPES = ["tensor(float)", "tensor(float16)"]


# --------------------------------------------------------------------------- declaring an op

def plugin_attributes() -> list[OpSchema.Attribute]:
    """The two string attributes the TensorRT ONNX parser reads to pick the plugin creator."""
    return [OpSchema.Attribute(k, helper.make_attribute(k, v), f"TensorRT plugin {k.split('_')[1]}.")
            for k, v in PLUGIN_ATTRIBUTES.items()]


def schema(name: str, doc: str, inputs: list[tuple[str, str, str]], outputs: list[tuple[str, str, str]],
           infer, attributes: list[OpSchema.Attribute] = ()) -> OpSchema:
    """An ``OpSchema`` in domain attnx: ``inputs``/``outputs`` are ``(name, type or "T", doc)``,
    ``T`` is float32 or float16, ``infer(ctx)`` sets the output types and shapes."""
    formal = [OpSchema.FormalParameter(n, t, d) for n, t, d in inputs]
    results = [OpSchema.FormalParameter(n, t, d) for n, t, d in outputs]
    out = OpSchema(name, DOMAIN, DOMAIN_VERSION, doc=doc, inputs=formal, outputs=results,
                   type_constraints=[("T", FLOAT_TYPES, "float32 or float16")],
                   attributes=[*attributes, *plugin_attributes()])
    out.set_type_and_shape_inference_function(infer)
    return out


def dims(type_proto: onnx.TypeProto) -> list[onnx.TensorShapeProto.Dimension] | None:
    t = type_proto.tensor_type
    return list(t.shape.dim) if t.HasField("shape") else None


def tensor_type(elem_type: int, dim_list: list | None) -> onnx.TypeProto:
    out = onnx.TypeProto()
    out.tensor_type.elem_type = elem_type
    if dim_list is not None:
        shape = out.tensor_type.shape
        for d in dim_list:
            if isinstance(d, int):
                shape.dim.add().dim_value = d
            else:
                shape.dim.add().CopyFrom(d)
    return out


def rank4_inputs(ctx, *indices: int) -> list[list | None]:
    """The dims of rank-4 inputs ``[B, H, L, *]`` (None where unknown); another rank is an error."""
    out = []
    for i in indices:
        d = dims(ctx.get_input_type(i))
        if d is not None and len(d) != 4:
            raise onnx.shape_inference.InferenceError(
                f"{ctx.get_display_name()}: input {i} must be rank 4 [B, H, L, *], got rank {len(d)}")
        out.append(d)
    return out


def function(name: str, inputs: list[str], outputs: list[str], nodes: list[onnx.NodeProto], opset: int,
             attributes: list[str] = ()) -> onnx.FunctionProto:
    """A model-local function body (standard ops of ``opset``) for a custom op."""
    return helper.make_function(DOMAIN, name, inputs, outputs, nodes, [helper.make_opsetid("", opset)],
                                attributes=[*attributes, *PLUGIN_ATTRIBUTES])


def attribute_ref(node: onnx.NodeProto, name: str, ref: str, kind=onnx.AttributeProto.FLOAT) -> onnx.NodeProto:
    """Give ``node`` an attribute ``name`` taking the function's own attribute ``ref``."""
    attr = onnx.AttributeProto()
    attr.name, attr.ref_attr_name, attr.type = name, ref, kind
    node.attribute.append(attr)
    return node


def opset():
    """The onnxscript opset of domain attnx (for plugin lowerings: ``opset().MyOp(x, **PLUGIN_ATTRIBUTES)``)."""
    import onnxscript

    return onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION)


def make_node(op: str, inputs: list[str], outputs: list[str], name: str | None = None, **attrs) -> onnx.NodeProto:
    """A custom-op node with the plugin attributes TensorRT needs (tests, hand-built graphs)."""
    if op not in {o.name for o in all_custom_ops()}:
        raise ValueError(f"unknown attnx op {op!r}; valid: {', '.join(o.name for o in all_custom_ops())}")
    return helper.make_node(op, inputs, outputs, name=name, domain=DOMAIN, **PLUGIN_ATTRIBUTES, **attrs)


# --------------------------------------------------------------------------- what the exporter does

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
