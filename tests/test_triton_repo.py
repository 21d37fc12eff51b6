"""`attnx triton-repo`: a Triton model repository whose config parses with Triton's own schema."""

from __future__ import annotations

import json
import shutil

import pytest
from google.protobuf import text_format

from attnx.contract import sha256_file
from attnx.deploy.repository import write_repository
from attnx.deploy.triton import ConfigError, model_config, to_pbtxt, triton_schema, validate_config
from attnx.runtime import load
from conftest_runtime import EXPORT_KW
from support.cli import one_line_error
from support.cli import run as attnx


PLAN = b"ftrt" + bytes(60)


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
                                 max_queue_delay_us=1500, max_queue_size=64, plugin_library=None).model_dir
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
    model_dir = write_repository(smal_path, repo, name="smal", instance_kind="KIND_CPU", instance_count=2).model_dir
    cfg = parse_with_triton_schema(model_dir / "config.pbtxt")
    spec = load(smal_path).input("trace")
    assert {t.name: list(t.dims) for t in cfg.input}["trace"] == list(spec.shape[1:])
    assert cfg.instance_group[0].count == 2 and cfg.instance_group[0].kind == triton_schema().ModelInstanceGroup.KIND_CPU
    assert "`maw`" in (repo / "README.md").read_text() and "`smal`" in (repo / "README.md").read_text()


def test_engine_repository_uses_tensorrt_plan_and_ships_the_plugin(maw_path, tmp_path):
    engine = tmp_path / "maw.engine"
    engine.write_bytes(PLAN)  # a plan's header, no sidecar: the ONNX names the I/O
    plugin = tmp_path / "libattnx_plugins.so"
    plugin.write_bytes(b"\x7fELF fake")
    model_dir = write_repository(engine, tmp_path / "repo", plugin_library=plugin, onnx_path=maw_path).model_dir
    cfg = parse_with_triton_schema(model_dir / "config.pbtxt")
    assert cfg.platform == "tensorrt_plan" and cfg.default_model_filename == "model.plan"
    assert (model_dir / "1" / "model.plan").read_bytes() == PLAN
    # Inside the model's folder, where Triton ignores it: a repository-level folder would be taken for a model.
    assert (model_dir / "plugins" / "libattnx_plugins.so").read_bytes() == plugin.read_bytes()
    assert [p.name for p in (tmp_path / "repo").iterdir() if p.is_dir()] == ["maw"]
    assert "maw/plugins/libattnx_plugins.so" in (tmp_path / "repo" / "README.md").read_text()


def test_engine_io_from_the_build_sidecar(tmp_path):
    engine = tmp_path / "m.engine"
    engine.write_bytes(b"x")
    (tmp_path / "m.engine.json").write_text(json.dumps({  # an attnx sidecar names its engine's sha256
        "engine_sha256": sha256_file(engine),
        "backend": "tensorrt_rtx",
        "inputs": [{"name": "hidden_states", "dtype": "float16", "shape": ["batch", "seq", 64]},
                   {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "seq"]}],
        "outputs": [{"name": "output", "dtype": "float16", "shape": ["batch", "seq", 64]}],
    }))
    cfg = parse_with_triton_schema(write_repository(engine, tmp_path / "repo").model_dir / "config.pbtxt")
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


def test_python_backend_repository_runs_attnx_and_says_what_it_needs(maw_path, tmp_path):
    """``--backend python``: the model folder holds attnx's runtime model and the ONNX file; the sequence
    inputs batch ragged (attnx pads them), the mask is optional (attnx fills it). A real Triton runs such
    repositories in tests/test_triton_server.py."""
    from attnx.deploy import runtime_model

    run = attnx("triton-repo", str(maw_path), "-o", str(tmp_path / "repo"), "--name", "maw", "--backend", "python")
    assert run.returncode == 0, run.stderr
    assert "runs attnx's runtime in Triton's Python backend" in " ".join(run.stdout.split())
    model_dir = tmp_path / "repo" / "maw"
    cfg = parse_with_triton_schema(model_dir / "config.pbtxt")
    assert cfg.backend == "python" and not cfg.platform and cfg.max_batch_size == 32
    inputs = {t.name: t for t in cfg.input}
    assert inputs["hidden_states"].allow_ragged_batch and not inputs["hidden_states"].optional
    assert inputs["attention_mask"].allow_ragged_batch and inputs["attention_mask"].optional
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert params == {"model_file": "model.onnx", "max_length_ratio": "1.5"}
    assert (model_dir / "1" / "model.onnx").read_bytes() == maw_path.read_bytes()
    assert (model_dir / "1" / "model.py").read_text() == open(runtime_model.__file__).read()
    readme = (tmp_path / "repo" / "README.md").read_text()
    assert "Models run by attnx's runtime (Python backend)" in readme and "numpy<2" in readme
    dockerfile = (tmp_path / "repo" / "Dockerfile").read_text()
    assert '"numpy<2"' in dockerfile and "onnxruntime==" in dockerfile and "--no-deps" in dockerfile
    bad = attnx("triton-repo", str(maw_path), "-o", str(tmp_path / "repo2"), "--backend", "tensorrt")
    one_line_error(bad, "runs on Triton's onnxruntime backend or attnx's (python), not tensorrt")


