"""`attnx export` / `attnx inspect` / `attnx variants` through the real command line."""

from __future__ import annotations

import json
import subprocess
import sys

import onnx
import pytest
from onnx import TensorProto, helper

from attnx.models import VARIANTS

ATTNX = [sys.executable, "-m", "attnx.cli.main"]


def attnx(*args, cwd=None):
    return subprocess.run([*ATTNX, *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_export_defaults_writes_under_workdir(tmp_path):
    proc = attnx("export", "--variant", "maw", "--set", "d_model=32", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    path = tmp_path / "attnx-out" / "maw.onnx"
    assert path.is_file() and proc.stdout.strip().splitlines()[-1] == "attnx-out/maw.onnx"
    assert (tmp_path / "attnx-out" / "maw.safetensors").is_file()
    info = json.loads(attnx("inspect", str(path), "--json").stdout)
    assert info["attnx"] and info["opsets"] == {"ai.onnx": 23, "attnx": 1}
    assert [c["op"] for c in info["custom_ops"]] == ["MawDepthGather"] and info["custom_ops"][0]["function_body"]
    assert [o["name"] for o in info["outputs"]] == ["output", "maw_depth"]
    assert info["metadata"]["attnx.variant"] == "maw"
    assert info["parameters"] > 10_000


def test_export_flags(tmp_path):
    out = tmp_path / "s.onnx"
    proc = attnx("export", "--variant", "smal", "-o", str(out), "--lowering", "rewrite", "--fp16", "--layers", "3",
                 "--set", "d_model=48", "--set", "n_heads=6", "--set", "per_head_trace=true", "--seq", "1,64,256")
    assert proc.returncode == 0, proc.stderr
    model = onnx.load(str(out))
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["attnx.lowering"] == "rewrite" and meta["attnx.precision"] == "fp16"
    cfg = json.loads(meta["attnx.config"])
    assert cfg["encoder"]["n_layers"] == 3 and cfg["attention"]["smal"]["per_head_trace"] is True
    assert json.loads(meta["attnx.profiles"])["seq"] == [1, 64, 256]
    trace = next(i for i in model.graph.input if i.name == "trace")
    assert [d.dim_param or d.dim_value for d in trace.type.tensor_type.shape.dim] == ["batch", 6, 8, 8]


@pytest.mark.parametrize("args,message", [
    (["--variant", "nope"], "unknown variant 'nope'; valid variants: mha, cultural, metaphor, maw, smal"),
    (["--variant", "maw", "--set", "depth=3"], "--set depth: unknown option for variant 'maw'; valid:"),
    (["--variant", "maw", "--set", "depth_dim=three"], "--set depth_dim=three: expected int"),
    (["--variant", "maw", "--set", "d_model"], "expected key=value"),
    (["--variant", "mha", "--set", "d_model=30", "--set", "n_heads=4"], "d_model (30) must be divisible by n_heads (4)"),
    (["--variant", "cultural", "--set", "bias_mode=sideways"], "bias_mode must be one of 'key', 'query'"),
    (["--variant", "mha", "--lowering", "fast"], "--lowering 'fast': valid: plugin, rewrite"),
    (["--variant", "mha", "--checkpoint", "/nonexistent/w.safetensors"], "checkpoint not found"),
    (["--variant", "mha", "--seq", "1,2"], "expected min,opt,max"),
    (["--variant", "mha", "--seq", "8,4,16"], "need 1 <= min <= opt <= max"),
])
def test_export_errors_are_one_line(tmp_path, args, message):
    proc = attnx("export", *args, cwd=tmp_path)
    assert proc.returncode != 0
    assert message in proc.stderr.replace("\n", " ")
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.glob("attnx-out/*.onnx"))


def test_checkpoint_that_does_not_fit(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"blocks.0.attn.W_Q.weight": torch.zeros(2, 2)}, str(tmp_path / "w.safetensors"))
    proc = attnx("export", "--variant", "mha", "--checkpoint", str(tmp_path / "w.safetensors"), cwd=tmp_path)
    assert proc.returncode == 1 and "does not fit this mha model" in proc.stderr and "Traceback" not in proc.stderr
    verbose = attnx("--verbose", "export", "--variant", "mha", "--checkpoint", str(tmp_path / "w.safetensors"), cwd=tmp_path)
    assert "Traceback" in verbose.stderr


def test_inspect_any_onnx_file(tmp_path):
    node = helper.make_node("Relu", ["x"], ["y"])
    custom = helper.make_node("Foo", ["y"], ["z"], domain="acme")
    graph = helper.make_graph([node, custom], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 3])],
                              [helper.make_tensor("w", TensorProto.FLOAT, [4, 5], [0.0] * 20)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("acme", 1)])
    onnx.save(model, tmp_path / "other.onnx")
    info = json.loads(attnx("inspect", str(tmp_path / "other.onnx"), "--json").stdout)
    assert info["inputs"] == [{"name": "x", "dtype": "float", "shape": ["n", 3]}]
    assert info["custom_ops"] == [{"domain": "acme", "op": "Foo", "count": 1, "function_body": False, "schema": False}]
    assert info["parameters"] == 20 and not info["attnx"]
    table = attnx("inspect", str(tmp_path / "other.onnx"))
    assert table.returncode == 0 and "acme::Foo" in table.stdout
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    proc = attnx("inspect", str(bad))
    assert proc.returncode != 0 and "not a readable ONNX file" in proc.stderr and "Traceback" not in proc.stderr


def test_variants_lists_options_and_context():
    proc = attnx("variants", "--json")
    info = {v["name"]: v for v in json.loads(proc.stdout)}
    assert list(info) == list(VARIANTS)
    assert info["maw"]["options"]["depth_dim"] == 5 and info["maw"]["outputs"] == ["output", "maw_depth"]
    assert info["smal"]["context"][1] == {"name": "trace", "shape": ["batch", 64, 64], "dtype": "float",
                                           "doc": "trace tensor T"}
    assert info["cultural"]["options"]["bias_mode"] == "key"
    assert "depth_dim" in attnx("variants").stdout
