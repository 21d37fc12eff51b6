"""INT8 on CPU (``attnx export --int8``, :mod:`attnx.export.quantize`) on the real all-MiniLM-L6-v2:
integer MatMuls (QuantizeLinear + MatMulIntegerToFloat) in the file, softmax / LayerNorm / custom ops still float, sentence embeddings
against sentence-transformers itself, ``attnx check`` passing the file and failing a broken one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from attnx import parity
from attnx.contract import DOMAIN, ModelInfo
from attnx.export.quantize import quantize_file
from attnx.export.tokenizer import ExportTokenizer
from attnx.parity.text_report import COSINE
from attnx.pretrained.sentences import SENTENCES
from support import exports
from support.cli import run as attnx

FEW = [SENTENCES[0], SENTENCES[2], SENTENCES[9], " ".join(SENTENCES)]  # short, "Hi!", "Ok.", ~216 tokens


@pytest.fixture(scope="module")
def st(st_minilm):
    return st_minilm


@pytest.fixture(scope="module")
def int8_of(minilm_export, tmp_path_factory):
    """``int8_of(variant) -> (fp32 path, int8 path)``: the cached fp32 export, linked into a folder of
    this module's, quantized beside it (the tokenizer folder and weights named by the metadata are shared)."""
    cache = {}

    def get(variant: str = "mha"):
        if variant not in cache:
            src = exports.linked_copy(minilm_export(variant).path, tmp_path_factory.mktemp(f"int8-{variant}"))
            dst = src.with_name(f"{src.stem}-int8.onnx")
            quantize_file(src, dst)
            cache[variant] = (src, dst)
        return cache[variant]

    return get


