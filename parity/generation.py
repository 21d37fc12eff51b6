"""``attnx check`` on a with-past export: cached generation steps, compared with the reference and the original.

The export's PyTorch reference (:class:`attnx.pretrained.cached.CachedHost`, rebuilt from ``attnx.config``
with the weights beside the file, on the literal formulas) and ONNX Runtime on the file (and the engine,
where it can run) are driven by the same :class:`attnx.runtime.core.decoding.Decoder`: real texts (the
built-in sentences, or ``--text``) prefilled one by one, merged into one left-padded batch, then
``steps`` decoding steps, every runtime fed the reference's greedy tokens (teacher forcing, so a near-tie
cannot send them down different paths). Compared per step: the logits of every row and, at the end,
every cached tensor (``present.*``); and the greedy tokens each runtime would have chosen.

When the placed model still is the original (:func:`attnx.parity.original.plan_original`: the folder's
weights, the variant at its neutral values), transformers' own model runs each text's full sequence
(prompt and generated tokens, no cache) and its logits at every generated position are compared with
the cached steps: what "greedy with the cache equals transformers" needs.

A weight-only quantized export (``int8-weights`` / ``int4-weights``, :mod:`attnx.export.weight_only`) is not
meant to match the fp32 reference to a bound per logit: it is judged by its quality against that reference
(:data:`PERPLEXITY_LIMITS`): the perplexity ratio on the built-in sentences, and the greedy agreement on the
prompts (free-running tokens, and the top-1 choice per teacher-forced step), both reported; the logits and cache
differences are reported without a bound.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from attnx.contract import ModelInfo
from attnx.parity.cases import ParityError
from attnx.runtime.core.session import Session, merge_specs

#: ``(atol, rtol)`` of logits and cached tensors, per precision: |a - b| <= atol + rtol |reference|.
BOUNDS = {"fp32": (1e-3, 1e-3), "fp16": (6e-2, 3e-2), "int8": (3e-1, 1e-1)}
#: A greedy choice whose top-2 margin (reference logits) is under this is a tie, not a mismatch.
TIE = {"fp32": 1e-4, "fp16": 2e-2, "int8": 1e-1}
DEFAULT_STEPS = 8
#: Weight-only quantized precisions: the largest perplexity ratio (quantized / fp32 reference) that passes.
PERPLEXITY_LIMITS = {"int8-weights": 1.01, "int4-weights": 1.05}


class TorchSession(Session):
    """The export's PyTorch reference as a :class:`Session`, so one decoder drives it and the runtimes."""

    platform = "pytorch"
    provider = "pytorch (reference path)"
    attention = "reference"  # the attention path it runs (attnx.models.attention.PATHS)

    def __init__(self, model, info: ModelInfo, path: Path):
        self.model, self.path = model, path
        self.metadata = info.to_props()
        self.inputs = merge_specs([(e.name, np.dtype(e.dtype), list(e.shape)) for e in info.inputs], info.inputs, True)
        self.outputs = merge_specs([(e.name, np.dtype(e.dtype), list(e.shape)) for e in info.outputs], info.outputs,
                                   False)

    @classmethod
    def of(cls, model, path: Path | str = "reference") -> "TorchSession":
        """A :class:`~attnx.pretrained.cached.CachedHost` as a session without an export (its declared specs)."""
        from attnx.contract import TensorEntry

        def entry(spec) -> TensorEntry:
            dtype = "float32" if spec.dtype == "float" else "int64"
            return TensorEntry(spec.name, spec.role, dtype, tuple(spec.shape), getattr(spec, "range", None),
                               spec.doc, getattr(spec, "default", None))

        info = ModelInfo(variant=model.variant, config=model.config_dict(), lowering="reference", precision="fp32",
                         inputs=[entry(s) for s in model.input_specs()], outputs=[entry(s) for s in model.output_specs()],
                         profiles={}, cache=model.cache_metadata())
        return cls(model, info, Path(path))

    def _run(self, feeds, output_names):
        import torch

        from attnx.models.attention import attention_path

        dtypes = {s.name: s.dtype for s in self.inputs}
        tensors = {k: torch.from_numpy(np.ascontiguousarray(v.astype(np.float32) if dtypes[k].kind == "f" else v))
                   for k, v in feeds.items()}
        with torch.no_grad(), attention_path(self.attention):
            out = self.model.forward_named(tensors)
        return {n: out[n].float().numpy() if out[n].is_floating_point() else out[n].numpy() for n in output_names}