def test_runtime_model_groups_requests_that_can_share_a_run():
    from types import SimpleNamespace as Item

    from attnx.deploy.runtime_model import length_groups

    items = [Item(key="a", length=10), Item(key="a", length=40), Item(key="b", length=10), Item(key="a", length=14),
             Item(key="a", length=12)]
    assert length_groups(items, 1.5) == [[0, 4, 3], [1], [2]]
    assert length_groups(items, None) == [[0, 4, 3, 1], [2]]


def test_server_config_endpoint_matches_the_repository_config(maw_path):
    session = load(maw_path)
    cfg = model_config("maw", session, max_batch_size=8, max_queue_delay_us=100)
    message = validate_config(to_pbtxt(cfg))
    assert message.max_batch_size == 8 and message.dynamic_batching.max_queue_delay_microseconds == 100


def test_cli_writes_the_latest_export(maw_path, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "maw.onnx").write_bytes(maw_path.read_bytes())
    env = {"ATTNX_WORKDIR": str(work)}
    run = attnx("triton-repo", "-o", str(tmp_path / "repo"), "--max-batch", "8", env=env)
    assert run.returncode == 0, run.stderr
    assert "most recent ONNX export" in run.stderr
    cfg = parse_with_triton_schema(tmp_path / "repo" / "maw" / "config.pbtxt")
    assert cfg.max_batch_size == 8
    bad = attnx("triton-repo", str(tmp_path / "nope.onnx"), env=env)
    assert bad.returncode != 0 and "no model file" in bad.stderr


def _enum(value):
    from attnx.deploy.triton import Enum

    return Enum(value)


# ----------------------------------------------------------------------------- issue 15: paths, errors, debris


