"""A model folder from a stranger (issue 26, items 4-8): nothing outside the folder is read or shipped,
odd weights and absurd configs are refused in one line before anything big is built, remote code is
never run, and a failed export leaves nothing half-written."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import hf_folders  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from attnx import pretrained  # noqa: E402
from attnx.export.pretrained import export_pretrained  # noqa: E402


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return hf_folders.make_folder("bert", tmp_path_factory.mktemp("hostile"))


@pytest.fixture
def folder(source, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(source, copy)
    return copy


def test_a_shard_outside_the_folder_is_refused(folder, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    save_file(tensors, str(tmp_path / "outside.safetensors"))
    index = {"metadata": {}, "weight_map": {name: "../outside.safetensors" for name in tensors}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"shard '\.\./outside\.safetensors' is not a file name of the folder"):
        pretrained.load(folder)
    index["weight_map"] = {name: str(tmp_path / "outside.safetensors") for name in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="is not a file name of the folder"):
        pretrained.load(folder)


def test_a_link_leaving_the_folder_is_never_followed(folder, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("password=hunter2\n")
    (folder / "vocab.txt").symlink_to(secret)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"vocab.txt: points outside the model folder"):
        export_pretrained(folder, out / "m.onnx")
    assert not out.exists() or not any("hunter2" in p.read_text(errors="ignore") for p in out.rglob("*") if p.is_file())
    (folder / "vocab.txt").unlink()
    (folder / "model.safetensors").rename(tmp_path / "weights.safetensors")
    (folder / "model.safetensors").symlink_to(tmp_path / "weights.safetensors")
    with pytest.raises(ValueError, match=r"model.safetensors: points outside the model folder"):
        pretrained.load(folder)


def test_a_hub_cache_snapshot_links_into_its_own_blobs(source, tmp_path):
    """The one kind of link that is fine: huggingface_hub's cache (snapshots/<hash>/x -> ../../blobs/<sha>)."""
    repo = tmp_path / "models--someone--bert"
    snap, blobs = repo / "snapshots" / ("0" * 40), repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in source.iterdir():
        if f.is_file():
            (blobs / f.name).write_bytes(f.read_bytes())
            (snap / f.name).symlink_to(Path("../../blobs") / f.name)
    shutil.copytree(source / "1_Pooling", snap / "1_Pooling")
    folder = pretrained.read_folder(snap)
    assert folder.name == "bert" and pretrained.load(folder).variant == "mha"


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool])
def test_weights_of_the_wrong_dtype_are_refused(folder, dtype):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    name = next(k for k in tensors if k.endswith("attention.self.query.weight"))
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"weight {name} is (I8|BOOL), expected a float tensor"):
        pretrained.load(folder)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("hidden_size", 10 ** 9, r"hidden_size must be an integer in \[1, 65536\], got 1000000000"),
    ("num_hidden_layers", 100000, r"num_hidden_layers must be an integer in \[1, 1024\], got 100000"),
    ("vocab_size", 0, r"vocab_size must be an integer in \[1, 8388608\], got 0"),
    ("max_position_embeddings", -1, r"max_position_embeddings must be an integer in \[1, 16777216\], got -1"),
    ("num_attention_heads", "12", r"num_attention_heads must be an integer"),
])
def test_absurd_configs_are_one_line_at_once(folder, key, value, message):
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, key: value}))
    started = time.monotonic()
    with pytest.raises(ValueError, match=message):
        pretrained.load(folder)
    assert time.monotonic() - started < 10  # refused from the numbers, before anything is built


def test_remote_code_is_ignored_and_said(folder, tmp_path):
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "evil.py").write_text("raise SystemExit('remote code ran')\n")
    (folder / "config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoModel": "evil.EvilModel"}}))
    result = export_pretrained(folder, tmp_path / "m.onnx")
    assert any("auto_map (remote code) is ignored" in n for n in result.notes)
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "evil", "auto_map": {"AutoModel": "evil.X"}}))
    with pytest.raises(ValueError, match=r"model_type 'evil' is not a transformers family \(its auto_map names remote "
                                         r"code, which attnx never runs\)"):
        pretrained.load(folder)


@pytest.mark.parametrize(("file", "content"), [("tokenizer.json", "{not json"),
                                               ("tokenizer_config.json", "{\"truncation_side\": \"middle\"}")])
def test_a_failed_tokenizer_copy_leaves_nothing_behind(folder, tmp_path, file, content):
    (folder / file).write_text(content)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError):
        export_pretrained(folder, out / "m.onnx")
    assert list(out.iterdir()) == []  # no .m.tokenizer.tmp/, no m.onnx, no m.safetensors
