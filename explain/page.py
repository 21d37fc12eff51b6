"""The attention page: one self-contained HTML file (inline CSS, JS and data; no network).

    html = explanation_page(ex)                        # from attnx.explain.explanation.explain(...)
    html = explanation_page(cmp.a, compare=cmp)        # two context values: A, B and B - A per head
    html = explanation_page(ex, ablation=rows)         # plus the head-ablation / patching table

It opens on the layer asked for (``layer=``, else the whole model) at its most distinctive head
(:func:`opening_view`: the head whose ablation changed the output most, else the one the two context
values change most, else the one with the clearest pattern), with the ablation ranking near the top.

What it shows: selectors for the example, layer and head; the pattern as a query x key heatmap
or as token-to-token lines (hover a cell or a token for the weights); each head's analysis
(entropy, the four scores, the primary pattern or "mixed"; click a row to show that head); a
model's extra per-example outputs (e.g. a decision the variant made, with its documentation);
with a comparison the map under each context value and their difference; with ``ablation``
the ranked table of each head's effect.

Weights travel as integers in thousandths (three decimals) to keep the page small; the page's
data block is ``<script type="application/json" id="attnx-data">``. numpy only.
"""

from __future__ import annotations

import html as _html
import json
from typing import Sequence

import numpy as np

from attnx.explain.analysis import PATTERN_TITLES, PATTERNS, HeadBehavior

SCALE = 1000  # weights are stored as round(w * SCALE)


def _display(token) -> str:
    """A visible label: control characters written as escapes (a newline token stays visible)."""
    return str(token).replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")


def _maps(patterns: dict[int, np.ndarray], lengths: Sequence[int]) -> list[list[list[list[int]]]]:
    """``[example][layer index][head] -> flat L*L ints`` (each example cut to its own length)."""
    out = []
    for ex, n in enumerate(lengths):
        per_layer = []
        for layer in sorted(patterns):
            p = np.nan_to_num(np.asarray(patterns[layer][ex], dtype=np.float64)[:, :n, :n])
            per_layer.append([np.rint(h * SCALE).astype(np.int64).ravel().tolist() for h in p])
        out.append(per_layer)
    return out


def _behaviors(behaviors: Sequence[HeadBehavior] | None) -> list[dict]:
    def num(v: float):
        return None if v != v else round(float(v), 4)

    return [{"layer": b.layer, "head": b.head, "entropy": num(b.entropy), "primary": b.primary_pattern,
             "scores": {k: num(b.scores.get(k, float("nan"))) for k in PATTERNS}} for b in behaviors or ()]


def page_data(tokens: Sequence[Sequence[str]], patterns: dict[int, np.ndarray], *, texts: Sequence[str] | None = None,
              behaviors: Sequence[HeadBehavior] | None = None, title: str = "attnx attention",
              model: str = "", extras: Sequence[Sequence[dict]] | None = None) -> dict:
    """The page's data for ``patterns`` ``{layer: [B, H, L, L]}`` of ``tokens`` (one list per example)."""
    if not patterns:
        raise ValueError("no attention patterns to show")
    first = np.asarray(next(iter(patterns.values())))
    if first.ndim == 3:  # one example given as [H, L, L]
        patterns = {k: np.asarray(v)[None] for k, v in patterns.items()}
        first = first[None]
    if first.ndim != 4 or first.shape[-1] != first.shape[-2]:
        raise ValueError(f"patterns: expected [B, H, L, L] or [H, L, L], got {list(first.shape)}")
    tokens = [[_display(t) for t in ts] for ts in tokens]
    if len(tokens) != first.shape[0]:
        raise ValueError(f"{len(tokens)} token lists for a batch of {first.shape[0]}")
    for ts in tokens:
        if not 0 < len(ts) <= first.shape[-1]:
            raise ValueError(f"{len(ts)} tokens for patterns of length {first.shape[-1]}")
    texts = list(texts) if texts is not None else [" ".join(ts) for ts in tokens]
    return {"title": title, "model": model, "layers": sorted(int(k) for k in patterns), "n_heads": int(first.shape[1]),
            "scale": SCALE, "patterns": list(PATTERNS), "pattern_titles": PATTERN_TITLES,
            "examples": [{"text": t[:2000], "tokens": ts, "extras": list(extras[i]) if extras else []}
                         for i, (t, ts) in enumerate(zip(texts, tokens))],
            "labels": ["A"], "maps": {"A": _maps(patterns, [len(ts) for ts in tokens])},
            "analysis": {"A": _behaviors(behaviors)}}


