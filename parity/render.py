"""What ``attnx check`` prints: one rich rendering per kind of parity report.

    render(report, console, report_path)   # a ParityReport, TextParityReport or GenerationReport

The reports themselves (figures, verdict, JSON) are :mod:`attnx.parity.report`,
:mod:`attnx.parity.text_report` and :mod:`attnx.parity.generation`; this module only lays them out.
"""

from __future__ import annotations

from pathlib import Path

from rich.markup import escape
from rich.table import Table

from attnx.parity.text_report import FLOOR_FACTOR, SCORE_OUTPUTS, SENTENCE_OUTPUT


def render(report, console, report_path: Path | None = None) -> None:
    """Print ``report`` on ``console`` (a rich Console): tables, notes and one verdict line."""
    kind = getattr(report, "kind", "")
    draw = render_generation if kind == "generation" else render_text if kind == "pretrained" else render_check
    draw(report, console, report_path)


def render_check(report, console, report_path: Path | None = None) -> None:
    """A variant export's report (:class:`~attnx.parity.report.ParityReport`): one row per runner and output,
    the tolerances, ties, whether the engine ran, and one verdict line."""
    table = Table(title=f"parity of {escape(report.model.name)} ({report.variant}, {report.precision}) with the "
                        f"PyTorch reference; cases {', '.join(c.label() for c in report.cases)}",
                  header_style="bold")
    for col in ("runner", "output", "max abs", "max rel", "mean abs", "result"):
        table.add_column(col, justify="right" if col in ("max abs", "mean abs", "max rel") else "left", no_wrap=True)
    for c in report.comparisons:
        result = "[green]pass[/green]" if c.passed else "[bold red]FAIL[/bold red]"
        if c.passed and c.ties and c.output in report.tie_margins:
            result = f"[yellow]pass, {c.ties} tie{'s' if c.ties != 1 else ''}[/yellow]"
        table.add_row(c.runner, c.output, f"{c.max_abs:.3g}", f"{c.max_rel:.3g}", f"{c.mean_abs:.2g}", result)
    console.print(table)
    tols = []
    for name, (atol, rtol, mean_atol) in report.tolerances.items():
        tols.append(f"{name} exact" if atol == 0 and rtol == 0 else
                    f"{name} per element abs <= {atol:g} or rel <= {rtol:g}, mean abs <= {mean_atol:g}")
    console.print(f"[dim]tolerances ({report.precision}): {'; '.join(tols)}[/dim]", highlight=False)
    for t in report.ties:
        console.print(f"[yellow]{t['output']} tie:[/yellow] {t['runner']} case {report.cases[t['iteration']].label()} "
                      f"row {t['row']}: {t['value']} vs reference {t['reference_value']} at decision margin "
                      f"{t['margin']:.2g} (< {t['tie_margin']:g}); row left out of the statistics", highlight=False)
    if report.engine is not None and not report.engine.get("ran"):
        console.print(f"[yellow]engine not run here:[/yellow] {escape(report.engine.get('reason', ''))}; "
                      "everything else was checked", highlight=False)
    elif report.engine is None:
        console.print("[dim]no engine checked (build one with `attnx build-engine`, or pass --engine)[/dim]")
    verdict = "[bold green]PASS[/bold green]" if report.passed else "[bold red]FAIL[/bold red]"
    if report.passed and report.ties:
        verdict += f" [yellow]({len(report.ties)} tie(s) at near-equal decision margins, reported above)[/yellow]"
    console.print(f"{verdict} in {report.seconds:.1f}s"
                  + (f"; report: {escape(str(report_path))}" if report_path else ""), highlight=False)


def _figure(value: float, metric: str) -> str:
    if value != value:  # NaN
        return "nan"
    return f"{value:.6f}" if metric == "cosine" else f"{value:.0%}" if metric == "top1" else f"{value:.2g}"


