"""The attnx file contract: what an exported ONNX file, its engine and the engine's sidecar promise.

Everything that writes or reads these files imports its names from here, so the contract
has one home (docs/architecture.md, "The file contract"):

- **Custom ops**: domain ``attnx`` (version 1); TensorRT finds a plugin by ``op_type``, plugin
  version and namespace, which every custom node carries as attributes (:data:`PLUGIN_ATTRIBUTES`).
  Which ops exist is declared by the variants (``VariantSpec.custom_ops``), not here.
- **Axes and roles**: dynamic dims are named :data:`BATCH` / :data:`SEQ`; every input and output
  has a role (:class:`Role`).
- **Metadata** (``metadata_props``, keys ``attnx.*``): :class:`ModelInfo` writes and reads them,
  versioned by ``attnx.schema`` (files without it are schema 1 and read the same way); a text model's
  ``attnx.tokenizer`` is :class:`TokenizerSettings`, checked once, when the file is read.
- **Profiles**: ``{"batch": (min, opt, max), "seq": (...)}``, parsed and checked here only.
- **Engine sidecar**: ``<engine>.json`` beside every engine (:func:`read_sidecar`,
  :func:`write_sidecar`, :func:`verify_engine`).

This module imports neither torch nor onnx at import time: serving reads the contract too.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

if TYPE_CHECKING:  # imported where used: serving reads the contract without loading onnx
    import onnx

# ============================================================================ custom ops

DOMAIN = "attnx"
DOMAIN_VERSION = 1
PLUGIN_NAMESPACE = "attnx"
PLUGIN_VERSION = "1"
#: The string attributes every custom node carries: the TensorRT ONNX parser reads them to pick the creator.
PLUGIN_ATTRIBUTES = {"plugin_version": PLUGIN_VERSION, "plugin_namespace": PLUGIN_NAMESPACE}
#: A model-local function of this domain, named like an attnx op, is that op's form for TensorRT: the op
#: has no plugin of its own, its ``attnx`` function is the fast form ONNX Runtime runs, and an engine build
#: inlines this one (made of ops that have plugins) in its place (:mod:`attnx.engine.forms`).
ENGINE_DOMAIN = "attnx.tensorrt"
ONNX_OPSET = 23  # plain attention is one ONNX ``Attention`` node from opset 23
MIN_OPSET = 18  # the dynamo exporter's minimum
IR_VERSION = 11  # opset 23 needs IR 11; onnxruntime 1.31 reads at most IR 13


class ContractError(ValueError):
    """A file, profile or sidecar that breaks the contract (one line, user-fixable)."""


# ============================================================================ axes and roles

BATCH = "batch"
SEQ = "seq"
AXES = (BATCH, SEQ)
#: A decoder exported with its KV cache (``--with-past``): the cached positions (``past_key_values.*``)
#: and past + new (``attention_mask``, ``present.*``); ``seq`` is then the new tokens.
PAST = "past"
TOTAL = "total"
CACHE_AXES = (PAST, TOTAL)


class Role:
    """What an input or output is for (``attnx.inputs`` / ``attnx.outputs`` ``role``)."""

    HIDDEN_STATES = "hidden_states"  # float [batch, seq, d_model]
    INPUT_IDS = "input_ids"  # int64 token ids [batch, seq]
    TOKEN_TYPE_IDS = "token_type_ids"  # int64 segment ids [batch, seq]
    ATTENTION_MASK = "attention_mask"  # [batch, seq], 1 = token, 0 = padding
    CONTEXT = "context"  # a variant's per-example input
    HEAD_MASK = "head_mask"  # [layers, heads], 1 = keep
    POSITION_IDS = "position_ids"  # int64 [batch, seq]: each new token's position (decoders with a cache)
    PAST = "past"  # a decoder's cached state in (past_key_values.{i}.key|value|<variant state>)
    PRESENT = "present"  # the same state out, past + new (present.{i}.*)
    OUTPUT = "output"  # the model's main output
    AUX = "aux"  # any other output (a variant's extra output, attention patterns, ...)


_DEFAULT_INPUT_ROLES = {name: name for name in (Role.HIDDEN_STATES, Role.INPUT_IDS, Role.TOKEN_TYPE_IDS,
                                                Role.ATTENTION_MASK, Role.HEAD_MASK)}
#: Outputs that are the model's main result when no metadata says otherwise.
MAIN_OUTPUTS = ("output", "last_hidden_state", "sentence_embedding", "logits")


def pretrained_task(config: dict[str, Any]) -> str:
    """The task of a ``--from-pretrained`` export's ``attnx.config``: its ``task``. attnx 0.1 files name only
    their hand-built host (``bert``: embeddings, ``gpt2``: a causal LM)."""
    return config.get("task") or ("causal-lm" if config.get("host") == "gpt2" else "feature-extraction")


def default_role(name: str, is_input: bool) -> str:
    """The role of a tensor that metadata does not describe (any ONNX file; Optimum's and
    onnxruntime-genai's cache names included)."""
    if is_input:
        if name.startswith("past_key_values."):
            return Role.PAST
        return _DEFAULT_INPUT_ROLES.get(name, Role.POSITION_IDS if name == "position_ids" else Role.CONTEXT)
    if name.startswith("present."):
        return Role.PRESENT
    return Role.OUTPUT if name in MAIN_OUTPUTS else Role.AUX


# ============================================================================ metadata

PREFIX = "attnx."
SCHEMA_VERSION = 2  # 2: adds attnx.schema and per-tensor value ranges; schema 1 files read the same way


#: What an input may be filled with when a request omits it (``TensorEntry.default``).
#: ``zeros`` / ``ones``: a variant context input's "no context" value (declared by the variant, e.g. smal's
#: trace is zeros, the test variant's temperature ones), which a text-only request has no say in.
INPUT_DEFAULTS = ("zeros", "ones")


@dataclass(frozen=True)
class TensorEntry:
    """One input or output as the metadata describes it. ``shape`` holds ints and dim names;
    ``range`` is ``[low, high)`` for integer inputs that index a table (ids, types); ``default``
    (inputs only, one of :data:`INPUT_DEFAULTS`) is what serving fills in when a request omits it
    (None: the input is required, as in files written before the field existed)."""

    name: str
    role: str
    dtype: str  # numpy dtype name: float32, float16, int64, ...
    shape: tuple[int | str, ...]
    range: tuple[int, int] | None = None
    doc: str = ""
    default: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "role": self.role, "dtype": self.dtype, "shape": list(self.shape)}
        if self.range is not None:
            out["range"] = list(self.range)
        if self.doc:
            out["doc"] = self.doc
        if self.default is not None:
            out["default"] = self.default
        return out

    @classmethod
    def from_json(cls, item: Mapping[str, Any], is_input: bool) -> "TensorEntry":
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
            raise ContractError(f"bad tensor entry in attnx metadata: {item!r}")
        rng = item.get("range")
        try:
            bounds = (int(rng[0]), int(rng[1])) if isinstance(rng, (list, tuple)) and len(rng) == 2 else None
        except (TypeError, ValueError):
            raise ContractError(f"bad range {rng!r} of {item['name']!r} in attnx metadata") from None
        if bounds is not None and not bounds[0] < bounds[1]:
            raise ContractError(f"bad range {list(bounds)} of {item['name']!r} in attnx metadata (need low < high)")
        default = item.get("default")
        if default is not None and (not is_input or default not in INPUT_DEFAULTS):
            raise ContractError(f"bad default {default!r} of {item['name']!r} in attnx metadata (an input's "
                                f"default is one of {', '.join(INPUT_DEFAULTS)})")
        return cls(name=item["name"], role=str(item.get("role") or default_role(item["name"], is_input)),
                   dtype=str(item.get("dtype", "float32")), shape=tuple(item.get("shape") or ()),
                   range=bounds, doc=str(item.get("doc", "")), default=default)