@dataclass
class GenerationReport:
    model: Path
    variant: str
    precision: str
    lowering: str
    texts: list[dict]
    steps: int
    runners: list[dict]
    comparisons: list[dict]
    tokens: list[dict]
    notes: list[str] = field(default_factory=list)
    engine: dict | None = None
    seconds: float = 0.0
    kind: str = "generation"
    quality: list[dict] = field(default_factory=list)  # weight-only precisions: perplexity and greedy agreement

    @property
    def passed(self) -> bool:
        return all(c["passed"] for c in self.comparisons) and all(t["passed"] for t in self.tokens) \
            and all(q["passed"] for q in self.quality)

    @property
    def engine_unchecked(self) -> str | None:
        if self.engine is not None and not self.engine.get("ran"):
            return self.engine.get("reason") or "it did not run here"
        return None

    def mismatches(self) -> list[str]:
        out = [f"{c['runner']} vs {c['reference']} {c['output']}: max abs {c['max_abs']:.3g} > bound"
               for c in self.comparisons if not c["passed"]]
        out += [f"{t['runner']}: greedy tokens differ from the reference at {t['differ']} step(s) (not ties)"
                for t in self.tokens if not t["passed"]]
        out += [f"{q['runner']}: perplexity {q['ratio']:.4f}x the fp32 reference's > {q['limit']}x"
                for q in self.quality if not q["passed"]]
        return out

    def to_json(self) -> dict:
        return {"kind": self.kind, "model": str(self.model), "variant": self.variant, "precision": self.precision,
                "lowering": self.lowering, "passed": self.passed, "texts": self.texts, "steps": self.steps,
                "runners": self.runners, "comparisons": self.comparisons, "tokens": self.tokens, "notes": self.notes,
                "engine": self.engine, "seconds": self.seconds, "quality": self.quality}

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path


def _close(a: np.ndarray, ref: np.ndarray, bounds: tuple[float, float]) -> tuple[float, bool]:
    diff = np.abs(a.astype(np.float64) - ref.astype(np.float64))
    return float(diff.max()) if diff.size else 0.0, bool(np.all(diff <= bounds[0] + bounds[1] * np.abs(ref)))


def _drive(decoder, prompts: Sequence[list[int]], forced: list[list[int]] | None, steps: int):
    """Prefill each prompt, merge, then ``steps`` steps fed ``forced`` tokens (None: this runner's greedy
    tokens become the forced ones). Returns (per-step logits [rows, vocab], final state, tokens fed)."""
    firsts, states = [], []
    for ids in prompts:
        logits, state = decoder.start(ids)
        firsts.append(logits)
        states.append(state)
    state = decoder.merge(states)
    per_step = [np.stack(firsts)]
    fed: list[list[int]] = []
    for step in range(steps):
        tokens = forced[step] if forced is not None else [int(np.argmax(r)) for r in per_step[-1]]
        fed.append(tokens)
        logits, state = decoder.step(state, tokens)
        per_step.append(logits)
    return per_step, state, fed


