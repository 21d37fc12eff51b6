"""The exporter's model contract, declared (:mod:`attnx.export.protocol`, issue 47 item 5).

attnx's encoders and the pretrained hosts are :class:`Exportable`; a host made to carry its KV cache is a
:class:`CachedExportable`; anything else is refused in one line naming what it lacks, before any trace.
"""

from __future__ import annotations

import pytest
import torch

from attnx.export.protocol import CachedExportable, Exportable, check_exportable, is_cached
from attnx.models.build import build_encoder
from tests.hf_folders import make_folder


def test_the_models_attnx_exports_satisfy_the_protocols(tmp_path):
    import attnx.pretrained as pretrained
    from attnx.pretrained.cached import CachedHost

    encoder = build_encoder("mha", d_model=32, n_heads=2, n_layers=1)
    assert isinstance(encoder, Exportable) and not is_cached(encoder)
    check_exportable(encoder)
    host = pretrained.load(make_folder("llama", tmp_path / "src"), "mha")
    assert isinstance(host, Exportable) and not is_cached(host)
    cached = CachedHost.of(host)
    assert isinstance(cached, CachedExportable) and is_cached(cached)
    check_exportable(cached)


class _Plain(torch.nn.Module):
    variant = "mha"

    def input_specs(self):
        return []

    def output_specs(self):
        return []


class _HalfCached(_Plain):
    def config_dict(self):
        return {}

    def forward_named(self, inputs):
        return {}

    def cache_metadata(self):
        return {}


def test_a_model_without_the_signature_is_refused_in_one_line(tmp_path):
    from attnx.export import export_encoder

    with pytest.raises(TypeError) as err:
        export_encoder(_Plain(), tmp_path / "m.onnx")
    message = str(err.value)
    assert "cannot export _Plain: it lacks config_dict, forward_named" in message and "\n" not in message
    assert not (tmp_path / "m.onnx").exists()
    with pytest.raises(TypeError, match="lacks parameters"):
        check_exportable(type("NotAModule", (), {n: None for n in ("variant", "input_specs", "output_specs",
                                                                      "config_dict", "forward_named")})())
    with pytest.raises(TypeError, match="has cache_metadata but lacks example_inputs, export_dims, input_defaults"):
        check_exportable(_HalfCached())
