"""CLI guards of issue 15 item 7: a command never destroys the file it reads (one line, non-zero exit)."""

from __future__ import annotations

import shutil

import onnx

from conftest_runtime import EXPORT_KW
from support.cli import run as attnx


def test_build_engine_refuses_to_write_over_its_source_model(exported, tmp_path):
    """Before: `attnx build-engine v.onnx -o v.onnx` replaced the ONNX file with the engine, exit 0."""
    src = exported("maw", **EXPORT_KW).path
    model = tmp_path / "v.onnx"
    shutil.copy(src, model)
    before = model.read_bytes()
    for spelled in (model, tmp_path / "sub" / ".." / "v.onnx"):
        (tmp_path / "sub").mkdir(exist_ok=True)
        proc = attnx("build-engine", model, "-o", spelled)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "is the model itself" in lines[0] and "v.engine" in lines[0], proc.stderr
    assert model.read_bytes() == before
    onnx.checker.check_model(onnx.load(model, load_external_data=False))


def test_a_failed_save_leaves_no_tmp_file(tmp_path, monkeypatch):
    """Issue 15 item 9: `build-engine --fp16` left `*-fp16.onnx.tmp` behind when saving failed."""
    import onnx

    from attnx.export import onnx_file
    from attnx.export.exporter import save_model

    def half_write(model, path, *args, **kwargs):
        open(path, "wb").write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(onnx_file, "save", half_write)
    model = onnx.helper.make_model(onnx.helper.make_graph([], "g", [], []))
    with __import__("pytest").raises(OSError, match="No space left"):
        save_model(model, tmp_path / "m-fp16.onnx")
    assert list(tmp_path.iterdir()) == []
