"""Helpers shared by the generation tests (imported by them; pytest does not load it by itself).

Random-weight folders of ``tests/hf_folders.py``, trained placements and their with-past exports come
from the shared export cache (``tests/support``), so each model is made and exported once for every
module, worker and run. ``trained_folder`` saves a placed model whose variant is moved off its neutral
values (what a fine-tuned placement looks like), so the variant's own math is what the cache has to carry.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from support import cache, exports  # noqa: E402

#: A chat template in the form transformers' templates take (tokenizer_config.json's ``chat_template``).
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def folder(name: str) -> Path:
    """The family's folder (shared: don't change it)."""
    return exports.hf_folder(name)


def _heads_of_16(path: Path) -> None:
    """The tiny Llama re-made with 2 query heads and 1 key/value head of 16 (ONNX Runtime's GroupQueryAttention
    takes head sizes that are multiples of 16; the tiny one's are 8), random weights widened as the others'."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 2, 1, 16
    torch.manual_seed(16)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.mul_(8.0) if p.dim() >= 2 else p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(path)


def wide_heads_folder() -> Path:
    """The tiny random Llama with heads of 16 (2 query heads sharing 1 key/value head)."""
    return exports.hf_folder("llama", edit=_heads_of_16, tag="head-dim-16")


def _add_chat_template(path: Path) -> None:
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))


def chat_folder() -> Path:
    """The Llama folder with a chat template in its tokenizer_config.json."""
    return exports.hf_folder("llama", edit=_add_chat_template, tag="chat-template")


def move_off_neutral(host, seed: int = 0) -> None:
    """Every placed variant's own parameters moved off their neutral values (seeded): smal's gamma, cultural's
    lambda, metaphor's gate, maw's output projection and policy, the toy's temperature exponent."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in host.hf.named_parameters():
            if ".attnx." not in f".{name}" and ".attnx_layer." not in f".{name}":
                continue
            if name.endswith("gamma"):
                p.fill_(0.8)
            elif name.endswith(".lam"):
                p.fill_(0.5)
            elif name.endswith("exponent"):
                p.fill_(1.0)
            elif "W_g" in name or "W_O" in name or "policy" in name:
                p.add_(torch.randn(p.shape, generator=g) * (2.0 if "policy" in name else 0.3))
            elif name.endswith("b_g") or name.endswith("W_g.bias"):
                p.fill_(0.5)


def trained_folder(family: str, variant: str, **placement) -> Path:
    """A folder saved from ``family`` with ``variant`` placed and moved off neutral (its tokenizer copied)."""
    src = folder(family)

    def make(path: Path) -> None:
        from attnx import pretrained

        host = pretrained.load(src, variant, **placement)
        move_off_neutral(host)
        host.hf.save_pretrained(path)
        for f in src.iterdir():
            if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
                shutil.copyfile(f, path / f.name)

    key = "-".join([family, variant] + [f"{k}{v}" for k, v in sorted(placement.items())]).replace(" ", "")
    return cache.entry(key, make, kind="trained", source=src, variant=variant, placement=placement)


def export(source: Path, variant: str | None = None, lowering: str = "plugin", **kw) -> Path:
    """The with-past export of ``source``: its ``model.onnx`` path (from the export cache)."""
    return exports.pretrained(source, variant, lowering=lowering, with_past=True, **kw).path


def greedy_transformers(source: Path, prompt: list[int], n: int) -> list[int]:
    """transformers' own ``generate`` (greedy, no stop) on a folder."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(source, local_files_only=True).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=hf.config.pad_token_id)
    return out[0, len(prompt):].tolist()


def greedy_full_recompute(host, prompt: list[int], n: int, context: dict | None = None) -> list[int]:
    """Greedy generation by re-running the whole sequence each step (no cache): the criterion."""
    seq = list(prompt)
    for _ in range(n):
        ids = torch.tensor([seq])
        with torch.no_grad():
            logits = host.forward_named({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                         **(context or {})})["logits"]
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt):]


def neutral_context(specs, rows: int = 1) -> dict:
    """Non-trivial context inputs (ones) as numpy rows, for variants that take them."""
    out = {}
    for s in specs:
        shape = [rows if d == "batch" else d for d in s.shape]
        out[s.name] = np.full(shape, 0.5, np.float32) if s.dtype == "float" else np.ones(shape, np.int64)
    return out


# --- a decoder that calls tools: a 512-position tiny Llama with a template that renders them ---------------------------

#: A chat template that lists the tools and asks for hermes-style calls (what tool-calling templates do).
TOOLS_TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }} {% endfor %}</tools>"
                  "answer with <tool_call>{json}</tool_call>\n{% endif %}{% for m in messages %}<{{ m['role'] }}>"
                  "{{ m['content'] }}{% endfor %}<assistant>")


def _long_positions(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 512  # room for the tools in the prompt (a 200-token vocabulary)
    (folder / "config.json").write_text(json.dumps(config))
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    tok["model_max_length"] = 512
    (folder / "tokenizer_config.json").write_text(json.dumps(tok))


def long_folder() -> Path:
    """The tiny random Llama with 512 positions (room for tools in a prompt); its files carry no chat template."""
    return exports.hf_folder("llama", edit=_long_positions, tag="positions-512-tok")


def tools_export(tmp: Path) -> Path:
    """:func:`long_folder`'s export in ``tmp`` (linked), its chat template :data:`TOOLS_TEMPLATE`."""
    tooled = exports.linked_copy(export(long_folder(), "mha"), tmp)
    (tooled.parent / "model.tokenizer" / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return tooled
