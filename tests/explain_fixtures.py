"""Helpers shared by the ``test_explain*`` files (imported by them; pytest does not collect it).

The MiniLM exports explaining needs (every layer's attention output and a head mask) come from the
export cache of ``tests/conftest.py``, so each is made once for every file, worker and run.
"""

from __future__ import annotations

import os

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from attnx.pretrained import minilm_path  # noqa: E402
from support import cache, exports  # noqa: E402

MINILM = minilm_path()


def explained_minilm(variant: str = "mha", *, randomize: bool = False, **kw) -> cache.CachedExport:
    """The real MiniLM exported with every layer's attention output and a head mask.

    ``randomize``: the placed variant's own parameters get seeded random values (a trained variant
    stands in), so its context inputs change the model."""
    result = exports.minilm(variant, attention_outputs="all", head_mask=True, **kw)
    if not randomize:
        return result

    def make(out):
        from attnx.export import export_encoder

        host = randomize_variant(result.model.model)
        try:
            export_encoder(host, out, attention_outputs="all", head_mask=True, profiles=result.info.profiles,
                           tokenizer=result.info.tokenizer)
        finally:
            result.__dict__.pop("model", None)  # the shared reference was randomised: rebuild it on next use
        import shutil

        tok = result.info.tokenizer.dir
        shutil.copytree(result.path.parent / tok, out.parent / tok)

    return exports.cached(cache.entry(f"minilm-{variant}.onnx", make, kind="randomized", source=str(result.path),
                               variant=variant, options=kw))


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
