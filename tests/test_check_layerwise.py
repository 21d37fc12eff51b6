"""``attnx check`` on a with-past export without the whole fp32 model in memory (issue 44, item 5).

- transformers' layers run one at a time (:class:`attnx.parity.layerwise.LayerwiseOriginal`) give transformers'
  own logits, and never hold more than one decoder layer's weights;
- the layer-by-layer check of an fp32 export passes with its logits within the fp32 bound of the original; of an
  int4 export, it finds the same perplexities as the full check (same runtime, same fp32 original);
- ``attnx check`` takes that path when the full check would not fit the memory available, and says so.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import generation_fixtures as gf

import transformers
transformers.logging.set_verbosity_error()

from attnx.contract import ModelInfo  # noqa: E402
from attnx.parity import layerwise, run_check  # noqa: E402


@pytest.fixture(scope="module")
def fp32_export():
    return gf.export(gf.folder("llama"), "mha")


@pytest.fixture(scope="module")
def int4_export():
    return gf.export(gf.folder("llama"), "mha", weight_only_bits=4)


def test_layers_one_at_a_time_give_transformers_logits_holding_one_layer(monkeypatch):
    folder = gf.folder("llama")
    original = layerwise.LayerwiseOriginal(folder)
    held = []

    def materialised() -> int:
        return sum(any(p.device.type != "meta" for p in layer.parameters()) for layer in original.model.model.layers)

    real = original._materialise
    monkeypatch.setattr(original, "_materialise", lambda m, prefix: (real(m, prefix), held.append(materialised())))
    sequences = [[5, 9, 33, 7, 100, 4], [8, 12]]
    got = original.logits(sequences)
    assert held and max(held) == 1  # every layer read in turn, never two at once
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    for seq, logits in zip(sequences, got):
        with torch.no_grad():
            want = hf(input_ids=torch.tensor([seq])).logits[0].numpy()
        assert logits.shape == want.shape
        np.testing.assert_allclose(logits, want, atol=1e-4, rtol=1e-4)


def test_the_layerwise_check_of_an_fp32_export_passes_within_the_fp32_bound(fp32_export, monkeypatch):
    monkeypatch.setenv("ATTNX_CHECK_LAYERWISE", "1")
    report = run_check(fp32_export)
    assert report.passed
    assert report.notes[0].startswith("checked layer by layer: ATTNX_CHECK_LAYERWISE=1")
    (logits,) = report.comparisons
    assert logits["reference"] == "original (layer by layer)" and logits["max_abs"] < 1e-3
    assert report.tokens[0]["differ"] == 0


def test_the_layerwise_check_of_an_int4_export_finds_the_full_checks_perplexities(int4_export, monkeypatch):
    full = run_check(int4_export)
    monkeypatch.setenv("ATTNX_CHECK_LAYERWISE", "1")
    layered = run_check(int4_export)
    (q_full,), (q_layered,) = full.quality, layered.quality
    assert q_layered["tokens"] == q_full["tokens"] > 100
    assert q_layered["reference_perplexity"] == pytest.approx(q_full["reference_perplexity"], rel=1e-4)
    assert q_layered["perplexity"] == pytest.approx(q_full["perplexity"], rel=1e-6)
    assert q_layered["greedy_common_prefix"] == pytest.approx(q_full["greedy_common_prefix"])
    assert q_layered["passed"] == q_full["passed"]


def test_check_goes_layer_by_layer_when_the_full_check_would_not_fit(fp32_export, monkeypatch):
    info = ModelInfo.read(fp32_export)
    assert layerwise.layerwise_reason(info) is None  # a tiny model fits
    params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(
        gf.folder("llama"), local_files_only=True).parameters())
    assert layerwise.reference_bytes(info) == 8 * params
    monkeypatch.setattr(layerwise, "available_memory", lambda: 4 * params)  # holds half of what it needs
    reason = layerwise.layerwise_reason(info)
    assert reason is not None and "more than the" in reason
    report = run_check(fp32_export)
    assert report.passed and report.notes[0].startswith(f"checked layer by layer: {reason}")
