"""Prepacked copies of with-past exports: the repacked ``MatMulNBits`` weights in a file ONNX Runtime maps.

ONNX Runtime (1.31) maps an export's external data, but repacks every ``MatMulNBits`` weight at load into MLAS's
layout in anonymous memory (~1.13-1.23x the files): an 8B int4 export of 5.3 GB ran at 7.56 GB. A session with
``session.save_external_prepacked_constant_initializers`` writes its optimized graph with the repacked weights in
an external data file; a later session of that file maps them, so they are file-backed and shared between
processes, and nothing is repacked again.

:func:`prepared_model` makes that copy once per export, ONNX Runtime version, CPU and session settings, in a child
process (the repacking's anonymous peak is not the serving process's), beside the export, in its hidden folder
``.attnx-prepacked/``, as ``<name>.prepacked.onnx`` + ``<name>.prepacked.onnx.data`` + ``<name>.prepacked.json``
(the key), or, where the
export's folder is not writable, under attnx's cache folder (``$ATTNX_CACHE``, else ``$XDG_CACHE_HOME/attnx``, else
``~/.cache/attnx``; then ``prepacked/``). The key records what the copy was made from and the identity (size,
mtime, inode) of the files written, which are written in a scratch folder and moved into place, the key last: a
stale, foreign or half-replaced copy is never loaded (it is made again). ONNX Runtime 1.31.1 writes the repacked
blobs at unaligned offsets, which MLAS then reads shifted, so the data file is rewritten page-aligned
(:func:`realign`), and a copy whose prefill logits differ by a bit from the export's own session is refused.
Opt-in for now (``ATTNX_PREPACKED=1``, or ``load(path, prepacked=True)``): the copy costs ~1.5x the export on disk
and a prepare step at the first load, and it relies on the layout of ONNX Runtime's prepacked external data (the
logits check above is the safeguard); the default load repacks into anonymous memory as before.
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

#: Turns the prepared copies on when set to 1 / true / yes / on.
ENV = "ATTNX_PREPACKED"
SUFFIX = ".prepacked.onnx"
#: The hidden folder beside an export that holds its copies (a folder's ``*.onnx`` stays the export alone).
BESIDE = ".attnx-prepacked"


def enabled(option: bool | None = None) -> bool:
    """The caller's choice, else the environment's (off unless ``ATTNX_PREPACKED`` says 1/true/yes/on)."""
    if option is not None:
        return bool(option)
    return os.environ.get(ENV, "0").strip().lower() in ("1", "true", "yes", "on")


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
    return [path.parent / BESIDE, Path(base).expanduser() / "prepacked" / digest]


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


#: Run in a child process: argv = source, target folder, JSON of the session settings. The session that writes the
#: copy computes a prefill's logits, and the copy (realigned) must compute the same bits, or it is refused.
_PREPARE = r"""
import json, sys
from pathlib import Path
import numpy as np
from attnx.runtime.core.backends.onnxrt import OnnxRuntimeSession, OrtOptions
from attnx.runtime.core.decoding import Decoder
from attnx.runtime.core.prepacked import realign
source, folder, settings = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
written = folder / ("unaligned" + source.stem + ".prepacked.onnx")
target = folder / (source.stem + ".prepacked.onnx")
def options(extra):
    return OrtOptions(device="cpu", threads=1, optimization=settings["optimization"],
                      disabled_optimizers=tuple(settings["disabled_optimizers"]),
                      extra_session_config={**settings.get("extra_session_config", {}), **extra})
saving = options({"session.save_external_prepacked_constant_initializers": "1",
                  "session.optimized_model_external_initializers_file_name": written.name + ".data",
                  "session.optimized_model_external_initializers_min_size_in_bytes": "1024"})
session_options = saving.session_options()
session_options.optimized_model_filepath = str(written)
saving.session_options = lambda: session_options
def logits(path):
    decoder = Decoder(OnnxRuntimeSession(path, saving if path == source else options({})))
    first, state = decoder.start([1, 2, 3])
    second, _ = decoder.step(state, [4])
    return np.concatenate([np.asarray(first).ravel(), np.asarray(second).ravel()])
expected = logits(source)
realign(written, target)
if not np.array_equal(expected, logits(target)):
    sys.exit("the prepacked copy computed other logits than the export")
"""


#: Where each tensor starts in a realigned data file: ONNX Runtime 1.31 writes prepacked blobs at any offset, but
#: MLAS aligns its packed layout from the buffer's address, so a blob mapped at another alignment than the heap
#: buffer it was written from is read shifted (wrong logits, NaN). A page keeps every alignment MLAS uses.
ALIGNMENT = 4096


def realign(written: Path, target: Path, chunk: int = 1 << 24) -> None:
    """Copy ``written`` (an optimized model with external data and prepacked blobs) to ``target``, every tensor
    and blob of its data at an :data:`ALIGNMENT`-aligned offset; streamed, a ``chunk`` at a time."""
    import onnx

    model = onnx.load(str(written), load_external_data=False)
    source_data = written.with_name(written.name + ".data")
    target_data = target.with_name(target.name + ".data")
    with open(source_data, "rb") as src, open(target_data, "wb") as dst:
        def copy(offset: int, length: int) -> int:
            dst.write(b"\0" * (-dst.tell() % ALIGNMENT))
            start = dst.tell()
            src.seek(offset)
            left = length
            while left:
                block = src.read(min(chunk, left))
                if not block:
                    raise OSError(f"{source_data.name} ends inside a tensor")
                dst.write(block)
                left -= len(block)
            return start

        for tensor in model.graph.initializer:
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            entries = {e.key: e for e in tensor.external_data}
            entries["location"].value = target_data.name
            entries["offset"].value = str(copy(int(entries["offset"].value), int(entries["length"].value)))
            for key, entry in entries.items():  # "prepacked_N": "<kernel key>|<offset>;<length>;<flags>"
                if key.startswith("prepacked"):
                    name, _, where = entry.value.partition("|")
                    offset, length, rest = where.split(";", 2)
                    entry.value = f"{name}|{copy(int(offset), int(length))};{length};{rest}"
    onnx.save(model, str(target))


def _write(folder: Path, path: Path, key: dict) -> Path:
    """Prepare in a scratch folder inside ``folder``, then move the files into place, the key last."""
    folder.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{path.stem}.prepacking-", dir=folder))
    try:
        done = subprocess.run([sys.executable, "-c", _PREPARE, str(path.resolve()), str(scratch),
                               json.dumps(key["settings"])], capture_output=True, text=True)
        made, made_data, _ = _names(scratch, path)
        if done.returncode != 0 or not made.is_file() or not made_data.is_file():
            lines = [line for line in done.stderr.splitlines() if line.strip() and "Serializing" not in line]
            raise RuntimeError(lines[-1] if lines else "ONNX Runtime wrote no prepacked data")
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
        if folder == places[0] and not _writable(path.parent):
            continue
        try:
            return _write(folder, path, key)
        except (OSError, RuntimeError) as exc:
            why = str(exc)
    warnings.warn(f"{path.name}: no prepacked copy ({why}); its repacked weights are held in anonymous memory",
                  RuntimeWarning, stacklevel=3)
    return None