def tree(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("name", ["../../x", "../escape", "/tmp/abs", "a/b", ".hidden", "..", "x y", "a\\b", ""])
def test_a_name_that_is_not_a_plain_model_name_is_refused(maw_path, tmp_path, name):
    work = tmp_path / "deep" / "er"
    work.mkdir(parents=True)
    before = tree(tmp_path)
    run = attnx("triton-repo", str(maw_path), "-o", str(work / "repo"), "--name", name, cwd=work)
    one_line_error(run, "is not a plain name", alone=True)
    assert tree(tmp_path) == before and not (tmp_path / "x").exists() and not (tmp_path.parent / "x").exists()


def _with_external_data(folder, location):
    """A small ONNX whose weight lives in external data; its location then rewritten to ``location``."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.arange(64, dtype=np.float32).reshape(8, 8), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])], [weight])
    path = folder / "ext.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path),
                    save_as_external_data=True, all_tensors_to_one_file=True, location="ext.data", size_threshold=0)
    if location != "ext.data":
        model = onnx.load(str(path), load_external_data=False)
        for entry in model.graph.initializer[0].external_data:
            if entry.key == "location":
                entry.value = location
        onnx.save_model(model, str(path))
    return path


def test_external_data_inside_the_folder_is_copied_with_the_model(tmp_path):
    model = _with_external_data(tmp_path, "ext.data")
    model_dir = write_repository(model, tmp_path / "repo").model_dir
    assert (model_dir / "1" / "ext.data").read_bytes() == (tmp_path / "ext.data").read_bytes()


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_external_data_outside_the_model_folder_is_refused_never_copied(tmp_path, where):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\x00" * 256)  # would be read as the 8x8 weight if followed
    models = tmp_path / "a" / "b" / "c"
    models.mkdir(parents=True)
    location = "../../../secret.bin" if where == "relative" else str(secret)
    model = _with_external_data(models, location)
    (models / "ext.data").unlink()
    run = attnx("triton-repo", str(model), "-o", str(tmp_path / "repo"))
    one_line_error(run, "external data location", "points outside", "refused", alone=True)
    assert not (tmp_path / "repo").exists()
    copies = [p for p in tmp_path.rglob("secret.bin")]
    assert copies == [secret]


@pytest.mark.parametrize("content,message", [
    (b"", "is empty: not an ONNX file"),
    (b"hello, not a model\n", "is not a readable ONNX file"),
    (None, "is not a readable ONNX file"),  # a real export, cut short
])
def test_corrupt_onnx_is_one_line_and_leaves_nothing(maw_path, tmp_path, content, message):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(maw_path.read_bytes()[:3000] if content is None else content)
    run = attnx("triton-repo", str(bad), "-o", str(tmp_path / "out" / "repo"))
    one_line_error(run, message, alone=True)
    assert not (tmp_path / "out").exists()
    verbose = attnx("--verbose", "triton-repo", str(bad), "-o", str(tmp_path / "out" / "repo"))
    assert verbose.returncode != 0 and "Traceback" in verbose.stderr


def test_an_engine_that_is_not_one_is_refused(maw_path, tmp_path):
    engine = tmp_path / "m.engine"
    engine.write_bytes(b"\x00garbage, not a plan")
    run = attnx("triton-repo", str(engine), "--onnx", str(maw_path), "-o", str(tmp_path / "repo"))
    one_line_error(run, "is not a TensorRT engine", alone=True)
    assert not (tmp_path / "repo").exists()


def test_missing_external_data_leaves_no_empty_folders(tmp_path):
    model = _with_external_data(tmp_path, "ext.data")
    (tmp_path / "ext.data").unlink()
    run = attnx("triton-repo", str(model), "-o", str(tmp_path / "new" / "repo"))
    one_line_error(run, "external data file 'ext.data' is missing", alone=True)
    assert not (tmp_path / "new").exists()


def test_a_failure_while_copying_leaves_no_debris_and_keeps_the_old_model(maw_path, smal_path, tmp_path, monkeypatch):
    import attnx.deploy.repository as repository

    repo = tmp_path / "repo"
    write_repository(maw_path, repo, name="m")
    before = {p: p.read_bytes() for p in repo.rglob("*") if p.is_file()}
    real_copy = shutil.copy2

    def failing_copy(src, dst, *args, **kwargs):
        if str(src).endswith(".onnx"):
            real_copy(src, dst, *args, **kwargs)
            raise OSError(28, "No space left on device")
        return real_copy(src, dst, *args, **kwargs)

    monkeypatch.setattr(repository.shutil, "copy2", failing_copy)
    with pytest.raises(OSError, match="No space left"):
        write_repository(smal_path, repo, name="m")  # replacing m: the old one must survive
    with pytest.raises(OSError, match="No space left"):
        write_repository(smal_path, tmp_path / "a" / "b" / "repo", name="m")
    assert {p: p.read_bytes() for p in repo.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]  # no staging folder, no a/b/


def test_folders_attnx_did_not_write_are_never_replaced(maw_path, tmp_path):
    repo = tmp_path / "repo"
    (repo / "maw").mkdir(parents=True)
    (repo / "maw" / "config.pbtxt").write_text('name: "maw"\nbackend: "python"\n')  # the user's own model
    with pytest.raises(ValueError, match="was not written by attnx triton-repo"):
        write_repository(maw_path, repo, name="maw")
    assert (repo / "maw" / "config.pbtxt").read_text().startswith('name: "maw"')
    write_repository(maw_path, repo, name="maw2")
    (repo / "README.md").write_text("my notes\n")
    write_repository(maw_path, repo, name="maw3")
    assert (repo / "README.md").read_text() == "my notes\n"  # the user's README is kept


def test_a_model_inside_the_folder_it_would_replace_is_refused(maw_path, tmp_path):
    repo = tmp_path / "repo"
    inner = write_repository(maw_path, repo, name="m").model_dir / "1" / "model.onnx"
    run = attnx("triton-repo", str(inner), "-o", str(repo), "--name", "m")
    one_line_error(run, "which would be replaced", alone=True)
    assert inner.read_bytes() == maw_path.read_bytes()


def test_a_with_past_decoder_is_refused_in_one_line_and_nothing_is_written(tmp_path):
    """Issue 46: an ensemble runs a decoder once per request (no loop over its KV cache), so it could never generate;
    the repository is refused, naming why and what serves it, before anything is written."""
    import generation_fixtures as gf

    decoder = gf.export(gf.folder("llama"), "mha")
    run = attnx("triton-repo", str(decoder), "-o", str(tmp_path / "repo"))
    one_line_error(run, "with-past decoder", alone=True)
    assert "attnx serve" in run.stderr and "never generate" in run.stderr
    assert not (tmp_path / "repo").exists()
    with pytest.raises(ConfigError, match="KV cache"):
        write_repository(decoder, tmp_path / "repo2")
    assert not (tmp_path / "repo2").exists()
