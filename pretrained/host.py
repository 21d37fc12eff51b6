"""A placed transformers model with the signature attnx exports, checks and serves (:class:`Host`).

    host = attnx.pretrained.load(folder, "smal")       # transformers' own model, smal placed in it
    host.hf                                           # that model: train it, save_pretrained it
    host.forward_named({"input_ids": ids, "attention_mask": mask, "self_state": s, "trace": T})

By task (from ``config.json``'s ``architectures``, or chosen):

- ``feature-extraction`` (``AutoModel``): ``last_hidden_state [batch, seq, hidden]`` and, for a
  sentence-transformers folder, ``sentence_embedding`` (its pooling and normalisation in the graph);
- ``causal-lm`` (``AutoModelForCausalLM``): ``logits [batch, seq, vocab]``;
- ``sequence-classification`` (``AutoModelForSequenceClassification``): ``logits [batch, labels]``.

Inputs: ``input_ids``, ``attention_mask``, ``token_type_ids`` where the family has more than one
segment, then the variants' context inputs. A causal model's positions are derived from the mask
(``cumsum(mask) - 1``, as transformers' ``generate`` does), so left-padded batches are exact.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attnx.contract import Role
from attnx.models.hooks import Hooked
from attnx.models.signature import InputSpec, OutputSpec, check_inputs
from attnx.pretrained import backend, placing
from attnx.pretrained.folder import SentenceTransformerInfo

TASKS = {"feature-extraction": "AutoModel", "causal-lm": "AutoModelForCausalLM",
         "sequence-classification": "AutoModelForSequenceClassification"}


def task_of(architectures: list | None) -> str:
    """The task a folder's ``architectures`` names (a bare or unknown class: feature extraction)."""
    name = str((architectures or [""])[0])
    if name.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")):
        return "causal-lm"
    if name.endswith("ForSequenceClassification"):
        return "sequence-classification"
    return "feature-extraction"


def check_task(task: str) -> str:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; valid: {', '.join(TASKS)}")
    return task


