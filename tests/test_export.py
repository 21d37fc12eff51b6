"""ONNX export: parity with the PyTorch reference through ONNX Runtime, graph properties, errors."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.inliner
import onnxruntime as ort
import pytest
import torch

from attnx.contract import DOMAIN, ENGINE_DOMAIN, ModelInfo
from attnx.export import export_variant
from attnx.export.exporter import example_inputs
from attnx.models import VARIANTS, get_spec, reference

def _inner_ops(variant: str) -> set[str]:
    """Ops a variant's coarser op uses in its TensorRT form (smal's distance): not nodes of its export."""
    return {n.op_type for op in get_spec(variant).custom_ops if op.engine_function is not None
            for n in op.engine_function(23).node if n.domain == DOMAIN}


#: (variant, an op its plugin lowering exports: one node per layer)
CUSTOM_OPS = [(v, op.name) for v in VARIANTS for op in get_spec(v).custom_ops
              if op.torch_op is not None and op.name not in _inner_ops(v)]
SHAPES = [(2, 8), (1, 5), (3, 13)]  # (2, 8) is the export example; the others are not
# fp16 tolerance, measured: max abs error on unit-scale inputs is ~2e-3..4e-3 for these configs.
FP16_ATOL = 2e-2


def session(path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def run_both(result, batch, seq, seed=1, fp16=False, feeds=None):
    feeds = feeds or example_inputs(result.model, batch, seq, seed=seed)
    with torch.no_grad(), reference():
        named = result.model.forward_named(feeds)
    ref = [named[n].numpy() for n in result.info.output_names]
    np_feeds = {k: (v.numpy().astype(np.float16) if fp16 and v.is_floating_point() else v.numpy())
                for k, v in feeds.items()}
    got = session(result.path).run(None, np_feeds)
    return ref, got, feeds


def max_err(a, b) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())


@pytest.mark.parametrize("lowering", ["plugin", "rewrite"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_ort_matches_reference_fp32(exported, variant, lowering):
    result = exported(variant, lowering)
    for batch, seq in SHAPES:
        ref, got, feeds = run_both(result, batch, seq)
        assert feeds["attention_mask"][-1].sum() < seq  # padding is exercised
        assert got[0].shape == (batch, seq, 32)
        assert max_err(ref[0], got[0]) <= 1e-4, (variant, lowering, batch, seq)
        for i, extra in enumerate(get_spec(variant).extra_outputs, start=1):
            if extra.exact:
                np.testing.assert_array_equal(ref[i], got[i])


@pytest.mark.parametrize("variant", VARIANTS)
def test_ort_matches_reference_fp16(exported, variant):
    result = exported(variant, "plugin", fp16=True)
    for batch, seq in SHAPES:
        ref, got, _ = run_both(result, batch, seq, fp16=True)
        assert got[0].dtype == np.float16
        err = max_err(ref[0], got[0])
        assert err <= FP16_ATOL, (variant, batch, seq, err)


@pytest.mark.parametrize("variant", ["mha", "maw", "smal"])
def test_fp16_keeps_softmax_layernorm_reductions_fp32(exported, variant):
    model = onnx.shape_inference.infer_shapes(onnx.load(str(exported(variant, fp16=True).path)))
    types = {vi.name: vi.type.tensor_type.elem_type for vi in
             list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output)}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    kept = [n for n in model.graph.node if n.op_type in ("Softmax", "LayerNormalization", "Attention", "ReduceSum")]
    assert kept
    for node in kept:
        float_inputs = [types[i] for i in node.input[:1] if i]
        assert float_inputs == [onnx.TensorProto.FLOAT], (node.op_type, node.name)
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in model.graph.initializer)  # weights are fp16
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16


@pytest.mark.parametrize("lowering", ["plugin", "rewrite"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_batch_invariance_through_ort(exported, variant, lowering):
    result = exported(variant, lowering)
    sess = session(result.path)
    feeds = example_inputs(result.model, 3, 9, seed=5)
    mask = feeds["attention_mask"]
    mask[:] = 1
    mask[1, 6:] = 0  # example 1 has 6 real tokens
    np_feeds = {k: v.numpy() for k, v in feeds.items()}
    batched = sess.run(None, np_feeds)[0]
    alone = {k: (v[1:2, :6] if v.ndim >= 2 and v.shape[1] == 9 and k != "trace" else v[1:2]) for k, v in np_feeds.items()}
    single = sess.run(None, alone)[0]
    np.testing.assert_allclose(batched[1, :6], single[0], atol=1e-5)


def graph_ops(path) -> list[str]:
    model = onnx.load(str(path))
    return sorted((f"{n.domain}::" if n.domain else "") + n.op_type for n in model.graph.node)


@pytest.mark.parametrize("variant,op", CUSTOM_OPS)
def test_plugin_lowering_has_custom_nodes_with_bodies(exported, variant, op):
    model = onnx.load(str(exported(variant).path))
    nodes = [n for n in model.graph.node if n.domain == DOMAIN]
    assert [n.op_type for n in nodes] == [op, op]  # one per layer
    for n in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert attrs["plugin_version"] == b"1" and attrs["plugin_namespace"] == b"attnx"
    form = next(o for o in get_spec(variant).custom_ops if o.name == op).engine_function
    tensorrt = set() if form is None else {(ENGINE_DOMAIN, op), *((DOMAIN, n.op_type) for n in form(23).node
                                                                    if n.domain == DOMAIN)}
    assert {(f.domain, f.name) for f in model.functions} == {(DOMAIN, op)} | tensorrt
    assert any(o.domain == DOMAIN and o.version == 1 for o in model.opset_import)
    onnx.checker.check_model(model, full_check=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_rewrite_lowering_uses_standard_ops_only(exported, variant):
    model = onnx.load(str(exported(variant, "rewrite").path))
    assert all(n.domain in ("", "ai.onnx") for n in model.graph.node)
    assert not model.functions


@pytest.mark.parametrize("lowering", ["plugin", "rewrite"])
def test_no_rank5_tensor_in_maw_graph(exported, lowering):
    model = onnx.load(str(exported("maw", lowering).path))
    inlined = onnx.inliner.inline_local_functions(model)  # look inside the function bodies too
    inferred = onnx.shape_inference.infer_shapes(inlined, strict_mode=True)
    ranks = [len(vi.type.tensor_type.shape.dim) for vi in inferred.graph.value_info if vi.type.tensor_type.HasField("shape")]
    assert ranks and max(ranks) <= 4
    assert all(n.op_type != "Einsum" for n in inlined.graph.node)


def test_mha_is_one_attention_node(exported):
    ops = graph_ops(exported("mha", n_layers=1).path)
    assert ops.count("Attention") == 1
    assert "Softmax" not in ops and "attnx::" not in " ".join(ops)


def test_cultural_query_mode_emits_no_nodes(exported):
    mha = graph_ops(exported("mha").path)
    query = graph_ops(exported("cultural", bias_mode="query").path)
    key = graph_ops(exported("cultural", bias_mode="key").path)
    assert query == mha
    assert len(key) > len(mha)


def test_smal_rewrite_is_attention_with_per_key_bias(exported):
    ops = graph_ops(exported("smal", "rewrite").path)
    assert ops.count("Attention") == 2 and "Softmax" not in ops


@pytest.mark.parametrize("overrides", [
    {"bias_mode": "key", "fusion": "gated", "lambda_mode": "mlp"},
    {"bias_mode": "query", "fusion": "gated"},
])
def test_cultural_modes(overrides):
    import inspect

    from attnx.export import export_encoder
    from attnx.models import build_encoder
    from support import cache
    from support.exports import cached

    def perturbed():
        model = build_encoder("cultural", d_model=32, n_heads=4, n_layers=2, **overrides)
        torch.manual_seed(0)
        with torch.no_grad():  # make lambda and gates matter (off their neutral start)
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        return model

    for lowering in ("plugin", "rewrite"):
        # from the export cache (keyed on this code): the reference is rebuilt from the perturbed weights beside it
        path = cache.entry(f"cultural-{lowering}.onnx", lambda out, lw=lowering: export_encoder(perturbed(), out,
                                                                                            lowering=lw),
                           kind="cultural-perturbed", overrides=overrides, lowering=lowering,
                           code=inspect.getsource(perturbed))
        result = cached(path)
        assert {k: result.config["attention"]["cultural"][k] for k in overrides} == overrides  # the modes it meant
        ref, got, _ = run_both(result, 2, 7)
        assert max_err(ref[0], got[0]) <= 1e-4


@pytest.mark.parametrize("mode", ["sequence", "token", "type", "token_type"])
def test_metaphor_input_modes(exported, mode):
    result = exported("metaphor", metaphor_input=mode, post_norm=mode == "token")
    spec = ModelInfo.read(result.path).input("metaphor")
    assert spec.dtype == ("int64" if "type" in mode else "float32")
    assert spec.range == ((0, 16) if "type" in mode else None)  # ids are range-checked by serving too
    for batch, seq in SHAPES:
        ref, got, _ = run_both(result, batch, seq)
        assert max_err(ref[0], got[0]) <= 1e-4


@pytest.mark.parametrize("overrides", [{"per_head_trace": True}, {"mode": "tta"}, {"mode": "tta", "per_head_trace": True}])
def test_smal_modes(exported, overrides):
    for lowering in ("plugin", "rewrite"):
        result = exported("smal", lowering, **overrides)
        for batch, seq in SHAPES[1:]:
            ref, got, _ = run_both(result, batch, seq)
            assert max_err(ref[0], got[0]) <= 1e-4 * max(1.0, float(np.abs(ref[0]).max()))


def test_metadata_and_dynamic_dims(exported):
    result = exported("smal")
    info = ModelInfo.read(result.path)
    assert info.variant == "smal" and info.lowering == "plugin" and info.precision == "fp32"
    assert info.config["attention"]["smal"]["d_model"] == 32
    assert info.profiles == {"batch": [1, 8, 32], "seq": [1, 128, 512]}
    assert [(i.name, i.role, list(i.shape)) for i in info.inputs] == [
        ("hidden_states", "hidden_states", ["batch", "seq", 32]),
        ("attention_mask", "attention_mask", ["batch", "seq"]),
        ("self_state", "context", ["batch", 32]),
        ("trace", "context", ["batch", 8, 8]),
    ]
    assert info.schema == 2
    assert info.weights == result.path.with_suffix(".safetensors").name
    model = onnx.load(str(result.path))
    out = model.graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in out] == ["batch", "seq", 32]


def test_checkpoint_roundtrip(tmp_path):
    from safetensors.torch import save_file

    first = export_variant("maw", tmp_path / "a.onnx", overrides={"d_model": 32, "n_heads": 4})
    with torch.no_grad():
        for p in first.model.parameters():
            p.mul_(1.5).add_(0.1)
    save_file({k: v.contiguous() for k, v in first.model.state_dict().items()}, str(tmp_path / "ckpt.safetensors"))
    second = export_variant("maw", tmp_path / "b.onnx", overrides={"d_model": 32, "n_heads": 4},
                            checkpoint=tmp_path / "ckpt.safetensors", seed=123)
    feeds = example_inputs(first.model, 3, 11, seed=2)
    with torch.no_grad():
        expected = first.model(**feeds)
    got = session(second.path).run(["output"], {k: v.numpy() for k, v in feeds.items()})[0]
    assert max_err(expected.numpy(), got) <= 1e-4
    # and a seeded export without the checkpoint differs
    plain = session(export_variant("maw", tmp_path / "c.onnx", overrides={"d_model": 32, "n_heads": 4}).path)
    assert max_err(expected.numpy(), plain.run(["output"], {k: v.numpy() for k, v in feeds.items()})[0]) > 1e-2


def test_checkpoint_mismatch_is_clear(tmp_path):
    from safetensors.torch import save_file

    save_file({"blocks.0.attn.W_Q.weight": torch.zeros(3, 3)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match=r"does not fit this maw model: missing \d+: .*wrong shape 1: blocks.0.attn.W_Q.weight \[3, 3\]"):
        export_variant("maw", tmp_path / "x.onnx", overrides={"d_model": 32, "n_heads": 4},
                       checkpoint=tmp_path / "bad.safetensors")


def test_external_data_for_large_models(tmp_path, monkeypatch):
    from attnx.export import onnx_file

    monkeypatch.setattr(onnx_file, "INLINE_LIMIT", 10_000)  # pretend the model is past 2 GB
    result = export_variant("mha", tmp_path / "big.onnx", overrides={"d_model": 32, "n_heads": 4})
    data = tmp_path / "big.onnx.data"
    assert data.stat().st_size > 10_000 and (tmp_path / "big.onnx").stat().st_size < data.stat().st_size / 4
    ref, got, _ = run_both(result, 2, 6)
    assert max_err(ref[0], got[0]) <= 1e-4
    monkeypatch.undo()  # the same export in one file: the previous export's data file goes with it
    export_variant("mha", tmp_path / "big.onnx", overrides={"d_model": 32, "n_heads": 4})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.onnx", "big.safetensors"]


def test_opset_range_is_checked(tmp_path):
    with pytest.raises(ValueError, match="opset must be in"):
        export_variant("mha", tmp_path / "x.onnx", overrides={"d_model": 32, "n_heads": 4}, opset=11)


def test_export_leaves_the_model_unchanged(tmp_path):
    from attnx.export import export_encoder
    from attnx.models import build_encoder
    from attnx.models.attention import current_path

    model = build_encoder("smal", d_model=32, n_heads=4, n_layers=2)
    feeds = example_inputs(model, 2, 6)
    with torch.no_grad():
        before = model(**feeds)
    for lowering in ("rewrite", "plugin"):
        export_encoder(model, tmp_path / f"{lowering}.onnx", lowering=lowering, save_weights=False)
        assert current_path() == "fast"  # the exporter's attention path is undone
        with torch.no_grad():
            assert torch.equal(model(**feeds), before)


def test_exports_share_torchs_function_registry_but_not_their_custom_translations():
    """torch builds its registry of torchlib functions once per process under attnx's exporter (not once
    per export); each export still gets a registry of its own, and torch's method is back afterwards."""
    from torch.onnx._internal.exporter import _registration

    from attnx.export import exporter

    original = _registration.ONNXRegistry.__dict__["from_torchlib"]
    fresh = _registration.ONNXRegistry.from_torchlib(opset_version=23)
    with exporter._shared_torchlib_registry():
        first = _registration.ONNXRegistry.from_torchlib(opset_version=23)
        assert first.opset_version == 23 and first.functions.keys() == fresh.functions.keys()
        target = next(iter(first.functions))
        first.functions[target].append("a custom translation of one export")
        second = _registration.ONNXRegistry.from_torchlib(opset_version=23)
        assert second.functions[target] == fresh.functions[target] and second is not first
    assert _registration.ONNXRegistry.__dict__["from_torchlib"] is original
