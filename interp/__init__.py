"""Interpretability on any attnx model, in PyTorch and on deployed exports.

- :mod:`attnx.interp.hooks`: hook points with TransformerLens' names, ``run_with_cache``,
  ``run_with_hooks``.
- :mod:`attnx.interp.patching`: activation patching and head ablation.
- :mod:`attnx.interp.analysis`: what each head does (entropy, previous-token, first-token,
  self, local-window scores, a primary pattern).
- :mod:`attnx.interp.visualize`: a self-contained HTML page and PNG heatmaps.
"""

from attnx.interp.hooks import ActivationCache, HookPoint, hook_points, hooks, run_with_cache, run_with_hooks
from attnx.interp.patching import patch_heads, patch_hook

__all__ = ["HookPoint", "ActivationCache", "hook_points", "hooks", "run_with_cache", "run_with_hooks",
           "patch_hook", "patch_heads"]
