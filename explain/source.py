"""Where attention patterns come from: a deployed export, a running server, or a torch model.

    source = open_source("minilm.onnx")                  # ONNX Runtime over an export with attentions.{i}
    source = open_source("http://127.0.0.1:8000/minilm") # a running `attnx serve` (KServe v2 + /explain/.../info)
    source = open_source("path/to/hf-folder")            # a pretrained folder, run by its torch host
    batch = source.encoder.encode(["The cat sat on the mat"])
    out = source.run(batch.feeds, ["sentence_embedding", "attentions.0"])

Every source has ``facts`` (:class:`ModelFacts`: layers, heads, which layers return patterns,
whether it takes ``head_mask``, the context inputs, the main output), an ``encoder``
(:class:`TextEncoder`, the export's own tokenizer settings) and ``run(feeds, outputs)`` with numpy
in and out. Nothing here imports torch except the torch source, so the server uses this module too.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from attnx.contract import ContractError, ModelInfo, Role, TensorEntry, contained, pretrained_task

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
    tokenizer: dict | None = None

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

    def __init__(self, tokenizer_json: str, settings: Mapping, input_names: Sequence[str]):
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_str(tokenizer_json)
        except Exception as e:  # tokenizers raises its own exception type
            raise ContractError(f"cannot read the tokenizer: {str(e).splitlines()[0][:120]}") from None
        self.max_length = int(settings.get("max_length") or 512)
        self.pad_id = int(settings.get("pad_id") or 0)
        # Byte-level BPE (GPT-2, Llama 3, Qwen...): tokens read "Ġcat"; each is shown decoded (" cat").
        decoder = json.loads(tokenizer_json).get("decoder") or {}
        self.byte_level = "ByteLevel" in {decoder.get("type"), *(d.get("type") for d in decoder.get("decoders") or [])}
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(self.max_length, direction=str(settings.get("truncation_side") or "right"))
        self.input_names = list(input_names)

    @classmethod
    def from_file(cls, path: Path, settings: Mapping, input_names: Sequence[str]) -> "TextEncoder":
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


class SessionSource(Source):
    """A runtime :class:`~attnx.runtime.session.Session` (ONNX Runtime, or an engine where one runs)."""

    def __init__(self, session, info: ModelInfo, folder: Path, name: str):
        self.session = session
        facts = model_facts(info, name)
        encoder = None
        if info.tokenizer:
            tok_dir = contained(folder, info.tokenizer["dir"], "the tokenizer folder named by attnx.tokenizer")
            encoder = TextEncoder.from_file(tok_dir / info.tokenizer.get("file", "tokenizer.json"), info.tokenizer,
                                            info.input_names)
        super().__init__(facts, encoder, label=getattr(session, "provider", "runtime"))

    def run(self, feeds, outputs):
        return self.session.run(dict(feeds), list(outputs))

    def close(self) -> None:
        self.session.close()


def _onnx_source(path: Path) -> SessionSource:
    from attnx.runtime.session import load

    info = ModelInfo.read(path)
    if info is None:
        raise ContractError(f"{path} has no attnx metadata (not an `attnx export` file)")
    return SessionSource(load(path, device="cpu"), info, path.parent, path.name)


class ServerSource(Source):
    """A model behind a running ``attnx serve``: metadata and tokenizer from ``/explain/{model}/info``,
    inference through the KServe v2 protocol with the unmodified ``tritonclient``."""

    def __init__(self, url: str, model: str | None = None, timeout: float = 60.0):
        import httpx
        import tritonclient.http as httpclient

        base, _, path_model = url.rstrip("/").partition("/v2/models/")
        m = re.match(r"^(https?://[^/]+)(?:/(.*))?$", base)
        if not m:
            raise ExplainError(f"not a server URL: {url!r} (expected http://host:port[/model])")
        root, rest = m.group(1), (m.group(2) or "").strip("/")
        model = model or path_model.split("/")[0] or rest or None
        try:
            if model is None:
                index = httpx.post(f"{root}/v2/repository/index", timeout=timeout).json()
                names = [m_["name"] for m_ in index]
                if len(names) != 1:
                    raise ExplainError(f"{root} serves {names}: name one (URL {root}/MODEL or --model)")
                model = names[0]
            resp = httpx.get(f"{root}/explain/{model}/info", timeout=timeout)
        except httpx.HTTPError as e:
            raise ExplainError(f"cannot reach {root}: {e}") from None
        if resp.status_code != 200:
            raise ExplainError(f"{root}: {_error_text(resp)}")
        body = resp.json()
        info = ModelInfo.from_props(body["metadata"])
        if info is None:
            raise ExplainError(f"{root}: model {model!r} has no attnx metadata")
        encoder = None
        if body.get("tokenizer_json") and info.tokenizer:
            encoder = TextEncoder(body["tokenizer_json"], info.tokenizer, info.input_names)
        super().__init__(model_facts(info, model), encoder, label=f"server {root}")
        self.root, self.model_name = root, model
        self.client = httpclient.InferenceServerClient(root.split("://", 1)[1], network_timeout=timeout,
                                                       connection_timeout=timeout)
        self._dtypes = {e.name: np.dtype(e.dtype) for e in info.inputs}

    def run(self, feeds, outputs):
        import tritonclient.http as httpclient
        from tritonclient.utils import InferenceServerException, np_to_triton_dtype

        inputs = []
        for name, value in feeds.items():
            arr = np.ascontiguousarray(value, dtype=self._dtypes.get(name))
            item = httpclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
            item.set_data_from_numpy(arr, binary_data=True)
            inputs.append(item)
        wanted = [httpclient.InferRequestedOutput(n, binary_data=True) for n in outputs]
        try:
            result = self.client.infer(self.model_name, inputs, outputs=wanted)
        except InferenceServerException as e:
            raise ExplainError(f"server: {e.message()}") from None
        return {n: result.as_numpy(n) for n in outputs}

    def close(self) -> None:
        self.client.close()


def _error_text(resp) -> str:
    try:
        return str(resp.json().get("error", resp.text))
    except ValueError:
        return f"HTTP {resp.status_code}: {resp.text[:200]}"


class TorchSource(Source):
    """A torch model with the export signature (``forward_named``), e.g. a pretrained folder's host or an
    export's rebuilt reference, with every layer's pattern and a head mask."""

    def __init__(self, model, name: str, tokenizer: dict | None = None, tokenizer_path: Path | None = None):
        from attnx.export.attention_outputs import WithAttentionOutputs

        if not isinstance(model, WithAttentionOutputs):
            model = WithAttentionOutputs(model, list(range(len(model.blocks))), head_mask=True)
        self.model = model.eval()
        info = ModelInfo(variant=model.variant, config=model.config_dict(), lowering="torch", precision="fp32",
                         inputs=[_entry(s) for s in model.input_specs()],
                         outputs=[_entry(s) for s in model.output_specs()], profiles={}, tokenizer=tokenizer)
        encoder = None
        if tokenizer is not None and tokenizer_path is not None:
            encoder = TextEncoder.from_file(tokenizer_path, tokenizer, info.input_names)
        super().__init__(model_facts(info, name), encoder, label="torch")
        self.info = info

    def run(self, feeds, outputs):
        import torch

        with torch.no_grad():
            tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in feeds.items()}
            if self.facts.head_mask and "head_mask" not in tensors:
                tensors["head_mask"] = torch.ones(self.facts.n_layers, self.facts.n_heads)
            out = self.model.forward_named(tensors)
        return {n: out[n].detach().cpu().numpy() for n in outputs}


def _entry(spec) -> TensorEntry:
    dtype = {"float": "float32", "mask": "int64"}.get(spec.dtype, spec.dtype)
    return TensorEntry(spec.name, spec.role, dtype, tuple(spec.shape), getattr(spec, "range", None), spec.doc)


def folder_source(path: Path) -> TorchSource:
    """A Hugging Face folder run by its torch host (plain attention), with its tokenizer settings."""
    from attnx import pretrained
    from attnx.export.pretrained import tokenizer_info

    folder = pretrained.read_folder(path)
    host = pretrained.load(folder, "mha")
    tok = None
    if (folder.path / "tokenizer.json").is_file():
        tok = tokenizer_info(folder, host.metadata_extra()["max_length"], str(folder.path))
    return TorchSource(host, folder.path.name, tok, folder.path / "tokenizer.json" if tok else None)


def reference_source(path: Path) -> TorchSource:
    """The torch reference of an export (its config and weights file), run through the same interface."""
    from attnx.export.reference import load_reference

    model, info = load_reference(path)
    tok_path = None
    if info.tokenizer:
        tok_path = contained(path.parent, info.tokenizer["dir"], "the tokenizer folder") / info.tokenizer.get(
            "file", "tokenizer.json")
    return TorchSource(model, f"{path.name} (torch reference)", info.tokenizer, tok_path)


def open_source(model: str | os.PathLike, *, server_model: str | None = None) -> Source:
    """An export (``.onnx``), a server URL (``http://host:port[/model]``) or a pretrained folder."""
    text = str(model)
    if re.match(r"^https?://", text):
        return ServerSource(text, server_model)
    path = Path(text)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ExplainError(f"{path} is a folder without config.json: not a Hugging Face model folder")
        return folder_source(path)
    if path.suffix.lower() == ".onnx":
        return _onnx_source(path)
    if not path.exists():
        raise FileNotFoundError(f"no such file or folder: {path}")
    raise ExplainError(f"{path}: expected an .onnx export, a Hugging Face folder or a server URL")


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
