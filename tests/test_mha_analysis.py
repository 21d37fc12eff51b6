"""Head analysis (attnx.explain.analysis): planted heads, entropy, masking, a loop reference."""

from __future__ import annotations

import math

import pytest
import torch

from attnx.models import VARIANTS, build_encoder
from attnx.explain.analysis import (  # noqa: E402
    MIXED, PATTERNS, Standout, analyze_cache, analyze_patterns, pattern_stats, primary_pattern,
)
from attnx.interp.analysis import analyze_heads  # noqa: E402
from attnx.models.hooks import run_with_cache

D, H, L = 32, 4, 8


def _encoder(is_causal: bool = True, variant: str = "mha", **kw):
    return build_encoder(variant, n_layers=2, d_model=D, n_heads=H, is_causal=is_causal, seed=0, **kw)


# --------------------------------------------------------------------------- reference (plain loops)


def reference_stats(P: torch.Tensor, mask, causal: bool, window: int, sinks=None) -> dict[str, list[float]]:
    """The module docstring's definitions, written out one row and one key at a time."""
    B, nh, n, _ = P.shape
    mask = torch.ones(B, n, dtype=torch.long) if mask is None else mask
    ent = [[] for _ in range(nh)]
    lifts = {p: [[] for _ in range(nh)] for p in PATTERNS}
    masses = {p: [[] for _ in range(nh)] for p in PATTERNS}
    for b in range(B):
        valid = [bool(v) for v in mask[b]]
        f = valid.index(True) if any(valid) else 0
        sink = {f} | ({j for j in range(n) if valid[j] and bool(sinks[b, j])} if sinks is not None else set())
        for i in range(n):
            allowed = [j for j in range(n) if valid[j] and (not causal or j <= i)]
            if not valid[i] or not allowed:
                continue
            sets = {
                "previous_token": {i - 1} - sink,
                "first_token": sink - {i, i - 1},
                "self": {i} - sink,
                "local_window": {j for j in range(n) if 1 <= abs(i - j) <= window} - {i - 1} - sink,
            }
            for h in range(nh):
                row = P[b, h, i].double()
                ent[h].append(-sum(float(w) * math.log(float(w)) for w in row if w > 0))
            for name, target in sets.items():
                target = [j for j in target if j in allowed]
                chance = len(target) / len(allowed)
                if not target or chance >= 1:
                    continue
                for h in range(nh):
                    m = sum(float(P[b, h, i, j]) for j in target)
                    masses[name][h].append(m)
                    lifts[name][h].append((m - chance) / (1 - chance))

    def mean(xs):
        return sum(xs) / len(xs) if xs else float("nan")

    out = {"entropy": [mean(e) for e in ent]}
    for name in PATTERNS:
        out[f"score_{name}"] = [mean(x) for x in lifts[name]]
        out[f"mass_{name}"] = [mean(x) for x in masses[name]]
    return out


def _assert_stats_equal(got: dict, want: dict):
    for key, values in want.items():
        g = got[key].tolist()
        for h, (a, b) in enumerate(zip(g, values)):
            if math.isnan(b):
                assert math.isnan(a), (key, h, a)
            else:
                assert a == pytest.approx(b, abs=1e-9), (key, h)


MASKS = {
    "none": None,
    "right": torch.tensor([[1] * L, [1] * 5 + [0] * 3]),
    "left": torch.tensor([[1] * L, [0] * 3 + [1] * 5]),
}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("window", [1, 3])
def test_matches_loop_reference_on_a_real_model(causal, mask_name, window):
    torch.manual_seed(1)
    enc, mask = _encoder(causal), MASKS[mask_name]
    x = torch.randn(2, L, D) * 3  # larger inputs -> peakier, less uniform patterns
    _, cache = run_with_cache(enc, x, mask, names_filter=lambda n: n.endswith("hook_pattern"))
    for layer in range(2):
        P = cache.pattern(layer)
        got = pattern_stats(P, mask, is_causal=causal, window=window)
        _assert_stats_equal(got, reference_stats(P, mask, causal, window))