def pool(x: torch.Tensor, mask: torch.Tensor | None, mode: str) -> torch.Tensor:
    """sentence-transformers' pooling of ``[B, L, d]`` over real tokens -> ``[B, d]``."""
    m = torch.ones(x.shape[:2], dtype=x.dtype, device=x.device) if mask is None else mask.to(x.dtype)
    if mode == "cls":
        return x[:, 0]
    if mode == "lasttoken":  # the last real token of each row (right or left padding)
        last = (m * torch.arange(x.shape[1], device=x.device, dtype=x.dtype)).argmax(dim=1)
        return x[torch.arange(x.shape[0], device=x.device), last]
    if mode == "max":
        return x.masked_fill(m[..., None] == 0, torch.finfo(x.dtype).min).amax(dim=1)
    summed = (x * m[..., None]).sum(dim=1)
    count = m.sum(dim=1, keepdim=True).clamp(min=1e-9)
    return summed / (count if mode == "mean" else count.sqrt())


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position of each token among the real ones (padding at 0): exact under left padding."""
    return (mask.long().cumsum(-1) - 1).clamp_min(0)


def max_positions(hf) -> int:
    """The longest sequence the model's position table takes (RoBERTa-style tables reserve
    ``padding_idx + 1`` rows before the first position)."""
    cfg = placing.text_config(hf)
    n = getattr(cfg, "max_position_embeddings", None) or 65536
    for name, module in hf.named_modules():
        if isinstance(module, nn.Embedding) and "position" in name and module.padding_idx is not None:
            return int(n) - int(module.padding_idx) - 1
    return int(n)


class Host(Hooked, nn.Module):
    """A placed transformers model (``.hf``) with attnx's export signature."""

    kind = "transformers"

    def __init__(self, hf: nn.Module, task: str, st: SentenceTransformerInfo | None = None,
                 source: str | None = None, max_length: int | None = None):
        super().__init__()
        if placing.placement_of(hf) is None:
            raise ValueError("the model has no placed variant: attnx.pretrained.place(model, variant) first")
        self.hf = hf
        self.task = check_task(task)
        if getattr(hf.config, "_experts_implementation", None) == "grouped_mm" and \
                hasattr(hf, "set_experts_implementation"):
            # mixture-of-experts: every expert on every token (exact; grouped_mm has no ONNX translation)
            hf.set_experts_implementation("batched_mm")
        if st is not None and task != "feature-extraction":
            raise ValueError(f"a sentence-transformers folder is a feature-extraction model, not {task}")
        self.st = st
        self.source = source
        self.max_seq = max_positions(hf)
        self.max_length = min(self.max_seq, max_length or self.max_seq)
        cfg = placing.text_config(hf)
        self.vocab_size = int(cfg.vocab_size)
        params = inspect.signature(hf.forward).parameters
        types = int(getattr(cfg, "type_vocab_size", 0) or 0)
        self.type_vocab_size = types if types > 1 and "token_type_ids" in params else 0
        self.causal = any(b.config.is_causal for b in placing.blocks(hf))
        self.derive_positions = self.causal and "position_ids" in params
        fresh = {f"hf.{n}" for n in getattr(hf, "attnx_initialized", ())}  # not from the folder (load_model)
        self.pretrained_names: set[str] = set(self.state_dict()) - set(self.variant_parameter_names()) - fresh

    # ---- the placement --------------------------------------------------------------------------
    @property
    def placement(self) -> placing.Placement:
        return placing.placement_of(self.hf)

    @property
    def variant(self) -> str:
        return self.placement.variant

    @property
    def blocks(self) -> list:
        return placing.blocks(self.hf)

    @property
    def replaced(self) -> list[int]:
        """The layers whose attention the variant replaced."""
        if self.variant == "mha":
            return []
        layers = self.blocks[:len(self.hf.attnx_attention)]
        return [i for i, b in enumerate(layers) if b.variant != "mha"]

    @property
    def n_heads(self) -> int:
        return self.blocks[0].config.n_heads

    def variant_parameter_names(self) -> list[str]:
        return [f"hf.{n}" for n in placing.variant_parameter_names(self.hf)]

    def load_variant_checkpoint(self, path) -> None:
        """Load a placed variant's trained parameters, named as in the placed model's own state dict
        (``save_pretrained`` of it) or as in an export's weights file; strict: every variant parameter
        must be there, nothing unknown may be."""
        from attnx.models.checkpoint import read_checkpoint

        state = read_checkpoint(self, path, required=self.variant_parameter_names(), what=f"{self.variant} placement",
                                prefix="hf.")
        self.load_state_dict(state, strict=False)

    # ---- the signature ---------------------------------------------------------------------------
    def context_inputs(self) -> list[InputSpec]:
        return placing.context_inputs(self.hf)

    def extra_outputs(self):
        return placing.extra_outputs(self.hf)

    def base_input_specs(self) -> list[InputSpec]:
        specs = [InputSpec("input_ids", ("batch", "seq"), "int64", Role.INPUT_IDS, "token ids",
                           range=(0, self.vocab_size)),
                 InputSpec("attention_mask", ("batch", "seq"), "mask", Role.ATTENTION_MASK, "1 = token, 0 = padding")]
        if self.type_vocab_size:
            specs.append(InputSpec("token_type_ids", ("batch", "seq"), "int64", Role.TOKEN_TYPE_IDS,
                                   "segment ids (0 for single sentences)", range=(0, self.type_vocab_size)))
        return specs

    def input_specs(self) -> list[InputSpec]:
        return self.base_input_specs() + self.context_inputs()

    def base_output_specs(self) -> list[OutputSpec]:
        cfg = placing.text_config(self.hf)
        if self.task == "causal-lm":
            return [OutputSpec("logits", ("batch", "seq", self.vocab_size), "float", Role.OUTPUT,
                               "next-token logits at every position")]
        if self.task == "sequence-classification":
            return [OutputSpec("logits", ("batch", int(self.hf.config.num_labels)), "float", Role.OUTPUT,
                               "class logits (labels: attnx.config hf_config.id2label)")]
        d = int(cfg.hidden_size)
        out = [OutputSpec("last_hidden_state", ("batch", "seq", d), "float", Role.OUTPUT,
                          "the model's last hidden states")]
        if self.st is not None:
            out.append(OutputSpec("sentence_embedding", ("batch", d), "float", Role.OUTPUT,
                                  f"{self.st.pooling} pooling" + (", L2-normalised" if self.st.normalize else "")))
        return out

    def output_specs(self) -> list[OutputSpec]:
        extras = [OutputSpec(o.name, o.shape, o.dtype, Role.AUX, o.doc) for o, _ in self.extra_outputs()]
        return self.base_output_specs() + extras

    def output_names(self) -> list[str]:
        return [o.name for o in self.output_specs()]

    # ---- the forward -----------------------------------------------------------------------------
    def forward_named(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        base = {s.name for s in self.base_input_specs()}
        head_mask = inputs.get("head_mask")
        context = {k: v for k, v in inputs.items() if k not in base and k != "head_mask"}
        ids, mask = inputs["input_ids"], inputs.get("attention_mask")
        if not torch.compiler.is_exporting():
            check_inputs(self.input_specs(), {k: v for k, v in inputs.items() if k != "head_mask"},
                         optional=("attention_mask", "token_type_ids"))
            if ids.shape[1] > self.max_seq:
                raise ValueError(f"input_ids: sequence length {ids.shape[1]} exceeds the model's {self.max_seq} "
                                 "positions")
        if head_mask is not None:
            from attnx.models.encoder import expand_head_mask

            head_mask = expand_head_mask(head_mask, len(self.blocks), self.n_heads)
        if mask is None:
            mask = torch.ones_like(ids)
        kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
        if self.type_vocab_size:
            tt = inputs.get("token_type_ids")
            kwargs["token_type_ids"] = torch.zeros_like(ids) if tt is None else tt
        if self.derive_positions:
            kwargs["position_ids"] = positions_from_mask(mask)
        if "use_cache" in inspect.signature(self.hf.forward).parameters:
            kwargs["use_cache"] = False
        call = backend.Call(context=context, tokens=mask, head_mask=head_mask)
        with backend.calling(call):
            result = self.hf(**kwargs)
        out = {}
        if self.task == "feature-extraction":
            x = result.last_hidden_state if hasattr(result, "last_hidden_state") else result[0]
            out["last_hidden_state"] = x
            if self.st is not None:
                emb = pool(x, mask, self.st.pooling)
                out["sentence_embedding"] = F.normalize(emb, p=2.0, dim=-1) if self.st.normalize else emb
        else:
            out["logits"] = result.logits
        blocks = self.blocks
        out.update({spec.name: spec.read(blocks[i].attn) for spec, i in self.extra_outputs()})
        return out

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, **context):
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
        return self.forward_named({k: v for k, v in {**inputs, **context}.items() if v is not None})

    # ---- metadata ---------------------------------------------------------------------------------
    def config_dict(self) -> dict:
        config = self.hf.config.to_dict()
        config.pop("attnx", None)
        return {"kind": "pretrained", "host": self.kind, "task": self.task, "architecture": type(self.hf).__name__,
                "hf_config": config, "placement": self.placement.to_dict(), "source": self.source,
                "sentence_transformers": self.st.to_dict() if self.st else None, "max_length": self.max_length}

    def metadata_extra(self) -> dict:
        return {"max_length": self.max_length}

    @classmethod
    def from_config(cls, config: dict) -> "Host":
        """An untrained host of the architecture an export's ``attnx.config`` describes (weights next)."""
        hf = build_model(config["hf_config"], config["architecture"])
        placing.place(hf, placing.Placement.from_dict(config.get("placement")))
        st = config.get("sentence_transformers")
        return cls(hf, config.get("task", "feature-extraction"), SentenceTransformerInfo(**st) if st else None,
                   config.get("source"), config.get("max_length")).eval()


def build_model(hf_config: dict, architecture: str):
    """transformers' own class ``architecture`` (no remote code) on ``hf_config``, random weights."""
    import transformers
    from transformers import PreTrainedModel

    cls = getattr(transformers, str(architecture), None)
    if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
        raise ValueError(f"{architecture!r} is not a model class of transformers {transformers.__version__}")
    hf_config = {k: v for k, v in hf_config.items() if k != "auto_map"}
    config = transformers.AutoConfig.for_model(hf_config.pop("model_type"), **hf_config)
    return cls._from_config(config).eval()