def run_generation_check(model_path: Path, model, info: ModelInfo, *, engine=None, texts: Sequence[str] | None = None,
                         original=None, plugins=True, progress=None, steps: int = DEFAULT_STEPS) -> GenerationReport:
    """Check a with-past export (``model``: its reference). Raises :class:`ParityError` for set-up problems."""
    from attnx.parity.engines import open_engine
    from attnx.parity.original import plan_original
    from attnx.parity.text_cases import default_texts
    from attnx.runtime.core.decoding import Decoder
    from attnx.runtime.core.loading import load
    from attnx.runtime.core.text import TextTokenizer

    started = time.monotonic()
    step = progress or (lambda name: None)
    weight_only = info.precision in PERPLEXITY_LIMITS
    precision = info.precision if info.precision in BOUNDS or weight_only else "fp32"
    bounds = (np.inf, 0.0) if weight_only else BOUNDS[precision]  # judged by quality instead (module doc)
    tie = TIE["int8"] if weight_only else TIE[precision]
    tokenizer = TextTokenizer.from_export(model_path, info)
    if tokenizer is None:
        raise ParityError(f"{model_path.name} names no tokenizer (attnx.tokenizer): re-export it")
    texts = list(texts) if texts else default_texts()[:4]
    positions = info.cache.get("max_positions") or None
    prompts = []
    for i, text in enumerate(texts):
        ids = [int(t) for t in tokenizer.tokenize([text])[0].ids]
        if positions:
            ids = ids[:max(1, positions - steps - 1)]  # room for the generated tokens
        prompts.append(ids)
    reference = Decoder(TorchSession(model, info, model_path))
    runners = {f"onnxrt-{info.lowering}": Decoder(load(model_path, device="cpu"))}
    runner_info = [{"name": "torch", "kind": "pytorch", "path": str(model_path.parent / (info.weights or ""))},
                   {"name": f"onnxrt-{info.lowering}", "kind": "onnxruntime", "path": str(model_path)}]
    engine_info = None
    if engine is not None:
        step("engine")
        from attnx.contract import sha256_file

        engine_info, _sidecar, engine_runner = open_engine(Path(engine), model_path, sha256_file(model_path), plugins)
        if engine_runner is not None:
            engine_runner.close()
            runners["tensorrt"] = Decoder(load(engine, onnx_path=model_path))
        runner_info.append({"name": "tensorrt", "kind": "tensorrt", "path": str(engine), "ran": engine_info["ran"]})

    step("run")
    ref_steps, ref_state, fed = _drive(reference, prompts, None, steps)
    comparisons, token_checks, quality = [], [], []
    for name, decoder in runners.items():
        got_steps, got_state, _ = _drive(decoder, prompts, fed, steps)
        worst, ok = max((_close(g, r, bounds) for g, r in zip(got_steps, ref_steps)), key=lambda x: (not x[1], x[0]))
        comparisons.append({"runner": name, "reference": "torch", "output": "logits", "max_abs": worst, "passed": ok})
        worst_c, ok_c = 0.0, True
        got_cache = got_state.host_cache()
        for key, ref_arr in ref_state.host_cache().items():
            m, good = _close(got_cache[key], ref_arr, bounds)
            worst_c, ok_c = max(worst_c, m), ok_c and good
        comparisons.append({"runner": name, "reference": "torch", "output": "present.*", "max_abs": worst_c,
                            "passed": ok_c})
        differ = ties = 0
        for g, r in zip(got_steps, ref_steps):
            for row_g, row_r in zip(g, r):
                if int(np.argmax(row_g)) != int(np.argmax(row_r)):
                    top = np.sort(row_r)[-2:]
                    ties += int(top[1] - top[0] < tie)
                    differ += int(top[1] - top[0] >= tie)
        token_checks.append({"runner": name, "reference": "torch", "differ": differ, "ties": ties,
                             "passed": differ == 0 or weight_only})
        if weight_only:
            decisions = sum(len(g) for g in got_steps)
            quality.append(_quality(name, decoder, reference, prompts, ref_steps, steps, tokenizer, positions,
                                    PERPLEXITY_LIMITS[info.precision], 1 - (differ + ties) / decisions))

    step("original")
    plan = plan_original(model, info.config, original)
    notes = [plan.note]
    if plan.used:
        worst, ok = _against_original(plan.source, prompts, fed, ref_steps, runners,
                                      BOUNDS["fp32"] if weight_only else bounds, comparisons)
    text_info = [{"index": i, "text": t, "tokens": len(p)} for i, t, p in zip(range(len(texts)), texts, prompts)]
    step("compare")
    return GenerationReport(model=model_path, variant=info.variant, precision=precision, lowering=info.lowering,
                            texts=text_info, steps=steps, runners=runner_info, comparisons=comparisons,
                            tokens=token_checks, notes=notes, engine=engine_info, seconds=time.monotonic() - started,
                            quality=quality)


def _greedy(decoder, prompts, steps: int) -> list[list[int]]:
    """Each prompt's own free-running greedy continuation (``steps`` tokens after the prefill's)."""
    per_step, _, fed = _drive(decoder, prompts, None, steps)
    last = [int(np.argmax(r)) for r in per_step[-1]]
    return [[fed[t][r] for t in range(steps)] + [last[r]] for r in range(len(prompts))]