def _embed(path: Path, texts) -> np.ndarray:
    """Sentence embeddings from ONNX Runtime, the texts padded into one batch (padding must not matter)."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    enc = ExportTokenizer(path, ModelInfo.read(path)).encode(texts)
    width = max(len(e.ids) for e in enc)
    ids = np.zeros((len(enc), width), np.int64)
    mask = np.zeros_like(ids)
    for i, e in enumerate(enc):
        ids[i, :len(e.ids)], mask[i, :len(e.ids)] = e.ids, 1
    feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
    rng = np.random.default_rng(0)
    for entry in ModelInfo.read(path).inputs:  # a variant's context inputs: fixed unit-scale values
        if entry.name not in feeds:
            shape = [len(enc) if d == "batch" else width if d == "seq" else int(d) for d in entry.shape]
            feeds[entry.name] = rng.standard_normal(shape).astype(entry.dtype)
    names = {i.name for i in sess.get_inputs()}
    return sess.run(["sentence_embedding"], {k: v for k, v in feeds.items() if k in names})[0].astype(np.float64)


def _cosines(a, b):
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_int8_file_has_integer_matmuls_and_float_softmax_layernorm(int8_of):
    src, dst = int8_of("mha")
    model, fp32 = onnx.load(str(dst)), onnx.load(str(src))
    ops = [n.op_type for n in model.graph.node]
    inits = {t.name: t for t in model.graph.initializer}
    weight_matmuls = [n for n in fp32.graph.node if n.op_type == "MatMul" and n.input[1] in
                      {t.name for t in fp32.graph.initializer}]
    # 6 layers x (packed q|k|v, o, ffn in, ffn out): one quantized input each
    assert ops.count("MatMulIntegerToFloat") == len(weight_matmuls) == 24
    assert ops.count("QuantizeLinear") == 24
    # smoothing: every quantized input is divided by its channel scales, folded into a LayerNorm or a
    # Mul (post-LN BERT: each LayerNorm also feeds a residual, so all 24 are Muls)
    smoothed_ln = [n for n in model.graph.node if n.op_type == "LayerNormalization" and "__smooth_" in n.input[1]]
    smoothing_muls = [n for n in model.graph.node if n.op_type == "Mul" and n.name.endswith("__smooth")]
    assert len(smoothed_ln) + len(smoothing_muls) == 24
    assert not [n for n in model.graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in inits]
    producers = {o: n for n in model.graph.node for o in n.output}
    for n in model.graph.node:
        if n.op_type == "MatMulIntegerToFloat":
            assert n.domain == "com.microsoft"
            w = inits[n.input[1]]
            assert w.data_type == onnx.TensorProto.INT8  # int8 weights, 7-bit range (no AVX2 saturation)
            assert np.abs(numpy_helper.to_array(w)).max() <= 63
            assert producers[n.input[0]].op_type == "QuantizeLinear"  # int8 activations
    # LayerNorm and attention are untouched: same count, float weights
    for op in ("LayerNormalization", "Attention", "Gelu"):
        assert ops.count(op) == [x.op_type for x in fp32.graph.node].count(op) > 0
    for n in model.graph.node:
        if n.op_type == "LayerNormalization":
            assert inits[n.input[1]].data_type == onnx.TensorProto.FLOAT
    info = ModelInfo.read(dst)
    assert info.precision == "int8"
    from attnx.pretrained.sentences import CALIBRATION

    assert info.quantization["weight_bits"] == 7 and info.quantization["matmuls"] == 24
    assert info.quantization["smoothing_alpha"] == 0.6
    assert info.quantization["calibration"] == f"{len(CALIBRATION)} built-in sentences"
    assert dst.stat().st_size < 0.7 * src.stat().st_size


def test_int8_sentence_embeddings_match_sentence_transformers(int8_of, st):
    _, dst = int8_of("mha")
    got, ref = _embed(dst, SENTENCES), st.encode(SENTENCES, convert_to_numpy=True).astype(np.float64)
    cos = _cosines(got, ref)
    assert cos.min() >= COSINE["int8"], cos
    assert cos.mean() >= 0.99, cos
    assert cos.min() < 1 - 1e-6  # it is quantized: not the fp32 numbers


def test_check_passes_int8_and_fails_a_broken_int8(int8_of, tmp_path):
    _, dst = int8_of("mha")
    rep = parity.run_check(dst, workdir=tmp_path / "ok", texts=FEW)
    assert rep.passed, rep.mismatches()
    assert rep.precision == "int8"
    cmp = next(c for c in rep.comparisons if (c.runner, c.reference, c.output) ==
               ("onnxrt-plugin", "original", "sentence_embedding"))
    assert cmp.gate.metric == "cosine" and cmp.gate.bound == COSINE["int8"]
    hidden = next(c for c in rep.comparisons if c.output == "last_hidden_state" and c.runner == "onnxrt-plugin")
    assert hidden.gate.metric == "report" and all(r["max_abs"] > 0 for r in hidden.rows)  # reported, not gated

    # broken: the first FFN-in weight's column scales tripled (one layer's weights wrong by 3x)
    model = onnx.load(str(dst))
    scale = next(t for t in model.graph.initializer if t.name.endswith("__scale") and list(t.dims) == [1536])
    scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scale) * 3, scale.name))
    bad = dst.with_name(f"{dst.stem}-broken.onnx")
    onnx.save(model, str(bad))
    rep = parity.run_check(bad, workdir=tmp_path / "bad", texts=FEW)
    assert not rep.passed
    assert any("sentence_embedding cosine" in m for m in rep.mismatches())


def test_custom_op_variant_keeps_its_op_in_float_and_matches_its_fp32_export(int8_of):
    src, dst = int8_of("smal")
    model = onnx.load(str(dst))
    custom = [n for n in model.graph.node if n.domain == DOMAIN]
    assert custom and len(custom) == len([n for n in onnx.load(str(src)).graph.node if n.domain == DOMAIN])
    assert {f.name for f in model.functions} >= {n.op_type for n in custom}  # bodies kept, ORT runs them
    producers = {o: n for n in model.graph.node for o in n.output}
    for n in custom:  # fed by float tensors, not by integer ones
        for name in n.input:
            p = producers.get(name)
            assert p is None or p.op_type not in ("QuantizeLinear", "Cast") or \
                any(a.name == "to" and a.i == onnx.TensorProto.FLOAT for a in p.attribute)
    cos = _cosines(_embed(dst, SENTENCES), _embed(src, SENTENCES))
    assert cos.min() >= COSINE["int8"], cos


def test_cli_refuses_int8_with_fp16_in_one_line(tmp_path):
    out = attnx("export", "--variant", "mha", "--int8", "--fp16", "-o", str(tmp_path / "m.onnx"))
    assert out.returncode != 0
    lines = [ln for ln in (out.stdout + out.stderr).strip().splitlines() if ln.strip()]
    assert lines == ["error: --int8 and --fp16 cannot be combined: int8 quantizes the fp32 export (choose one)"], lines
    assert not list(tmp_path.iterdir())


def test_quantizing_twice_is_refused(int8_of, tmp_path):
    _, dst = int8_of("mha")
    with pytest.raises(ValueError, match="is int8: int8 quantizes an fp32 export"):
        quantize_file(dst, tmp_path / "again.onnx")


def test_matmuls_feeding_a_decision_stay_float_and_maw_int8_passes_check(exported, tmp_path):
    """MAW's depth is an argmax: quantising the projections that feed it flipped depths at clear
    margins (a different model), so those MatMuls stay float and ``attnx check`` passes on int8."""
    from attnx.export.quantize import decision_inputs

    src = exported("maw").path
    dst = tmp_path / "maw-int8.onnx"
    count = quantize_file(src, dst)
    fp32 = onnx.load(str(src))
    keep = decision_inputs(fp32.graph)
    gather = [n for n in fp32.graph.node if n.domain == DOMAIN]
    assert gather and keep and count > 0
    q8 = onnx.load(str(dst))
    produced_by = {o: n.op_type for n in q8.graph.node for o in n.output}
    assert all(produced_by[name] in ("MatMul", "Gemm") for name in keep)  # still float
    assert sum(t == "MatMulIntegerToFloat" for t in produced_by.values()) == count
    (tmp_path / src.with_suffix(".safetensors").name).write_bytes(src.with_suffix(".safetensors").read_bytes())
    report = parity.run_check(dst, workdir=tmp_path / "parity")
    assert report.passed, report.mismatches()


def test_calibration_text_is_held_out_from_the_checked_text():
    from attnx.parity.text_cases import default_texts
    from attnx.pretrained.sentences import CALIBRATION

    checked = " ".join(default_texts())
    assert len(CALIBRATION) >= 16 and not [t for t in CALIBRATION if t in checked]


def test_gemm_with_bias_quantizes_to_the_float_result():
    """A Gemm's bias stays a separate Add (ORT's fused bias is wrong with per-row activation scales)."""
    from onnx import TensorProto, helper

    from attnx.export.quantize import quantize_int8

    rng = np.random.default_rng(0)
    w, b = rng.normal(0, 0.2, (16, 8)).astype(np.float32), rng.normal(0, 1, 8).astype(np.float32)
    graph = helper.make_graph([helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="g")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)
    q, count = quantize_int8(model)
    assert count == 1 and [n.op_type for n in q.graph.node][-2:] == ["MatMulIntegerToFloat", "Add"]
    import onnxruntime as ort

    x = rng.normal(0, 1, (5, 16)).astype(np.float32)
    y = ort.InferenceSession(q.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, x @ w + b, atol=0.05)  # int8 error, not a misplaced bias (~1)


def test_a_model_without_tokenizer_calibrates_on_synthetic_ids_within_its_positions(tmp_path):
    """GPT-2 built with transformers' save_pretrained (no tokenizer files, 64 positions): --int8
    calibrates on random ids no longer than the model's positions and keeps its next-token choices."""
    import onnxruntime as ort
    import torch
    import transformers

    from attnx.export.pretrained import export_pretrained

    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100,
                                                              n_positions=64)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(5.0)  # logits of order 1: top-1 is a real comparison
    hf.save_pretrained(tmp_path / "gpt2", safe_serialization=True)
    src = export_pretrained(tmp_path / "gpt2", tmp_path / "g.onnx").path
    dst = tmp_path / "g-int8.onnx"
    assert quantize_file(src, dst) == 9  # 2 layers x (q|k|v, o, fc, proj) + the LM head
    ids = np.random.default_rng(3).integers(0, 100, (4, 64)).astype(np.int64)

    def logits(path):
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return sess.run(["logits"], {i.name: ids if i.name == "input_ids" else np.ones_like(ids)
                                     for i in sess.get_inputs()})[0]

    want, got = logits(src), logits(dst)
    assert np.abs(want).max() > 1.0
    assert (want.argmax(-1) == got.argmax(-1)).mean() >= 0.85
    assert not np.array_equal(want, got)


