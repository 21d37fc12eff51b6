"""Explaining a deployed model's attention with numpy: what the server's ``/explain`` page and
``attnx explain`` compute, over anything that runs the model.

- :mod:`attnx.explain.source`: what explaining knows of a model (:class:`~attnx.explain.source.ModelFacts`,
  read from its attnx metadata), its tokenizer (:class:`~attnx.explain.source.TextEncoder`), the
  :class:`~attnx.explain.source.Source` interface (``facts``, ``encoder``, ``run(feeds, outputs)``)
  and context files;
- :mod:`attnx.explain.analysis`: what each head does (entropy, previous-token, first-token/sink,
  self, local-window scores, a primary pattern or "mixed");
- :mod:`attnx.explain.explanation`: text -> patterns, analysis, head ablation through ``head_mask``,
  context comparison;
- :mod:`attnx.explain.page`: the self-contained HTML page.

numpy (and ``tokenizers``) only: no torch, nothing that opens a model. The sources that do (an ONNX
export through the runtime, a running server, a torch model) and the torch tools (activation
patching, PNG heatmaps) are :mod:`attnx.interp`; the server passes its own batcher as the source.
"""

if not __name__.startswith("attnx."):  # one file, one module: src/attnx links this folder as attnx.explain
    raise ImportError(f"import attnx.explain, not {__name__}: the package is attnx (pip install -e .)")
