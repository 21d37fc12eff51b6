"""`attnx.engine`: engines for every variant, fp32 and fp16, built with TensorRT-RTX on this
CPU-only machine (target sm89), with plugin layers counted and a sidecar that check/serve/bench read.

A small build takes 0.3-1.5 s here (d_model 32, 2 layers); the exports (shared, cached by the
``exported`` fixture) dominate this file's time.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from attnx import engine as eng
from attnx.contract import DOMAIN, PLAN_MAGICS, ContractError, ModelInfo, sha256_file, sidecar_path, verify_engine
from attnx.engine import fp16 as engine_fp16
from attnx.models import VARIANTS, get_spec

tb = eng
pytestmark = pytest.mark.rtx


def custom_nodes(variant: str) -> dict[str, int]:
    """attnx custom nodes TensorRT parses in a 2-layer plugin-lowered export: one per layer of each plugin op the
    variant lowers to (an op with a TensorRT form is counted as the plugin ops of that form: smal's distance)."""
    ops = get_spec(variant).custom_ops
    inner = {n.op_type for op in ops if op.engine_function is not None for n in op.engine_function(23).node
             if n.domain == DOMAIN}
    return {op.name: 2 for op in ops if op.torch_op is not None and op.engine_function is None
            and (op.name in inner or not inner)}


@pytest.fixture(scope="module")
def backend(rtx):
    return rtx


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_build_every_variant(exported, backend, plugin_lib, tmp_path, variant, fp16):
    res = exported(variant)
    out = tmp_path / f"{variant}.engine"
    start = time.monotonic()
    built = eng.build(res.path, out, fp16=fp16, target="sm89")
    elapsed = time.monotonic() - start
    assert elapsed < 60, f"build took {elapsed:.1f}s"

    # The engine and its sidecar.
    plan = out.read_bytes()
    assert built.engine_path == out and len(plan) > 10_000
    assert plan[:4] in PLAN_MAGICS
    side = json.loads(sidecar_path(out).read_text())
    assert side == built.sidecar
    assert side["engine_bytes"] == len(plan) and side["engine_sha256"] == sha256_file(out)
    assert (side["backend"], side["backend_version"]) == (backend.name, backend.version)
    assert side["target"] == "sm89"
    assert side["precision"] == ("fp16" if fp16 else "fp32")
    assert side["variant"] == variant and side["lowering"] == "plugin"
    assert side["attnx_version"] and side["built_at"] and side["build_seconds"] >= 0

    # Built from the fp16 file for --fp16 (written beside the export, metadata updated).
    src = Path(side["onnx"])
    if fp16:
        assert src == res.path.with_name(res.path.stem + "-fp16.onnx").resolve()
        info = ModelInfo.read(src)
        assert info.precision == "fp16" and info.weights == res.info.weights
        assert {i.name: i.dtype for i in info.inputs}["hidden_states"] == "float16"
        assert {o.name: o.dtype for o in info.outputs}["output"] == "float16"
    else:
        assert src == res.path.resolve()
    assert side["onnx_sha256"] == sha256_file(src)

    # Profiles from the metadata; bindings with dim names, dtypes and roles.
    assert side["profiles"] == {k: list(v) for k, v in res.info.profiles.items()}
    d = res.info.config["attention"][variant]["d_model"]
    hs = side["profile_shapes"]["hidden_states"]
    assert hs["min"] == [1, 1, d] and hs["max"] == [res.info.profiles["batch"][2], res.info.profiles["seq"][2], d]
    inputs = {i["name"]: i for i in side["inputs"]}
    assert inputs["hidden_states"]["shape"] == ["batch", "seq", d]
    assert inputs["hidden_states"]["dtype"] == ("float16" if fp16 else "float32")
    assert inputs["attention_mask"] == {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "seq"],
                                        "role": "attention_mask"}
    assert [o["name"] for o in side["outputs"]] == ["output"] + [o.name for o in get_spec(variant).extra_outputs]
    assert {i["name"] for i in side["inputs"]} == {i.name for i in res.info.inputs}

    # Plugin layers: every attnx custom node became a plugin layer, none inlined.
    assert side["plugins"]["sha256"] == sha256_file(plugin_lib)
    assert Path(side["plugins"]["path"]) == Path(plugin_lib).resolve()
    assert side["custom_nodes"] == custom_nodes(variant)
    n_custom = sum(custom_nodes(variant).values())
    assert built.plugin_layers == side["plugin_layers"] == side["layers"].get("PLUGIN_V3", 0) == n_custom
    assert built.inlined_custom_nodes == side["inlined_custom_nodes"] == 0
    # The plain-attention variants' Attention layers were made buildable (see prepare_attention).
    if not get_spec(variant).custom_ops:
        assert side["attention"]["layers"] == 2 == side["attention"]["decomposable"]
        assert side["attention"]["mask_casts_bypassed"] == (2 if fp16 else 0)

    # What `check` relies on.
    assert verify_engine(out) == side


