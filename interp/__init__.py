"""Interpretability on any attnx model in PyTorch, and the sources that open a model for explaining.

- hook points with TransformerLens' names, ``run_with_cache``, ``run_with_hooks``: re-exported from
  :mod:`attnx.models.hooks` (model code names its hook points, so they live with the models);
- :mod:`attnx.interp.patching`: activation patching and head ablation (torch), and the ablation
  table of ``attnx explain --ablate`` (the deployed model's head ablation beside the torch reference's
  ablation and patching);
- :mod:`attnx.interp.analysis`: run a torch model once and analyse its heads (the numbers:
  :mod:`attnx.explain.analysis`);
- :mod:`attnx.interp.source`: where patterns come from: an ONNX export (through the runtime), a running
  server, a torch model (a Hugging Face folder, an export's reference);
- :mod:`attnx.interp.visualize`: PNG heatmaps and the HTML page of a torch cache.

Explaining itself (facts, tokenizer, per-head analysis, ablation through ``head_mask``, the page) is
numpy and lives in :mod:`attnx.explain`, which the server's ``/explain`` page imports. This package
sits above the runtime, the exporter and the pretrained hosts; the names below are imported on first
use, so ``import attnx.interp`` loads none of them.
"""

from __future__ import annotations

if not __name__.startswith("attnx."):  # one file, one module: src/attnx links this folder as attnx.interp
    raise ImportError(f"import attnx.interp, not {__name__}: the package is attnx (pip install -e .)")

import importlib

_LAZY = {
    "HookPoint": "attnx.models.hooks", "ActivationCache": "attnx.models.hooks", "hook_points": "attnx.models.hooks",
    "run_with_cache": "attnx.models.hooks", "run_with_hooks": "attnx.models.hooks",
    "patch_hook": "attnx.interp.patching", "patch_heads": "attnx.interp.patching",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'attnx.interp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
