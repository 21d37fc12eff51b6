"""Everything downstream of an export keeps working on the transformers-hosted families (issue 22,
item 5), shown on a decoder with grouped-query attention and RoPE (Qwen3) and an encoder with local
and global RoPE attention (ModernBERT):

- fp16 and int8 exports pass ``attnx check`` against the original model;
- ``--attention-outputs`` equals transformers' own eager attention weights, and ``--head-mask``
  ablation equals the torch reference with that head's output zeroed;
- ``attnx explain`` (per-head analysis, ablation ranking, activation patching) runs on the folder
  and on the export with TransformerLens' hook names;
- ``attnx triton-repo`` writes a repository whose configs pass Triton's schema.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import hf_folders  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402
transformers.logging.set_verbosity_error()

FAMILIES = ["qwen3", "modernbert"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("downstream")
    return {name: hf_folders.make_folder(name, root) for name in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_fp16_and_int8_exports_pass_check_against_the_original(family, precision, folders, tmp_path):
    from attnx.export.pretrained import export_pretrained
    from attnx.export.quantize import quantize_file
    from attnx.parity.check import run_check

    result = export_pretrained(folders[family], tmp_path / f"{family}.onnx", variant="cultural",
                               fp16=precision == "fp16")
    if precision == "int8":
        quantize_file(result.path, result.path)
    report = run_check(result.path, workdir=tmp_path)
    assert report.precision == precision and report.passed, report.to_json()
    assert report.original["used"], report.original["note"]


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_outputs_and_head_mask_equal_transformers_and_the_reference(family, folders, tmp_path):
    import onnxruntime as ort

    from attnx.export.pretrained import export_pretrained
    from attnx.pretrained.host import TASKS, positions_from_mask

    folder = folders[family]
    result = export_pretrained(folder, tmp_path / f"{family}-ao.onnx", variant="smal", attention_outputs="all",
                               head_mask=True)
    host = result.model.model  # WithAttentionOutputs around the host
    n_layers, heads = len(host.blocks), host.n_heads
    g = np.random.default_rng(0)
    ids = g.integers(4, host.vocab_size, (2, 11))
    mask = np.ones((2, 11), np.int64)
    if host.causal:
        mask[1, :3] = 0
    else:
        mask[1, 8:] = 0
    dh = host.blocks[0].config.head_dim
    feeds = {"input_ids": ids, "attention_mask": mask, "self_state": g.standard_normal((2, 32)).astype(np.float32),
             "trace": g.standard_normal((2, dh, dh)).astype(np.float32), "head_mask": np.ones((n_layers, heads), np.float32)}
    sess = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    got = dict(zip(names, sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})))
    eager = getattr(transformers, TASKS[host.task]).from_pretrained(str(folder), attn_implementation="eager").eval()
    kwargs = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}
    if host.causal:
        kwargs["position_ids"] = positions_from_mask(kwargs["attention_mask"])
    with torch.no_grad():
        attentions = eager(**kwargs, output_attentions=True).attentions
    rows = mask.astype(bool)[:, None, :, None]
    for i in range(n_layers):
        pattern = got[f"attentions.{i}"]
        assert pattern.shape == (2, heads, 11, 11)
        err = np.abs(pattern - attentions[i].numpy())[np.broadcast_to(rows, pattern.shape)]
        assert err.max() <= 1e-5, (i, err.max())
    # ablate layer 1 head 2: ONNX Runtime equals the torch reference with that head's output zeroed
    ablated = dict(feeds, head_mask=feeds["head_mask"].copy())
    ablated["head_mask"][1, 2] = 0
    out = names[0]
    onnx_ablated = sess.run([out], {i.name: ablated[i.name] for i in sess.get_inputs()})[0]
    with torch.no_grad():
        want = result.model.forward_named({k: torch.from_numpy(v) for k, v in ablated.items()})[out].numpy()
    real = mask.astype(bool) if onnx_ablated.ndim == 3 else slice(None)
    assert np.abs(onnx_ablated - want)[real].max() <= 1e-4
    assert np.abs(onnx_ablated - got[out])[real].max() > 1e-3  # the head mattered


@pytest.mark.parametrize("family", FAMILIES)
def test_explain_runs_on_the_folder_and_the_export_with_hook_names(family, folders, tmp_path):
    from attnx.export.pretrained import export_pretrained
    from attnx.explain.explanation import explain
    from attnx.interp.patching import ablation_table
    from attnx.interp.source import open_source

    folder = folders[family]
    texts = ["the cat sat on the mat", "a man is playing a guitar"]
    torch_source = open_source(folder)  # transformers' own model, mha placed, every layer's pattern
    n_layers, n_heads = torch_source.facts.n_layers, torch_source.facts.n_heads
    report = explain(torch_source, texts)
    assert {(b.layer, b.head) for b in report.behaviors} == {(i, h) for i in range(n_layers) for h in range(n_heads)}
    batch = torch_source.require_text().encode(texts)
    table = ablation_table(torch_source, batch, 1)  # ablation and activation patching (hook_embed, hook_z)
    assert sorted(table.ranking) == list(range(n_heads)) and table.patching
    result = export_pretrained(folder, tmp_path / f"{family}-explain.onnx", attention_outputs="all", head_mask=True)
    deployed = open_source(result.path)
    # A decoder's analysis counts only the keys causality allows (the chance level), read from the task;
    # byte-level BPE tokens (both folders' tokenizers) are shown decoded (" cat"), not as stored ("Ġcat").
    causal = family == "qwen3"
    assert torch_source.facts.is_causal == causal and deployed.facts.is_causal == causal
    assert hf_folders.FAMILIES[family].tokenizer == "bpe"
    shown = [t for ts in deployed.require_text().encode(texts).tokens for t in ts]
    assert " cat" in shown and not any("\u0120" in t for t in shown)
    on_file = explain(deployed, texts)
    for i in range(n_layers):  # the deployed file's patterns are the torch model's
        assert np.abs(on_file.patterns[i] - report.patterns[i]).max() <= 1e-5
    both = ablation_table(deployed, deployed.require_text().encode(texts), 1, reference=torch_source)
    deployed_col, torch_col = both.columns[0], both.columns[1]
    for row in both.rows:
        assert abs(row[deployed_col] - row[torch_col]) <= 1e-4 * max(1.0, abs(row[torch_col]))


@pytest.mark.parametrize("family", FAMILIES)
def test_triton_repository_of_a_family_export(family, folders, tmp_path):
    from attnx.deploy.repository import write_repository
    from attnx.export.pretrained import export_pretrained

    result = export_pretrained(folders[family], tmp_path / f"{family}.onnx", variant="smal")
    repo = write_repository(result.path, tmp_path / "repo", name=family, validate=True)
    assert repo.validated and repo.text is not None  # the tokenizer + model ensemble of a text model
    assert (repo.models[family] / "config.pbtxt").is_file()
