"""Exports from the cache (``support/cache.py``), one object per export and process.

The fixtures of ``tests/conftest.py`` (``exported``, ``pretrained_export``, ``minilm_export``) call these;
helper modules that build on an export (``explain_fixtures.py``, ``scoring_fixtures.py``,
``generation_fixtures.py``) call them directly.
"""

from __future__ import annotations

from pathlib import Path

from support import cache

#: attnx's own small encoders: two layers of d_model 32 with 4 heads unless a test overrides it.
SMALL = {"d_model": 32, "n_heads": 4}
_OBJECTS: dict[Path, cache.CachedExport] = {}


def cached(path: Path) -> cache.CachedExport:
    if path not in _OBJECTS:  # one object per process: its torch reference is built once
        _OBJECTS[path] = cache.CachedExport(path)
    return _OBJECTS[path]


def variant(name: str, lowering: str = "plugin", fp16: bool = False, n_layers: int = 2, *,
            export: dict | None = None, **overrides) -> cache.CachedExport:
    """attnx's small encoder with variant ``name`` (``attnx export --variant``); ``export``: more keyword
    arguments of ``export_variant`` (``seed``, ``attention_outputs``, ``head_mask``, ``fuse``, ...)."""
    from attnx.export import export_variant

    opts = {**SMALL, **overrides}
    more = dict(export or {})
    file = f"{name}-{lowering}-{'fp16' if fp16 else 'fp32'}.onnx"
    path = cache.entry(file, lambda out: export_variant(name, out, overrides=opts, n_layers=n_layers,
                                                        lowering=lowering, fp16=fp16, **more),
                       kind="variant", variant=name, lowering=lowering, fp16=fp16, n_layers=n_layers, opts=opts,
                       **({"export": more} if more else {}))
    return cached(path)


def pretrained(folder, variant: str | None = "mha", name: str | None = None, **kw) -> cache.CachedExport:
    """``attnx export --from-pretrained folder`` (``kw``: keyword arguments of ``export_pretrained``).
    ``variant=None`` exports what a saved placed folder records. A with-past export is ``model.onnx`` in
    a folder of its own (onnxruntime-genai's layout). The entry holds its reference weights
    (``copy_weights``): it is keyed on the folder's content and outlives the folder it was exported from,
    whose path an export otherwise records as its reference."""
    from attnx.export.pretrained import export_pretrained

    folder = stable_folder(Path(folder))
    kw = {k: v for k, v in kw.items() if v is not None}
    kw.setdefault("copy_weights", True)
    if "checkpoint" in kw:  # keyed on its content, wherever it lies
        kw["checkpoint"] = Path(kw["checkpoint"])
    name = "model.onnx" if kw.get("with_past") else (name or f"{folder.name}-{variant or 'saved'}.onnx")
    path = cache.entry(name, lambda out: export_pretrained(folder, out, variant=variant, **kw),
                       kind="pretrained", folder=folder, variant=variant, options=kw)
    return cached(path)


def stable_folder(folder: Path) -> Path:
    """A folder a test made under its tmp path, copied into the cache (keyed on its content), so that a
    cached export never names a source folder that a later run no longer has."""
    import shutil
    import tempfile

    resolved = folder.resolve()
    if Path(tempfile.gettempdir()).resolve() not in resolved.parents or cache.cache_root() in resolved.parents:
        return folder
    return cache.entry(folder.name, lambda out: shutil.copytree(resolved, out), kind="source", folder=resolved)


def minilm(variant: str = "mha", **kw) -> cache.CachedExport:
    """The real all-MiniLM-L6-v2 with ``variant`` placed, as ``minilm-<variant>.onnx``."""
    from attnx.pretrained import minilm_path

    return pretrained(minilm_path(), variant, name=f"minilm-{variant}.onnx", **kw)


_REFERENCE: list = []


def minilm_reference():
    """sentence-transformers' own all-MiniLM-L6-v2, one per process (the reference of every text test)."""
    if not _REFERENCE:
        from sentence_transformers import SentenceTransformer

        from attnx.pretrained import minilm_path

        _REFERENCE.append(SentenceTransformer(str(minilm_path()), device="cpu"))
    return _REFERENCE[0]


def hf_folder(family: str, seed: int = 0, *, edit=None, tag: str = "") -> Path:
    """The random-weight Hugging Face folder of ``family`` (``tests/hf_folders.py``), from the cache.
    ``edit(folder)`` changes the folder once after it is made (``tag`` names the edit in the key).
    Shared by every test: copy it before changing it."""
    import hf_folders

    def make(out: Path) -> None:
        hf_folders.make_folder(family, out.parent, seed)
        if edit is not None:
            edit(out)

    return cache.entry(family, make, kind="folder", family=family, seed=seed, tag=tag)


def linked_copy(path: Path, folder: Path) -> Path:
    """The export ``path`` with everything beside it, hard-linked (copied across file systems) into
    ``folder``: a test may write new files beside it there without touching the cache. (Files are
    shared, not duplicated: replace a file there, never change it in place.)"""
    import os
    import shutil

    folder.mkdir(parents=True, exist_ok=True)

    def link(src: str, dst: str) -> None:
        if src.endswith(".data"):  # onnx refuses external data with several links ("a potential hardlink attack")
            shutil.copy2(src, dst)
            return
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    for item in Path(path).parent.iterdir():
        if item.name == "key.json":
            continue
        if item.is_dir():
            shutil.copytree(item, folder / item.name, copy_function=link)
        else:
            link(str(item), str(folder / item.name))
    return folder / Path(path).name


def check_workdir(path: Path, folder: Path) -> Path:
    """``folder`` as the ``workdir`` of ``attnx check`` on the attnx encoder ``path``, its ``parity/`` already
    holding the other lowering that check re-exports from the reference (from the cache, keyed on the file and
    its weights): what a second ``attnx check`` in the same workdir gets. The re-export itself is tested where
    a test passes a workdir of its own."""
    import shutil

    from attnx.contract import ModelInfo, sha256_file
    from attnx.export.reference import load_reference
    from attnx.parity.check import _other_lowering_file

    path = Path(path)
    info = ModelInfo.read(path)
    weights = path.parent / info.weights
    other = "rewrite" if info.lowering == "plugin" else "plugin"
    name = f"{path.stem.removesuffix('-' + info.lowering)}-{other}.onnx"

    def make(out: Path) -> None:
        model, info_ = load_reference(path)
        made, _ = _other_lowering_file(model, info_, path, out.parent, sha256_file(weights))
        assert made == out, (made, out)

    cached_file = cache.entry(name, make, kind="other-lowering", model=cache.file_hash(path),
                              weights=cache.file_hash(weights))
    parity = Path(folder) / "parity"
    parity.mkdir(parents=True, exist_ok=True)
    for item in cached_file.parent.iterdir():
        if item.name.startswith(name):  # the file, its .key stamp (and its .data, if any)
            shutil.copy2(item, parity / item.name)
    return Path(folder)
