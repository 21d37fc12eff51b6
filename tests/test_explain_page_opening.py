"""Where the attention page opens (issue 26, friction): on the layer `--layer` asks for, at its most
distinctive head (first in the ablation ranking, else the one two contexts change most, else the clearest
pattern), with the ablation ranking near the top of the page. The page's own JavaScript is driven in a
real browser by tests/test_explain_browser.py."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from attnx.explain.analysis import PATTERNS, HeadBehavior
from attnx.explain.page import add_ablation, add_comparison, opening_view, page_data, render_page


def behavior(layer, head, score, entropy=1.0):
    scores = {p: 0.1 for p in PATTERNS}
    scores[PATTERNS[0]] = score
    return HeadBehavior(layer=layer, head=head, entropy=entropy, scores=scores, primary_pattern=PATTERNS[0])


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    patterns = {layer: rng.random((1, 4, 5, 5)) for layer in (0, 1, 2)}
    behaviors = [behavior(layer, head, score=0.2) for layer in (0, 1, 2) for head in range(4)]
    behaviors[1 * 4 + 3] = behavior(1, 3, score=0.9)  # layer 1's clearest head
    behaviors[2 * 4 + 1] = behavior(2, 1, score=0.95)  # the model's clearest head
    return page_data([["a", "b", "c", "d", "e"]], patterns, behaviors=behaviors)


def test_it_opens_on_the_asked_layer_at_its_clearest_head(data):
    assert opening_view(data, 1)["layer"] == 1 and opening_view(data, 1)["head"] == 3
    assert (opening_view(data)["layer"], opening_view(data)["head"]) == (2, 1)  # no layer asked: the whole model
    assert opening_view(data, 7)["layer"] == 2  # a layer without patterns on the page: the whole model


def test_an_ablated_layer_opens_at_its_first_ranked_head(data):
    add_ablation(data, 1, "cosine", ["delta"], [{"head": 2, "delta": 0.5}, {"head": 3, "delta": 0.1}])
    assert opening_view(data, 1) == {"layer": 1, "head": 2, "why": "ranked first when ablated (cosine)"}
    assert opening_view(data)["head"] == 2
    assert opening_view(data, 0)["layer"] == 0  # another layer asked for: its own clearest head


def test_a_comparison_opens_where_the_contexts_differ_most(data):
    from types import SimpleNamespace as D

    diffs = [D(layer=l, head=h, max_abs=0.9 if (l, h) == (0, 2) else 0.1, mean_abs=0.0)
             for l in (0, 1, 2) for h in range(4)]
    add_comparison(data, {l: np.zeros((1, 4, 5, 5)) for l in (0, 1, 2)}, [], ["A", "B"], diffs,
                   {"metric": "cosine", "value": 1.0})
    assert (opening_view(data)["layer"], opening_view(data)["head"]) == (0, 2)


def test_the_page_carries_its_opening_view_and_the_ranking_sits_above_the_map(data):
    add_ablation(data, 1, "cosine", ["delta"], [{"head": 2, "delta": 0.5}])
    data["start"] = opening_view(data, 1)
    html = render_page(data)
    block = re.search(r'<script type="application/json" id="attnx-data">(.*?)</script>', html, re.S).group(1)
    assert json.loads(block)["start"]["head"] == 2
    assert html.index('id="ablation-box"') < html.index('id="heatmap"') < html.index('id="analysis"')
    assert "sel.layer.value = Math.max(0, D.layers.indexOf(S.layer)); sel.head.value = S.head;" in html
