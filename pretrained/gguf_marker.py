"""The marker of a GGUF-backed folder (:data:`MARKER`): which GGUF file its weights stay in, and whether that file
is still the one the folder was made from (:func:`gguf_of`).

A leaf of :mod:`attnx.pretrained`: the folder's maker (:mod:`attnx.pretrained.gguf`) writes it, and the GGUF's tensor
source (:mod:`attnx.pretrained.gguf_tensors`) reads it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

#: the file in a GGUF-backed folder that names its GGUF: ``{"gguf": <absolute path>, "size": <bytes>,
#: "mtime_ns": <int>}``
MARKER = "attnx-gguf.json"


def gguf_of(folder: str | os.PathLike) -> Path | None:
    """The GGUF a GGUF-backed folder reads its weights from; None for any other folder. One line if the file
    is gone or changed since the folder was made from it."""
    folder = Path(folder)
    if not (folder / MARKER).is_file():
        return None
    marker = read_marker(folder)
    path = Path(str(marker.get("gguf", "")))
    if not path.is_absolute() or not path.is_file():
        raise FileNotFoundError(f"{folder}: its weights are in {path}, which is gone; export from the .gguf again")
    if marker_of(path) != marker:
        raise ValueError(f"{folder}: {path} changed since this folder was made from it; export from the .gguf "
                         "again")
    return path


def marker_of(gguf: Path) -> dict:
    """What the marker of a folder made from ``gguf`` says now: its path, size and modification time."""
    stat = gguf.stat()
    return {"gguf": str(gguf.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def read_marker(folder: Path) -> dict:
    """The marker of ``folder`` as written (one line if it is unreadable)."""
    try:
        value = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder / MARKER}: unreadable ({e})") from None
    return value if isinstance(value, dict) else {}


def write_marker(folder: Path, gguf: Path) -> None:
    """Point ``folder`` at ``gguf`` (atomically)."""
    tmp = folder / f".{MARKER}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(marker_of(gguf)))
    os.replace(tmp, folder / MARKER)
