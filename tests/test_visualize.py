"""Attention visualisation (attnx.interp.visualize): self-contained HTML, PNG heatmaps."""

from __future__ import annotations

import json
import re
import subprocess

import numpy as np
import pytest
import torch

import matplotlib  # noqa: E402,F401
from PIL import Image  # noqa: E402  (matplotlib depends on pillow)

from attnx.models import build_encoder  # noqa: E402
from attnx.explain.analysis import analyze_cache  # noqa: E402
from attnx.models.hooks import run_with_cache  # noqa: E402
from attnx.interp.visualize import (  # noqa: E402
    attention_html,
    default_figsize,
    save_attention_html,
    save_attention_png,
    save_layer_pngs,
    visualize_text,
)

TOKENS = ["The", "cat", "sat", "on", "the", "mat", "$x$", "</script><b>&"]
L = len(TOKENS)


@pytest.fixture(scope="module")
def cache():
    torch.manual_seed(0)
    enc = build_encoder("mha", n_layers=2, d_model=32, n_heads=4, is_causal=True)
    _, c = run_with_cache(enc, torch.randn(1, L, 32) * 3)
    return c


def _data(html: str) -> dict:
    m = re.search(r'<script type="application/json" id="attnx-data">(.*?)</script>', html, re.S)
    assert m, "no embedded data block"
    return json.loads(m.group(1))


def _map(data: dict, layer: int, head: int, example: int = 0) -> torch.Tensor:
    """One head's weights as the page stores them (thousandths)."""
    n = len(data["examples"][example]["tokens"])
    flat = data["maps"]["A"][example][data["layers"].index(layer)][head]
    return torch.tensor(flat, dtype=torch.float64).reshape(n, n) / data["scale"]


def test_html_is_self_contained_and_holds_tokens_and_weights(cache):
    behaviors = analyze_cache(cache, is_causal=True)
    html = attention_html(TOKENS, cache, layers=[1], heads=[0, 2], behaviors=behaviors)
    # No network: no URL, no external script/style/image.
    assert not re.search(r"https?:|//[a-z0-9]", html.replace("http://www.w3.org/2000/svg", ""), re.I)
    assert not re.search(r"<(link|img|iframe)\b|\bsrc\s*=|@import|url\(|fetch\(|XMLHttpRequest", html, re.I)
    assert html.count("<script") == 2 and html.count("</script>") == 2  # data + code; the token cannot break out
    assert "<style>" in html
    data = _data(html)
    assert data["examples"][0]["tokens"] == TOKENS and data["layers"] == [1] and data["n_heads"] == 4
    for head in range(4):
        want = cache["blocks.1.attn.hook_pattern"][0, head].double()
        assert (_map(data, 1, head) - want).abs().max() <= 5.1e-4  # stored in thousandths
    rows = data["analysis"]["A"]
    assert [(r["layer"], r["head"]) for r in rows] == [(1, 0), (1, 2)]
    for r in rows:
        b = next(b for b in behaviors if (b.layer, b.head) == (1, r["head"]))
        assert r["primary"] == b.primary_pattern and r["entropy"] == pytest.approx(b.entropy, abs=1e-4)
    # The token's markup stays data: the page shows it with textContent, the JSON escapes "<".
    assert "</script><b>" not in html and "\\u003c/script>\\u003cb>&" in html


def test_html_accepts_layer_dicts_and_checks_inputs(cache):
    pats = {0: cache.pattern(0)[0], 1: cache.pattern(1)[0]}  # {layer: [H, L, L]}
    data = _data(attention_html(TOKENS, pats))
    assert data["layers"] == [0, 1] and len(data["maps"]["A"][0]) == 2
    with pytest.raises(ValueError, match="tokens"):
        attention_html(TOKENS[:-1], cache)
    with pytest.raises(ValueError, match="layer 5"):
        attention_html(TOKENS, cache, layers=[5])
    with pytest.raises(ValueError, match="head 4"):
        attention_html(TOKENS, cache, heads=[4])
    with pytest.raises(ValueError, match="no attention patterns"):
        attention_html(TOKENS, {"blocks.0.hook_resid_pre": torch.zeros(1, L, 32)})


