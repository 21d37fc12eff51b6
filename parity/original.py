"""The original model behind a pretrained export, and whether a parity check may compare with it.

:func:`plan_original` decides. The original (the Hugging Face folder named by ``attnx.config``'s
``source``, or ``attnx check --original DIR``) is compared only when the placed model still *is*
the original model:

1. the folder is there and attnx's safe reader accepts it (:func:`attnx.pretrained.read_folder`:
   a supported ``model_type``, only Transformer/Pooling/Normalize modules, no pickled code);
2. every pretrained weight of the export (``Host.pretrained_names`` of the folder loaded afresh with
   the same placement) equals the folder's, bit for bit (not fine-tuned, not another model);
3. the placed variant is at its neutral values: applying the variant's ``Placement.neutral`` (and
   ``neutral_fusion``; zero output projections for appended layers) to a copy of the model changes
   no parameter. A variant without neutral values (``Placement.exact`` false) never is.

Otherwise one line says why, and the export is compared with attnx's torch reference only.

:class:`OriginalRunner` is that model as a Polygraphy runner: transformers' own class for the
export's task (``AutoModel``: ``last_hidden_state``; ``AutoModelForCausalLM`` /
``AutoModelForSequenceClassification``: ``logits``) with its ``eager`` attention, positions derived
from the mask for a causal model (as ``generate`` does), or for sentence-transformers folders
``SentenceTransformer(folder)``: ``sentence_embedding`` from ``encode(texts)`` on the raw texts (its
own tokenisation, so a tokenizer that disagrees with the export's shows), ``last_hidden_state`` from
its transformer module on the export's token ids. Loaded offline, in fp32, on the CPU.
"""

from __future__ import annotations

import copy
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from attnx.contract import Role, TensorEntry
from attnx.parity.cases import ParityError


@dataclass
class OriginalPlan:
    """What :func:`plan_original` decided (``to_json`` goes into the report)."""

    source: str | None
    used: bool
    note: str  # one line: why the original is, or is not, compared
    library: str = ""
    neutral: bool | None = None

    def to_json(self) -> dict:
        return {"source": self.source, "used": self.used, "note": self.note, "library": self.library,
                "neutral": self.neutral}


def _host(model):
    return getattr(model, "model", model)  # WithAttentionOutputs wraps the host


def _neutralize(host) -> None:
    import torch

    from attnx.pretrained.placing import AppendedBlock, make_neutral

    for block in host.blocks:
        if isinstance(block, AppendedBlock):
            with torch.no_grad():
                block.attn.W_O.weight.zero_()
                block.attn.W_O.bias.zero_()
        else:
            make_neutral(block.spec, block.attn, block.fusion)


def _first_difference(a: dict, b: dict, keys) -> str | None:
    import torch

    for key in sorted(keys):
        if key not in a or key not in b or a[key].shape != b[key].shape or not torch.equal(a[key], b[key]):
            return key
    return None


def neutral_decision(model, fresh) -> tuple[bool, str]:
    """``(True, "")`` when ``model`` (an export's reference) still computes the folder's original model
    ``fresh`` (that folder loaded with the same placement), else ``(False, why)``: steps 2-3 of the
    module doc."""
    host = _host(model)
    spec = host.placement.check()
    state, fresh_state = host.state_dict(), fresh.state_dict()
    if set(state) != set(fresh_state):
        return False, "the export's model has other parameters than the folder's with this placement"
    changed = _first_difference(state, fresh_state, fresh.pretrained_names)
    if changed is not None:
        return False, f"its pretrained weights differ from the folder's ({changed}): fine-tuned, or another model"
    if host.placement.variant != "mha" or host.placement.append:
        from attnx.pretrained.placing import AppendedBlock

        # Appended layers are residual branches, neutral at a zero output projection whatever the
        # variant; only a variant that replaces a pretrained attention needs neutral values of its own.
        replaces = any(not isinstance(b, AppendedBlock) and b.variant != "mha" for b in host.blocks)
        if replaces and not spec.placement.exact:
            return False, f"{spec.name} has no neutral values: the placed model is not the original"
        probe = copy.deepcopy(host)
        _neutralize(probe)
        moved = _first_difference(state, probe.state_dict(), state)
        if moved is not None:
            return False, (f"the {spec.name} parameters are trained (not at their neutral values: {moved}), so the "
                           "original model no longer applies")
    return True, ""


