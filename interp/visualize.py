"""Attention patterns as a self-contained HTML page and as PNG heatmaps.

    html = attention_html(tokens, cache, layers=[0, 1], heads=[0, 3])   # str, no network needed
    save_attention_html("attn.html", tokens, cache)
    save_attention_png("l0h3.png", tokens, cache["blocks.0.attn.hook_pattern"][0, 3])
    paths = visualize_text(lm, lm.tokenizer, "The cat sat on the mat", "out/")

``patterns`` is either a cache (``{"blocks.{i}.attn.hook_pattern": [B, H, L, L]}``,
e.g. from ``run_with_cache``, prefixed keys allowed; ``batch_index`` picks the example) or a mapping
``{layer: [H, L, L]}`` (torch or numpy). The HTML page (:mod:`attnx.explain.page`) inlines its CSS,
JS and data (no CDN, no fetch), so it opens offline and can be attached to a report. Only
:func:`visualize_text` runs a (torch) model; the rest is numpy and matplotlib.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from attnx.explain.analysis import pattern_keys

# --------------------------------------------------------------------------- inputs


def _array(value) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor, without importing torch here
        value = value.detach().float().cpu().numpy()
    return np.asarray(value, dtype=np.float32)


def _layer_patterns(patterns: Mapping, batch_index: int = 0) -> dict[int, np.ndarray]:
    """Normalise the accepted forms to ``{layer: [H, L, L]}`` (float32)."""
    out: dict[int, np.ndarray] = {}
    if all(isinstance(k, str) for k in patterns):  # a cache: other activations are skipped
        items = [(layer, patterns[key]) for layer, key in pattern_keys(patterns).items()]
    else:
        items = [(int(k), v) for k, v in patterns.items()]
    for layer, value in items:
        t = _array(value)
        if t.ndim == 4:  # [B, H, L, L]
            if not 0 <= batch_index < t.shape[0]:
                raise ValueError(f"batch_index {batch_index} out of range for a batch of {t.shape[0]}")
            t = t[batch_index]
        if t.ndim != 3 or t.shape[-1] != t.shape[-2]:
            raise ValueError(f"pattern of layer {layer}: expected [H, L, L] or [B, H, L, L], got {list(t.shape)}")
        out[layer] = t
    if not out:
        raise ValueError("no attention patterns given (expected blocks.{i}.attn.hook_pattern keys or {layer: tensor})")
    return dict(sorted(out.items()))


def _select(pats: dict[int, np.ndarray], layers, heads) -> list[tuple[int, int]]:
    layers = list(pats) if layers is None else [int(i) for i in layers]
    pairs = []
    for layer in layers:
        if layer not in pats:
            raise ValueError(f"no pattern for layer {layer}; available layers: {list(pats)}")
        n_heads = pats[layer].shape[0]
        for h in (range(n_heads) if heads is None else heads):
            if not 0 <= int(h) < n_heads:
                raise ValueError(f"head {h} out of range: layer {layer} has {n_heads} heads")
            pairs.append((layer, int(h)))
    return pairs


def _display(token) -> str:
    """A visible label: control characters written as escapes (a newline token stays visible)."""
    return str(token).replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")


def _check_tokens(tokens: Sequence[str], length: int) -> list[str]:
    tokens = [_display(t) for t in tokens]
    if len(tokens) != length:
        raise ValueError(f"{len(tokens)} tokens for patterns of length {length}")
    return tokens


# --------------------------------------------------------------------------- HTML


def attention_html(tokens: Sequence[str], patterns: Mapping, layers: Sequence[int] | None = None,
                   heads: Sequence[int] | None = None, *, batch_index: int = 0, behaviors: Sequence | None = None,
                   title: str = "attnx attention patterns", text: str | None = None) -> str:
    """The attention page (:mod:`attnx.explain.page`) for one example: layer and head selectors, a
    query x key heatmap or token-to-token lines (hover for weights) and the heads' analysis.

    ``behaviors`` (from :func:`attnx.interp.analysis.analyze_heads`) fills the analysis table.
    ``heads`` limits the analysis rows shown; every head's map stays selectable.
    """
    from attnx.explain.page import page_data, render_page

    pats = _layer_patterns(patterns, batch_index)
    length = next(iter(pats.values())).shape[-1]
    tokens = _check_tokens(tokens, length)
    pairs = _select(pats, layers, heads)
    chosen = {layer: pats[layer][None] for layer in dict.fromkeys(l_ for l_, _ in pairs)}
    shown = set(pairs)
    rows = [b for b in (behaviors or ()) if (b.layer, b.head) in shown]
    data = page_data([tokens], chosen, texts=[text if text is not None else " ".join(tokens)], behaviors=rows,
                     title=title)
    return render_page(data)


def save_attention_html(path: str | Path, tokens: Sequence[str], patterns: Mapping, layers=None, heads=None,
                        **kwargs) -> Path:
    """Write :func:`attention_html` to ``path`` (UTF-8) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(attention_html(tokens, patterns, layers, heads, **kwargs), encoding="utf-8")
    return path


# --------------------------------------------------------------------------- PNG


