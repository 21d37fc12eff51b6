"""The support matrix (issue 22): every family of ``tests/hf_folders.py`` (random weights saved by
transformers itself, tokenizers trained in-process) exported with ``mha`` and with a placed variant
at its neutral values, then

- ONNX Runtime vs transformers' own ``eager`` model on padded batches (right padding; decoders also
  left padding, with positions from the mask as ``generate`` gives them): max abs <= 1e-4;
- ONNX Runtime vs attnx's torch reference of the placed model (the literal formulas);
- ``attnx check``: PASS (against the original model and the reference, on real text);
- ``attnx build-engine --fp16`` builds (TensorRT-RTX);
- text served by ``attnx serve`` equals the same text run directly (``TextModel``).

With ``$ATTNX_SUPPORT_MATRIX`` naming a file, each figure lands there, from which
``tools/support_matrix.py`` writes docs/models.md (tests write nothing outside their tmp folders otherwise).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import hf_folders  # noqa: E402
from conftest_runtime import running_server  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402
transformers.logging.set_verbosity_error()


ROWS = [(name, variant) for name, fam in hf_folders.FAMILIES.items() for variant in ("mha", fam.variant)]
IDS = [f"{name}-{variant}" for name, variant in ROWS]
RESULTS: dict[str, dict] = {}
MATRIX = Path(os.environ["ATTNX_SUPPORT_MATRIX"]) if os.environ.get("ATTNX_SUPPORT_MATRIX") else None


def write_matrix(figures: dict) -> None:
    """Merge ``figures`` into ``$ATTNX_SUPPORT_MATRIX`` (when set)."""
    if MATRIX is None:
        return
    previous = json.loads(MATRIX.read_text()) if MATRIX.is_file() else {}
    MATRIX.parent.mkdir(parents=True, exist_ok=True)
    MATRIX.write_text(json.dumps({**previous, **figures}, indent=1, sort_keys=True))


def record(name: str, variant: str, **figures) -> None:
    RESULTS.setdefault(f"{name}/{variant}", {"family": name, "variant": variant}).update(figures)


@pytest.fixture(scope="module", autouse=True)
def toy_and_matrix(toy_registered):
    """The toy variant registered for this module only; the matrix written at the end."""
    yield
    write_matrix({**RESULTS, "_versions": {
        "transformers": transformers.__version__, "torch": torch.__version__.split("+")[0],
        "onnxruntime": __import__("onnxruntime").__version__}})


@pytest.fixture(scope="module")
def folders():
    return hf_folders.lazy_folders()


@pytest.fixture(scope="module")
def exports(folders, tmp_path_factory):
    from attnx.export.pretrained import export_pretrained

    out = tmp_path_factory.mktemp("family-exports")
    cache = {}

    def get(name: str, variant: str):
        if (name, variant) not in cache:
            cache[name, variant] = export_pretrained(folders(name), out / f"{name}-{variant}.onnx", variant=variant)
        return cache[name, variant]

    return get


def neutral_context(specs, batch: int) -> dict[str, np.ndarray]:
    """Context inputs at which every placed variant is neutral whatever its values (ones: the toy's
    temperature 1 is its neutral value; smal, cultural and metaphor are neutral at any context)."""
    out = {}
    for spec in specs:
        shape = [batch if d == "batch" else d for d in spec.shape]
        out[spec.name] = np.ones(shape, np.int64 if spec.dtype == "int64" else np.float32)
    return out


def padded_batch(vocab: int, causal: bool, left: bool, seed: int = 0):
    g = np.random.default_rng(seed)
    ids = g.integers(4, vocab, (3, 13))
    mask = np.ones((3, 13), np.int64)
    for row, pad in ((1, 5), (2, 2)):
        if left:
            mask[row, :pad] = 0
        else:
            mask[row, 13 - pad:] = 0
    return ids, mask


def ort_session(path):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize(("name", "variant"), ROWS, ids=IDS)
def test_onnx_runtime_equals_transformers_eager_on_padded_batches(name, variant, folders, exports):
    from attnx.pretrained.host import TASKS, positions_from_mask

    result = exports(name, variant)
    host = result.model
    eager = getattr(transformers, TASKS[host.task]).from_pretrained(str(folders(name)), attn_implementation="eager")
    sess = ort_session(result.path)
    out_name = "last_hidden_state" if host.task == "feature-extraction" else "logits"
    worst, worst_ref = 0.0, 0.0
    for left in ([False, True] if host.causal else [False]):
        ids, mask = padded_batch(host.vocab_size, host.causal, left)
        feeds = {"input_ids": ids, "attention_mask": mask, **neutral_context(host.context_inputs(), 3)}
        if host.type_vocab_size:
            feeds["token_type_ids"] = np.zeros_like(ids)
        got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))[out_name]
        kwargs = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}
        if host.causal:
            kwargs["position_ids"] = positions_from_mask(kwargs["attention_mask"])
        with torch.no_grad():
            result_eager = eager.eval()(**kwargs)
            ref = host.forward_named({k: torch.from_numpy(v) for k, v in feeds.items()})[out_name].numpy()
        want = getattr(result_eager, out_name).numpy()
        real = mask.astype(bool) if got.ndim == 3 else np.ones(got.shape[0], bool)
        assert np.abs(want[real]).max() > 0.5, "a trivial model: the comparison would mean nothing"
        worst = max(worst, float(np.abs(got - want)[real].max()))
        worst_ref = max(worst_ref, float(np.abs(got - ref)[real].max()))
    record(name, variant, task=host.task, architecture=type(host.hf).__name__, ort_vs_eager=worst,
           ort_vs_reference=worst_ref, padding="left+right" if host.causal else "right")
    assert worst <= 1e-4 and worst_ref <= 1e-4, (worst, worst_ref)


@pytest.mark.parametrize(("name", "variant"), ROWS, ids=IDS)
def test_check_passes(name, variant, exports, tmp_path):
    from attnx.parity.check import run_check

    result = exports(name, variant)
    report = run_check(result.path, workdir=tmp_path)
    record(name, variant, check="PASS" if report.passed else "FAIL", check_original=report.original["used"])
    assert report.passed, report.to_json()
    assert report.original["used"], report.original["note"]  # compared with transformers itself


@pytest.mark.rtx
@pytest.mark.parametrize(("name", "variant"), ROWS, ids=IDS)
def test_engine_builds_fp16(name, variant, exports, plugin_lib, tmp_path):
    from attnx import engine

    result = exports(name, variant)
    built = engine.build(result.path, tmp_path / f"{name}-{variant}.engine", fp16=True, target="sm89",
                         plugins=plugin_lib)
    record(name, variant, engine_fp16=f"{built.sidecar['engine_bytes'] // 1024} KiB, "
                                      f"{built.sidecar['plugin_layers']} plugin layers")
    assert built.sidecar["engine_bytes"] > 1000 and built.sidecar["inlined_custom_nodes"] == 0


def test_served_text_equals_the_direct_run(exports):
    """One server with every export of the matrix: text in, the same numbers as TextModel on the file."""
    import requests  # noqa: F401  (tritonclient.http needs it too)
    import tritonclient.http as httpclient

    from attnx.runtime import TextModel

    texts = ["The cat sat on the mat.", "A man is playing a guitar on the stage tonight.", "Hi"]
    models = {f"{n}-{v}": exports(n, v).path for n, v in ROWS}
    with running_server(models) as server:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}")
        for (name, variant), model in zip(ROWS, models):
            direct = TextModel(models[model])
            context = neutral_context([s for s in exports(name, variant).model.context_inputs()], len(texts))
            want = direct.encode(texts, output_value=None, context=context)
            inputs = [httpclient.InferInput("text", [len(texts)], "BYTES")]
            inputs[0].set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
            for key, value in context.items():
                item = httpclient.InferInput(key, list(value.shape), "FP32" if value.dtype == np.float32 else "INT64")
                item.set_data_from_numpy(value)
                inputs.append(item)
            result = client.infer(model, inputs)
            worst = 0.0
            for out_name in want[0]:
                got = result.as_numpy(out_name)
                for i, row in enumerate(want):
                    expected = row[out_name][0]
                    served = got[i][tuple(slice(0, n) for n in expected.shape)]
                    worst = max(worst, float(np.abs(served - expected).max()))
            record(name, variant, served_vs_direct=worst)
            assert worst <= 1e-5, (model, worst)