def host_variant_moved(why: str) -> bool:
    """Whether :func:`neutral_decision`'s reason is the placed variant itself (trained or without
    neutral values), as opposed to another model's weights."""
    return "no neutral values" in why or "parameters are trained" in why


def plan_original(model, config: dict, override: str | os.PathLike | None = None) -> OriginalPlan:
    """Decide whether the check compares with the original (see the module doc). ``override``
    (``--original``) replaces the folder named in the metadata; a problem with it is an error, while a
    problem with the metadata's folder is a note."""
    from attnx import pretrained

    source = str(override) if override is not None else config.get("source")
    if not source:
        return OriginalPlan(None, False, "the export does not name the folder it came from: compared with attnx's "
                                         "torch reference only (pass --original DIR)")
    path = Path(source).expanduser()

    def skip(why: str) -> OriginalPlan:
        if override is not None:
            raise ParityError(f"--original {source}: {why}")
        return OriginalPlan(str(path), False, f"{why}: compared with attnx's torch reference only")

    if not path.is_dir():
        return skip(f"the source folder {path} is gone" if override is None else "no such folder")
    placement = _host(model).placement
    try:
        folder = pretrained.read_folder(path)
        host = _host(model)
        if folder.placement is not None:  # saved from a placed, trained model: that model is the original
            return _plan_trained(model, folder, path, skip)
        fresh = pretrained.load(folder, placement.variant, layers=placement.layers, append=placement.append,
                                options=placement.options, task=getattr(host, "task", None))
    except (OSError, ValueError, KeyError, TypeError) as e:
        return skip(f"the source folder {path} cannot be read ({' '.join(str(e).split())[:200]})")
    neutral, why = neutral_decision(model, fresh)
    del fresh
    if not neutral and override is not None and not host_variant_moved(why):
        # --original names another model (other weights or shapes): comparing with it cannot pass.
        raise ParityError(f"--original {source}: not the model this export was made from: {why}")
    if not neutral:
        return OriginalPlan(str(path), False, f"not compared with the original model in {path}: {why}", neutral=False)
    library = _library(folder)
    return OriginalPlan(str(path), True, f"compared with the original model ({library}) loaded from {path}",
                        library, neutral=True)


def _plan_trained(model, folder, path: Path, skip) -> OriginalPlan:
    """A folder saved by ``save_pretrained`` of a placed model: compare with that trained model (transformers'
    own model with the saved placement and weights) when the export's weights are its weights."""
    import torch

    from attnx import pretrained

    host = _host(model)
    trained = pretrained.load(folder, task=getattr(host, "task", None))
    mine, theirs = host.state_dict(), trained.state_dict()
    keys = set(theirs) - {f"hf.{n}" for n in getattr(trained.hf, "attnx_initialized", ())}
    if set(mine) != set(theirs) or any(not torch.equal(mine[k], theirs[k]) for k in keys):
        return skip(f"the export's weights are not those of the trained model saved in {path}")
    import transformers

    library = f"transformers {transformers.__version__} + its saved {trained.variant} placement"
    return OriginalPlan(str(path), True, f"compared with the trained model ({library}) loaded from {path}",
                        library, neutral=False)


def _library(folder) -> str:
    if folder.sentence_transformer is not None:
        import sentence_transformers

        return f"sentence-transformers {sentence_transformers.__version__}"
    import transformers

    return f"transformers {transformers.__version__}"


def _base_runner():
    from polygraphy.backend.base import BaseRunner

    return BaseRunner


