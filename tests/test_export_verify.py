"""``attnx export`` checks the file it wrote (:mod:`attnx.parity.after_export`, issue 47 item 5).

One case through ONNX Runtime against the PyTorch model still in memory, one line of result: the numbers are the
file's (a file whose weights are perturbed fails, by the difference the perturbation makes), ``--no-verify``
prints none of it, and a failure is one error line naming the output, exit 1, the file kept.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from attnx.export.exporter import export_variant
from attnx.parity import after_export
from attnx.parity.after_export import MAX_REFERENCE_BYTES, skip_reason, verify_export

from support.cli import one_line_error, run as attnx

TINY = ["--layers", "1", "--set", "d_model=32", "--set", "n_heads=2"]
LINE = re.compile(r"^verify: passed \(ONNX Runtime vs PyTorch, fp32, 1x8 tokens; max abs diff output ([0-9.e+-]+); "
                  r"[0-9.]+s\)$", re.M)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return export_variant("smal", tmp_path_factory.mktemp("verify") / "smal.onnx", n_layers=1,
                          overrides={"d_model": 32, "n_heads": 2})


def _outputs(path, feeds):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(["output"], {k: v for k, v in feeds.items() if k in {i.name for i in session.get_inputs()}})[0]


def test_a_file_with_perturbed_weights_fails_by_the_difference_it_makes(tiny, tmp_path):
    good = verify_export(tiny.model, tiny.path, tiny.info)
    assert good.passed is True and 0 < good.max_abs["output"] < 1e-4, good.line
    model = onnx.load(str(tiny.path))
    weight = max((t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT),
                 key=lambda t: int(np.prod(t.dims)))
    values = numpy_helper.to_array(weight).copy()
    values.flat[0] += 0.5  # one weight moved: a wrong file, not rounding
    weight.CopyFrom(numpy_helper.from_array(values, weight.name))
    bad_path = tmp_path / "perturbed.onnx"
    onnx.save(model, str(bad_path))
    bad = verify_export(tiny.model, bad_path, tiny.info)
    assert bad.passed is False
    assert bad.line.startswith("verify: FAILED: output differs from the PyTorch model by up to ")
    assert f"`attnx check {bad_path}` gives the full report" in bad.line and "\n" not in bad.line
    # the reported figure is the file's: what the perturbation moves ONNX Runtime's output by, give or take
    # the good file's own distance from the reference
    feeds = after_export._feeds(tiny.model, tiny.info, ort.InferenceSession(str(tiny.path)), 8, False)
    moved = float(np.abs(_outputs(bad_path, feeds) - _outputs(tiny.path, feeds)).max())
    assert moved > 1e-3 and abs(bad.max_abs["output"] - moved) <= 2 * good.max_abs["output"] + 1e-6


def test_what_is_skipped_says_why(tiny, monkeypatch):
    assert skip_reason(tiny.model, tiny.info) is None
    monkeypatch.setattr(after_export, "MAX_REFERENCE_BYTES", 1000)
    assert "above the" in skip_reason(tiny.model, tiny.info)
    monkeypatch.setattr(after_export, "MAX_REFERENCE_BYTES", MAX_REFERENCE_BYTES)
    import dataclasses

    int4 = dataclasses.replace(tiny.info, precision="int4-weights")
    found = verify_export(tiny.model, tiny.path, int4)
    assert found.passed is None and found.line.startswith("verify: skipped: int4-weights (weight-only) files")


def test_export_prints_one_verify_line_and_no_verify_none(tmp_path):
    proc = attnx("export", "--variant", "mha", *TINY, "-o", tmp_path / "m.onnx")
    assert proc.returncode == 0, proc.stderr
    found = LINE.findall(proc.stdout)
    assert len(found) == 1 and 0 < float(found[0]) < 1e-4, proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == str(tmp_path / "m.onnx")
    quiet = attnx("export", "--variant", "mha", *TINY, "-o", tmp_path / "n.onnx", "--no-verify")
    assert quiet.returncode == 0, quiet.stderr
    assert "verify:" not in quiet.output


def test_a_failed_verification_is_one_error_line_and_keeps_the_file(tmp_path, monkeypatch):
    real = after_export._reference

    def off_by_one_tenth(model, feeds, names, float64=False):  # a reference the file cannot match
        return {k: v + 0.1 for k, v in real(model, feeds, names, float64).items()}

    monkeypatch.setattr(after_export, "_reference", off_by_one_tenth)
    proc = attnx("export", "--variant", "mha", *TINY, "-o", tmp_path / "m.onnx")
    line = one_line_error(proc, "verify: FAILED: output differs from the PyTorch model by up to 0.1",
                          "gives the full report")
    assert proc.returncode == 1 and "attnx check" in line
    assert (tmp_path / "m.onnx").is_file()
