"""The export cache every test that needs an export shares (tests *of* the exporter export fresh).

An entry is a folder holding what one export wrote (the ``.onnx``, its reference weights, its
tokenizer folder, ...), keyed on everything the result depends on:

- what was exported: the exporter's options and, for a Hugging Face folder, the folder's content
  (sizes and sha256 of its files; the random folders of ``tests/hf_folders.py`` are seeded, so the same
  folder made by another session or worker hits the same entry);
- the code that made it: a sha256 of the syntax trees (comments and layout left out, so such an edit keeps
  the cache warm) of the packages at or below ``attnx.export`` in the layer order (``pyproject.toml``'s
  import contract, checked by ``tests/test_layers.py``: ``attnx``, ``models``, ``explain``, ``plugins``,
  ``pretrained``, ``export``) and of the test modules that define models (``toy_variant.py``,
  ``hf_folders.py``);
- the libraries: torch, onnx, onnxscript, onnxruntime, transformers, tokenizers, ... versions.

The cache lives outside the checkout (``$ATTNX_TEST_CACHE``, default ``~/.cache/attnx/test-exports``),
so a fresh clone reuses what an earlier run made. xdist workers share it: a file lock per entry makes
the second worker wait for the first one's export instead of repeating it; entries appear by an atomic
rename of a staging folder, so a killed run leaves no half entry. Entries unused for a week are pruned,
those of other exporter sources after a day.
Tests must not modify files of a cached export (copy it to ``tmp_path`` first).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from filelock import FileLock

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
#: Packages whose code an export depends on: the layers at and below attnx.export (pyproject.toml's contract).
EXPORT_PACKAGES = ("models", "explain", "plugins", "pretrained", "export")
PACKAGE = ROOT / "src" / "attnx"
MODEL_TEST_MODULES = ("toy_variant.py", "hf_folders.py")
LIBRARIES = ("torch", "onnx", "onnxscript", "onnxruntime", "onnx-graphsurgeon", "transformers", "tokenizers",
             "sentence-transformers", "safetensors", "numpy")
KEEP_SECONDS = 7 * 24 * 3600
KEEP_OTHER_CODE_SECONDS = 24 * 3600


def cache_root() -> Path:
    root = os.environ.get("ATTNX_TEST_CACHE") or Path.home() / ".cache" / "attnx" / "test-exports"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def code_hash() -> str:
    h = hashlib.sha256()
    files = sorted(PACKAGE.glob("*.py")) + [p for pkg in EXPORT_PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    files += [TESTS / name for name in MODEL_TEST_MODULES]
    for path in files:
        h.update(str(path.relative_to(ROOT)).encode())
        h.update(source_digest(path.read_text(encoding="utf-8")).encode())
    for lib in LIBRARIES:
        try:
            h.update(f"{lib}={metadata.version(lib)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{lib}=none".encode())
    return h.hexdigest()[:16]


def source_digest(source: str) -> str:
    """What the code of a module says, not how it is written: its syntax tree (docstrings kept, since code may
    read them), so that a comment or a re-wrapped line leaves the cache warm. Unparsable source: its text."""
    try:
        text = ast.dump(ast.parse(source))
    except SyntaxError:
        text = source
    return hashlib.sha256(text.encode()).hexdigest()


_FOLDER_HASHES: dict[tuple, str] = {}


def folder_hash(folder: Path) -> str:
    """The content of a folder (file names, sizes, sha256), memoised on the files' sizes and mtimes."""
    folder = Path(folder).resolve()
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    stamp = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    key = (str(folder), stamp)
    if key not in _FOLDER_HASHES:
        h = hashlib.sha256()
        for p in files:
            h.update(f"{p.relative_to(folder)}={file_hash(p)}".encode())
        _FOLDER_HASHES[key] = h.hexdigest()[:16]
    return _FOLDER_HASHES[key]


def file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def _describe(value: Any) -> Any:
    if isinstance(value, Path):
        if value.is_dir():
            return {"folder": folder_hash(value)}
        return {"file": file_hash(value)} if value.is_file() else {"path": str(value)}
    if isinstance(value, dict):
        return {str(k): _describe(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def entry(name: str, make: Callable[[Path], Any], **key: Any) -> Path:
    """``<entry>/<name>``: made once by ``make(<staging>/<name>)`` for this ``key`` and reused after.

    ``key`` values may be paths of folders (hashed by content), JSON values, or anything with a stable
    ``repr``."""
    described = json.dumps({"name": name, "key": _describe(key), "code": code_hash()}, sort_keys=True)
    digest = hashlib.sha256(described.encode()).hexdigest()[:24]
    root = cache_root()
    final = root / digest
    with FileLock(str(root / f"{digest}.lock")):
        if not (final / name).exists():
            staging = root / f".staging-{digest}-{uuid.uuid4().hex[:8]}"
            staging.mkdir()
            try:
                make(staging / name)
                (staging / "key.json").write_text(described)
                shutil.rmtree(final, ignore_errors=True)
                os.replace(staging, final)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        os.utime(final)  # last use, for pruning
    return final / name


def _other_code(entry: Path) -> bool:
    """The entry was made by other exporter sources than this checkout's (a change makes ~3 GB of them)."""
    try:
        return json.loads((entry / "key.json").read_text()).get("code") != code_hash()
    except (OSError, ValueError):
        return False


def prune(now: float | None = None) -> None:
    """Remove entries unused for :data:`KEEP_SECONDS`, or for :data:`KEEP_OTHER_CODE_SECONDS` when other
    exporter sources made them (another branch may still want them for a while), and staging folders of
    killed runs (an hour old)."""
    now = now or time.time()
    root = cache_root()
    for path in root.iterdir():
        try:
            age = now - path.stat().st_mtime
        except FileNotFoundError:
            continue
        if path.name.startswith(".staging-"):
            stale = age > 3600
        else:
            stale = age > KEEP_SECONDS or (age > KEEP_OTHER_CODE_SECONDS and path.is_dir() and _other_code(path))
        if stale and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif stale and path.suffix == ".lock":
            path.unlink(missing_ok=True)


@dataclass
class CachedExport:
    """What a test gets for a cached export: the path and metadata, and the PyTorch reference
    (rebuilt from the weights beside the file on first use, as ``attnx check`` does)."""

    path: Path

    @functools.cached_property
    def info(self):
        from attnx.contract import ModelInfo

        return ModelInfo.read(self.path)

    @property
    def config(self) -> dict:
        return self.info.config

    @property
    def weights_path(self) -> Path | None:
        return self.path.parent / self.info.weights if self.info.weights else None

    @functools.cached_property
    def model(self):
        from attnx.export.reference import load_reference

        return load_reference(self.path)[0]
