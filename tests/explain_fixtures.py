"""Helpers shared by the ``test_explain*`` files (imported by them; pytest does not collect it).

Exporting the real all-MiniLM-L6-v2 takes ~30 s here, so each export is made once per test run
and shared by every file that asks for it (:func:`minilm_export`).
"""

from __future__ import annotations

import os

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from attnx.pretrained import minilm_path  # noqa: E402

MINILM = minilm_path()
_EXPORTS: dict = {}


def minilm_export(tmp_path_factory, variant: str = "mha", *, randomize: bool = False, **kw):
    """The real MiniLM exported with every layer's attention output and a head mask (cached per run).

    ``randomize``: the placed variant's own parameters get seeded random values (a trained variant
    stands in), so its context inputs change the model."""
    key = (variant, randomize, repr(sorted(kw.items())))
    if key not in _EXPORTS:
        from attnx.export import export_encoder
        from attnx.export.pretrained import export_pretrained

        folder = tmp_path_factory.mktemp(f"minilm-{variant}")
        path = folder / f"minilm-{variant}.onnx"
        result = export_pretrained(MINILM, path, variant=variant, attention_outputs="all", head_mask=True, **kw)
        if randomize:
            host = randomize_variant(result.model.model)
            result = export_encoder(host, path, attention_outputs="all", head_mask=True, profiles=result.info.profiles,
                                    tokenizer=result.info.tokenizer)
        _EXPORTS[key] = result
    return _EXPORTS[key]


def randomize_variant(host, seed: int = 3, scale: float = 0.5):
    """Give a placed variant's own parameters seeded random values of unit-preserving scale."""
    g = torch.Generator().manual_seed(seed)
    state = host.state_dict()
    with torch.no_grad():
        for name in host.variant_parameter_names():
            t = state[name]
            std = scale / (t.shape[-1] ** 0.5 if t.dim() >= 2 else 1.0)
            t.copy_(torch.randn(t.shape, generator=g) * std)
    return host


def ablate_columns(linear: torch.nn.Linear, head: int, head_dim: int) -> None:
    """Zero the input columns of an attention output projection that head ``head`` feeds: the head's
    output no longer reaches the model (transformers 5 has no ``head_mask`` argument)."""
    with torch.no_grad():
        linear.weight[:, head * head_dim:(head + 1) * head_dim] = 0


def ort_session(path):
    """The session a served model runs (attnx.runtime's settings), so served and direct results agree
    to the bit rather than to ORT's per-fusion rounding."""
    from attnx.runtime.core.backends.onnxrt import OrtOptions

    return OrtOptions(device="cpu").inference_session(path)


def ort_run(path, feeds: dict, outputs=None) -> dict[str, np.ndarray]:
    sess = ort_session(path)
    names = outputs or [o.name for o in sess.get_outputs()]
    np_feeds = {i.name: np.asarray(feeds[i.name].numpy() if hasattr(feeds[i.name], "numpy") else feeds[i.name])
                for i in sess.get_inputs() if i.name in feeds}
    return dict(zip(names, sess.run(names, np_feeds)))
