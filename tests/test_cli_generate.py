"""`attnx export --with-past`, `attnx generate` and `attnx build-engine` on a with-past file, through the
command line (in process): the streamed text is what the runtime generates in process (itself equal to transformers'
greedy ``generate``, test_generation.py), bad flags are one line, an engine builds with a past-length profile."""

from __future__ import annotations

import json

import pytest

import generation_fixtures as gf
from support.cli import run as attnx

PROMPT = "the cat sat on the mat"


def test_export_with_past_then_generate(tmp_path):
    source = gf.folder("gpt2")
    proc = attnx("export", "--from-pretrained", str(source), "--variant", "smal", "--with-past", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    path = tmp_path / "attnx-out" / "gpt2-smal-with-past" / "model.onnx"
    assert proc.stdout.strip().splitlines()[-1] == "attnx-out/gpt2-smal-with-past/model.onnx"
    assert (path.parent / "genai_config.json").is_file() and (path.parent / "model.tokenizer").is_dir()
    assert "onnxruntime-genai cannot run this file" in proc.stdout and "key_term" in proc.stdout
    info = json.loads(attnx("inspect", str(path), "--json").stdout)
    names = [i["name"] for i in info["inputs"]]
    assert names[:3] == ["input_ids", "attention_mask", "position_ids"] and "past_key_values.1.key_term" in names
    assert info["inputs"][1]["shape"] == ["batch", "total"]

    from attnx.runtime import TextModel

    want = "".join(TextModel(path).generate(PROMPT, max_new_tokens=8))
    proc = attnx("generate", str(path.parent), PROMPT, "-n", "8", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == want + "\n"
    assert "tokens (" in proc.stderr and "ms/token" in proc.stderr
    seeded = [attnx("generate", str(path), PROMPT, "-n", "8", "--temperature", "0.9", "--top-k", "20", "--seed", "3",
                    cwd=tmp_path).stdout for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_generate_exports_a_hugging_face_folder_on_first_use(tmp_path):
    source = gf.folder("llama")
    proc = attnx("generate", str(source), PROMPT, "-n", "6", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "exporting" in proc.stderr and (tmp_path / "attnx-out" / "llama-mha-with-past" / "model.onnx").is_file()
    again = attnx("generate", str(source), PROMPT, "-n", "6", cwd=tmp_path)
    assert "exported earlier" in again.stderr and again.stdout == proc.stdout

    from attnx.runtime import TextModel

    assert proc.stdout == "".join(TextModel(tmp_path / "attnx-out" / "llama-mha-with-past").generate(
        PROMPT, max_new_tokens=6)) + "\n"


@pytest.mark.parametrize("args,message", [(["-n", "0"], "max_new_tokens must be >= 1"),
                                          (["--top-p", "1.5"], "--top-p"),
                                          (["--temperature", "-1"], "--temperature")])
def test_bad_flags_are_one_line(args, message):
    path = gf.export(gf.folder("llama"), "mha")
    proc = attnx("generate", str(path), PROMPT, *args)
    assert proc.returncode != 0 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_full_sequence_export_cannot_generate(tmp_path):
    out = tmp_path / "full.onnx"
    assert attnx("export", "--from-pretrained", str(gf.folder("llama")), "-o", str(out)).returncode == 0
    proc = attnx("generate", str(out), PROMPT)
    assert proc.returncode != 0 and "--with-past" in proc.stderr
    proc = attnx("export", "--variant", "mha", "--with-past", "-o", str(tmp_path / "x.onnx"))
    assert proc.returncode != 0 and "--from-pretrained" in proc.stderr
    proc = attnx("export", "--from-pretrained", str(gf.folder("bert")), "--with-past", "-o",
                 str(tmp_path / "b" / "model.onnx"))
    assert proc.returncode != 0 and "causal LM" in proc.stderr


@pytest.mark.rtx
def test_build_engine_on_a_with_past_export(tmp_path):
    """TensorRT-RTX builds the decoder with profiles for the cache's axes (past 1..positions); `attnx check`
    verifies the ONNX file and says the engine could not run here (no GPU)."""
    path = gf.export(gf.folder("llama"), "mha")
    engine = tmp_path / "llama.engine"
    proc = attnx("build-engine", str(path), "-o", str(engine))
    assert proc.returncode == 0, proc.stderr
    sidecar = json.loads(engine.with_name(engine.name + ".json").read_text())
    assert sidecar["profiles"]["past"] == [1, 64, 64] and sidecar["profiles"]["total"] == [2, 65, 65]
    assert {b["name"] for b in sidecar["inputs"]} >= {"past_key_values.0.key", "attention_mask"}
    proc = attnx("check", str(path), "--engine", str(engine), cwd=tmp_path)
    assert proc.returncode in (0, 3), proc.stdout + proc.stderr
    assert "PASS" in proc.stdout or "engine not run here" in proc.stdout


def test_the_fp16_file_of_a_with_past_export_agrees_with_fp32_on_a_cached_step(tmp_path):
    """The fp16 conversion `attnx build-engine --fp16` makes of a decoder with its cache (attention in fp16 there:
    TensorRT-RTX 1.7 cannot fuse an fp32 attention whose k/v are also graph outputs) computes what the fp32 file
    does on a left-padded cached step, to fp16's precision (ONNX Runtime)."""
    import numpy as np
    import onnxruntime as ort

    from attnx.engine.fp16 import ensure_fp16

    path = gf.export(gf.folder("llama"), "mha")
    half, _ = ensure_fp16(path, tmp_path / "model-fp16.onnx")
    s32, s16 = ort.InferenceSession(str(path)), ort.InferenceSession(str(half))
    rng = np.random.default_rng(0)
    batch, past, new = 2, 5, 3
    feeds = {"input_ids": rng.integers(3, 100, (batch, new)), "attention_mask": np.ones((batch, past + new), np.int64),
             "position_ids": np.tile(np.arange(past, past + new), (batch, 1))}
    feeds["attention_mask"][1, :2] = 0  # row 1 left-padded by two slots
    feeds["position_ids"][1] -= 2
    for i in s32.get_inputs():
        if i.name.startswith("past_key_values."):
            feeds[i.name] = rng.standard_normal((batch, i.shape[1], past, i.shape[3])).astype(np.float32)
    want = s32.run(None, feeds)
    got = s16.run(None, {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in feeds.items()})
    assert [i.type for i in s16.get_inputs() if i.name.startswith("past_")][0] == "tensor(float16)"
    for out, a, b in zip(s32.get_outputs(), want, got):
        err = float(np.abs(a - b.astype(np.float32)).max())
        assert err <= 2e-2 * max(1.0, float(np.abs(a).max())), (out.name, err)


@pytest.mark.rtx
def test_build_engine_fp16_on_a_with_past_export(tmp_path):
    from attnx.engine.fp16 import ensure_fp16

    half, _ = ensure_fp16(gf.export(gf.folder("llama"), "smal"), tmp_path / "model-fp16.onnx")
    engine = tmp_path / "llama16.engine"
    proc = attnx("build-engine", str(half), "-o", str(engine))
    assert proc.returncode == 0, proc.stderr
    sidecar = json.loads(engine.with_name(engine.name + ".json").read_text())
    assert sidecar["profiles"]["past"][0] == 1 and {b["dtype"] for b in sidecar["inputs"]
                                                      if b["name"].startswith("past_key_values.")} == {"float16"}
