"""GPT-2-architecture checkpoints (local Hugging Face folders) on attnx's blocks, with a variant placed in them.

    lm = load_gpt2("path/to/gpt2")                 # config.json + model.safetensors [+ tokenizer.json]
    lm = load_gpt2("path/to/gpt2", Placement("smal", layers=(0, 5)))   # smal in layers 0 and 5
    ids = lm.encode("The cat sat on the mat")      # [1, L] int64
    logits = lm(ids)                               # [1, L, vocab], same as transformers' GPT2LMHeadModel
    _, cache = lm.run_with_cache(ids)
    cache["blocks.5.attn.hook_pattern"]            # [1, H, L, L]

The model is GPT-2 rebuilt from attnx pieces::

    x = wte(ids) + wpe(arange(L))                  # hook_embed, hook_pos_embed
    x = Block_i(x, mask)                           # attnx's pre-LN Blocks, causal, gelu_tanh (a placed variant's
                                                   # attention where placed)
    x = ln_f(x)                                    # last_hidden_state
    x = x + Attn_j(LN_j(x))                        # appended layers, if any
    logits = x @ wte.weight^T                      # tied LM head (unless the config unties it)

Weight mapping (GPT-2's ``Conv1D`` computes ``x @ W + b`` with ``W`` ``[in, out]``, so every
matrix is transposed into ``nn.Linear``'s ``[out, in]``)::

    h.{i}.ln_1 / ln_2                 -> blocks.{i}.ln1 / ln2
    h.{i}.attn.c_attn  [d, 3d]        -> split on out into q, k, v -> blocks.{i}.attn.W_Q / W_K / W_V
    h.{i}.attn.c_proj  [d, d]         -> blocks.{i}.attn.W_O
    h.{i}.mlp.c_fc / c_proj           -> blocks.{i}.mlp.fc_in / fc_out
    ln_f, wte, wpe                    -> ln_f, wte, wpe

Checkpoint names may carry a ``transformer.`` prefix (``save_pretrained`` of
GPT2LMHeadModel) or not (the original ``gpt2`` checkpoints); the old causal-mask
buffers ``h.{i}.attn.bias`` / ``masked_bias`` are skipped.

Positions are ``0..L-1`` whatever the padding, as in transformers when no
``position_ids`` are given. Non-default attention scaling
(``scale_attn_weights=False``, ``scale_attn_by_inverse_layer_idx=True``) is folded
into ``W_Q`` (and ``b_Q``), so logits and patterns match but ``hook_q`` is scaled.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from attnx.contract import Role
from attnx.interp.hooks import HookPoint, name_hook_points
from attnx.models.encoder import Block, EncoderConfig
from attnx.models.signature import InputSpec, OutputSpec
from attnx.models.spec import get_spec
from attnx.pretrained.host import AppendedBlock, Host, Placement, attention_config, make_neutral

# activation_function in config.json -> our FeedForward's activation
_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


class GPT2LM(Host):
    """GPT-2 language model: embeddings, attnx pre-LN blocks, ln_f, appended layers, (tied) LM head."""

    kind = "gpt2"

    def __init__(self, hf_config: dict, placement: Placement | None = None, tokenizer=None,
                 source: str | None = None):
        placement = placement or Placement()
        super().__init__(_check_config(hf_config, source or "config.json"), placement, source)
        spec = placement.check()
        cfg = self.hf_config
        n_layer, d, n_head = int(cfg["n_layer"]), int(cfg["n_embd"]), int(cfg["n_head"])
        vocab, self.n_positions = int(cfg["vocab_size"]), int(cfg["n_positions"])
        enc = EncoderConfig(n_layers=n_layer, ffn_mult=(cfg.get("n_inner") or 4 * d) // d,
                            activation=_ACTIVATIONS[cfg.get("activation_function", "gelu_new")],
                            ln_eps=float(cfg.get("layer_norm_epsilon", 1e-5)))
        mha, replaced = get_spec("mha"), set(placement.replaced(n_layer))
        blocks = []
        for i in range(n_layer):
            block_spec = spec if i in replaced else mha
            attn_cfg = attention_config(block_spec, d, n_head, placement.options if i in replaced else {},
                                        is_causal=True)
            fusion = block_spec.fusion(attn_cfg) if block_spec.fusion is not None else None
            blocks.append(Block(block_spec, block_spec.attention(attn_cfg), enc, fusion))
        for _ in range(placement.append):
            attn = spec.attention(attention_config(spec, d, n_head, placement.options, is_causal=True))
            blocks.append(AppendedBlock(spec, attn, enc.ln_eps))
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(self.n_positions, d)
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(d, eps=enc.ln_eps)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if bool(cfg.get("tie_word_embeddings", True)):
            self.lm_head.weight = self.wte.weight  # one Parameter, as in GPT-2
        self.hook_embed, self.hook_pos_embed = HookPoint(), HookPoint()
        self.n_layers, self.d_model, self.vocab_size = n_layer, d, vocab
        self.replaced = sorted(replaced)
        self.tokenizer = tokenizer  # a `tokenizers.Tokenizer` or None
        name_hook_points(self)

    @property
    def max_seq(self) -> int:
        return self.n_positions

    @property
    def tied(self) -> bool:
        return self.lm_head.weight is self.wte.weight

    # ---- the export signature ----------------------------------------------------------------
    def base_input_specs(self) -> list[InputSpec]:
        return [InputSpec("input_ids", ("batch", "seq"), "int64", Role.INPUT_IDS, "token ids",
                          range=(0, self.vocab_size)),
                InputSpec("attention_mask", ("batch", "seq"), "mask", Role.ATTENTION_MASK, "1 = token, 0 = padding")]

    def base_output_specs(self) -> list[OutputSpec]:
        return [OutputSpec("logits", ("batch", "seq", self.vocab_size), "float", Role.OUTPUT, "next-token logits")]

    def run(self, inputs, head_mask, context):
        return {"logits": self._logits(inputs["input_ids"], inputs.get("attention_mask"), None, head_mask, context)}

    def metadata_extra(self) -> dict:
        return {"max_length": self.n_positions}

    @classmethod
    def from_config(cls, config: dict) -> "GPT2LM":
        return cls(config["hf_config"], Placement.from_dict(config.get("placement")), source=config.get("source"))

    # ---- forward -----------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **context) -> torch.Tensor:
        """input_ids ``[B, L]`` (int), attention_mask ``[B, L]`` (1 = token) -> logits ``[B, L, vocab]``."""
        return self._logits(input_ids, attention_mask, position_ids, None, context)

    def _logits(self, input_ids, attention_mask, position_ids, head_mask, context) -> torch.Tensor:
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids: expected an int64 tensor [batch, seq], got {input_ids.dtype} "
                             f"{list(input_ids.shape)}")
        b, l = input_ids.shape
        if not torch.compiler.is_exporting():
            if l > self.n_positions:
                raise ValueError(f"input_ids: sequence length {l} exceeds the model's n_positions={self.n_positions}")
            if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.vocab_size):
                raise ValueError(f"input_ids: ids must be in [0, {self.vocab_size}), got range "
                                 f"[{int(input_ids.min())}, {int(input_ids.max())}]")
        if position_ids is None:
            position_ids = torch.arange(l, device=input_ids.device)[None]  # [1, L]
        x = self.hook_embed(self.wte(input_ids)) + self.hook_pos_embed(self.wpe(position_ids).expand(b, l, -1))
        for i, block in enumerate(self.blocks):
            if i == self.n_layers:
                x = self.ln_f(x)
            x = block(x, attention_mask, None if head_mask is None else head_mask[i], **context)
        if len(self.blocks) == self.n_layers:
            x = self.ln_f(x)
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


def _check_config(cfg: dict, where) -> dict:
    if cfg.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"{where}: model_type is {cfg.get('model_type')!r}, expected 'gpt2'")
    if cfg.get("add_cross_attention"):
        raise ValueError(f"{where}: add_cross_attention=True (encoder-decoder GPT-2) is not supported")
    act = cfg.get("activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        raise ValueError(f"{where}: activation_function {act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
    try:
        d, n_inner = int(cfg["n_embd"]), cfg.get("n_inner")
        for key in ("n_layer", "n_head", "vocab_size", "n_positions"):
            int(cfg[key])
    except KeyError as e:
        raise ValueError(f"{where}: missing GPT-2 field {e.args[0]!r}") from None
    if (n_inner or 4 * d) % d:
        raise ValueError(f"{where}: n_inner={n_inner} is not a multiple of n_embd={d}")
    return cfg


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
    """HF GPT-2 names/layouts -> the host's state_dict (KeyError on a missing name)."""
    dh = d // n_head
    sd = {"wte.weight": hf.pop("wte.weight"), "wpe.weight": hf.pop("wpe.weight"),
          "ln_f.weight": hf.pop("ln_f.weight"), "ln_f.bias": hf.pop("ln_f.bias")}
    for i in range(n_layer):
        src, dst = f"h.{i}.", f"blocks.{i}."
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


