"""``attnx check`` on a with-past export whose fp32 reference would not fit in memory: transformers' own layers,
one at a time.

:func:`run_generation_check <attnx.parity.generation.run_generation_check>` holds the export's fp32 PyTorch reference
and transformers' fp32 model at once: 8 bytes a parameter, 64 GB for an 8B model, whose int4 export is 5 GB. When
that would not fit the memory available (or ``ATTNX_CHECK_LAYERWISE=1`` asks for it), the check runs instead:

- ONNX Runtime on the file, through the runtime's own :class:`~attnx.runtime.core.decoding.Decoder`: each text's
  prompt prefilled, the rows merged into one left-padded batch, ``steps`` greedy steps (its own tokens);
- the original, transformers' model of the source folder's architecture built on the ``meta`` device, its decoder
  layers materialised **one at a time** in fp32 from the folder's safetensors (memory-mapped), each applied to every
  sequence (prompt + the tokens ONNX Runtime chose, no cache) before the next is read, then the final norm and
  the head in slices of the vocabulary: at most one layer, the embedding rows used and a slice of the head in fp32.

Compared: the logits at every generated position (bounded for an fp32 export, reported for a weight-only one),
the greedy tokens (the original's choice at each step of the runtime's path: all equal means the original's own
greedy generation is the same text), and for a weight-only export the perplexity on the built-in sentences
against the original's (:data:`~attnx.parity.generation.PERPLEXITY_LIMITS`). Not compared: the cached tensors
(``present.*``; the original runs without a cache) and the export's own PyTorch reference. Plain-attention
exports (``mha``) of the families whose model is embedding -> layers -> norm -> head only (:data:`FAMILIES`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from attnx.contract import ModelInfo
from attnx.parity.cases import ParityError

#: Architectures whose forward is exactly embedding -> decoder layers -> final norm -> head (no embedding scale,
#: no per-layer mask kinds), so running their layers one by one is their model.
FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
#: Vocabulary rows of the head made fp32 at once.
HEAD_SLICE = 16384


def reference_bytes(info: ModelInfo) -> int | None:
    """Bytes the full check holds in fp32 (the export's reference and transformers' model: 8 per parameter)."""
    folder = _source(info)
    if folder is None:
        return None
    from attnx.pretrained import read_folder
    from attnx.pretrained.folder import weight_numel

    try:
        return 8 * sum(weight_numel(read_folder(folder).weights).values())
    except (OSError, ValueError):
        return None


def available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def layerwise_reason(info: ModelInfo) -> str | None:
    """Why a with-past export is checked layer by layer (it would not fit, or ``ATTNX_CHECK_LAYERWISE=1``); None:
    the full check fits."""
    if os.environ.get("ATTNX_CHECK_LAYERWISE") == "1":
        return "ATTNX_CHECK_LAYERWISE=1"
    need, available = reference_bytes(info), available_memory()
    if need is None or available is None or need <= 0.8 * available:
        return None
    return (f"the full check holds the fp32 reference and transformers' fp32 model ({need / 1e9:.1f} GB), more than "
            f"the {available / 1e9:.1f} GB available")


def _source(info: ModelInfo) -> Path | None:
    source = (info.reference or {}).get("source") or (info.config or {}).get("source")
    return Path(source) if source and Path(source).is_dir() else None


class LayerwiseOriginal:
    """transformers' model of ``folder`` run one decoder layer at a time (module docstring)."""

    def __init__(self, folder: Path):
        import torch
        import transformers
        from safetensors import safe_open

        from attnx.pretrained import read_folder

        hf_folder = read_folder(folder)
        if not hf_folder.weights or any(w.suffix != ".safetensors" for w in hf_folder.weights):
            raise ParityError(f"{folder}: the layer-by-layer check reads safetensors weights; this folder has "
                              f"{', '.join(w.name for w in hf_folder.weights) or 'none'}")
        self.config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
        arch = (self.config.architectures or ["?"])[0]
        if arch not in FAMILIES:
            raise ParityError(f"{folder} holds a {arch}; the layer-by-layer check runs {', '.join(FAMILIES)} (their "
                              "model is its layers in sequence), and the full check would not fit here")
        self.config._attn_implementation = "eager"
        with torch.device("meta"):
            self.model = transformers.AutoModelForCausalLM.from_config(self.config, dtype=torch.float32)
        self.rotary = type(self.model.model.rotary_emb)(config=self.config)  # its buffers, on the CPU
        self._files = {}
        for file in hf_folder.weights:
            handle = safe_open(str(file), framework="pt")
            for name in handle.keys():
                self._files[name] = handle
        self.tied = bool(getattr(self.config, "tie_word_embeddings", False)) or "lm_head.weight" not in self._files

    def _tensor(self, name: str):
        if name not in self._files:
            raise ParityError(f"the source folder has no tensor {name!r}: the layer-by-layer check cannot run")
        return self._files[name].get_tensor(name)

    def _materialise(self, module, prefix: str) -> None:
        import torch

        state = {k: self._tensor(prefix + k).to(torch.float32) for k in module.state_dict()}
        module.load_state_dict(state, strict=True, assign=True)

    def logits(self, sequences: Sequence[Sequence[int]], progress=None) -> list[np.ndarray]:
        """Each sequence's logits at every position ``[len, vocab]`` (float32), no cache."""
        import torch

        with torch.no_grad():
            embedding = self._tensor("model.embed_tokens.weight")  # memory-mapped; only the rows used become fp32
            hidden = [embedding[torch.tensor(list(s))].to(torch.float32)[None] for s in sequences]
            rope, masks = [], []
            for h in hidden:
                n = h.shape[1]
                positions = torch.arange(n)[None]
                rope.append((positions, self.rotary(h, positions)))
                masks.append(torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None])
            for i, layer in enumerate(self.model.model.layers):
                self._materialise(layer, f"model.layers.{i}.")
                for k, h in enumerate(hidden):
                    out = layer(h, attention_mask=masks[k], position_ids=rope[k][0], position_embeddings=rope[k][1])
                    hidden[k] = out[0] if isinstance(out, tuple) else out
                layer.to("meta")  # its fp32 weights go before the next layer's are read
                if progress is not None:
                    progress(i)
            norm = self.model.model.norm
            self._materialise(norm, "model.norm.")
            hidden = [norm(h)[0] for h in hidden]
            head = self._tensor("model.embed_tokens.weight" if self.tied else "lm_head.weight")
            out = [np.empty((h.shape[0], head.shape[0]), np.float32) for h in hidden]
            for start in range(0, head.shape[0], HEAD_SLICE):
                rows = head[start:start + HEAD_SLICE].to(torch.float32)
                for k, h in enumerate(hidden):
                    out[k][:, start:start + HEAD_SLICE] = (h @ rows.T).numpy()
        return out


