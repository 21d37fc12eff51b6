"""Writing an export's file: its ``attnx.*`` metadata and the file itself, staged and made visible whole.

A leaf of :mod:`attnx.export`: the exporter, the quantizers (:mod:`~attnx.export.quantize`,
:mod:`~attnx.export.weight_only`) and engine's fp16 conversion all write through it, and it imports none of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import onnx

from attnx.contract import PREFIX, ModelInfo
from attnx.export import onnx_file
from attnx.export.staging import Staging


def write_info(model, info: ModelInfo) -> None:
    """``info`` as the ``attnx.*`` metadata of an onnx-ir model (other keys kept)."""
    props = model.metadata_props
    for key in [k for k in props if k.startswith(PREFIX)]:
        del props[key]
    props.update(info.to_props())


def save_model(model, path: Path, progress: Callable[[int, int], None] | None = None, *,
               external: bool | None = None) -> list[Path]:
    """Write an ``onnx.ModelProto`` or onnx-ir model to ``path`` as a whole (staged, then renamed; a
    previous ``<name>.data`` replaced or removed), its weights streamed (:func:`attnx.export.onnx_file.save`;
    ``external``: as there, None = by size)."""
    path = Path(path)
    if isinstance(model, onnx.ModelProto):
        model = onnx_file.from_proto(model)
    with Staging(path, owned={path.name + ".data"}) as stage:
        written = onnx_file.save(model, stage.path(path.name), progress=progress, external=external)
        stage.commit()
    return [path.with_name(p.name) for p in written]