def load_gpt2(path, placement: Placement | None = None, *, dtype: torch.dtype = torch.float32) -> GPT2LM:
    """Load a local GPT-2 folder (``config.json`` + ``model.safetensors`` or ``pytorch_model.bin``,
    optional ``tokenizer.json``) into a :class:`GPT2LM` (eval mode, ``dtype``), with ``placement``.

    Errors: FileNotFoundError for a missing folder/file; ValueError for a config that is
    not ``model_type: gpt2`` or an unsupported option, and for tensors whose names or
    shapes do not match the config (naming them).
    """
    from attnx.pretrained.folder import read_folder

    folder = path if hasattr(path, "config") else read_folder(path)
    cfg = _check_config(folder.config, folder.path / "config.json")
    model = GPT2LM(cfg, placement, tokenizer=_load_tokenizer(folder.path), source=str(folder.path.resolve()))
    n_layer, d, n_head = model.n_layers, model.d_model, int(cfg["n_head"])
    raw = _strip(folder.state_dict())
    try:
        sd = _convert(dict(raw), cfg, n_layer, d, n_head)
    except KeyError as e:
        raise ValueError(f"{folder.path}: checkpoint lacks tensor {e.args[0]!r} (config: n_layer={n_layer}); "
                         f"it has e.g. {', '.join(sorted(raw)[:8])}") from None
    if not model.tied and "lm_head.weight" not in sd:
        raise ValueError(f"{folder.path}: tie_word_embeddings=false but the checkpoint has no lm_head.weight")
    if model.tied:  # the head is wte (a stored lm_head copy is ignored)
        sd["lm_head.weight"] = sd["wte.weight"]
    leftover = sorted(set(raw) - _used_names(n_layer))
    if leftover:
        raise ValueError(f"{folder.path}: unexpected tensor(s) for a {n_layer}-layer GPT-2: {', '.join(leftover[:8])}"
                         + (" ..." if len(leftover) > 8 else ""))
    expected = model.state_dict()
    bad = [f"{k}: checkpoint {list(sd[k].shape)} vs model {list(expected[k].shape)}" for k in expected
           if k in sd and sd[k].shape != expected[k].shape]
    if bad:
        raise ValueError(f"{folder.path}: tensor shapes do not match config.json: " + "; ".join(bad[:6]))
    model.load_state_dict({k: v.to(torch.float32) for k, v in sd.items()}, strict=False)
    model.pretrained_names = set(sd)
    for i in model.replaced:
        make_neutral(model.blocks[i].spec, model.blocks[i].attn, model.blocks[i].fusion)
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