def test_png_has_the_expected_size_and_content(tmp_path, cache):
    p = cache.pattern(0)[0, 0]
    path = save_attention_png(tmp_path / "one.png", TOKENS, p, figsize=(4, 3), dpi=50, title="L0 H0")
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size == (200, 150)
        px = torch.from_numpy(np.array(im.convert("L"))).float()
    assert px.std() > 10  # not a blank canvas

    import matplotlib.image as mpimg

    grid = save_attention_png(tmp_path / "grid.png", TOKENS, cache.pattern(1)[0], titles=[f"H{h}" for h in range(4)],
                              dpi=40)
    w, h = default_figsize(L, 4)
    assert mpimg.imread(grid).shape[:2] == (round(h * 40), round(w * 40))


def test_png_heatmap_puts_dark_cells_where_the_weight_is(tmp_path):
    # An identity pattern drawn on a known canvas: the diagonal must be darker than off-diagonal.
    n = 4
    path = save_attention_png(tmp_path / "eye.png", list("abcd"), torch.eye(n), figsize=(4, 4), dpi=100)
    with Image.open(path) as im:
        g = torch.from_numpy(np.array(im.convert("L"))).float()  # [H, W]
        assert g.shape == (400, 400)
    dark = (g < 80).nonzero()
    assert len(dark) > 0
    ys, xs = dark[:, 0].float(), dark[:, 1].float()
    # Dark pixels (the 1.0 cells and the colorbar top) are spread along a falling diagonal.
    in_axes = xs < xs.quantile(0.8)
    assert torch.corrcoef(torch.stack([ys[in_axes], xs[in_axes]]))[0, 1] > 0.8


def test_png_input_errors(tmp_path):
    with pytest.raises(ValueError, match="tokens"):
        save_attention_png(tmp_path / "x.png", ["a"], torch.eye(3))
    with pytest.raises(ValueError, match="pattern"):
        save_attention_png(tmp_path / "x.png", ["a"], torch.zeros(2, 3))


def test_save_html_and_layer_pngs(tmp_path, cache):
    html = save_attention_html(tmp_path / "sub" / "a.html", TOKENS, cache, [0], [0])
    assert html.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    paths = save_layer_pngs(tmp_path, TOKENS, cache, layers=[0, 1], heads=[0, 1], dpi=30)
    assert [p.name for p in paths] == ["layer0.png", "layer1.png"]
    for p in paths:
        with Image.open(p) as im:
            w, h = default_figsize(L, 2)
            assert im.size == (round(w * 30), round(h * 30))


def test_visualize_text_end_to_end(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["<pad>", "the", "cat", "sat", "on", "mat", "[UNK]"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    lm = tiny_gpt2(len(words))
    out = visualize_text(lm, tok, "the cat sat on the mat", tmp_path / "viz", layers=[1], heads=[0, 3], dpi=30)
    assert out["tokens"] == ["the", "cat", "sat", "on", "the", "mat"]
    html = out["html"].read_text(encoding="utf-8")
    data = _data(html)
    assert data["examples"][0]["tokens"] == out["tokens"] and data["layers"] == [1]
    assert [(r["layer"], r["head"]) for r in data["analysis"]["A"]] == [(1, 0), (1, 3)]
    assert [p.name for p in out["png"]] == ["layer1.png"]
    assert len(out["behaviors"]) == 4
    with pytest.raises(ValueError, match="tokenizer"):
        visualize_text(tiny_gpt2(7), None, "the cat", tmp_path)


def test_interpretability_example_runs(tmp_path):
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "interpretability.py"
    res = subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=120, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "best head" in res.stdout and "primary" in res.stdout
    for name in ("encoder.html", "encoder/layer0.png", "lm/attention.html", "lm/layer1.png"):
        assert (tmp_path / name).is_file(), name


def tiny_gpt2(vocab_size: int, n_positions: int = 16, n_layer: int = 2, seed: int = 0):
    """transformers' GPT-2 of a small config (seeded, untrained) with attnx's mha placed: token ids in."""
    import transformers

    from attnx.pretrained import place
    from attnx.pretrained.host import Host

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=32, n_head=4, vocab_size=vocab_size, n_positions=n_positions)
    return Host(place(transformers.GPT2LMHeadModel(cfg), "mha"), "causal-lm").eval()