def _headline_pairs(report) -> list[tuple[str, str, str, str]]:
    """``(runner, reference, token-level output, sentence-level output)`` for each runtime in the
    per-sentence table: compared with the original where it is, else with attnx's reference."""
    reference = "original" if report.original.get("used") else "torch"
    pairs: dict[str, list[str]] = {}
    for c in report.comparisons:
        if c.reference == reference and c.runner not in ("torch", "original") and c.gate.metric != "exact":
            pairs.setdefault(c.runner, []).append(c.output)
    out = []
    for runner, outputs in pairs.items():
        token = next((o for o in outputs if o != SENTENCE_OUTPUT), outputs[0])
        out.append((runner, reference, token, SENTENCE_OUTPUT if SENTENCE_OUTPUT in outputs else token))
    return out


def render_text(report, console, report_path: Path | None = None) -> None:
    """A pretrained export's report: one row per comparison (worst figures over the texts), then one
    row per sentence (tokens, max abs difference, cosine of each runtime against the original, and
    whether every comparison holds on it), the notes, and one verdict line."""
    placement = report.placement
    if placement.get("append"):
        where = f"{report.variant} appended x{placement['append']}"
    elif report.variant == "mha" or not placement.get("layers"):
        where = "its own attention" if report.variant == "mha" else report.variant
    else:
        where = f"{report.variant} in layers {','.join(map(str, placement['layers']))}"
    console.print(f"[bold]parity of {escape(report.model.name)}[/bold]: {report.host} with {escape(where)}, "
                  f"{report.precision}, on {len(report.texts)} real texts in {len(report.batches)} padded batches",
                  highlight=False)
    table = Table(header_style="bold", box=None, pad_edge=False)
    for col in ("runner vs reference", "output", "max abs", "min cosine", "must hold", "result"):
        table.add_column(col, justify="right" if col in ("max abs", "min cosine") else "left", no_wrap=True)
    for c in report.comparisons:
        result = ("[green]pass[/green]" if c.gated else "[dim]reported[/dim]") if c.passed else "[bold red]FAIL[/bold red]"
        bound = c.gate.describe() + (" x max|ref|" if c.output in SCORE_OUTPUTS and c.gate.metric == "max_abs" else "")
        floored = [r for r in c.rows if r.get("fp32_floor") is not None and r["bound"] > c.gate.bound]
        if floored and c.output not in SCORE_OUTPUTS:  # the model amplifies fp32 rounding (text_report doc)
            bound += f", or {FLOOR_FACTOR:g}x fp32 floor on {len(floored)} (up to {max(r['bound'] for r in floored):.2g})"
        table.add_row(c.pair, c.output, _figure(c.worst("max_abs"), "max_abs"), _figure(c.worst("cosine"), "cosine"),
                      bound, result)
    console.print(table)

    by_key = {(c.runner, c.reference, c.output): c for c in report.comparisons}
    heads = _headline_pairs(report)
    per = Table(title="per sentence" + (f" (against the {heads[0][1]} model)" if heads else "")
                + "; * = outside its bound", header_style="bold", title_justify="left")
    per.add_column("#", justify="right")
    per.add_column("tokens", justify="right")
    per.add_column("text", no_wrap=True, max_width=32)
    cells_of = []
    for runner, reference, token, sentence in heads:
        tag = "" if len(heads) == 1 else f"{runner} "
        per.add_column(f"{tag}max abs\n{token}", justify="right")
        cells_of.append((by_key.get((runner, reference, token)), "max_abs"))
        per.add_column(f"{tag}cosine\n{sentence}", justify="right")
        cells_of.append((by_key.get((runner, reference, sentence)), "cosine"))
        if token == "logits":
            per.add_column(f"{tag}top-1\nagrees", justify="right")
            cells_of.append((by_key.get((runner, reference, token)), "top1"))
    per.add_column("result")
    for item in report.texts:
        i = item["index"]
        cells = []
        for comp, key in cells_of:
            row = next((r for r in comp.rows if r["text"] == i), None) if comp else None
            gated = comp is not None and comp.gated and (key == "cosine") == (comp.gate.metric == "cosine")
            cells.append("-" if row is None or key not in row else
                         _figure(row[key], key) + ("*" if gated and not row["passed"] else ""))
        failing = [c for c in report.comparisons for r in c.rows if r["text"] == i and not r["passed"]]
        if item.get("left_out"):
            result = "[dim]left out[/dim]"
        else:
            result = "[green]pass[/green]" if not failing else \
                "[bold red]FAIL[/bold red] " + escape(", ".join(f"{c.pair} {c.output}" for c in failing))
        tokens = f"{item['tokens']}{' cut' if item['truncated'] else ''}"
        per.add_row(str(i), tokens, escape(" ".join(item["text"].split())), *cells, result)
    console.print(per)
    for note in report.notes:
        console.print(f"[yellow]note:[/yellow] {escape(note)}", highlight=False)
    for t in report.ties:
        console.print(f"[yellow]{t['output']} tie:[/yellow] {t['runner']} vs {t['reference']} on sentence "
                      f"{t['text']} at decision margin {t['margin']:.2g} (< {t['tie_margin']:g})", highlight=False)
    tail = f" in {report.seconds:.1f}s" + (f"; report: {escape(str(report_path))}" if report_path else "")
    if not report.passed:
        verdict = f"[bold red]FAIL[/bold red]: {len(report.mismatches())} comparison(s) outside their bounds"
    elif report.engine_unchecked:
        verdict = (f"[bold yellow]NOT VERIFIED[/bold yellow]: the engine {escape(Path(report.engine['path']).name)} "
                   f"did not run here: {escape(report.engine_unchecked)}; the ONNX file and the reference passed "
                   "(check the engine where it runs, or pass --no-engine to check the ONNX alone)")
    else:
        ties = len(report.ties)
        verdict = "[bold green]PASS[/bold green]" + (f" ({ties} tie(s) at near-equal decision margins)" if ties else "")
    console.print(verdict + tail, highlight=False, soft_wrap=True)  # one line, however narrow the terminal


