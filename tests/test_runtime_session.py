"""attnx.runtime sessions: specs from the file, parity with the PyTorch reference, checks, threads."""

from __future__ import annotations

import platform
import sys
import threading

import numpy as np
import pytest
import torch

from attnx.contract import TensorEntry
from attnx.runtime import InputError, load
from attnx.runtime.core.backends.onnxrt import OnnxRuntimeSession, OrtOptions, ort_providers
from attnx.runtime.core.session import TensorSpec, merge_specs
from conftest_runtime import EXPORT_KW, assert_outputs_equal, request


@pytest.fixture(scope="module")
def maw(exported):
    return exported("maw", **EXPORT_KW)


@pytest.fixture(scope="module")
def smal(exported):
    return exported("smal", **EXPORT_KW)


@pytest.fixture(scope="module")
def maw_session(maw):
    return load(maw.path, device="cpu")


@pytest.fixture(scope="module")
def smal_session(smal):
    return load(smal.path, device="cpu")


def test_specs_come_from_the_file(maw_session, smal_session):
    s = maw_session
    assert s.input_names == ["hidden_states", "attention_mask"]
    assert s.output_names == ["output", "maw_depth"]
    hs = s.input("hidden_states")
    assert hs.dtype == np.float32 and hs.shape[:2] == ("batch", "seq") and isinstance(hs.shape[2], int)
    assert (hs.batch_axis, hs.seq_axis, hs.role) == (0, 1, "hidden_states")
    assert s.input("attention_mask").dtype == np.int64 and s.mask_input.name == "attention_mask"
    assert s.output("maw_depth").shape == ("batch",) and s.output("maw_depth").dtype == np.int64
    assert s.output("output").seq_axis == 1
    assert s.provider == "onnxruntime:CPUExecutionProvider" and s.platform == "onnxruntime_onnx"
    assert s.variant == "maw"
    assert smal_session.input("self_state").shape[0] == "batch"
    assert smal_session.input("trace").role == "context"
    assert smal_session.input("trace").rank == 3


def test_maw_matches_the_pytorch_reference(maw, maw_session):
    feeds = request(maw_session, rows=3, length=9, seed=1, pad_to=12)
    out = maw_session.run(feeds)
    with torch.no_grad():
        ref, extras = maw.model(torch.from_numpy(feeds["hidden_states"]), torch.from_numpy(feeds["attention_mask"]),
                                return_extras=True)
    # Padded query rows carry no meaning: compare the real tokens.
    np.testing.assert_allclose(out["output"][:, :9], ref.numpy()[:, :9], atol=1e-4, rtol=0)
    np.testing.assert_array_equal(out["maw_depth"], extras["maw_depth"].numpy())


def test_smal_matches_the_pytorch_reference(smal, smal_session):
    feeds = request(smal_session, rows=2, length=7, seed=2)
    out = smal_session.run(feeds)
    with torch.no_grad():
        ref = smal.model(torch.from_numpy(feeds["hidden_states"]), torch.from_numpy(feeds["attention_mask"]),
                         self_state=torch.from_numpy(feeds["self_state"]), trace=torch.from_numpy(feeds["trace"]))
    np.testing.assert_allclose(out["output"], ref.numpy(), atol=1e-4, rtol=0)


def test_omitted_mask_means_all_tokens(maw_session):
    with_mask = request(maw_session, rows=2, length=6, seed=3)
    without = {k: v for k, v in with_mask.items() if k != "attention_mask"}
    assert_outputs_equal(maw_session.run(without), maw_session.run(with_mask), atol=0)


def test_selected_outputs_only(maw_session):
    feeds = request(maw_session, rows=1, length=5, seed=4)
    out = maw_session.run(feeds, output_names=["maw_depth"])
    assert list(out) == ["maw_depth"]
    with pytest.raises(InputError, match="unknown output"):
        maw_session.run(feeds, output_names=["nope"])


def test_concurrent_runs_from_threads_get_their_own_results(maw_session):
    requests = [request(maw_session, rows=1 + i % 3, length=4 + 3 * i, seed=10 + i) for i in range(8)]
    expected = [maw_session.run(r) for r in requests]
    got: dict[int, dict] = {}
    errors = []

    def worker(i: int) -> None:
        try:
            for _ in range(3):
                got[i] = maw_session.run(requests[i])
                assert_outputs_equal(got[i], expected[i], atol=0)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(got) == 8


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda f: f.update(extra=np.zeros(1, np.float32)), "unknown input"),
        (lambda f: f.pop("hidden_states"), "missing input|cannot infer"),
        (lambda f: f.update(hidden_states=f["hidden_states"].astype(np.float64)), "dtype"),
        (lambda f: f.update(hidden_states=f["hidden_states"][0]), "rank"),
        (lambda f: f.update(hidden_states=f["hidden_states"][:, :, :-1]), "dim 2"),
        (lambda f: f.update(attention_mask=f["attention_mask"][:1]), "disagrees"),
    ],
    ids=["unknown", "missing", "dtype", "rank", "fixed-dim", "batch-mismatch"],
)
def test_bad_feeds_raise_input_error(maw_session, change, message):
    feeds = request(maw_session, rows=2, length=5, seed=5)
    change(feeds)
    with pytest.raises(InputError, match=message):
        maw_session.run(feeds)


