"""Declaring a variant's custom ONNX op (domain ``attnx``): its :class:`onnx.defs.OpSchema`, its
model-local function body of standard ops, its plugin lowering's opset, and nodes for hand-built graphs.

A variant's file calls these from its op's ``schema`` / ``function`` / ``plugin`` factories (onnx is
imported only then, so ``import attnx.models`` stays torch-only). What the exporter does with the
declared ops (register the schemas, attach the bodies, inline them) is :mod:`attnx.export.ops`.
TensorRT maps each node onto the plugin of the same name (version and namespace from
:data:`attnx.contract.PLUGIN_ATTRIBUTES`).
"""

from __future__ import annotations

import onnx
from onnx import helper
from onnx.defs import OpSchema

from attnx.contract import DOMAIN, DOMAIN_VERSION, PLUGIN_ATTRIBUTES
from attnx.models.spec import all_custom_ops

FLOAT_TYPES = ["tensor(float)", "tensor(float16)"]


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
