"""Attention patterns as a self-contained HTML page and as PNG heatmaps.

    html = attention_html(tokens, cache, layers=[0, 1], heads=[0, 3])   # str, no network needed
    save_attention_html("attn.html", tokens, cache)
    save_attention_png("l0h3.png", tokens, cache["blocks.0.attn.hook_pattern"][0, 3])
    paths = visualize_text(lm, lm.tokenizer, "The cat sat on the mat", "out/")

``patterns`` is either a cache (``{"blocks.{i}.attn.hook_pattern": [B, H, L, L]}``,
e.g. from ``run_with_cache``, prefixed keys allowed; ``batch_index`` picks the example) or a mapping
``{layer: [H, L, L]}``. The HTML page inlines its CSS, JS and data (no CDN, no
fetch), so it opens offline and can be attached to a report.
"""

from __future__ import annotations

import html as _html
import json
from pathlib import Path
from typing import Mapping, Sequence

import torch

# --------------------------------------------------------------------------- inputs


def _layer_patterns(patterns: Mapping, batch_index: int = 0) -> dict[int, torch.Tensor]:
    """Normalise the accepted forms to ``{layer: [H, L, L]}`` (float32, CPU)."""
    from attnx.interp.analysis import pattern_keys

    out: dict[int, torch.Tensor] = {}
    if all(isinstance(k, str) for k in patterns):  # a cache: other activations are skipped
        items = [(layer, patterns[key]) for layer, key in pattern_keys(patterns).items()]
    else:
        items = [(int(k), v) for k, v in patterns.items()]
    for layer, value in items:
        t = torch.as_tensor(value).detach().float().cpu()
        if t.dim() == 4:  # [B, H, L, L]
            if not 0 <= batch_index < t.shape[0]:
                raise ValueError(f"batch_index {batch_index} out of range for a batch of {t.shape[0]}")
            t = t[batch_index]
        if t.dim() != 3 or t.shape[-1] != t.shape[-2]:
            raise ValueError(f"pattern of layer {layer}: expected [H, L, L] or [B, H, L, L], got {list(t.shape)}")
        out[layer] = t
    if not out:
        raise ValueError("no attention patterns given (expected blocks.{i}.attn.hook_pattern keys or {layer: tensor})")
    return dict(sorted(out.items()))