def test_shapes_override_and_options(exported, backend, plugin_lib, tmp_path):
    res = exported("maw")
    out = tmp_path / "maw-small.engine"
    # The library as it is (make test's, for sm89): compiling it again for sm86 is what the next test checks.
    built = eng.build(res.path, out, shapes=eng.parse_shapes(["batch=1,4,16", "seq=2:64:256"]), workspace="256M",
                      timing_cache=tmp_path / "timing.cache", target="sm86", optimization_level=1,
                      build_plugins=False)
    side = built.sidecar
    assert side["profiles"] == {"batch": [1, 4, 16], "seq": [2, 64, 256]}
    d = res.info.config["attention"][res.info.variant]["d_model"]
    assert side["profile_shapes"]["hidden_states"] == {"min": [1, 2, d], "opt": [4, 64, d], "max": [16, 256, d]}
    assert side["profile_shapes"]["attention_mask"] == {"min": [1, 2], "opt": [4, 64], "max": [16, 256]}
    assert side["target"] == "sm86" and side["workspace"] == 256 << 20
    if backend.is_rtx:
        assert side["timing_cache"] is None  # TensorRT-RTX has no timing cache
    # One axis alone keeps the other from the metadata.
    only = eng.build(res.path, tmp_path / "maw-b.engine", shapes={"batch": (2, 2, 2)}).sidecar
    assert only["profiles"] == {"batch": [2, 2, 2], "seq": list(res.info.profiles["seq"])}
    assert only["target"] == "sm89"  # no GPU here: the default target


def test_a_library_built_without_the_target_is_rebuilt_with_it_added(monkeypatch, tmp_path):
    """An engine for sm86 from a library built for sm89 compiles it for both (said first); one that has it, or
    one built elsewhere (no build record), is used as it is; none at all is built for the target alone."""
    from attnx import plugins as plugin_pkg
    from attnx.engine.plugins import resolve_plugin_library

    lib = tmp_path / "libattnx_plugins.so"
    lib.write_bytes(b"")
    built, said = [], []
    monkeypatch.setattr(plugin_pkg, "library_path", lambda: lib)
    monkeypatch.setattr(plugin_pkg, "build", lambda archs=None, console=None: built.append(archs) or lib)
    console = type("Console", (), {"print": lambda self, text, **kw: said.append(text)})()
    for record, target in (({"cuda_archs": ["89"]}, "sm86"), ({"cuda_archs": ["89", "86"]}, "sm86"), (None, "sm86")):
        monkeypatch.setattr(plugin_pkg, "build_info", lambda path, record=record: record)
        assert resolve_plugin_library(None, needed=True, console=console, target=target) == lib
    assert built == [["89", "86"]]
    assert said == ["compiling the attnx plugin library for sm89, sm86 with nvcc (a minute or more; "
                    "`attnx plugins build` makes it once for every architecture)"]
    monkeypatch.setattr(plugin_pkg, "library_path", lambda: None)
    assert resolve_plugin_library(None, needed=True, target="sm90") == lib and built[-1] == ["90"]
    with pytest.raises(eng.EngineBuildError, match="not built: run `attnx plugins build`"):
        resolve_plugin_library(None, needed=True, build_missing=False, target="sm90")


def test_default_engine_path_is_beside_the_onnx(exported, backend, plugin_lib, tmp_path):
    import shutil

    res = exported("smal")
    src = tmp_path / "smal.onnx"
    shutil.copy(res.path, src)
    built = eng.build(src, fp16=True)
    assert built.onnx_path == tmp_path / "smal-fp16.onnx"
    assert built.engine_path == tmp_path / "smal-fp16.engine"
    assert sidecar_path(built.engine_path) == tmp_path / "smal-fp16.engine.json"
    assert built.engine_path.is_file() and built.sidecar_path.is_file()


