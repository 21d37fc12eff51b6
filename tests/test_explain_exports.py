"""Attention outputs and the head mask in exports (issue 13, item 1): every variant's ``attentions.{i}``
equal ``run_with_cache`` patterns, a masked head equals the torch model with that head ablated,
BERT-family / GPT-2 / the real MiniLM equal transformers (its attentions, and the model with the
head's output-projection columns zeroed), plain exports are unchanged, engines keep the outputs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from explain_fixtures import MINILM, ablate_columns, explained_minilm, ort_run  # noqa: E402

from attnx.contract import ModelInfo  # noqa: E402
from attnx.export import export_encoder, export_variant  # noqa: E402
from attnx.export.pretrained import export_pretrained  # noqa: E402
from attnx.models.hooks import run_with_cache  # noqa: E402
from attnx.models import VARIANTS, build_encoder  # noqa: E402
from attnx.models.signature import example_tensor  # noqa: E402

import transformers
from support.cli import run as attnx
transformers.logging.set_verbosity_error()
SMALL = {"d_model": 32, "n_heads": 4}
B, L = 3, 7


def _feeds(model, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    feeds = {s.name: example_tensor(s, {"batch": B, "seq": L}, g) for s in model.input_specs()}
    feeds["attention_mask"] = torch.ones(B, L, dtype=torch.int64)
    feeds["attention_mask"][1, 5:] = 0  # right padding
    feeds["attention_mask"][2, 3:] = 0
    return feeds


@pytest.fixture(scope="module")
def variant_exports(tmp_path_factory):
    folder = tmp_path_factory.mktemp("attn-out")
    return {v: export_variant(v, folder / f"{v}.onnx", overrides=SMALL, n_layers=2, attention_outputs="all",
                              head_mask=True, seed=1) for v in VARIANTS}


@pytest.mark.parametrize("variant", VARIANTS)
def test_attention_outputs_equal_run_with_cache_patterns(variant, variant_exports):
    result = variant_exports[variant]
    info = ModelInfo.read(result.path)
    assert info.output_names[-2:] == ["attentions.0", "attentions.1"]
    assert info.output("attentions.1").shape == ("batch", 4, "seq", "seq")
    assert info.input("head_mask").shape == (2, 4) and info.input("head_mask").role == "head_mask"
    encoder = result.model.model  # the bare encoder inside the attention-output wrapper
    feeds = _feeds(encoder)
    context = {k: v for k, v in feeds.items() if k not in ("hidden_states", "attention_mask")}
    _, cache = run_with_cache(encoder, feeds["hidden_states"], feeds["attention_mask"],
                              names_filter=lambda n: n.endswith("hook_pattern"), **context)
    got = ort_run(result.path, {**feeds, "head_mask": torch.ones(2, 4)})
    real = feeds["attention_mask"].bool().numpy()
    for layer in range(2):
        want = cache[f"blocks.{layer}.attn.hook_pattern"].numpy()
        rows = real[:, None, :, None] & np.ones_like(want, dtype=bool)  # padded query rows carry no meaning
        err = np.abs(got[f"attentions.{layer}"] - want)[rows]
        assert err.max() <= 1e-5, (variant, layer, err.max())
        assert want.max() > 0.3  # not a uniform pattern: the comparison is informative
    np.testing.assert_allclose(got["output"][real], encoder(**feeds).detach().numpy()[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_masked_head_equals_the_torch_model_with_that_head_ablated(variant, variant_exports):
    result = variant_exports[variant]
    encoder = result.model.model
    feeds = _feeds(encoder, seed=1)
    real = feeds["attention_mask"].bool().numpy()
    plain = ort_run(result.path, {**feeds, "head_mask": torch.ones(2, 4)})["output"]
    for layer, head in ((0, 1), (1, 3)):
        mask = torch.ones(2, 4)
        mask[layer, head] = 0
        got = ort_run(result.path, {**feeds, "head_mask": mask})
        with torch.no_grad():
            want = encoder(**feeds, head_mask=mask).numpy()
        assert np.abs(got["output"] - want)[real].max() <= 1e-5
        assert np.abs(got["output"] - plain)[real].max() > 1e-3  # the head mattered


def test_chosen_layers_only_and_plain_exports_unchanged(tmp_path):
    model = build_encoder("mha", n_layers=3, seed=0, **SMALL)
    before = export_encoder(model, tmp_path / "before.onnx", save_weights=False)
    some = export_encoder(model, tmp_path / "some.onnx", save_weights=False, attention_outputs="0,2")
    after = export_encoder(model, tmp_path / "after.onnx", save_weights=False)
    assert ModelInfo.read(some.path).output_names == ["output", "attentions.0", "attentions.2"]
    assert "head_mask" not in ModelInfo.read(some.path).input_names
    g_before, g_after = (onnx.load(str(p.path)).graph for p in (before, after))
    # The same graph as an export that never met the attention-output wrapper (no hook left behind).
    assert g_before.SerializeToString() == g_after.SerializeToString()
    assert [o.name for o in g_before.output] == ["output"] and [i.name for i in g_before.input] == [
        "hidden_states", "attention_mask"]
    ops = [n.op_type for n in g_before.node]
    assert ops.count("Attention") == 3 and "Softmax" not in ops  # still the fused attention op
    feeds = _feeds(model)
    np.testing.assert_allclose(ort_run(some.path, feeds)["output"], ort_run(before.path, feeds)["output"],
                               atol=1e-5, rtol=0)


def test_export_errors_are_one_line(tmp_path):
    for value, needle in (("7", "layer 7 out of range: the model has 2 layers"), ("x,1", "expected all or layer")):
        res = attnx("export", "--variant", "mha", "--set", "d_model=32", "--set", "n_heads=4", "--attention-outputs",
                    value, "-o", str(tmp_path / "x.onnx"))
        assert res.returncode != 0 and needle in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
        assert not (tmp_path / "x.onnx").exists()


# ----------------------------------------------------------------------------- real models vs transformers


def _bert_check(folder, hf, feeds, tmp_path, atol=1e-5):
    result = export_pretrained(folder, tmp_path / "bert.onnx", attention_outputs="all", head_mask=True)
    n_layers, n_heads = hf.config.num_hidden_layers, hf.config.num_attention_heads
    head_dim = hf.config.hidden_size // n_heads
    real = feeds["attention_mask"].bool().numpy()
    got = ort_run(result.path, {**feeds, "head_mask": torch.ones(n_layers, n_heads)})
    with torch.no_grad():
        want = hf(**feeds, output_attentions=True)
    for layer, att in enumerate(want.attentions):
        err = np.abs(got[f"attentions.{layer}"] - att.numpy())[np.broadcast_to(real[:, None, :, None], att.shape)]
        assert err.max() <= atol, (layer, err.max())
    layer, head = n_layers - 1, 1
    mask = torch.ones(n_layers, n_heads)
    mask[layer, head] = 0
    ablated_out = ort_run(result.path, {**feeds, "head_mask": mask})["last_hidden_state"]
    ablate_columns(hf.encoder.layer[layer].attention.output.dense, head, head_dim)
    with torch.no_grad():
        ablated_hf = hf(**feeds).last_hidden_state.numpy()
    assert np.abs(ablated_out - ablated_hf)[real].max() <= 1e-4
    assert np.abs(ablated_out - got["last_hidden_state"])[real].max() > 1e-3


def test_real_minilm_attentions_and_ablation_equal_transformers(tmp_path):
    from tokenizers import Tokenizer

    from attnx.pretrained.sentences import SENTENCES

    hf = transformers.BertModel.from_pretrained(str(MINILM), local_files_only=True, attn_implementation="eager").eval()
    tok = Tokenizer.from_file(str(MINILM / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(256)
    encs = tok.encode_batch(list(SENTENCES[:6]))
    n = max(len(e.ids) for e in encs)
    ids, mask = torch.zeros(len(encs), n, dtype=torch.int64), torch.zeros(len(encs), n, dtype=torch.int64)
    for i, e in enumerate(encs):
        ids[i, :len(e.ids)], mask[i, :len(e.ids)] = torch.tensor(e.ids), 1
    _bert_check(MINILM, hf, {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)},
                tmp_path, atol=1e-5)


def test_small_bert_and_gpt2_folders_equal_transformers(tmp_path):
    bert_dir, gpt_dir = tmp_path / "bert", tmp_path / "gpt2"
    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=200, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
        max_position_embeddings=32, attn_implementation="eager")).eval()
    gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=48, n_head=4, vocab_size=200, n_positions=32, attn_implementation="eager")).eval()
    for model in (bert, gpt):
        with torch.no_grad():  # larger than the init: peaky attention, a meaningful comparison
            for name, p in model.named_parameters():
                p.copy_((1 + 0.2 * torch.randn_like(p)) if ("LayerNorm.weight" in name or ".ln_" in name and
                                                              name.endswith("weight")) else 0.3 * torch.randn_like(p))
    bert.save_pretrained(bert_dir)
    gpt.save_pretrained(gpt_dir)
    ids = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 9, dtype=torch.int64)
    mask[1, 6:] = 0
    _bert_check(bert_dir, bert, {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)},
                tmp_path)
    result = export_pretrained(gpt_dir, tmp_path / "gpt2.onnx", attention_outputs="all", head_mask=True)
    real = mask.bool().numpy()
    got = ort_run(result.path, {"input_ids": ids, "attention_mask": mask, "head_mask": torch.ones(2, 4)})
    with torch.no_grad():
        want = gpt(input_ids=ids, attention_mask=mask, output_attentions=True)
    for layer, att in enumerate(want.attentions):
        rows = np.broadcast_to(real[:, None, :, None], att.shape)
        assert np.abs(got[f"attentions.{layer}"] - att.numpy())[rows].max() <= 1e-5
    head_mask = torch.ones(2, 4)
    head_mask[0, 2] = 0
    ablated = ort_run(result.path, {"input_ids": ids, "attention_mask": mask, "head_mask": head_mask})["logits"]
    with torch.no_grad():  # GPT-2's c_proj is a Conv1D ([in, out]): the head's input rows
        gpt.transformer.h[0].attn.c_proj.weight[2 * 12:3 * 12, :] = 0
        ablated_hf = gpt(input_ids=ids, attention_mask=mask).logits.numpy()
    assert np.abs(ablated - ablated_hf)[real].max() <= 1e-4
    assert np.abs(ablated - got["logits"])[real].max() > 1e-2


# ----------------------------------------------------------------------------- engines keep them


@pytest.mark.rtx
def test_engine_keeps_attention_outputs_and_head_mask(variant_exports, plugin_lib, tmp_path):
    from attnx import engine as eng

    for variant in ("mha", "smal"):
        res = variant_exports[variant]
        built = eng.build(res.path, tmp_path / f"{variant}.engine", target="sm89")
        side = json.loads((tmp_path / f"{variant}.engine.json").read_text())
        assert side == built.sidecar
        outputs = {o["name"]: o for o in side["outputs"]}
        for layer in (0, 1):
            assert outputs[f"attentions.{layer}"]["shape"] == ["batch", 4, "seq", "seq"]
            assert outputs[f"attentions.{layer}"]["dtype"] == "float32"
        inputs = {i["name"]: i for i in side["inputs"]}
        assert inputs["head_mask"]["shape"] == [2, 4] and inputs["head_mask"]["role"] == "head_mask"
        assert built.inlined_custom_nodes == 0


def test_explained_minilm_has_everything():
    result = explained_minilm()
    info = ModelInfo.read(result.path)
    assert [n for n in info.output_names if n.startswith("attentions.")] == [f"attentions.{i}" for i in range(6)]
    assert info.input("head_mask").shape == (6, 12)
