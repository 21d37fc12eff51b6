"""What explaining knows of a model and how it runs one: facts, tokenizer, the source interface.

    facts = model_facts(ModelInfo.read("minilm.onnx"), "minilm")
    encoder = TextEncoder.from_file(folder / "tokenizer.json", info.tokenizer, info.input_names)
    batch = encoder.encode(["The cat sat on the mat"])
    out = source.run(batch.feeds, ["sentence_embedding", "attentions.0"])

A :class:`Source` has ``facts`` (:class:`ModelFacts`: layers, heads, which layers return patterns,
whether it takes ``head_mask``, the context inputs, the main output), an ``encoder``
(:class:`TextEncoder`, the export's own tokenizer settings) and ``run(feeds, outputs)`` with numpy
in and out. The sources that open a model (an ONNX export, a running server, a torch model:
:func:`attnx.interp.source.open_source`) live in :mod:`attnx.interp`; the server's ``/explain``
page passes its own batcher. numpy only, so the server uses this module too.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from attnx.contract import ContractError, ModelInfo, Role, TensorEntry, TokenizerSettings, pretrained_task

#: Output names of the per-layer attention patterns (``attnx export --attention-outputs``).
ATTENTION_OUTPUT = re.compile(r"^attentions\.(\d+)$")
#: The output that best stands for "what the model says", most specific first.
_MAIN_OUTPUTS = ("sentence_embedding", "logits", "last_hidden_state", "output")


def attention_output_name(layer: int) -> str:
    return f"attentions.{layer}"


class ExplainError(ValueError):
    """A request the model cannot answer (no attention outputs, a layer out of range, ...): one line."""


@dataclass
class ModelFacts:
    """What explaining needs to know about a model, read from its attnx metadata."""

    name: str
    variant: str
    n_layers: int
    n_heads: int
    attention_layers: list[int]  # layers whose patterns the model returns
    head_mask: bool  # takes head_mask [n_layers, n_heads]
    is_causal: bool
    main_output: str
    inputs: list[TensorEntry]
    outputs: list[TensorEntry]
    tokenizer: TokenizerSettings | None = None

    @property
    def context_inputs(self) -> list[TensorEntry]:
        return [e for e in self.inputs if e.role == Role.CONTEXT]

    @property
    def extra_outputs(self) -> list[TensorEntry]:
        """Auxiliary outputs other than the patterns (e.g. a variant's per-example decision)."""
        return [e for e in self.outputs if e.role == Role.AUX and not ATTENTION_OUTPUT.match(e.name)]

    def check_layer(self, layer: int, *, needs_pattern: bool = False) -> int:
        if not 0 <= int(layer) < self.n_layers:
            raise ExplainError(f"layer {layer} out of range: {self.name} has {self.n_layers} layers "
                               f"(0..{self.n_layers - 1})")
        if needs_pattern and int(layer) not in self.attention_layers:
            raise ExplainError(f"{self.name} returns no attention pattern for layer {layer} (it has "
                               f"{_layers_text(self.attention_layers)}); re-export with --attention-outputs all")
        return int(layer)

    def check_head(self, head: int) -> int:
        if not 0 <= int(head) < self.n_heads:
            raise ExplainError(f"head {head} out of range: {self.name} has {self.n_heads} heads per layer "
                               f"(0..{self.n_heads - 1})")
        return int(head)

    def require_patterns(self) -> None:
        if not self.attention_layers:
            raise ExplainError(f"{self.name} has no attention outputs: export it with `attnx export "
                               "--attention-outputs all` (and --head-mask for ablation)")

    def require_head_mask(self) -> None:
        if not self.head_mask:
            raise ExplainError(f"{self.name} takes no head_mask input: export it with `attnx export --head-mask` "
                               "to ablate heads")

    def check_head_mask(self, head_mask) -> np.ndarray:
        """A head mask as the model takes it: float32 ``[n_layers, n_heads]`` of finite values."""
        self.require_head_mask()
        arr = np.asarray(head_mask)
        if arr.dtype.kind not in "fiub":
            raise ExplainError(f"head_mask: dtype {arr.dtype} is not numeric (float32 [n_layers, n_heads])")
        if arr.shape != (self.n_layers, self.n_heads):
            raise ExplainError(f"head_mask: shape {list(arr.shape)}, {self.name} takes [{self.n_layers}, "
                               f"{self.n_heads}] (layers, heads)")
        arr = arr.astype(np.float32)
        if not np.isfinite(arr).all():
            raise ExplainError("head_mask holds NaN or infinite values")
        return arr


def _layers_text(layers: Sequence[int]) -> str:
    return f"layers {', '.join(map(str, layers))}" if layers else "no attention outputs"


def model_facts(info: ModelInfo, name: str) -> ModelFacts:
    """:class:`ModelFacts` from an export's metadata (attnx encoders and pretrained hosts)."""
    cfg = info.config or {}
    heads_mask = next((e for e in info.inputs if e.role == Role.HEAD_MASK), None)
    patterns = sorted(int(m.group(1)) for e in info.outputs if (m := ATTENTION_OUTPUT.match(e.name)))
    if cfg.get("kind") == "pretrained":
        hf = cfg.get("hf_config") or {}
        n_layers = int(hf.get("num_hidden_layers", hf.get("n_layer", 0))) + int((cfg.get("placement") or {})
                                                                                 .get("append", 0))
        n_heads = int(hf.get("num_attention_heads", hf.get("n_head", 0)))
        is_causal = pretrained_task(cfg) == "causal-lm"
    else:
        attention = cfg.get("attention") or {}
        n_layers = int((cfg.get("encoder") or {}).get("n_layers", 0))
        n_heads = int(next(iter(attention.values()), {}).get("n_heads", 0))
        is_causal = any(bool(a.get("is_causal")) for a in attention.values())
    if heads_mask is not None:  # the file's own dims are the truth
        n_layers, n_heads = int(heads_mask.shape[0]), int(heads_mask.shape[1])
    for e in info.outputs:
        if ATTENTION_OUTPUT.match(e.name) and isinstance(e.shape[1], int):
            n_heads = int(e.shape[1])
    if n_layers <= 0 or n_heads <= 0:
        raise ContractError(f"{name}: cannot tell the number of layers and heads from its attnx metadata")
    names = [e.name for e in info.outputs]
    main = next((n for n in _MAIN_OUTPUTS if n in names), None) or next(
        (e.name for e in info.outputs if e.role == Role.OUTPUT), names[0])
    return ModelFacts(name=name, variant=info.variant, n_layers=n_layers, n_heads=n_heads, attention_layers=patterns,
                      head_mask=heads_mask is not None, is_causal=is_causal, main_output=main,
                      inputs=list(info.inputs), outputs=list(info.outputs), tokenizer=info.tokenizer)


# --------------------------------------------------------------------------- text -> feeds


@dataclass
class EncodedBatch:
    """Texts tokenised as the export expects, right-padded to the longest."""

    texts: list[str]
    tokens: list[list[str]]  # display strings per example (no padding)
    feeds: dict[str, np.ndarray]  # input_ids, attention_mask, token_type_ids (those the model takes)
    special: np.ndarray  # [B, L] bool: [CLS]/[SEP]/BOS/EOS positions

    @property
    def attention_mask(self) -> np.ndarray:
        return self.feeds["attention_mask"]

    @property
    def lengths(self) -> list[int]:
        return [len(t) for t in self.tokens]


class TextEncoder:
    """The export's tokenizer with its recorded settings: truncation to ``max_length`` on the recorded
    side, no padding of single texts (the tokenizer file's own padding and truncation are replaced)."""

    def __init__(self, tokenizer_json: str, settings: TokenizerSettings, input_names: Sequence[str]):
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_str(tokenizer_json)
        except Exception as e:  # tokenizers raises its own exception type
            raise ContractError(f"cannot read the tokenizer: {str(e).splitlines()[0][:120]}") from None
        # The export's own length: there is no default (a guessed 512 cut texts a model never saw whole).
        self.max_length, self.pad_id = settings.max_length, settings.pad_id
        # Byte-level BPE (GPT-2, Llama 3, Qwen...): tokens read "Ġcat"; each is shown decoded (" cat").
        decoder = json.loads(tokenizer_json).get("decoder") or {}
        self.byte_level = "ByteLevel" in {decoder.get("type"), *(d.get("type") for d in decoder.get("decoders") or [])}
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(self.max_length, direction=settings.truncation_side)
        self.input_names = list(input_names)

    @classmethod
    def from_file(cls, path: Path, settings: TokenizerSettings, input_names: Sequence[str]) -> "TextEncoder":
        if not path.is_file():
            raise ContractError(f"the tokenizer file {path} is missing (it is written beside the export)")
        return cls(path.read_text(encoding="utf-8"), settings, input_names)

    def _display(self, enc) -> list[str]:
        if self.byte_level:
            return [self.tokenizer.decode([i], skip_special_tokens=False) for i in enc.ids]
        return list(enc.tokens)

    def token_id(self, token: str) -> int:
        """The id of one token given as text (``" mat"``) or as a number."""
        if token.strip().isdigit():
            return int(token)
        found = self.tokenizer.token_to_id(token)
        if found is None:
            ids = self.tokenizer.encode(token, add_special_tokens=False).ids
            if len(ids) != 1:
                raise ExplainError(f"target {token!r} is {len(ids)} tokens, not one: give a single token or its id")
            found = ids[0]
        return int(found)

    def encode(self, texts: str | Sequence[str]) -> EncodedBatch:
        texts = [texts] if isinstance(texts, str) else list(texts)
        if not texts:
            raise ExplainError("no text given")
        encodings = self.tokenizer.encode_batch(texts)
        empty = [t for t, e in zip(texts, encodings) if not e.ids]
        if empty:
            raise ExplainError(f"the text {empty[0]!r} tokenised to no tokens")
        length = max(len(e.ids) for e in encodings)
        b = len(texts)
        ids = np.full((b, length), self.pad_id, dtype=np.int64)
        mask = np.zeros((b, length), dtype=np.int64)
        types = np.zeros((b, length), dtype=np.int64)
        special = np.zeros((b, length), dtype=bool)
        for row, e in enumerate(encodings):
            n = len(e.ids)
            ids[row, :n], mask[row, :n], types[row, :n] = e.ids, 1, e.type_ids
            special[row, :n] = np.asarray(e.special_tokens_mask, dtype=bool)
        available = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        feeds = {k: v for k, v in available.items() if k in self.input_names}
        return EncodedBatch(texts, [self._display(e) for e in encodings], feeds, special)


# --------------------------------------------------------------------------- sources


@dataclass
class Source:
    """A model that explaining can run: ``facts``, ``encoder`` and ``run``."""

    facts: ModelFacts
    encoder: TextEncoder | None
    label: str = ""  # where it runs, for humans ("onnxruntime", "server http://...", "torch")
    extra: dict = field(default_factory=dict)

    def run(self, feeds: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def close(self) -> None:
        """Release connections or sessions (optional)."""

    def require_text(self) -> TextEncoder:
        if self.encoder is None:
            raise ExplainError(f"{self.facts.name} carries no tokenizer (it takes "
                               f"{', '.join(e.name for e in self.facts.inputs)}): text cannot be fed to it")
        return self.encoder


def read_context(path: str | os.PathLike | None, facts: ModelFacts) -> dict[str, np.ndarray]:
    """A JSON file ``{input name: nested list}`` of context values for one example (the batch dim may be
    left out), checked against the model's context inputs."""
    if path is None:
        return {}
    p = Path(path)
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"no such context file: {p}") from None
    except ValueError as e:
        raise ExplainError(f"{p}: not valid JSON ({e})") from None
    specs = {e.name: e for e in facts.context_inputs}
    if not isinstance(raw, dict):
        raise ExplainError(f"{p}: expected a JSON object {{input name: values}}")
    if not specs:
        raise ExplainError(f"{facts.name} takes no context inputs (it is {facts.variant!r} attention)")
    unknown = sorted(set(raw) - set(specs))
    if unknown:
        raise ExplainError(f"{p}: unknown context input(s) {unknown}; {facts.name} takes {_describe(specs.values())}")
    out = {}
    for name, value in raw.items():
        spec = specs[name]
        try:
            arr = np.asarray(value, dtype=np.dtype(spec.dtype))
        except (TypeError, ValueError):
            raise ExplainError(f"{p}: {name} is not a regular array of {spec.dtype}") from None
        fixed = [d for d in spec.shape if d != "batch"]
        if arr.ndim == len(fixed):
            arr = arr[None]
        shape = [1 if d == "batch" else d for d in spec.shape]
        if arr.ndim != len(shape) or any(isinstance(w, int) and w != g for w, g in zip(shape, arr.shape)):
            raise ExplainError(f"{p}: {name} has shape {list(arr.shape)}, expected {_dims(spec)}")
        if spec.range is not None and arr.size and (arr.min() < spec.range[0] or arr.max() >= spec.range[1]):
            raise ExplainError(f"{p}: {name} values must be in [{spec.range[0]}, {spec.range[1]})")
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise ExplainError(f"{p}: {name} holds NaN or infinite values")
        out[name] = arr
    return out


def _dims(e: TensorEntry) -> str:
    return "[" + ", ".join(str(d) for d in e.shape) + "]"


def _describe(entries) -> str:
    return ", ".join(f"{e.name} {e.dtype} {_dims(e)}" for e in entries)
