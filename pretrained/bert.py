"""BERT-family encoders (``model_type: bert``) on attnx blocks, with a variant placed in them.

    x = LN_e(word[ids] + position[0..L-1] + token_type[tt])            # hook_embed, hook_pos_embed
    for each layer:                                                     # post-LN, as BERT
        h = LN1(x + Attn(x, mask))                                      # Attn: mha, or the placed variant
        x = LN2(h + FFN(h))                                             # FFN: Linear -> GELU(erf) -> Linear
        x = Fusion(x_in, x)                                             # variants with a fusion only
    x = x + Attn_j(LN_j(x))  for each appended layer                    # (the seed's MAW form)
    last_hidden_state = x                                               # [B, L, d]
    sentence_embedding = normalize(pool(x, mask))                       # sentence-transformers folders

Weight mapping (``bert.`` prefixes of task checkpoints are dropped; old ``LayerNorm.gamma/beta`` read)::

    embeddings.{word,position,token_type}_embeddings, embeddings.LayerNorm -> embed.*
    encoder.layer.{i}.attention.self.{query,key,value}   -> blocks.{i}.attn.W_Q / W_K / W_V
    encoder.layer.{i}.attention.output.dense / LayerNorm -> blocks.{i}.attn.W_O / ln1
    encoder.layer.{i}.intermediate.dense / output.dense  -> blocks.{i}.mlp.fc_in / fc_out
    encoder.layer.{i}.output.LayerNorm                   -> blocks.{i}.ln2
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnx.contract import Role
from attnx.interp.hooks import HookPoint, name_hook_points
from attnx.models.encoder import FeedForward
from attnx.models.signature import InputSpec, OutputSpec, check_inputs
from attnx.models.spec import VariantSpec, get_spec
from attnx.pretrained.folder import HFFolder, SentenceTransformerInfo, Weights, config_int
from attnx.pretrained.host import AppendedBlock, Host, Placement, attention_config, make_neutral

#: hidden_act in config.json -> attnx's FeedForward activation
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


class Embeddings(nn.Module):
    def __init__(self, vocab: int, positions: int, types: int, d: int, eps: float):
        super().__init__()
        self.word = nn.Embedding(vocab, d)
        self.position = nn.Embedding(positions, d)
        self.token_type = nn.Embedding(types, d) if types else None
        self.ln = nn.LayerNorm(d, eps=eps)
        self.hook_embed, self.hook_pos_embed = HookPoint(), HookPoint()

    def forward(self, input_ids, token_type_ids=None):
        l = input_ids.shape[1]
        x = self.hook_embed(self.word(input_ids)) + self.hook_pos_embed(self.position.weight[:l][None])
        if self.token_type is not None:
            x = x + self.token_type(torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids)
        return self.ln(x)


class PostLNBlock(nn.Module):
    """One BERT layer around an attnx attention (hook names as attnx's pre-LN ``Block``)."""

    def __init__(self, spec: VariantSpec, config, d_ff: int, activation: str, eps: float):
        super().__init__()
        d = config.d_model
        self.spec = spec
        self.attn = spec.attention(config)
        self.ln1 = nn.LayerNorm(d, eps=eps)
        self.mlp = FeedForward(d, activation=activation, d_ff=d_ff)
        self.ln2 = nn.LayerNorm(d, eps=eps)
        self.fusion = spec.fusion(config) if spec.fusion is not None else None
        self.hook_resid_pre, self.hook_attn_out = HookPoint(), HookPoint()
        self.hook_mlp_out, self.hook_resid_post = HookPoint(), HookPoint()

    @property
    def config(self):
        return self.attn.config

    @property
    def variant(self) -> str:
        return self.spec.name

    def forward(self, x, attention_mask=None, head_mask=None, **context):
        x = self.hook_resid_pre(x)
        attn_ctx = {k: context[k] for k in self.attn.context_names}
        h = self.ln1(x + self.hook_attn_out(self.attn(x, attention_mask, head_mask, **attn_ctx)))
        y = self.ln2(h + self.hook_mlp_out(self.mlp(h)))
        if self.fusion is not None:
            y = self.fusion(x, y, **{k: context[k] for k in self.fusion.context_names})
        return self.hook_resid_post(y)


def pool(x: torch.Tensor, mask: torch.Tensor | None, mode: str) -> torch.Tensor:
    """sentence-transformers' pooling of ``[B, L, d]`` over real tokens -> ``[B, d]``."""
    m = torch.ones(x.shape[:2], dtype=x.dtype, device=x.device) if mask is None else mask.to(x.dtype)
    if mode == "cls":
        return x[:, 0]
    if mode == "max":
        return x.masked_fill(m[..., None] == 0, torch.finfo(x.dtype).min).amax(dim=1)
    summed = (x * m[..., None]).sum(dim=1)
    count = m.sum(dim=1, keepdim=True).clamp(min=1e-9)
    return summed / (count if mode == "mean" else count.sqrt())


class BertHost(Host):
    kind = "bert"

    def __init__(self, hf_config: dict, placement: Placement, st: SentenceTransformerInfo | None = None,
                 source: str | None = None):
        super().__init__(hf_config, placement, source)
        spec = placement.check()
        c = hf_config
        where = source or "config"
        d, n_layers, heads = (config_int(c, k, where) for k in ("hidden_size", "num_hidden_layers",
                                                                  "num_attention_heads"))
        if c.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {c.get('position_embedding_type')!r} is not supported "
                             "(attnx's BERT host uses absolute positions)")
        act = c.get("hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        if d % heads:
            raise ValueError(f"hidden_size {d} is not divisible by num_attention_heads {heads}")
        self.vocab_size, self.max_positions = c["vocab_size"], c["max_position_embeddings"]
        self.type_vocab_size = int(c.get("type_vocab_size", 0) or 0)
        eps = float(c.get("layer_norm_eps", 1e-12))
        self.st = st
        self.embed = Embeddings(self.vocab_size, self.max_positions, self.type_vocab_size, d, eps)
        mha, replaced = get_spec("mha"), set(placement.replaced(n_layers))
        blocks = []
        for i in range(n_layers):
            block_spec = spec if i in replaced else mha
            cfg = attention_config(block_spec, d, heads, placement.options if i in replaced else {})
            blocks.append(PostLNBlock(block_spec, cfg, c["intermediate_size"], ACTIVATIONS[act], eps))
        for _ in range(placement.append):
            blocks.append(AppendedBlock(spec, spec.attention(attention_config(spec, d, heads, placement.options)), eps))
        self.blocks = nn.ModuleList(blocks)
        self.n_layers, self.d_model = n_layers, d
        self.replaced = sorted(replaced)
        name_hook_points(self, strip="embed.")

    @property
    def max_seq(self) -> int:
        return self.max_positions

    def base_input_specs(self) -> list[InputSpec]:
        specs = [InputSpec("input_ids", ("batch", "seq"), "int64", Role.INPUT_IDS, "token ids",
                           range=(0, self.vocab_size)),
                 InputSpec("attention_mask", ("batch", "seq"), "mask", Role.ATTENTION_MASK, "1 = token, 0 = padding")]
        if self.type_vocab_size:
            specs.append(InputSpec("token_type_ids", ("batch", "seq"), "int64", Role.TOKEN_TYPE_IDS,
                                   "segment ids (0 for single sentences)", range=(0, self.type_vocab_size)))
        return specs

    def base_output_specs(self) -> list[OutputSpec]:
        out = [OutputSpec("last_hidden_state", ("batch", "seq", self.d_model), "float", Role.OUTPUT,
                          "the encoder's last hidden states")]
        if self.st is not None:
            out.append(OutputSpec("sentence_embedding", ("batch", self.d_model), "float", Role.OUTPUT,
                                  f"{self.st.pooling} pooling" + (", L2-normalised" if self.st.normalize else "")))
        return out

    def run(self, inputs, head_mask, context):
        ids, mask = inputs["input_ids"], inputs.get("attention_mask")
        if not torch.compiler.is_exporting():
            check_inputs(self.input_specs(), {k: v for k, v in inputs.items() if k != "head_mask"},
                         optional=("attention_mask", "token_type_ids"))
            if ids.shape[1] > self.max_positions:
                raise ValueError(f"input_ids: sequence length {ids.shape[1]} exceeds the model's "
                                 f"{self.max_positions} positions")
        x = self.embed(ids, inputs.get("token_type_ids"))
        for i, block in enumerate(self.blocks):
            x = block(x, mask, None if head_mask is None else head_mask[i], **context)
        out = {"last_hidden_state": x}
        if self.st is not None:
            emb = pool(x, mask, self.st.pooling)
            out["sentence_embedding"] = F.normalize(emb, p=2.0, dim=-1) if self.st.normalize else emb
        return out

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, **context):
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
        return self.forward_named({k: v for k, v in {**inputs, **context}.items() if v is not None})

    def config_dict(self) -> dict:
        return {**super().config_dict(), "sentence_transformers": self.st.to_dict() if self.st else None}

    def metadata_extra(self) -> dict:
        max_len = min(self.max_positions, self.st.max_seq_length or self.max_positions) if self.st else self.max_positions
        return {"max_length": max_len}

    @classmethod
    def from_config(cls, config: dict) -> "BertHost":
        st = config.get("sentence_transformers")
        return cls(config["hf_config"], Placement.from_dict(config.get("placement")),
                   SentenceTransformerInfo(**st) if st else None, config.get("source"))


