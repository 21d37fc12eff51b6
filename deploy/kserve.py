"""Kubernetes: a KServe ``InferenceService`` that serves a repository written by ``attnx triton-repo``.

The manifest uses KServe's Triton runtime (``modelFormat: triton``, Open Inference Protocol v2) on
the whole repository at ``storageUri``, so an ensemble and the models it composes load together.
A repository with a text ensemble needs an image that has the ``tokenizers`` package (the
repository's ``Dockerfile`` builds one), set as the predictor's ``image``; an engine's plugin
library is preloaded from where the repository keeps it (``/mnt/models`` is where KServe puts
the storage).

:func:`check_manifest` rebuilds the manifest from the kserve package's own generated types
(``V1beta1InferenceService`` and the Kubernetes types it nests): an unknown field, a value of the
wrong type or a missing required field is an error, and the objects must serialise back to the
same manifest. The kserve package is only needed for that check (and only its types are used).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

API_VERSION = "serving.kserve.io/v1beta1"
KIND = "InferenceService"
MOUNT = "/mnt/models"  # where KServe's storage initializer puts storageUri's contents
#: KServe's InferenceService names: a DNS-1035 label (a letter first, then letters, digits, '-').
_SERVICE_NAME = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
_STORAGE_URI = re.compile(r"(s3|gs|pvc|https?|hdfs|webhdfs|oci|hf)://\S+")


class ManifestError(ValueError):
    """A manifest that KServe's types (or its naming rules) refuse."""


@dataclass(frozen=True)
class KServeOptions:
    """What ``attnx triton-repo --kserve-uri ...`` asks for (see :func:`inference_service`)."""

    storage_uri: str
    image: str | None = None
    name: str | None = None
    gpus: int | None = None  # None: one for a TensorRT engine or KIND_GPU instances, else none


def service_name(name: str) -> str:
    """A Kubernetes-safe name for a Triton model name (lower case, ``_`` and ``.`` become ``-``)."""
    candidate = re.sub(r"[^a-z0-9-]", "-", name.lower()).strip("-")
    if not _SERVICE_NAME.fullmatch(candidate):
        raise ManifestError(f"{name!r} gives no valid InferenceService name (a letter first, then letters, "
                            "digits and '-', at most 63): pass --kserve-name")
    return candidate


def inference_service(name: str, storage_uri: str, *, image: str | None = None, gpus: int = 0,
                      plugins: list[str] | tuple[str, ...] = (), cpu: str = "2", memory: str = "4Gi",
                      min_replicas: int = 1, max_replicas: int | None = None,
                      namespace: str | None = None) -> dict[str, Any]:
    """The InferenceService as a dict (camelCase keys, as ``kubectl`` reads it).

    ``plugins``: plugin libraries relative to the repository root, preloaded into Triton.
    ``image``: the Triton image to run in place of the runtime's (needed for text ensembles)."""
    if not _SERVICE_NAME.fullmatch(name):
        raise ManifestError(f"InferenceService name {name!r} must be a letter, then letters, digits and '-' "
                            "(at most 63)")
    if not _STORAGE_URI.fullmatch(storage_uri):
        raise ManifestError(f"storage URI {storage_uri!r}: expected s3://, gs://, pvc://, https://, hdfs://, "
                            "oci:// or hf:// followed by a path")
    if gpus < 0 or min_replicas < 0 or (max_replicas is not None and max_replicas < max(1, min_replicas)):
        raise ManifestError("GPUs and replicas must be >= 0, and max replicas >= min replicas (and >= 1)")
    limits = {"cpu": cpu, "memory": memory, **({"nvidia.com/gpu": str(gpus)} if gpus else {})}
    model: dict[str, Any] = {
        "modelFormat": {"name": "triton", "version": "2"},
        "protocolVersion": "v2",
        "storageUri": storage_uri,
        "resources": {"requests": {"cpu": cpu, "memory": memory}, "limits": limits},
    }
    if image:
        model["image"] = image
    if plugins:
        model["env"] = [{"name": "LD_PRELOAD", "value": ":".join(f"{MOUNT}/{p}" for p in plugins)}]
    predictor: dict[str, Any] = {"minReplicas": min_replicas}
    if max_replicas is not None:
        predictor["maxReplicas"] = max_replicas
    predictor["model"] = model
    metadata: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/created-by": "attnx"}}
    if namespace:
        metadata["namespace"] = namespace
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": {"predictor": predictor}}


# ------------------------------------------------------------------------------------------
# Checking with kserve's own types
# ------------------------------------------------------------------------------------------


def _model_class(type_name: str):
    import kubernetes.client.models as k8s
    from kserve import models as ks

    cls = getattr(ks, type_name, None) or getattr(k8s, type_name, None)
    if cls is None:
        raise ManifestError(f"neither kserve nor kubernetes has a type {type_name}")
    return cls


