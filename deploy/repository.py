"""Write a Triton Inference Server model repository for an attnx export, all or nothing.

Layout written by :func:`write_repository`::

    repo/
      README.md                      how to start Triton on it (and the Dockerfile, KServe notes)
      <name>/config.pbtxt            platform, max_batch_size, dynamic_batching, inputs/outputs
      <name>/1/model.onnx            (or model.plan for a TensorRT engine; external data beside it)
      <name>/plugins/lib...so        an engine's TensorRT plugin library (not a model folder: Triton
                                     ignores non-numeric folders inside a model, not in the repository)

and for an export that carries a tokenizer (:mod:`attnx.deploy.text_ensemble`) the model is
``<name>_model``, next to ``<name>_tokenizer/`` (Python backend: ``1/model.py``, ``1/tokenizer/``) and
the ensemble ``<name>/``, plus a ``Dockerfile`` adding the ``tokenizers`` package to Triton's image.

The model runs on Triton's ONNX Runtime backend (``.onnx``) or TensorRT backend (an engine), or,
with ``backend="python"`` (``attnx triton-repo --backend python``), on attnx's own runtime inside
Triton's Python backend (:mod:`attnx.deploy.runtime_model`, shipped as ``1/model.py`` beside the model
file): for a Triton without the ONNX Runtime backend, attnx's custom ops on the stub's ONNX Runtime,
or an attnx engine; it pads requests of different lengths into one batch (``allow_ragged_batch``) and
fills left-out inputs as ``attnx serve`` does (``optional``).

Every path is checked before anything is written: the model name must be a plain folder name,
external data and tokenizer files named inside the export must stay in its folder, and a model
folder is only replaced when attnx wrote it and it does not hold the files being copied. The models
are assembled in a staging folder beside the repository and moved in at the end; after a failure
neither the staging folder nor any folder this call created is left behind, and replaced folders
are put back.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnx.contract import BATCH, SEQ, ContractError, ModelInfo, contained, load_onnx, verify_engine
from attnx.deploy import text_ensemble as text
from attnx.deploy.kserve import KServeOptions, check_manifest, kserve_problem, repository_service, to_yaml
from attnx.deploy.readme import repository_readme
from attnx.deploy.triton import (
    ConfigError,
    check_model_name,
    model_config,
    python_model_config,
    schema_problem,
    to_pbtxt,
    validate_config,
    validate_ensemble,
)

PLATFORMS = {".onnx": ("onnxruntime_onnx", "model.onnx"),
             ".engine": ("tensorrt_plan", "model.plan"),
             ".plan": ("tensorrt_plan", "model.plan")}
#: ``--backend``: what runs the model, by the name Triton gives the backend.
BACKENDS = {"onnxruntime": "onnxruntime_onnx", "tensorrt": "tensorrt_plan", "python": "python"}
#: The first line of every config.pbtxt attnx writes: only such model folders are ever replaced.
MARK = "# Written by attnx triton-repo"
DEFAULT_MAX_BATCH = 32


@dataclass
class Repository:
    """What :func:`write_repository` wrote: ``models`` maps each model name to its folder; ``entry``
    is the model clients call (the ensemble for a text model)."""

    root: Path
    entry: str
    models: dict[str, Path] = field(default_factory=dict)
    text: text.TextNames | None = None
    plugin: Path | None = None
    validated: bool = False
    manifest: Path | None = None  # kserve.yaml, when asked for
    manifest_checked: bool = False
    backend: str = "onnxruntime"  # what runs the model: onnxruntime, tensorrt or python

    @property
    def model_dir(self) -> Path:
        """The folder of the ONNX Runtime / TensorRT model itself."""
        return self.models[self.text.model if self.text else self.entry]


@dataclass
class _Source:
    """The model file and everything copied with it, checked."""

    path: Path
    platform: str
    filename: str
    inputs: list
    outputs: list
    external: list[tuple[Path, str]]  # (file, its location relative to the model)
    profiles: dict
    info: ModelInfo | None  # the export's metadata (an engine's: its source ONNX's)
    info_dir: Path | None  # the folder of the file the metadata came from
    onnx: Path | None = None  # an engine's source ONNX, when found
    sidecar: dict = field(default_factory=dict)  # an engine's build sidecar


def find_plugin_library() -> Path | None:
    """The built TensorRT plugin library, if ``attnx.plugins`` can say where it is."""
    try:
        from attnx.plugins.locate import library_path
        path = library_path()
    except Exception:  # noqa: BLE001 - not built yet is a normal state here
        return None
    return Path(path) if path and Path(path).is_file() else None


def _external_data(model_path: Path, proto) -> list[tuple[Path, str]]:
    """The external data files of an ONNX model, each contained in the model's folder and present."""
    import onnx
    from onnx.external_data_helper import _get_all_tensors

    locations = sorted({entry.value for tensor in _get_all_tensors(proto)
                        if tensor.data_location == onnx.TensorProto.EXTERNAL
                        for entry in tensor.external_data if entry.key == "location"})
    files = []
    for location in locations:
        path = contained(model_path.parent, location, f"{model_path.name}: external data location")
        if not path.is_file():
            raise ContractError(f"{model_path.name}: its external data file {location!r} is missing")
        files.append((path, location))
    return files


