"""TensorRT-RTX's "precision-lose casting" warnings on every fp16 build are explained where they appear
(issue 26, friction): they name the clamps that have only a lower bound, whose missing upper bound
TensorRT fills with float32's largest value; `attnx build-engine` says so in one note."""

from __future__ import annotations

import shutil

import onnx
import pytest
from onnx import TensorProto, helper

from attnx.engine.fp16 import unbounded_clips
from support import exports
from support.cli import run as attnx


def test_unbounded_clips_are_the_ones_without_an_upper_bound(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2])
    lo = helper.make_tensor("lo", TensorProto.FLOAT16, [], [0.0])
    hi = helper.make_tensor("hi", TensorProto.FLOAT16, [], [1.0])
    nodes = [helper.make_node("Clip", ["x", "lo"], ["a"], name="only_min"),
             helper.make_node("Clip", ["a", "lo", ""], ["b"], name="empty_max"),
             helper.make_node("Clip", ["b", "lo", "hi"], ["y"], name="both")]
    graph = helper.make_graph(nodes, "g", [x], [y], initializer=[lo, hi])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    assert unbounded_clips(path) == ["only_min", "empty_max"]


@pytest.mark.rtx
def test_an_fp16_build_explains_its_precision_warnings(tmp_path_factory, tmp_path):
    src = exports.minilm().path  # sentence pooling: clamp(min=...) twice
    work = tmp_path / "m"
    work.mkdir()
    shutil.copy(src, work / src.name)
    shutil.copytree(src.with_suffix(".tokenizer"), work / src.with_suffix(".tokenizer").name)
    weights = src.with_suffix(".safetensors")
    if weights.is_file():
        shutil.copy(weights, work / weights.name)
    run = attnx("build-engine", "--fp16", str(work / src.name), env={"ATTNX_WORKDIR": str(tmp_path)})
    assert run.returncode == 0, run.stderr
    notes = [line for line in run.stderr.splitlines() if line.startswith("note: TensorRT's 'precision-lose casting'")]
    assert len(notes) == 1, run.stderr
    assert "2 clamp(s) with only a lower bound" in notes[0]