def test_matches_loop_reference_with_special_token_sinks():
    # [CLS] first and [SEP] last (right padding): both are sinks; the sets stay disjoint.
    torch.manual_seed(4)
    P = torch.rand(2, 3, L, L) ** 3
    P = P / P.sum(-1, keepdim=True)
    mask = MASKS["right"]
    sinks = torch.zeros(2, L, dtype=torch.bool)
    sinks[0, [0, L - 1]] = True
    sinks[1, [0, 4]] = True
    for causal in (True, False):
        _assert_stats_equal(pattern_stats(P, mask, is_causal=causal, window=2, sinks=sinks),
                            reference_stats(P, mask, causal, 2, sinks))
    # A head parked on [SEP] scores as a sink once [SEP] is marked, not otherwise.
    sep = torch.zeros(1, 1, L, L)
    sep[..., L - 1] = 1.0
    marked = torch.zeros(1, L, dtype=torch.bool)
    marked[0, [0, L - 1]] = True
    assert float(pattern_stats(sep, sinks=marked)["score_first_token"][0]) > 0.8  # rows L-2, L-1 see [CLS] only
    assert float(pattern_stats(sep)["score_first_token"][0]) < 0


def test_matches_loop_reference_on_an_arbitrary_pattern():
    # Not a real attention output (weight on padded / future keys): the definitions still hold.
    torch.manual_seed(2)
    P = torch.rand(2, 3, L, L) ** 4
    P = P / P.sum(-1, keepdim=True)
    mask = MASKS["left"]
    for causal in (True, False):
        _assert_stats_equal(pattern_stats(P, mask, is_causal=causal, window=2), reference_stats(P, mask, causal, 2))


# --------------------------------------------------------------------------- planted heads


def _planted(n: int) -> torch.Tensor:
    """[H=4, n, n]: previous-token, first-token, self and local-window heads (causal)."""
    P = torch.zeros(4, n, n)
    for i in range(n):
        P[0, i, max(i - 1, 0)] = 1.0  # previous token (row 0: itself)
        P[1, i, 0] = 1.0  # first token
        P[2, i, i] = 1.0  # self
        local = [j for j in (i - 2, i - 3) if j >= 1]  # within window 3, not i-1, not the first token
        for j in local or [i]:
            P[3, i, j] = 1.0 / len(local or [i])
    return P


def test_planted_heads_get_their_labels_through_run_with_hooks():
    torch.manual_seed(0)
    enc = _encoder(is_causal=True)
    x = torch.randn(2, L, D)
    planted = _planted(L)
    seen = {}

    def plant(pattern, hook):
        seen["shape"] = tuple(pattern.shape)
        return planted.expand_as(pattern).clone()

    out_plain = enc(x)
    behaviors = analyze_heads(enc, x, layers=[1], window=3, fwd_hooks=[("blocks.1.attn.hook_pattern", plant)])
    assert seen["shape"] == (2, H, L, L)
    assert [(b.layer, b.head) for b in behaviors] == [(1, h) for h in range(H)]
    assert [b.primary_pattern for b in behaviors] == ["previous_token", "first_token", "self", "local_window"]
    for b in behaviors:
        assert b.scores[b.primary_pattern] == pytest.approx(1.0, abs=1e-9)
        assert b.mass[b.primary_pattern] == pytest.approx(1.0, abs=1e-9)
        assert b.entropy <= math.log(2) + 1e-9  # one-hot rows (local: at most 2 keys)
        others = [s for n, s in b.scores.items() if n != b.primary_pattern]
        # A perfect head avoids every other target (the local head attends to itself on
        # rows 1-2, which have no local keys, so its self score is slightly positive).
        assert max(others) < (0.0 if b.head < 3 else 0.2)
    # The previous-token head never looks at itself: self lift per row i>=1 is -1/i.
    prev = behaviors[0]
    assert prev.scores["self"] == pytest.approx(-sum(1 / i for i in range(1, L)) / (L - 1), abs=1e-9)
    assert prev.entropy == pytest.approx(0.0, abs=1e-9)
    # The hooks were removed: a plain run is unchanged afterwards.
    assert torch.equal(enc(x), out_plain)


def test_other_layers_are_analysed_unplanted():
    torch.manual_seed(0)
    enc = _encoder()
    x = torch.randn(1, L, D)
    both = analyze_heads(enc, x, fwd_hooks=[("blocks.1.attn.hook_pattern", lambda p, h: _planted(L)[None])])
    assert len(both) == 2 * H
    assert [b.primary_pattern for b in both[H:]] == ["previous_token", "first_token", "self", "local_window"]
    assert all(b.primary_score < 0.9 for b in both[:H])  # layer 0: a random head


