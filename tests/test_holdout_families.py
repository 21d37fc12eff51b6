"""Families and sizes beyond the support matrix (issue 22's hold-out bar): each built from its own
transformers config at a size the matrix does not use (random weights, ``save_pretrained``),
exported with ``mha`` and with a placed variant at neutral init, and compared with transformers'
``eager`` model on padded batches (decoders: left and right padding): max abs <= 1e-4.

Covers what a new family brings: logit soft-capping (Gemma 2), partial rotary (GPT-NeoX, Phi,
Persimmon), QK norms (OLMo 2), mixture-of-experts MLPs (Mixtral, Qwen2-MoE, GraniteMoE), learned
absolute positions with an offset (OPT), a model whose code only holds from seq 2 on (MobileBERT),
encoders with RoPE (EuroBERT, GTE, NomicBERT) and ALBERT's shared layers.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_families import write_matrix  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402
transformers.logging.set_verbosity_error()

BASE = dict(vocab_size=160, hidden_size=48, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
            intermediate_size=72, max_position_embeddings=80, pad_token_id=0, bos_token_id=1, eos_token_id=2)
#: model_type -> (config overrides, placed variant)
HOLDOUT = {
    "albert": (dict(embedding_size=24, num_key_value_heads=None), "smal"),
    "gemma2": (dict(head_dim=16, sliding_window=8), "cultural"),
    "gpt_neox": (dict(rotary_pct=0.5, num_key_value_heads=None), "metaphor"),
    "phi": (dict(partial_rotary_factor=0.5), "smal"),
    "olmo2": ({}, "cultural"),
    "starcoder2": ({}, "smal"),
    "opt": (dict(ffn_dim=72, word_embed_proj_dim=48, num_key_value_heads=None), "cultural"),
    "mixtral": (dict(num_local_experts=4, num_experts_per_tok=2), "smal"),
    "qwen2_moe": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                       shared_expert_intermediate_size=24), "metaphor"),
    "mobilebert": (dict(embedding_size=16, intra_bottleneck_size=24, true_hidden_size=24,
                        num_key_value_heads=None), "smal"),
    "eurobert": ({}, "cultural"),
    "gte": (dict(num_key_value_heads=None), "smal"),
    "persimmon": (dict(num_key_value_heads=None), "maw"),
    "cohere": ({}, "smal"),
}


def build(model_type: str, root: Path) -> tuple[Path, str]:
    overrides, _ = HOLDOUT[model_type]
    kwargs = {k: v for k, v in {**BASE, **overrides}.items() if v is not None}
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    try:
        cls = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        cls = transformers.AutoModel._model_mapping[type(config)]
    config.architectures = [cls.__name__]
    torch.manual_seed(1)
    model = cls(config).eval()
    with torch.no_grad():  # widen the tiny init: outputs far from constant
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(8.0)
    folder = root / model_type
    model.save_pretrained(folder)
    return folder, cls.__name__


@pytest.fixture(scope="module")
def results():
    found: dict[str, dict] = {}
    yield found
    write_matrix(found)


@pytest.mark.parametrize("model_type", HOLDOUT)
def test_holdout_family_exports_equal_transformers_eager(model_type, results, tmp_path):
    import onnxruntime as ort

    from attnx.export.pretrained import export_pretrained
    from attnx.pretrained.host import TASKS, positions_from_mask

    folder, architecture = build(model_type, tmp_path)
    variant = HOLDOUT[model_type][1]
    for name in ("mha", variant):
        result = export_pretrained(folder, tmp_path / f"{model_type}-{name}.onnx", variant=name)
        host = result.model
        eager = getattr(transformers, TASKS[host.task]).from_pretrained(str(folder), attn_implementation="eager")
        sess = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
        out_name = "last_hidden_state" if host.task == "feature-extraction" else "logits"
        worst = 0.0
        for left in ([False, True] if host.causal else [False]):
            g = np.random.default_rng(0)
            ids = g.integers(3, 150, (3, 12))
            mask = np.ones((3, 12), np.int64)
            for row, pad in ((1, 4), (2, 2)):
                if left:
                    mask[row, :pad] = 0
                else:
                    mask[row, 12 - pad:] = 0
            feeds = {"input_ids": ids, "attention_mask": mask}
            for i in sess.get_inputs():
                if i.name == "token_type_ids":
                    feeds[i.name] = np.zeros_like(ids)
                elif i.name not in feeds:  # context: any value (neutral placements ignore it)
                    feeds[i.name] = g.standard_normal([3 if d == "batch" else d for d in i.shape]).astype(np.float32)
            got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))[out_name]
            kwargs = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}
            if host.causal:
                kwargs["position_ids"] = positions_from_mask(kwargs["attention_mask"])
            with torch.no_grad():
                want = getattr(eager.eval()(**kwargs), out_name).numpy()
            real = mask.astype(bool)
            assert np.abs(want[real]).max() > 0.1  # far from a constant (Cohere scales its logits by 1/16)
            worst = max(worst, float(np.abs(got - want)[real].max()))
        results[f"{model_type}/{name}"] = {"family": model_type, "variant": name, "architecture": architecture,
                                           "holdout": True, "ort_vs_eager": worst,
                                           "padding": "left+right" if host.causal else "right",
                                           "size": "hidden 48, 3 layers, 6 heads"}
        assert worst <= 1e-4, (model_type, name, worst)