def _select(pats: dict[int, torch.Tensor], layers, heads) -> list[tuple[int, int]]:
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

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:16px;color:#222}
h1{font-size:18px;margin:0 0 4px} .sub{color:#666;font-size:13px;margin-bottom:10px}
.controls{display:flex;gap:12px;align-items:center;flex-wrap:wrap;margin-bottom:10px;font-size:14px}
.controls select{font-size:14px;padding:2px 4px}
#info{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:13px;min-height:1.4em;margin:6px 0;color:#0a3d91}
table.grid{border-collapse:collapse;font-size:11px}
table.grid td{width:18px;height:18px;padding:0;border:1px solid #f2f2f2}
table.grid td.v{cursor:crosshair}
table.grid td.hl{outline:2px solid #e4572e}
table.grid th{font-weight:normal;white-space:nowrap;padding:0 4px;color:#444}
table.grid th.col{writing-mode:vertical-rl;transform:rotate(180deg);text-align:left;height:auto;padding:4px 0}
.tokens{line-height:2.2;font-size:15px;max-width:900px}
.tok{padding:2px 3px;margin:0 1px;border-radius:3px;cursor:pointer;white-space:pre;border:1px solid #ddd}
.tok.q{outline:2px solid #e4572e}
.legend{font-size:12px;color:#666;margin-top:8px}
"""

_JS = r"""
(() => {
const D = JSON.parse(document.getElementById('attn-data').textContent);
const sel = document.getElementById('head');
const info = document.getElementById('info');
const grid = document.getElementById('grid');
const toks = document.getElementById('tokens');
D.heads.forEach((h, k) => {
  const o = document.createElement('option');
  o.value = k; o.textContent = 'layer ' + h.layer + ' head ' + h.head + (h.label ? ' - ' + h.label : '');
  sel.appendChild(o);
});
function color(w) { return 'rgba(31,119,180,' + Math.min(1, Math.max(0, w)).toFixed(3) + ')'; }
function show(txt) { info.textContent = txt; }
function fmt(w) { return w.toFixed(4); }
function render() {
  const h = D.heads[+sel.value], P = h.pattern, T = D.tokens, n = T.length;
  grid.textContent = '';
  const head = grid.insertRow(); head.appendChild(document.createElement('th'));
  for (let j = 0; j < n; j++) { const th = document.createElement('th'); th.className = 'col'; th.textContent = T[j]; head.appendChild(th); }
  for (let i = 0; i < n; i++) {
    const r = grid.insertRow(); const th = document.createElement('th'); th.textContent = T[i]; r.appendChild(th);
    for (let j = 0; j < n; j++) {
      const c = r.insertCell(); const w = P[i][j];
      c.className = 'v'; c.style.background = color(w);
      c.title = 'query ' + i + ' "' + T[i] + '" -> key ' + j + ' "' + T[j] + '": ' + fmt(w);
      c.onmouseenter = () => show(c.title);
    }
  }
  toks.textContent = '';
  T.forEach((t, i) => {
    const s = document.createElement('span'); s.className = 'tok'; s.textContent = t; s.dataset.i = i;
    s.onmouseenter = () => {
      toks.querySelectorAll('.tok').forEach((o, j) => {
        o.style.background = color(P[i][j]); o.classList.toggle('q', j === i);
        o.title = 'weight from "' + T[i] + '": ' + fmt(P[i][j]);
      });
      const top = P[i].map((w, j) => [w, j]).sort((a, b) => b[0] - a[0]).slice(0, 3)
        .map(([w, j]) => '"' + T[j] + '" ' + fmt(w)).join(', ');
      show('query ' + i + ' "' + t + '" attends most to: ' + top);
    };
    toks.appendChild(s);
  });
  const sc = h.scores ? Object.entries(h.scores).map(([k, v]) => k + ' ' + (v === null ? 'n/a' : v.toFixed(2))).join(', ') : '';
  document.getElementById('meta').textContent = (h.entropy !== undefined ? 'entropy ' + h.entropy.toFixed(3) + ' nats; ' : '') + sc;
}
sel.onchange = render;
render();
})();
"""


def _json_for_script(obj) -> str:
    # Inside <script> only "</" can end the element; escape "<" so no token can.
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")


def attention_html(tokens: Sequence[str], patterns: Mapping, layers: Sequence[int] | None = None,
                   heads: Sequence[int] | None = None, *, batch_index: int = 0, behaviors: Sequence | None = None,
                   title: str = "attnx attention patterns", text: str | None = None, decimals: int = 4) -> str:
    """One HTML page: a head selector, a query x key heatmap (hover a cell for its weight)
    and the text (hover a token to shade the tokens it attends to).

    ``behaviors`` (from :func:`attnx.interp.analysis.analyze_heads`) adds each head's
    primary pattern to the selector and its scores under it. Weights are rounded to
    ``decimals`` places to keep the page small. ``text`` is shown above the plots
    (default: the tokens joined by spaces).
    """
    pats = _layer_patterns(patterns, batch_index)
    length = next(iter(pats.values())).shape[-1]
    tokens = _check_tokens(tokens, length)
    by_head = {(b.layer, b.head): b for b in (behaviors or ())}
    entries = []
    for layer, head in _select(pats, layers, heads):
        p = pats[layer][head]
        entry = {"layer": layer, "head": head,
                 "pattern": [[round(float(w), decimals) for w in row] for row in p.nan_to_num(0.0).tolist()]}
        b = by_head.get((layer, head))
        if b is not None:
            entry["label"] = b.primary_pattern
            if b.entropy == b.entropy:  # not NaN (JSON has no NaN)
                entry["entropy"] = float(b.entropy)
            entry["scores"] = {k: (None if v != v else round(float(v), 4)) for k, v in b.scores.items()}
        entries.append(entry)
    data = _json_for_script({"tokens": tokens, "heads": entries})
    text = " ".join(tokens) if text is None else text
    text = _html.escape(text if len(text) <= 2000 else text[:2000] + "...")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{_html.escape(title)}</title>
<style>{_CSS}</style></head>
<body>
<h1>{_html.escape(title)}</h1>
<div class="sub">{len(tokens)} tokens: <span>{text}</span></div>
<div class="controls"><label>head <select id="head"></select></label><span id="meta"></span></div>
<div id="info">hover a cell or a token</div>
<div class="tokens" id="tokens"></div>
<table class="grid" id="grid"></table>
<div class="legend">rows: queries, columns: keys; darker = more attention (0..1).</div>
<script type="application/json" id="attn-data">{data}</script>
<script>{_JS}</script>
</body></html>
"""


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

    p = torch.as_tensor(pattern).detach().float().cpu()
    if p.dim() == 2:
        p = p[None]
    if p.dim() != 3 or p.shape[-1] != p.shape[-2]:
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
        im = ax.imshow(p[k].numpy(), cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest")
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
    from attnx.interp.analysis import analyze_cache, cache_patterns, pattern_keys

    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ValueError("visualize_text needs a tokenizer (the model has none)")
    ids, labels = _tokenize(tokenizer, text)
    if not ids:
        raise ValueError("the text tokenised to no tokens")
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
