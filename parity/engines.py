"""The engine side of a parity check: which engine goes with an ONNX file (:func:`onnx_for_engine`,
:func:`find_engine_for`), the profiles cases must fit (:func:`engine_profiles`), and :func:`open_engine`, which
verifies an engine and decides whether it runs here.

An engine is never taken on trust: one without a sidecar must be intact (its plan header's size) and able to run
here, and one that should run here must load. Shared by :mod:`attnx.parity.check` and the checks it hands
pretrained and with-past exports to (:mod:`attnx.parity.pretrained`, :mod:`attnx.parity.generation`).
"""

from __future__ import annotations

import os
from pathlib import Path

from attnx.contract import ContractError, contained, read_sidecar, sha256_file, sidecar_path, verify_engine
from attnx.engine import runner as engine_runner
from attnx.parity.cases import ParityError
from attnx.parity.runners import EngineRunner


def onnx_for_engine(engine: str | os.PathLike) -> Path | None:
    """The ONNX an engine was built from, as its sidecar names it (None without a sidecar or when the
    file is gone). The sidecar is file contents: a path outside the engine's folder is refused."""
    engine = Path(engine)
    sidecar = read_sidecar(engine) if engine.is_file() else None
    if not sidecar:
        return None
    names = [str(n) for n in (sidecar.get("onnx"), sidecar.get("onnx_name")) if n]
    found = []
    for name in names:
        try:
            found.append(contained(engine.parent, name, f"the ONNX named by {sidecar_path(engine).name}"))
        except ContractError:
            continue
    if names and not found:
        raise ParityError(f"{sidecar_path(engine).name} names its ONNX at {names[0]!r}, outside {engine.parent.resolve()}: "
                          "refused (pass the ONNX file to check)")
    return next((p for p in found if p.is_file()), None)


def find_engine_for(model: Path) -> Path | None:
    """``<stem>.engine`` beside ``model`` when its sidecar says it was built from this file."""
    candidate = model.with_suffix(".engine")
    if not candidate.is_file():
        return None
    try:
        sidecar = read_sidecar(candidate)
    except ValueError:
        return None
    if sidecar and sidecar.get("onnx_sha256") == sha256_file(model):
        return candidate
    return None


def engine_profiles(profiles: dict, sidecar: dict | None) -> dict:
    """Cases must fit both the model's and the engine's profiles."""
    out = dict(profiles)
    for axis, rng in ((sidecar or {}).get("profiles") or {}).items():
        if axis in out:
            mine = out[axis]
            out[axis] = [max(mine[0], rng[0]), min(max(mine[1], rng[0]), rng[2]), min(mine[2], rng[2])]
        else:
            out[axis] = list(rng)
    return out


def _plan_size_problem(engine: Path) -> str | None:
    """Why an engine without a sidecar is visibly truncated: TensorRT-RTX plans (``vtrt``) record
    their total size as a little-endian uint64 at byte 16 (measured with TensorRT-RTX 1.7)."""
    size = engine.stat().st_size
    with open(engine, "rb") as f:
        head = f.read(24)
    if head[:4] == b"vtrt" and len(head) == 24:
        declared = int.from_bytes(head[16:24], "little")
        if declared != size:
            return f"its header declares {declared} bytes and the file has {size}"
    elif len(head) < 24:
        return f"it has only {size} bytes"
    return None


def open_engine(engine: Path, model_path: Path, model_sha: str, plugins) -> tuple[dict, dict | None, object]:
    """Verify the engine and decide whether it runs here: (report entry, sidecar, runner or None).

    An engine that cannot be verified (no sidecar) must run here, and one that should run here must
    load: otherwise nothing about it is known, and the check says so instead of passing."""
    sidecar = verify_engine(engine)
    if sidecar is None:
        problem = _plan_size_problem(engine)
        if problem:
            raise ParityError(f"{engine} is truncated or corrupt: {problem} (rebuild it with `attnx build-engine`)")
    if sidecar is not None and sidecar.get("onnx_sha256") and sidecar["onnx_sha256"] != model_sha:
        raise ParityError(f"{engine.name} was built from {sidecar.get('onnx_name', 'another file')} "
                          f"(sha256 {sidecar['onnx_sha256'][:12]}), not from {model_path.name}: pass the ONNX "
                          "it was built from, or rebuild the engine")
    runnable, reason = engine_runner.runnable_here(sidecar)
    if sidecar is None and not runnable:
        raise ParityError(f"{engine.name} has no sidecar ({sidecar_path(engine).name}) to verify it against and "
                          f"cannot run here ({reason}): nothing about it can be checked; rebuild it with `attnx "
                          "build-engine` (which writes the sidecar), check it where it runs, or pass --no-engine")
    entry = {"path": str(engine), "sidecar": sidecar is not None, "ran": False,
             "target": (sidecar or {}).get("target"), "backend": (sidecar or {}).get("backend")}
    runner = None
    if runnable:
        candidate = EngineRunner(engine, plugins=plugins)
        try:
            candidate.open()
        except Exception as e:  # EngineUnavailable, a plugin library that does not load, ...
            raise ParityError(f"{engine.name} should run on this machine but does not load: "
                              f"{' '.join(str(e).split())[:300]}") from None
        runner = candidate
        entry["ran"] = True
    else:
        entry["reason"] = reason
    return entry, sidecar, runner
