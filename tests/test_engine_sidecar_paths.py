"""An engine's sidecar is untrusted (issue 47): the source ONNX it names is followed only inside the engine's folder,
as docs/architecture.md promises for every path a file carries."""

from __future__ import annotations

import json

import onnx
import pytest
from onnx import TensorProto, helper

from attnx.runtime.core.backends.tensorrt import engine_io_specs


def _identity_onnx(path, width: int) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]), path)


def _engine(folder, sidecar: dict):
    folder.mkdir(parents=True)
    engine = folder / "model.engine"
    engine.write_bytes(b"vtrt")
    (folder / "model.engine.json").write_text(json.dumps({"engine_sha256": "0" * 64, **sidecar}))
    return engine


def test_the_sidecar_source_is_read_inside_the_engine_folder(tmp_path):
    engine = _engine(tmp_path / "eng", {"onnx": "/elsewhere/built-on-another-machine.onnx", "onnx_name": "src.onnx"})
    _identity_onnx(engine.parent / "src.onnx", 7)
    inputs, outputs, _ = engine_io_specs(engine)
    assert [s.name for s in inputs] == ["x"] and inputs[0].shape[-1] == 7 and [s.name for s in outputs] == ["y"]


@pytest.mark.parametrize("key", ["onnx", "onnx_name"])
def test_a_sidecar_path_outside_the_engine_folder_is_not_followed(tmp_path, key):
    outside = tmp_path / "outside.onnx"
    _identity_onnx(outside, 5)
    engine = _engine(tmp_path / "eng", {key: str(outside) if key == "onnx" else "../outside.onnx"})
    with pytest.raises(FileNotFoundError, match="no source ONNX found"):
        engine_io_specs(engine)
