"""ONNX export of attnx models with the attnx custom ops.

Public names: ``export_variant``, ``export_encoder``, ``ExportResult``, ``to_fp16``, ``describe_model``,
``load_checkpoint``, ``save_checkpoint``; what the exporter does with custom ops in :mod:`attnx.export.ops`
(variants declare theirs with :mod:`attnx.models.onnx_ops`).
"""

if not __name__.startswith("attnx."):  # one file, one module: src/attnx links this folder as attnx.export
    raise ImportError(f"import attnx.export, not {__name__}: the package is attnx (pip install -e .)")

from attnx.models.checkpoint import load_checkpoint, save_checkpoint
from attnx.export.describe import describe_model
from attnx.export.exporter import DEFAULT_OPTIONS, LOWERINGS, ExportResult, export_encoder, export_variant
from attnx.export.fp16 import to_fp16

__all__ = ["export_variant", "export_encoder", "ExportResult", "to_fp16", "describe_model", "load_checkpoint",
           "save_checkpoint", "LOWERINGS", "DEFAULT_OPTIONS"]