def render_generation(report, console, report_path: Path | None = None) -> None:
    """A with-past export's report (:class:`~attnx.parity.generation.GenerationReport`): cached generation
    against the reference, step by step, and the greedy tokens."""
    table = Table(title=f"cached generation of {escape(report.model.name)} ({report.variant}, {report.precision}): "
                        f"{len(report.texts)} texts in one left-padded batch, prefill + {report.steps} steps",
                  title_justify="left")
    for col in ("runtime", "vs", "output", "max abs", ""):
        table.add_column(col)
    for c in report.comparisons:
        table.add_row(c["runner"], c["reference"], c["output"], f"{c['max_abs']:.2e}",
                      "[green]ok[/green]" if c["passed"] else "[red]FAIL[/red]")
    for t in report.tokens:
        table.add_row(t["runner"], t["reference"], "greedy tokens",
                      f"{t['differ']} differ" + (f", {t['ties']} tie(s)" if t["ties"] else ""),
                      "[green]ok[/green]" if t["passed"] else "[red]FAIL[/red]")
    console.print(table)
    for q in getattr(report, "quality", []):  # a weight-only quantized file against its fp32 reference
        mark = "[green]ok[/green]" if q["passed"] else "[red]FAIL[/red]"
        console.print(f"{q['runner']} vs fp32: perplexity {q['perplexity']:.3f} vs {q['reference_perplexity']:.3f} "
                      f"(ratio {q['ratio']:.4f}, limit {q['limit']}) on {q['sentences']} built-in sentences "
                      f"({q['tokens']} tokens) {mark}; greedy: {q['greedy_identical']}/{q['prompts']} prompts "
                      f"identical over {q['greedy_tokens']} tokens (common prefix {q['greedy_common_prefix']:.1f}), "
                      f"top-1 agreement {q['top1_agreement']:.1%} of teacher-forced steps", highlight=False)
    for note in report.notes:
        console.print(f"[dim]{escape(note)}[/dim]", highlight=False)
    if report.engine_unchecked:
        console.print(f"[yellow]engine not run here:[/yellow] {escape(report.engine_unchecked)}", highlight=False)
    verdict = "[bold green]PASS[/bold green]" if report.passed else "[bold red]FAIL[/bold red]"
    console.print(f"{verdict} in {report.seconds:.1f}s" + (f"; report: {escape(str(report_path))}" if report_path else ""),
                  highlight=False)
