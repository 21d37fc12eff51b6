"""``attnx check``: parity of an attnx export against its PyTorch reference, with Polygraphy.

:func:`run_check` compares, on the same inputs (:mod:`attnx.parity.cases`), the reference
(:class:`~attnx.parity.runners.TorchReferenceRunner`: the model rebuilt from the file's
``attnx.config`` with the weights named by ``attnx.weights``) with ONNX Runtime on both lowerings
(the given file is one; the other is re-exported from the reference into ``<workdir>/parity/``)
and with the engine where it can run (a GPU of the architecture it was built for; otherwise one
line says why and the rest is checked). ``Comparator.compare_accuracy`` with the tie-aware compare
function (:mod:`attnx.parity.compare`); relative errors are relative to the reference.

Pretrained exports go to :mod:`attnx.parity.pretrained` (real text, the original model), with-past ones to
:mod:`attnx.parity.generation`. An engine is never taken on trust (:func:`attnx.parity.engines.open_engine`); the
reference is :func:`attnx.parity.reference.load_reference`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import attnx
from attnx.contract import ContractError, ModelInfo, sha256_file
from attnx.parity.cases import Case, ParityDataLoader, ParityError, check_in_profile, default_cases, parse_cases
from attnx.parity.compare import TieAwareCompareFunc, TieTracker, main_outputs, resolve_tolerances, tie_margins
from attnx.parity.engines import engine_profiles, open_engine
from attnx.parity.reference import load_reference
from attnx.parity.report import ParityReport, summarize
from attnx.parity.runners import REFERENCE, TorchReferenceRunner, onnxrt_runner, quiet_polygraphy

LOWERINGS = ("plugin", "rewrite")


def _other_lowering_file(model, info: ModelInfo, source: Path, folder: Path, weights_sha: str) -> tuple[Path, str]:
    """The reference re-exported with the other lowering into ``folder`` (reused while the
    weights, config and precision are the same)."""
    from attnx.export.exporter import export_encoder

    other = "rewrite" if info.lowering == "plugin" else "plugin"
    stem = source.stem.removesuffix(f"-{info.lowering}")
    path = folder / f"{stem}-{other}.onnx"
    key = hashlib.sha256(json.dumps({"config": info.config, "precision": info.precision, "lowering": other,
                                     "weights": weights_sha, "profiles": info.profiles,
                                     "attnx": attnx.__version__}, sort_keys=True).encode()).hexdigest()
    stamp = path.with_name(path.name + ".key")
    if path.is_file() and stamp.is_file() and stamp.read_text().strip() == key:
        return path, other
    folder.mkdir(parents=True, exist_ok=True)
    # torch's exporter logs a warning per missing torchvision op; nothing to do with this check.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    export_encoder(model, path, lowering=other, fp16=info.precision == "fp16", profiles=info.profiles,
                   save_weights=False, tokenizer=info.tokenizer)
    stamp.write_text(key + "\n")
    return path, other


def _compare_funcs(tracker: TieTracker, tol: Mapping[str, tuple]) -> list:
    atol = {k: v[0] for k, v in tol.items()}
    rtol = {k: v[1] for k, v in tol.items()}
    return [
        TieAwareCompareFunc(tracker=tracker, atol=atol, rtol=rtol, check_error_stat="elemwise"),
        # rtol 0: the mean relative error is meaningless next to near-zero reference values.
        TieAwareCompareFunc(tracker=tracker, atol={k: v[2] for k, v in tol.items()}, rtol=0.0,
                            check_error_stat="mean", row_atol=atol, row_rtol=rtol),
    ]


def _compare(runners: list, loader, funcs: list, verbose: bool, step):
    from polygraphy.comparator import Comparator
    from polygraphy.exception import PolygraphyException

    try:
        with quiet_polygraphy(verbose):
            results = Comparator.run(runners, data_loader=loader)
            step("compare")
            return Comparator.compare_accuracy(results, comparisons=[(i, 0) for i in range(1, len(runners))],
                                               compare_func=funcs)
    except PolygraphyException as e:
        raise ParityError(f"Polygraphy could not run the comparison: {' '.join(str(e).split())[:400]}") from None


def run_check(model_path: str | os.PathLike, *, engine: str | os.PathLike | None = None,
              workdir: str | os.PathLike = "attnx-out", cases: Sequence[Case] | None = None,
              case_specs: Iterable[str] | None = None, tolerances: Mapping[str, Sequence[float]] | None = None,
              plugins: str | os.PathLike | bool | None = True, verbose: bool = False,
              progress=None, seed: int = 0, texts: Sequence[str] | None = None,
              original: str | os.PathLike | None = None):
    """Compare ``model_path`` (and its other lowering, and ``engine`` where it can run) with the
    PyTorch reference. ``progress(step)`` is called with ``reference``, ``engine``, ``lowering``,
    ``run``, ``compare``. Raises :class:`ParityError` for set-up problems; a mismatch is a report
    with ``passed == False``.

    A pretrained export (``attnx export --from-pretrained``) is checked on real text against the
    original model too (:func:`attnx.parity.pretrained.run_text_check`; ``texts`` replace the
    built-in ones, ``original`` the source folder its metadata names); it returns a
    :class:`~attnx.parity.text_report.TextParityReport`."""
    from attnx.parity.pretrained import is_pretrained, run_text_check

    started = time.monotonic()
    step = progress or (lambda name: None)
    model_path = Path(model_path)

    step("reference")
    try:
        found = ModelInfo.read(model_path)
    except (ContractError, ValueError, OSError):
        found = None  # load_reference says what is wrong
    if found is not None and found.cache:  # a decoder whose fp32 reference would not fit: one layer at a time
        from attnx.parity.layerwise import layerwise_reason, run_layerwise_check

        reason = layerwise_reason(found)
        if reason is not None:
            if cases or case_specs or tolerances:
                raise ParityError("--case does not apply to a with-past export: it is checked on generation steps "
                                  "from real text (pass --text to choose the texts)")
            return run_layerwise_check(model_path, found, reason, texts=texts, original=original, progress=step)
    model, info = load_reference(model_path, original)
    if info.cache:  # a decoder exported with its KV cache: checked on cached generation steps
        from attnx.parity.generation import run_generation_check

        if cases or case_specs or tolerances:
            raise ParityError("--case does not apply to a with-past export: it is checked on generation steps from "
                              "real text (pass --text to choose the texts)")
        return run_generation_check(model_path, model, info, engine=engine, texts=texts, original=original,
                                    plugins=plugins, progress=step)
    if is_pretrained(info):
        if cases or case_specs or tolerances:
            raise ParityError("--case does not apply to a pretrained export: it is checked on real text "
                              "(pass --text to choose the texts)")
        return run_text_check(model_path, model, info, engine=engine, texts=texts, original=original,
                              plugins=plugins, verbose=verbose, progress=step, seed=seed)
    if texts or original is not None:
        raise ParityError(f"--text and --original apply to pretrained exports; {model_path.name} is an attnx "
                          "encoder checked on generated inputs (use --case)")
    precision = info.precision if info.precision in ("fp32", "fp16", "int8") else "fp32"
    tol = resolve_tolerances(model, info.outputs, precision, tolerances)
    weights_sha = sha256_file(model_path.parent / info.weights)
    model_sha = sha256_file(model_path)

    # The engine: verify it before any long work, decide whether it can run here.
    profiles = {k: list(v) for k, v in (info.profiles or {}).items()}
    engine_info, engine_runner_ = None, None
    if engine is not None:
        step("engine")
        engine = Path(engine)
        engine_info, sidecar, engine_runner_ = open_engine(engine, model_path, model_sha, plugins)
        profiles = engine_profiles(profiles, sidecar)

    where = "engine's" if engine is not None else "model's"
    if cases is None:
        cases = parse_cases(case_specs, profiles, where) if case_specs else default_cases(profiles)
    for c in cases:
        check_in_profile(c.batch, c.seq, profiles, where)
    if not cases:
        raise ParityError("no input cases to check")

    step("lowering")
    other_path, other = _other_lowering_file(model, info, model_path, Path(workdir) / "parity", weights_sha)
    by_lowering = {info.lowering: model_path, other: other_path}
    runners = [TorchReferenceRunner(model, info.inputs, info.output_names)]
    runners += [onnxrt_runner(by_lowering[lw], f"onnxrt-{lw}") for lw in LOWERINGS]
    runner_info = [{"name": REFERENCE, "kind": "pytorch", "path": str(model_path.parent / info.weights)}]
    runner_info += [{"name": f"onnxrt-{lw}", "kind": "onnxruntime", "path": str(by_lowering[lw]),
                     "given": lw == info.lowering} for lw in LOWERINGS]
    if engine_runner_ is not None:
        runners.append(engine_runner_)
    if engine_info is not None:
        runner_info.append({"name": "tensorrt", "kind": "tensorrt", "path": str(engine), "ran": engine_info["ran"],
                            **({"reason": engine_info["reason"]} if not engine_info["ran"] else {})})

    margins = tie_margins(model, precision)
    tracker = TieTracker(margins, main_outputs(info.outputs))
    step("run")
    try:
        accuracy = _compare(runners, ParityDataLoader(model, info.inputs, cases, seed=seed),
                            _compare_funcs(tracker, tol), verbose, step)
    finally:
        if engine_runner_ is not None:
            engine_runner_.close()

    return ParityReport(model=model_path, variant=info.variant, precision=precision, lowering=info.lowering,
                        runners=runner_info, cases=list(cases), tolerances=tol, tie_margins=margins,
                        comparisons=summarize(accuracy[0], accuracy[1], tol, tracker.ties, cases), ties=tracker.ties,
                        engine=engine_info, seconds=time.monotonic() - started, model_sha256=model_sha)
