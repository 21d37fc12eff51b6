"""The attention page in a real browser (issue 13, item 4): Debian's chromium, headless, driven by
Playwright. Opens a real-model (MiniLM) page written by `attnx explain`, switches the head, checks
what is drawn against the export's own numbers, hovers, draws the lines view and the comparison.

Set-up (``make test``): ``apt-get install -y chromium`` and ``pip install playwright``; Playwright's
own browser download is not used (no network), the system chromium is."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from explain_fixtures import explained_minilm  # noqa: E402

from attnx.explain.explanation import explain  # noqa: E402
from attnx.interp.source import open_source  # noqa: E402
from support.cli import run as attnx  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
pytestmark = pytest.mark.chromium
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--no-first-run"]
TEXT = "The cat sat on the mat."


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def page_file(tmp_path_factory):
    export = explained_minilm()
    out = tmp_path_factory.mktemp("page") / "minilm.html"
    res = attnx("explain", str(export.path), TEXT, "-o", str(out), "--ablate", "--layer", "0", "--no-png")
    assert res.returncode == 0, res.stderr
    return export, out


def _open(browser, path: Path):
    page = browser.new_page(viewport={"width": 1100, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    page.goto(path.as_uri())
    return page, errors, requests


def _cells(page) -> np.ndarray:
    cells = page.eval_on_selector_all("#heatmap td.v", "cs => cs.map(c => [+c.dataset.q, +c.dataset.k, +c.dataset.w])")
    n = int(round(len(cells) ** 0.5))
    grid = np.zeros((n, n))
    for q, k, w in cells:
        grid[q, k] = w
    return grid


def test_switching_heads_draws_that_heads_weights(browser, page_file):
    export, path = page_file
    ex = explain(open_source(export.path), [TEXT])
    page, errors, requests = _open(browser, path)
    assert page.eval_on_selector_all("#layer option", "os => os.length") == 6
    assert page.eval_on_selector_all("#head option", "os => os.length") == 12
    # It opens on --layer 0 at the head ranked first by the ablation, which sits above the map (issue 26).
    ranked = page.eval_on_selector_all("#ablation tbody tr", "rs => rs.map(r => +r.dataset.head)")
    assert (page.input_value("#layer"), page.input_value("#head")) == ("0", str(ranked[0]))
    assert page.eval_on_selector("#ablation-box", "b => b.getBoundingClientRect().top") < \
        page.eval_on_selector("#plot", "p => p.getBoundingClientRect().top")
    np.testing.assert_allclose(_cells(page), ex.patterns[0][0, ranked[0]], atol=6e-4)
    page.select_option("#head", "0")
    first = _cells(page)
    np.testing.assert_allclose(first, ex.patterns[0][0, 0], atol=6e-4)
    page.select_option("#head", "2")
    drawn = _cells(page)
    np.testing.assert_allclose(drawn, ex.patterns[0][0, 2], atol=6e-4)
    assert np.abs(drawn - first).max() > 0.5  # the map really changed
    assert "previous_token" in page.inner_text("#meta") and "layer 0 head 2" in page.inner_text("#meta")
    assert page.eval_on_selector("#analysis tr.current", "r => [r.dataset.layer, r.dataset.head]") == ["0", "2"]
    # Hover: the weight of query 3 ("sat") on key 2 ("cat").
    page.hover("#heatmap td.v[data-q='3'][data-k='2']")
    assert page.inner_text("#info") == f'query 3 "sat" -> key 2 "cat": {ex.patterns[0][0, 2, 3, 2]:.3f}'
    # A layer switch through the analysis table's rows.
    page.click("#analysis tbody tr[data-layer='4'][data-head='5']")
    assert (page.input_value("#layer"), page.input_value("#head")) == ("4", "5")
    np.testing.assert_allclose(_cells(page), ex.patterns[4][0, 5], atol=6e-4)
    # The lines view: one line per weight >= 0.01, opacity = weight; hovering a token keeps its lines only.
    page.select_option("#layer", "0")
    page.select_option("#head", "2")
    page.select_option("#view", "lines")
    lines = page.eval_on_selector_all("#lines line", "ls => ls.map(l => [+l.dataset.q, +l.dataset.k, "
                                                     "+l.getAttribute('stroke-opacity')])")
    want = [(q, k) for q in range(9) for k in range(9) if ex.patterns[0][0, 2, q, k] >= 0.01]
    assert sorted((q, k) for q, k, _ in lines) == want
    for q, k, w in lines:
        assert w == pytest.approx(min(1.0, ex.patterns[0][0, 2, q, k]), abs=6e-4)
    page.hover("#lines text[data-side='query'][data-i='4']")
    shown = page.eval_on_selector_all("#lines line", "ls => ls.filter(l => l.style.display !== 'none').length")
    assert shown == sum(1 for q, _ in want if q == 4)
    assert page.inner_text("#info").startswith('query 4 "on" attends most to: "sat"')
    # The ablation table is on the page, ranked.
    rows = page.eval_on_selector_all("#ablation tbody tr", "rs => rs.map(r => +r.dataset.head)")
    assert len(rows) == 12
    assert errors == [] and all(u.startswith("file:") for u in requests)  # self-contained: no network
    page.close()


def test_comparison_page_shows_both_maps_and_the_difference(browser, tmp_path_factory, tmp_path):
    result = explained_minilm("smal", randomize=True, layers=[0, 1])
    src = open_source(result.path)
    spec = {e.name: e for e in src.facts.context_inputs}
    dh, d_self = spec["trace"].shape[-1], spec["self_state"].shape[1]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"self_state": [0.0] * d_self, "trace": (0.05 * np.eye(dh)).tolist()}))
    b.write_text(json.dumps({"self_state": [1.5] * d_self}))
    out = tmp_path / "cmp.html"
    res = attnx("explain", str(result.path), TEXT, "--context", str(a), "--against", str(b), "-o", str(out), "--no-png")
    assert res.returncode == 0, res.stderr
    page, errors, _ = _open(browser, out)
    maps = {}
    for mode in ("A", "B", "diff"):
        page.select_option("#mode", mode)
        maps[mode] = _cells(page)
    np.testing.assert_allclose(maps["diff"], maps["B"] - maps["A"], atol=2e-3)
    assert np.abs(maps["diff"]).max() > 1e-3
    reds = page.eval_on_selector_all("#heatmap td.v", "cs => cs.filter(c => c.style.background.startsWith("
                                                      "'rgba(214, 39, 40')).length")
    assert reds == int((maps["diff"] >= 0).sum()) < maps["diff"].size  # red = more under B, blue = less
    assert "output distance A vs B" in page.inner_text("#distance")
    assert errors == []
    page.close()