@pytest.fixture(scope="module")
def int8_8bit(int8_of):
    src, _ = int8_of("mha")
    dst = src.with_name(f"{src.stem}-int8-w8.onnx")  # beside its source: the tokenizer folder is shared
    quantize_file(src, dst, weight_bits=8)
    return dst


def test_8bit_weights_use_the_full_range_and_say_so(int8_8bit):
    model = onnx.load(str(int8_8bit))
    weights = [numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT8
               and t.name.endswith("__s8")]
    assert len(weights) == 24
    assert all(np.abs(w).max() == 127 for w in weights)  # every column's largest weight maps to +-127
    assert ModelInfo.read(int8_8bit).quantization["weight_bits"] == 8
    with pytest.raises(ValueError, match=r"int8 weight bits 6: valid: 7 \(every CPU\) or 8"):
        quantize_file(int8_8bit, int8_8bit.with_name("x.onnx"), weight_bits=6)


@pytest.mark.skipif(__import__("attnx.runtime.core.cpu", fromlist=["x"]).saturates_8bit_weights(),
                    reason="this CPU's integer GEMM (AVX2 without VNNI) saturates 8-bit weights: that is why 7 is "
                    "the default")
def test_8bit_weights_are_more_accurate_on_a_cpu_that_does_not_saturate(int8_of, int8_8bit, st):
    _, seven = int8_of("mha")
    ref = st.encode(SENTENCES, convert_to_numpy=True).astype(np.float64)
    cos7, cos8 = _cosines(_embed(seven, SENTENCES), ref), _cosines(_embed(int8_8bit, SENTENCES), ref)
    assert cos8.min() >= COSINE["int8"], cos8
    # measured: worst sentence 0.991 -> 0.995, mean error 2.8e-3 -> 1.3e-3
    assert (1 - cos8).mean() < 0.7 * (1 - cos7).mean(), (cos7, cos8)
    assert cos8.min() > cos7.min()