def _source_onnx(engine: Path, onnx_path: Path | None, sidecar: dict) -> Path | None:
    """The ONNX an engine was built from: the one given, else one beside the engine (never a path
    taken from the sidecar outside the engine's folder)."""
    if onnx_path is not None:
        return onnx_path
    named = sidecar.get("onnx_name")
    candidates = [contained(engine.parent, named, "the sidecar's onnx_name")] if isinstance(named, str) else []
    candidates.append(engine.with_suffix(".onnx"))
    return next((c for c in candidates if c.is_file()), None)


def read_source(model_path: Path, onnx_path: Path | None = None) -> _Source:
    """Check the model file (and an engine's sidecar and source ONNX); one clear error for any problem."""
    from attnx.runtime.core.axes import resolve_axes
    from attnx.runtime.core.backends.onnxrt import onnx_io_specs
    from attnx.runtime.core.backends.tensorrt import engine_io_specs

    suffix = model_path.suffix.lower()
    if suffix not in PLATFORMS:
        raise ValueError(f"{model_path}: expected a .onnx or .engine/.plan file")
    if not model_path.is_file():
        raise FileNotFoundError(f"no model file at {model_path}")
    platform, filename = PLATFORMS[suffix]
    if suffix == ".onnx":
        proto = load_onnx(model_path)
        # A foreign file's batch/sequence dims go by other names (batch_size, sequence_length): the
        # names attnx serve reads as batch and seq are read here too, so Triton batches it as well.
        inputs, outputs, _ = resolve_axes(*onnx_io_specs(model_path))
        info = ModelInfo.read(proto)
        return _Source(model_path, platform, filename, inputs, outputs, _external_data(model_path, proto),
                       dict(info.profiles) if info else {}, info, model_path.parent)
    sidecar = verify_engine(model_path) or {}
    source = _source_onnx(model_path, onnx_path, sidecar)
    if source is not None and not source.is_file():
        raise FileNotFoundError(f"no ONNX file at {source}")
    inputs, outputs, _ = engine_io_specs(model_path, source)
    info = ModelInfo.read(source) if source is not None else None
    profiles = sidecar.get("profiles") or (dict(info.profiles) if info else {})
    return _Source(model_path, platform, filename, inputs, outputs, [], profiles, info,
                   source.parent if source is not None else None, source, dict(sidecar))


def _tokenizer_folder(source: _Source) -> tuple[Path, list[Path]]:
    """The export's tokenizer folder and its files, each checked to stay inside it (no escaping links)."""
    tokenizer = source.info.tokenizer  # type: ignore[union-attr]
    folder = tokenizer.folder(source.info_dir)  # type: ignore[union-attr,arg-type]
    if not folder.is_dir():
        raise FileNotFoundError(f"the export's tokenizer folder {folder} is missing (it travels beside the .onnx)")
    file = tokenizer.path(source.info_dir)  # type: ignore[union-attr,arg-type]
    if not file.is_file():
        raise FileNotFoundError(f"the export's tokenizer file {file} is missing")
    files = [contained(folder, p.name, "a file of the export's tokenizer folder") for p in sorted(folder.iterdir())]
    return folder, [f for f in files if f.is_file()]


