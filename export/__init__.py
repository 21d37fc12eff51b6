"""ONNX export of attnx encoders with the ``attnx`` custom ops.

Public names: ``export_variant``, ``export_encoder``, ``ExportResult``, ``to_fp16``,
``read_metadata``, ``ModelInfo``; the custom ops live in ``attnx.export.ops``.
"""

from attnx.export.exporter import DEFAULT_OPTIONS, LOWERINGS, ExportResult, export_encoder, export_variant
from attnx.export.fp16 import to_fp16
from attnx.export.metadata import ModelInfo, read_metadata

__all__ = ["export_variant", "export_encoder", "ExportResult", "to_fp16", "read_metadata", "ModelInfo",
           "LOWERINGS", "DEFAULT_OPTIONS"]
