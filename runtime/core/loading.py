"""Loading a model file into a :class:`~attnx.runtime.core.session.Session`: :func:`load` picks the backend by
the file suffix (:mod:`attnx.runtime.core.backends`), applies a with-past export's own ONNX Runtime defaults and its
prepacked copy, resolves the batch and sequence axes (:mod:`attnx.runtime.core.axes`) and refuses tampered
metadata (:mod:`attnx.runtime.core.model_checks`).

Its own module so that the session types stay a leaf the backends, axes and checks import, with nothing of theirs
imported back (import-linter's ``acyclic_siblings``). Users call it as :func:`attnx.runtime.load`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from attnx.runtime.core.axes import apply_axes
from attnx.runtime.core.model_checks import check_metadata
from attnx.runtime.core.session import Session


def release_read_weights(path: Path) -> int:
    """Drop from this process's resident set the pages of ``path``'s external data (``<file>.data``) that ONNX Runtime
    read while loading; returns the bytes dropped.

    ORT memory-maps the file; a ``MatMulNBits`` weight is repacked into memory of its own and its mapping released,
    but a table another node also reads (a tied embedding's, which the head's ``MatMulNBits`` repacks) stays mapped
    with every page the repacking read resident: the head counted twice. Only a region none of whose pages was
    copied on write (smaps' ``Anonymous: 0``) is dropped (``MADV_DONTNEED``: its pages are the file's, read again
    from the page cache when next used, e.g. an embedding row), so nothing the runtime holds changes. (smaps'
    ``*_Dirty`` also counts file pages not yet written back, so it says nothing here.) Linux only."""
    import ctypes

    names = {str(f.resolve()) for f in path.parent.glob(path.name + "*.data")}  # attnx writes <name>.onnx.data
    if not names or not sys.platform.startswith("linux"):
        return 0
    regions, current = [], None
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                parts = line.split()
                if "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:  # a region's header line
                    start, end = (int(x, 16) for x in parts[0].split("-"))
                    current = [start, end - start, 0] if len(parts) > 5 and parts[5] in names else None
                    if current is not None:
                        regions.append(current)
                elif current is not None and parts[0] == "Anonymous:":
                    current[2] += int(parts[1])
    except OSError:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    dropped = 0
    for start, length, copied_kb in regions:
        if copied_kb == 0 and libc.madvise(start, length, 4) == 0:  # 4: MADV_DONTNEED
            dropped += length
    return dropped


def prepacked_source(path: Path, options, choice: bool | None = None) -> Path:
    """The file to load for the with-past export ``path``: its prepacked copy
    (:func:`attnx.runtime.core.prepacked.prepared_model`: the ``MatMulNBits`` weights repacked once into a file ONNX
    Runtime maps, not into anonymous memory at every load) when it has such weights, runs on the CPU with
    prepacking on, and ``choice`` / ``ATTNX_PREPACKED=1`` ask for it; else ``path`` itself."""
    from attnx.runtime.core import prepacked
    from attnx.runtime.core.backends.onnxrt import ort_providers

    extra = dict(options.extra_session_config)
    if not prepacked.enabled(choice) or extra.get("session.disable_prepacking") == "1" \
            or ort_providers(options.device) != ["CPUExecutionProvider"] or not _weight_only(path):
        return path
    settings = {"optimization": options.optimization, "disabled_optimizers": sorted(options.disabled_optimizers),
                "extra_session_config": extra}
    return prepacked.prepared_model(path, settings) or path


def _weight_only(path: Path) -> bool:
    """The file's metadata says its weights are ``MatMulNBits`` blocks (``attnx.precision`` ``int4-weights`` /
    ``int8-weights``); read without its external data."""
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # an unreadable file fails in the session, with ONNX Runtime's own message
        return False
    return any(p.key == "attnx.precision" and p.value.endswith("-weights") for p in model.metadata_props)


def load(path: str | os.PathLike, *, device: str = "auto", threads: int | None = None, axes=None,
         **opts: Any) -> Session:
    """Load a model file once; returns a thread-safe :class:`Session`.

    ``.onnx`` -> ONNX Runtime (``device``: ``auto`` | ``cpu`` | ``cuda``; ``threads``:
    intra-op threads; ``spin``, ``optimization`` as in :class:`~attnx.runtime.core.backends.onnxrt.OrtOptions`;
    ``prepacked``: load a with-past int8/int4 export through its prepacked copy, :func:`prepacked_source`; default
    on unless ``ATTNX_PREPACKED=0``).
    ``.engine`` / ``.plan`` -> TensorRT (``onnx_path``: the source ONNX, when the engine's sidecar
    does not list its I/O). The batch and sequence axes of every tensor are then resolved
    (:func:`attnx.runtime.core.axes.apply_axes`; ``axes``: an :class:`~attnx.runtime.core.axes.AxisFlags`).
    """
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix == ".onnx":
        from attnx.runtime.core.backends.onnxrt import OnnxRuntimeSession, OrtOptions
        from attnx.runtime.core.decoding import decoding_options

        # a with-past export runs one short step after another: its own defaults (caller's options win)
        decoding = decoding_options(p)
        prepacked = opts.pop("prepacked", None)
        options = OrtOptions(device=device, threads=threads, **{**decoding, **opts})
        source = prepacked_source(p, options, prepacked) if decoding else p
        session: Session = OnnxRuntimeSession(source, options)
        session.path = p  # the export's own name: its tokenizer, config and sidecars lie beside it
        if decoding:
            release_read_weights(source)
    elif suffix in (".engine", ".plan"):
        from attnx.runtime.core.backends.tensorrt import EngineSession

        session = EngineSession(p, onnx_path=opts.get("onnx_path"))
    else:
        raise ValueError(f"{p}: unknown model type {suffix!r} (expected .onnx or .engine)")
    session = apply_axes(session, axes)
    check_metadata(session)  # tampered metadata is refused here, not inside every request
    return session
