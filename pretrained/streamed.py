"""A transformers model whose pretrained weights are never in memory: built on the meta device, each
parameter bound by name to a tensor of its source (:mod:`attnx.pretrained.tensors`), read when the
export writes it.

    hf = empty_model(folder, task)       # meta parameters (buffers real: rotary inv_freq...), bound to the source
    place(hf, "mha")                     # placing probes a forward on meta; the variant's own parameters are real
    hf = with_placeholders(hf)           # meta -> CPU placeholders of no memory, so torch.export can trace it
    hf.attnx_source                      # Binding: model parameter name -> source tensor name, the source

Tracing needs CPU tensors (a meta parameter beside CPU inputs is refused by the fake tensors' device
checks); a placeholder is one zero element expanded to the parameter's shape (stride 0: no memory,
any shape). Its values are never read: the trace sees shapes only, and the exporter replaces every
initializer it makes from a bound parameter by a lazy read of the source (:mod:`attnx.export.streaming`).

A model whose parameters do not map one to one onto the source's tensors (names after transformers'
base-model prefix, shapes) is not bound (:func:`empty_model` returns None): the caller loads it whole.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

_FLOAT = ("F32", "F16", "BF16")


@dataclass
class Binding:
    source: object  # TensorSource
    names: dict[str, str]  # the model's parameter name (named_parameters, deduplicated) -> source tensor name


def _build_empty(cls, config):
    from accelerate import init_empty_weights

    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with init_empty_weights(include_buffers=False):  # buffers (rotary inv_freq) are computed, not loaded
            model = cls._from_config(config, dtype=torch.float32)
        model.tie_weights()  # init_empty_weights re-registers each meta parameter: a tied head lost its tie
    finally:
        quiet.setLevel(level)
    return model.eval()


def _source_names(model, infos: dict) -> dict[str, str] | str:
    """Each parameter's source tensor (by any of its tied names, with or without the base-model prefix);
    a reason string where one does not map."""
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    out = {}
    for name, p in model.named_parameters():
        if sum(a in infos for a in aliases[id(p)]) > 1:  # a tied weight stored twice: transformers may untie it
            return f"the checkpoint holds {' and '.join(a for a in aliases[id(p)] if a in infos)}, tied in the model"
        found = None
        for alias in aliases[id(p)]:
            candidates = [alias]
            if prefix and alias.startswith(prefix + "."):
                candidates.append(alias[len(prefix) + 1:])
            elif prefix:
                candidates.append(f"{prefix}.{alias}")
            found = next((c for c in candidates if c in infos), None)
            if found:
                break
        if found is None:
            return f"the checkpoint has no tensor {name}"
        info = infos[found]
        if tuple(info.shape) != tuple(p.shape):
            return f"{found} has shape {list(info.shape)}, the model's {name} {list(p.shape)}"
        if info.dtype.upper() not in _FLOAT and not info.dtype.upper().startswith(("Q", "IQ", "TQ")):
            return f"{found} is {info.dtype}"
        out[name] = found
    return out


def empty_model(folder, cls, config):
    """``cls`` on ``config`` with meta parameters bound to ``folder``'s tensor source (``attnx_source``), or
    None where they do not map onto it (see the module doc)."""
    from attnx.pretrained.tensors import source_of

    model = _build_empty(cls, config)
    source = source_of(folder)
    names = _source_names(model, source.infos())
    if isinstance(names, str):
        source.close()
        return None
    _load_buffers(model, source)
    model.attnx_source = Binding(source, names)
    model.attnx_initialized = []
    return model


def _load_buffers(model, source) -> None:
    """Persistent buffers the checkpoint holds (small: position ids...) take its values."""
    infos = source.infos()
    persistent = set(model.state_dict())
    for name, buffer in list(model.named_buffers()):
        if name in persistent and name in infos and tuple(infos[name].shape) == tuple(buffer.shape):
            buffer.data = source.read(name).to(buffer.dtype)


def _placeholder(p: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.zeros((), dtype=p.dtype).expand(p.shape), requires_grad=False)


def with_placeholders(model):
    """Every meta parameter of ``model`` replaced (ties kept) by a CPU placeholder of no memory."""
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is not None and p.device.type == "meta":
                if id(p) not in new:
                    new[id(p)] = _placeholder(p)
                module._parameters[key] = new[id(p)]
    return model


def load_materialized(folder, cls, config):
    """``cls`` on ``config`` with every parameter read from ``folder``'s tensor source in fp32 (a folder
    without weight files of its own: a GGUF-backed one)."""
    from attnx.pretrained.tensors import source_of

    model = _build_empty(cls, config)
    source = source_of(folder)
    try:
        names = _source_names(model, source.infos())
        if isinstance(names, str):
            raise ValueError(f"{folder.path}: {names}")
        _load_buffers(model, source)
        real: dict[int, nn.Parameter] = {}
        params = dict(model.named_parameters())
        for name, src in names.items():
            real[id(params[name])] = nn.Parameter(source.read(src).to(torch.float32), requires_grad=False)
        for module in model.modules():
            for key, p in list(module._parameters.items()):
                if p is not None and id(p) in real:
                    module._parameters[key] = real[id(p)]
    finally:
        source.close()
    model.attnx_initialized = []
    return model.eval()
