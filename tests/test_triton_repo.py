"""`attnx triton-repo`: a Triton model repository whose config parses with Triton's own schema."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from google.protobuf import text_format

from attnx.runtime import load
from attnx.deploy.triton import ConfigError, model_config, to_pbtxt, triton_schema, validate_config, write_repository
from conftest_runtime import EXPORT_KW


@pytest.fixture(scope="module")
def maw_path(exported):
    return exported("maw", **EXPORT_KW).path


@pytest.fixture(scope="module")
def smal_path(exported):
    return exported("smal", **EXPORT_KW).path


def parse_with_triton_schema(path):
    """Independent of our validator: Triton's ModelConfig message and protobuf's text parser."""
    message = triton_schema().ModelConfig()
    text_format.Parse(path.read_text(), message)
    return message


def test_onnx_repository_config_parses_with_tritons_schema(maw_path, tmp_path):
    d = load(maw_path).input("hidden_states").shape[2]
    model_dir = write_repository(maw_path, tmp_path / "repo", name="maw", max_batch_size=16,
                                 max_queue_delay_us=1500, max_queue_size=64, plugin_library=None)
    schema = triton_schema()
    cfg = parse_with_triton_schema(model_dir / "config.pbtxt")
    assert cfg.name == "maw" and cfg.platform == "onnxruntime_onnx" and cfg.max_batch_size == 16
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 1500
    assert cfg.dynamic_batching.default_queue_policy.max_queue_size == 64
    inputs = {t.name: t for t in cfg.input}
    assert list(inputs) == ["hidden_states", "attention_mask"]
    assert inputs["hidden_states"].data_type == schema.TYPE_FP32 and list(inputs["hidden_states"].dims) == [-1, d]
    assert inputs["attention_mask"].data_type == schema.TYPE_INT64 and list(inputs["attention_mask"].dims) == [-1]
    outputs = {t.name: t for t in cfg.output}
    assert list(outputs["output"].dims) == [-1, d]
    # [batch] output: Triton's idiom is dims [1] reshaped to [].
    assert list(outputs["maw_depth"].dims) == [1] and outputs["maw_depth"].HasField("reshape")
    assert cfg.default_model_filename == "model.onnx"
    assert (model_dir / "1" / "model.onnx").read_bytes() == maw_path.read_bytes()
    readme = (tmp_path / "repo" / "README.md").read_text()
    assert "does not pad" in readme and "--backend-config=tensorrt,plugins=" in readme and "LD_PRELOAD" in readme
    validate_config((model_dir / "config.pbtxt").read_text())


def test_smal_and_a_second_model_share_one_repository(maw_path, smal_path, tmp_path):
    repo = tmp_path / "repo"
    write_repository(maw_path, repo, name="maw")
    model_dir = write_repository(smal_path, repo, name="smal", instance_kind="KIND_CPU", instance_count=2)
    cfg = parse_with_triton_schema(model_dir / "config.pbtxt")
    spec = load(smal_path).input("trace")
    assert {t.name: list(t.dims) for t in cfg.input}["trace"] == list(spec.shape[1:])
    assert cfg.instance_group[0].count == 2 and cfg.instance_group[0].kind == triton_schema().ModelInstanceGroup.KIND_CPU
    assert "`maw`" in (repo / "README.md").read_text() and "`smal`" in (repo / "README.md").read_text()


def test_engine_repository_uses_tensorrt_plan_and_ships_the_plugin(maw_path, tmp_path):
    engine = tmp_path / "maw.engine"
    engine.write_bytes(b"serialized engine bytes")
    plugin = tmp_path / "libattnx_plugins.so"
    plugin.write_bytes(b"\x7fELF fake")
    model_dir = write_repository(engine, tmp_path / "repo", plugin_library=plugin, onnx_path=maw_path)
    cfg = parse_with_triton_schema(model_dir / "config.pbtxt")
    assert cfg.platform == "tensorrt_plan" and cfg.default_model_filename == "model.plan"
    assert (model_dir / "1" / "model.plan").read_bytes() == b"serialized engine bytes"
    assert (tmp_path / "repo" / "plugins" / "libattnx_plugins.so").read_bytes() == plugin.read_bytes()
    assert "plugins/libattnx_plugins.so" in (tmp_path / "repo" / "README.md").read_text()


def test_engine_io_from_the_build_sidecar(tmp_path):
    engine = tmp_path / "m.engine"
    engine.write_bytes(b"x")
    (tmp_path / "m.engine.json").write_text(json.dumps({  # an attnx sidecar names its engine's sha256
        "engine_sha256": "0" * 64,
        "backend": "tensorrt_rtx",
        "inputs": [{"name": "hidden_states", "dtype": "float16", "shape": ["batch", "seq", 64]},
                   {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "seq"]}],
        "outputs": [{"name": "output", "dtype": "float16", "shape": ["batch", "seq", 64]}],
    }))
    cfg = parse_with_triton_schema(write_repository(engine, tmp_path / "repo") / "config.pbtxt")
    assert [t.data_type for t in cfg.input] == [triton_schema().TYPE_FP16, triton_schema().TYPE_INT64]


def test_validator_rejects_what_triton_would(tmp_path):
    good = to_pbtxt({"name": "m", "platform": "onnxruntime_onnx", "max_batch_size": 4,
                     "input": [{"name": "x", "data_type": _enum("TYPE_FP32"), "dims": [-1, 8]}],
                     "output": [{"name": "y", "data_type": _enum("TYPE_FP32"), "dims": [-1, 8]}]})
    validate_config(good)
    with pytest.raises(ConfigError, match="schema rejects"):
        validate_config(good + "max_batch_sise: 3\n")  # unknown field
    with pytest.raises(ConfigError, match="schema rejects"):
        validate_config(good.replace("TYPE_FP32", "TYPE_FLOAT32", 1))  # unknown enum value
    with pytest.raises(ConfigError, match="no dims"):
        validate_config(good.replace("dims: [ -1, 8 ]", "", 1))
    with pytest.raises(ConfigError, match="no platform"):
        validate_config(good.replace('platform: "onnxruntime_onnx"', ""))
    with pytest.raises(ConfigError, match="dynamic_batching needs max_batch_size"):
        validate_config(good.replace("max_batch_size: 4", "max_batch_size: 0") + "dynamic_batching {\n}\n")


def test_server_config_endpoint_matches_the_repository_config(maw_path):
    session = load(maw_path)
    cfg = model_config("maw", session, max_batch_size=8, max_queue_delay_us=100)
    message = validate_config(to_pbtxt(cfg))
    assert message.max_batch_size == 8 and message.dynamic_batching.max_queue_delay_microseconds == 100


def test_cli_writes_the_latest_export(maw_path, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "maw.onnx").write_bytes(maw_path.read_bytes())
    env = {**os.environ, "ATTNX_WORKDIR": str(work)}
    run = subprocess.run([sys.executable, "-m", "attnx.cli.main", "triton-repo", "-o", str(tmp_path / "repo"),
                          "--max-batch", "8"], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "most recent ONNX export" in run.stderr
    cfg = parse_with_triton_schema(tmp_path / "repo" / "maw" / "config.pbtxt")
    assert cfg.max_batch_size == 8
    bad = subprocess.run([sys.executable, "-m", "attnx.cli.main", "triton-repo", str(tmp_path / "nope.onnx")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode != 0 and "no model file" in bad.stderr


def _enum(value):
    from attnx.deploy.triton import Enum

    return Enum(value)
