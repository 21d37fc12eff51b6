"""TensorRT engines: :class:`EngineSession` (an ``.engine`` / ``.plan`` file, run through :class:`attnx.engine.Engine`)
and :func:`engine_io_specs` (an engine's I/O specs without running it: what ``attnx triton-repo`` uses on a machine
without a GPU).

I/O specs come from the build sidecar (:func:`attnx.contract.read_sidecar`; ``attnx build-engine`` lists every
tensor there) or the source ONNX, which name the ``batch``/``seq`` dims; failing those, from the engine itself,
reading its first dynamic dim as ``batch`` and its second as ``seq`` (the export contract's order).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from attnx.contract import (BATCH, SEQ, ContractError, TensorEntry, contained, default_role, read_sidecar, sha256_file,
                            verify_engine)
from attnx.runtime.core.backends.onnxrt import onnx_io_specs
from attnx.runtime.core.session import Session, TensorSpec, merge_specs


def _sidecar_specs(items: list, is_input: bool) -> list[TensorSpec]:
    entries = [TensorEntry.from_json(item, is_input) for item in items]
    return merge_specs([(e.name, np.dtype(e.dtype), list(e.shape)) for e in entries], entries, is_input)


def engine_io_specs(path: Path, onnx_path: Path | None = None) -> tuple[list[TensorSpec], list[TensorSpec], dict]:
    """``(inputs, outputs, sidecar)`` of an engine: the sidecar's, else those of its source ONNX."""
    sidecar = read_sidecar(path) or {}
    if isinstance(sidecar.get("inputs"), list) and isinstance(sidecar.get("outputs"), list):
        return _sidecar_specs(sidecar["inputs"], True), _sidecar_specs(sidecar["outputs"], False), sidecar
    candidates = [onnx_path] if onnx_path else []
    for key in ("onnx_name", "onnx"):  # the sidecar is untrusted: its source file only inside the engine's folder
        if isinstance(sidecar.get(key), str):
            try:
                candidates.append(contained(path.parent, sidecar[key], f"the sidecar's {key!r}"))
            except ContractError:
                pass  # built elsewhere (an absolute path of another machine) or hostile: not followed
    candidates.append(path.with_suffix(".onnx"))
    for c in candidates:
        if c is not None and c.is_file():
            inputs, outputs = onnx_io_specs(c)
            return inputs, outputs, sidecar
    raise FileNotFoundError(
        f"cannot tell the inputs/outputs of {path}: no sidecar with 'inputs'/'outputs' "
        f"and no source ONNX found (pass the .onnx it was built from)"
    )


def check_built_from(engine: Path, sidecar: dict, onnx_path: Path) -> None:
    """Refuse an engine whose sidecar says it was built from another ONNX file than ``onnx_path``."""
    want = sidecar.get("onnx_sha256")
    if want and onnx_path.is_file() and sha256_file(onnx_path) != want:
        raise ContractError(f"{engine.name} was built from {sidecar.get('onnx_name') or 'another file'} "
                            f"(sha256 {str(want)[:12]}), not from {onnx_path.name}: pass the ONNX it was built "
                            "from, or rebuild the engine")


def _engine_spec(tensor: Any, is_input: bool) -> TensorSpec:
    names = iter((BATCH, SEQ))
    shape = tuple(d if d >= 0 else next(names, "?") for d in tensor.shape)
    return TensorSpec(tensor.name, np.dtype(tensor.dtype), shape, default_role(tensor.name, is_input))


class EngineSession(Session):
    """A TensorRT engine. :class:`attnx.engine.Engine` owns deserialization and execution (and
    serializes calls on its one execution context); this class gives it the session interface."""

    platform = "tensorrt_plan"

    def __init__(self, path: str | os.PathLike, onnx_path: str | os.PathLike | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no engine file at {self.path}")
        from attnx.engine.errors import TensorRTUnavailable
        from attnx.engine.runner import load_engine

        # The same size/sha256 check as `attnx check` and `attnx triton-repo`, before TensorRT reads a
        # byte: a truncated or swapped engine is refused in one line, never deserialized and served.
        verified = verify_engine(self.path)
        if verified is not None and onnx_path is not None:
            check_built_from(self.path, verified, Path(onnx_path))
        try:
            self._engine = load_engine(self.path)
        except TensorRTUnavailable as e:
            raise TensorRTUnavailable(f"cannot run {self.path.name}: {e}") from None
        try:
            self.inputs, self.outputs, sidecar = engine_io_specs(self.path, Path(onnx_path) if onnx_path else None)
        except FileNotFoundError:
            sidecar = read_sidecar(self.path) or {}
            tensors = getattr(self._engine, "io_tensors", [])
            self.inputs = [_engine_spec(t, True) for t in tensors if t.is_input]
            self.outputs = [_engine_spec(t, False) for t in tensors if not t.is_input]
        self.sidecar = sidecar
        self.metadata = {k: v if isinstance(v, str) else json.dumps(v) for k, v in sidecar.items()}
        self.provider = "tensorrt:" + str(sidecar.get("backend", "tensorrt"))

    @property
    def profiles(self) -> dict | None:
        """The engine's optimization-profile ranges (from its sidecar): requests past them cannot run."""
        found = self.sidecar.get("profiles")
        return {axis: list(rng) for axis, rng in found.items()} if isinstance(found, dict) and found else None

    def _run(self, feeds: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        out = self._engine.run(feeds)
        return {n: np.asarray(out[n]) for n in output_names}

    def close(self) -> None:
        close = getattr(self._engine, "close", None)
        if close is not None:
            close()
