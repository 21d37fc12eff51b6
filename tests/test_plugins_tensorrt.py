"""The plugins inside TensorRT (TensorRT-RTX here, installed by the test set-up from PyPI) and the
TensorRT layer (``attnx.engine``).

- backend selection logic, exercised with fake packages (no TensorRT needed);
- the library loads through the plugin registry; the ONNX parser with the plugin-override flag
  turns the custom nodes into PLUGIN_V3 layers (not their inlined function bodies); output shapes
  and dtypes are right for dynamic inputs; SM89 engines build in fp32 and from fp16 models;
- malformed models fail with the plugin's own message naming the node;
- the same on the real ``attnx export`` files (maw, smal; fp32 and fp16).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from attnx import plugins
from attnx.contract import DOMAIN, IR_VERSION, ONNX_OPSET
from attnx.export import ops
from attnx.models import onnx_ops
from attnx import engine as tb
from attnx.engine import discovery, targets
from attnx.engine.forms import engine_form
from attnx.engine import plugins as engine_plugins

FLOAT, HALF, INT64, INT32 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT64, TensorProto.INT32
MAW_DEPTH_SELECT, TTA_DISTANCE = "MawDepthSelect", "TtaDistance"  # the plugins' op types


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def loaded(rtx, plugin_lib) -> tb.PluginLibrary:
    return tb.load_plugins(plugin_lib)


def make_model(path: Path, nodes, inputs, outputs, metadata: dict | None = None) -> Path:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(*o) for o in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", ONNX_OPSET)], ir_version=IR_VERSION)
    ops.attach_functions(model)
    for k, v in (metadata or {}).items():
        model.metadata_props.add(key=k, value=v)
    onnx.save(model, path)
    return path


def both_ops_model(path: Path, dtype=FLOAT, *, dh: int = 8, trace_size: int | None = None, trace_heads: int = 1,
                   depth: int = 5, policy_depth: int | None = None, k_head: int | None = None,
                   policy_batch="batch", trace_dtype=None) -> Path:
    """MawDepthSelect and TtaDistance side by side, dynamic batch/seq (Lq and Lk both "seq")."""
    ts = trace_size or dh
    return make_model(
        path,
        [onnx_ops.make_node(MAW_DEPTH_SELECT, ["q_depth", "k_depth", "policy"], ["logits", "depth"], name="maw0",
                       scale=0.25),
         onnx_ops.make_node(TTA_DISTANCE, ["q", "k", "trace"], ["dist"], name="tta0")],
        [("q_depth", dtype, ["batch", 4, "seq", depth]), ("k_depth", dtype, ["batch", 4, "seq", depth]),
         ("policy", dtype, [policy_batch, policy_depth or depth]),
         ("q", dtype, ["batch", 4, "seq", dh]), ("k", dtype, ["batch", 4, "seq", k_head or dh]),
         ("trace", trace_dtype or dtype, ["batch", trace_heads, ts, ts])],
        [("logits", dtype, ["batch", 4, "seq", "seq"]), ("depth", INT64, ["batch"]),
         ("dist", dtype, ["batch", 4, "seq", "seq"])],
        metadata={"attnx.profiles": '{"batch": [1, 2, 4], "seq": [1, 16, 64]}'},
    )


# ------------------------------------------------------------------------------------------ backend selection


def _fake_module(version: str, **attrs):
    mod = types.SimpleNamespace(__version__=version, **attrs)
    return lambda: mod


def _missing(name):
    def importer():
        raise ModuleNotFoundError(f"No module named {name!r}")
    return importer


def test_selection_prefers_full_tensorrt():
    info = tb.select_backend("auto", {"tensorrt": _fake_module("10.14.1"), "tensorrt-rtx": _fake_module("1.7.1")})
    assert (info.name, info.version, info.is_rtx) == ("tensorrt", "10.14.1", False)
    assert info.targets == ()  # full TensorRT builds for the local GPU only
    assert info.describe() == "TensorRT 10.14.1"


def test_selection_falls_back_to_rtx():
    info = tb.select_backend(None, {"tensorrt": _missing("tensorrt"), "tensorrt-rtx": _fake_module("1.7.1")})
    assert (info.name, info.is_rtx) == ("tensorrt-rtx", True)


def test_selection_names_both_extras_when_nothing_is_installed():
    with pytest.raises(tb.TensorRTUnavailable) as e:
        tb.select_backend("auto", {"tensorrt": _missing("tensorrt"), "tensorrt-rtx": _missing("tensorrt_rtx_libs")})
    msg = str(e.value)
    assert "attnx[tensorrt]" in msg and "attnx[rtx]" in msg
    assert "No module named 'tensorrt'" in msg and "tensorrt_rtx_libs" in msg


def test_forced_choices():
    fakes = {"tensorrt": _missing("tensorrt"), "tensorrt-rtx": _fake_module("1.7.1")}
    with pytest.raises(tb.TensorRTUnavailable, match=r"pip install attnx\[tensorrt\]") as e:
        tb.select_backend("tensorrt", fakes)
    assert "attnx[rtx]" not in str(e.value)
    assert tb.select_backend("rtx", fakes).is_rtx
    with pytest.raises(tb.TensorRTUnavailable, match="unknown TensorRT backend"):
        tb.select_backend("tensorflow", fakes)


def test_tensorrt_stub_package_is_not_taken(monkeypatch):
    """PyPI's `tensorrt` without NVIDIA's index is a stub: importable, no API. It must not win."""
    stub = types.ModuleType("tensorrt")
    stub.__version__ = "10.14.1"
    monkeypatch.setitem(sys.modules, "tensorrt", stub)
    with pytest.raises(ImportError, match="stub"):
        discovery._import_tensorrt()
    info = tb.select_backend("auto", {"tensorrt": discovery._import_tensorrt, "tensorrt-rtx": _fake_module("1.7.1")})
    assert info.is_rtx


def test_environment_variable_forces_the_backend(monkeypatch):
    monkeypatch.setattr(discovery, "IMPORTERS", {"tensorrt": _missing("tensorrt"), "tensorrt-rtx": _fake_module("1.7.1")})
    monkeypatch.setenv(tb.BACKEND_ENV, "tensorrt")
    tb.reset_backend()
    try:
        with pytest.raises(tb.TensorRTUnavailable, match=r"attnx\[tensorrt\]"):
            tb.backend()
        assert not tb.is_available()
    finally:
        tb.reset_backend()


class _FakeConfig:
    def __init__(self):
        self.num_compute_capabilities = 0
        self.calls = []

    def set_compute_capability(self, cc, index):
        self.calls.append((cc, index))


def test_full_tensorrt_builds_for_the_local_gpu_only(monkeypatch):
    info = tb.BackendInfo("tensorrt", "10.14.1", False, module=types.SimpleNamespace())
    monkeypatch.setattr(targets, "gpu_compute_capability", lambda: None)
    with pytest.raises(tb.BuildError, match="local GPU and none was found"):
        tb.apply_target(_FakeConfig(), "sm89", info)
    monkeypatch.setattr(targets, "gpu_compute_capability", lambda: (8, 9))
    assert tb.apply_target(_FakeConfig(), None, info) == "sm89"
    assert tb.apply_target(_FakeConfig(), "8.9", info) == "sm89"
    with pytest.raises(tb.BuildError, match=r"local GPU \(sm89\), not sm80"):
        tb.apply_target(_FakeConfig(), "sm_80", info)
    with pytest.raises(tb.BuildError, match="bad target"):
        tb.parse_target("ampere", info)


def test_rtx_targets(monkeypatch):
    cc = types.SimpleNamespace(SM80="SM80", SM89="SM89", CURRENT="CURRENT", __members__={"NONE": 0, "CURRENT": 1,
                                                                                         "SM80": 80, "SM89": 89})
    info = tb.BackendInfo("tensorrt-rtx", "1.7.1", True, module=types.SimpleNamespace(ComputeCapability=cc))
    assert info.targets == ("sm80", "sm89")
    config = _FakeConfig()
    assert tb.apply_target(config, "sm89", info) == "sm89"
    assert config.num_compute_capabilities == 1 and config.calls == [("SM89", 0)]
    with pytest.raises(tb.BuildError, match="cannot target sm90"):
        tb.apply_target(_FakeConfig(), "sm90", info)
    monkeypatch.setattr(targets, "gpu_compute_capability", lambda: None)
    with pytest.raises(tb.BuildError, match="needs a target compute capability"):
        tb.apply_target(_FakeConfig(), None, info)
    monkeypatch.setattr(targets, "gpu_compute_capability", lambda: (8, 6))
    config = _FakeConfig()
    assert tb.apply_target(config, None, info) == "sm86" and config.calls == [("CURRENT", 0)]


def test_profiles_from_metadata_and_overrides(tmp_path):
    path = both_ops_model(tmp_path / "m.onnx")
    ranges = tb.resolve_profiles(path)
    assert ranges["q"] == ((1, 4, 1, 8), (2, 4, 16, 8), (4, 4, 64, 8))
    assert ranges["policy"] == ((1, 5), (2, 5), (4, 5))
    assert ranges["trace"] == ((1, 1, 8, 8), (2, 1, 8, 8), (4, 1, 8, 8))
    ranges = tb.resolve_profiles(path, profiles={"batch": (1, 1, 1), "seq": (3, 5, 7)},
                                 shapes={"trace": ((2, 1, 8, 8), (2, 1, 8, 8), (2, 1, 8, 8))})
    assert ranges["k"] == ((1, 4, 3, 8), (1, 4, 5, 8), (1, 4, 7, 8))
    assert ranges["trace"][0] == (2, 1, 8, 8)
    with pytest.raises(tb.BuildError, match="no optimization-profile range for the dynamic dim 'seq'"):
        tb.resolve_profiles(path, profiles={"batch": (1, 1, 1)})
    with pytest.raises(tb.BuildError, match="min <= opt <= max"):
        tb.resolve_profiles(path, profiles={"batch": (4, 1, 1), "seq": (1, 1, 1)})


# ------------------------------------------------------------------------------------------ registry and parser


def test_rtx_parser_library_name_is_fixed(rtx):
    """The RTX parser dlopens libtensorrt_rtx.so (the wheel has .so.1): the adapter makes it resolvable."""
    import tensorrt_rtx_libs

    folder = Path(tensorrt_rtx_libs.__file__).parent
    assert (folder / "libtensorrt_rtx.so").exists() or discovery.rtx_link_problem() is None


def test_library_loads_through_the_registry(loaded, rtx, plugin_lib):
    assert loaded.path == plugin_lib.resolve()
    from attnx.contract import PLUGIN_NAMESPACE, PLUGIN_VERSION
    from attnx.models.spec import all_custom_ops

    # every op but those TensorRT gets in another form (smal's whole attention: its distance plugin)
    assert {(op.name, PLUGIN_VERSION, PLUGIN_NAMESPACE) for op in all_custom_ops()
            if op.engine_function is None} <= set(loaded.creators)
    registry = rtx.module.get_plugin_registry()
    creator = registry.get_creator("MawDepthSelect", "1", "attnx")
    assert creator is not None
    assert [(f.name, str(f.type).split(".")[-1]) for f in creator.field_names] == [("scale", "FLOAT32")]
    assert tb.load_plugins(plugin_lib) is loaded  # once per path


def test_registry_refuses_a_library_without_entry_points(rtx, tmp_path):
    with pytest.raises(tb.PluginLoadError, match="does not exist"):
        tb.load_plugins(tmp_path / "nope.so")
    import ctypes.util

    libm = ctypes.util.find_library("m")  # a real shared library without the two entry points
    assert libm is not None
    libm_path = next((p for p in ("/lib/x86_64-linux-gnu/" + libm, "/usr/lib/x86_64-linux-gnu/" + libm,
                                  "/lib64/" + libm, "/usr/lib64/" + libm) if Path(p).exists()), None)
    assert libm_path is not None, libm
    with pytest.raises(tb.PluginLoadError, match="getCreators and setLoggerFinder"):
        tb.load_plugins(libm_path)


@pytest.mark.parametrize("dtype,name", [(FLOAT, "float32"), (HALF, "float16")])
def test_custom_nodes_become_plugin_layers(loaded, tmp_path, dtype, name):
    net = tb.parse_onnx(both_ops_model(tmp_path / f"m_{name}.onnx", dtype))
    assert net.layer_type_counts() == {"PLUGIN_V3": 2}  # not the inlined function bodies
    assert sorted(n for n, _ in net.plugin_layers()) == ["maw0", "tta0"]
    outs = {o.name: o for o in net.outputs}
    assert outs["logits"].shape == (-1, 4, -1, -1) and outs["logits"].dtype == name
    assert outs["depth"].shape == (-1,) and outs["depth"].dtype == "int64"
    assert outs["dist"].shape == (-1, 4, -1, -1) and outs["dist"].dtype == name


def test_without_the_plugins_the_bodies_are_inlined(rtx, tmp_path):
    """The same file parses without the plugin library: TensorRT inlines the ops' function bodies.
    (In a fresh process: once loaded, the plugins stay registered. TensorRT-RTX 1.7 also picks a
    registered plugin without the override flag; the adapter sets the flag anyway.)"""
    import subprocess

    path = both_ops_model(tmp_path / "m.onnx")
    code = ("import json, sys; from attnx import engine as tb; "
            "print(json.dumps(tb.parse_onnx(sys.argv[1], plugins=False).layer_type_counts()))")
    res = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    import json

    counts = json.loads(res.stdout.strip().splitlines()[-1])
    assert "PLUGIN_V3" not in counts
    assert counts.get("MATRIX_MULTIPLY", 0) >= 3


def test_lq_differs_from_lk(loaded, tmp_path):
    path = make_model(
        tmp_path / "lqlk.onnx",
        [onnx_ops.make_node(TTA_DISTANCE, ["q", "k", "trace"], ["dist"], name="tta_cross")],
        [("q", FLOAT, ["batch", 2, "lq", 16]), ("k", FLOAT, ["batch", 2, "lk", 16]), ("trace", FLOAT, [1, 2, 16, 16])],
        [("dist", FLOAT, ["batch", 2, "lq", "lk"])])
    net = tb.parse_onnx(path)
    assert net.layer_type_counts() == {"PLUGIN_V3": 1}
    plan = tb.build_engine(path, target="sm89" if tb.backend().is_rtx else None,
                           profiles={"batch": (1, 2, 3), "lq": (1, 7, 33), "lk": (1, 9, 65)})
    assert len(plan) > 0


# ------------------------------------------------------------------------------------------ engines


@pytest.mark.rtx
@pytest.mark.parametrize("dtype,name", [(FLOAT, "fp32"), (HALF, "fp16")])
def test_sm89_engine_builds(rtx, loaded, tmp_path, dtype, name):
    path = both_ops_model(tmp_path / f"m_{name}.onnx", dtype)
    cache = tmp_path / "timing.cache"
    plan = tb.build_engine(path, target="sm89", timing_cache=cache, workspace=1 << 28)
    assert isinstance(plan, bytes) and len(plan) > 1000
    assert not cache.exists()  # timing caches are no-ops in TensorRT-RTX: nothing is written


@pytest.mark.rtx
def test_hopper_is_not_an_rtx_target(rtx, loaded, tmp_path):
    with pytest.raises(tb.BuildError, match="sm90"):
        tb.build_engine(both_ops_model(tmp_path / "m.onnx"), target="sm90")


def test_engines_need_a_gpu(rtx, loaded, tmp_path):
    if tb.gpu_compute_capability() is not None:
        pytest.skip("a GPU is present")
    with pytest.raises(tb.EngineUnavailable, match="no CUDA GPU"):
        tb.deserialize(b"not an engine")
    engine_file = tmp_path / "m.engine"
    engine_file.write_bytes(b"x")
    with pytest.raises(tb.EngineUnavailable):
        tb.load_engine(engine_file)


# ------------------------------------------------------------------------------------------ malformed models

BAD_PARSES = [
    # (id, model kwargs, expected text in the error)
    ("trace-size", {"trace_size": 6}, "attnx::TtaDistance node 'tta0': trace size differs: trace[2] is 6 but the head size q[3] is 8"),
    ("trace-heads", {"trace_heads": 3}, "trace heads: trace[1] is 3 but must be 1 or the number of heads q[1] (4)"),
    ("head-size", {"k_head": 16}, "attnx::TtaDistance node 'tta0': head size differs: q[3] is 8 but k[3] is 16"),
    ("depth-size", {"policy_depth": 6}, "attnx::MawDepthSelect node 'maw0': depth size differs: q_depth[3] is 5 but policy_logits[1] is 6"),
    ("int32", {"dtype": INT32}, "input 'q_depth' is int32; supported: float32 or float16"),
    ("mixed-types", {"trace_dtype": HALF}, "attnx::TtaDistance node 'tta0': inputs must share one type, but 'q' is float32 and 'trace' is float16"),
]


@pytest.mark.parametrize("kwargs,expected", [b[1:] for b in BAD_PARSES], ids=[b[0] for b in BAD_PARSES])
def test_malformed_models_fail_with_the_plugin_message(loaded, tmp_path, kwargs, expected):
    path = both_ops_model(tmp_path / "bad.onnx", **kwargs)
    with pytest.raises(tb.ParseError) as e:
        tb.parse_onnx(path)
    assert expected in str(e.value)
    assert any(expected in m for m in e.value.errors)


def test_missing_scale_attribute(loaded, tmp_path):
    node = helper.make_node(MAW_DEPTH_SELECT, ["q", "k", "p"], ["l", "d"], name="maw_noscale", domain=DOMAIN,
                            plugin_version="1", plugin_namespace="attnx")
    path = make_model(tmp_path / "noscale.onnx", [node],
                      [("q", FLOAT, ["batch", 2, "seq", 5]), ("k", FLOAT, ["batch", 2, "seq", 5]), ("p", FLOAT, ["batch", 5])],
                      [("l", FLOAT, ["batch", 2, "seq", "seq"]), ("d", INT64, ["batch"])])
    with pytest.raises(tb.ParseError, match="node 'maw_noscale': missing or non-finite float attribute 'scale'"):
        tb.parse_onnx(path)


@pytest.mark.rtx
@pytest.mark.parametrize("policy_batch,expected", [
    ("pbatch", "batch size differs: q_depth[0] is 4 but policy_logits[0] is 3 (at the profile's max shapes)"),
    (3, "batch size differs: q_depth[0] is 1 but policy_logits[0] is 3 (at the profile's min shapes)"),
], ids=["other-dynamic-dim", "static-dim"])
def test_profile_inconsistency_fails_the_build(rtx, loaded, tmp_path, policy_batch, expected):
    """Dims the parser cannot compare (symbolic batch vs another name or a constant) are checked
    against the optimization profile in configurePlugin."""
    path = both_ops_model(tmp_path / "cfg.onnx", policy_batch=policy_batch)
    tb.parse_onnx(path)  # parses: the batch dims are symbolic
    with pytest.raises(tb.BuildError) as e:
        tb.build_engine(path, target="sm89", profiles={"batch": (1, 2, 4), "seq": (1, 8, 16), "pbatch": (1, 2, 3)})
    assert "attnx::MawDepthSelect node 'maw0': " + expected in str(e.value)


def test_models_with_custom_ops_need_the_library(rtx, tmp_path, monkeypatch):
    monkeypatch.setattr(plugins, "library_path", lambda: None)
    monkeypatch.setattr(engine_plugins, "_loaded_plugins", {})
    with pytest.raises(tb.PluginLoadError, match="attnx plugins build"):
        tb.parse_onnx(both_ops_model(tmp_path / "m.onnx"))


# ------------------------------------------------------------------------------------------ real exports


@pytest.fixture(scope="module")
def real_exports(exported):
    """maw and smal, `plugin` lowering, fp32 and fp16 (from the export cache)."""
    return {(v, fp16): exported(v, lowering="plugin", fp16=fp16) for v in ("maw", "smal") for fp16 in (False, True)}


@pytest.mark.parametrize("variant", ["maw", "smal"])
@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_real_export_parses_to_plugin_layers(loaded, real_exports, variant, fp16):
    result = real_exports[(variant, fp16)]
    model = onnx.load(str(result.path), load_external_data=False)
    custom = [n for n in (engine_form(model) or model).graph.node if n.domain == DOMAIN]  # smal: its distance
    assert custom, "the plugin lowering should contain attnx nodes"
    net = tb.parse_onnx(result.path)
    counts = net.layer_type_counts()
    assert counts.get("PLUGIN_V3") == len(custom)
    assert sorted(n for n, _ in net.plugin_layers()) == sorted(n.name for n in custom)
    float_name = "float16" if fp16 else "float32"
    outs = {o.name: o for o in net.outputs}
    assert outs["output"].dtype == float_name and outs["output"].shape[:2] == (-1, -1)
    if variant == "maw":
        assert outs["maw_depth"].dtype == "int64" and outs["maw_depth"].shape == (-1,)
    ins = {i.name: i for i in net.inputs}
    assert ins["hidden_states"].dtype == float_name and ins["attention_mask"].dtype == "int64"


@pytest.mark.rtx
@pytest.mark.parametrize("variant", ["maw", "smal"])
@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_real_export_builds_an_sm89_engine(rtx, loaded, real_exports, variant, fp16):
    result = real_exports[(variant, fp16)]
    plan = tb.build_engine(result.path, target="sm89")  # profiles from the export's metadata
    assert len(plan) > 1000


# ------------------------------------------------------------------------------------------ MawDepthGather

GATHER_PROFILES = {"batch": (1, 2, 4), "seq": (1, 16, 64), "kseq": (1, 8, 32)}


def gather_model(path: Path, dtype=FLOAT, *, depth: int = 5, k_depth: int | None = None, q_rank: int = 4) -> Path:
    """One attnx::MawDepthGather node, hand-built (no function body: TensorRT must use the plugin);
    Lq ("seq") and Lk ("kseq") differ."""
    node = helper.make_node("MawDepthGather", ["q_depth", "k_depth", "policy"], ["q_sel", "k_sel", "depth"],
                            name="gather0", domain="attnx", plugin_version="1", plugin_namespace="attnx")
    q_shape = ["batch", 4, "seq", depth] if q_rank == 4 else ["batch", "seq", depth]
    return make_model(
        path, [node],
        [("q_depth", dtype, q_shape), ("k_depth", dtype, ["batch", 4, "kseq", k_depth or depth]),
         ("policy", dtype, ["batch", depth])],
        [("q_sel", dtype, ["batch", 4, "seq", 1]), ("k_sel", dtype, ["batch", 4, "kseq", 1]), ("depth", INT64, ["batch"])],
        metadata={"attnx.profiles": '{"batch": [1, 2, 4], "seq": [1, 16, 64], "kseq": [1, 8, 32]}'},
    )


def test_maw_depth_gather_creator_is_registered(loaded):
    assert ("MawDepthGather", "1", "attnx") in loaded.creators


@pytest.mark.parametrize("dtype,name", [(FLOAT, "float32"), (HALF, "float16")])
def test_maw_depth_gather_parses_to_a_plugin_layer(loaded, tmp_path, dtype, name):
    net = tb.parse_onnx(gather_model(tmp_path / f"gather_{name}.onnx", dtype))
    assert net.layer_type_counts() == {"PLUGIN_V3": 1}
    assert [n for n, _ in net.plugin_layers()] == ["gather0"]
    outs = {o.name: o for o in net.outputs}
    assert outs["q_sel"].shape == (-1, 4, -1, 1) and outs["q_sel"].dtype == name
    assert outs["k_sel"].shape == (-1, 4, -1, 1) and outs["k_sel"].dtype == name
    assert outs["depth"].shape == (-1,) and outs["depth"].dtype == "int64"


@pytest.mark.rtx
@pytest.mark.parametrize("dtype,name", [(FLOAT, "fp32"), (HALF, "fp16")])
def test_maw_depth_gather_builds_an_sm89_engine(rtx, loaded, tmp_path, dtype, name):
    plan = tb.build_engine(gather_model(tmp_path / f"gather_{name}.onnx", dtype), target="sm89",
                           profiles=GATHER_PROFILES)
    assert isinstance(plan, bytes) and len(plan) > 1000


BAD_GATHERS = [
    ("rank", {"q_rank": 3}, "attnx::MawDepthGather node 'gather0': q_depth must have rank 4, got rank 3"),
    ("depth-size", {"k_depth": 6}, "attnx::MawDepthGather node 'gather0': depth size differs: q_depth[3] is 5 but k_depth[3] is 6"),
    ("int32", {"dtype": INT32}, "attnx::MawDepthGather node 'gather0': input 'q_depth' is int32; supported: float32 or float16"),
]


@pytest.mark.parametrize("kwargs,expected", [b[1:] for b in BAD_GATHERS], ids=[b[0] for b in BAD_GATHERS])
def test_malformed_maw_depth_gather_fails_with_the_plugin_message(loaded, tmp_path, kwargs, expected):
    with pytest.raises(tb.ParseError) as e:
        tb.parse_onnx(gather_model(tmp_path / "bad_gather.onnx", **kwargs))
    assert expected in str(e.value)
    assert any(expected in m for m in e.value.errors)
