"""One file, two forms (issue 25): a smal export's ``attnx::SmalAttention`` node runs its fast body on ONNX Runtime
(a plain ``InferenceSession``), and :func:`attnx.engine.forms.engine_form` gives TensorRT the same function as
the ``TtaDistance`` plugin and a softmax. Both forms are checked against the PyTorch reference here, on ONNX
Runtime; that TensorRT turns the distance into plugin layers is ``test_engine_build.py`` /
``test_plugins_tensorrt.py``. No TensorRT needed."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from attnx.contract import DOMAIN, ENGINE_DOMAIN
from attnx.engine.forms import engine_form
from attnx.export.exporter import example_inputs
from attnx.models.attention import attention_path, reference


def plain_run(model_or_path, feeds) -> np.ndarray:
    source = model_or_path.SerializeToString() if isinstance(model_or_path, onnx.ModelProto) else str(model_or_path)
    sess = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    return sess.run(["output"], {k: v.numpy() for k, v in feeds.items()})[0]


def padded(model, batch=3, seq=19):
    feeds = example_inputs(model, batch, seq, seed=3)
    feeds["attention_mask"][1, 11:] = 0
    feeds["trace"] = feeds["trace"] * 0.5  # a distance term that changes the pattern, not only a neutral one
    return feeds


def torch_reference(model, feeds) -> np.ndarray:
    with torch.no_grad(), reference():
        out = model(**feeds)
    return (out["output"] if isinstance(out, dict) else out).numpy()


@pytest.mark.parametrize("options", [{}, {"mode": "tta"}, {"per_head_trace": True}], ids=["smal", "tta", "per-head"])
def test_both_forms_compute_the_reference(exported, options):
    res = exported("smal", **options)
    model = onnx.load(str(res.path))
    assert [n.op_type for n in model.graph.node if n.domain == DOMAIN] == ["SmalAttention"] * 2
    feeds = padded(res.model)
    want = torch_reference(res.model, feeds)
    np.testing.assert_allclose(plain_run(res.path, feeds), want, atol=2e-5, rtol=1e-4)  # the fast body

    form = engine_form(model)
    assert [n.op_type for n in form.graph.node if n.domain == DOMAIN] == ["TtaDistance"] * 2
    assert {(f.domain, f.name) for f in form.functions} == {(DOMAIN, "TtaDistance")}
    onnx.checker.check_model(form, full_check=True)
    np.testing.assert_allclose(plain_run(form, feeds), want, atol=2e-5, rtol=1e-4)  # what TensorRT builds


def test_the_fast_body_forms_no_scores_and_the_tensorrt_form_does(exported):
    """ONNX Runtime's graph has one fused Attention per layer and no Softmax; TensorRT's has the explicit softmax
    over the distance plugin's [B, H, L, L] output (what the plugin computes)."""
    import onnx.inliner

    model = onnx.load(str(exported("smal").path))
    fast = [n.op_type for n in onnx.inliner.inline_local_functions(model).graph.node]
    assert fast.count("Attention") == 2 and "Softmax" not in fast
    explicit = [n.op_type for n in engine_form(model).graph.node]
    assert explicit.count("Softmax") == 2 and "Attention" not in explicit


def test_eager_plugin_path_equals_the_reference(exported):
    """The torch op the plugin lowering traces (its eager body is the rewrite) computes the reference."""
    res = exported("smal")
    feeds = padded(res.model)
    with torch.no_grad(), attention_path("plugin"):
        out = res.model(**feeds)
    got = (out["output"] if isinstance(out, dict) else out).numpy()
    np.testing.assert_allclose(got, torch_reference(res.model, feeds), atol=2e-5, rtol=1e-4)


def test_fp16_file_keeps_both_forms(exported):
    res = exported("smal", fp16=True)
    model = onnx.load(str(res.path))
    assert (ENGINE_DOMAIN, "SmalAttention") in {(f.domain, f.name) for f in model.functions}
    feeds = {k: (v.half() if v.is_floating_point() else v) for k, v in padded(res.model).items()}
    want = torch_reference(res.model, padded(res.model))
    np.testing.assert_allclose(plain_run(res.path, feeds).astype(np.float32), want, atol=5e-2, rtol=5e-2)
    form = engine_form(model)
    np.testing.assert_allclose(plain_run(form, feeds).astype(np.float32), want, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("variant,lowering", [("mha", "plugin"), ("maw", "plugin"), ("smal", "rewrite")])
def test_files_without_a_tensorrt_form_are_parsed_as_they_are(exported, variant, lowering):
    assert engine_form(onnx.load(str(exported(variant, lowering).path))) is None


def test_hooked_scores_export_the_distance_itself(tmp_path):
    """Attention outputs need the pattern, so the scores are formed: the distance op, as before."""
    from attnx.export import export_variant

    res = export_variant("smal", tmp_path / "smal-att.onnx", overrides={"d_model": 32, "n_heads": 2}, n_layers=1,
                         attention_outputs="all")
    model = onnx.load(str(res.path))
    assert [n.op_type for n in model.graph.node if n.domain == DOMAIN] == ["TtaDistance"]
    assert engine_form(model) is None