def test_a_label_only_when_a_score_stands_out():
    # Today's rule (analysis docstring): best >= 0.5 and best - runner-up >= 0.2, else "mixed".
    assert primary_pattern({"previous_token": 0.9, "first_token": 0.1, "self": -0.1, "local_window": 0.0}) == \
        "previous_token"
    assert primary_pattern({"previous_token": 0.05, "first_token": 0.04, "self": 0.0, "local_window": 0.01}) == MIXED
    assert primary_pattern({"previous_token": 0.6, "first_token": 0.5, "self": 0.0, "local_window": 0.0}) == MIXED
    assert primary_pattern({"previous_token": 0.45, "first_token": 0.0, "self": 0.0, "local_window": 0.0}) == MIXED
    assert primary_pattern({"previous_token": float("nan"), "first_token": float("nan"), "self": float("nan"),
                            "local_window": float("nan")}) == "none"
    loose = Standout(min_score=0.4, min_margin=0.05)
    assert primary_pattern({"previous_token": 0.45, "first_token": 0.0, "self": 0.0, "local_window": 0.0},
                           loose) == "previous_token"
    with pytest.raises(ValueError, match="min_score"):
        Standout(min_score=2.0)
    # A uniform head and a head split between two behaviours are mixed; a planted head is not.
    uniform = torch.full((1, 2, L, L), 1.0 / L)
    assert all(b.primary_pattern == MIXED for b in analyze_cache({"blocks.0.attn.hook_pattern": uniform}))
    split = 0.5 * _planted(L)[0] + 0.5 * _planted(L)[1]  # half previous token, half first token
    planted = torch.stack([_planted(L)[0], split])[None]
    behaviors = analyze_patterns({0: planted}, is_causal=True)
    assert [b.primary_pattern for b in behaviors] == ["previous_token", MIXED]
    assert behaviors[1].best_pattern in ("previous_token", "first_token") and behaviors[1].primary_score > 0.3


# --------------------------------------------------------------------------- entropy and masking


def _uniform_over_allowed(mask: torch.Tensor, causal: bool) -> torch.Tensor:
    n = mask.shape[1]
    allowed = mask.bool()[:, None, :].expand(-1, n, -1)
    if causal:
        allowed = allowed & torch.ones(n, n, dtype=torch.bool).tril()
    P = allowed.float()
    return (P / P.sum(-1, keepdim=True).clamp(min=1))[:, None].expand(-1, H, -1, -1).clone()


def test_entropy_of_uniform_is_log_of_valid_keys_bidirectional_with_padding():
    enc = _encoder(is_causal=False)
    mask = torch.tensor([[1] * L, [1] * 5 + [0] * 3])
    U = _uniform_over_allowed(mask, causal=False)
    behaviors = analyze_heads(enc, torch.randn(2, L, D), mask, layers=[0],
                              fwd_hooks=[("blocks.0.attn.hook_pattern", lambda p, h: U)])
    # Pooled over valid rows: 8 rows with log 8, 5 rows with log 5 (padded rows ignored).
    want = (8 * math.log(8) + 5 * math.log(5)) / 13
    for b in behaviors:
        assert b.entropy == pytest.approx(want, abs=1e-6)  # float32 weights (1/5 is inexact)
        for name in PATTERNS:  # a uniform head is exactly at chance on every pattern
            assert b.scores[name] == pytest.approx(0.0, abs=1e-6)


def test_entropy_of_uniform_causal_rows():
    mask = torch.ones(1, L, dtype=torch.long)
    stats = pattern_stats(_uniform_over_allowed(mask, causal=True), mask, is_causal=True)
    want = sum(math.log(i + 1) for i in range(L)) / L
    assert stats["entropy"].tolist() == pytest.approx([want] * H, abs=1e-6)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("left", [True, False])
def test_padding_does_not_change_the_analysis(causal, left):
    # Without positional information, an example padded to length 8 attends exactly as the
    # same 5 tokens alone; the analysis must agree (first token = first real position).
    torch.manual_seed(3)
    enc = _encoder(is_causal=causal)
    real = torch.randn(1, 5, D)
    pad = torch.randn(1, 3, D) * 10  # garbage that must be ignored
    x = torch.cat([pad, real], 1) if left else torch.cat([real, pad], 1)
    mask = torch.tensor([[0] * 3 + [1] * 5]) if left else torch.tensor([[1] * 5 + [0] * 3])
    padded = analyze_heads(enc, x, mask)
    alone = analyze_heads(enc, real)
    for a, b in zip(padded, alone):
        assert a.entropy == pytest.approx(b.entropy, abs=1e-5)
        for name in PATTERNS:
            if math.isnan(b.scores[name]):
                assert math.isnan(a.scores[name])
            else:
                assert a.scores[name] == pytest.approx(b.scores[name], abs=1e-5), name
        assert a.primary_pattern == b.primary_pattern


