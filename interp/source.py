"""Where attention patterns come from: a deployed export, a running server, or a torch model.

    source = open_source("minilm.onnx")                  # ONNX Runtime over an export with attentions.{i}
    source = open_source("http://127.0.0.1:8000/minilm") # a running `attnx serve` (KServe v2 + /explain/.../info)
    source = open_source("path/to/hf-folder")            # a pretrained folder, run by its torch host
    batch = source.encoder.encode(["The cat sat on the mat"])
    out = source.run(batch.feeds, ["sentence_embedding", "attentions.0"])

Each is a :class:`attnx.explain.source.Source` (``facts``, ``encoder``, ``run(feeds, outputs)`` with
numpy in and out), so :mod:`attnx.explain` explains all of them alike. Opening one needs the
runtime (an export), tritonclient (a server) or torch with the exporter (a folder, an export's
reference), each imported when that source is opened.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from attnx.contract import ContractError, ModelInfo, TensorEntry, TokenizerSettings
from attnx.explain.source import ExplainError, Source, TextEncoder, model_facts


class SessionSource(Source):
    """A runtime :class:`~attnx.runtime.core.session.Session` (ONNX Runtime, or an engine where one runs)."""

    def __init__(self, session, info: ModelInfo, folder: Path, name: str):
        self.session = session
        facts = model_facts(info, name)
        encoder = None
        if info.tokenizer is not None:
            encoder = TextEncoder.from_file(info.tokenizer.path(folder), info.tokenizer,
                                            info.input_names)
        super().__init__(facts, encoder, label=getattr(session, "provider", "runtime"))

    def run(self, feeds, outputs):
        return self.session.run(dict(feeds), list(outputs))

    def close(self) -> None:
        self.session.close()


def _onnx_source(path: Path) -> SessionSource:
    from attnx.runtime.core.loading import load

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
        if body.get("tokenizer_json") and info.tokenizer is not None:
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

    def __init__(self, model, name: str, tokenizer: TokenizerSettings | dict | None = None,
                 tokenizer_path: Path | None = None):
        from attnx.export.attention_outputs import WithAttentionOutputs

        if not isinstance(model, WithAttentionOutputs):
            model = WithAttentionOutputs(model, list(range(len(model.blocks))), head_mask=True)
        self.model = model.eval()
        info = ModelInfo(variant=model.variant, config=model.config_dict(), lowering="torch", precision="fp32",
                         inputs=[_entry(s) for s in model.input_specs()],
                         outputs=[_entry(s) for s in model.output_specs()], profiles={}, tokenizer=tokenizer)
        encoder = None
        if info.tokenizer is not None and tokenizer_path is not None:
            encoder = TextEncoder.from_file(tokenizer_path, info.tokenizer, info.input_names)
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
    if info.tokenizer is not None:
        tok_path = info.tokenizer.path(path.parent)
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