def test_smal_context_left_out_is_its_declared_default(smal_session):
    feeds = request(smal_session, rows=1, length=4, seed=6)
    assert {s.name: s.default for s in smal_session.inputs if s.default} == {"self_state": "zeros", "trace": "zeros"}
    zeros = {**feeds, "trace": np.zeros_like(feeds["trace"])}
    feeds.pop("trace")
    assert_outputs_equal(smal_session.run(feeds), smal_session.run(zeros), atol=0)
    with pytest.raises(InputError, match="trace"):
        smal_session.run({**feeds, "trace": np.zeros((1, 3, 3), np.float32)})


def test_thread_options_and_devices(maw):
    one = OnnxRuntimeSession(maw.path, OrtOptions(device="cpu", threads=1, spin=True, optimization="basic"))
    two = load(maw.path, device="cpu", threads=2)
    feeds = request(one, rows=2, length=5, seed=7)
    assert_outputs_equal(one.run(feeds), two.run(feeds), atol=1e-5)
    assert ort_providers("cpu") == ["CPUExecutionProvider"]
    assert ort_providers("auto")[-1] == "CPUExecutionProvider"
    with pytest.raises(ValueError, match="unknown device"):
        ort_providers("tpu")


def test_disabled_optimizers_reach_onnx_runtime(maw, tmp_path, monkeypatch):
    """The default skips ORT's SkipLayerNormFusion (slower on CPU, docs/performance.md); ``()`` lets it
    run. Read from the graph ORT actually optimized, so a dropped argument fails here."""
    import onnx
    import onnxruntime as ort

    def fused_ops(options: OrtOptions, name: str) -> set[str]:
        path = tmp_path / f"{name}.onnx"
        plain = OrtOptions.session_options

        def saving(self):
            so = plain(self)
            so.optimized_model_filepath = str(path)
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED  # portable file
            return so

        monkeypatch.setattr(OrtOptions, "session_options", saving)
        options.inference_session(maw.path)
        monkeypatch.setattr(OrtOptions, "session_options", plain)
        return {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}

    assert OrtOptions().disabled_optimizers == ("SkipLayerNormFusion",)
    assert "SkipLayerNormalization" not in fused_ops(OrtOptions(device="cpu"), "default")
    assert "SkipLayerNormalization" in fused_ops(OrtOptions(device="cpu", disabled_optimizers=()), "all")


def test_load_refuses_unknown_and_missing_files(tmp_path):
    with pytest.raises(ValueError, match="unknown model type"):
        load(tmp_path / "model.pt")
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "missing.onnx")
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "missing.engine")


def test_engine_that_cannot_run_here_fails_clearly(tmp_path):
    engine = tmp_path / "model.engine"
    engine.write_bytes(b"not an engine")
    with pytest.raises(Exception) as info:  # no GPU here, or not an engine: either way a clear error
        load(engine)
    assert "model.engine" in str(info.value)  # says which file, in one line


def test_metadata_names_dims_the_file_left_anonymous():
    meta = [TensorEntry("output", "output", "float32", ("batch", "seq", 8)),
            TensorEntry("depth", "aux", "int64", ("batch",))]
    specs = merge_specs(
        [("output", np.dtype(np.float32), ["s0", None, 8]), ("depth", np.dtype(np.int64), [3])], meta, False
    )
    assert specs[0] == TensorSpec("output", np.dtype(np.float32), ("batch", "seq", 8), "output")
    # A fixed dim in the file wins over the metadata.
    assert specs[1].shape == (3,) and specs[1].role == "aux"


@pytest.mark.skipif(not (sys.platform.startswith("linux") and platform.machine() == "x86_64"),
                    reason="FTZ/DAZ is the x86 MXCSR; the calling thread is flushed on x86-64 Linux only")
def test_denormals_flush_in_onnx_runtime_and_the_callers_thread_keeps_its_mode(tmp_path):
    """``denormal_as_zero`` (default on) reaches ORT's pool threads, and a runtime session flushes on the
    calling thread for each run (it does part of ORT's work); the caller's thread keeps its own mode
    before, between and after runs (ORT alone would set FTZ/DAZ on the session's creating thread)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph([helper.make_node("Mul", ["x", "two"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])],
                              [numpy_helper.from_array(np.array(2.0, np.float32), "two")])
    path = tmp_path / "mul.onnx"
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21)]), str(path))
    tiny = np.full(1 << 22, 1e-39, np.float32)  # denormal: 2 * 1e-39 is 2e-39 unless flushed

    def this_thread_flushes() -> bool:
        return bool((tiny[:4] * np.float32(2) == 0).all())

    assert OrtOptions().denormal_as_zero
    pool_only = OrtOptions(device="cpu", threads=2).inference_session(path)  # ORT's own session
    assert not this_thread_flushes()
    assert max(int((pool_only.run(None, {"x": tiny})[0] == 0).sum()) for _ in range(5)) > 0  # pool's share
    runtime = OnnxRuntimeSession(path, OrtOptions(device="cpu", threads=2))
    assert (runtime.run({"x": tiny})["y"] == 0).all()  # every share, this thread's included
    assert not this_thread_flushes()
    off = OnnxRuntimeSession(path, OrtOptions(device="cpu", threads=2, denormal_as_zero=False))
    assert (off.run({"x": tiny})["y"] == np.float32(2e-39)).all()
