"""`attnx.parity`: Polygraphy's Comparator over the PyTorch reference, ONNX Runtime on both
lowerings and (where it can run) the engine. Passes on every variant in fp32 and fp16, fails on a
model whose weights were changed after export, reports ties of an exact output (a variant's
decision at a near-equal margin, e.g. MAW's depth) instead of hiding them."""

from __future__ import annotations

import json
import shutil
from collections import OrderedDict
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from attnx import engine as eng
from attnx import parity
from attnx.contract import ContractError
from attnx.models import VARIANTS, get_spec
from support.exports import check_workdir


def _tie_output(variant: str):
    """The variant's exact extra output with a decision margin (None when it has none)."""
    return next((o for o in get_spec(variant).extra_outputs if o.exact and o.margin is not None), None)


#: A variant with an exact output that can tie (MAW's depth), from the registry.
TIE_VARIANT = next(v for v in VARIANTS if _tie_output(v) is not None)
TIE_OUTPUT = _tie_output(TIE_VARIANT).name


def _copy_export(res, folder: Path, name: str | None = None) -> Path:
    """The export and its weights file in ``folder`` (so it can be edited)."""
    folder.mkdir(parents=True, exist_ok=True)
    dst = folder / (name or res.path.name)
    shutil.copy(res.path, dst)
    shutil.copy(res.weights_path, folder / res.info.weights)
    return dst