def _nll(decoder, sentences: Sequence[list[int]]) -> tuple[float, int]:
    """Summed negative log-likelihood of every sentence's tokens after its first, and how many: the
    sentences in one batch, each fed its own tokens one step at a time (a file's logits are the last
    position's)."""
    firsts, states = [], []
    for ids in sentences:
        logits, state = decoder.start(ids[:1])
        firsts.append(logits)
        states.append(state)
    state, logits = decoder.merge(states), np.stack(firsts)
    longest = max(len(ids) for ids in sentences)
    total, count = 0.0, 0
    for t in range(1, longest):
        rows = logits.astype(np.float64)
        log_z = np.log(np.exp(rows - rows.max(axis=1, keepdims=True)).sum(axis=1)) + rows.max(axis=1)
        for r, ids in enumerate(sentences):
            if t < len(ids):
                total += float(log_z[r] - rows[r, ids[t]])
                count += 1
        if t + 1 < longest:  # rows already done are fed their last token again (ignored)
            logits, state = decoder.step(state, [ids[min(t, len(ids) - 1)] for ids in sentences])
    return total, count


def _quality(name: str, decoder, reference, prompts, ref_steps, steps: int, tokenizer, positions, limit: float,
             top1: float) -> dict:
    """A weight-only quantized file against the fp32 reference: perplexity on the built-in sentences and greedy
    agreement on the prompts (:data:`PERPLEXITY_LIMITS`)."""
    from attnx.pretrained.sentences import SENTENCES

    sentences = [[int(t) for t in tokenizer.tokenize([s])[0].ids] for s in SENTENCES]
    sentences = [ids[:positions] if positions else ids for ids in sentences]
    sentences = [ids for ids in sentences if len(ids) >= 2]
    ref_nll, n = _nll(reference, sentences)
    got_nll, _ = _nll(decoder, sentences)
    ref_ppl, got_ppl = float(np.exp(ref_nll / n)), float(np.exp(got_nll / n))
    ref_tokens = _greedy(reference, prompts, steps)
    got_tokens = _greedy(decoder, prompts, steps)
    same = sum(a == b for a, b in zip(ref_tokens, got_tokens))
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(ref_tokens, got_tokens)]
    ratio = got_ppl / ref_ppl
    return {"runner": name, "reference": "torch (fp32)", "sentences": len(sentences), "tokens": n,
            "perplexity": got_ppl, "reference_perplexity": ref_ppl, "ratio": ratio, "limit": limit,
            "greedy_identical": same, "prompts": len(prompts), "greedy_tokens": steps + 1,
            "greedy_common_prefix": float(np.mean(prefix)), "top1_agreement": top1, "passed": ratio <= limit}


def _against_original(source: str, prompts, fed, ref_steps, runners, bounds, comparisons):
    """The original re-running each prefix in full (no cache), its last logits at every step: transformers' own
    model, or for a folder saved from a placed model the placed model itself (as :mod:`attnx.parity.original`
    loads it). Each prefix, not the final sequence: a variant that pools the sequence (maw) chooses for the
    last token what the sequence so far says."""
    import torch
    import transformers

    from attnx import pretrained

    folder = pretrained.read_folder(source)
    if folder.placement is not None:
        host = pretrained.load(folder, task="causal-lm").eval()
        context = {s.name: torch.full([1 if d == "batch" else d for d in s.shape], 1.0 if s.default == "ones" else 0.0)
                   for s in host.context_inputs()}

        def last_logits(seq):
            ids = torch.tensor([seq])
            return host.forward_named({"input_ids": ids, "attention_mask": torch.ones_like(ids), **context})["logits"]
    else:
        if folder.weights:
            hf = transformers.AutoModelForCausalLM.from_pretrained(source, local_files_only=True, dtype=torch.float32,
                                                                   attn_implementation="eager").eval()
        else:  # a GGUF-backed folder: transformers' model, each tensor read from the GGUF (attnx.pretrained.gguf)
            hf = pretrained.load_model(folder, "causal-lm")
            hf.set_attn_implementation("eager")

        def last_logits(seq):
            return hf(input_ids=torch.tensor([seq])).logits

    expected = []
    for s in range(len(ref_steps)):
        rows = []
        for r, ids in enumerate(prompts):
            with torch.no_grad():
                rows.append(last_logits(list(ids) + [fed[t][r] for t in range(s)])[0, -1].float().numpy())
        expected.append(np.stack(rows))
    worst, ok = max((_close(g, e, bounds) for g, e in zip(ref_steps, expected)), key=lambda x: (not x[1], x[0]))
    comparisons.append({"runner": "torch", "reference": "original", "output": "logits", "max_abs": worst,
                        "passed": ok})
    return worst, ok