def _max_batch(source: _Source, requested: int | None) -> int:
    """``max_batch_size``: as asked (default 32), within an engine's batch profile."""
    limit = int(source.profiles[BATCH][2]) if source.platform == "tensorrt_plan" and BATCH in source.profiles else None
    if requested is None:
        return min(DEFAULT_MAX_BATCH, limit) if limit else DEFAULT_MAX_BATCH
    if requested < 0:
        raise ValueError(f"max batch size must be >= 0, got {requested}")
    if limit is not None and requested > limit:
        raise ValueError(f"max batch size {requested} exceeds the engine's batch profile maximum {limit} "
                         "(rebuild it with a larger --shapes batch=..., or lower --max-batch)")
    return requested


def _check_destination(repo: Path, names: list[str], sources: list[Path]) -> None:
    """Refuse to replace a folder attnx did not write, or one that holds a file we are about to copy."""
    if repo.exists() and not repo.is_dir():
        raise ValueError(f"{repo} is not a folder")
    for name in names:
        folder = repo / name
        if not folder.exists():
            continue
        config = folder / "config.pbtxt"
        ours = config.is_file() and config.read_text(errors="replace").startswith(MARK)
        if not ours:
            raise ValueError(f"{folder} exists and was not written by attnx triton-repo: choose another --name "
                             "or another repository")
        for src in sources:
            if src.resolve().is_relative_to(folder.resolve()):
                raise ValueError(f"{src} is inside {folder}, which would be replaced: copy it elsewhere first")


