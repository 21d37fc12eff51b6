"""GPT-2-architecture checkpoints (local Hugging Face folders) on attnx's own blocks.

    lm = load_gpt2("path/to/gpt2")                 # config.json + model.safetensors [+ tokenizer.json]
    ids = lm.encode("The cat sat on the mat")      # [1, L] int64
    logits = lm(ids)                               # [1, L, vocab], same as transformers' GPT2LMHeadModel
    _, cache = lm.run_with_cache(ids)
    cache["blocks.5.attn.hook_pattern"]            # [1, H, L, L]

The model is GPT-2 rebuilt from attnx pieces::

    x = wte(ids) + wpe(arange(L))                  # hook_embed, hook_pos_embed
    x = Encoder(x, mask)                           # pre-LN mha Blocks, is_causal=True, gelu_tanh, ln_f
    logits = x @ wte.weight^T                      # tied LM head (unless the config unties it)

Weight mapping (GPT-2's ``Conv1D`` computes ``x @ W + b`` with ``W`` ``[in, out]``, so every
matrix is transposed into ``nn.Linear``'s ``[out, in]``)::

    h.{i}.ln_1 / ln_2                 -> blocks.{i}.ln1 / ln2
    h.{i}.attn.c_attn  [d, 3d]        -> split on out into q, k, v -> blocks.{i}.attn.W_Q / W_K / W_V
    h.{i}.attn.c_proj  [d, d]         -> blocks.{i}.attn.W_O
    h.{i}.mlp.c_fc / c_proj           -> blocks.{i}.mlp.fc_in / fc_out
    ln_f, wte, wpe                    -> encoder.ln_f, wte, wpe

Checkpoint names may carry a ``transformer.`` prefix (``save_pretrained`` of
GPT2LMHeadModel) or not (the original ``gpt2`` checkpoints); the old causal-mask
buffers ``h.{i}.attn.bias`` / ``masked_bias`` are skipped.

Positions are ``0..L-1`` whatever the padding, as in transformers when no
``position_ids`` are given. Non-default attention scaling
(``scale_attn_weights=False``, ``scale_attn_by_inverse_layer_idx=True``) is folded
into ``W_Q`` (and ``b_Q``), so logits and patterns match but ``hook_q`` is scaled.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from attnx.interp.hooks import HookPoint, Hooked, name_hook_points
from attnx.models.build import build_encoder
from attnx.models.encoder import Encoder

# activation_function in config.json -> our FeedForward's activation
_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


class GPT2LM(Hooked, nn.Module):
    """GPT-2 language model: embeddings + attnx :class:`Encoder` + (tied) LM head."""

    def __init__(self, encoder: Encoder, vocab_size: int, n_positions: int, tie_word_embeddings: bool = True,
                 tokenizer=None, config: dict | None = None):
        super().__init__()
        d = encoder.d_model
        self.config = dict(config or {})
        self.n_positions = n_positions
        self.wte = nn.Embedding(vocab_size, d)
        self.wpe = nn.Embedding(n_positions, d)
        self.encoder = encoder
        self.lm_head = nn.Linear(d, vocab_size, bias=False)
        if tie_word_embeddings:
            self.lm_head.weight = self.wte.weight  # one Parameter, as in GPT-2
        self.hook_embed, self.hook_pos_embed = HookPoint(), HookPoint()
        name_hook_points(self, strip="encoder.")  # blocks.{i}..., hook_embed: the TransformerLens names
        self.tokenizer = tokenizer  # a `tokenizers.Tokenizer` or None

    @property
    def tied(self) -> bool:
        return self.lm_head.weight is self.wte.weight

    @property
    def blocks(self):
        return self.encoder.blocks

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids ``[B, L]`` (int), attention_mask ``[B, L]`` (1 = token) -> logits ``[B, L, vocab]``."""
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids: expected an int64 tensor [batch, seq], got {input_ids.dtype} "
                             f"{list(input_ids.shape)}")
        b, l = input_ids.shape
        if l > self.n_positions:
            raise ValueError(f"input_ids: sequence length {l} exceeds the model's n_positions={self.n_positions}")
        if position_ids is None:
            position_ids = torch.arange(l, device=input_ids.device)[None]  # [1, L]
        x = self.hook_embed(self.wte(input_ids)) + self.hook_pos_embed(self.wpe(position_ids).expand(b, l, -1))
        x = self.encoder(x, attention_mask)  # [B, L, D], ln_f applied
        return self.lm_head(x)  # [B, L, V]

    # ---- text ---------------------------------------------------------------------------------
    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (no tokenizer.json in its folder); pass token ids")
        return self.tokenizer

    def encode(self, text: str | Sequence[str]) -> torch.Tensor:
        """Text -> ids ``[1, L]`` (one string) or ``[B, L]`` right-padded with 0 (a list;
        use :meth:`encode_batch` to get the mask too)."""
        if isinstance(text, str):
            return torch.tensor([self._need_tokenizer().encode(text).ids], dtype=torch.long)
        return self.encode_batch(text)[0]

    def encode_batch(self, texts: Sequence[str], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ids ``[B, L]`` and attention_mask ``[B, L]``."""
        rows = [self._need_tokenizer().encode(t).ids for t in texts]
        l = max(len(r) for r in rows)
        ids = torch.full((len(rows), l), pad_id, dtype=torch.long)
        mask = torch.zeros(len(rows), l, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, :len(r)] = 1
        return ids, mask

    def to_text(self, ids) -> str:
        """Ids (list or ``[L]`` / ``[1, L]`` tensor) -> text."""
        ids = torch.as_tensor(ids).reshape(-1).tolist()
        return self._need_tokenizer().decode(ids)

    def to_str_tokens(self, ids_or_text) -> list[str]:
        """One readable string per token (each id decoded alone), e.g. for plot labels."""
        ids = self.encode(ids_or_text) if isinstance(ids_or_text, str) else ids_or_text
        tok = self._need_tokenizer()
        return [tok.decode([i]) for i in torch.as_tensor(ids).reshape(-1).tolist()]


# --------------------------------------------------------------------------- loading


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no config.json (expected a Hugging Face GPT-2 folder with "
                                "config.json and model.safetensors)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if cfg.get("model_type") != "gpt2":
        raise ValueError(f"{path}: model_type is {cfg.get('model_type')!r}, expected 'gpt2' "
                         "(only GPT-2-architecture checkpoints are supported)")
    if cfg.get("add_cross_attention"):
        raise ValueError(f"{path}: add_cross_attention=True (encoder-decoder GPT-2) is not supported")
    act = cfg.get("activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        raise ValueError(f"{path}: activation_function {act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
    return cfg


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return load_file(str(single))
    if index.is_file():  # sharded checkpoint
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        tensors: dict[str, torch.Tensor] = {}
        for shard in shards:
            if not (folder / shard).is_file():
                raise FileNotFoundError(f"{folder}: shard {shard} listed in {index.name} is missing")
            tensors.update(load_file(str(folder / shard)))
        return tensors
    found = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
    raise FileNotFoundError(f"{folder}: no model.safetensors (found: {found}); "
                            "convert .bin checkpoints with save_pretrained(..., safe_serialization=True)")


def _strip(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the ``transformer.`` prefix and the causal-mask buffers of old checkpoints."""
    out = {}
    for k, v in tensors.items():
        k = k.removeprefix("transformer.")
        if k.endswith(".attn.bias") or k.endswith(".attn.masked_bias"):
            continue
        out[k] = v
    return out


def _convert(hf: dict[str, torch.Tensor], cfg: dict, n_layer: int, d: int, n_head: int) -> dict[str, torch.Tensor]:
    """HF GPT-2 names/layouts -> our GPT2LM state_dict (KeyError on a missing name)."""
    dh = d // n_head
    sd = {"wte.weight": hf.pop("wte.weight"), "wpe.weight": hf.pop("wpe.weight"),
          "encoder.ln_f.weight": hf.pop("ln_f.weight"), "encoder.ln_f.bias": hf.pop("ln_f.bias")}
    for i in range(n_layer):
        src, dst = f"h.{i}.", f"encoder.blocks.{i}."
        for a, b in (("ln_1", "ln1"), ("ln_2", "ln2")):
            sd[f"{dst}{b}.weight"] = hf.pop(f"{src}{a}.weight")
            sd[f"{dst}{b}.bias"] = hf.pop(f"{src}{a}.bias")
        w, bias = hf.pop(f"{src}attn.c_attn.weight"), hf.pop(f"{src}attn.c_attn.bias")  # [d, 3d], [3d]
        if tuple(w.shape) != (d, 3 * d) or tuple(bias.shape) != (3 * d,):
            raise ValueError(f"{src}attn.c_attn: expected weight [{d}, {3 * d}] and bias [{3 * d}], "
                             f"got {list(w.shape)} and {list(bias.shape)}")
        wq, wk, wv = w.split(d, dim=1)  # each [d_in, d_out]; out columns are (head, Dh) in order
        bq, bk, bv = bias.split(d)
        # Our attention always scales by 1/sqrt(Dh); fold GPT-2's other scalings into Q.
        scale = (1.0 if cfg.get("scale_attn_weights", True) else math.sqrt(dh))
        if cfg.get("scale_attn_by_inverse_layer_idx", False):
            scale /= float(i + 1)
        for name, wt, bt, s in (("W_Q", wq, bq, scale), ("W_K", wk, bk, 1.0), ("W_V", wv, bv, 1.0)):
            sd[f"{dst}attn.{name}.weight"] = wt.T.contiguous() * s  # [out, in]
            sd[f"{dst}attn.{name}.bias"] = bt * s
        for a, b in (("attn.c_proj", "attn.W_O"), ("mlp.c_fc", "mlp.fc_in"), ("mlp.c_proj", "mlp.fc_out")):
            sd[f"{dst}{b}.weight"] = hf.pop(f"{src}{a}.weight").T.contiguous()
            sd[f"{dst}{b}.bias"] = hf.pop(f"{src}{a}.bias")
    if "lm_head.weight" in hf:
        sd["lm_head.weight"] = hf.pop("lm_head.weight")
    return sd


def load_gpt2(path: str | Path, *, dtype: torch.dtype = torch.float32) -> GPT2LM:
    """Load a local GPT-2 folder (``config.json`` + ``model.safetensors``, optional
    ``tokenizer.json``) into a :class:`GPT2LM` (eval mode, ``dtype``).

    Errors: FileNotFoundError for a missing folder/file; ValueError for a config that is
    not ``model_type: gpt2`` or an unsupported option, and for tensors whose names or
    shapes do not match the config (naming them).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"GPT-2 checkpoint folder not found: {folder}")
    cfg = _read_config(folder)
    try:
        n_layer, d, n_head = int(cfg["n_layer"]), int(cfg["n_embd"]), int(cfg["n_head"])
        vocab, n_pos = int(cfg["vocab_size"]), int(cfg["n_positions"])
    except KeyError as e:
        raise ValueError(f"{folder / 'config.json'}: missing GPT-2 field {e.args[0]!r}") from None
    n_inner = cfg.get("n_inner") or 4 * d
    if n_inner % d:
        raise ValueError(f"{folder / 'config.json'}: n_inner={n_inner} is not a multiple of n_embd={d}")
    tie = bool(cfg.get("tie_word_embeddings", True))

    raw = _strip(_read_tensors(folder))
    try:
        sd = _convert(dict(raw), cfg, n_layer, d, n_head)
    except KeyError as e:
        raise ValueError(f"{folder}: checkpoint lacks tensor {e.args[0]!r} (config: n_layer={n_layer}); "
                         f"it has e.g. {', '.join(sorted(raw)[:8])}") from None
    if not tie and "lm_head.weight" not in sd:
        raise ValueError(f"{folder}: tie_word_embeddings=false but the checkpoint has no lm_head.weight")
    if tie:  # the head is wte (a stored lm_head copy is ignored)
        sd["lm_head.weight"] = sd["wte.weight"]
    leftover = sorted(set(raw) - _used_names(n_layer))
    if leftover:
        raise ValueError(f"{folder}: unexpected tensor(s) for a {n_layer}-layer GPT-2: {', '.join(leftover[:8])}"
                         + (" ..." if len(leftover) > 8 else ""))

    activation = _ACTIVATIONS[cfg.get("activation_function", "gelu_new")]
    encoder = build_encoder("mha", seed=None, n_layers=n_layer, d_model=d, n_heads=n_head, is_causal=True,
                            qkv_bias=True, dropout=0.0, activation=activation, ffn_mult=n_inner // d,
                            ln_eps=float(cfg.get("layer_norm_epsilon", 1e-5)), final_norm=True)
    model = GPT2LM(encoder, vocab, n_pos, tie_word_embeddings=tie, tokenizer=_load_tokenizer(folder), config=cfg)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    bad = [f"{k}: checkpoint {list(sd[k].shape)} vs model {list(expected[k])}" for k in expected
           if k in sd and sd[k].shape != expected[k]]
    if bad:
        raise ValueError(f"{folder}: tensor shapes do not match config.json: " + "; ".join(bad[:6]))
    missing = sorted(set(expected) - set(sd))
    if missing:
        raise ValueError(f"{folder}: checkpoint lacks {', '.join(missing[:8])}")
    model.load_state_dict({k: v.to(torch.float32) for k, v in sd.items()}, strict=True)
    return model.to(dtype).eval()


def _used_names(n_layer: int) -> set[str]:
    names = {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"}
    for i in range(n_layer):
        for m in ("ln_1", "ln_2", "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            names |= {f"h.{i}.{m}.weight", f"h.{i}.{m}.bias"}
    # A tied checkpoint may still store lm_head.weight (a copy of wte); it is ignored then.
    return names | {"lm_head.weight"}


def _load_tokenizer(folder: Path):
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))
