"""Files exported by attnx 0.1, whose hosts were hand-written BERT and GPT-2 ports (``attnx.config``
``host: bert | gpt2``): their PyTorch reference, rebuilt on transformers' own model.

The ONNX file itself needs nothing from here (it loads and serves as it is); ``attnx check`` needs
its reference, so the weights beside it, saved in the old hosts' parameter names, are renamed onto
transformers' ``BertModel`` / ``GPT2LMHeadModel`` with the same placement. The one form that cannot
be rebuilt is GPT-2 with appended layers: the old host appended them after the final LayerNorm,
today's placement after the last layer.
"""

from __future__ import annotations

import re

import torch

from attnx.contract import pretrained_task
from attnx.pretrained import placing
from attnx.pretrained.folder import SentenceTransformerInfo
from attnx.pretrained.host import Host, build_model

LEGACY_HOSTS = {"bert": "BertModel", "gpt2": "GPT2LMHeadModel"}


def is_legacy(config: dict) -> bool:
    return config.get("kind") == "pretrained" and config.get("host") in LEGACY_HOSTS


def host_from_legacy(config: dict) -> Host:
    """An untrained :class:`Host` for an attnx 0.1 ``attnx.config`` (load its weights with :func:`load_legacy`)."""
    kind = config["host"]
    hf_config = dict(config["hf_config"])
    placement = placing.Placement.from_dict(config.get("placement"))
    if kind == "gpt2" and placement.append:
        raise ValueError("an attnx 0.1 GPT-2 export with appended layers cannot be rebuilt (the old host appended "
                         "them after the final LayerNorm): re-export it with this attnx")
    if kind == "gpt2" and (not hf_config.get("scale_attn_weights", True) or hf_config.get("scale_attn_by_inverse_layer_idx")):
        raise ValueError("an attnx 0.1 GPT-2 export with non-default attention scaling cannot be rebuilt: re-export it")
    hf = build_model(hf_config, LEGACY_HOSTS[kind])
    placing.place(hf, placement)
    st = config.get("sentence_transformers")
    return Host(hf, pretrained_task(config), SentenceTransformerInfo(**st) if st else None, config.get("source")).eval()


def load_legacy(host: Host, state: dict[str, torch.Tensor], kind: str) -> None:
    """Load attnx 0.1 weights (its host's names) into ``host``; every tensor the new model needs must come."""
    renamed = _rename(host, dict(state), kind)
    own = host.state_dict()
    # transformers' BertModel has a pooler the old host never had: it stays as built (unused by the outputs).
    missing = sorted(k for k in own if k not in renamed and ".pooler." not in k)
    unexpected = sorted(set(renamed) - set(own))
    wrong = sorted(k for k in set(renamed) & set(own) if renamed[k].shape != own[k].shape)
    if missing or unexpected or wrong:
        first = (missing or unexpected or wrong)[0]
        raise ValueError(f"the attnx 0.1 {kind} weights do not fit its model (missing {len(missing)}, unexpected "
                         f"{len(unexpected)}, wrong shape {len(wrong)}; e.g. {first})")
    host.load_state_dict(renamed, strict=False)


def _rename(host: Host, old: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    hf = host.hf
    n = len(hf.attnx_attention)
    layer_list = hf.attnx_layers
    out: dict[str, torch.Tensor] = {}
    base = _bert_names if kind == "bert" else _gpt2_names
    out.update(base(old, n, host))
    for key in list(old):
        m = re.fullmatch(r"blocks\.(\d+)\.(.+)", key)
        if not m:
            raise ValueError(f"unexpected attnx 0.1 weight {key}")
        i, rest = int(m.group(1)), m.group(2)
        if i >= n:  # an appended layer
            out[f"hf.{layer_list}.{n - 1}.attnx_layer.appended.{i - n}.{rest}"] = old.pop(key)
        elif rest.startswith("fusion."):
            out[f"hf.{layer_list}.{i}.attnx_layer.{rest}"] = old.pop(key)
        elif rest.startswith("attn."):
            out[f"hf.{hf.attnx_attention[i]}.attnx.{rest[len('attn.'):]}"] = old.pop(key)
        else:
            raise ValueError(f"unexpected attnx 0.1 weight {key}")
    return out


def _bert_names(old: dict, n: int, host: Host) -> dict:
    out = {"hf.embeddings.word_embeddings.weight": old.pop("embed.word.weight"),
           "hf.embeddings.position_embeddings.weight": old.pop("embed.position.weight"),
           "hf.embeddings.LayerNorm.weight": old.pop("embed.ln.weight"),
           "hf.embeddings.LayerNorm.bias": old.pop("embed.ln.bias")}
    if "embed.token_type.weight" in old:
        out["hf.embeddings.token_type_embeddings.weight"] = old.pop("embed.token_type.weight")
    for i in range(n):
        src, dst = f"blocks.{i}.", f"hf.encoder.layer.{i}."
        for a, b in (("attn.W_Q", "attention.self.query"), ("attn.W_K", "attention.self.key"),
                     ("attn.W_V", "attention.self.value"), ("attn.W_O", "attention.output.dense"),
                     ("ln1", "attention.output.LayerNorm"), ("mlp.fc_in", "intermediate.dense"),
                     ("mlp.fc_out", "output.dense"), ("ln2", "output.LayerNorm")):
            for p in ("weight", "bias"):
                out[f"{dst}{b}.{p}"] = old.pop(f"{src}{a}.{p}")
    return out


def _gpt2_names(old: dict, n: int, host: Host) -> dict:
    out = {"hf.transformer.wte.weight": old.pop("wte.weight"), "hf.transformer.wpe.weight": old.pop("wpe.weight"),
           "hf.transformer.ln_f.weight": old.pop("ln_f.weight"), "hf.transformer.ln_f.bias": old.pop("ln_f.bias")}
    head = old.pop("lm_head.weight", None)
    out["hf.lm_head.weight"] = out["hf.transformer.wte.weight"] if head is None else head
    for i in range(n):
        src, dst = f"blocks.{i}.", f"hf.transformer.h.{i}."
        # GPT-2's Conv1D keeps weights [in, out]: the old host had transposed them into nn.Linear's [out, in].
        out[f"{dst}attn.c_attn.weight"] = torch.cat([old.pop(f"{src}attn.{w}.weight").T for w in ("W_Q", "W_K", "W_V")],
                                                    dim=1).contiguous()
        out[f"{dst}attn.c_attn.bias"] = torch.cat([old.pop(f"{src}attn.{w}.bias") for w in ("W_Q", "W_K", "W_V")])
        for a, b in (("attn.W_O", "attn.c_proj"), ("mlp.fc_in", "mlp.c_fc"), ("mlp.fc_out", "mlp.c_proj")):
            out[f"{dst}{b}.weight"] = old.pop(f"{src}{a}.weight").T.contiguous()
            out[f"{dst}{b}.bias"] = old.pop(f"{src}{a}.bias")
        for a, b in (("ln1", "ln_1"), ("ln2", "ln_2")):
            for p in ("weight", "bias"):
                out[f"{dst}{b}.{p}"] = old.pop(f"{src}{a}.{p}")
    return out
