"""Small exported models for the runtime's tests and benchmarks.

``export_model(variant, path)`` makes a ``.onnx`` that follows the export
contract (docs/contracts.md): inputs ``hidden_states [batch, seq, d]``,
``attention_mask [batch, seq]`` int64 and the variant's context inputs, output
``output [batch, seq, d]`` (maw: also ``maw_depth [batch]`` int64), dims named
``batch``/``seq``, ``attnx.*`` metadata.

It uses the real exporter (``attnx.export.export_variant``) whenever that is
importable. Only while the exporter is missing does it fall back to a toy
module with the same contract (masked attention written out in plain ops), so
the runtime can be tested on its own. ``USING_REAL_EXPORTER`` says which.
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

#: Small enough for quick CPU tests, big enough to be a real multi-head encoder.
SMALL = {"overrides": {"d_model": 64, "n_heads": 4}, "n_layers": 1}


def real_exporter():
    """``attnx.export.export_variant`` or None while it does not exist yet."""
    try:
        from attnx.export import export_variant
    except ImportError:
        return None
    return export_variant


USING_REAL_EXPORTER = real_exporter() is not None


def export_model(variant: str, path: str | Path, *, small: bool = True, seed: int = 0) -> Path:
    """Export ``variant`` (maw, smal, ...) to ``path``: the real exporter, else a toy (maw/smal only)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    export_variant = real_exporter()
    if export_variant is not None:
        kwargs = dict(SMALL) if small else {}
        return Path(export_variant(variant, str(path), seed=seed, **kwargs).path)
    return export_toy(variant, path, seed=seed)


_cache_dir: Path | None = None


@functools.lru_cache(maxsize=None)
def cached_model(variant: str, small: bool = True) -> Path:
    """Export once per process into a temporary folder (removed at exit); tests share it."""
    global _cache_dir
    if _cache_dir is None:
        _cache_dir = Path(tempfile.mkdtemp(prefix="attnx-runtime-models-"))
        atexit.register(shutil.rmtree, _cache_dir, True)
    return export_model(variant, _cache_dir / f"{variant}{'' if small else '-default'}.onnx", small=small)


# --------------------------------------------------------------------------------------
# The toy stand-in (only while the real exporter is missing)
# --------------------------------------------------------------------------------------


def export_toy(variant: str, path: Path, *, d_model: int = 64, n_heads: int = 4, seed: int = 0) -> Path:
    """A one-layer masked-attention encoder with the export contract of ``maw`` or ``smal``."""
    import onnx
    import torch
    from torch import nn

    if variant not in ("maw", "smal"):
        raise ValueError(f"the toy stand-in only has maw and smal, not {variant!r}")
    dh = d_model // n_heads
    d_self = 16

    class ToyEncoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(d_model)
            self.qkv = nn.Linear(d_model, 3 * d_model)
            self.out = nn.Linear(d_model, d_model)
            self.policy = nn.Linear(d_model, 5)
            self.beta = nn.Linear(d_self, 1)

        def attend(self, x, mask, self_state=None, trace=None):
            b, n, _ = x.shape
            q, k, v = self.qkv(self.norm(x)).view(b, n, 3, n_heads, dh).permute(2, 0, 3, 1, 4)
            scores = q @ k.transpose(-1, -2) / dh**0.5
            if trace is not None:  # smal-like: a per-key penalty k^T T k scaled by beta(self_state)
                beta = torch.sigmoid(self.beta(self_state))[:, :, None, None]
                ktk = torch.einsum("bhjd,bde,bhje->bhj", k, trace, k)[:, :, None, :]
                scores = scores - beta * ktk
            keep = mask[:, None, None, :] > 0
            scores = scores.masked_fill(~keep, -1e9)
            z = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d_model)
            return x + self.out(z)

    class ToyMaw(ToyEncoder):
        def forward(self, hidden_states, attention_mask):
            m = attention_mask.to(hidden_states.dtype)[..., None]
            pooled = (hidden_states * m).sum(1) / m.sum(1).clamp_min(1.0)
            return self.attend(hidden_states, attention_mask), self.policy(pooled).argmax(-1)

    class ToySmal(ToyEncoder):
        def forward(self, hidden_states, attention_mask, self_state, trace):
            return self.attend(hidden_states, attention_mask, self_state, trace)

    torch.manual_seed(seed)
    model = (ToyMaw() if variant == "maw" else ToySmal()).eval()
    batch, seq = torch.export.Dim("batch", max=1024), torch.export.Dim("seq", max=4096)
    x = torch.randn(2, 8, d_model)
    mask = torch.ones(2, 8, dtype=torch.int64)
    args: tuple = (x, mask)
    names = ["hidden_states", "attention_mask"]
    dynamic = {"hidden_states": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
    specs = [
        {"name": "hidden_states", "role": "hidden_states", "dtype": "float32", "shape": ["batch", "seq", d_model]},
        {"name": "attention_mask", "role": "attention_mask", "dtype": "int64", "shape": ["batch", "seq"]},
    ]
    outputs = ["output"]
    out_specs = [{"name": "output", "role": "output", "dtype": "float32", "shape": ["batch", "seq", d_model]}]
    if variant == "maw":
        outputs.append("maw_depth")
        out_specs.append({"name": "maw_depth", "role": "aux", "dtype": "int64", "shape": ["batch"]})
    else:
        args += (torch.randn(2, d_self), torch.randn(2, dh, dh) * 0.05)
        names += ["self_state", "trace"]
        dynamic.update({"self_state": {0: batch}, "trace": {0: batch}})
        specs += [
            {"name": "self_state", "role": "context", "dtype": "float32", "shape": ["batch", d_self]},
            {"name": "trace", "role": "context", "dtype": "float32", "shape": ["batch", dh, dh]},
        ]
    with torch.no_grad():
        program = torch.onnx.export(
            model, args, dynamo=True, opset_version=23, input_names=names, output_names=outputs,
            dynamic_shapes=dynamic, verbose=False,
        )
    proto = program.model_proto
    meta = {
        "attnx.variant": variant,
        "attnx.config": json.dumps({"d_model": d_model, "n_heads": n_heads, "toy": True}),
        "attnx.version": "toy",
        "attnx.lowering": "rewrite",
        "attnx.precision": "fp32",
        "attnx.inputs": json.dumps(specs),
        "attnx.outputs": json.dumps(out_specs),
        "attnx.profiles": json.dumps({"batch": [1, 8, 64], "seq": [1, 128, 512]}),
    }
    for k, v in meta.items():
        proto.metadata_props.add(key=k, value=v)
    onnx.save(proto, str(path))
    return path
