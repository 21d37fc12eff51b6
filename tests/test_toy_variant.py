"""A sixth variant in one file, with no file of the package edited (issue 10's proof).

``tests/toy_variant.py`` (temperature-scaled attention with a ``temperature [batch]`` context input)
is registered the two ways a user has: importing it in-process, and ``ATTNX_VARIANTS=toy_variant``
for the command line. It then goes through what the five built-in variants go through: the torch
model (fast path = reference path; equal to mha at temperature 1), placement in the real
all-MiniLM-L6-v2 (fresh = the original model), ``attnx variants``, ``attnx export`` (own encoder and
``--from-pretrained``), ``attnx check``, ``attnx build-engine --fp16`` (TensorRT-RTX), and a served
request through the unmodified tritonclient, with its context input validated like any other.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest_runtime import running_server, triton_infer  # noqa: E402

from attnx.models import build_encoder, get_spec, reference, variant_names  # noqa: E402
from attnx.models.spec import unregister  # noqa: E402
from support.cli import subprocess_run  # noqa: E402

TESTS = Path(__file__).parent
SMALL = ["--set", "d_model=32", "--set", "n_heads=4"]


def attnx(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """A real process with the toy registered the out-of-tree way: a module named in $ATTNX_VARIANTS,
    read when the process starts."""
    env = {"ATTNX_VARIANTS": "toy_variant",
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess_run(*args, cwd=cwd, env=env, timeout=600)


@pytest.fixture(scope="module", autouse=True)
def toy_variant():
    """Registered for this module only: other tests list the registry and must not see it."""
    import importlib

    import toy_variant as module

    if "toy" not in variant_names():
        module = importlib.reload(module)  # registering happens at import
    yield module
    unregister("toy")


def test_registered_in_process_and_equal_to_mha_at_temperature_one(toy_variant):
    assert "toy" in variant_names() and get_spec("toy").attention is toy_variant.TemperatureAttention
    toy = build_encoder("toy", d_model=32, n_heads=4, n_layers=2)
    mha = build_encoder("mha", d_model=32, n_heads=4, n_layers=2)
    missing, unexpected = toy.load_state_dict(mha.state_dict(), strict=False)
    assert unexpected == [] and sorted(missing) == [f"blocks.{i}.attn.{p}" for i in range(2)
                                                    for p in ("exponent", "log_scale")]
    x = torch.randn(3, 9, 32)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0
    one = torch.ones(3)
    with torch.no_grad():
        want = mha(x, mask)
        fast = toy(x, mask, temperature=one)
        with reference():
            literal = toy(x, mask, temperature=one)
        hot = toy(x, mask, temperature=torch.full((3,), 4.0))
    torch.testing.assert_close(fast, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(literal, want, atol=1e-6, rtol=0)
    assert float((hot - want).abs().max()) > 1e-2  # the temperature reaches the softmax
    with pytest.raises(ValueError, match="temperature"):
        toy(x, mask, temperature=torch.ones(2))  # one per example, checked by its InputSpec


def test_placed_in_the_real_minilm_it_starts_as_the_original():
    import transformers

    from attnx import pretrained

    folder = pretrained.minilm_path()
    host = pretrained.load(folder, "toy")
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    batch = tok(["A sixth attention variant.", "It lives in one file outside the package, and runs."],
                padding=True, return_tensors="pt")
    feeds = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    hot = {**feeds, "temperature": torch.full((2,), 3.0)}
    with torch.no_grad():
        want = transformers.BertModel.from_pretrained(str(folder)).eval()(**feeds).last_hidden_state
        got = host.forward_named(hot)["last_hidden_state"]  # neutral whatever the temperature
        for block in host.blocks:
            block.attn.exponent.fill_(1.0)  # "trained": the temperature now acts
        moved = host.forward_named(hot)["last_hidden_state"]
    real = feeds["attention_mask"].bool()
    assert float((got - want)[real].abs().max()) <= 1e-5
    assert float((moved - want)[real].abs().max()) > 1e-2


def test_every_command_takes_it_without_a_package_edit(tmp_path):
    import onnxruntime as ort
    import tritonclient.http as httpclient

    listed = attnx("variants", cwd=tmp_path)
    assert listed.returncode == 0 and "temperature-scaled attention" in " ".join(listed.stdout.split()), listed.stderr
    run = attnx("export", "--variant", "toy", *SMALL, "-o", "toy.onnx", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    model = tmp_path / "toy.onnx"
    check = attnx("check", str(model), cwd=tmp_path)
    assert check.returncode == 0 and "PASS" in check.stdout, check.stdout + check.stderr
    engine = attnx("build-engine", "--fp16", str(model), cwd=tmp_path)
    assert engine.returncode == 0 and (tmp_path / "toy-fp16.engine").stat().st_size > 0, engine.stderr

    # the file alone, with no attnx Python of the variant: ONNX Runtime and the server agree
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["hidden_states", "attention_mask", "temperature"]
    rng = np.random.default_rng(0)
    feeds = {"hidden_states": rng.standard_normal((2, 7, 32)).astype(np.float32),
             "attention_mask": np.array([[1] * 7, [1] * 4 + [0] * 3], dtype=np.int64),
             "temperature": np.array([0.5, 2.0], dtype=np.float32)}
    want = sess.run(None, feeds)[0]
    with running_server({"toy": model}) as server:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}")
        meta = client.get_model_metadata("toy")
        assert {"name": "temperature", "datatype": "FP32", "shape": [-1]} in meta["inputs"]
        got, _ = triton_infer(client, "toy", feeds)
        np.testing.assert_allclose(got["output"], want, atol=1e-5, rtol=0)
        with pytest.raises(Exception, match="temperature"):  # a 400 naming the input, server still up
            triton_infer(client, "toy", {**feeds, "temperature": np.ones((3,), np.float32)})
        again, _ = triton_infer(client, "toy", feeds)
        np.testing.assert_allclose(again["output"], want, atol=1e-5, rtol=0)

    # and placed in the real model from the command line (the original's tokenizer travels with it)
    from attnx import pretrained

    run = attnx("export", "--from-pretrained", str(pretrained.minilm_path()), "--variant", "toy",
                "--layers-replaced", "0,5", "-o", "minilm-toy.onnx", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    names = [i.name for i in ort.InferenceSession(str(tmp_path / "minilm-toy.onnx"),
                                                  providers=["CPUExecutionProvider"]).get_inputs()]
    assert names == ["input_ids", "attention_mask", "token_type_ids", "temperature"]
