"""`attnx build-engine`, `attnx check` and `attnx demo` through the CLI (in process; real processes where
the installed packages or the start-up environment are what is tested):
the happy path with defaults, and every error of the issue as one line with no traceback.

The adapter's backend selection itself (fake importers, the PyPI stub, $ATTNX_TENSORRT_BACKEND)
is unit-tested in tests/test_plugins_tensorrt.py; here the same situations are produced for a
real process (shadowing packages on PYTHONPATH) and checked at the user's end.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import attnx.engine as tb
from support.cli import one_line_error, subprocess_run
from support.cli import run as attnx


def attnx_with(fakes: Path, *args, cwd: Path, env: dict | None = None):
    """A real process whose imports see the fake packages in ``fakes`` first (or the environment ``env``
    at start-up): what a user with that installation gets."""
    environ = dict(env or {})
    if fakes is not None:
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(fakes), os.environ.get("PYTHONPATH")]))
    return subprocess_run(*args, cwd=cwd, env=environ)


def _workdir(res, tmp: Path) -> Path:
    """A project folder whose attnx-out/ holds a copy of the export and its weights (and the other lowering
    a check of it re-exports: :func:`support.exports.check_workdir`)."""
    from support.exports import check_workdir

    out = tmp / "attnx-out"
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(res.path, out / f"{res.info.variant}.onnx")
    shutil.copy(res.weights_path, out / res.info.weights)
    check_workdir(out / f"{res.info.variant}.onnx", out)
    return tmp


def _fake_packages(folder: Path, **modules: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, source in modules.items():
        (folder / name).mkdir(exist_ok=True)
        (folder / name / "__init__.py").write_text(source)
    return folder


NO_TENSORRT = "raise ImportError('simulated: {} is not installed')\n"


# ----------------------------------------------------------------------------- the happy path


def test_build_engine_and_check_with_defaults(exported, rtx, tmp_path):
    cwd = _workdir(exported("maw"), tmp_path)
    built = attnx("build-engine", "--fp16", "--shapes", "batch=1,2,4", "--shapes", "seq=1,16,32", cwd=cwd)
    assert built.returncode == 0, built.stderr
    assert "using the most recent ONNX export: " in built.stderr and "maw.onnx" in built.stderr
    engine = Path(built.stdout.strip().splitlines()[-1])
    assert (cwd / engine).resolve() == (cwd / "attnx-out" / "maw-fp16.engine").resolve()
    assert "2 plugin layers, 0 inlined" in built.stdout and "sm89" in built.stdout
    side = json.loads((cwd / "attnx-out" / "maw-fp16.engine.json").read_text())
    assert side["precision"] == "fp16" and side["profiles"]["batch"] == [1, 2, 4]

    report = tmp_path / "parity.json"
    checked = attnx("check", "--report", report, cwd=cwd)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "maw-fp16.onnx" in checked.stderr  # the most recent export is now the fp16 file
    assert "maw-fp16.engine" in checked.stderr  # and its engine was found beside it
    assert "engine not run here" in checked.stdout and "no CUDA GPU" in checked.stdout
    assert "onnxrt-plugin" in checked.stdout and "onnxrt-rewrite" in checked.stdout and "PASS" in checked.stdout
    data = json.loads(report.read_text())
    assert data["passed"] and data["engine"]["ran"] is False and data["precision"] == "fp16"
    assert all(c["batch"] <= 4 and c["seq"] <= 32 for c in data["cases"])  # inside the engine's profile


def test_check_fails_on_perturbed_weights(exported, tmp_path):
    cwd = _workdir(exported("smal"), tmp_path)
    path = cwd / "attnx-out" / "smal.onnx"
    model = onnx.load(str(path))
    init = max(model.graph.initializer, key=lambda i: int(np.prod(i.dims)))
    arr = numpy_helper.to_array(init).copy()
    arr *= np.float32(1.05)
    init.CopyFrom(numpy_helper.from_array(arr, init.name))
    onnx.save(model, str(path))
    proc = attnx("check", path, cwd=cwd)
    assert proc.returncode == 1
    assert "FAIL" in proc.stdout
    line = one_line_error(proc, "parity mismatch", "onnxrt-plugin vs torch: output")
    assert "onnxrt-rewrite" not in line  # the re-export from the reference matches


def test_demo_one_variant(rtx, tmp_path):
    """`attnx demo --toy` for one variant: export, fp16 engine (its plugins), check, all passing (the demo
    path is the same for every variant; `make demo` runs the real MiniLM)."""
    proc = attnx("demo", "--toy", "--workdir", tmp_path / "demo", "--variants", "maw", "--set", "d_model=32",
                 cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "attnx demo" in out and "maw" in out and "2 of 2" in out and "pass" in out
    assert (tmp_path / "demo" / "maw.onnx").is_file() and (tmp_path / "demo" / "maw-fp16.engine").is_file()
    assert json.loads((tmp_path / "demo" / "parity" / "maw-fp16.parity.json").read_text())["passed"]


# ----------------------------------------------------------------------------- errors, one line each


def test_missing_plugin_library(exported, rtx, tmp_path):
    cwd = _workdir(exported("maw"), tmp_path)
    one_line_error(attnx("build-engine", "--plugins", tmp_path / "nowhere" / "libattnx_plugins.so", cwd=cwd),
                   "plugin library", "does not exist")


def test_incompatible_plugin_library(exported, rtx, tmp_path):
    cwd = _workdir(exported("maw"), tmp_path)
    bogus = tmp_path / "libnot_a_plugin.so"
    bogus.write_bytes(b"\x7fELF not really")
    one_line_error(attnx("build-engine", "--plugins", bogus, cwd=cwd), "refused the plugin library",
                   "getCreators")


def test_op_the_parser_cannot_map(rtx, tmp_path):
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, ["batch", "seq", 8])
    y = helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", "seq", 8])
    node = helper.make_node("Swizzle", ["hidden_states"], ["output"], domain="research.ops", name="swizzle0")
    model = helper.make_model(helper.make_graph([node], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("research.ops", 1)])
    path = tmp_path / "swizzle.onnx"
    onnx.save(model, str(path))
    one_line_error(attnx("build-engine", path, "--shapes", "batch=1,1,2", "--shapes", "seq=1,4,8", cwd=tmp_path),
                   "cannot map the model to TensorRT", "Swizzle")


def test_shapes_outside_the_profile(exported, rtx, tmp_path):
    cwd = _workdir(exported("mha"), tmp_path)
    one_line_error(attnx("build-engine", "--shapes", "batch=8,4,16", cwd=cwd), "min <= opt <= max")
    one_line_error(attnx("build-engine", "--shapes", "heads=1,2,3", cwd=cwd), "unknown axis 'heads'")
    built = attnx("build-engine", "--shapes", "batch=1,2,4", cwd=cwd)
    assert built.returncode == 0, built.stderr
    one_line_error(attnx("check", "--case", "8x16", cwd=cwd), "case 8x16", "outside the engine's profile",
                   "batch=1..4")


def test_corrupt_files(exported, rtx, tmp_path):
    cwd = _workdir(exported("cultural"), tmp_path)
    junk = cwd / "attnx-out" / "junk.onnx"
    junk.write_bytes(b"\x0a\xff\xff\xffnot a protobuf")
    one_line_error(attnx("build-engine", junk, cwd=cwd), "not a readable ONNX file")
    one_line_error(attnx("check", junk, cwd=cwd), "not a readable ONNX file")
    model = cwd / "attnx-out" / "cultural.onnx"
    built = attnx("build-engine", model, cwd=cwd)
    assert built.returncode == 0, built.stderr
    engine = cwd / "attnx-out" / "cultural.engine"
    data = bytearray(engine.read_bytes())
    data[100] ^= 0xFF
    engine.write_bytes(bytes(data))
    one_line_error(attnx("check", model, "--engine", engine, cwd=cwd), "corrupt", "rebuild")
    stray = cwd / "stray.engine"
    stray.write_text("plain text")
    one_line_error(attnx("check", model, "--engine", stray, cwd=cwd), "not a TensorRT engine")


def test_no_tensorrt_installed(exported, tmp_path):
    cwd = _workdir(exported("maw"), tmp_path)
    fakes = _fake_packages(tmp_path / "fakes", tensorrt=NO_TENSORRT.format("tensorrt"),
                           tensorrt_rtx_libs=NO_TENSORRT.format("tensorrt_rtx_libs"))
    line = one_line_error(attnx_with(fakes, "build-engine", "--fp16", cwd=cwd), "no usable TensorRT")
    assert "pip install attnx[tensorrt]" in line and "pip install attnx[rtx]" in line
    # Forcing full TensorRT where it is absent names that extra.
    one_line_error(attnx_with(None, "build-engine", cwd=cwd, env={"ATTNX_TENSORRT_BACKEND": "tensorrt"}),
                   "pip install attnx[tensorrt]")


def test_check_without_tensorrt_still_verifies_the_rest(exported, rtx, tmp_path):
    cwd = _workdir(exported("maw"), tmp_path)
    built = attnx("build-engine", cwd=cwd)
    assert built.returncode == 0, built.stderr
    fakes = _fake_packages(tmp_path / "fakes", tensorrt=NO_TENSORRT.format("tensorrt"),
                           tensorrt_rtx_libs=NO_TENSORRT.format("tensorrt_rtx_libs"))
    proc = attnx_with(fakes, "check", cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    notes = [line for line in proc.stdout.splitlines() if line.startswith("engine not run here")]
    assert len(notes) == 1 and "no TensorRT installed here" in notes[0]
    assert "PASS" in proc.stdout


def test_pypi_tensorrt_stub_falls_back_to_rtx(exported, rtx, tmp_path):
    """`pip install tensorrt` without NVIDIA's index gives an importable stub with no API."""
    cwd = _workdir(exported("smal"), tmp_path)
    fakes = _fake_packages(tmp_path / "fakes", tensorrt="__version__ = '10.14.1'\n")
    proc = attnx_with(fakes, "build-engine", cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    side = json.loads((cwd / "attnx-out" / "smal.engine.json").read_text())
    assert side["backend"] == "tensorrt-rtx" and side["plugin_layers"] == 2


def test_full_tensorrt_branch_up_to_the_gpu(exported, rtx, tmp_path):
    """TensorRT-RTX's bindings installed under the name `tensorrt`: the adapter selects the full
    TensorRT branch (preferred), parses with our plugins through the registry, and then stops where
    full TensorRT needs the local GPU, with a one-line error saying what to do."""
    if tb.gpu_compute_capability() is not None:
        pytest.skip("a GPU is present")
    cwd = _workdir(exported("maw"), tmp_path)
    fakes = _fake_packages(tmp_path / "fakes", tensorrt=(
        "import sys\nimport tensorrt_rtx_libs\nimport tensorrt_rtx_bindings as _trt\nsys.modules[__name__] = _trt\n"))
    one_line_error(attnx_with(fakes, "build-engine", cwd=cwd), "full TensorRT builds engines for the local GPU",
                   "attnx[rtx]")
    other = attnx_with(fakes, "build-engine", "--target", "sm86", cwd=cwd)
    one_line_error(other, "local GPU")
    assert "compiling" not in other.stdout + other.stderr  # refused before the plugins are built for sm86
