"""Loading a model file into a :class:`~attnx.runtime.core.session.Session`: :func:`load` picks the backend by
the file suffix (:mod:`attnx.runtime.core.backends`), applies a with-past export's own ONNX Runtime defaults and its
prepacked copy, resolves the batch and sequence axes (:mod:`attnx.runtime.core.axes`) and refuses tampered
metadata (:mod:`attnx.runtime.core.model_checks`).

Its own module so that the session types stay a leaf the backends, axes and checks import, with nothing of theirs
imported back (import-linter's ``acyclic_siblings``). Users call it as :func:`attnx.runtime.load`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from attnx.runtime.core.axes import apply_axes
from attnx.runtime.core.model_checks import check_metadata
from attnx.runtime.core.session import Session


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
    ``prepacked``: load a with-past int8/int4 export through its prepacked copy, :func:`prepacked_source` (opt-in:
    ``ATTNX_PREPACKED=1``);
    ``huge_pages``: a with-past export on the CPU has the memory its load filled moved into 2 MB pages,
    :func:`attnx.runtime.core.process_memory.into_huge_pages`; default on unless ``ATTNX_HUGE_PAGES=0``).
    ``.engine`` / ``.plan`` -> TensorRT (``onnx_path``: the source ONNX, when the engine's sidecar
    does not list its I/O). The batch and sequence axes of every tensor are then resolved
    (:func:`attnx.runtime.core.axes.apply_axes`; ``axes``: an :class:`~attnx.runtime.core.axes.AxisFlags`).
    """
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix == ".onnx":
        from attnx.runtime.core.backends.onnxrt import OnnxRuntimeSession, OrtOptions, ort_providers
        from attnx.runtime.core.decoding import decoding_options
        from attnx.runtime.core.process_memory import huge_pages_enabled, into_huge_pages, release_read_weights

        # a with-past export runs one short step after another: its own defaults (caller's options win)
        decoding = decoding_options(p)
        prepacked = opts.pop("prepacked", None)
        huge = huge_pages_enabled(opts.pop("huge_pages", None))
        options = OrtOptions(device=device, threads=threads, **{**decoding, **opts})
        source = prepacked_source(p, options, prepacked) if decoding else p
        # a decode step streams every weight once: in 2 MB pages (a decoder's only: measured there)
        on_cpu = ort_providers(options.device) == ["CPUExecutionProvider"]
        with into_huge_pages(huge and on_cpu and bool(decoding), background=True) as collapsed:
            session: Session = OnnxRuntimeSession(source, options)
            if decoding:
                release_read_weights(source)
        session.path = p  # the export's own name: its tokenizer, config and sidecars lie beside it
        session.huge_pages = collapsed
    elif suffix in (".engine", ".plan"):
        from attnx.runtime.core.backends.tensorrt import EngineSession

        session = EngineSession(p, onnx_path=opts.get("onnx_path"))
    else:
        raise ValueError(f"{p}: unknown model type {suffix!r} (expected .onnx or .engine)")
    session = apply_axes(session, axes)
    check_metadata(session)  # tampered metadata is refused here, not inside every request
    return session