def _build(type_name: str, value: Any, where: str) -> Any:
    """``value`` (plain data) as an instance of the OpenAPI type ``type_name``; strict about fields."""
    container = re.fullmatch(r"(?:list|List)\[(.+)\]", type_name)
    if container:
        if not isinstance(value, list):
            raise ManifestError(f"{where}: expected a list, got {type(value).__name__}")
        return [_build(container.group(1), v, f"{where}[{i}]") for i, v in enumerate(value)]
    mapping = re.fullmatch(r"(?:dict\(str, |Dict\[str, )(.+)[)\]]", type_name)
    if mapping:
        if not isinstance(value, dict):
            raise ManifestError(f"{where}: expected a mapping, got {type(value).__name__}")
        return {k: _build(mapping.group(1), v, f"{where}.{k}") for k, v in value.items()}
    primitives = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object}
    if type_name in primitives:
        if not isinstance(value, primitives[type_name]) or (type_name == "int" and isinstance(value, bool)):
            raise ManifestError(f"{where}: expected {type_name}, got {type(value).__name__} {value!r}")
        return value
    cls = _model_class(type_name)
    if not isinstance(value, dict):
        raise ManifestError(f"{where}: expected a {type_name} object, got {type(value).__name__}")
    by_key = {key: attr for attr, key in cls.attribute_map.items()}
    kwargs = {}
    for key, item in value.items():
        if key not in by_key:
            raise ManifestError(f"{where}: {type_name} has no field {key!r}")
        attr = by_key[key]
        kwargs[attr] = _build(cls.openapi_types[attr], item, f"{where}.{key}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:  # the generated types refuse missing required fields here
        raise ManifestError(f"{where}: {type_name}: {' '.join(str(e).split())[:300]}") from None


def check_manifest(manifest: dict[str, Any]) -> dict[str, Any]:
    """Build ``manifest`` as kserve's ``V1beta1InferenceService`` and serialise it back; returns that
    round trip (plain data, with the types' defaults). Raises ManifestError for what KServe's types
    refuse, and RuntimeError when the kserve package is not installed.

    kserve's package import registers its own copy of the KServe v2 gRPC protos; in a process that
    already holds tritonclient's copy (``attnx serve --grpc-port``, a tritonclient.grpc user) protobuf
    refuses the second one, so the check then runs in a fresh interpreter."""
    try:
        import kserve
    except ImportError as e:
        raise RuntimeError(f"checking a KServe manifest needs the kserve package ({e})") from None
    except TypeError as e:  # "Couldn't build proto file into descriptor pool: duplicate symbol ..."
        if "descriptor pool" not in str(e):
            raise
        return _check_in_subprocess(manifest)
    if manifest.get("apiVersion") != API_VERSION or manifest.get("kind") != KIND:
        raise ManifestError(f"expected apiVersion {API_VERSION} and kind {KIND}")
    service = _build("V1beta1InferenceService", manifest, "InferenceService")
    if service.spec is None or service.spec.predictor is None:
        raise ManifestError("InferenceService: spec.predictor is required")
    back = kserve.ApiClient().sanitize_for_serialization(service)
    lost = _lost(manifest, back, "InferenceService")
    if lost:
        raise ManifestError(f"{lost} does not survive a round trip through kserve's types")
    return back


def _check_in_subprocess(manifest: dict[str, Any]) -> dict[str, Any]:
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "attnx.deploy.kserve"], input=json.dumps(manifest),
                         capture_output=True, text=True, timeout=300)
    if run.returncode == 2:
        raise ManifestError(run.stderr.strip())
    if run.returncode != 0:
        tail = (run.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"checking the KServe manifest in a subprocess failed: {tail}")
    return json.loads(run.stdout)


def _lost(given: Any, back: Any, where: str) -> str | None:
    """The first place where ``given`` is not found in ``back`` (the types may add their defaults)."""
    if isinstance(given, dict):
        if not isinstance(back, dict):
            return where
        return next((w for k, v in given.items() if (w := _lost(v, back.get(k), f"{where}.{k}"))), None)
    if isinstance(given, list):
        if not isinstance(back, list) or len(back) != len(given):
            return where
        return next((w for i, v in enumerate(given) if (w := _lost(v, back[i], f"{where}[{i}]"))), None)
    return None if given == back else where


def kserve_problem() -> str | None:
    """Why a manifest cannot be checked here (None when it can)."""
    try:
        import kserve  # noqa: F401
    except ImportError as e:
        return f"the kserve package is not installed ({e})"
    except TypeError:  # installed; its protos clash with tritonclient's here (check_manifest copes)
        pass
    return None


def to_yaml(manifest: dict[str, Any]) -> str:
    """YAML text of the manifest (JSON, which is YAML too, where PyYAML is not installed)."""
    head = "# Written by attnx triton-repo: kubectl apply -f kserve.yaml\n"
    try:
        import yaml
    except ImportError:
        import json

        return head + json.dumps(manifest, indent=2) + "\n"
    return head + yaml.safe_dump(manifest, sort_keys=False)


def repository_service(options: KServeOptions, entry: str, *, gpu: bool, text_model: bool,
                       plugins: list[str]) -> dict[str, Any]:
    """The InferenceService for a repository whose entry model is ``entry``: a text model's needs an
    image with the tokenizers package; an engine (or GPU instances) gets one GPU unless told."""
    if text_model and not options.image:
        raise ManifestError("a text model's repository runs a Python-backend tokenizer that needs the tokenizers "
                            "package: build the repository's Dockerfile, push it, and pass --kserve-image")
    gpus = options.gpus if options.gpus is not None else int(gpu)
    return inference_service(options.name or service_name(entry), options.storage_uri, image=options.image,
                             gpus=gpus, plugins=plugins)


if __name__ == "__main__":  # the clean-interpreter check of check_manifest: JSON in, JSON out, exit 2 on refusal
    import json
    import sys

    try:
        print(json.dumps(check_manifest(json.load(sys.stdin))))
    except ManifestError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
