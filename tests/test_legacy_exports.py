"""Files exported by attnx 0.1's hand-written BERT and GPT-2 hosts (tests/data/legacy-0.1) still load,
serve and check now that the hosts are transformers' own models: their reference is rebuilt by
renaming the old weights (``attnx.pretrained.legacy``) and equals the file and the original model."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest_runtime import running_server  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
DATA = Path(__file__).parent / "data" / "legacy-0.1"
FILES = {"bert-smal": "bert", "bert-maw": "bert", "gpt2-metaphor": "gpt2"}


@pytest.fixture(scope="module")
def legacy(tmp_path_factory):
    """A writable copy (a check writes its report beside the work folder, never into tests/)."""
    root = tmp_path_factory.mktemp("legacy")
    shutil.copytree(DATA, root, dirs_exist_ok=True)
    return root


@pytest.mark.parametrize("name", FILES)
def test_an_attnx_01_export_checks_against_its_original_folder(name, legacy):
    from attnx.contract import ModelInfo
    from attnx.parity.check import run_check

    path = legacy / "exports" / f"{name}.onnx"
    assert ModelInfo.read(path).config["host"] in ("bert", "gpt2")  # the old hosts' metadata
    report = run_check(path, workdir=legacy / "out", original=legacy / FILES[name])
    assert report.passed, report.to_json()
    if name != "bert-maw":  # maw's appended layer is neutral (W_O = 0): all three compare with the original
        assert report.original["used"], report.original["note"]


def test_an_attnx_01_reference_equals_its_file(legacy):
    import onnxruntime as ort
    import torch

    from attnx.export.reference import load_reference

    for name in FILES:
        path = legacy / "exports" / f"{name}.onnx"
        model, info = load_reference(path)
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        g = np.random.default_rng(0)
        ids = g.integers(5, 100, (2, 9))
        mask = np.ones((2, 9), np.int64)
        mask[1, 6:] = 0
        feeds = {"input_ids": ids, "attention_mask": mask}
        for i in sess.get_inputs():
            if i.name == "token_type_ids":
                feeds[i.name] = np.zeros_like(ids)
            elif i.name not in feeds:
                feeds[i.name] = g.standard_normal([2 if d == "batch" else d for d in i.shape]).astype(np.float32)
        got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        with torch.no_grad():
            want = model.forward_named({k: torch.from_numpy(v) for k, v in feeds.items()})
        real = mask.astype(bool)
        for key, value in got.items():
            ref = want[key].numpy()
            diff = np.abs(value - ref)[real] if value.ndim == 3 else np.abs(value - ref)
            assert diff.max() <= 1e-4, (name, key, float(diff.max()))


def test_attnx_01_exports_serve_text_as_before(legacy):
    import tritonclient.http as httpclient

    from attnx.runtime import TextModel

    texts = ["The cat sat on the mat.", "Where is the nearest train station?"]
    models = {name: legacy / "exports" / f"{name}.onnx" for name in FILES}
    with running_server(models) as server:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}")
        for name, path in models.items():
            direct = TextModel(path)
            context = {}
            for spec in direct.session.inputs:
                if spec.name not in ("input_ids", "attention_mask", "token_type_ids"):
                    context[spec.name] = np.zeros([len(texts) if d in ("batch", -1, None) else d for d in spec.shape],
                                                  np.float32)
            want = direct.encode(texts, output_value=None, context=context)
            inputs = [httpclient.InferInput("text", [len(texts)], "BYTES")]
            inputs[0].set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
            for key, value in context.items():
                item = httpclient.InferInput(key, list(value.shape), "FP32")
                item.set_data_from_numpy(value)
                inputs.append(item)
            result = client.infer(name, inputs)
            out = "logits" if name.startswith("gpt2") else "sentence_embedding"
            for i, row in enumerate(want):
                expected = row[out][0]
                served = result.as_numpy(out)[i][tuple(slice(0, n) for n in expected.shape)]
                assert np.abs(served - expected).max() <= 1e-5, name
