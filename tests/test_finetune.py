"""A placed variant trained with sentence-transformers' own trainer (issue 22, item 4):
``examples/finetune_variant.py`` places smal (and maw, with its GRPO loss added to the training
loss) in the real all-MiniLM-L6-v2, trains it with ``SentenceTransformerTrainer`` and
``MultipleNegativesRankingLoss`` on the built-in paraphrase pairs, saves the folder, exports it and
checks it: the variant parameters leave their neutral values, ONNX Runtime equals the trained torch
model, and ``attnx check`` compares against that trained model and says so."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import datasets  # noqa: E402,F401
sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
import finetune_variant  # noqa: E402


@pytest.mark.slow
def test_smal_trained_with_sentence_transformers_exports_the_trained_model(tmp_path):
    figures = finetune_variant.finetune("smal", steps=6, out=tmp_path, batch=16, log=lambda *_: None)
    gammas = [v for n, v in figures["moved"].items() if n.endswith("attnx.gamma")]
    assert len(gammas) == 6 and min(gammas) > 1e-4  # every layer's gamma left its neutral 0
    assert figures["ort_vs_trained"] <= 1e-4
    assert figures["check_passed"] and figures["check_used_trained"]
    assert "compared with the trained model" in figures["check_note"] and "smal placement" in figures["check_note"]

    from attnx import pretrained

    host = pretrained.load(figures["folder"])  # the saved folder carries the placement and trained weights
    assert host.variant == "smal" and float(host.blocks[0].attn.gamma.detach().abs()) > 1e-4


@pytest.mark.slow
def test_maw_policy_is_trained_by_its_grpo_loss_and_inference_takes_the_argmax(tmp_path):
    figures = finetune_variant.finetune("maw", steps=4, out=tmp_path, batch=16, log=lambda *_: None)
    policy = [v for n, v in figures["moved"].items() if ".policy." in n]
    assert policy and max(policy) > 0  # only the GRPO loss reaches the policy (the argmax has no gradient)
    assert figures["ort_vs_trained"] <= 1e-4 and figures["check_passed"] and figures["check_used_trained"]


def test_the_aux_loss_wrapper_adds_every_forwards_grpo_loss():
    """MNRL embeds anchors and positives in two forwards: the GRPO loss of each is added."""
    from attnx.pretrained import placing

    class Loss(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, features, labels):
            return sum(self.model(**f).last_hidden_state.sum() * 0 for f in features)

    import transformers

    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32)
    model = placing.place(transformers.BertModel(config), "maw").train()
    wrapped = finetune_variant.WithAuxLoss(Loss(model), model)
    ids = torch.randint(0, 50, (4, 6))
    total = wrapped([{"input_ids": ids}, {"input_ids": ids.flip(0)}], None)
    assert len(wrapped._aux) == 2 and torch.allclose(total, torch.stack(wrapped._aux).sum())