def default_figsize(n_tokens: int, n_panels: int = 1, ncols: int | None = None) -> tuple[float, float]:
    """Inches for ``n_panels`` heatmaps of ``n_tokens`` x ``n_tokens``: ~0.25 in per token."""
    ncols = min(n_panels, 4) if ncols is None else ncols
    nrows = -(-n_panels // ncols)
    side = min(max(3.0, 0.25 * n_tokens + 1.5), 12.0)
    return side * ncols, side * nrows


def save_attention_png(path: str | Path, tokens: Sequence[str], pattern, *, titles: Sequence[str] | None = None,
                       title: str | None = None, ncols: int | None = None, figsize: tuple[float, float] | None = None,
                       dpi: int = 100, cmap: str = "Blues") -> Path:
    """Heatmap(s) of ``pattern`` ``[L, L]`` (one head) or ``[N, L, L]`` (a grid of N heads)
    with tokens on both axes (rows: queries, columns: keys). The image is exactly
    ``figsize * dpi`` pixels (``figsize`` defaults to :func:`default_figsize`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    p = _array(pattern)
    if p.ndim == 2:
        p = p[None]
    if p.ndim != 3 or p.shape[-1] != p.shape[-2]:
        raise ValueError(f"pattern: expected [L, L] or [N, L, L], got {list(p.shape)}")
    n, length = p.shape[0], p.shape[-1]
    # "$" would switch matplotlib into mathtext; escape it so tokens show verbatim.
    tokens = [t.replace("$", r"\$") for t in _check_tokens(tokens, length)]
    if titles is not None and len(titles) != n:
        raise ValueError(f"{len(titles)} titles for {n} panels")
    ncols = min(n, 4) if ncols is None else ncols
    nrows = -(-n // ncols)
    figsize = default_figsize(length, n, ncols) if figsize is None else figsize
    # Figure + Agg canvas directly: no pyplot global state, works headless.
    fig = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)
    fontsize = max(4, min(9, int(220 / max(length, 1))))
    for k in range(nrows * ncols):
        ax = fig.add_subplot(nrows, ncols, k + 1)
        if k >= n:
            ax.axis("off")
            continue
        im = ax.imshow(p[k], cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest")
        ax.set_xticks(range(length), labels=tokens, rotation=90, fontsize=fontsize)
        ax.set_yticks(range(length), labels=tokens, fontsize=fontsize)
        ax.set_xlabel("key", fontsize=8)
        ax.set_ylabel("query", fontsize=8)
        if titles is not None:
            ax.set_title(titles[k], fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()  # layout inside the fixed canvas; the pixel size stays figsize * dpi
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, format="png")
    return path


def save_layer_pngs(out_dir: str | Path, tokens: Sequence[str], patterns: Mapping, layers=None, heads=None, *,
                    batch_index: int = 0, behaviors: Sequence | None = None, **kwargs) -> list[Path]:
    """One PNG per chosen layer (``layer{i}.png``) with a panel per chosen head."""
    pats = _layer_patterns(patterns, batch_index)
    by_head = {(b.layer, b.head): b for b in (behaviors or ())}
    pairs = _select(pats, layers, heads)
    paths = []
    for layer in dict.fromkeys(l_ for l_, _ in pairs):
        hs = [h for l_, h in pairs if l_ == layer]
        titles = [f"L{layer} H{h}" + (f" ({by_head[(layer, h)].primary_pattern})" if (layer, h) in by_head else "")
                  for h in hs]
        paths.append(save_attention_png(Path(out_dir) / f"layer{layer}.png", tokens, pats[layer][hs],
                                        titles=titles, **kwargs))
    return paths


# --------------------------------------------------------------------------- text -> files


def _tokenize(tokenizer, text: str) -> tuple[list[int], list[str]]:
    """ids and one display string per token, for a `tokenizers.Tokenizer` or a
    transformers tokenizer (anything with encode/decode)."""
    enc = tokenizer.encode(text)
    ids = list(enc.ids) if hasattr(enc, "ids") else list(enc)
    try:
        labels = [tokenizer.decode([i]) for i in ids]
    except Exception:  # noqa: BLE001 - a tokenizer without per-id decode: fall back to its token strings
        labels = list(getattr(enc, "tokens", map(str, ids)))
    return ids, labels


def visualize_text(model, tokenizer, text: str, out_dir: str | Path, layers: Sequence[int] | None = None,
                   heads: Sequence[int] | None = None, *, analyze: bool = True, **png_kwargs) -> dict[str, object]:
    """Tokenise ``text``, run ``model`` (token ids -> anything, e.g. GPT2LM) once, and write
    ``attention.html`` plus ``layer{i}.png`` to ``out_dir``.

    Returns ``{"html": Path, "png": [Path, ...], "tokens": [...], "behaviors": [...]}``.
    """
    from attnx.explain.analysis import analyze_cache
    from attnx.interp.analysis import cache_patterns

    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ValueError("visualize_text needs a tokenizer (the model has none)")
    ids, labels = _tokenize(tokenizer, text)
    if not ids:
        raise ValueError("the text tokenised to no tokens")
    import torch

    input_ids = torch.tensor([ids], dtype=torch.long)
    cache = cache_patterns(model, input_ids, None, layers=layers)
    enc = getattr(model, "encoder", model)
    chosen = list(pattern_keys(cache))
    behaviors = None
    if analyze:
        causal = [bool(getattr(enc.blocks[i].attn.config, "is_causal", False)) for i in chosen]
        behaviors = analyze_cache(cache, None, layers=chosen, is_causal=causal)
    out = Path(out_dir)
    html_path = save_attention_html(out / "attention.html", labels, cache, chosen, heads, behaviors=behaviors,
                                    title=f"attention: {text[:60]}", text=text)
    pngs = save_layer_pngs(out, labels, cache, chosen, heads, behaviors=behaviors, **png_kwargs)
    return {"html": html_path, "png": pngs, "tokens": labels, "behaviors": behaviors}