def write_repository(
    model_path: str | Path,
    out_dir: str | Path,
    *,
    name: str | None = None,
    max_batch_size: int | None = None,
    max_queue_delay_us: int = 2000,
    max_queue_size: int | None = None,
    instance_kind: str = "KIND_AUTO",
    instance_count: int = 1,
    plugin_library: str | Path | None = None,
    onnx_path: str | Path | None = None,
    validate: bool | None = None,
    max_length: int | None = None,
    pad_to_multiple_of: int = 16,
    kserve: KServeOptions | None = None,
    backend: str | None = None,
) -> Repository:
    """Write (or add to) a Triton model repository (see the module doc).

    ``max_batch_size``: default 32, or an engine's batch profile maximum when lower.
    ``plugin_library``: the TensorRT plugin ``.so`` to ship with an engine (default: the built one).
    ``onnx_path``: for an engine, the ONNX it was built from (I/O names, the tokenizer). ``validate``:
    check the configs with Triton's schema (None: when tritonclient is installed to provide it).
    ``max_length`` (text models): truncate below the export's maximum length, e.g. to fit an engine's
    seq profile. ``pad_to_multiple_of``: the tokenizer's length buckets. ``kserve``: also write
    ``kserve.yaml``, an InferenceService for the repository (:mod:`attnx.deploy.kserve`).
    ``backend``: ``onnxruntime`` (an ``.onnx``'s default), ``tensorrt`` (an engine's) or ``python``
    (attnx's runtime in Triton's Python backend, either file).
    """
    model_path, repo = Path(model_path), Path(out_dir)
    name = name if name is not None else model_path.stem
    try:
        check_model_name(name)
    except ConfigError as e:
        raise ConfigError(f"{e} (pass --name)" if name == model_path.stem else str(e)) from None
    source = read_source(model_path, Path(onnx_path) if onnx_path else None)
    if source.info is not None and source.info.cache:  # refused before anything is written
        raise ConfigError(f"{model_path.name} is a with-past decoder (its KV cache goes in and out at every step): "
                          "a Triton repository would run it once per request and never generate text; serve it with "
                          "`attnx serve` (OpenAI completions and chat, Triton's generate extension)")
    backend = _backend(source, backend)
    is_text = source.info is not None and source.info.tokenizer is not None
    names = text.TextNames.of(name) if is_text else None
    batch = _max_batch(source, max_batch_size)

    plugin = Path(plugin_library) if plugin_library else None
    if plugin is not None and not plugin.is_file():
        raise FileNotFoundError(f"no plugin library at {plugin}")
    if plugin is None and source.platform == "tensorrt_plan":
        plugin = find_plugin_library()

    net_name = names.model if names else name
    pad_id = source.info.tokenizer.pad_id if is_text else None  # type: ignore[union-attr]
    net_config = model_config(
        net_name, (source.inputs, source.outputs), platform=source.platform, max_batch_size=batch,
        max_queue_delay_us=max_queue_delay_us, max_queue_size=max_queue_size, instance_kind=instance_kind,
        instance_count=instance_count, default_model_filename=source.filename)
    if backend == "python":
        engine = source.platform == "tensorrt_plan"
        net_config = python_model_config(
            net_config, source.inputs, source.outputs, model_file=source.filename, pad_id=pad_id, text_fed=is_text,
            onnx_file="model.onnx" if engine and not _sidecar_lists_io(source.sidecar) else None,
            plugin=f"plugins/{plugin.name}" if plugin and engine else None, gpu=engine)
    configs: dict[str, dict[str, Any]] = {net_name: net_config}
    tokenizer_dir, tokenizer_files = None, []
    if names is not None:
        tokenizer_dir, tokenizer_files = _tokenizer_folder(source)
        tokenization = text.Tokenization.from_metadata(source.info.tokenizer, max_length=max_length,  # type: ignore[union-attr]
                                                       pad_to_multiple_of=pad_to_multiple_of)
        seq_max = int(source.profiles[SEQ][2]) if source.platform == "tensorrt_plan" and SEQ in source.profiles else None
        if seq_max is not None and tokenization.max_length > seq_max:
            raise ValueError(f"the export truncates texts at {tokenization.max_length} tokens but the engine's seq "
                             f"profile stops at {seq_max}: rebuild it with --shapes seq=1,128,{tokenization.max_length} "
                             f"or pass --max-length {seq_max} (longer texts are then cut there)")
        roles = text.id_inputs(source.inputs)
        context, pairs = text.defaulted_context(source.inputs), text.scores_pairs(source.outputs)
        configs[names.tokenizer] = text.tokenizer_config(names, net_config, roles, tokenization,
                                                         max_queue_delay_us=max_queue_delay_us,
                                                         instance_count=instance_count, context=context, pairs=pairs)
        configs[names.ensemble] = text.ensemble_config(names, net_config, roles, source.outputs,
                                                       context=context, pairs=pairs)
    elif max_length is not None:
        raise ValueError("--max-length applies to a model that carries a tokenizer; this one takes no text")

    origin = f"{MARK} from {source.path.name}; see ../README.md.\n"
    texts = {n: origin + to_pbtxt(c) for n, c in configs.items()}
    validated = validate or (validate is None and schema_problem() is None)
    if validated:
        parsed = {n: validate_config(t) for n, t in texts.items()}
        if names is not None:
            validate_ensemble(parsed[names.ensemble], parsed)

    engine_files = _engine_companions(source) if backend == "python" and source.platform == "tensorrt_plan" else {}
    copied = [source.path, *(f for f, _ in source.external), *([tokenizer_dir] if tokenizer_dir else []),
              *([plugin] if plugin else []), *engine_files.values()]
    _check_destination(repo, list(configs), copied)

    def fill(staged: dict[str, Path]) -> None:
        version_dir = staged[net_name] / "1"
        version_dir.mkdir(parents=True)
        shutil.copy2(source.path, version_dir / source.filename)
        for file, location in source.external:
            target = contained(version_dir, location, "external data location")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(file, target)
        for target, file in engine_files.items():
            shutil.copy2(file, version_dir / target)
        if backend == "python":
            shutil.copy2(Path(text.__file__).with_name("runtime_model.py"), version_dir / "model.py")
        if plugin is not None:
            (staged[net_name] / "plugins").mkdir()
            shutil.copy2(plugin, staged[net_name] / "plugins" / plugin.name)
        if names is not None:
            tok_version = staged[names.tokenizer] / "1"
            tok_version.mkdir(parents=True)
            shutil.copy2(Path(text.__file__).with_name("tokenizer_model.py"), tok_version / "model.py")
            (tok_version / text.TOKENIZER_FOLDER).mkdir()
            for file in tokenizer_files:
                shutil.copy2(file, tok_version / text.TOKENIZER_FOLDER / file.name)
            (staged[names.ensemble] / "1").mkdir(parents=True)  # Triton wants a version folder, even empty
        for n, t in texts.items():
            (staged[n] / "config.pbtxt").write_text(t)

    root_files = {}
    if names is not None or backend == "python":
        root_files["Dockerfile"] = text.dockerfile(attnx_runtime=backend == "python")
    kserve_checked = False
    if kserve is not None:
        engine = source.platform == "tensorrt_plan"
        manifest = repository_service(kserve, names.ensemble if names else name,
                                      gpu=engine or instance_kind == "KIND_GPU",
                                      text_model=names is not None or backend == "python",
                                      plugins=[f"{net_name}/plugins/{plugin.name}"] if plugin and engine
                                      and backend != "python" else [])
        if kserve_problem() is None:
            check_manifest(manifest)
            kserve_checked = True
        root_files["kserve.yaml"] = to_yaml(manifest)
    _install(repo, list(configs), fill, root_files)
    return Repository(repo, names.ensemble if names else name, {n: repo / n for n in configs}, names,
                      repo / net_name / "plugins" / plugin.name if plugin else None, bool(validated),
                      repo / "kserve.yaml" if kserve else None, kserve_checked, backend)


