"""The exporter's standard-ONNX fusions (:mod:`attnx.export.fuse`) and int8 smoothing
(:func:`attnx.export.quantize.smooth`): each is exact, and each finds what it is for.

Every variant is exported twice (fused, the default, and ``fuse=False``, from the export cache of
tests/support, keyed on the exporter's sources); both files run in ONNX
Runtime on the same padded inputs (one row all padding) and must agree to float rounding.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from attnx.export.fuse import attention_3d, pack_projections
from attnx.models import VARIANTS

LAYERS = 2


def _ops(path) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)


def _feeds(sess: ort.InferenceSession, batch: int = 3, seq: int = 11) -> dict:
    rng = np.random.default_rng(0)
    feeds = {}
    for i in sess.get_inputs():
        shape = [batch if d == "batch" else seq if d == "seq" else d for d in i.shape]
        if i.name == "attention_mask":
            mask = np.ones(shape, np.int64)
            mask[1, 7:] = 0
            mask[2, :] = 0  # a row of padding only: the fused graph must zero it as the reference does
            feeds[i.name] = mask.astype(np.int64 if "int64" in i.type else np.bool_ if "bool" in i.type else np.float32)
        elif "float" in i.type:
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32) * (0.05 if "trace" in i.name else 0.5)
        elif "bool" in i.type:
            feeds[i.name] = np.ones(shape, np.bool_)
        else:
            feeds[i.name] = np.zeros(shape, np.int64)
    return feeds


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("lowering", ["plugin", "rewrite"])
def test_fused_export_equals_unfused(variant, lowering, exported):
    fused = exported(variant, lowering, n_layers=LAYERS)  # both from the export cache (keyed on fuse.py too)
    plain = exported(variant, lowering, n_layers=LAYERS, export={"fuse": False})
    ops_f, ops_p = _ops(fused.path), _ops(plain.path)
    # Q, K and V read the same activation in every variant: one packed MatMul per layer at least
    assert ops_f["Split"] >= LAYERS, ops_f
    assert ops_f["MatMul"] <= ops_p["MatMul"] - 2 * LAYERS, (ops_f, ops_p)
    assert ops_f["Transpose"] <= ops_p["Transpose"], (ops_f, ops_p)  # 3-D attention where the pattern is plain
    so = ort.SessionOptions()  # attnx custom ops run through their ONNX function bodies
    so.log_severity_level = 3
    s_f = ort.InferenceSession(str(fused.path), so, providers=["CPUExecutionProvider"])
    s_p = ort.InferenceSession(str(plain.path), so, providers=["CPUExecutionProvider"])
    feeds = _feeds(s_p)
    for name, a, b in zip([o.name for o in s_p.get_outputs()], s_p.run(None, feeds), s_f.run(None, feeds)):
        assert a.shape == b.shape, name
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5, err_msg=f"{variant}/{lowering} output {name}")


def test_mha_fused_attention_has_no_head_transposes(exported):
    res = exported("mha", n_layers=LAYERS)
    model = onnx.load(str(res.path))
    attn = [n for n in model.graph.node if n.op_type == "Attention"]
    assert len(attn) == LAYERS
    for node in attn:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["q_num_heads"] == attrs["kv_num_heads"] == res.config["attention"]["mha"]["n_heads"]
    assert _ops(res.path)["Transpose"] == 0


def test_fusions_leave_other_graphs_alone():
    """A MatMul whose weight is not a constant, and one reading another input, are not packed;
    an Attention fed 4-D tensors that did not come from the heads reshape keeps its inputs."""
    f32 = ir.DataType.FLOAT
    x, y = ir.val("x", f32, ["b", "l", 8]), ir.val("y", f32, ["b", "l", 8])
    w_var = ir.val("w", f32, [8, 8])
    c1 = ir.val("c1", f32, [8, 8], const_value=ir.tensor(np.ones((8, 8), np.float32), name="c1"))
    q = ir.val("q", f32, ["b", 2, "l", 4])
    nodes = [ir.node("MatMul", [x, c1]), ir.node("MatMul", [x, w_var]), ir.node("MatMul", [y, c1]),
             ir.node("Attention", [q, q, q])]
    graph = ir.Graph([x, y, w_var, q], [n.outputs[0] for n in nodes], nodes=nodes, initializers=[c1],
                     opset_imports={"": 23})
    assert pack_projections(graph) == 0
    assert attention_3d(graph) == 0
    assert [n.op_type for n in graph] == ["MatMul", "MatMul", "MatMul", "Attention"]


def _ln_matmul_graph() -> onnx.ModelProto:
    """x -> LN_a -> (MatMul W1, MatMul W2) and x -> LN_b -> (MatMul W3, + residual Add)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    d = 16
    inits = [numpy_helper.from_array(v.astype(np.float32), n) for n, v in {
        "g_a": rng.uniform(0.5, 3, d), "b_a": rng.normal(0, 1, d), "g_b": rng.uniform(0.5, 3, d), "b_b": rng.normal(0, 1, d),
        "w1": rng.normal(0, 0.2, (d, 8)), "w2": rng.normal(0, 0.2, (d, 8)), "w3": rng.normal(0, 0.2, (d, d))}.items()]
    nodes = [helper.make_node("LayerNormalization", ["x", "g_a", "b_a"], ["a"], name="ln_a"),
             helper.make_node("MatMul", ["a", "w1"], ["y1"], name="mm1"),
             helper.make_node("MatMul", ["a", "w2"], ["y2"], name="mm2"),
             helper.make_node("LayerNormalization", ["x", "g_b", "b_b"], ["b"], name="ln_b"),
             helper.make_node("MatMul", ["b", "w3"], ["y3_"], name="mm3"),
             helper.make_node("Add", ["y3_", "b"], ["y3"], name="residual")]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", d])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n", w]) for n, w in (("y1", 8), ("y2", 8), ("y3", d))]
    graph = helper.make_graph(nodes, "g", [x], outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)


def test_smoothing_is_exact_in_float_and_folds_into_a_layernorm_only_when_it_may():
    from attnx.export.quantize import smooth

    model = _ln_matmul_graph()
    rng = np.random.default_rng(2)
    feeds = [{"x": rng.normal(0, 1, (5, 16)).astype(np.float32) * np.linspace(0.1, 20, 16).astype(np.float32)}
             for _ in range(3)]
    before = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds[0])
    assert smooth(model, feeds) == 2  # two activations: a (mm1 + mm2) and b (mm3)
    onnx.checker.check_model(model)
    after = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds[0])
    for a, b in zip(before, after):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    nodes = {n.name: n for n in model.graph.node}
    assert nodes["ln_a"].input[1] != "g_a"  # folded: a feeds only the smoothed MatMuls
    assert nodes["ln_b"].input[1] == "g_b"  # b also feeds the residual: a Mul instead
    assert nodes["mm3"].input[0] == "b__smooth" and nodes["b__smooth"].op_type == "Mul"
    original = {t.name: onnx.numpy_helper.to_array(t) for t in _ln_matmul_graph().graph.initializer}
    now = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    assert nodes["mm1"].input[1] != "w1" and not np.allclose(now[nodes["mm1"].input[1]], original["w1"])  # range moved
    np.testing.assert_array_equal(now["w1"], original["w1"])  # a new initializer: a shared weight stays intact
