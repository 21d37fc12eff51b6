"""Placing a variant in transformers' own models (``attnx.pretrained.place``): what a user who trains
a variant into their own model relies on, on every family of the support matrix.

- the toy sixth variant (tests/toy_variant.py, no package file edited) placed in every family starts
  as the original model and, once its own parameters move, changes it;
- TransformerLens hook names on every family; the patterns in the cache equal transformers' eager
  attention weights;
- context inputs go in through the model call; a missing one is one clear error;
- a placed model is an ordinary transformers model: gradients reach the variant's parameters (and the
  base unless frozen), ``save_pretrained`` records the placement, and loading the saved folder gives
  the same model; its export equals the trained torch model;
- layers not chosen keep plain attention.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import hf_folders  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402
transformers.logging.set_verbosity_error()

from attnx import pretrained  # noqa: E402
from attnx.models.hooks import run_with_cache  # noqa: E402
from attnx.pretrained import placing  # noqa: E402
from attnx.pretrained.host import TASKS, positions_from_mask  # noqa: E402

FAMILIES = list(hf_folders.FAMILIES)


pytestmark = pytest.mark.usefixtures("toy_registered")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return hf_folders.lazy_folders(tmp_path_factory.mktemp("placing"))


def batch(host, left: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, host.vocab_size, (2, 9), generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    if left:
        mask[1, :3] = 0
    else:
        mask[1, 6:] = 0
    return ids, mask


def eager_output(folder, host, ids, mask):
    eager = getattr(transformers, TASKS[host.task]).from_pretrained(str(folder), attn_implementation="eager").eval()
    kwargs = {"input_ids": ids, "attention_mask": mask}
    if host.causal:
        kwargs["position_ids"] = positions_from_mask(mask)
    with torch.no_grad():
        out = eager(**kwargs, output_attentions=True)
    main = out.last_hidden_state if host.task == "feature-extraction" else out.logits
    return main, out.attentions


def main_output(host, out):
    return out["last_hidden_state"] if host.task == "feature-extraction" else out["logits"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_toy_variant_works_on_every_family(family, folders):
    folder = folders(family)
    host = pretrained.load(folder, "toy")
    assert [b.variant for b in host.blocks] == ["toy"] * len(host.blocks)
    ids, mask = batch(host, left=host.causal)
    feeds = {"input_ids": ids, "attention_mask": mask, "temperature": torch.full((2,), 2.5)}
    want, _ = eager_output(folder, host, ids, mask)
    with torch.no_grad():
        got = main_output(host, host.forward_named(feeds))
        for block in host.blocks:
            block.attn.exponent.fill_(1.0)  # trained: the temperature now acts
        moved = main_output(host, host.forward_named(feeds))
    real = mask.bool() if got.dim() == 3 else slice(None)
    assert float((got - want)[real].abs().max()) <= 1e-4
    assert float((moved - want)[real].abs().max()) > 1e-3


@pytest.mark.parametrize("family", ["bert", "distilbert", "modernbert", "llama", "qwen3", "gemma3", "gpt2", "phi3"])
def test_hook_names_and_patterns_equal_transformers_eager_attentions(family, folders):
    folder = folders(family)
    host = pretrained.load(folder, "mha")
    ids, mask = batch(host, left=host.causal)
    _, attentions = eager_output(folder, host, ids, mask)
    with torch.no_grad():
        _, cache = run_with_cache(host, ids, mask, names_filter=lambda n: n.endswith(("hook_pattern", "hook_resid_post",
                                                                                   "hook_z", "hook_k")))
    n_layers = len(host.blocks)
    assert n_layers == len(attentions)
    cfg = placing.text_config(host.hf)
    heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    for i in range(n_layers):
        pattern = cache[f"blocks.{i}.attn.hook_pattern"]
        assert pattern.shape == (2, heads, 9, 9)
        real = mask.bool()
        # padded query rows carry no meaning; on real rows the pattern is transformers' own
        err = (pattern - attentions[i]).abs()[real[:, None, :, None].expand_as(pattern)]
        assert float(err.max()) <= 1e-5, (i, float(err.max()))
        assert cache[f"blocks.{i}.attn.hook_k"].shape[2] == kv_heads  # grouped-query k as the family has it
        assert cache[f"blocks.{i}.hook_resid_post"].shape[:2] == (2, 9)


def test_context_goes_in_through_the_model_call_and_a_missing_one_is_one_error(folders):
    folder = folders("llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    placing.place(model, "smal", layers=[1])
    with torch.no_grad():
        for block in placing.blocks(model):
            if block.variant == "smal":
                block.attn.gamma.fill_(0.7)  # "trained": the context acts
    ids = torch.randint(4, 100, (2, 7))
    s, trace = torch.randn(2, 32), torch.randn(2, 8, 8) * 0.3
    with torch.no_grad():
        a = model(input_ids=ids, self_state=s, trace=trace).logits
        with pretrained.context(self_state=s, trace=trace):
            b = model(input_ids=ids).logits
        c = model(input_ids=ids, self_state=s, trace=trace * 2).logits
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert float((a - c).abs().max()) > 1e-3
    with pytest.raises(ValueError, match=r"missing context input\(s\) self_state \[batch, 32\] float, trace"):
        model(input_ids=ids)
    with pytest.raises(ValueError, match=r"trace: expected shape"):
        model(input_ids=ids, self_state=s, trace=torch.randn(2, 5, 5))


def test_gradients_reach_the_variant_and_the_base_unless_frozen(folders):
    folder = folders("qwen2")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    placing.place(model, "cultural")
    model.train()
    ids = torch.randint(4, 100, (2, 8))
    out = model(input_ids=ids, labels=ids, cultural=torch.randn(2, 32))
    out.loss.backward()
    names = set(placing.variant_parameter_names(model))
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert names and all(grads[n] is not None and float(grads[n].abs().sum()) > 0 for n in names if n.endswith("lam"))
    assert grads["model.embed_tokens.weight"] is not None
    model.zero_grad()
    for n, p in model.named_parameters():
        p.requires_grad_(n in names)
    model(input_ids=ids, labels=ids, cultural=torch.randn(2, 32)).loss.backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n not in names)


def test_save_pretrained_records_the_placement_and_the_saved_folder_is_the_trained_model(folders, tmp_path):
    import json

    import numpy as np
    import onnxruntime as ort

    from attnx.export.pretrained import export_pretrained

    folder = folders("mistral")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    placing.place(model, "smal", layers=[0])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".attnx." in n:
                p.add_(0.3 * torch.randn_like(p))  # trained
    saved = tmp_path / "trained"
    model.save_pretrained(saved)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (saved / f).write_bytes((folder / f).read_bytes())
    assert json.loads((saved / "config.json").read_text())["attnx"]["placement"] == {
        "variant": "smal", "layers": [0], "append": 0, "options": {}}
    host = pretrained.load(saved)
    assert host.variant == "smal" and host.replaced == [0]
    ids, mask = batch(host, left=True)
    ctx = {"self_state": torch.randn(2, 32), "trace": torch.randn(2, 8, 8) * 0.3}
    with torch.no_grad():
        want = model.eval()(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask), **ctx).logits
        got = host.forward_named({"input_ids": ids, "attention_mask": mask, **ctx})["logits"]
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    with pytest.raises(ValueError, match="carries a trained placement"):
        pretrained.load(saved, "cultural")
    result = export_pretrained(saved, tmp_path / "trained.onnx")
    sess = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), **{k: v.numpy() for k, v in ctx.items()}}
    onnx_logits = sess.run(["logits"], feeds)[0]
    real = mask.bool().numpy()
    assert np.abs(onnx_logits - want.numpy())[real].max() <= 1e-4


def test_layers_not_chosen_keep_plain_attention_and_placing_twice_is_refused(folders):
    model = transformers.AutoModel.from_pretrained(str(folders("roberta")))
    placing.place(model, "smal", layers=[1])
    assert [b.variant for b in placing.blocks(model)] == ["mha", "smal"]
    assert [n.split(".attnx.")[1] for n in placing.variant_parameter_names(model)] == [
        "gamma", "self_gate.bias", "self_gate.weight"]
    with pytest.raises(ValueError, match="already has a placed variant"):
        placing.place(model, "cultural")


def test_the_transformers_trainer_and_peft_train_a_placed_variant(folders, tmp_path):
    """The trainers people use: transformers' Trainer (full fine-tuning) and PEFT's LoRA with the variant's
    own parameters trained beside the adapters; the merged model exports as the trained model."""
    import numpy as np
    import onnxruntime as ort
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model

    from attnx.export.pretrained import export_pretrained

    folder = folders("llama")
    ids = torch.randint(4, 100, (16, 10), generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    placing.place(model, "cultural")
    before = {n: p.detach().clone() for n, p in model.named_parameters() if ".attnx." in n}
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "t"), max_steps=3, per_device_train_batch_size=8,
                                          learning_rate=0.05, report_to="none", save_strategy="no", use_cpu=True)
    with pretrained.context(cultural=torch.randn(1, 32)):
        transformers.Trainer(model=model, args=args, train_dataset=data).train()
    assert max(float((p.detach() - before[n]).abs().max()) for n, p in model.named_parameters() if n in before) > 0

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    placing.place(model, "cultural")
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_alpha=8))
    for n, p in lora.named_parameters():
        if ".attnx." in n:
            p.requires_grad_(True)  # the variant learns with the adapters; the base stays frozen
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert any("lora_" in n for n in trainable) and any(".attnx." in n for n in trainable)
    assert not any(n.endswith("embed_tokens.weight") for n in trainable)
    with pretrained.context(cultural=torch.randn(1, 32)):
        transformers.Trainer(model=lora, args=args, train_dataset=data).train()
    merged = lora.merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "merged" / f).write_bytes((folder / f).read_bytes())
    result = export_pretrained(tmp_path / "merged", tmp_path / "merged.onnx")
    ctx = torch.randn(2, 32)
    x = ids[:2]
    with torch.no_grad():
        want = merged.eval()(input_ids=x, cultural=ctx).logits.numpy()
    sess = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    got = sess.run(["logits"], {"input_ids": x.numpy(), "attention_mask": np.ones_like(x.numpy()),
                                "cultural": ctx.numpy()})[0]
    assert np.abs(got - want).max() <= 1e-4