def test_loading_8bit_weights_on_a_saturating_cpu_warns_once_at_load(int8_of, int8_8bit, monkeypatch):
    from attnx.runtime.core import cpu
    from attnx.runtime.core.backends.onnxrt import OnnxRuntimeSession

    monkeypatch.setattr(cpu, "saturates_8bit_weights", lambda: True)
    with pytest.warns(RuntimeWarning, match="8-bit int8 weights.*re-export with --int8-weight-bits 7"):
        OnnxRuntimeSession(int8_8bit)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OnnxRuntimeSession(int8_of("mha")[1])  # 7-bit: exact on that CPU, no warning
        monkeypatch.setattr(cpu, "saturates_8bit_weights", lambda: False)
        OnnxRuntimeSession(int8_8bit)


def test_cpu_integer_dot_product_names_and_which_cpus_saturate():
    from attnx.runtime.core.cpu import int8_dot_product, saturates_8bit_weights

    cases = [  # (flags, x86) -> (name starts with, saturates)
        ({"avx2", "avx512bw", "avx512_vnni", "amx_int8"}, True, "AMX", False),
        ({"avx2", "avx512bw", "avx512_vnni"}, True, "AVX-512 VNNI", False),
        ({"avx2", "avx_vnni"}, True, "AVX-VNNI", False),
        ({"avx2", "fma"}, True, "AVX2 without VNNI", True),
        ({"avx2", "avx512bw"}, True, "AVX2 without VNNI", True),
        ({"sse4_1"}, True, "SSE", False),
        ({"asimd", "asimddp"}, False, "", False),
    ]
    for flags, x86, name, clips in cases:
        assert int8_dot_product(frozenset(flags), x86).startswith(name), flags
        assert saturates_8bit_weights(frozenset(flags), x86) is clips, flags


@pytest.mark.parametrize("args, message", [
    (["--int8", "--int8-weight-bits", "6"], "error: --int8-weight-bits 6: valid: 7 (every CPU) or 8 (VNNI, AMX, ARM)"),
    (["--int8-weight-bits", "8"], "error: --int8-weight-bits needs --int8"),
])
def test_cli_refuses_bad_int8_weight_bits_in_one_line(tmp_path, args, message):
    out = attnx("export", "--variant", "mha", *args, "-o", str(tmp_path / "m.onnx"))
    assert out.returncode != 0
    assert [ln for ln in (out.stdout + out.stderr).strip().splitlines() if ln.strip()] == [message]
    assert not list(tmp_path.iterdir())


def test_cli_notes_when_8bit_weights_are_exported_on_a_cpu_that_would_clip_them(tmp_path, monkeypatch):
    from attnx.runtime.core import cpu

    args = ["export", "--variant", "mha", "--layers", "1", "--int8", "--int8-weight-bits", "8"]
    monkeypatch.setattr(cpu, "saturates_8bit_weights", lambda: True)
    clipping = attnx(*args, "-o", tmp_path / "a.onnx")
    assert clipping.returncode == 0, clipping.output
    assert "serve this file on a CPU with VNNI, AMX or ARM dot products" in clipping.output
    assert ModelInfo.read(tmp_path / "a.onnx").quantization["weight_bits"] == 8  # written all the same
    monkeypatch.setattr(cpu, "saturates_8bit_weights", lambda: False)
    fine = attnx(*args, "-o", tmp_path / "b.onnx")
    assert fine.returncode == 0 and "serve this file" not in fine.output


def test_cli_int8_weight_bits_reach_the_file(tmp_path):
    out = attnx("export", "--variant", "mha", "--layers", "1", "--int8", "--int8-weight-bits", "8", "-o",
                str(tmp_path / "m.onnx"))
    assert out.returncode == 0, out.stderr
    info = ModelInfo.read(tmp_path / "m.onnx")
    assert info.precision == "int8" and info.quantization["weight_bits"] == 8
    assert info.quantization["calibration"] == "8 synthetic batches"
    weights = [numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "m.onnx")).graph.initializer
               if t.data_type == onnx.TensorProto.INT8 and t.name.endswith("__s8")]
    assert weights and max(np.abs(w).max() for w in weights) == 127