def load_bert(folder: HFFolder, placement: Placement) -> BertHost:
    """The folder's BERT with ``placement`` applied: pretrained weights copied, placed layers neutral."""
    host = BertHost(folder.config, placement, folder.sentence_transformer, str(folder.path.resolve()))
    w = Weights(folder.state_dict(), folder.path, prefixes=("bert.",))
    d, ff, types = host.d_model, host.hf_config["intermediate_size"], host.type_vocab_size
    sd = {"embed.word.weight": w.take("embeddings.word_embeddings.weight", (host.vocab_size, d)),
          "embed.position.weight": w.take("embeddings.position_embeddings.weight", (host.max_positions, d)),
          "embed.ln.weight": w.take("embeddings.LayerNorm.weight", (d,), "embeddings.LayerNorm.gamma"),
          "embed.ln.bias": w.take("embeddings.LayerNorm.bias", (d,), "embeddings.LayerNorm.beta")}
    if types:
        sd["embed.token_type.weight"] = w.take("embeddings.token_type_embeddings.weight", (types, d))
    for i in range(host.n_layers):
        src, dst = f"encoder.layer.{i}.", f"blocks.{i}."
        for hf, ours, shape in (("attention.self.query", "attn.W_Q", (d, d)), ("attention.self.key", "attn.W_K", (d, d)),
                                ("attention.self.value", "attn.W_V", (d, d)), ("attention.output.dense", "attn.W_O", (d, d)),
                                ("intermediate.dense", "mlp.fc_in", (ff, d)), ("output.dense", "mlp.fc_out", (d, ff))):
            sd[f"{dst}{ours}.weight"] = w.take(f"{src}{hf}.weight", shape)
            sd[f"{dst}{ours}.bias"] = w.take(f"{src}{hf}.bias", shape[:1])
        for hf, ours in (("attention.output.LayerNorm", "ln1"), ("output.LayerNorm", "ln2")):
            sd[f"{dst}{ours}.weight"] = w.take(f"{src}{hf}.weight", (d,), f"{src}{hf}.gamma")
            sd[f"{dst}{ours}.bias"] = w.take(f"{src}{hf}.bias", (d,), f"{src}{hf}.beta")
    w.skip("embeddings.position_ids", *[k for k in w.tensors if k.startswith(("pooler.", "cls."))])
    leftover = w.leftover()
    if leftover:
        raise ValueError(f"{folder.path}: unexpected weight(s) for a {host.n_layers}-layer BERT: "
                         f"{', '.join(leftover[:6])}{' ...' if len(leftover) > 6 else ''}")
    host.load_state_dict(sd, strict=False)
    host.pretrained_names = set(sd)
    for i in host.replaced:
        make_neutral(host.blocks[i].spec, host.blocks[i].attn, host.blocks[i].fusion)
    return host.eval()