TRUNCATION_SIDES = ("left", "right")


@dataclass(frozen=True)
class TokenizerSettings:
    """``attnx.tokenizer``: how a text model's export is tokenised, read and checked here only.

    ``dir`` is the tokenizer folder beside the ``.onnx`` (relative to it), ``file`` the ``tokenizer.json`` in it;
    texts are cut to ``max_length`` tokens on ``truncation_side`` and batches padded with ``pad_id``. Every
    ``--from-pretrained`` export (attnx 0.1's included) writes all of them; ``max_length`` has no default: a
    reader never guesses a model's length. Unknown keys are kept in ``extra`` and written back unchanged."""

    dir: str
    max_length: int
    file: str = "tokenizer.json"
    truncation_side: str = "right"
    pad_id: int = 0
    model_type: str | None = None  # the source's model_type (bert, gpt2, ...), informative
    extra: dict[str, Any] = field(default_factory=dict)

    _KEYS = ("dir", "file", "max_length", "truncation_side", "pad_id", "model_type")

    @classmethod
    def from_metadata(cls, meta: Any) -> "TokenizerSettings":
        """The checked settings of an ``attnx.tokenizer`` value (a one-line :class:`ContractError` if bad)."""
        if not isinstance(meta, Mapping):
            raise ContractError(f"attnx.tokenizer metadata is not an object: {str(meta)[:80]!r} (re-export the model)")
        for key in ("dir", "max_length"):
            if key not in meta:
                raise ContractError(f"attnx.tokenizer metadata has no {key} (re-export the model)")
        for key in ("max_length", "pad_id"):
            value = meta.get(key, 0)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ContractError(f"attnx.tokenizer {key} {value!r} is not an integer (the file's metadata was "
                                    "changed; re-export it)")
        if not isinstance(meta["dir"], str) or not meta["dir"]:
            raise ContractError(f"attnx.tokenizer dir {meta['dir']!r} is not a folder name (re-export the model)")
        for key in ("file", "truncation_side"):
            if not isinstance(meta.get(key, ""), str):
                raise ContractError(f"attnx.tokenizer {key} {meta[key]!r} is not a string (re-export the model)")
        side = meta.get("truncation_side", "right")
        if side not in TRUNCATION_SIDES:
            raise ContractError(f"attnx.tokenizer truncation_side {side!r} must be left or right")
        if meta["max_length"] < 1:
            raise ContractError(f"attnx.tokenizer max length {meta['max_length']} must be at least 1")
        if meta.get("pad_id", 0) < 0:
            raise ContractError(f"attnx.tokenizer pad id {meta['pad_id']} is outside the token ids (negative)")
        model_type = meta.get("model_type")
        return cls(dir=meta["dir"], max_length=meta["max_length"], file=meta.get("file") or "tokenizer.json",
                   truncation_side=side, pad_id=meta.get("pad_id", 0),
                   model_type=str(model_type) if model_type is not None else None,
                   extra={k: v for k, v in meta.items() if k not in cls._KEYS})

    def to_json(self) -> dict[str, Any]:
        out = {"dir": self.dir, "file": self.file, "max_length": self.max_length,
               "truncation_side": self.truncation_side, "pad_id": self.pad_id, **self.extra}
        if self.model_type is not None:
            out["model_type"] = self.model_type
        return out

    def folder(self, model_dir: str | os.PathLike[str]) -> Path:
        """The tokenizer folder, which must lie inside ``model_dir`` (the folder of the ``.onnx``)."""
        return contained(model_dir, self.dir, "the tokenizer folder named by attnx.tokenizer")

    def path(self, model_dir: str | os.PathLike[str]) -> Path:
        """The ``tokenizer.json`` (checked to lie inside the folder; whether it exists is the caller's check)."""
        return contained(self.folder(model_dir), self.file, "the tokenizer file named by attnx.tokenizer")


