"""GPT-2 checkpoints on attnx blocks (attnx.pretrained.gpt2) against transformers' GPT2LMHeadModel."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")  # a guard only: installed with attnx[dev]
from safetensors.torch import load_file, save_file  # noqa: E402

from attnx.models.encoder import Block  # noqa: E402
from attnx.pretrained.gpt2 import GPT2LM, load_gpt2  # noqa: E402

VOCAB, N_POS = 100, 64
transformers.logging.set_verbosity_error()


def _hf_model(seed: int = 0, **overrides):
    cfg = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=N_POS,
               bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg)).eval()
    # GPT-2's init (std 0.02) gives near-constant logits; larger weights make the
    # comparison meaningful (logits of order 1-10, peaky attention).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2")
    hf = _hf_model()
    hf.save_pretrained(folder, safe_serialization=True)
    return folder, hf


def _ids(batch=2, length=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=g)


def test_logits_match_transformers_without_mask(checkpoint):
    folder, hf = checkpoint
    lm = load_gpt2(folder)
    ids = _ids()
    want = hf(ids).logits
    got = lm(ids)
    assert got.shape == (2, 12, VOCAB)
    assert want.abs().max() > 1.0  # a non-trivial comparison
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("side", ["right", "left"])
def test_logits_match_transformers_with_padding_mask(checkpoint, side):
    folder, hf = checkpoint
    lm = load_gpt2(folder)
    ids = _ids()
    mask = torch.ones(2, 12, dtype=torch.long)
    if side == "right":
        mask[1, 8:] = 0
    else:
        mask[1, :4] = 0
    want = hf(ids, attention_mask=mask).logits
    got = lm(ids, mask)
    real = mask.bool()
    # Real tokens must agree; left-padded query rows have no key at all (we give zeros,
    # transformers a uniform row), so only real positions carry meaning.
    torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=0)
    if side == "right":
        # Right-padded query rows still see the earlier real keys: they match too.
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    else:
        # The mask matters: without it, left padding leaks into example 1's real tokens.
        assert (lm(ids)[1][real[1]] - want[1][real[1]]).abs().max() > 1e-2


def test_patterns_in_the_cache_equal_transformers_attentions(checkpoint):
    folder, hf = checkpoint
    lm = load_gpt2(folder)
    ids = _ids(length=10)
    logits, cache = lm.run_with_cache(ids, names_filter=lambda n: n.endswith("hook_pattern") or n == "hook_embed")
    out = hf(ids, output_attentions=True)
    assert sorted(cache) == ["blocks.0.attn.hook_pattern", "blocks.1.attn.hook_pattern", "hook_embed"]
    for i, attn in enumerate(out.attentions):
        torch.testing.assert_close(cache[f"blocks.{i}.attn.hook_pattern"], attn, atol=1e-5, rtol=0)
    torch.testing.assert_close(cache["hook_embed"], hf.transformer.wte(ids))
    torch.testing.assert_close(logits, out.logits, atol=1e-4, rtol=0)


def test_structure_tied_head_and_hook_names(checkpoint):
    folder, _ = checkpoint
    lm = load_gpt2(folder)
    assert isinstance(lm, GPT2LM) and all(isinstance(b, Block) for b in lm.blocks)
    assert lm.tied and lm.lm_head.weight is lm.wte.weight
    assert not lm.training
    blk = lm.blocks[0]
    assert blk.attn.config.is_causal and blk.mlp.approximate == "tanh" and blk.variant == "mha"
    # One naming scheme: the TransformerLens names, whatever wraps the blocks.
    assert {"hook_embed", "hook_pos_embed", "blocks.1.attn.hook_pattern", "blocks.0.hook_resid_post"} <= \
        set(lm.hook_points())
    # Ablating a head through run_with_hooks changes the logits; the hook is gone afterwards.
    ids = _ids(batch=1, length=6)
    base = lm(ids)

    def zero_head(z, hook):
        z = z.clone()
        z[:, :, 2] = 0
        return z

    ablated = lm.run_with_hooks(ids, fwd_hooks=[("blocks.0.attn.hook_z", zero_head)])
    assert (ablated - base).abs().max() > 1e-3
    torch.testing.assert_close(lm(ids), base, atol=0, rtol=0)


def test_untied_head_is_loaded(tmp_path):
    hf = _hf_model(seed=3, tie_word_embeddings=False)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    assert "lm_head.weight" in load_file(str(tmp_path / "model.safetensors"))
    lm = load_gpt2(tmp_path)
    assert not lm.tied
    ids = _ids()
    torch.testing.assert_close(lm(ids), hf(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("options", [{"scale_attn_by_inverse_layer_idx": True}, {"scale_attn_weights": False},
                                     {"n_inner": 128, "activation_function": "gelu"}])
def test_config_options_match(tmp_path, options):
    hf = _hf_model(seed=4, **options)
    with torch.no_grad():  # keep softmax inputs moderate without the 1/sqrt(Dh) scale
        for blk in hf.transformer.h:
            blk.attn.c_attn.weight.mul_(0.3)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    lm = load_gpt2(tmp_path)
    ids = _ids()
    torch.testing.assert_close(lm(ids), hf(ids).logits, atol=1e-4, rtol=0)


def test_original_gpt2_names_without_prefix(tmp_path, checkpoint):
    # The original gpt2 checkpoints have no "transformer." prefix and carry attn.bias buffers.
    folder, hf = checkpoint
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(str(folder / "model.safetensors")).items()}
    for i in range(2):
        tensors[f"h.{i}.attn.bias"] = torch.ones(1, 1, N_POS, N_POS).tril()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    ids = _ids()
    torch.testing.assert_close(load_gpt2(tmp_path)(ids), hf(ids).logits, atol=1e-4, rtol=0)


def test_tokenizer_json_is_loaded(tmp_path, checkpoint):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    folder, _ = checkpoint
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    words = ["<pad>", "the", "cat", "sat", "on", "mat", "[UNK]"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    tok.save(str(tmp_path / "tokenizer.json"))
    lm = load_gpt2(tmp_path)
    assert lm.tokenizer is not None
    ids = lm.encode("the cat sat on the mat")
    assert ids.tolist() == [[1, 2, 3, 4, 1, 5]]
    assert lm.to_text(ids) == "the cat sat on the mat"
    assert lm.to_str_tokens("the cat") == ["the", "cat"]
    batch, mask = lm.encode_batch(["the cat", "the cat sat"])
    assert batch.tolist() == [[1, 2, 0], [1, 2, 3]] and mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert lm(batch, mask).shape == (2, 3, VOCAB)
    assert load_gpt2(folder).tokenizer is None
    with pytest.raises(ValueError, match="tokenizer"):
        load_gpt2(folder).encode("the cat")


# --------------------------------------------------------------------------- errors


def _copy(src, dst, skip=()):
    for p in src.iterdir():
        if p.name not in skip:
            (dst / p.name).write_bytes(p.read_bytes())


def test_missing_folder_and_files(tmp_path, checkpoint):
    folder, _ = checkpoint
    with pytest.raises(FileNotFoundError, match="no model folder"):
        load_gpt2(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_gpt2(tmp_path)
    _copy(folder, tmp_path, skip=("model.safetensors",))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_gpt2(tmp_path)


def test_non_gpt2_config(tmp_path, checkpoint):
    folder, _ = checkpoint
    _copy(folder, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "bert"}))
    with pytest.raises(ValueError, match="model_type is 'bert'"):
        load_gpt2(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "activation_function": "relu"}))
    with pytest.raises(ValueError, match="activation_function"):
        load_gpt2(tmp_path)


def test_mismatching_tensors(tmp_path, checkpoint):
    folder, _ = checkpoint
    _copy(folder, tmp_path)
    good = load_file(str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    st = tmp_path / "model.safetensors"

    bad = dict(good)
    bad["transformer.h.1.mlp.c_fc.weight"] = torch.zeros(64, 100)
    save_file(bad, str(st))
    with pytest.raises(ValueError, match=r"blocks\.1\.mlp\.fc_in\.weight"):
        load_gpt2(tmp_path)

    bad = dict(good)
    bad["transformer.h.0.attn.c_attn.weight"] = torch.zeros(64, 64)
    save_file(bad, str(st))
    with pytest.raises(ValueError, match="c_attn"):
        load_gpt2(tmp_path)

    bad = {k: v for k, v in good.items() if k != "transformer.h.1.ln_2.bias"}
    save_file(bad, str(st))
    with pytest.raises(ValueError, match=r"lacks tensor 'h\.1\.ln_2\.bias'"):
        load_gpt2(tmp_path)

    save_file({**good, "transformer.h.2.ln_1.weight": torch.ones(64)}, str(st))
    with pytest.raises(ValueError, match=r"unexpected tensor.*h\.2\.ln_1\.weight"):
        load_gpt2(tmp_path)

    save_file(good, str(st))  # config says 3 layers, the file has 2
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "n_layer": 3}))
    with pytest.raises(ValueError, match="lacks tensor 'h.2"):
        load_gpt2(tmp_path)


def test_input_errors(checkpoint):
    lm = load_gpt2(checkpoint[0])
    with pytest.raises(ValueError, match="n_positions"):
        lm(torch.zeros(1, N_POS + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids"):
        lm(torch.zeros(1, 4))
