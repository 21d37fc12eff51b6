"""Prepacked copies of with-past exports: the repacked ``MatMulNBits`` weights in a file ONNX Runtime maps.

ONNX Runtime (1.31) maps an export's external data, but repacks every ``MatMulNBits`` weight at load into MLAS's
layout in anonymous memory (~1.13-1.23x the files): an 8B int4 export of 5.3 GB ran at 7.56 GB. A session with
``session.save_external_prepacked_constant_initializers`` writes its optimized graph with the repacked weights in
an external data file; a later session of that file maps them, so they are file-backed and shared between
processes, and nothing is repacked again.

:func:`prepared_model` makes that copy once per export, ONNX Runtime version, CPU and session settings, in a child
process (the repacking's anonymous peak is not the serving process's), beside the export as
``<name>.prepacked.onnx`` + ``<name>.prepacked.onnx.data`` + ``<name>.prepacked.json`` (the key), or, where the
export's folder is not writable, under attnx's cache folder (``$ATTNX_CACHE``, else ``$XDG_CACHE_HOME/attnx``, else
``~/.cache/attnx``; then ``prepacked/``). The key records what the copy was made from and the identity (size,
mtime, inode) of the files written, which are written in a scratch folder and moved into place, the key last: a
stale, foreign or half-replaced copy is never loaded (it is made again). ``ATTNX_PREPACKED=0``, or
``load(path, prepacked=False)``, turns it off.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

#: Turns the prepared copies off when set to 0 / false / no / off.
ENV = "ATTNX_PREPACKED"
SUFFIX = ".prepacked.onnx"


def enabled(option: bool | None = None) -> bool:
    """The caller's choice, else the environment's (on unless ``ATTNX_PREPACKED`` says 0/false/no/off)."""
    if option is not None:
        return bool(option)
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _cpu() -> str:
    """What MLAS's packed layout depends on: the CPU's model and instruction-set flags."""
    model = flags = ""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = value.strip()
                if model and flags:
                    break
    except OSError:
        pass
    return f"{platform.machine()} {model} {flags}"


def _identity(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _sources(path: Path) -> list[Path]:
    """The export's files: the graph and its external data (attnx writes ``<name>.onnx.data``)."""
    return [path, *sorted(path.parent.glob(path.name + "*.data"))]


def source_key(path: Path, settings: dict) -> dict:
    """What a prepared copy depends on: the export's files (size + mtime), ONNX Runtime, the CPU, the settings."""
    import onnxruntime as ort

    return {"export": str(path.resolve()),
            "files": {f.name: _identity(f)[:2] for f in _sources(path)},
            "onnxruntime": ort.__version__, "cpu": hashlib.sha256(_cpu().encode()).hexdigest()[:16],
            "settings": settings}


def _places(path: Path) -> list[Path]:
    """Where the prepared copy of ``path`` may live: beside it, then in the cache (one folder per export)."""
    base = os.environ.get("ATTNX_CACHE") or (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                                              / "attnx")
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    return [path.parent, Path(base).expanduser() / "prepacked" / digest]


def _names(folder: Path, path: Path) -> tuple[Path, Path, Path]:
    model = folder / (path.stem + SUFFIX)
    return model, model.with_name(model.name + ".data"), folder / (path.stem + ".prepacked.json")


def _valid(folder: Path, path: Path, key: dict) -> Path | None:
    """The prepared model in ``folder`` when its key is ``key`` and its files are those the key recorded."""
    model, data, key_file = _names(folder, path)
    try:
        recorded = json.loads(key_file.read_text())
        if recorded.get("key") != key:
            return None
        if recorded.get("written") != {f.name: _identity(f) for f in (model, data)}:
            return None
    except (OSError, ValueError, AttributeError):
        return None
    return model


#: Run in a child process: argv = source, target folder, JSON of the session settings.
_PREPARE = r"""
import json, sys
from pathlib import Path
from attnx.runtime.core.backends.onnxrt import OrtOptions
source, folder, settings = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
target = folder / (source.stem + ".prepacked.onnx")
options = OrtOptions(device="cpu", threads=1, optimization=settings["optimization"],
                     disabled_optimizers=tuple(settings["disabled_optimizers"]), extra_session_config={
    **settings.get("extra_session_config", {}), "session.save_external_prepacked_constant_initializers": "1",
    "session.optimized_model_external_initializers_file_name": target.name + ".data",
    "session.optimized_model_external_initializers_min_size_in_bytes": "1024"})
session_options = options.session_options()
session_options.optimized_model_filepath = str(target)
import onnxruntime
onnxruntime.InferenceSession(str(source), sess_options=session_options, providers=["CPUExecutionProvider"],
                             disabled_optimizers=list(options.disabled_optimizers))
"""


def _write(folder: Path, path: Path, key: dict) -> Path:
    """Prepare in a scratch folder inside ``folder``, then move the files into place, the key last."""
    folder.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{path.stem}.prepacking-", dir=folder))
    try:
        done = subprocess.run([sys.executable, "-c", _PREPARE, str(path.resolve()), str(scratch),
                               json.dumps(key["settings"])], capture_output=True, text=True)
        made, made_data, _ = _names(scratch, path)
        if done.returncode != 0 or not made.is_file() or not made_data.is_file():
            raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else
                               "ONNX Runtime wrote no prepacked data")
        model, data, key_file = _names(folder, path)
        key_file.unlink(missing_ok=True)  # no key: no copy, while the files are replaced
        os.replace(made_data, data)
        os.replace(made, model)
        written = {f.name: _identity(f) for f in (model, data)}
        temp_key = scratch / key_file.name
        temp_key.write_text(json.dumps({"key": key, "written": written}, indent=1))
        os.replace(temp_key, key_file)
        return model
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _writable(folder: Path) -> bool:
    return os.access(folder, os.W_OK)


def prepared_model(path: Path, settings: dict) -> Path | None:
    """The prepacked copy of the with-past export ``path`` for these session ``settings`` (``optimization``,
    ``disabled_optimizers``), made now if there is none valid; None when it cannot be made (then the export loads
    as it is, with a warning saying why)."""
    path = Path(path)
    key = source_key(path, settings)
    places = _places(path)
    for folder in places:
        found = _valid(folder, path, key)
        if found is not None:
            return found
    why = "no writable folder"
    for folder in places:
        if folder == path.parent and not _writable(folder):
            continue
        try:
            return _write(folder, path, key)
        except (OSError, RuntimeError) as exc:
            why = str(exc)
    warnings.warn(f"{path.name}: no prepacked copy ({why}); its repacked weights are held in anonymous memory",
                  RuntimeWarning, stacklevel=3)
    return None