class OriginalRunner(_base_runner()):
    """The original model as a Polygraphy runner (see the module doc). ``texts_of(input_ids)`` gives
    the texts of a batch (for ``SentenceTransformer.encode``)."""

    def __init__(self, source: str | os.PathLike, inputs: Sequence[TensorEntry], texts_of: Callable,
                 name: str = "original", task: str = "feature-extraction"):
        super().__init__(name=name, prefix="original-model")
        self.source = Path(source)
        self.task = task
        self.all_inputs = list(inputs)  # a trained placed model takes the context inputs too
        self.inputs = [e for e in inputs if e.role in (Role.INPUT_IDS, Role.ATTENTION_MASK, Role.TOKEN_TYPE_IDS)]
        self.placed = None
        self.ids_name = next(e.name for e in self.inputs if e.role == Role.INPUT_IDS)
        self.texts_of = texts_of
        self.st = self.hf = None
        self.derive_positions = False

    def activate_impl(self):
        if self.hf is None:
            self._load()

    def deactivate_impl(self):
        pass  # kept loaded between activations (one check activates it once per batch)

    def _load(self) -> None:
        import inspect

        import torch
        import transformers

        from attnx import pretrained
        from attnx.pretrained.host import TASKS

        folder = pretrained.read_folder(self.source)
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        if folder.placement is not None:  # the trained placed model itself (see _plan_trained)
            self.placed = self.hf = pretrained.load(folder, task=self.task)
            self.inputs = self.all_inputs
            return
        kwargs = {"local_files_only": True, "dtype": torch.float32, "trust_remote_code": False,
                  "attn_implementation": "eager"}
        if folder.sentence_transformer is not None and self.task == "feature-extraction":
            from sentence_transformers import SentenceTransformer

            self.st = SentenceTransformer(str(self.source), device="cpu", local_files_only=True,
                                          trust_remote_code=False, model_kwargs=kwargs)
            self.hf = self.st[0].auto_model.eval()
        elif folder.weights:
            self.hf = getattr(transformers, TASKS[self.task]).from_pretrained(str(self.source), **kwargs).eval()
        else:  # a GGUF-backed folder: transformers' model, each tensor read from the GGUF (attnx.pretrained.gguf)
            self.hf = pretrained.load_model(folder, self.task)
            self.hf.set_attn_implementation("eager")
        params = inspect.signature(self.hf.forward).parameters
        # a causal model's positions come from the mask, as transformers' generate gives them
        self.derive_positions = "position_ids" in params and any(getattr(m, "is_causal", False) is True
                                                                 for m in self.hf.modules())
        self.takes_token_types = "token_type_ids" in params

    def get_input_metadata_impl(self):
        from polygraphy.common import TensorMetadata

        meta = TensorMetadata()
        for e in self.inputs:
            meta.add(e.name, dtype=np.dtype(e.dtype), shape=[None] * len(e.shape))
        return meta

    def infer_impl(self, feed_dict):
        import torch

        from attnx.pretrained.host import positions_from_mask

        start = time.perf_counter()
        if self.placed is not None:
            with torch.no_grad():
                out = self.placed.forward_named({e.name: torch.from_numpy(np.ascontiguousarray(feed_dict[e.name]))
                                                 for e in self.inputs if e.name in feed_dict})
            self.inference_time = time.perf_counter() - start
            return OrderedDict((k, v.float().numpy() if v.is_floating_point() else v.numpy()) for k, v in out.items())
        by_role = {e.role: torch.from_numpy(np.ascontiguousarray(feed_dict[e.name])) for e in self.inputs}
        ids, mask = by_role[Role.INPUT_IDS], by_role.get(Role.ATTENTION_MASK)
        kwargs = {"input_ids": ids, "attention_mask": mask}
        if self.takes_token_types and Role.TOKEN_TYPE_IDS in by_role:
            kwargs["token_type_ids"] = by_role[Role.TOKEN_TYPE_IDS]
        if self.derive_positions and mask is not None:
            kwargs["position_ids"] = positions_from_mask(mask)
        out: OrderedDict[str, np.ndarray] = OrderedDict()
        with torch.no_grad():
            result = self.hf(**kwargs)
            if self.task == "feature-extraction":
                out["last_hidden_state"] = result.last_hidden_state.float().numpy()
            else:
                out["logits"] = result.logits.float().numpy()
            if self.st is not None:
                texts = self.texts_of(feed_dict[self.ids_name])
                out["sentence_embedding"] = np.asarray(
                    self.st.encode(list(texts), batch_size=len(texts), convert_to_numpy=True,
                                   show_progress_bar=False), dtype=np.float32)
        self.inference_time = time.perf_counter() - start
        return out