def test_ignoring_the_mask_changes_the_numbers():
    # Guard against a vacuous masking test: analysing the padded example as if all keys
    # were real must give different numbers.
    torch.manual_seed(3)
    enc = _encoder(is_causal=False)
    x = torch.cat([torch.randn(1, 5, D), torch.randn(1, 3, D) * 10], 1)
    mask = torch.tensor([[1] * 5 + [0] * 3])
    _, cache = run_with_cache(enc, x, mask, names_filter=lambda n: n.endswith("hook_pattern"))
    right = analyze_cache(cache, mask)
    wrong = analyze_cache(cache, None)
    assert any(abs(a.entropy - b.entropy) > 1e-3 for a, b in zip(right, wrong))


# --------------------------------------------------------------------------- every variant, errors


def _context(enc, batch: int) -> dict:
    ctx = {}
    for spec in enc.context_inputs():
        shape = [batch if d == "batch" else L if d == "seq" else d for d in spec.shape]
        ctx[spec.name] = torch.randn(*shape) if spec.dtype == "float" else torch.zeros(*shape, dtype=torch.long)
    return ctx


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_encoder(variant):
    torch.manual_seed(0)
    enc = build_encoder(variant, n_layers=2, d_model=D, n_heads=H, seed=0)
    mask = torch.tensor([[1] * L, [1] * 6 + [0] * 2])
    behaviors = analyze_heads(enc, torch.randn(2, L, D), mask, **_context(enc, 2))
    assert len(behaviors) == 2 * H
    for b in behaviors:
        assert 0.0 <= b.entropy <= math.log(L) + 1e-6
        assert b.primary_pattern in PATTERNS + (MIXED,)
        assert set(b.scores) == set(PATTERNS)
        assert all(-1e-9 <= m <= 1 + 1e-9 for m in b.mass.values())


def test_analyze_cache_accepts_a_full_cache_and_reports_errors():
    enc = _encoder()
    x = torch.randn(1, L, D)
    _, cache = run_with_cache(enc, x)  # every hook, not only patterns
    assert len(analyze_cache(cache, is_causal=True)) == 2 * H
    with pytest.raises(ValueError, match="layer"):
        analyze_cache(cache, layers=[5])
    with pytest.raises(ValueError, match="hook_pattern"):
        analyze_cache({"blocks.0.hook_resid_pre": x})
    with pytest.raises(ValueError, match="attention_mask"):
        analyze_cache(cache, torch.ones(1, L + 1))
    with pytest.raises(ValueError, match="out of range"):
        analyze_heads(enc, x, layers=[2])
    with pytest.raises(ValueError, match="no hook point"):
        analyze_heads(enc, x, fwd_hooks=[("blocks.0.attn.hook_nope", lambda p, h: p)])


def test_a_transformers_gpt2_host_and_prefixed_cache_keys():
    # transformers' own GPT-2 with attnx's attention: analyze_heads takes its token ids, and every way of
    # caching gives the one naming scheme (blocks.{i}...); a cache with prefixed keys is understood as well.
    import transformers

    from attnx.explain.analysis import pattern_keys
    from attnx.pretrained import place
    from attnx.pretrained.host import Host

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=D, n_head=H, vocab_size=50, n_positions=16)
    lm = Host(place(transformers.GPT2LMHeadModel(cfg), "mha"), "causal-lm").eval()
    ids = torch.randint(0, 50, (2, L))
    direct = analyze_heads(lm, ids)
    _, cache = run_with_cache(lm, ids)
    assert pattern_keys(cache) == {0: "blocks.0.attn.hook_pattern", 1: "blocks.1.attn.hook_pattern"}
    via_cache = analyze_cache(cache, is_causal=True)
    _, own = lm.run_with_cache(ids, names_filter=lambda n: n.endswith("hook_pattern"))
    assert sorted(own) == ["blocks.0.attn.hook_pattern", "blocks.1.attn.hook_pattern"]
    prefixed = {f"encoder.{k}": v for k, v in own.items()}
    assert [b.to_dict() for b in direct] == [b.to_dict() for b in via_cache] == \
        [b.to_dict() for b in analyze_cache(own, is_causal=True)] == \
        [b.to_dict() for b in analyze_cache(prefixed, is_causal=True)]
    with pytest.raises(ValueError, match="two patterns"):
        pattern_keys({**prefixed, **own})
