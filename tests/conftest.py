"""Shared fixtures: cached small exports (exporting costs seconds; many tests share one file)."""

from __future__ import annotations

import os

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
