"""``attnx export --int8 --with-past`` (issue 34): the int8 calibration feeds a with-past file what it accepts (a
prefill after one masked cache slot), the int8 decoder generates, and a failed quantization never leaves the fp32
export under the int8 name.

Before: calibration fed ``past`` = 1 with a ``[1, 1]`` attention mask beside ``[1, len]`` ids; ONNX Runtime
failed (GatherND invalid index) after the whole export, and the fp32 file stayed under the int8 name.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

import generation_fixtures as gf
from attnx.contract import ModelInfo
from attnx.export.quantize import calibration_feeds
from support.cli import run as attnx


def test_calibration_feeds_of_a_with_past_file_run_on_onnx_runtime():
    path = gf.export(gf.folder("llama"), "mha")
    info = ModelInfo.read(path)
    feeds = calibration_feeds(path, info)
    assert len(feeds) >= 4
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    for feed in feeds:
        n = feed["input_ids"].shape[1]
        assert feed["attention_mask"].tolist() == [[0] + [1] * n]
        (logits,) = sess.run(["logits"], feed)
        assert logits.shape[:2] == (1, 1) and np.isfinite(logits).all()  # the last position's only


def test_int8_with_past_exports_and_generates_near_fp32(tmp_path):
    from attnx.runtime import TextModel

    folder = gf.folder("llama")
    out = tmp_path / "int8" / "model.onnx"
    proc = attnx("export", "--from-pretrained", folder, "--with-past", "--int8", "-o", out)
    assert proc.returncode == 0, proc.stderr
    info = ModelInfo.read(out)
    assert info.precision == "int8" and info.cache and info.quantization["matmuls"] > 0
    assert "built-in sentences" in info.quantization["calibration"]
    fp32 = TextModel(gf.export(folder, "mha"))
    int8 = TextModel(out)
    ids = fp32.tokenizer.tokenize(["the cat sat on the mat"])[0].ids.tolist()
    a, _ = fp32.decoder.start(ids)
    b, _ = int8.decoder.start(ids)
    a, b = np.asarray(a).ravel(), np.asarray(b).ravel()
    # random tiny weights: logits near fp32's, not equal (int8 weights and activations)
    assert np.abs(a - b).max() < 0.1 * np.abs(a).max() and np.abs(a - b).max() > 0
    assert len([p for p in int8.generate("the cat", max_new_tokens=5, details=True) if p.token is not None]) == 5


def test_a_failed_quantization_leaves_no_file_under_the_int8_name(tmp_path, monkeypatch):
    import attnx.export.quantize as q

    def broken(*args, **kwargs):
        raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : GatherND invalid index")

    monkeypatch.setattr(q, "quantize_file", broken)
    out = tmp_path / "int8" / "model-int8.onnx"
    proc = attnx("export", "--from-pretrained", gf.folder("llama"), "--with-past", "--int8", "-o", out)
    assert proc.returncode != 0
    assert len(proc.errors()) == 1 and "int8 quantization failed" in proc.errors()[0], proc.stderr
    assert "GatherND" in proc.errors()[0] and "Traceback" not in proc.output
    assert not out.exists() and not list(out.parent.glob("*.onnx*"))
