"""Interpretability on any attnx model, in PyTorch and on deployed exports.

- hook points with TransformerLens' names, ``run_with_cache``, ``run_with_hooks``: re-exported from
  :mod:`attnx.models.hooks` (model code names its hook points, so they live with the models).
- :mod:`attnx.interp.patching`: activation patching and head ablation (torch).
- :mod:`attnx.explain.analysis`: what each head does (entropy, previous-token, first-token/sink,
  self, local-window scores, a primary pattern or "mixed"); numpy, so serving can use it.
- :mod:`attnx.explain.source`: where patterns come from: an ONNX export, a running server, a torch model.
- :mod:`attnx.explain.explanation`: text -> patterns, analysis, head ablation, context comparison.
- :mod:`attnx.explain.page`: the self-contained HTML page; :mod:`attnx.interp.visualize`: PNG heatmaps.

The torch names are imported on first use, so the numpy parts (analysis, source, explain, page)
load without torch: the server's ``/explain`` page uses them.
"""

from __future__ import annotations

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
