"""Parity of an attnx export with its PyTorch reference (``attnx check``), with Polygraphy.

- :mod:`~attnx.parity.cases`: the input cases and the Polygraphy data loader;
- :mod:`~attnx.parity.runners`: the PyTorch reference, ONNX Runtime and engine runners;
- :mod:`~attnx.parity.compare`: tolerances (per precision; variants override) and the tie-aware compare function;
- :mod:`~attnx.parity.report`: comparisons, the verdict, the JSON report;
- :mod:`~attnx.parity.reference`: the PyTorch reference of an export (:func:`load_reference`);
- :mod:`~attnx.parity.engines`: which engine goes with a file, and whether it is intact and runs here;
- :mod:`~attnx.parity.check`: :func:`run_check`, which puts them together;
- :mod:`~attnx.parity.render`: what ``attnx check`` prints for each kind of report;
- pretrained exports (real models): :mod:`~attnx.parity.text_cases` (real texts through the export's
  tokenizer, :mod:`attnx.export.tokenizer`), :mod:`~attnx.parity.original` (the original transformers / sentence-transformers model,
  and whether it still applies), :mod:`~attnx.parity.text_report` (per-sentence figures, what must
  hold per precision), :mod:`~attnx.parity.pretrained` (:func:`run_text_check`).

Nothing here names a variant: exact outputs, their decision margins and tolerances come from the
variants' specs (:class:`attnx.models.spec.VariantSpec`).
"""

if not __name__.startswith("attnx."):  # one file, one module: src/attnx links this folder as attnx.parity
    raise ImportError(f"import attnx.parity, not {__name__}: the package is attnx (pip install -e .)")

from attnx.parity.cases import Case, ParityDataLoader, ParityError, default_cases, parse_cases
from attnx.parity.check import LOWERINGS, run_check
from attnx.parity.compare import (
    DEFAULT_TOLERANCES,
    EXACT,
    TieAwareCompareFunc,
    TieTracker,
    main_outputs,
    resolve_tolerances,
    tie_margins,
)
from attnx.parity.engines import find_engine_for, onnx_for_engine
from attnx.parity.original import plan_original
from attnx.parity.pretrained import run_text_check
from attnx.parity.reference import load_reference
from attnx.parity.report import Comparison, ParityReport, summarize
from attnx.parity.runners import MARGIN_PREFIX, REFERENCE, EngineRunner, TorchReferenceRunner, margins, onnxrt_runner
from attnx.parity.text_cases import default_texts
from attnx.parity.text_report import TextComparison, TextParityReport

__all__ = [
    "ParityError", "Case", "default_cases", "parse_cases", "ParityDataLoader",
    "TorchReferenceRunner", "EngineRunner", "onnxrt_runner", "margins", "MARGIN_PREFIX", "REFERENCE",
    "DEFAULT_TOLERANCES", "EXACT", "resolve_tolerances", "tie_margins", "main_outputs", "TieTracker",
    "TieAwareCompareFunc", "Comparison", "ParityReport", "summarize",
    "run_check", "load_reference", "find_engine_for", "onnx_for_engine", "LOWERINGS",
    "run_text_check", "TextParityReport", "TextComparison", "plan_original", "default_texts",
]
