"""Interpretability on any attnx model, in PyTorch and on deployed exports.

- :mod:`attnx.interp.hooks`: hook points with TransformerLens' names, ``run_with_cache``,
  ``run_with_hooks``.
- :mod:`attnx.interp.patching`: activation patching and head ablation (torch).
- :mod:`attnx.interp.analysis`: what each head does (entropy, previous-token, first-token/sink,
  self, local-window scores, a primary pattern or "mixed"); numpy, so serving can use it.
- :mod:`attnx.interp.source`: where patterns come from: an ONNX export, a running server, a torch model.
- :mod:`attnx.interp.explain`: text -> patterns, analysis, head ablation, context comparison.
- :mod:`attnx.interp.page`: the self-contained HTML page; :mod:`attnx.interp.visualize`: PNG heatmaps.

The torch names are imported on first use, so the numpy parts (analysis, source, explain, page)
load without torch: the server's ``/explain`` page uses them.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "HookPoint": "hooks", "ActivationCache": "hooks", "hook_points": "hooks",
    "run_with_cache": "hooks", "run_with_hooks": "hooks", "patch_hook": "patching", "patch_heads": "patching",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'attnx.interp' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"attnx.interp.{module}"), name)
    globals()[name] = value
    return value
