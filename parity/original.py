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

:class:`OriginalRunner` is that model as a Polygraphy runner: ``transformers``' ``BertModel``
(``last_hidden_state``) or ``GPT2LMHeadModel`` (``logits``), or for sentence-transformers folders
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

    from attnx.pretrained.host import AppendedBlock, make_neutral

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
        from attnx.pretrained.host import AppendedBlock

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
        fresh = pretrained.load(folder, placement.variant, layers=placement.layers, append=placement.append,
                                options=placement.options)
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
                 name: str = "original"):
        super().__init__(name=name, prefix="original-model")
        self.source = Path(source)
        self.inputs = [e for e in inputs if e.role in (Role.INPUT_IDS, Role.ATTENTION_MASK, Role.TOKEN_TYPE_IDS)]
        self.ids_name = next(e.name for e in self.inputs if e.role == Role.INPUT_IDS)
        self.texts_of = texts_of
        self.st = self.hf = None

    def activate_impl(self):
        if self.hf is None:
            self._load()

    def deactivate_impl(self):
        pass  # kept loaded between activations (one check activates it once per batch)

    def _load(self) -> None:
        import torch
        import transformers

        from attnx import pretrained

        folder = pretrained.read_folder(self.source)
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        kwargs = {"local_files_only": True, "dtype": torch.float32}
        if folder.sentence_transformer is not None:
            from sentence_transformers import SentenceTransformer

            self.st = SentenceTransformer(str(self.source), device="cpu", local_files_only=True,
                                          trust_remote_code=False, model_kwargs={"dtype": torch.float32})
            self.hf = self.st[0].auto_model.eval()
        elif folder.model_type == "gpt2":
            self.hf = transformers.GPT2LMHeadModel.from_pretrained(str(self.source), **kwargs).eval()
        else:
            self.hf = transformers.BertModel.from_pretrained(str(self.source), add_pooling_layer=False,
                                                             **kwargs).eval()

    def get_input_metadata_impl(self):
        from polygraphy.common import TensorMetadata

        meta = TensorMetadata()
        for e in self.inputs:
            meta.add(e.name, dtype=np.dtype(e.dtype), shape=[None, None])
        return meta

    def infer_impl(self, feed_dict):
        import torch

        start = time.perf_counter()
        by_role = {e.role: torch.from_numpy(np.ascontiguousarray(feed_dict[e.name])) for e in self.inputs}
        ids, mask = by_role[Role.INPUT_IDS], by_role.get(Role.ATTENTION_MASK)
        out: OrderedDict[str, np.ndarray] = OrderedDict()
        with torch.no_grad():
            if isinstance(self.hf, _gpt2_class()):
                out["logits"] = self.hf(input_ids=ids, attention_mask=mask).logits.float().numpy()
            else:
                hidden = self.hf(input_ids=ids, attention_mask=mask, token_type_ids=by_role.get(Role.TOKEN_TYPE_IDS))
                out["last_hidden_state"] = hidden.last_hidden_state.float().numpy()
            if self.st is not None:
                texts = self.texts_of(feed_dict[self.ids_name])
                out["sentence_embedding"] = np.asarray(
                    self.st.encode(list(texts), batch_size=len(texts), convert_to_numpy=True,
                                   show_progress_bar=False), dtype=np.float32)
        self.inference_time = time.perf_counter() - start
        return out


def _gpt2_class():
    import transformers

    return transformers.GPT2LMHeadModel