def _perturb(path: Path, scale: float = 0.02) -> str:
    """Edit the largest float initializer of the ONNX file in place; returns its name."""
    model = onnx.load(str(path))
    init = max((i for i in model.graph.initializer if i.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)),
               key=lambda i: int(np.prod(i.dims)))
    arr = numpy_helper.to_array(init).copy()
    arr.flat[: max(1, arr.size // 8)] += np.asarray(scale, arr.dtype)
    init.CopyFrom(numpy_helper.from_array(arr, init.name))
    onnx.save(model, str(path))
    return init.name


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_check_passes_on_every_variant(exported, tmp_path, variant, fp16):
    res = exported(variant)
    path = res.path
    if fp16:
        path, _ = eng.ensure_fp16(_copy_export(res, tmp_path / "m"))
    report = parity.run_check(path, workdir=check_workdir(path, tmp_path))
    assert report.passed, report.mismatches()
    precision = "fp16" if fp16 else "fp32"
    assert report.precision == precision
    spec = get_spec(variant)
    exact = {o.name for o in spec.extra_outputs if o.exact}
    outputs = ["output"] + [o.name for o in spec.extra_outputs]
    pairs = {(c.runner, c.output) for c in report.comparisons}
    assert pairs == {(r, o) for r in ("onnxrt-plugin", "onnxrt-rewrite") for o in outputs}
    assert all(c.reference == "torch" for c in report.comparisons)
    for c in report.comparisons:
        default = parity.EXACT if c.output in exact else parity.DEFAULT_TOLERANCES[precision]
        atol, rtol, mean_atol = spec.tolerances.get(precision, {}).get(c.output, default)
        assert (c.atol, c.rtol, c.mean_atol) == (atol, rtol, mean_atol)
        assert c.max_abs <= max(atol, 1e-12) * (1 if c.output in exact else 50)
        assert len(c.iterations) == len(report.cases)
    for name in exact:
        assert {c.atol for c in report.comparisons if c.output == name} == {0.0}  # exact
    if not fp16:
        assert max(c.max_abs for c in report.comparisons) < 1e-4
    # The other lowering was re-exported from the reference into <workdir>/parity/.
    other = next(r for r in report.runners if r["name"].startswith("onnxrt") and not r["given"])
    assert Path(other["path"]).parent == tmp_path / "parity" and Path(other["path"]).is_file()
    assert report.engine is None


def test_check_fails_on_weights_changed_after_export(exported, tmp_path):
    res = exported(TIE_VARIANT)
    path = _copy_export(res, tmp_path / "m", "perturbed.onnx")
    # The reference weights are named in the metadata: keep them (that is the point).
    name = _perturb(path)
    report = parity.run_check(path, workdir=tmp_path)
    assert not report.passed
    failed = {(c.runner, c.output) for c in report.comparisons if not c.passed}
    assert ("onnxrt-plugin", "output") in failed  # the edited file
    assert not {c for c in failed if c[0] == "onnxrt-rewrite"}  # re-exported from the reference: fine
    assert any("onnxrt-plugin vs torch: output" in m for m in report.mismatches())
    assert report.verdict == "FAIL" and name


def test_check_fails_on_small_fp16_drift_through_the_mean(exported, tmp_path):
    """A change too small for the loose fp16 elementwise bound still fails the mean-error check."""
    res = exported("mha")
    path, _ = eng.ensure_fp16(_copy_export(res, tmp_path / "m"))
    _perturb(path, scale=0.01)
    report = parity.run_check(path, workdir=tmp_path)
    bad = [c for c in report.comparisons if c.runner == "onnxrt-plugin"]
    assert not report.passed and not bad[0].passed
    assert not bad[0].mean_passed


def test_report_json(exported, tmp_path):
    res = exported("smal")
    report = parity.run_check(res.path, workdir=check_workdir(res.path, tmp_path), case_specs=["2x9", "1x3"])
    path = report.write(tmp_path / "r" / "parity.json")
    data = json.loads(path.read_text())
    assert data["passed"] is True and data["verdict"] == "pass"
    assert data["variant"] == "smal" and data["precision"] == "fp32" and data["reference"] == "torch"
    assert [c["batch"] for c in data["cases"]] == [2, 1] and data["cases"][0]["lengths"][0] == 9
    assert data["tolerances"]["output"] == {"atol": 1e-4, "rtol": 1e-4, "mean_atol": 1e-5}
    assert {r["name"] for r in data["runners"]} == {"torch", "onnxrt-plugin", "onnxrt-rewrite"}
    for c in data["comparisons"]:
        assert {"runner", "output", "max_abs", "max_rel", "mean_abs", "atol", "rtol", "passed", "iterations"} <= set(c)
        assert [it["case"] for it in c["iterations"]] == ["2x9", "1x3"]
    assert data["mismatches"] == [] and data["ties"] == []


@pytest.mark.rtx
def test_engine_is_verified_and_reported_where_it_cannot_run(exported, tmp_path):
    if eng.gpu_compute_capability() is not None:
        pytest.skip("a GPU is present: this checks the 'cannot run here' path")
    res = exported(TIE_VARIANT)
    path = _copy_export(res, tmp_path / "m")
    built = eng.build(path, shapes={"batch": (1, 2, 3), "seq": (1, 8, 20)})
    report = parity.run_check(path, engine=built.engine_path, workdir=check_workdir(path, tmp_path))
    assert report.passed
    assert report.engine["ran"] is False and "no CUDA GPU" in report.engine["reason"]
    engine_runner = next(r for r in report.runners if r["name"] == "tensorrt")
    assert engine_runner["ran"] is False
    # The cases were clipped into the engine's (smaller) profile.
    assert all(c.batch <= 3 and c.seq <= 20 for c in report.cases)
    # Found automatically beside the ONNX it was built from.
    assert parity.find_engine_for(path) == built.engine_path
    # A case outside the engine's profile is refused.
    with pytest.raises(parity.ParityError, match="outside the engine's profile"):
        parity.run_check(path, engine=built.engine_path, workdir=tmp_path, case_specs=["4x8"])
    # An engine built from another file is refused.
    other = _copy_export(exported(TIE_VARIANT, d_model=16), tmp_path / "o")
    with pytest.raises(parity.ParityError, match="was built from"):
        parity.run_check(other, engine=built.engine_path, workdir=tmp_path)
    # A changed engine is refused.
    data = bytearray(built.engine_path.read_bytes())
    data[-10] ^= 0x55
    built.engine_path.write_bytes(bytes(data))
    with pytest.raises(ContractError, match="corrupt"):
        parity.run_check(path, engine=built.engine_path, workdir=tmp_path)


def test_data_loader_covers_batches_lengths_and_padding(exported):
    res = exported("smal")
    model, info = parity.load_reference(res.path)
    cases = parity.default_cases(info.profiles)
    assert len(cases) >= 4 and all(c.seq != 8 or c.batch != 2 for c in cases)  # not the export example
    assert len({c.batch for c in cases}) >= 3 and len({c.seq for c in cases}) >= 3
    loader = parity.ParityDataLoader(model, info.inputs, cases)
    feeds = list(loader)
    assert len(feeds) == len(cases)
    padded = 0
    for case, feed in zip(cases, feeds):
        assert list(feed) == [i.name for i in info.inputs]
        assert feed["hidden_states"].shape == (case.batch, case.seq, model.d_model)
        assert feed["hidden_states"].dtype == np.float32
        mask = feed["attention_mask"]
        assert mask.dtype == np.int64 and list(mask.sum(axis=1)) == list(case.lengths)
        assert (mask[:, 0] == 1).all()
        padded += int((mask == 0).any())
    assert padded >= 2
    # Random access (Polygraphy reloads inputs by index) returns the same data.
    np.testing.assert_array_equal(loader[1]["hidden_states"], feeds[1]["hidden_states"])
    # Clipped into narrow profiles.
    narrow = parity.default_cases({"batch": [1, 1, 2], "seq": [4, 8, 10]})
    assert all(1 <= c.batch <= 2 and 4 <= c.seq <= 10 for c in narrow)


def test_parse_cases():
    assert [(c.batch, c.seq) for c in parity.parse_cases(["2x16", "3x5,1x1"])] == [(2, 16), (3, 5), (1, 1)]
    with pytest.raises(parity.ParityError, match="BATCHxSEQ"):
        parity.parse_cases(["16"])
    with pytest.raises(parity.ParityError, match="outside the model's profile"):
        parity.parse_cases(["64x8"], {"batch": [1, 8, 32], "seq": [1, 128, 512]})


def test_runners_are_polygraphy_runners(exported):
    from polygraphy.backend.base import BaseRunner

    res = exported(TIE_VARIANT)
    runner = parity.TorchReferenceRunner.from_onnx(res.path)
    assert isinstance(runner, BaseRunner) and issubclass(parity.EngineRunner, BaseRunner)
    model, info = parity.load_reference(res.path)
    feed = parity.ParityDataLoader(model, info.inputs, [parity.Case(2, 6, (6, 3))])[0]
    with runner:
        meta = runner.get_input_metadata(use_numpy_dtypes=False)
        assert list(meta) == ["hidden_states", "attention_mask"]
        out = runner.infer(feed)
    assert out["output"].shape == (2, 6, model.d_model) and out[TIE_OUTPUT].dtype == np.int64
    margins = out[parity.MARGIN_PREFIX + TIE_OUTPUT]
    assert margins.shape == (2, 2)  # [layers, batch]
    assert (margins >= 0).all()


def _iteration(name, outputs):
    from polygraphy.comparator import IterationResult

    return IterationResult(OrderedDict(outputs), runner_name=name)


@pytest.mark.parametrize("margin,tied", [(1e-3, True), (0.5, False)])
def test_depth_flip_at_a_near_tie_is_reported_not_hidden(margin, tied):
    """Row 1 picks another depth; the reference's top-2 policy logits differ by ``margin``."""
    tie_margin = _tie_output(TIE_VARIANT).tie_margin["fp16"]
    from polygraphy.comparator import Comparator, RunResults

    rng = np.random.default_rng(0)
    ref_out = rng.standard_normal((3, 4, 8)).astype(np.float32)
    out = ref_out.astype(np.float16)
    out[1] += np.float16(0.5)  # the other depth changes that row's output
    ref = {"output": ref_out, TIE_OUTPUT: np.array([0, 2, 1]),
           parity.MARGIN_PREFIX + TIE_OUTPUT: np.array([[0.4, margin, 0.3]])}
    run = {"output": out, TIE_OUTPUT: np.array([0, 1, 1])}
    results = RunResults()
    results.append(("torch", [_iteration("torch", ref)]))
    results.append(("onnxrt-plugin", [_iteration("onnxrt-plugin", run)]))
    tracker = parity.TieTracker({TIE_OUTPUT: tie_margin}, ["output"])
    tol = {"output": parity.DEFAULT_TOLERANCES["fp16"], TIE_OUTPUT: parity.EXACT}
    funcs = [parity.TieAwareCompareFunc(tracker=tracker, atol={k: v[0] for k, v in tol.items()},
                                        rtol={k: v[1] for k, v in tol.items()}),
             parity.TieAwareCompareFunc(tracker=tracker, atol={k: v[2] for k, v in tol.items()}, rtol=0.0,
                                        check_error_stat="mean", row_atol={k: v[0] for k, v in tol.items()},
                                        row_rtol={k: v[1] for k, v in tol.items()})]
    accuracy = Comparator.compare_accuracy(results, comparisons=[(1, 0)], compare_func=funcs)
    assert bool(accuracy) is tied
    if tied:
        assert len(tracker.ties) == 1
        tie = tracker.ties[0]
        assert (tie["row"], tie["output"], tie["reference_value"], tie["value"]) == (1, TIE_OUTPUT, 2, 1)
        assert tie["margin"] == pytest.approx(margin) and tie["row_max_abs"] > 0.4
        comparisons = parity.summarize(accuracy[0], accuracy[1], tol, tracker.ties, [parity.Case(3, 4, (4, 4, 4))])
        assert all(c.passed for c in comparisons) and all(c.ties == 1 for c in comparisons)
    else:
        assert tracker.ties == []


def test_setup_errors(exported, tmp_path):
    res = exported("cultural")
    path = _copy_export(res, tmp_path / "m")
    (tmp_path / "m" / res.info.weights).unlink()
    with pytest.raises(parity.ParityError, match="weights"):
        parity.run_check(path, workdir=tmp_path)
    bare = tmp_path / "bare.onnx"
    model = onnx.load(str(res.path))
    del model.metadata_props[:]
    onnx.save(model, str(bare))
    with pytest.raises(parity.ParityError, match="no attnx metadata"):
        parity.run_check(bare, workdir=tmp_path)
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x12\x34not onnx")
    with pytest.raises(ContractError, match="not a readable ONNX file"):
        parity.run_check(junk, workdir=tmp_path)


class _OrtAsEngine:
    """Stands in for the adapter's ``Engine`` where no GPU is: the same interface (io_tensors,
    run, close), computed by ONNX Runtime on the file, optionally with a defect."""

    def __init__(self, onnx_path: Path, defect: float = 0.0):
        import onnxruntime as ort

        from attnx.engine import IOTensor

        self.sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
        self.defect = defect
        to_np = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64}
        self.io_tensors = [IOTensor(i.name, True, np.dtype(to_np[i.type]), tuple(-1 if isinstance(d, str) else d
                                                                                 for d in i.shape))
                           for i in self.sess.get_inputs()]
        self.closed = False

    def run(self, feeds):
        names = [o.name for o in self.sess.get_outputs()]
        out = dict(zip(names, self.sess.run(None, dict(feeds))))
        out["output"] = out["output"] + np.asarray(self.defect, out["output"].dtype)
        return out

    def close(self):
        self.closed = True


@pytest.mark.parametrize("defect", [0.0, 0.01])
@pytest.mark.rtx
def test_engine_runner_joins_the_comparison_where_it_can_run(exported, tmp_path, monkeypatch, defect):
    """The wiring for a machine with the right GPU: the engine is a fourth Polygraphy runner."""
    res = exported(TIE_VARIANT)
    path = _copy_export(res, tmp_path / "m")
    built = eng.build(path)
    opened = []

    def fake_open(self):
        if self.engine is None:
            self.engine = _OrtAsEngine(path, defect)
            opened.append(self.engine)
        return self.engine

    monkeypatch.setattr(eng.runner, "runnable_here", lambda sidecar: (True, ""))
    monkeypatch.setattr(parity.EngineRunner, "open", fake_open)
    report = parity.run_check(path, engine=built.engine_path, workdir=check_workdir(path, tmp_path))
    assert report.engine["ran"] is True and opened and opened[0].closed
    trt = {c.output: c for c in report.comparisons if c.runner == "tensorrt"}
    assert set(trt) == {"output", TIE_OUTPUT}
    assert trt[TIE_OUTPUT].passed
    if defect:
        assert not report.passed and not trt["output"].passed
        assert any(m.startswith("tensorrt vs torch: output") for m in report.mismatches())
    else:
        assert report.passed and trt["output"].max_abs < 1e-4
