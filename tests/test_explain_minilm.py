"""`attnx explain` on the real all-MiniLM-L6-v2 (issue 13, items 3, 5, 6): the heads a reader expects,
found from the exported model's outputs; head ablation through ``head_mask`` against the torch
reference and sentence-transformers; activation patching beside it; two context values compared."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from explain_fixtures import MINILM, ablate_columns, explained_minilm  # noqa: E402

from attnx.explain.analysis import MIXED, analyze_patterns  # noqa: E402
from attnx.explain.explanation import compare_contexts, explain  # noqa: E402
from attnx.models.hooks import hooks  # noqa: E402
from attnx.explain.page import explanation_page  # noqa: E402
from attnx.explain.source import ExplainError  # noqa: E402
from attnx.interp.patching import ablation_table  # noqa: E402
from attnx.interp.source import open_source, reference_source  # noqa: E402
from attnx.pretrained.sentences import SENTENCES  # noqa: E402
from support.cli import run as attnx  # noqa: E402

@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return explained_minilm()


@pytest.fixture(scope="module")
def source(export):
    s = open_source(export.path)
    yield s
    s.close()


@pytest.fixture(scope="module")
def explained(source):
    return explain(source, list(SENTENCES))


def test_the_heads_a_reader_expects(explained):
    by = {(b.layer, b.head): b for b in explained.behaviors}
    prev = [b for b in explained.behaviors if b.primary_pattern == "previous_token"]
    sink = [b for b in explained.behaviors if b.primary_pattern == "first_token"]
    # Layer 0 head 2 copies the previous token on every sentence: a textbook previous-token head.
    assert (0, 2) in [(b.layer, b.head) for b in prev]
    assert by[0, 2].scores["previous_token"] > 0.95 and by[0, 2].entropy < 0.05
    # [CLS]/[SEP] sinks: at least one head parks most of its attention there, clearly.
    best_sink = max(sink, key=lambda b: b.scores["first_token"])
    assert best_sink.scores["first_token"] > 0.6 and best_sink.mass["first_token"] > 0.6
    # Most heads do not stand out: they are called mixed, not forced into a label.
    assert sum(b.primary_pattern == MIXED for b in explained.behaviors) > len(explained.behaviors) // 2
    # Every label that is given stands out by the documented rule.
    for b in explained.behaviors:
        ranked = sorted((s for s in b.scores.values() if not math.isnan(s)), reverse=True)
        stands = ranked[0] >= 0.5 and ranked[0] - ranked[1] >= 0.2
        assert (b.primary_pattern != MIXED) == stands, (b.layer, b.head, b.scores)


def test_the_numbers_equal_transformers_own_attentions(explained):
    import transformers

    hf = transformers.BertModel.from_pretrained(str(MINILM), local_files_only=True, attn_implementation="eager").eval()
    feeds = {k: torch.from_numpy(v) for k, v in explained.batch.feeds.items()}
    with torch.no_grad():
        atts = hf(**feeds, output_attentions=True).attentions
    theirs = analyze_patterns({i: a.numpy() for i, a in enumerate(atts)}, explained.batch.attention_mask,
                              sinks=explained.batch.special)
    for a, b in zip(explained.behaviors, theirs):
        assert a.primary_pattern == b.primary_pattern
        assert a.entropy == pytest.approx(b.entropy, abs=1e-4)
        for name, value in b.scores.items():
            assert a.scores[name] == pytest.approx(value, abs=1e-4)


def test_ablation_matches_the_torch_reference_and_sentence_transformers(source, export):
    from sentence_transformers import SentenceTransformer

    batch = source.encoder.encode(["The cat sat on the mat.", "A man is playing a guitar."])
    table = ablation_table(source, batch, 1, reference=reference_source(export.path))
    deployed, ref, patched = (np.array([r[c] for r in table.rows]) for c in table.columns)
    assert table.columns == ["ablated (deployed)", "ablated (torch reference)", "patched: share restored"]
    assert np.abs(deployed - ref).max() <= 1e-5
    assert list(deployed) == sorted(deployed, reverse=True) and deployed.max() > 1e-3
    # The same ablation in sentence-transformers itself: the head's output-projection columns zeroed.
    st = SentenceTransformer(str(MINILM), device="cpu")
    base = st.encode(batch.texts, convert_to_numpy=True)
    top = table.rows[0]["head"]
    ablate_columns(st[0].auto_model.encoder.layer[1].attention.output.dense, top, 32)
    changed = st.encode(batch.texts, convert_to_numpy=True)
    cos = (base * changed).sum(1) / np.linalg.norm(base, axis=1) / np.linalg.norm(changed, axis=1)
    assert float((1 - cos).mean()) == pytest.approx(table.rows[0]["ablated (deployed)"], rel=1e-3, abs=1e-6)
    assert np.isfinite(patched).all() and patched.max() > 0


def test_patching_column_is_activation_patching(export, source):
    ref = reference_source(export.path)
    batch = source.encoder.encode(["The cat sat on the mat."])
    corrupt = source.encoder.encode(["The dog sat on the rug."])
    table = ablation_table(source, batch, 0, reference=ref, corrupt=corrupt)
    restored = {r["head"]: r["patched: share restored"] for r in table.rows}
    # By hand: run the corrupted text with head 2's hook_z taken from the clean run.
    host = ref.model.model
    feeds = {k: torch.from_numpy(v) for k, v in batch.feeds.items()}
    bad = {k: torch.from_numpy(v) for k, v in corrupt.feeds.items()}
    with torch.no_grad():
        clean_cache = {}
        with hooks(host, [("blocks.0.attn.hook_z", lambda z, h: clean_cache.__setitem__("z", z.clone()))]):
            clean = host.forward_named(feeds)["sentence_embedding"].numpy()
        dirty = host.forward_named(bad)["sentence_embedding"].numpy()

        def patch(z, h):
            z = z.clone()
            z[:, :, 2] = clean_cache["z"][:, :, 2]
            return z

        with hooks(host, [("blocks.0.attn.hook_z", patch)]):
            patched = host.forward_named(bad)["sentence_embedding"].numpy()

    def dist(a, b):
        return float(1 - (a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))

    assert restored[2] == pytest.approx(1 - dist(clean, patched) / dist(clean, dirty), abs=1e-6)
    assert "dog" in table.patching


def test_cli_prints_the_table_writes_page_and_pngs(export, tmp_path):
    page = tmp_path / "page.html"
    res = attnx("explain", str(export.path), "The cat sat on the mat.", "-o", str(page), "--layer", "0", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["tokens"][0] == ["[CLS]", "the", "cat", "sat", "on", "the", "mat", ".", "[SEP]"]
    heads = {h["head"]: h for h in out["heads"]}
    assert len(heads) == 12 and heads[2]["primary_pattern"] == "previous_token"
    html = page.read_text()
    assert "attnx-data" in html and '"[CLS]"' in html
    assert (tmp_path / "page-heatmaps" / "layer0.png").stat().st_size > 5000
    res = attnx("explain", str(export.path), "The cat sat on the mat.", "-o", str(page), "--ablate", "--layer", "1",
                "--no-reference")
    assert res.returncode == 0, res.stderr
    assert "each head ablated" in res.stdout and "previous_token" not in res.stdout.split("each head ablated")[1]


def test_pretrained_folder_gives_the_same_analysis(explained):
    folder = open_source(MINILM)
    ex = explain(folder, list(SENTENCES))
    assert folder.label == "torch"
    for a, b in zip(explained.behaviors, ex.behaviors):
        assert a.primary_pattern == b.primary_pattern
        assert a.scores["previous_token"] == pytest.approx(b.scores["previous_token"], abs=1e-4)


def test_bad_input_is_one_clear_error(export, tmp_path):
    plain = tmp_path / "plain.onnx"
    from attnx.export.pretrained import export_pretrained

    res = attnx("explain", str(export.path), "hi", "--layer", "6")
    assert res.returncode != 0 and "layer 6 out of range" in res.stderr and "6 layers" in res.stderr
    res = attnx("explain", str(export.path), "hi", "--mask", "0.12")
    assert res.returncode != 0 and "head 12 out of range" in res.stderr
    for err in (res.stderr,):
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    export_pretrained(MINILM, plain)  # no attention outputs, no head mask
    res = attnx("explain", str(plain), "hi")
    assert res.returncode != 0 and "has no attention outputs" in res.stderr and "--attention-outputs" in res.stderr
    src = open_source(export.path)
    with pytest.raises(ExplainError, match=r"head_mask: shape \[12, 6\], .* takes \[6, 12\]"):
        explain(src, ["hi"], head_mask=np.ones((12, 6)))
    with pytest.raises(ExplainError, match="dtype"):
        explain(src, ["hi"], head_mask=np.array([["a"] * 12] * 6))
    with pytest.raises(ExplainError, match="takes no context inputs"):
        compare_contexts(src, ["hi"], {}, {})


# ----------------------------------------------------------------------------- context values and maw


def test_context_comparison_smal(tmp_path_factory, tmp_path):
    result = explained_minilm("smal", randomize=True, layers=[0, 1])
    src = open_source(result.path)
    spec = {e.name: e for e in src.facts.context_inputs}
    assert set(spec) == {"self_state", "trace"}
    d_self = spec["self_state"].shape[1]
    a_json, b_json = tmp_path / "a.json", tmp_path / "b.json"
    dh = spec["trace"].shape[-1]  # the trace is shared (given once): only self_state differs
    a_json.write_text(json.dumps({"self_state": [0.0] * d_self, "trace": (0.05 * np.eye(dh)).tolist()}))
    b_json.write_text(json.dumps({"self_state": [1.5] * d_self}))
    from attnx.explain.source import read_context

    cmp = compare_contexts(src, ["The cat sat on the mat."], read_context(a_json, src.facts),
                           read_context(b_json, src.facts))
    changed = [d for d in cmp.differences if d.layer in (0, 1)]
    assert max(d.mean_abs for d in changed) > 1e-3 and cmp.output_distance["value"] > 1e-6
    # Both maps equal the torch reference under each context value.
    ref = reference_source(result.path)
    for ex in (cmp.a, cmp.b):
        want = explain(ref, ex.batch, context=ex.context)
        for layer in (0, 1, 5):
            np.testing.assert_allclose(ex.patterns[layer], want.patterns[layer], atol=1e-5, rtol=0)
    data = explanation_page(cmp.a, compare=cmp)
    assert '"labels":["A","B"]' in data and "output_distance" in data
    res = attnx("explain", str(result.path), "The cat sat on the mat.", "--context", str(a_json), "--against",
                str(b_json), "-o", str(tmp_path / "cmp.html"), "--no-png")
    assert res.returncode == 0, res.stderr
    assert "output distance (context A vs B)" in res.stdout
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"self_state": [0.0] * (d_self + 1)}))
    res = attnx("explain", str(result.path), "hi", "--context", str(bad))
    assert res.returncode != 0 and "self_state has shape" in res.stderr


def test_maw_page_shows_the_depth_chosen_per_example(tmp_path_factory):
    result = explained_minilm("maw", randomize=True)
    src = open_source(result.path)
    extras = [e.name for e in src.facts.extra_outputs]
    assert extras and src.facts.n_layers == 7  # six MiniLM layers and the appended MAW layer
    ex = explain(src, ["The cat sat on the mat.", "Where is the nearest train station?"])
    ref = explain(reference_source(result.path), ex.batch)
    for name in extras:
        np.testing.assert_array_equal(ex.outputs[name], ref.outputs[name])
    np.testing.assert_allclose(ex.patterns[6], ref.patterns[6], atol=1e-5, rtol=0)  # the chosen depth's pattern
    html = explanation_page(ex)
    data = json.loads(html.split('id="attnx-data">')[1].split("</script>")[0])
    for row, example in enumerate(data["examples"]):
        shown = {x["name"]: x["value"] for x in example["extras"]}
        assert shown[extras[0]] == ex.outputs[extras[0]][row].tolist()