@dataclass
class ModelInfo:
    """The ``attnx.*`` metadata of an export: what the file is and how to feed it.

    Written by the exporter (:meth:`write`), read by everything else (:meth:`read`). Keys are
    the field names under ``attnx.``; dicts and lists are JSON. Unknown ``attnx.*`` keys are
    kept in ``extra`` and written back unchanged.
    """

    variant: str
    config: dict[str, Any]  # everything needed to rebuild the PyTorch reference
    lowering: str  # plugin | rewrite
    precision: str  # fp32 | fp16 | int8 (CPU: int8 MatMul weights, attnx.export.quantize)
    inputs: list[TensorEntry]
    outputs: list[TensorEntry]
    profiles: dict[str, Any]  # {"batch": [min, opt, max], "seq": [...]}
    version: str = ""  # attnx version that wrote the file
    weights: str | None = None  # safetensors file beside the model (the reference's weights)
    tokenizer: TokenizerSettings | None = None  # text models (a dict given here is checked into one)
    quantization: dict[str, Any] | None = None  # int8: {"weight_bits", "matmuls", "smoothing_alpha", "calibration", ...}
    #: decoders exported with their KV cache: each cached tensor's input/output names, layer and grown axis,
    #: and what generation needs (attnx.export.with_past.cache_metadata)
    cache: dict[str, Any] | None = None
    #: pretrained exports: the source folder the reference's pretrained weights are read from (path, and each
    #: weight file's size and sha256); ``weights`` then holds only what the folder lacks (the placed variant's)
    reference: dict[str, Any] | None = None
    schema: int = SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    _JSON_KEYS = ("config", "inputs", "outputs", "profiles", "tokenizer", "quantization", "cache", "reference")

    def __post_init__(self) -> None:
        if self.tokenizer is not None and not isinstance(self.tokenizer, TokenizerSettings):
            self.tokenizer = TokenizerSettings.from_metadata(self.tokenizer)

    # ---- lookups ------------------------------------------------------------------------
    def input(self, name: str) -> TensorEntry:
        for entry in self.inputs:
            if entry.name == name:
                return entry
        raise KeyError(f"no input {name!r}; inputs: {', '.join(e.name for e in self.inputs)}")

    def output(self, name: str) -> TensorEntry:
        for entry in self.outputs:
            if entry.name == name:
                return entry
        raise KeyError(f"no output {name!r}; outputs: {', '.join(e.name for e in self.outputs)}")

    @property
    def input_names(self) -> list[str]:
        return [e.name for e in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [e.name for e in self.outputs]

    # ---- writing ------------------------------------------------------------------------
    def to_props(self) -> dict[str, str]:
        """``{"attnx.variant": ..., ...}`` as strings."""
        props: dict[str, str] = {}
        for f in fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name in ("inputs", "outputs"):
                value = [e.to_json() for e in value]
            elif isinstance(value, TokenizerSettings):
                value = value.to_json()
            props[PREFIX + f.name] = value if isinstance(value, str) else json.dumps(value)
        for key, value in self.extra.items():
            props[PREFIX + key] = value if isinstance(value, str) else json.dumps(value)
        return props

    def write(self, model: onnx.ModelProto) -> None:
        """Replace the ``attnx.*`` entries of an ``onnx.ModelProto``'s ``metadata_props``."""
        keep = [(p.key, p.value) for p in model.metadata_props if not p.key.startswith(PREFIX)]
        del model.metadata_props[:]
        for key, value in keep:
            model.metadata_props.add(key=key, value=value)
        for key, value in self.to_props().items():
            model.metadata_props.add(key=key, value=value)

    # ---- reading ------------------------------------------------------------------------
    @classmethod
    def from_props(cls, props: Mapping[str, str]) -> "ModelInfo | None":
        """From ``{key: value}`` metadata (any keys); None when it is not an attnx export."""
        own = {k[len(PREFIX):]: v for k, v in props.items() if k.startswith(PREFIX)}
        if "variant" not in own:
            return None
        known = {f.name for f in fields(cls)} - {"extra"}
        parsed: dict[str, Any] = {}
        for key in known & set(own):
            value = own[key]
            if key in cls._JSON_KEYS:
                try:
                    value = json.loads(value)
                except ValueError:
                    raise ContractError(f"bad attnx.{key} metadata (not JSON): {value[:80]!r}") from None
            parsed[key] = value
        try:
            schema = int(parsed.get("schema", 1))
        except ValueError:
            raise ContractError(f"bad attnx.schema metadata: {parsed.get('schema')!r}") from None
        if schema > SCHEMA_VERSION:
            raise ContractError(f"this file uses attnx metadata schema {schema}; this attnx reads up to "
                                f"{SCHEMA_VERSION} (upgrade attnx)")
        parsed["schema"] = schema
        for key, is_input in (("inputs", True), ("outputs", False)):
            parsed[key] = [TensorEntry.from_json(item, is_input) for item in parsed.get(key) or []]
        parsed.setdefault("config", {})
        parsed.setdefault("lowering", "plugin")
        parsed.setdefault("precision", "fp32")
        parsed.setdefault("profiles", {})
        parsed["extra"] = {k: v for k, v in own.items() if k not in known}
        return cls(**parsed)

    @classmethod
    def read(cls, model: str | os.PathLike[str] | onnx.ModelProto) -> "ModelInfo | None":
        """The metadata of an ``onnx.ModelProto`` or a path to one (weights are not loaded)."""
        if isinstance(model, (str, os.PathLike)):
            model = load_onnx(model)
        return cls.from_props({p.key: p.value for p in model.metadata_props})


def load_onnx(path: str | os.PathLike[str], *, with_data: bool = False) -> onnx.ModelProto:
    """``onnx.load`` with one clear error for a missing or unreadable file."""
    import onnx

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    if path.stat().st_size == 0:
        raise ContractError(f"{path} is empty: not an ONNX file")
    try:
        return onnx.load(str(path), load_external_data=with_data)
    except Exception as e:  # protobuf's DecodeError and friends
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise ContractError(f"{path} is not a readable ONNX file ({type(e).__name__}: {first})") from None


# ============================================================================ profiles

#: Engine optimization profiles recorded at export unless given.
DEFAULT_PROFILES = {BATCH: (1, 8, 32), SEQ: (1, 128, 512)}


def check_profile(axis: str, values: Iterable[Any]) -> tuple[int, int, int]:
    try:
        lo, opt, hi = (int(v) for v in values)
    except (TypeError, ValueError):
        raise ContractError(f"profile {axis}: expected (min, opt, max) integers, got {values!r}") from None
    if not 1 <= lo <= opt <= hi:
        raise ContractError(f"profile {axis}={lo},{opt},{hi}: need 1 <= min <= opt <= max")
    return lo, opt, hi


def check_profiles(profiles: Mapping[str, Iterable[Any]], required: Sequence[str] = AXES) -> dict[str, tuple[int, int, int]]:
    """Validate ``{axis: (min, opt, max)}``; every axis in ``required`` must be there."""
    for axis in required:
        if axis not in profiles:
            raise ContractError(f"profiles need '{axis}': (min, opt, max)")
    return {axis: check_profile(axis, rng) for axis, rng in profiles.items()}


def parse_profile(text: str, axis: str) -> tuple[int, int, int]:
    """``"1,8,32"`` or ``"1:8:32"`` -> ``(1, 8, 32)``."""
    parts = [p for p in re.split(r"[,:]", str(text).strip()) if p.strip()]
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ContractError(f"{axis} profile {text!r}: expected min,opt,max (three integers, e.g. 1,8,32)")
    return check_profile(axis, parts)


def parse_shapes(items: Iterable[str] | None) -> dict[str, tuple[int, int, int]]:
    """``["batch=1,4,16", "seq=1:64:256"]`` (or ``"batch=1,4,16;seq=..."``) -> ``{axis: (min, opt, max)}``."""
    out: dict[str, tuple[int, int, int]] = {}
    for item in items or ():
        for part in re.split(r"[;\s]+", str(item).strip()):
            if not part:
                continue
            key, sep, raw = part.partition("=")
            if not sep or not key:
                raise ContractError(f"--shapes {part!r}: expected axis=min,opt,max (e.g. batch=1,4,16)")
            out[key.strip()] = parse_profile(raw, key.strip())
    return out


def read_profiles(props: Mapping[str, str]) -> dict[str, tuple[int, int, int]]:
    """The ``attnx.profiles`` of any file's ``{key: value}`` metadata (an attnx export, or a hand-made
    file that carries only its profiles), checked; ``{}`` when there are none."""
    raw = props.get(PREFIX + "profiles")
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except ValueError:
        raise ContractError(f"bad attnx.profiles metadata (not JSON): {raw[:80]!r}") from None
    if not isinstance(data, Mapping):
        raise ContractError(f"bad attnx.profiles metadata (not an object): {raw[:80]!r}")
    return {axis: check_profile(axis, rng) for axis, rng in data.items()}


def merge_profiles(base: Mapping[str, Iterable[Any]] | None,
                   overrides: Mapping[str, Iterable[Any]] | None) -> dict[str, tuple[int, int, int]]:
    """``base`` (e.g. a file's ``attnx.profiles``) with ``overrides`` on top, each checked."""
    out = {axis: check_profile(axis, rng) for axis, rng in (base or {}).items()}
    out.update({axis: check_profile(axis, rng) for axis, rng in (overrides or {}).items()})
    return out


# ============================================================================ files

def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


#: A graph input or output: ``(name, numpy dtype name, dims)``, each dim an int, a dim name or None.
GraphIO = tuple[str, str, list[int | str | None]]


def graph_io(model: onnx.ModelProto) -> tuple[list[GraphIO], list[GraphIO]]:
    """The graph's own inputs (initializers left out) and outputs of an ``onnx.ModelProto``, each as
    ``(name, numpy dtype name, dims)``; a dim is an int, a dim name (``batch``, ``seq``), or None."""
    import onnx

    initializers = {i.name for i in model.graph.initializer}

    def one(vi: onnx.ValueInfoProto) -> GraphIO:
        t = vi.type.tensor_type
        dims = [d.dim_param if d.dim_param else (d.dim_value if d.HasField("dim_value") else None)
                for d in t.shape.dim]
        return vi.name, onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name, dims

    return [one(v) for v in model.graph.input if v.name not in initializers], [one(v) for v in model.graph.output]


def contained(base: str | os.PathLike[str], relative: str, what: str) -> Path:
    """``base / relative``, refusing a path that leaves ``base`` (file contents are untrusted)."""
    root = Path(base).resolve()
    target = (root / relative).resolve()
    if not target.is_relative_to(root):
        raise ContractError(f"{what} {relative!r} points outside {root}: refused")
    return target


# ============================================================================ engine sidecar

SIDECAR_FORMAT = 1
#: First bytes of serialized plans: TensorRT-RTX 1.7 writes b"vtrt" (seen here), TensorRT 8-10 b"ftrt".
#: Only used for engines without a sidecar (which carries the engine's sha256).
PLAN_MAGICS = (b"vtrt", b"ftrt")


def sidecar_path(engine: str | os.PathLike[str]) -> Path:
    """``x.engine`` -> ``x.engine.json``."""
    p = Path(engine)
    return p.with_name(p.name + ".json")


def read_sidecar(engine: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The sidecar of an engine (``x.engine.json``, or an attnx sidecar at ``x.json``); None when
    there is none. A broken ``x.engine.json`` is a :class:`ContractError`."""
    p = Path(engine)
    for primary, candidate in ((True, sidecar_path(p)), (False, p.with_suffix(".json"))):
        if not candidate.is_file():
            continue
        try:
            data = json.loads(candidate.read_text())
        except (OSError, ValueError) as e:
            if not primary:
                continue  # x.json may be any JSON file
            raise ContractError(f"{candidate}: unreadable engine sidecar ({e})") from None
        if not isinstance(data, dict) or "engine_sha256" not in data:
            if not primary:
                continue
            raise ContractError(f"{candidate} is not an attnx engine sidecar")
        return data
    return None


def write_sidecar(engine: str | os.PathLike[str], data: Mapping[str, Any]) -> Path:
    """Write ``<engine>.json`` atomically."""
    side = sidecar_path(engine)
    tmp = side.with_name(side.name + ".tmp")
    tmp.write_text(json.dumps({"format": SIDECAR_FORMAT, **data}, indent=2) + "\n")
    os.replace(tmp, side)
    return side


def plan_declared_size(engine: str | os.PathLike[str]) -> int | None:
    """The total size a plan's header records, where the format is known: TensorRT-RTX plans (``vtrt``)
    hold it as a little-endian uint64 at byte 16 (measured with TensorRT-RTX 1.7). None otherwise."""
    with open(engine, "rb") as f:
        head = f.read(24)
    if head[:4] == b"vtrt" and len(head) == 24:
        return int.from_bytes(head[16:24], "little")
    return None


def verify_engine(engine: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Check an engine file against its sidecar (size and sha256); returns the sidecar, or None
    when the engine has none but looks like a plan. Anything else is a :class:`ContractError`."""
    p = Path(engine)
    if not p.is_file():
        raise FileNotFoundError(f"no engine file at {p}")
    size = p.stat().st_size
    if size == 0:
        raise ContractError(f"{p} is empty: not a TensorRT engine (rebuild it with `attnx build-engine`)")
    sidecar = read_sidecar(p)
    if sidecar is None:
        with open(p, "rb") as f:
            head = f.read(4)
        if head not in PLAN_MAGICS:
            raise ContractError(f"{p} is not a TensorRT engine (its header {head!r} is not a TensorRT plan's, and "
                                f"it has no {sidecar_path(p).name} sidecar)")
        declared = plan_declared_size(p)
        if declared is not None and declared != size:
            raise ContractError(f"{p} is truncated or corrupt: its header declares {declared} bytes and the file "
                                f"has {size} (rebuild it with `attnx build-engine`)")
        return None
    if sidecar.get("engine_bytes") not in (None, size) or sidecar.get("engine_sha256") != sha256_file(p):
        raise ContractError(f"{p} is corrupt or was changed after it was built: its sha256 does not match "
                            f"{sidecar_path(p).name} (rebuild it with `attnx build-engine`)")
    return sidecar
