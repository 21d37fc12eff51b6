"""``attnx check`` on a pretrained export: real text, compared with the original model itself.

:func:`run_text_check` tokenises real texts (:mod:`attnx.parity.text_cases`: the built-in
sentences and two longer passages, or ``--text``) with the export's own tokenizer, batches them
with padding, and runs Polygraphy's ``Comparator`` (streaming: one batch at a time, so even a causal LM's
``[batch, seq, vocab]`` logits are never all held at once) over

- ``torch``: attnx's PyTorch reference of the placed model (fp32, the literal formulas), and for
  fp32 files ``torch-fp64``, the same in float64 (the fp32 floor of :mod:`attnx.parity.text_report`);
- ``original``: the transformers / sentence-transformers model loaded offline from the export's
  source folder, when the placed model still is that model (:mod:`attnx.parity.original` decides
  and says why not);
- ``onnxrt-<lowering>``: ONNX Runtime on the file;
- ``tensorrt``: the engine, where it can run; where it cannot (no GPU of its target), the report's
  verdict is ``engine not run`` (``attnx check`` exits 3), never a pass.

The texts must fit the model: token ids inside its vocabulary and the tokenizer's length inside its
positions, else one :class:`ParityError` line before anything runs.

Then compares each runtime with the original and with the reference, and the reference with the
original, sentence by sentence (:mod:`attnx.parity.text_report`: what must hold per precision).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from attnx.contract import SEQ, ModelInfo, pretrained_task, sha256_file
from attnx.parity.cases import ParityError
from attnx.parity.original import OriginalRunner, plan_original
from attnx.parity.runners import MARGIN_PREFIX, REFERENCE, TorchReferenceRunner, onnxrt_runner
from attnx.parity.text_cases import TextDataLoader, default_texts, text_cases
from attnx.parity.text_report import TextParityReport, compare_iteration, fp32_floors, gates

if TYPE_CHECKING:  # imported where it runs: attnx.export pulls in torch
    from attnx.export.tokenizer import ExportTokenizer

ORIGINAL = "original"
REFERENCE64 = "torch-fp64"
ENGINE = "tensorrt"


def is_pretrained(info: ModelInfo) -> bool:
    return isinstance(info.config, dict) and info.config.get("kind") == "pretrained"


def _texts_json(texts: Sequence[str], encoded, left_out: Sequence[int]) -> list[dict]:
    out = []
    for i, (text, enc) in enumerate(zip(texts, encoded)):
        item = {"index": i, "text": text, "tokens": len(enc.ids), "truncated": enc.truncated}
        if i in left_out:
            item["left_out"] = True
        out.append(item)
    return out


def run_text_check(model_path: Path, model, info: ModelInfo, *, engine=None, texts: Sequence[str] | None = None,
                   original: str | os.PathLike | None = None, plugins=True, verbose: bool = False,
                   progress=None, seed: int = 0) -> TextParityReport:
    """Check a pretrained export (``model``: its reference from :func:`attnx.parity.load_reference`).
    Raises :class:`ParityError` for set-up problems; a mismatch is a report with ``passed == False``."""
    from polygraphy.comparator import Comparator
    from polygraphy.exception import PolygraphyException

    from attnx.parity.engines import engine_profiles, open_engine
    from attnx.parity.runners import quiet_polygraphy
    from attnx.parity.compare import tie_margins, variant_specs

    started = time.monotonic()
    step = progress or (lambda name: None)
    host = getattr(model, "model", model)
    precision = info.precision if info.precision in ("fp32", "fp16", "int8") else "fp32"
    model_sha = sha256_file(model_path)
    from attnx.export.tokenizer import ExportTokenizer

    tokenizer = ExportTokenizer(model_path, info)
    texts = list(texts) if texts else default_texts()
    if not all(isinstance(t, str) and t.strip() for t in texts):
        raise ParityError("--text: every text must be non-empty")
    encoded = tokenizer.encode(texts)
    _check_tokens(model_path, info, tokenizer, texts, encoded, getattr(host, "max_seq", None))

    profiles = {k: list(v) for k, v in (info.profiles or {}).items()}
    engine_info, engine_runner = None, None
    if engine is not None:
        step("engine")
        engine_info, sidecar, engine_runner = open_engine(Path(engine), model_path, model_sha, plugins)
        profiles = engine_profiles(profiles, sidecar)
    where = "engine's" if engine is not None else "model's"
    cases, left_out = text_cases(encoded, profiles, where)
    notes = []
    if left_out:
        notes.append(f"{len(left_out)} text(s) longer than the {where} profile seq<={profiles[SEQ][2]} left out: "
                     + ", ".join(str(i) for i in left_out))

    step("original")
    plan = plan_original(model, info.config, original)
    notes.insert(0, plan.note)
    ort_name = f"onnxrt-{info.lowering}"
    runners = [TorchReferenceRunner(model, info.inputs, info.output_names)]
    runner_info = [{"name": REFERENCE, "kind": "pytorch", "path": str(model_path.parent / info.weights)}]
    if precision == "fp32":  # the fp32 floor of every sentence (text_report)
        runners.append(TorchReferenceRunner(model, info.inputs, info.output_names, name=REFERENCE64, float64=True))
        runner_info.append({"name": REFERENCE64, "kind": "pytorch float64", "path": runner_info[0]["path"]})
    texts_by_ids: dict[bytes, list[str]] = {}
    if plan.used:
        runners.append(OriginalRunner(plan.source, info.inputs, lambda ids: texts_by_ids[_key(ids)], name=ORIGINAL,
                                      task=pretrained_task(info.config)))
        runner_info.append({"name": ORIGINAL, "kind": plan.library, "path": plan.source})
    runners.append(onnxrt_runner(model_path, ort_name))
    runner_info.append({"name": ort_name, "kind": "onnxruntime", "path": str(model_path), "given": True})
    if engine_runner is not None:
        runners.append(engine_runner)
    if engine_info is not None:
        runner_info.append({"name": ENGINE, "kind": "tensorrt", "path": str(engine), "ran": engine_info["ran"],
                            **({"reason": engine_info["reason"]} if not engine_info["ran"] else {})})

    specs = variant_specs(host)
    exact = {e.name for spec in specs for e in spec.extra_outputs if e.exact}
    file_gates, fp32_gates = gates(precision, info.outputs, exact), gates("fp32", info.outputs, exact)
    pair_gates = {}
    for runtime in (ort_name, ENGINE):
        pair_gates[(runtime, REFERENCE)] = file_gates
        pair_gates[(runtime, ORIGINAL)] = file_gates
    pair_gates[(REFERENCE, ORIGINAL)] = fp32_gates  # the reference runs in fp32 whatever the file
    ties_at = tie_margins(host, "fp16" if precision == "int8" else precision)
    entries = {e.name: e for e in info.outputs}
    id_name = next(e.name for e in info.inputs if e.role == "input_ids")
    loader = TextDataLoader(model, info.inputs, cases, encoded, tokenizer.pad_id,
                            seq_min=int(profiles.get(SEQ, (1,))[0]), seed=seed)
    for i, case in enumerate(cases):
        texts_by_ids[_key(loader[i][id_name])] = [texts[j] for j in case.indices]

    step("run")
    comparisons: dict = {}
    try:
        with quiet_polygraphy(verbose):
            stream = Comparator.run(runners, data_loader=loader, streaming=True)
            for case, results in zip(cases, stream):
                outputs = {name: iterations[0] for name, iterations in results}
                torch_out = outputs.get(REFERENCE, {})
                margins = {k[len(MARGIN_PREFIX):]: v for k, v in torch_out.items() if k.startswith(MARGIN_PREFIX)}
                floors = fp32_floors(torch_out, outputs[REFERENCE64], entries, case.lengths) \
                    if REFERENCE64 in outputs else None
                compare_iteration(comparisons, outputs, pair_gates, entries, case.indices, case.lengths, margins,
                                  ties_at, floors)
    except PolygraphyException as e:
        raise ParityError(f"Polygraphy could not run the comparison: {' '.join(str(e).split())[:400]}") from None
    finally:
        if engine_runner is not None:
            engine_runner.close()
    step("compare")
    order = {name: i for i, name in enumerate([ort_name, ENGINE, REFERENCE])}
    ordered = sorted(comparisons.values(), key=lambda c: (order.get(c.runner, 9), c.reference != ORIGINAL))
    return TextParityReport(
        model=model_path, variant=info.variant, precision=precision, lowering=info.lowering,
        host=str(info.config.get("architecture") or info.config.get("host")), placement=dict(info.config.get("placement") or {}),
        texts=_texts_json(texts, encoded, left_out), tokenizer=tokenizer.to_json(), original=plan.to_json(),
        runners=runner_info, comparisons=ordered, engine=engine_info, notes=notes,
        seconds=time.monotonic() - started, model_sha256=model_sha, batches=[list(c.indices) for c in cases])


def _check_tokens(model_path: Path, info: ModelInfo, tokenizer: ExportTokenizer, texts: Sequence[str],
                  encoded, positions: int | None) -> None:
    """The tokenizer must fit the model: ids inside the vocabulary and lengths inside the positions
    (both from the metadata). A swapped tokenizer file or edited metadata is one line here, not a
    failure deep inside a runner."""
    ids_entry = next((e for e in info.inputs if e.role == "input_ids"), None)
    if positions is not None and tokenizer.max_length > positions:
        raise ParityError(f"the tokenizer of {model_path.name} truncates at {tokenizer.max_length} tokens (attnx.tokenizer "
                          f"max_length) but the model has {positions} positions: texts that long cannot run; "
                          "re-export it")
    high = ids_entry.range[1] if ids_entry is not None and ids_entry.range else None
    for i, (text, enc) in enumerate(zip(texts, encoded)):
        top = max(enc.ids, default=0)
        if high is not None and top >= high:
            snippet = " ".join(text.split())[:40]
            raise ParityError(f"text {i} (\"{snippet}\") gives token id {top}, outside the model's vocabulary "
                              f"[0, {high}) ({ids_entry.name}): the tokenizer {tokenizer.path} does not belong to "
                              f"{model_path.name}")


def _key(ids) -> bytes:
    import numpy as np

    arr = np.ascontiguousarray(ids, dtype=np.int64)
    return arr.tobytes() + str(arr.shape).encode()