def _backend(source: _Source, asked: str | None) -> str:
    """What runs the model: as asked, or the file's own (ONNX Runtime for .onnx, TensorRT for an engine)."""
    own = "tensorrt" if source.platform == "tensorrt_plan" else "onnxruntime"
    if asked is None:
        return own
    if asked not in BACKENDS:
        raise ValueError(f"unknown backend {asked!r}: onnxruntime, tensorrt or python")
    if asked not in (own, "python"):
        raise ValueError(f"{source.path.name} runs on Triton's {own} backend or attnx's (python), not {asked}")
    return asked


def _sidecar_lists_io(sidecar: dict) -> bool:
    return isinstance(sidecar.get("inputs"), list) and isinstance(sidecar.get("outputs"), list)


def _engine_companions(source: _Source) -> dict[str, Path]:
    """What an engine needs beside it in the Python backend: its sidecar (size, sha256, tensors), and its
    source ONNX when the sidecar does not list the tensors."""
    from attnx.contract import sidecar_path

    files = {}
    if sidecar_path(source.path).is_file():
        files[f"{source.filename}.json"] = sidecar_path(source.path)
    if not _sidecar_lists_io(source.sidecar):
        if source.onnx is None:
            raise ValueError(f"{source.path.name}: the Python backend needs the engine's tensors: pass --onnx with the "
                             "ONNX it was built from")
        files["model.onnx"] = source.onnx
    return files


def _install(repo: Path, names: list[str], fill, root_files: dict[str, str]) -> None:
    """Build the model folders in a staging folder beside ``repo``, then move them in; undo on failure."""
    created = _missing_ancestors(repo)
    moved: list[tuple[Path, Path]] = []  # (old folder's place in the repository, where it waits)
    placed: list[Path] = []
    staging = None
    try:
        repo.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{repo.name}.attnx-", dir=repo.parent))
        staged = {n: staging / "new" / n for n in names}
        for folder in staged.values():
            folder.mkdir(parents=True)
        fill(staged)
        (staging / "old").mkdir()
        for n in names:
            if (repo / n).exists():
                os.replace(repo / n, staging / "old" / n)
                moved.append((repo / n, staging / "old" / n))
            os.replace(staged[n], repo / n)
            placed.append(repo / n)
        for file_name, content in root_files.items():
            write_root_file(repo / file_name, content)
        write_root_file(repo / "README.md", repository_readme(repo))
    except BaseException:
        for folder in placed:
            shutil.rmtree(folder, ignore_errors=True)
        for original, waiting in moved:
            os.replace(waiting, original)
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        for folder in created:  # deepest first; only what this call made
            shutil.rmtree(folder, ignore_errors=True)
        raise
    shutil.rmtree(staging, ignore_errors=True)


def _missing_ancestors(path: Path) -> list[Path]:
    """``path`` and its parents that do not exist yet, deepest first."""
    missing = []
    for p in [path, *path.parents]:
        if p.exists():
            break
        missing.append(p)
    return missing


def write_root_file(path: Path, content: str) -> None:
    """Write a README/Dockerfile at the repository root (atomically), unless the user put their own there."""
    if path.exists() and "attnx triton-repo" not in path.read_text(errors="replace")[:200]:
        return
    tmp = path.with_name(f".{path.name}.attnx-tmp")
    tmp.write_text(content)
    os.replace(tmp, path)