def test_ensure_fp16_converts_once_and_keeps_fp16_files(exported, tmp_path):
    import shutil

    res = exported("cultural")
    src = tmp_path / "c.onnx"
    shutil.copy(res.path, src)
    shutil.copy(res.weights_path, tmp_path / res.info.weights)
    dst, converted = eng.ensure_fp16(src)
    assert converted and dst == tmp_path / "c-fp16.onnx"
    mtime = dst.stat().st_mtime_ns
    again, converted = eng.ensure_fp16(src)
    assert again == dst and not converted and dst.stat().st_mtime_ns == mtime  # reused
    same, converted = eng.ensure_fp16(dst)  # already fp16: used as is
    assert same == dst and not converted
    # The conversion keeps softmax/LayerNorm/reductions in fp32 and is a valid model.
    model = onnx.load(str(dst))
    onnx.checker.check_model(model)
    info = ModelInfo.read(model)
    assert info.precision == "fp16" and info.extra["fp16_source_sha256"] == sha256_file(src)
    # An `attnx export --fp16` of the same weights is reused rather than overwritten.
    fp16_export = exported("cultural", fp16=True)
    assert engine_fp16._same_fp16(fp16_export.path, res.path, res.info, sha256_file(res.path))


def test_parse_shapes():
    assert eng.parse_shapes(["batch=1,4,16", "seq=1:64:256"]) == {"batch": (1, 4, 16), "seq": (1, 64, 256)}
    assert eng.parse_shapes(["batch=1,2,3 seq=4,5,6"]) == {"batch": (1, 2, 3), "seq": (4, 5, 6)}
    assert eng.parse_shapes(["seq=128"]) == {"seq": (128, 128, 128)}
    for bad, words in [("batch", "axis=min,opt,max"), ("heads=1,2,3", "unknown axis"), ("batch=1,2", "three"),
                       ("batch=4,2,1", "min <= opt <= max"), ("seq=0,1,2", "min <= opt"), ("batch=a,b,c", "three")]:
        with pytest.raises(ContractError, match=words):
            eng.parse_shapes([bad])


def test_parse_size():
    assert eng.parse_size("512M") == 512 << 20
    assert eng.parse_size("1GiB") == 1 << 30
    assert eng.parse_size("2gb") == 2 * 10**9
    assert eng.parse_size("4096") == 4096 and eng.parse_size(None) is None
    with pytest.raises(eng.EngineBuildError):
        eng.parse_size("lots")


def test_corrupt_and_foreign_files(exported, backend, plugin_lib, tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07garbage" * 50)
    with pytest.raises(ContractError, match="not a readable ONNX file"):
        eng.build(bad, tmp_path / "bad.engine")
    res = exported("mha")
    built = eng.build(res.path, tmp_path / "m.engine")
    data = bytearray(built.engine_path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    built.engine_path.write_bytes(bytes(data))
    with pytest.raises(ContractError, match="corrupt"):
        verify_engine(built.engine_path)
    text = tmp_path / "notes.engine"
    text.write_text("hello")
    with pytest.raises(ContractError, match="not a TensorRT engine"):
        verify_engine(text)
    with pytest.raises(eng.EngineBuildError, match="does not exist"):
        eng.build(exported("maw").path, tmp_path / "x.engine", plugins=tmp_path / "missing.so")


def test_unmappable_op_is_a_parse_error(backend, plugin_lib, tmp_path):
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, ["batch", "seq", 8])
    y = helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", "seq", 8])
    node = helper.make_node("FancyMix", ["hidden_states"], ["output"], domain="attnx", name="fancy")
    model = helper.make_model(helper.make_graph([node], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("attnx", 1)])
    path = tmp_path / "fancy.onnx"
    onnx.save(model, str(path))
    with pytest.raises(tb.ParseError, match="FancyMix"):
        eng.build(path, tmp_path / "fancy.engine", shapes={"batch": (1, 1, 2), "seq": (1, 4, 8)})
    with pytest.raises(eng.EngineBuildError, match="--shapes"):  # no metadata, no --shapes: say how
        eng.build(path, tmp_path / "fancy.engine")


def test_prepare_attention_without_iattention():
    class Net:  # a TensorRT without IAttention (older full TensorRT): nothing to do, no error
        num_layers = 0

    stats = tb.prepare_attention(Net())
    assert stats["layers"] == 0


def test_fp16_model_runs_on_onnxruntime(exported, tmp_path):
    import shutil

    import onnxruntime as ort

    res = exported("metaphor")
    src = tmp_path / "m.onnx"
    shutil.copy(res.path, src)
    dst, _ = eng.ensure_fp16(src)
    sess = ort.InferenceSession(str(dst), providers=["CPUExecutionProvider"])
    from attnx.export.exporter import example_inputs

    feeds = {k: v.numpy() for k, v in example_inputs(res.model, batch=3, seq=5).items()}
    feeds = {k: (v.astype(np.float16) if v.dtype == np.float32 else v) for k, v in feeds.items()}
    out = sess.run(None, feeds)[0]
    assert out.dtype == np.float16 and out.shape == (3, 5, res.model.d_model)