def add_comparison(data: dict, patterns_b: dict[int, np.ndarray], behaviors_b, labels: Sequence[str],
                   differences: Sequence, output_distance: dict) -> dict:
    """Add a second map per head (the same input under another context value) and the differences."""
    data["labels"] = [labels[0], labels[1]]
    data["maps"] = {labels[0]: data["maps"]["A"], labels[1]: _maps(patterns_b, [len(e["tokens"]) for e in
                                                                               data["examples"]])}
    data["analysis"] = {labels[0]: data["analysis"]["A"], labels[1]: _behaviors(behaviors_b)}
    data["differences"] = [{"layer": d.layer, "head": d.head, "max_abs": round(d.max_abs, 4),
                            "mean_abs": round(d.mean_abs, 4)} for d in differences]
    data["output_distance"] = output_distance
    return data


def add_ablation(data: dict, layer: int, metric: str, columns: Sequence[str], rows: Sequence[dict]) -> dict:
    """``rows``: ``{"head": h, column: value, ...}`` in rank order; ``columns`` name the value columns."""
    data["ablation"] = {"layer": layer, "metric": metric, "columns": list(columns), "rows": list(rows)}
    return data


def opening_view(data: dict, layer: int | None = None) -> dict:
    """``{"layer", "head", "why"}``: where the page opens. ``layer`` (None: any) and in it the most
    distinctive head: first in the ablation ranking (when it ablated that layer), else the head the two
    context values change most (a comparison), else the head whose clearest pattern scores highest
    (lowest entropy on a tie)."""
    layers = data["layers"]
    if layer not in layers:  # None, or a layer ablated whose patterns were not exported
        layer = None
    ablation = data.get("ablation")
    if ablation and ablation["rows"] and ablation["layer"] in layers and layer in (None, ablation["layer"]):
        return {"layer": ablation["layer"], "head": int(ablation["rows"][0]["head"]),
                "why": f"ranked first when ablated ({ablation['metric']})"}
    keep = lambda item: layer is None or item["layer"] == layer  # noqa: E731
    differences = [d for d in data.get("differences") or () if keep(d)]
    if differences:
        top = max(differences, key=lambda d: d["max_abs"])
        return {"layer": top["layer"], "head": top["head"], "why": "changed most between the two contexts"}

    def clearest(b) -> tuple:
        scores = [v for v in b["scores"].values() if v is not None]
        entropy = b["entropy"] if b["entropy"] is not None else float("inf")
        return (max(scores) if scores else float("-inf"), -entropy)

    heads = [b for b in data["analysis"].get(data["labels"][0]) or () if keep(b)]
    if heads:
        top = max(heads, key=clearest)
        return {"layer": top["layer"], "head": top["head"], "why": f"clearest pattern ({top['primary']})"}
    return {"layer": layer if layer is not None else layers[0], "head": 0, "why": ""}


def explanation_page(ex, *, compare=None, ablation: dict | None = None, title: str | None = None,
                     form_action: str | None = None, layer: int | None = None) -> str:
    """The page for an :class:`~attnx.explain.explanation.Explanation` (and optionally its comparison / ablation),
    opening on ``layer`` (``attnx explain --layer``) at its most distinctive head (:func:`opening_view`)."""
    extras = []
    for row in range(len(ex.batch.tokens)):
        items = []
        for e in ex.facts.extra_outputs:
            if e.name in ex.outputs:
                value = np.asarray(ex.outputs[e.name])[row]
                items.append({"name": e.name, "doc": e.doc,
                              "value": value.tolist() if value.size <= 16 else f"array {list(value.shape)}"})
        extras.append(items)
    data = page_data(ex.batch.tokens, ex.patterns, texts=ex.batch.texts, behaviors=ex.behaviors,
                     title=title or f"attention: {ex.facts.name}", model=f"{ex.facts.name} ({ex.facts.variant})",
                     extras=extras)
    if compare is not None:
        add_comparison(data, compare.b.patterns, compare.b.behaviors, ["A", "B"], compare.differences,
                       compare.output_distance)
    if ablation is not None:
        add_ablation(data, **ablation)
    data["start"] = opening_view(data, layer)
    return render_page(data, form_action)


def _json_for_script(obj) -> str:
    # Inside <script> only "</" can end the element; escape "<" so no token can.
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")


