"""A placed decoder that generates: the with-past signature, one forward for prefill and decode.

    host = attnx.pretrained.load(folder, "smal")          # a causal LM with smal placed in it
    cached = CachedHost.of(host)                          # the same model (its weights), cache in/out
    out = cached.forward_named({"input_ids": ids, "attention_mask": mask, "position_ids": pos,
                                **past, "self_state": s, "trace": T})
    out["logits"], out["present.0.key"], ...

Inputs (the names Optimum and onnxruntime-genai use): ``input_ids [batch, seq]`` (the new tokens),
``attention_mask [batch, total]`` (past + new: 1 = token, 0 = padding or an unused cache slot),
``position_ids [batch, seq]`` (where the family takes positions), ``past_key_values.{i}.key|value
[batch, kv_heads, past, head_dim]`` for each layer, then each variant's cached state
(``past_key_values.{i}.<name>``, :mod:`attnx.models.cache`), then the context inputs, and last
``logits_to_keep [keep]`` (int64: which new positions get logits, transformers' tensor form of its
``logits_to_keep``; negative counts from the end). Outputs: ``logits`` (``[batch, keep, vocab]``, declared
``[batch, 1, vocab]``: the default's shape, which onnxruntime-genai sizes its buffer from), ``present.{i}.*``
(past + new, the same layout) and the variants' extra outputs.

``logits_to_keep`` has a default in the file: an initializer of the same name holding ``[-1]`` (ONNX's
overridable initializer, :meth:`CachedHost.input_defaults`), so a caller that does not feed it (ONNX Runtime,
onnxruntime-genai, attnx's own decode loop) gets the last new position's logits only, as before the input
existed: a prefill never runs the LM head on the whole prompt (transformers' ``logits_to_keep=1``), and the
file's required inputs (``attnx.inputs``, ONNX Runtime's ``get_inputs``) are unchanged. Prompt logprobs feed
it (every new position of a prefill chunk: :meth:`attnx.runtime.core.decoding.Decoder.prompt_logprobs`);
``attnx.cache`` names it (``logits_to_keep``). A TensorRT engine takes the initializer as a constant (the last
position); ONNX Runtime warns when fed logits differ from the declared shape (attnx's decoder sessions run
with its warnings off). Layers appended after the last one (maw's own form) cache their own k/v as layers
``n_layers ...``. ``past`` may be 0 on ONNX Runtime; attnx's own generation keeps one masked slot
(``attention_mask`` 0 there) so no tensor is ever empty, which TensorRT profiles need.

transformers' own attention modules update the cache (a :class:`PastCache` over the given tensors:
full-length layers, sliding windows are applied by the mask) and call attnx's attention backend on
the new tokens' q and every cached k/v; :class:`CachedState` carries each layer's variant state
through the forward (``mask.cache``) and runs appended layers on their cache.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from attnx.contract import BATCH, PAST, SEQ, TOTAL, Role
from attnx.models.attention import Mask, mask_bias, merge_heads
from attnx.models.cache import LayerCache, cache_entries
from attnx.models.signature import InputSpec, OutputSpec, check_inputs, example_tensor
from attnx.pretrained import backend
from attnx.pretrained.host import Host, positions_from_mask

#: The input choosing which new positions get logits, and its dim (module docstring).
LOGITS_TO_KEEP = "logits_to_keep"
KEEP = "keep"


def _cache_base():
    from transformers.cache_utils import DynamicCache, DynamicLayer

    return DynamicCache, DynamicLayer


class PastCache:
    """transformers' ``DynamicCache`` holding the given past tensors (built lazily: transformers is imported
    only when a cached forward runs). Its layers report their length from the tensors' shape (no
    "is it empty" test, which would be a data-dependent branch in an exported graph)."""

    def __new__(cls, pairs: list[tuple[torch.Tensor, torch.Tensor]]):
        DynamicCache, DynamicLayer = _cache_base()

        class _Layer(DynamicLayer):
            def get_seq_length(self) -> int:
                return self.keys.shape[-2]

        cache = DynamicCache()
        for k, v in pairs:
            layer = _Layer()
            layer.dtype, layer.device = k.dtype, k.device
            layer.keys, layer.values, layer.is_initialized = k, v, True
            cache.layers.append(layer)
        return cache


class CachedState:
    """One cached forward's state besides transformers' k/v: a :class:`LayerCache` per layer (what the
    variant declared; appended layers' k/v too), read by the attention backend and the appended layers."""

    def __init__(self, past: dict[int, dict[str, torch.Tensor]]):
        self.layers = {i: LayerCache(p) for i, p in past.items()}

    def layer(self, index: int) -> LayerCache:
        return self.layers.setdefault(index, LayerCache())

    def run_appended(self, block, index: int, y: torch.Tensor, tokens: torch.Tensor | None, head_mask, ctx):
        """An appended layer (``y = x + Attn(LN(x))``) on the new tokens, its k/v joining its cache."""
        cache = self.layer(index)
        attn = block.attn
        x = block.hook_resid_pre(y)
        h = block.ln(x)
        q, k, v = attn.project(h)
        k = cache.append("key", k, axis=2)
        v = cache.append("value", v, axis=2)
        bias, row_valid = mask_bias(tokens, q.shape[2], k.shape[2], q.dtype, attn.config.is_causal, device=q.device)
        z = attn.core(q, k, v, Mask(bias, row_valid, tokens, h, cache=cache), head_mask, **ctx)
        return block.hook_resid_post(x + block.hook_attn_out(attn.W_O(merge_heads(z))))


class CachedHost(Host):
    """A placed causal LM (:class:`~attnx.pretrained.host.Host`, the same weights and names) whose
    export signature carries the KV cache (module docstring)."""

    #: Whether the signature has the ``logits_to_keep`` input (off: the file of attnx before it, for comparisons).
    keeps_logits: bool = True

    @classmethod
    def of(cls, host: Host, keeps_logits: bool = True) -> "CachedHost":
        if host.task != "causal-lm":
            raise ValueError(f"a KV cache belongs to a causal LM (a decoder that generates); this model's task is "
                             f"{host.task}")
        out = cls(host.hf, host.task, host.st, host.source, host.max_length)
        out.keeps_logits = keeps_logits
        return out.eval() if not host.training else out

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.task != "causal-lm":
            raise ValueError(f"a KV cache belongs to a causal LM; this model's task is {self.task}")

    # ---- the cache layout -------------------------------------------------------------------------
    def cache_layers(self) -> list[dict[str, Any]]:
        """Per cached layer: its index, what it holds and each tensor's shape (``past`` grows)."""
        out = []
        host_layers = len(self.hf.attnx_attention)
        for i, block in enumerate(self.blocks):
            attn = block.attn
            heads = attn.n_heads if i >= host_layers else int(getattr(attn, "kv_heads", attn.n_heads))
            kv = (BATCH, heads, PAST, attn.head_dim)
            tensors = [("key", kv, "keys"), ("value", kv, "values")]
            tensors += [(e.name, e.shape, e.doc) for e in cache_entries(attn)]
            out.append({"layer": i, "appended": i >= host_layers, "variant": block.variant,
                        "tensors": [{"name": n, "shape": list(s), "doc": d} for n, s, d in tensors]})
        return out

    def cache_specs(self) -> list[tuple[InputSpec, OutputSpec, int | None]]:
        """``(past input, present output, grown axis)`` for every cached tensor."""
        specs = []
        for layer in self.cache_layers():
            i = layer["layer"]
            for t in layer["tensors"]:
                shape = tuple(t["shape"])
                axis = shape.index(PAST) if PAST in shape else None
                present = tuple(TOTAL if d == PAST else d for d in shape)
                specs.append((InputSpec(f"past_key_values.{i}.{t['name']}", shape, "float", Role.PAST,
                                        f"layer {i}: cached {t['doc']}", default="zeros"),
                              OutputSpec(f"present.{i}.{t['name']}", present, "float", Role.PRESENT,
                                         f"layer {i}: {t['doc']}, past + new"), axis))
        return specs

    # ---- the signature ----------------------------------------------------------------------------
    def base_input_specs(self) -> list[InputSpec]:
        specs = [InputSpec("input_ids", (BATCH, SEQ), "int64", Role.INPUT_IDS, "the new tokens' ids",
                           range=(0, self.vocab_size)),
                 InputSpec("attention_mask", (BATCH, TOTAL), "mask", Role.ATTENTION_MASK,
                           "past + new: 1 = token, 0 = padding or an unused cache slot")]
        if self.derive_positions:
            specs.append(InputSpec("position_ids", (BATCH, SEQ), "int64", Role.POSITION_IDS,
                                   "each new token's position among the real tokens", range=(0, self.max_seq)))
        return specs + [past for past, _, _ in self.cache_specs()]

    def input_defaults(self) -> list[tuple[InputSpec, torch.Tensor]]:
        """Inputs after :meth:`input_specs` that the file gives a default (the exporter writes each value as an
        initializer of the input's name): a caller that leaves one out gets today's last-position logits."""
        if not self.keeps_logits:
            return []
        spec = InputSpec(LOGITS_TO_KEEP, (KEEP,), "int64", LOGITS_TO_KEEP, "which new positions get logits (indices "
                         "into the new tokens, negative from the end); default [-1]: the last one")
        return [(spec, torch.tensor([-1], dtype=torch.int64))]

    def base_output_specs(self) -> list[OutputSpec]:
        # [batch, 1, vocab] as declared, the default's shape: onnxruntime-genai sizes its logits from that 1
        # (a dynamic dim reads to it as one row per new token); fed, logits_to_keep gives [batch, keep, vocab]
        return [OutputSpec("logits", (BATCH, 1, self.vocab_size), "float", Role.OUTPUT,
                           "next-token logits at the last new position (at those logits_to_keep names when fed)")] + \
            [p for _, p, _ in self.cache_specs()]

    def empty_cache(self, batch: int, slots: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
        """The past before any token: ``slots`` zero positions per layer (masked out by the caller)."""
        out = {}
        for past, _, axis in self.cache_specs():
            dims = [batch if d == BATCH else slots if d == PAST else int(d) for d in past.shape]
            out[past.name] = torch.zeros(dims, dtype=dtype)
        return out

    def example_inputs(self, batch: int = 2, seq: int = 3, past: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
        """Unit-scale example inputs for tracing: a cache of ``past`` positions, the last row left-padded."""
        g = torch.Generator().manual_seed(seed)
        dims = {BATCH: batch, SEQ: seq, PAST: past, TOTAL: past + seq}
        feeds = {s.name: example_tensor(s, dims, g) for s in self.input_specs()}
        mask = torch.ones(batch, past + seq, dtype=torch.int64)
        mask[-1, :2] = 0
        feeds["attention_mask"] = mask
        if "position_ids" in feeds:
            feeds["position_ids"] = positions_from_mask(mask)[:, past:].contiguous()
        if self.keeps_logits:  # two positions, one counted from the end (one would fix the dim at 1 in a trace)
            feeds[LOGITS_TO_KEEP] = torch.tensor([0, -1], dtype=torch.int64)
        return feeds

    def export_dims(self) -> dict:
        """Every dim dynamic without stated bounds: ``total >= past + seq`` relates three dims, which no
        ``torch.export.Dim`` can state (it is checked here, in :meth:`forward_named`, and by the runtimes)."""
        return {d: torch.export.Dim.DYNAMIC for d in (BATCH, SEQ, PAST, TOTAL, KEEP)}

    #: ``torch.export`` options (:func:`attnx.export.exporter._trace`): guards between the cache's dims become
    #: runtime asserts, which the ONNX exporter drops, instead of a guard function it cannot translate.
    trace_options = {"prefer_deferred_runtime_asserts_over_guards": True}

    # ---- the forward ------------------------------------------------------------------------------
    def forward_named(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        specs = self.cache_specs()
        defaults = [spec for spec, _ in self.input_defaults()]
        base = {s.name for s in [*self.base_input_specs(), *defaults]}
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        keep = inputs.get(LOGITS_TO_KEEP)
        if not torch.compiler.is_exporting():
            check_inputs(self.input_specs() + defaults, inputs, optional=("position_ids", LOGITS_TO_KEEP))
            if keep is not None and keep.numel() and not -ids.shape[1] <= int(keep.min()) <= int(keep.max()) < \
                    ids.shape[1]:
                raise ValueError(f"{LOGITS_TO_KEEP} must index the {ids.shape[1]} new tokens (in [-{ids.shape[1]}, "
                                 f"{ids.shape[1]})), got {keep.tolist()}")
            if mask.shape[1] < ids.shape[1]:
                raise ValueError(f"attention_mask covers {mask.shape[1]} positions, fewer than the {ids.shape[1]} new "
                                 "tokens: it must cover the cached ones and the new ones")
            if mask.shape[1] > self.max_seq + 1:
                raise ValueError(f"past + new tokens ({mask.shape[1]}) exceed the model's {self.max_seq} positions")
        context = {k: v for k, v in inputs.items() if k not in base}
        host_layers = len(self.hf.attnx_attention)
        pairs, states = [], {}
        for past, _, _ in specs:
            i, name = _split(past.name)
            if i < host_layers and name in ("key", "value"):
                continue
            states.setdefault(i, {})[name] = inputs[past.name]
        for i in range(host_layers):
            pairs.append((inputs[f"past_key_values.{i}.key"], inputs[f"past_key_values.{i}.value"]))
        cache = PastCache(pairs)
        kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "past_key_values": cache, "use_cache": True}
        if self.derive_positions:
            positions = inputs.get("position_ids")
            kwargs["position_ids"] = positions if positions is not None else \
                positions_from_mask(mask)[:, mask.shape[1] - ids.shape[1]:]
        takes = "logits_to_keep" in inspect.signature(self.hf.forward).parameters
        if keep is None:  # the last position only (the LM head never runs on the whole prompt)
            if takes:
                kwargs["logits_to_keep"] = 1
        else:  # indices counted from the start: a Gather every backend takes (TensorRT included)
            keep = torch.where(keep < 0, keep + ids.shape[1], keep)
            if takes:
                kwargs["logits_to_keep"] = keep
        state = CachedState(states)
        with backend.calling(backend.Call(context=context, tokens=mask, cache=state)):
            result = self.hf(**kwargs)
        if keep is None:
            logits = result.logits[:, -1:]
        else:
            logits = result.logits if takes else result.logits.index_select(1, keep)
        out = {"logits": logits}
        for i, layer in enumerate(cache.layers[:host_layers]):
            out[f"present.{i}.key"], out[f"present.{i}.value"] = layer.keys, layer.values
        for _, present, _ in specs:
            if present.name in out:
                continue
            i, name = _split(present.name)
            value = state.layer(i).present.get(name)
            if value is None:
                raise RuntimeError(f"layer {i} did not update its cached {name!r} (its attention never ran?)")
            out[present.name] = value
        blocks = self.blocks
        out.update({spec.name: spec.read(blocks[i].attn) for spec, i in self.extra_outputs()})
        return out

    # ---- metadata ---------------------------------------------------------------------------------
    def config_dict(self) -> dict:
        return {**super().config_dict(), "with_past": True}

    def cache_metadata(self) -> dict:
        """``attnx.cache``: what a generation loop needs to drive the file."""
        cfg = self.hf.config
        gen = getattr(self.hf, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        eos = cfg.eos_token_id if eos is None else eos
        eos_ids = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None]
        bos = getattr(gen, "bos_token_id", None) if gen is not None else None
        bos = getattr(cfg, "bos_token_id", None) if bos is None else bos
        entries = []
        for past, present, axis in self.cache_specs():
            i, name = _split(past.name)
            entries.append({"layer": i, "name": name, "input": past.name, "output": present.name, "axis": axis,
                            "shape": list(past.shape)})
        variants = sorted({layer["variant"] for layer in self.cache_layers()})
        out = {"layers": len(self.blocks), "host_layers": len(self.hf.attnx_attention), "entries": entries,
               "position_ids": self.derive_positions, "max_positions": int(self.max_seq),
               "eos_token_id": eos_ids, "bos_token_id": None if bos is None else int(bos),
               "semantics": {v: cache_semantics(v) for v in variants}}
        if self.keeps_logits:  # the input that chooses the positions with logits (its default: the last)
            out["logits_to_keep"] = LOGITS_TO_KEEP
        return out


def _split(name: str) -> tuple[int, str]:
    """``past_key_values.3.key`` / ``present.3.key`` -> ``(3, "key")``."""
    parts = name.split(".")
    return int(parts[1]), ".".join(parts[2:])


def cache_semantics(variant: str) -> str:
    """What the variant caches and how exact its cached step is (``VariantSpec.cache_note``)."""
    from attnx.models.spec import get_spec

    return get_spec(variant).cache_summary()


__all__ = ["KEEP", "LOGITS_TO_KEEP", "CachedHost", "CachedState", "PastCache", "cache_semantics"]
