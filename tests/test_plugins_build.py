"""The plugin library builds with nvcc + CMake, exports what TensorRT needs, links nothing of TensorRT,
and its plugin logic (creators, fields, validation, logging) behaves, checked through the TensorRT
interfaces by a small C++ program (no TensorRT library, no GPU)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from attnx import plugins
from support import probes
from support.cli import run as attnx

REPO = Path(__file__).resolve().parents[1]


_tool = probes.tool


def _dynamic_symbols(lib: Path, *, defined: bool) -> set[str]:
    nm = _tool("nm")
    flag = "--defined-only" if defined else "--undefined-only"
    out = subprocess.run([nm, "-D", flag, str(lib)], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}


def test_library_exports_registry_entry_points(plugin_lib):
    exported = _dynamic_symbols(plugin_lib, defined=True)
    # IPluginRegistry::loadLibrary needs both; the kernels' C ABI is for direct (ctypes) use.
    for name in ("getCreators", "setLoggerFinder", "attnx_maw_depth_select", "attnx_maw_depth_gather", "attnx_tta_distance",
                 "attnx_tta_distance_workspace_size", "attnx_kernels_abi_version", "attnx_plugins_errors"):
        assert name in exported, f"{name} not exported by {plugin_lib}"
    # Nothing else leaks (hidden visibility, static cudart not re-exported).
    ours = {s for s in exported if not s.startswith("_")}
    assert not {s for s in ours if s.startswith("cuda")}, ours


def test_library_needs_only_the_c_and_cuda_runtime(plugin_lib):
    readelf = _tool("readelf")
    out = subprocess.run([readelf, "-d", str(plugin_lib)], capture_output=True, text=True, check=True).stdout
    needed = [line.split("[")[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]
    assert not [n for n in needed if "nvinfer" in n or "tensorrt" in n or "nvonnxparser" in n], needed
    # cudart is linked statically: the library loads without libcudart on the library path.
    assert not [n for n in needed if "cudart" in n], needed
    undefined = _dynamic_symbols(plugin_lib, defined=False)
    assert not {s for s in undefined if s.startswith("cuda") or "nvinfer" in s}, undefined


def test_library_path_and_cli(plugin_lib, monkeypatch, tmp_path):
    assert plugins.library_path() == plugin_lib.resolve()
    result = attnx("plugins", "path")
    assert result.returncode == 0, result.output
    assert result.output.strip() == str(plugin_lib.resolve())
    # $ATTNX_PLUGIN_LIB wins when it exists, and is ignored when it does not.
    monkeypatch.setenv("ATTNX_PLUGIN_LIB", str(plugin_lib))
    assert plugins.library_path() == plugin_lib.resolve()
    monkeypatch.setenv("ATTNX_PLUGIN_LIB", str(tmp_path / "does-not-exist.so"))
    assert plugins.library_path() == plugin_lib.resolve()


def test_cli_path_when_not_built(monkeypatch, tmp_path):
    monkeypatch.setattr(plugins, "library_path", lambda: None)
    result = attnx("plugins", "path")
    assert result.returncode == 1
    assert "attnx plugins build" in result.output


def test_build_reports_missing_tools(monkeypatch, tmp_path):
    from attnx.plugins import builder

    monkeypatch.setattr(builder, "find_nvcc", lambda: None)
    with pytest.raises(plugins.PluginBuildError, match="nvcc"):
        plugins.build(build_dir=tmp_path / "b", output_dir=tmp_path / "l")
    monkeypatch.setattr(builder, "find_cmake", lambda: None)
    with pytest.raises(plugins.PluginBuildError, match="cmake not found"):
        plugins.build(build_dir=tmp_path / "b", output_dir=tmp_path / "l")


@pytest.mark.nvcc
def test_build_rejects_bad_arguments(tmp_path):
    with pytest.raises(plugins.PluginBuildError, match="NvInferRuntime.h"):
        plugins.build(tensorrt_include=tmp_path, build_dir=tmp_path / "b", output_dir=tmp_path / "l")
    with pytest.raises(plugins.PluginBuildError, match="bad CUDA architecture"):
        plugins.build(archs=["hopper"], build_dir=tmp_path / "b", output_dir=tmp_path / "l")
    # The kernels use mma.sync (sm_80+): older targets are refused at configure time, with the reason.
    with pytest.raises(plugins.PluginBuildError, match="sm_75 is not supported"):
        plugins.build(archs=["75"], build_dir=tmp_path / "b75", output_dir=tmp_path / "l75")


def test_public_names_and_layout():
    """`attnx.plugins` keeps its public names; the sources sit one folder per op beside common/."""
    for name in plugins.__all__:
        assert hasattr(plugins, name), name
    assert callable(plugins.build) and callable(plugins.library_path) and callable(plugins.require_library)
    src = plugins.source_dir()
    for op in ("maw_depth_select", "maw_depth_gather", "tta_distance"):
        names = {p.name for p in (src / op).iterdir()}
        assert {f"{op}_kernel.h", f"{op}_plugin.h", f"{op}_plugin.cpp", f"{op}_kernel.cu"} <= names, names
    for name in ("plugin_v3.h", "plugin_common.h", "logger.cpp", "entry_points.cpp", "attnx_kernels.h"):
        assert (src / "common" / name).is_file(), name
    assert not list(src.glob("*.cu")) and not list(src.glob("*.cpp"))  # nothing left flat


def test_require_library_follows_the_package_hook(monkeypatch):
    monkeypatch.setattr(plugins, "library_path", lambda: None)
    with pytest.raises(FileNotFoundError, match="attnx plugins build"):
        plugins.require_library()


@pytest.mark.nvcc
def test_cmake_explains_missing_headers(tmp_path):
    """With downloads off and no TensorRT anywhere, configuring fails with a clear message."""
    cmake = plugins.find_cmake()
    nvcc = plugins.find_nvcc()
    if any(Path(p, "NvInferRuntime.h").exists() for p in ("/usr/include/x86_64-linux-gnu", "/usr/include",
                                                          "/usr/local/TensorRT/include")):
        pytest.skip("a TensorRT install is present")
    env = {k: v for k, v in os.environ.items() if k not in ("TENSORRT_INCLUDE_DIR", "TensorRT_ROOT", "TENSORRT_ROOT")}
    cmd = [cmake, "-S", str(plugins.source_dir()), "-B", str(tmp_path / "b"), f"-DCMAKE_CUDA_COMPILER={nvcc}",
           "-DATTNX_FETCH_TENSORRT_HEADERS=OFF", f"-DATTNX_PLUGIN_OUTPUT_DIR={tmp_path / 'l'}"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert res.returncode != 0
    assert "TensorRT headers not found" in " ".join((res.stderr + res.stdout).split())
    res = subprocess.run(cmd + [f"-DTENSORRT_INCLUDE_DIR={tmp_path}"], capture_output=True, text=True, env=env)
    assert res.returncode != 0
    assert "which has no NvInferRuntime.h" in " ".join((res.stderr + res.stdout).split())


def test_build_info_of_the_built_library(plugin_lib):
    info = plugins.build_info(plugin_lib)
    assert info is not None, f"{plugin_lib} has no build info: not built by `attnx plugins build`"
    assert int(info["tensorrt_version"].split(".")[0]) >= 10
    archs = info["cuda_archs"]  # `make test` builds for the engines' target GPU only
    assert info["cuda_architectures"].split(";") == [f"{a}-real" for a in archs] + [f"{min(archs, key=int)}-virtual"]


@pytest.mark.nvcc
@pytest.mark.parametrize("archs, compiled", [
    (None, ["80-real", "86-real", "89-real", "90-real", "120-real", "80-virtual"]),  # SASS for every generation
    (["sm_89"], ["89-real", "89-virtual"]),                                        # + PTX of the lowest (JIT)
], ids=["default", "sm89"])
def test_what_a_build_compiles_for(plugin_lib, tmp_path, archs, compiled):
    """The architectures CMake is told to compile (its configure step; compiling them is `make test`'s
    own build, for one target)."""
    from attnx.plugins import builder

    info = plugins.build_info(plugin_lib)
    cmd = builder.configure_command(plugins.find_cmake(), plugins.find_nvcc(), archs or plugins.DEFAULT_ARCHS,
                                    tmp_path / "build", tmp_path / "lib", Path(info["tensorrt_include_dir"]))
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    written = json.loads((tmp_path / "lib" / "attnx_plugins_build.json").read_text())
    assert written["cuda_architectures"].split(";") == compiled


def test_headers_are_not_in_the_source_tree():
    """NVIDIA's headers are obtained at build time, never committed."""
    res = subprocess.run(["git", "ls-files", "plugins"], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert not [f for f in res.stdout.splitlines() if Path(f).name.startswith("NvInfer")]
    assert not [f for f in res.stdout.splitlines() if f.startswith(("plugins/build/", "plugins/lib/"))]
    assert not list(plugins.source_dir().glob("NvInfer*.h"))


# ----------------------------------------------------------------------------------- plugin logic in C++

FAKE_NVINFER = r"""
// A stand-in for libnvinfer: reports TensorRT 10 (the headers' ABI) and owns a logger finder.
#include <NvInferRuntime.h>
#include <mutex>
#include <string>
#include <vector>
namespace {
struct CaptureLogger : nvinfer1::ILogger {
    std::mutex mutex;
    std::vector<std::string> messages;
    void log(Severity, nvinfer1::AsciiChar const* msg) noexcept override {
        std::lock_guard<std::mutex> lock(mutex);
        messages.emplace_back(msg);
    }
};
struct Finder : nvinfer1::ILoggerFinder {
    nvinfer1::ILogger* findLogger() override { return logger; }
    nvinfer1::ILogger* logger{nullptr};
};
CaptureLogger gLogger;
Finder gFinder;
}
#define API extern "C" __attribute__((visibility("default")))
API int32_t getInferLibMajorVersion() noexcept { return NV_TENSORRT_MAJOR; }
API nvinfer1::ILoggerFinder* fake_logger_finder() { gFinder.logger = &gLogger; return &gFinder; }
API int fake_logger_saw(char const* text) {
    std::lock_guard<std::mutex> lock(gLogger.mutex);
    for (auto const& m : gLogger.messages) if (m.find(text) != std::string::npos) return 1;
    return 0;
}
API int fake_logger_count() { std::lock_guard<std::mutex> lock(gLogger.mutex); return (int) gLogger.messages.size(); }
"""

HARNESS = r"""
// The attnx plugins through their TensorRT interfaces: creators, fields (serialization round
// trip), type/format/shape validation with messages naming the node, workspace size.
#include <NvInferRuntime.h>
#include <cstdio>
#include <cstring>
#include <initializer_list>
using namespace nvinfer1;
extern "C" IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);
extern "C" void setLoggerFinder(ILoggerFinder* finder);
extern "C" size_t attnx_tta_distance_workspace_size(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
extern "C" ILoggerFinder* fake_logger_finder();
extern "C" int fake_logger_saw(char const* text);
extern "C" int fake_logger_count();

static int failures = 0;
#define CHECK(cond) do { if (!(cond)) { std::printf("FAIL line %d: %s\n", __LINE__, #cond); ++failures; } } while (0)
static bool saw(char const* text) { return fake_logger_saw(text) != 0; }
static Dims dims(std::initializer_list<int64_t> v) {
    Dims d{}; d.nbDims = (int32_t) v.size(); int i = 0; for (auto x : v) d.d[i++] = x; return d;
}
static DynamicPluginTensorDesc desc(DataType t, Dims d) {
    DynamicPluginTensorDesc x{}; x.desc.type = t; x.desc.format = TensorFormat::kLINEAR; x.desc.dims = d;
    x.min = d; x.opt = d; x.max = d; return x;
}
template <typename T> static T* cap(IPluginV3* p, PluginCapabilityType t) { return static_cast<T*>(p->getCapabilityInterface(t)); }

int main() {
    setLoggerFinder(fake_logger_finder());
    int32_t n = 0;
    auto* const* creators = getCreators(n);
    CHECK(n == 3);
    IPluginCreatorV3One* maw = nullptr; IPluginCreatorV3One* tta = nullptr; IPluginCreatorV3One* gather = nullptr;
    for (int i = 0; i < n; ++i) {
        CHECK(std::strcmp(creators[i]->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") == 0);
        auto* c = static_cast<IPluginCreatorV3One*>(creators[i]);
        CHECK(std::strcmp(c->getPluginVersion(), "1") == 0);
        CHECK(std::strcmp(c->getPluginNamespace(), "attnx") == 0);
        if (!std::strcmp(c->getPluginName(), "MawDepthSelect")) maw = c;
        if (!std::strcmp(c->getPluginName(), "TtaDistance")) tta = c;
        if (!std::strcmp(c->getPluginName(), "MawDepthGather")) gather = c;
    }
    if (!maw || !tta || !gather) { std::printf("FAIL: creators missing\n"); return 1; }

    // MawDepthSelect: fields and the serialization round trip
    auto const* names = maw->getFieldNames();
    CHECK(names->nbFields == 1 && !std::strcmp(names->fields[0].name, "scale") && names->fields[0].type == PluginFieldType::kFLOAT32);
    float scale = 0.125f;
    PluginField f("scale", &scale, PluginFieldType::kFLOAT32, 1);
    PluginFieldCollection fc{1, &f};
    IPluginV3* p = maw->createPlugin("maw_node", &fc, TensorRTPhase::kBUILD);
    CHECK(p != nullptr);
    if (!p) return 1;
    CHECK(!std::strcmp(cap<IPluginV3OneCore>(p, PluginCapabilityType::kCORE)->getPluginName(), "MawDepthSelect"));
    CHECK(!std::strcmp(cap<IPluginV3OneCore>(p, PluginCapabilityType::kCORE)->getPluginNamespace(), "attnx"));
    auto const* ser = cap<IPluginV3OneRuntime>(p, PluginCapabilityType::kRUNTIME)->getFieldsToSerialize();
    CHECK(ser->nbFields == 1 && !std::strcmp(ser->fields[0].name, "scale") && ser->fields[0].type == PluginFieldType::kFLOAT32
          && ser->fields[0].length == 1 && *static_cast<float const*>(ser->fields[0].data) == 0.125f);
    IPluginV3* restored = maw->createPlugin("maw_node", ser, TensorRTPhase::kRUNTIME);
    CHECK(restored && *static_cast<float const*>(cap<IPluginV3OneRuntime>(restored, PluginCapabilityType::kRUNTIME)->getFieldsToSerialize()->fields[0].data) == 0.125f);
    IPluginV3* cl = p->clone();
    CHECK(cl && *static_cast<float const*>(cap<IPluginV3OneRuntime>(cl, PluginCapabilityType::kRUNTIME)->getFieldsToSerialize()->fields[0].data) == 0.125f);
    IPluginV3* attached = cap<IPluginV3OneRuntime>(p, PluginCapabilityType::kRUNTIME)->attachToContext(nullptr);
    CHECK(attached != nullptr);
    double scale64 = 0.25;
    PluginField f64("scale", &scale64, PluginFieldType::kFLOAT64, 1);
    PluginFieldCollection fc64{1, &f64};
    IPluginV3* p64 = maw->createPlugin("maw_node", &fc64, TensorRTPhase::kBUILD);
    CHECK(p64 && *static_cast<float const*>(cap<IPluginV3OneRuntime>(p64, PluginCapabilityType::kRUNTIME)->getFieldsToSerialize()->fields[0].data) == 0.25f);
    PluginFieldCollection empty{0, nullptr};
    CHECK(maw->createPlugin("maw_missing_scale", &empty, TensorRTPhase::kBUILD) == nullptr);
    CHECK(saw("attnx::MawDepthSelect node 'maw_missing_scale'") && saw("'scale'"));

    // MawDepthSelect: types, formats, configure
    auto* b = cap<IPluginV3OneBuild>(p, PluginCapabilityType::kBUILD);
    CHECK(b->getNbOutputs() == 2);
    DataType half3[3] = {DataType::kHALF, DataType::kHALF, DataType::kHALF};
    DataType out2[2];
    CHECK(b->getOutputDataTypes(out2, 2, half3, 3) == 0 && out2[0] == DataType::kHALF && out2[1] == DataType::kINT64);
    DataType int3[3] = {DataType::kINT32, DataType::kINT32, DataType::kINT32};
    CHECK(b->getOutputDataTypes(out2, 2, int3, 3) != 0);
    CHECK(saw("node 'maw_node': input 'q_depth' is int32"));
    DataType mixed3[3] = {DataType::kFLOAT, DataType::kHALF, DataType::kFLOAT};
    CHECK(b->getOutputDataTypes(out2, 2, mixed3, 3) != 0);
    CHECK(saw("inputs must share one type"));

    DynamicPluginTensorDesc io[5] = {desc(DataType::kFLOAT, dims({2, 4, 7, 5})), desc(DataType::kFLOAT, dims({2, 4, 9, 5})),
        desc(DataType::kFLOAT, dims({2, 5})), desc(DataType::kFLOAT, dims({2, 4, 7, 9})), desc(DataType::kINT64, dims({2}))};
    for (int pos = 0; pos < 5; ++pos) CHECK(b->supportsFormatCombination(pos, io, 3, 2));
    io[1].desc.type = DataType::kHALF; CHECK(!b->supportsFormatCombination(1, io, 3, 2)); io[1].desc.type = DataType::kFLOAT;
    io[4].desc.type = DataType::kINT32; CHECK(!b->supportsFormatCombination(4, io, 3, 2)); io[4].desc.type = DataType::kINT64;
    io[0].desc.format = TensorFormat::kHWC8; CHECK(!b->supportsFormatCombination(0, io, 3, 2)); io[0].desc.format = TensorFormat::kLINEAR;
    io[0].desc.type = DataType::kBF16; CHECK(!b->supportsFormatCombination(0, io, 3, 2)); io[0].desc.type = DataType::kFLOAT;
    CHECK(b->configurePlugin(io, 3, io + 3, 2) == 0);
    io[2].max = dims({3, 5});
    CHECK(b->configurePlugin(io, 3, io + 3, 2) != 0);
    CHECK(saw("batch size differs: q_depth[0] is 2 but policy_logits[0] is 3 (at the profile's max shapes)"));
    io[2].max = dims({2, 5});
    io[1].min = dims({2, 4, 9, 6});
    CHECK(b->configurePlugin(io, 3, io + 3, 2) != 0);
    CHECK(saw("depth size differs"));
    io[1].min = dims({2, 4, 9, 5});
    io[2].min = dims({2, 5, 1});
    CHECK(b->configurePlugin(io, 3, io + 3, 2) != 0);
    CHECK(saw("policy_logits must have rank 2"));

    // TtaDistance
    IPluginV3* t = tta->createPlugin("tta_node", &empty, TensorRTPhase::kBUILD);
    CHECK(t != nullptr);
    if (!t) return 1;
    auto* tb = cap<IPluginV3OneBuild>(t, PluginCapabilityType::kBUILD);
    CHECK(tb->getNbOutputs() == 1);
    CHECK(cap<IPluginV3OneRuntime>(t, PluginCapabilityType::kRUNTIME)->getFieldsToSerialize()->nbFields == 0);
    DataType f3[3] = {DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT};
    DataType o1[1];
    CHECK(tb->getOutputDataTypes(o1, 1, f3, 3) == 0 && o1[0] == DataType::kFLOAT);
    DynamicPluginTensorDesc tio[4] = {desc(DataType::kHALF, dims({2, 4, 7, 16})), desc(DataType::kHALF, dims({2, 4, 9, 16})),
        desc(DataType::kHALF, dims({2, 1, 16, 16})), desc(DataType::kHALF, dims({2, 4, 7, 9}))};
    tio[0].min = dims({1, 4, 1, 16}); tio[1].min = dims({1, 4, 1, 16}); tio[2].min = dims({1, 1, 16, 16}); tio[3].min = dims({1, 4, 1, 1});
    for (int pos = 0; pos < 4; ++pos) CHECK(tb->supportsFormatCombination(pos, tio, 3, 1));
    CHECK(tb->configurePlugin(tio, 3, tio + 3, 1) == 0);
    size_t ws = tb->getWorkspaceSize(tio, 3, tio + 3, 1);
    CHECK(ws == attnx_tta_distance_workspace_size(2, 4, 2, 1, 7, 9, 16) + 256);  // + room to align the pointer
    tio[2].max = dims({2, 1, 12, 12});
    CHECK(tb->configurePlugin(tio, 3, tio + 3, 1) != 0);
    CHECK(saw("attnx::TtaDistance node 'tta_node': trace size differs"));
    tio[2].max = dims({2, 3, 16, 16});
    CHECK(tb->configurePlugin(tio, 3, tio + 3, 1) != 0);
    CHECK(saw("trace heads: trace[1] is 3 but must be 1 or the number of heads"));
    tio[2].max = dims({2, 4, 16, 16});
    CHECK(tb->configurePlugin(tio, 3, tio + 3, 1) == 0);
    tio[1].max = dims({2, 4, 9, 8});
    CHECK(tb->configurePlugin(tio, 3, tio + 3, 1) != 0);
    CHECK(saw("head size differs: q[3] is 16 but k[3] is 8"));

    // MawDepthGather: no fields, three outputs (q_sel, k_sel: T; depth: int64), MawDepthSelect's shape rules
    CHECK(gather->getFieldNames()->nbFields == 0);
    IPluginV3* gp = gather->createPlugin("gather_node", &fc, TensorRTPhase::kBUILD);  // a stray field is ignored
    CHECK(gp != nullptr);
    if (!gp) return 1;
    CHECK(!std::strcmp(cap<IPluginV3OneCore>(gp, PluginCapabilityType::kCORE)->getPluginName(), "MawDepthGather"));
    CHECK(!std::strcmp(cap<IPluginV3OneCore>(gp, PluginCapabilityType::kCORE)->getPluginVersion(), "1"));
    CHECK(cap<IPluginV3OneRuntime>(gp, PluginCapabilityType::kRUNTIME)->getFieldsToSerialize()->nbFields == 0);
    auto* gb = cap<IPluginV3OneBuild>(gp, PluginCapabilityType::kBUILD);
    CHECK(gb->getNbOutputs() == 3);
    DataType out3[3];
    CHECK(gb->getOutputDataTypes(out3, 3, half3, 3) == 0 && out3[0] == DataType::kHALF && out3[1] == DataType::kHALF
          && out3[2] == DataType::kINT64);
    CHECK(gb->getOutputDataTypes(out3, 2, half3, 3) != 0);
    CHECK(saw("attnx::MawDepthGather node 'gather_node': expects 3 inputs (q_depth, k_depth, policy_logits) and 3 outputs (q_sel, k_sel, depth), got 3 and 2"));
    CHECK(gb->getOutputDataTypes(out3, 3, int3, 3) != 0);
    CHECK(saw("attnx::MawDepthGather node 'gather_node': input 'q_depth' is int32"));
    DynamicPluginTensorDesc gio[6] = {desc(DataType::kFLOAT, dims({2, 4, 7, 5})), desc(DataType::kFLOAT, dims({2, 4, 9, 5})),
        desc(DataType::kFLOAT, dims({2, 5})), desc(DataType::kFLOAT, dims({2, 4, 7, 1})), desc(DataType::kFLOAT, dims({2, 4, 9, 1})),
        desc(DataType::kINT64, dims({2}))};
    for (int pos = 0; pos < 6; ++pos) CHECK(gb->supportsFormatCombination(pos, gio, 3, 3));
    gio[4].desc.type = DataType::kHALF; CHECK(!gb->supportsFormatCombination(4, gio, 3, 3)); gio[4].desc.type = DataType::kFLOAT;
    gio[5].desc.type = DataType::kFLOAT; CHECK(!gb->supportsFormatCombination(5, gio, 3, 3)); gio[5].desc.type = DataType::kINT64;
    CHECK(gb->configurePlugin(gio, 3, gio + 3, 3) == 0);
    gio[1].max = dims({2, 4, 9, 6});
    CHECK(gb->configurePlugin(gio, 3, gio + 3, 3) != 0);
    CHECK(saw("attnx::MawDepthGather node 'gather_node': depth size differs: q_depth[3] is 5 but k_depth[3] is 6 (at the profile's max shapes)"));
    IPluginV3* gc = gp->clone();
    CHECK(gc && !std::strcmp(cap<IPluginV3OneCore>(gc, PluginCapabilityType::kCORE)->getPluginName(), "MawDepthGather"));

    delete p; delete restored; delete cl; delete attached; delete p64; delete t; delete gp; delete gc;
    std::printf("%s (%d messages logged)\n", failures ? "FAILED" : "OK", fake_logger_count());
    return failures ? 1 : 0;
}
"""


@pytest.mark.cxx
def test_plugin_logic_through_tensorrt_interfaces(plugin_lib, tmp_path):
    """Creators, PluginField (de)serialization, type/format/shape checks with node-named messages,
    workspace size, and logging through setLoggerFinder's ILogger (TensorRT 10 ABI)."""
    info = plugins.build_info(plugin_lib)
    assert info is not None, f"{plugin_lib} has no build info: not built by `attnx plugins build`"
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    includes = [f"-I{info['tensorrt_include_dir']}"] + [f"-I{d}" for d in info["cuda_include_dirs"]]
    (tmp_path / "fake_nvinfer.cpp").write_text(FAKE_NVINFER)
    (tmp_path / "harness.cpp").write_text(HARNESS)
    common = [cxx, "-std=c++17", "-w", *includes]
    for cmd in ([*common, "-shared", "-fPIC", "fake_nvinfer.cpp", "-o", "libfake_nvinfer.so"],
                [*common, "harness.cpp", "-o", "harness", "-L.", "-lfake_nvinfer", f"-L{plugin_lib.parent}",
                 f"-l:{plugin_lib.name}", f"-Wl,-rpath,{plugin_lib.parent}:{tmp_path}", "-ldl"]):
        res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
        assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr[-3000:]}"
    res = subprocess.run([str(tmp_path / "harness")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("OK")
    # Every message went through the ILogger from setLoggerFinder, none to stderr.
    assert "[attnx plugins]" not in res.stderr