def render_page(data: dict, form_action: str | None = None) -> str:
    """The HTML for :func:`page_data` (``form_action``: a URL the page's text box submits to, on a server)."""
    title = _html.escape(data["title"])
    form = ""
    if form_action is not None:
        text = _html.escape(data["examples"][0]["text"]) if data["examples"] else ""
        form = (f'<form class="ask" method="get" action="{_html.escape(form_action)}"><input name="text" '
                f'id="ask-text" value="{text}" size="70"><button type="submit">explain</button></form>')
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>{_CSS}</style></head>
<body>
<h1>{title}</h1>
<div class="sub">{_html.escape(data.get("model", ""))}</div>
{form}
<div id="ablation-box"><h2 id="ablation-title"></h2><table class="analysis" id="ablation"></table></div>
<div class="controls">
<label>example <select id="example"></select></label>
<label>layer <select id="layer"></select></label>
<label>head <select id="head"></select></label>
<label>view <select id="view"><option value="heatmap">heatmap</option><option value="lines">lines</option></select></label>
<label id="mode-label">map <select id="mode"></select></label>
</div>
<div id="text" class="text"></div>
<div id="extras" class="extras"></div>
<div id="meta" class="meta"></div>
<div id="info" class="info">hover a cell or a token</div>
<div id="plot"><table class="grid" id="heatmap"></table><svg id="lines"></svg></div>
<div class="legend">rows / left: queries; columns / right: keys; darker = more attention (0..1);
difference maps: red = more under the second value, blue = less.</div>
<div id="distance" class="meta"></div>
<h2>heads</h2>
<table class="analysis" id="analysis"></table>
<script type="application/json" id="attnx-data">{_json_for_script(data)}</script>
<script>{_JS}</script>
</body></html>
"""


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:16px;color:#222}
h1{font-size:18px;margin:0 0 4px} h2{font-size:15px;margin:18px 0 6px} .sub{color:#666;font-size:13px}
.controls{display:flex;gap:14px;align-items:center;flex-wrap:wrap;margin:10px 0;font-size:14px}
.controls select{font-size:14px;padding:2px 4px} .ask{margin:8px 0} .ask input{font-size:14px;padding:3px}
.text{font-size:14px;margin:4px 0;color:#333} .extras{font-size:13px;color:#5a3d00;margin:4px 0}
.meta{font-size:13px;color:#333;margin:4px 0;font-family:ui-monospace,Menlo,Consolas,monospace}
.info{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:13px;min-height:1.4em;margin:6px 0;color:#0a3d91}
table.grid{border-collapse:collapse;font-size:11px}
table.grid td{width:18px;height:18px;padding:0;border:1px solid #f2f2f2}
table.grid td.v{cursor:crosshair} table.grid td.hl{outline:2px solid #e4572e}
table.grid th{font-weight:normal;white-space:pre;padding:0 4px;color:#444}
table.grid th.col{writing-mode:vertical-rl;transform:rotate(180deg);text-align:left;padding:4px 0}
svg#lines text{font-size:12px;cursor:pointer;white-space:pre} svg#lines line{stroke-linecap:round}
table.analysis{border-collapse:collapse;font-size:12px} table.analysis td,table.analysis th{padding:2px 7px;
border-bottom:1px solid #eee;text-align:right} table.analysis tr.current{outline:2px solid #e4572e}
table.analysis tbody tr{cursor:pointer} table.analysis td.label{text-align:left}
.legend{font-size:12px;color:#666;margin-top:8px}
"""

