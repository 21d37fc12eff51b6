"""Shared fixtures: cached small exports (exporting costs seconds; many tests share one file)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMALL = {"d_model": 32, "n_heads": 4}


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """``exported(variant, lowering="plugin", fp16=False, **overrides) -> ExportResult`` (cached per session)."""
    from attnx.export import export_variant

    cache = {}
    folder = tmp_path_factory.mktemp("exports")

    def get(variant: str, lowering: str = "plugin", fp16: bool = False, n_layers: int = 2, **overrides):
        opts = {**SMALL, **overrides}
        key = (variant, lowering, fp16, n_layers, tuple(sorted(opts.items())))
        if key not in cache:
            name = f"{variant}-{lowering}-{'fp16' if fp16 else 'fp32'}-{len(cache)}.onnx"
            cache[key] = export_variant(variant, folder / name, overrides=opts, n_layers=n_layers,
                                        lowering=lowering, fp16=fp16)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def minilm_export(tmp_path_factory):
    """``minilm_export(variant="mha", lowering="plugin", fp16=False, **kw) -> ExportResult``: the real
    all-MiniLM-L6-v2 with ``variant`` placed in it, exported once per session (each export takes ~10 s)."""
    from attnx.export.pretrained import export_pretrained
    from attnx.pretrained import minilm_path

    cache = {}
    folder = tmp_path_factory.mktemp("minilm")

    def get(variant: str = "mha", lowering: str = "plugin", fp16: bool = False, **kw):
        key = (variant, lowering, fp16, tuple(sorted((k, str(v)) for k, v in kw.items())))
        if key not in cache:
            name = f"minilm-{variant}-{lowering}-{'fp16' if fp16 else 'fp32'}-{len(cache)}.onnx"
            cache[key] = export_pretrained(minilm_path(), folder / name, variant=variant, lowering=lowering,
                                           fp16=fp16, **kw)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def plugin_lib() -> Path:
    """The built attnx plugin library (`make test` builds it first); built here only when missing,
    skipped when nvcc is not there to compile it."""
    from attnx import plugins

    path = plugins.library_path()
    if path is None:
        if plugins.find_nvcc() is None:
            pytest.skip("nvcc not found: the plugin library is not built and cannot be compiled here")
        path = plugins.build()
    return path


@pytest.fixture(scope="module")
def toy_registered():
    """The toy variant (tests/toy_variant.py) registered for the module that asks, and unregistered after."""
    import importlib
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    import toy_variant

    from attnx.models.spec import unregister, variant_names

    if "toy" not in variant_names():
        importlib.reload(toy_variant)
    yield
    unregister("toy")
