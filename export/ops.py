"""The attnx custom ONNX ops: schemas, portable function bodies, node builders.

Two ops in domain ``attnx`` (version 1), the contract in docs/contracts.md:

- ``MawDepthSelect(q_depth [B,H,Lq,d], k_depth [B,H,Lk,d], policy_logits [B,d]; scale)
  -> logits [B,H,Lq,Lk], depth [B] int64``: argmax depth per example and the selected
  slice's logits ``scale * q_depth[..., t] k_depth[..., t]^T``, never the 5-D tensor.
- ``TtaDistance(q [B,H,Lq,Dh], k [B,H,Lk,Dh], trace [B,1|H,Dh,Dh]) -> dist [B,H,Lq,Lk]``:
  ``dist_ij = (q_i - k_j)^T T (q_i - k_j)``.

Each op has a registered :class:`onnx.defs.OpSchema` (so the checker and shape
inference know it) and a model-local ``FunctionProto`` of standard ops (so ONNX
Runtime runs the node by inlining it), while TensorRT maps the node onto our
plugin (name = op_type, version ``"1"``, namespace ``"attnx"``). Both bodies compute
in float32 and cast back, as the plugins do.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper
from onnx.defs import OpSchema

DOMAIN = "attnx"
DOMAIN_VERSION = 1
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = "attnx"
ONNX_OPSET = 23
IR_VERSION = 11  # opset 23 needs IR 11; onnxruntime 1.31 reads at most IR 13

MAW_DEPTH_SELECT = "MawDepthSelect"
TTA_DISTANCE = "TtaDistance"
CUSTOM_OPS = (MAW_DEPTH_SELECT, TTA_DISTANCE)

_FLOAT_TYPES = ["tensor(float)", "tensor(float16)"]


# --------------------------------------------------------------------------- schemas

def _plugin_attributes() -> list[OpSchema.Attribute]:
    # The TensorRT ONNX parser reads these two to pick the plugin creator.
    return [
        OpSchema.Attribute("plugin_version", helper.make_attribute("plugin_version", PLUGIN_VERSION),
                           "TensorRT plugin version."),
        OpSchema.Attribute("plugin_namespace", helper.make_attribute("plugin_namespace", PLUGIN_NAMESPACE),
                           "TensorRT plugin namespace."),
    ]


def _dims(type_proto: onnx.TypeProto) -> list[onnx.TensorShapeProto.Dimension] | None:
    t = type_proto.tensor_type
    return list(t.shape.dim) if t.HasField("shape") else None


def _tensor_type(elem_type: int, dims: list[onnx.TensorShapeProto.Dimension] | None) -> onnx.TypeProto:
    out = onnx.TypeProto()
    out.tensor_type.elem_type = elem_type
    if dims is not None:
        shape = out.tensor_type.shape
        for d in dims:
            shape.dim.add().CopyFrom(d)
    return out


def _attention_shape(ctx, q_index: int, k_index: int) -> tuple[int, list | None]:
    """Element type and [B, H, Lq, Lk] dims from q [B,H,Lq,*] and k [B,H,Lk,*]."""
    q_type = ctx.get_input_type(q_index)
    k_type = ctx.get_input_type(k_index)
    q_dims, k_dims = _dims(q_type), _dims(k_type)
    dims = None
    if q_dims is not None and k_dims is not None:
        if len(q_dims) != 4 or len(k_dims) != 4:
            raise onnx.shape_inference.InferenceError(
                f"{ctx.get_display_name()}: q and k must be rank 4, got {len(q_dims)} and {len(k_dims)}")
        dims = [q_dims[0], q_dims[1], q_dims[2], k_dims[2]]
    return q_type.tensor_type.elem_type, dims


def _infer_maw_depth_select(ctx) -> None:
    elem, dims = _attention_shape(ctx, 0, 1)
    ctx.set_output_type(0, _tensor_type(elem, dims))
    ctx.set_output_type(1, _tensor_type(TensorProto.INT64, dims[:1] if dims else None))


def _infer_tta_distance(ctx) -> None:
    elem, dims = _attention_shape(ctx, 0, 1)
    ctx.set_output_type(0, _tensor_type(elem, dims))


def _schemas() -> list[OpSchema]:
    maw = OpSchema(
        MAW_DEPTH_SELECT, DOMAIN, DOMAIN_VERSION,
        doc="MAW inference: argmax depth per example and that depth's attention logits "
            "scale * q_depth[..., t] k_depth[..., t]^T (no 5-D tensor).",
        inputs=[
            OpSchema.FormalParameter("q_depth", "T", "[B, H, Lq, d] per-depth query scalars"),
            OpSchema.FormalParameter("k_depth", "T", "[B, H, Lk, d] per-depth key scalars"),
            OpSchema.FormalParameter("policy_logits", "T", "[B, d] policy logits over depths"),
        ],
        outputs=[
            OpSchema.FormalParameter("logits", "T", "[B, H, Lq, Lk] selected-depth logits"),
            OpSchema.FormalParameter("depth", "tensor(int64)", "[B] selected depth"),
        ],
        type_constraints=[("T", _FLOAT_TYPES, "float32 or float16")],
        attributes=[OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, "logit scale, 1/sqrt(Dh)", required=True),
                    *_plugin_attributes()],
    )
    maw.set_type_and_shape_inference_function(_infer_maw_depth_select)
    tta = OpSchema(
        TTA_DISTANCE, DOMAIN, DOMAIN_VERSION,
        doc="Trace-tensor distance dist_ij = (q_i - k_j)^T T (q_i - k_j) per head.",
        inputs=[
            OpSchema.FormalParameter("q", "T", "[B, H, Lq, Dh] queries"),
            OpSchema.FormalParameter("k", "T", "[B, H, Lk, Dh] keys"),
            OpSchema.FormalParameter("trace", "T", "[B, 1|H, Dh, Dh] trace tensor"),
        ],
        outputs=[OpSchema.FormalParameter("dist", "T", "[B, H, Lq, Lk] distances")],
        type_constraints=[("T", _FLOAT_TYPES, "float32 or float16")],
        attributes=_plugin_attributes(),
    )
    tta.set_type_and_shape_inference_function(_infer_tta_distance)
    return [maw, tta]


def register_schemas() -> None:
    """Register the attnx op schemas with onnx (idempotent)."""
    for schema in _schemas():
        if not onnx.defs.has(schema.name, schema.domain):
            onnx.defs.register_schema(schema)


# --------------------------------------------------------------------------- function bodies

def _opset_imports(opset: int) -> list[onnx.OperatorSetIdProto]:
    # The bodies use ops stable since opset 15; they import the model's own default opset.
    return [helper.make_opsetid("", opset)]


def maw_depth_select_function(opset: int = ONNX_OPSET) -> onnx.FunctionProto:
    """Body of MawDepthSelect: one-hot(argmax) weights the depth axis, rank 4 throughout."""
    scale_ref = onnx.AttributeProto()
    scale_ref.name = "value_float"
    scale_ref.ref_attr_name = "scale"
    scale_ref.type = onnx.AttributeProto.FLOAT
    nodes = [
        helper.make_node("Cast", ["q_depth"], ["q32"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["k_depth"], ["k32"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["policy_logits"], ["p32"], to=TensorProto.FLOAT),
        helper.make_node("ArgMax", ["p32"], ["depth"], axis=1, keepdims=0),  # [B]; first max on ties
        helper.make_node("Shape", ["p32"], ["n_depth"], start=1, end=2),  # [1]
        helper.make_node("Constant", [], ["off_on"], value=helper.make_tensor("v", TensorProto.FLOAT, [2], [0.0, 1.0])),
        helper.make_node("OneHot", ["depth", "n_depth", "off_on"], ["one_hot"], axis=-1),  # [B, d]
        helper.make_node("Constant", [], ["bh_axes"], value=helper.make_tensor("a", TensorProto.INT64, [2], [1, 2])),
        helper.make_node("Unsqueeze", ["one_hot", "bh_axes"], ["w"]),  # [B, 1, 1, d]
        helper.make_node("Mul", ["q32", "w"], ["q_sel"]),  # [B, H, Lq, d], zero off the chosen depth
        helper.make_node("Transpose", ["k32"], ["k_t"], perm=[0, 1, 3, 2]),  # [B, H, d, Lk]
        helper.make_node("MatMul", ["q_sel", "k_t"], ["raw"]),  # [B, H, Lq, Lk]
        helper.make_node("Constant", [], ["scale"]),  # value_float = @scale (below)
        helper.make_node("Mul", ["raw", "scale"], ["logits32"]),
        helper.make_node("CastLike", ["logits32", "q_depth"], ["logits"]),
    ]
    nodes[12].attribute.append(scale_ref)
    return helper.make_function(
        DOMAIN, MAW_DEPTH_SELECT, ["q_depth", "k_depth", "policy_logits"], ["logits", "depth"],
        nodes, _opset_imports(opset), attributes=["scale", "plugin_version", "plugin_namespace"],
    )


def tta_distance_function(opset: int = ONNX_OPSET) -> onnx.FunctionProto:
    """Body of TtaDistance via the expansion q^T T q + k^T T k - q^T (T + T^T) k (no [Lq, Lk, Dh] tensor)."""
    nodes = [
        helper.make_node("Cast", ["q"], ["q32"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["k"], ["k32"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["trace"], ["t32"], to=TensorProto.FLOAT),
        helper.make_node("Constant", [], ["last"], value=helper.make_tensor("a", TensorProto.INT64, [1], [-1])),
        helper.make_node("MatMul", ["q32", "t32"], ["qT"]),  # [B, H, Lq, Dh]
        helper.make_node("Mul", ["qT", "q32"], ["qTq_terms"]),
        helper.make_node("ReduceSum", ["qTq_terms", "last"], ["qq"], keepdims=1),  # [B, H, Lq, 1]
        helper.make_node("MatMul", ["k32", "t32"], ["kT"]),  # [B, H, Lk, Dh]
        helper.make_node("Mul", ["kT", "k32"], ["kTk_terms"]),
        helper.make_node("ReduceSum", ["kTk_terms", "last"], ["kk_col"], keepdims=1),  # [B, H, Lk, 1]
        helper.make_node("Transpose", ["kk_col"], ["kk"], perm=[0, 1, 3, 2]),  # [B, H, 1, Lk]
        helper.make_node("Transpose", ["t32"], ["t_t"], perm=[0, 1, 3, 2]),
        helper.make_node("Add", ["t32", "t_t"], ["t_sym"]),  # T + T^T
        helper.make_node("MatMul", ["k32", "t_sym"], ["k_sym"]),  # [B, H, Lk, Dh]
        helper.make_node("Transpose", ["k_sym"], ["k_sym_t"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q32", "k_sym_t"], ["cross"]),  # [B, H, Lq, Lk]
        helper.make_node("Add", ["qq", "kk"], ["qq_kk"]),
        helper.make_node("Sub", ["qq_kk", "cross"], ["dist32"]),
        helper.make_node("CastLike", ["dist32", "q"], ["dist"]),
    ]
    return helper.make_function(
        DOMAIN, TTA_DISTANCE, ["q", "k", "trace"], ["dist"], nodes, _opset_imports(opset),
        attributes=["plugin_version", "plugin_namespace"],
    )


_FUNCTIONS = {MAW_DEPTH_SELECT: maw_depth_select_function, TTA_DISTANCE: tta_distance_function}


# --------------------------------------------------------------------------- model helpers

def make_node(op_type: str, inputs: list[str], outputs: list[str], name: str | None = None, **attrs) -> onnx.NodeProto:
    """A custom-op node with the plugin attributes TensorRT needs."""
    if op_type not in _FUNCTIONS:
        raise ValueError(f"unknown attnx op {op_type!r}; valid: {', '.join(CUSTOM_OPS)}")
    return helper.make_node(op_type, inputs, outputs, name=name, domain=DOMAIN,
                            plugin_version=PLUGIN_VERSION, plugin_namespace=PLUGIN_NAMESPACE, **attrs)


def attach_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """Add the function bodies (and the attnx opset import) for every custom op the graph uses."""
    used = {n.op_type for n in model.graph.node if n.domain == DOMAIN}
    have = {(f.domain, f.name) for f in model.functions}
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), ONNX_OPSET)
    for op in sorted(used):
        if (DOMAIN, op) not in have:
            model.functions.append(_FUNCTIONS[op](opset))
    if used and not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    return model


register_schemas()