def run_layerwise_check(model_path: Path, info: ModelInfo, reason: str, *, texts: Sequence[str] | None = None,
                        original: str | os.PathLike | None = None, progress=None, steps: int | None = None):
    """Check a with-past export against transformers' layers run one at a time (module docstring); a
    :class:`~attnx.parity.generation.GenerationReport`."""
    from attnx.parity.generation import (BOUNDS, DEFAULT_STEPS, PERPLEXITY_LIMITS, TIE, GenerationReport, _close,
                                         _drive, _nll)
    from attnx.parity.text_cases import default_texts
    from attnx.pretrained.sentences import SENTENCES
    from attnx.runtime.core.decoding import Decoder
    from attnx.runtime.core.loading import load
    from attnx.runtime.core.text import TextTokenizer

    started = time.monotonic()
    step = progress or (lambda name: None)
    steps = steps or DEFAULT_STEPS
    placement = (info.config or {}).get("placement") or {}
    if info.variant not in (None, "mha") or placement.get("variant") not in (None, "mha"):
        raise ParityError(f"{model_path.name} places {info.variant}: the layer-by-layer check runs transformers' own "
                          f"layers (plain attention) only, and the full check would not fit ({reason})")
    folder = Path(original) if original is not None else _source(info)
    if folder is None:
        raise ParityError(f"{model_path.name}: the folder it was exported from is not there: pass it with --original")
    weight_only = info.precision in PERPLEXITY_LIMITS
    precision = info.precision if info.precision in BOUNDS or weight_only else "fp32"
    bounds = (np.inf, 0.0) if weight_only else BOUNDS[precision]
    tie = TIE["int8"] if weight_only else TIE[precision]
    tokenizer = TextTokenizer.from_export(model_path, info)
    if tokenizer is None:
        raise ParityError(f"{model_path.name} names no tokenizer (attnx.tokenizer): re-export it")
    texts = list(texts) if texts else default_texts()[:4]
    positions = info.cache.get("max_positions") or None
    prompts = []
    for text in texts:
        ids = [int(t) for t in tokenizer.tokenize([text])[0].ids]
        prompts.append(ids[:max(1, positions - steps - 1)] if positions else ids)
    sentences = [[int(t) for t in tokenizer.tokenize([s])[0].ids] for s in SENTENCES] if weight_only else []
    sentences = [ids[:positions] if positions else ids for ids in sentences]
    sentences = [ids for ids in sentences if len(ids) >= 2]

    step("run")
    name = f"onnxrt-{info.lowering}"
    decoder = Decoder(load(model_path, device="cpu"))
    got_steps, _, fed = _drive(decoder, prompts, None, steps)
    got_nll = _nll(decoder, sentences)[0] if sentences else None
    del decoder

    step("original")
    reference = LayerwiseOriginal(folder)
    paths = [list(p) + [fed[t][r] for t in range(steps)] for r, p in enumerate(prompts)]
    every = reference.logits(paths + sentences)
    ref_paths, ref_sentences = every[:len(paths)], every[len(paths):]
    # the original's logits where the runtime chose each token: the prompt's last position, then each step's
    ref_steps = [np.stack([ref_paths[r][len(p) - 1 + s] for r, p in enumerate(prompts)]) for s in range(steps + 1)]

    step("compare")
    worst, ok = max((_close(g, r, bounds) for g, r in zip(got_steps, ref_steps)), key=lambda x: (not x[1], x[0]))
    comparisons = [{"runner": name, "reference": "original (layer by layer)", "output": "logits", "max_abs": worst,
                    "passed": ok}]
    differ = ties = 0
    first_diff = [steps + 1] * len(prompts)
    for s, (g, r) in enumerate(zip(got_steps, ref_steps)):
        for row, (row_g, row_r) in enumerate(zip(g, r)):
            if int(np.argmax(row_g)) != int(np.argmax(row_r)):
                top = np.sort(row_r)[-2:]
                ties += int(top[1] - top[0] < tie)
                differ += int(top[1] - top[0] >= tie)
                first_diff[row] = min(first_diff[row], s)
    tokens = [{"runner": name, "reference": "original (layer by layer)", "differ": differ, "ties": ties,
               "passed": differ == 0 or weight_only}]
    quality = []
    if weight_only:
        ref_nll, count = 0.0, 0
        for ids, logits in zip(sentences, ref_sentences):
            rows = logits[:-1].astype(np.float64)
            top = rows.max(axis=1, keepdims=True)
            log_z = np.log(np.exp(rows - top).sum(axis=1)) + top[:, 0]
            ref_nll += float((log_z - rows[np.arange(len(ids) - 1), ids[1:]]).sum())
            count += len(ids) - 1
        ref_ppl, got_ppl = float(np.exp(ref_nll / count)), float(np.exp(got_nll / count))
        decisions = sum(len(g) for g in got_steps)
        quality.append({"runner": name, "reference": "original (layer by layer, fp32)", "sentences": len(sentences),
                        "tokens": count, "perplexity": got_ppl, "reference_perplexity": ref_ppl,
                        "ratio": got_ppl / ref_ppl, "limit": PERPLEXITY_LIMITS[info.precision],
                        "greedy_identical": sum(d == steps + 1 for d in first_diff), "prompts": len(prompts),
                        "greedy_tokens": steps + 1, "greedy_common_prefix": float(np.mean(first_diff)),
                        "top1_agreement": 1 - (differ + ties) / decisions,
                        "passed": got_ppl / ref_ppl <= PERPLEXITY_LIMITS[info.precision]})
    notes = [f"checked layer by layer: {reason}. The original ({reference.config.architectures[0]} of {folder}) ran "
             "its decoder layers one at a time in fp32, without a cache, on each prompt and the tokens ONNX Runtime "
             "chose; compared: the logits at every generated position, the greedy choices"
             + (", the perplexity on the built-in sentences" if weight_only else "")
             + ". Not compared: the cached tensors (present.*) and the export's own PyTorch reference."]
    runners = [{"name": "original", "kind": "transformers (layer by layer)", "path": str(folder)},
               {"name": name, "kind": "onnxruntime", "path": str(model_path)}]
    text_info = [{"index": i, "text": t, "tokens": len(p)} for i, (t, p) in enumerate(zip(texts, prompts))]
    return GenerationReport(model=model_path, variant=info.variant, precision=precision, lowering=info.lowering,
                            texts=text_info, steps=steps, runners=runners, comparisons=comparisons, tokens=tokens,
                            notes=notes, seconds=time.monotonic() - started, quality=quality)