_JS = r"""
(() => {
const D = JSON.parse(document.getElementById('attnx-data').textContent);
const $ = id => document.getElementById(id);
const sel = {example: $('example'), layer: $('layer'), head: $('head'), view: $('view'), mode: $('mode')};
const compare = D.labels.length > 1;
function opt(s, value, text) { const o = document.createElement('option'); o.value = value; o.textContent = text; s.appendChild(o); }
D.examples.forEach((e, i) => opt(sel.example, i, (i + 1) + ': ' + e.text.slice(0, 50)));
D.layers.forEach((l, i) => opt(sel.layer, i, l));
for (let h = 0; h < D.n_heads; h++) opt(sel.head, h, h);
D.labels.forEach(l => opt(sel.mode, l, l));
if (compare) opt(sel.mode, 'diff', D.labels[1] + ' - ' + D.labels[0]); else $('mode-label').style.display = 'none';
if (D.examples.length < 2) sel.example.parentNode.style.display = 'none';
const S = D.start || {layer: D.layers[0], head: 0};  // the asked layer, at its most distinctive head
sel.layer.value = Math.max(0, D.layers.indexOf(S.layer)); sel.head.value = S.head;
const fmt = w => w.toFixed(3);
function weights() {
  const e = +sel.example.value, l = +sel.layer.value, h = +sel.head.value, m = sel.mode.value || D.labels[0];
  const get = lab => D.maps[lab][e][l][h].map(v => v / D.scale);
  if (m === 'diff') { const a = get(D.labels[0]), b = get(D.labels[1]); return b.map((v, i) => v - a[i]); }
  return get(m);
}
function color(w) {
  if (w < 0) return 'rgba(31,90,200,' + Math.min(1, -w * 2).toFixed(3) + ')';
  if (sel.mode.value === 'diff') return 'rgba(214,39,40,' + Math.min(1, w * 2).toFixed(3) + ')';
  return 'rgba(31,119,180,' + Math.min(1, w).toFixed(3) + ')';
}
function behavior(lab) {
  const layer = D.layers[+sel.layer.value], head = +sel.head.value;
  return (D.analysis[lab] || []).find(b => b.layer === layer && b.head === head);
}
function scoresText(b) {
  if (!b) return '';
  const s = D.patterns.map(p => D.pattern_titles[p] + ' ' + (b.scores[p] === null ? 'n/a' : b.scores[p].toFixed(2))).join(', ');
  return b.primary + ' | entropy ' + (b.entropy === null ? 'n/a' : b.entropy.toFixed(3)) + ' nats | ' + s;
}
function drawHeatmap(P, T) {
  const g = $('heatmap'), n = T.length; g.textContent = '';
  const head = g.insertRow(); head.appendChild(document.createElement('th'));
  T.forEach(t => { const th = document.createElement('th'); th.className = 'col'; th.textContent = t; head.appendChild(th); });
  for (let i = 0; i < n; i++) {
    const r = g.insertRow(); const th = document.createElement('th'); th.textContent = T[i]; r.appendChild(th);
    for (let j = 0; j < n; j++) {
      const c = r.insertCell(), w = P[i * n + j];
      c.className = 'v'; c.style.background = color(w); c.dataset.q = i; c.dataset.k = j; c.dataset.w = w.toFixed(3);
      c.title = 'query ' + i + ' "' + T[i] + '" -> key ' + j + ' "' + T[j] + '": ' + fmt(w);
      c.onmouseenter = () => { $('info').textContent = c.title; };
    }
  }
}
function drawLines(P, T) {
  const svg = $('lines'), n = T.length, step = 20, width = 560, top = 14;
  svg.textContent = ''; svg.setAttribute('width', width); svg.setAttribute('height', top + n * step);
  const NS = 'http://www.w3.org/2000/svg', xl = 150, xr = width - 150, lines = [];
  function text(x, y, s, anchor, i, side) {
    const t = document.createElementNS(NS, 'text'); t.setAttribute('x', x); t.setAttribute('y', y + 4);
    t.setAttribute('text-anchor', anchor); t.textContent = s; t.dataset.i = i; t.dataset.side = side; svg.appendChild(t); return t;
  }
  for (let i = 0; i < n; i++) for (let j = 0; j < n; j++) {
    const w = P[i * n + j]; if (Math.abs(w) < 0.01) continue;
    const ln = document.createElementNS(NS, 'line');
    ln.setAttribute('x1', xl + 6); ln.setAttribute('y1', top + i * step); ln.setAttribute('x2', xr - 6); ln.setAttribute('y2', top + j * step);
    ln.setAttribute('stroke', color(w > 0 ? 1 : -1).replace(/,[0-9.]+\)$/, ',1)'));
    ln.setAttribute('stroke-opacity', Math.min(1, Math.abs(w)).toFixed(3)); ln.setAttribute('stroke-width', 2);
    ln.dataset.q = i; ln.dataset.k = j; ln.dataset.w = w.toFixed(3); svg.appendChild(ln); lines.push(ln);
  }
  T.forEach((t, i) => {
    const q = text(xl, top + i * step, t, 'end', i, 'query'); text(xr, top + i * step, t, 'start', i, 'key');
    q.onmouseenter = () => {
      lines.forEach(ln => ln.style.display = (+ln.dataset.q === i) ? '' : 'none');
      const top3 = T.map((s, j) => [P[i * n + j], j]).sort((a, b) => Math.abs(b[0]) - Math.abs(a[0])).slice(0, 3)
        .map(([w, j]) => '"' + T[j] + '"' + fmt(w)).join(', ');
      $('info').textContent = 'query ' + i + ' "' + t + '" attends most to: ' + top3;
    };
    q.onmouseleave = () => lines.forEach(ln => ln.style.display = '');
  });
}
function drawAnalysis() {
  const t = $('analysis'), lab = sel.mode.value === D.labels[1] ? D.labels[1] : D.labels[0];
  const rows = D.analysis[lab] || []; t.textContent = '';
  if (!rows.length) return;
  const h = t.createTHead().insertRow();
  ['layer', 'head', 'entropy'].concat(D.patterns.map(p => D.pattern_titles[p])).concat(['primary'])
    .concat(compare ? ['max |B-A|', 'mean TV'] : []).forEach(s => { const th = document.createElement('th'); th.textContent = s; h.appendChild(th); });
  const body = t.createTBody();
  rows.forEach(b => {
    const r = body.insertRow(); r.dataset.layer = b.layer; r.dataset.head = b.head;
    const cells = [b.layer, b.head, b.entropy === null ? 'n/a' : b.entropy.toFixed(3)]
      .concat(D.patterns.map(p => b.scores[p] === null ? 'n/a' : b.scores[p].toFixed(2))).concat([b.primary]);
    if (compare) { const d = D.differences.find(x => x.layer === b.layer && x.head === b.head); cells.push(d.max_abs.toFixed(3), d.mean_abs.toFixed(3)); }
    cells.forEach((v, k) => { const c = r.insertCell(); c.textContent = v; if (k === 3 + D.patterns.length) c.className = 'label';
      if (k >= 3 && k < 3 + D.patterns.length && b.scores[D.patterns[k - 3]] !== null) c.style.background = 'rgba(44,160,44,' + Math.max(0, b.scores[D.patterns[k - 3]]).toFixed(2) + ')'; });
    r.onclick = () => { sel.layer.value = D.layers.indexOf(b.layer); sel.head.value = b.head; render(); };
  });
}
function drawAblation() {
  const A = D.ablation, box = $('ablation-box');
  if (!A) { box.style.display = 'none'; return; }
  $('ablation-title').textContent = 'layer ' + A.layer + ': each head ablated (' + A.metric + ')';
  const t = $('ablation'); t.textContent = '';
  const h = t.createTHead().insertRow();
  ['rank', 'head'].concat(A.columns).forEach(s => { const th = document.createElement('th'); th.textContent = s; h.appendChild(th); });
  const body = t.createTBody();
  A.rows.forEach((row, k) => {
    const r = body.insertRow(); r.dataset.head = row.head;
    [k + 1, row.head].concat(A.columns.map(c => row[c] === null || row[c] === undefined ? 'n/a' : (+row[c]).toPrecision(4)))
      .forEach(v => { r.insertCell().textContent = v; });
    r.onclick = () => { sel.layer.value = D.layers.indexOf(A.layer); sel.head.value = row.head; render(); };
  });
}
function render() {
  const e = D.examples[+sel.example.value], T = e.tokens, P = weights(), lab = sel.mode.value === 'diff' ? null : (sel.mode.value || D.labels[0]);
  $('text').textContent = e.text;
  $('extras').textContent = e.extras.map(x => x.name + ' = ' + JSON.stringify(x.value) + (x.doc ? ' (' + x.doc + ')' : '')).join('; ');
  const lines = sel.view.value === 'lines';
  $('heatmap').style.display = lines ? 'none' : ''; $('lines').style.display = lines ? '' : 'none';
  if (lines) drawLines(P, T); else drawHeatmap(P, T);
  $('meta').textContent = 'layer ' + D.layers[+sel.layer.value] + ' head ' + sel.head.value + ': ' +
    (lab ? scoresText(behavior(lab)) : 'difference ' + D.labels[1] + ' - ' + D.labels[0]);
  if (compare) $('distance').textContent = 'output distance ' + D.labels[0] + ' vs ' + D.labels[1] + ': ' +
    D.output_distance.metric + ' = ' + (+D.output_distance.value).toPrecision(4);
  document.querySelectorAll('#analysis tbody tr').forEach(r => r.classList.toggle('current',
    +r.dataset.layer === D.layers[+sel.layer.value] && +r.dataset.head === +sel.head.value));
}
Object.values(sel).forEach(s => s.onchange = () => { if (s === sel.mode) drawAnalysis(); render(); });
drawAnalysis(); drawAblation(); render();
})();
"""
