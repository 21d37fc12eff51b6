"""Model weights as safetensors: strict loading (every missing, unexpected or mis-shaped tensor is
named) and saving beside an export (the PyTorch reference ``attnx check`` rebuilds)."""

from __future__ import annotations

from pathlib import Path

from torch import nn


def read_checkpoint(model: nn.Module, checkpoint: str | Path, *, required=None, what: str = "model",
                    prefix: str = "") -> dict:
    """The tensors of a safetensors file, checked against ``model``: every name in ``required``
    (default: all of the model's) present, none unknown, none mis-shaped; else one error listing them.
    ``prefix``: the model's names carry it and the file's may not (a wrapped model's own checkpoint)."""
    from safetensors.torch import load_file

    path = Path(checkpoint)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        state = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"cannot read checkpoint {path}: {e}") from None
    if prefix and state and not any(k.startswith(prefix) for k in state):
        state = {prefix + k: v for k, v in state.items()}
    own = model.state_dict()
    for name, alias in _aliases(model).items():  # tied weights are stored once (save_checkpoint)
        if name not in state and alias in state:
            state[name] = state[alias]
    missing = sorted(set(own if required is None else required) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong = [f"{k} {list(state[k].shape)} (model expects {list(own[k].shape)})"
             for k in sorted(set(own) & set(state)) if state[k].shape != own[k].shape]
    problems = [f"{label} {len(items)}: {', '.join(items[:4])}{' ...' if len(items) > 4 else ''}"
                for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if items]
    if problems:
        raise ValueError(f"checkpoint {path.name} does not fit this {what}: " + " | ".join(problems))
    return state


def load_checkpoint(model: nn.Module, checkpoint: str | Path) -> None:
    """Load safetensors weights; any missing, unexpected or mis-shaped tensor is a clear error."""
    model.load_state_dict(read_checkpoint(model, checkpoint, what=f"{getattr(model, 'variant', '')} model"))


def save_checkpoint(model: nn.Module, path: str | Path, names=None) -> Path:
    """Every tensor of ``model.state_dict()`` (or those in ``names``); a tied weight (one Parameter under two
    names) is stored once."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    aliases = _aliases(model)
    tmp = path.with_name(path.name + ".tmp")
    wanted = None if names is None else set(names)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()
               if k not in aliases and (wanted is None or k in wanted)}, str(tmp))
    tmp.replace(path)
    return path


def _aliases(model: nn.Module) -> dict[str, str]:
    """``{name: first name}`` for state_dict entries that are the same tensor as an earlier entry."""
    first: dict[tuple, str] = {}
    out = {}
    for name, value in model.state_dict(keep_vars=True).items():
        key = (value.data_ptr(), tuple(value.shape), value.dtype)
        if key in first:
            out[name] = first[key]
        else:
            first[key] = name
    return out

