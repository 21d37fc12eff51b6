"""`attnx explain`: what the heads of a deployed model do on real text, as a table, a page and PNGs.

    attnx explain model.onnx "The cat sat on the mat"            # an export with --attention-outputs
    attnx explain path/to/hf-folder "The cat sat on the mat"     # a pretrained folder (torch host)
    attnx explain http://127.0.0.1:8000/minilm "..."             # a running `attnx serve`
    attnx explain model.onnx "..." --ablate --layer 3            # each head of layer 3 ablated + patching
    attnx explain model.onnx "..." --context a.json --against b.json   # two context values

The work is in :mod:`attnx.explain` (numpy) and :mod:`attnx.interp` (opening the model, patching on torch);
this module parses, prints and writes files.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import List, Optional

import typer

from attnx.cli._common import UserError, console, guarded, workdir


def _fmt(v) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}"


def _print_heads(ex, layer: int | None) -> None:
    from rich.table import Table

    from attnx.explain.analysis import PATTERNS

    short = {"previous_token": "prev", "first_token": "first/sink", "self": "self", "local_window": "local"}
    table = Table("layer", "head", "entropy", *[short[p] for p in PATTERNS],
                  title=f"heads of {ex.facts.name} on {len(ex.batch.texts)} text(s)", header_style="bold")
    table.add_column("primary", no_wrap=True)
    for b in ex.behaviors:
        if layer is None or b.layer == layer:
            table.add_row(str(b.layer), str(b.head), _fmt(b.entropy), *[_fmt(b.scores[p]) for p in PATTERNS],
                          b.primary_pattern)
    console.print(table)


def _parse_mask(text: str | None, facts):
    """``"3.2,4.7"`` (layer.head, ...) -> a head mask with those heads at 0."""
    import numpy as np

    if text is None:
        return None
    mask = np.ones((facts.n_layers, facts.n_heads), dtype=np.float32)
    for item in filter(None, (t.strip() for t in text.split(","))):
        layer, dot, head = item.partition(".")
        if not dot or not layer.isdigit() or not head.isdigit():
            raise UserError(f"--mask {item!r}: expected LAYER.HEAD, e.g. 3.2")
        mask[facts.check_layer(int(layer)), facts.check_head(int(head))] = 0.0
    return mask


def _write_pngs(ex, folder: Path, layers) -> list[Path]:
    from attnx.interp.visualize import save_layer_pngs

    n = ex.batch.lengths[0]
    pats = {i: ex.patterns[i][0][:, :n, :n] for i in layers}
    return save_layer_pngs(folder, ex.batch.tokens[0], pats, behaviors=ex.behaviors, dpi=80)


def register(app: typer.Typer) -> None:
    @app.command("explain")
    @guarded
    def explain_cmd(
        model: str = typer.Argument(..., help="An export with attention outputs (.onnx), a Hugging Face folder, "
                                    "or a server URL (http://host:port\\[/model])."),
        texts: Optional[List[str]] = typer.Argument(None, help="Text(s) to explain (default: the built-in "
                                                   "sentences with --sentences)."),
        output: Optional[Path] = typer.Option(None, "-o", "--output", help="The HTML page (default: "
                                              "attnx-out/explain/<model>.html); PNG heatmaps go beside it."),
        layer: Optional[int] = typer.Option(None, "--layer", help="Only this layer in the table; the layer "
                                            "--ablate works on (default 0)."),
        ablate: bool = typer.Option(False, "--ablate", help="Ablate each head of --layer through head_mask and "
                                    "rank heads by the output's change; activation patching beside it."),
        target: Optional[str] = typer.Option(None, "--target", help="A causal LM: the token whose logit --ablate "
                                             "follows (text or id; default: the top prediction)."),
        corrupt: Optional[str] = typer.Option(None, "--corrupt", help="Patching's corrupted input: a text of "
                                              "the same token count (default: noise on the embeddings)."),
        no_reference: bool = typer.Option(False, "--no-reference", help="Skip the torch reference (faster)."),
        context: Optional[Path] = typer.Option(None, "--context", help="JSON {input: values} for the variant's "
                                               "context inputs (default: zeros)."),
        against: Optional[Path] = typer.Option(None, "--against", help="A second context JSON: compare both maps "
                                               "per head and the outputs."),
        mask: Optional[str] = typer.Option(None, "--mask", help="Analyse with these heads ablated: "
                                           "LAYER.HEAD[,LAYER.HEAD...]."),
        server_model: Optional[str] = typer.Option(None, "--model", help="The model's name on a server."),
        sentences: bool = typer.Option(False, "--sentences", help="Explain the built-in real sentences."),
        min_score: float = typer.Option(0.5, "--min-score", help="A pattern's lift must reach this to name a "
                                        "head (else mixed)."),
        min_margin: float = typer.Option(0.2, "--min-margin", help="...and lead the runner-up by this much."),
        png: bool = typer.Option(True, "--png/--no-png", help="Write PNG heatmaps of the first text."),
        as_json: bool = typer.Option(False, "--json", help="Print the analysis as JSON."),
    ) -> None:
        """Per-head analysis of a deployed model on real text (entropy, previous-token, first-token/sink,
        self, local-window, primary pattern), an HTML page and PNG heatmaps; head ablation and patching;
        two context values compared."""
        from attnx.explain.analysis import Standout
        from attnx.explain.explanation import compare_contexts, explain
        from attnx.explain.page import explanation_page
        from attnx.explain.source import read_context
        from attnx.interp.patching import ablation_table
        from attnx.interp.source import open_source, reference_source

        texts = list(texts or [])
        if sentences:
            from attnx.pretrained.sentences import SENTENCES

            texts += list(SENTENCES)
        if not texts:
            raise UserError("give a text to explain (or --sentences)")
        if against is not None and context is None:
            raise UserError("--against compares with --context: give both")
        if (target is not None or corrupt is not None) and not ablate:
            raise UserError("--target and --corrupt belong to --ablate")
        standout = Standout(min_score, min_margin)
        source = open_source(model, server_model=server_model)
        try:
            facts = source.facts
            facts.require_patterns()
            if layer is not None:
                facts.check_layer(layer, needs_pattern=not ablate)
            head_mask = _parse_mask(mask, facts)
            ctx_a = read_context(context, facts)
            batch = source.require_text().encode(texts)
            comparison = None
            if against is not None:
                comparison = compare_contexts(source, batch, ctx_a, read_context(against, facts), standout=standout)
                ex = comparison.a
            else:
                ex = explain(source, batch, context=ctx_a, head_mask=head_mask, standout=standout)
            table = None
            if ablate:
                reference = None
                if not no_reference and str(model).lower().endswith(".onnx"):
                    reference = reference_source(Path(model))
                target_id = source.encoder.token_id(target) if target is not None else None
                corrupt_batch = source.encoder.encode([corrupt] * len(texts)) if corrupt is not None else None
                table = ablation_table(source, batch, 0 if layer is None else layer, reference=reference,
                                       patch=not no_reference and (reference is not None or hasattr(source, "model")),
                                       corrupt=corrupt_batch, context=ctx_a, target_id=target_id)
            name = Path(str(model).rstrip("/")).name.removesuffix(".onnx") or "model"
            page = output or workdir() / "explain" / f"{name}.html"
            if page.suffix.lower() not in (".html", ".htm"):
                raise UserError(f"-o {page}: the page is an .html file")
            abl = None if table is None else {"layer": table.layer, "metric": table.metric,
                                              "columns": table.columns, "rows": table.rows}
            page.parent.mkdir(parents=True, exist_ok=True)
            page.write_text(explanation_page(ex, compare=comparison, ablation=abl, layer=layer), encoding="utf-8")
            pngs = _write_pngs(ex, page.with_name(page.stem + "-heatmaps"),
                               [layer] if layer is not None else sorted(ex.patterns)) if png else []
        finally:
            source.close()
        if as_json:
            out = {"model": facts.name, "texts": texts, "tokens": ex.batch.tokens, "page": str(page),
                   "heads": [b.to_dict() for b in ex.behaviors if layer is None or b.layer == layer]}
            if table is not None:
                out["ablation"] = {"layer": table.layer, "metric": table.metric, "columns": table.columns,
                                   "rows": table.rows, "patching": table.patching}
            if comparison is not None:
                out["comparison"] = {"output_distance": comparison.output_distance,
                                     "heads": [d.__dict__ for d in comparison.differences]}
            typer.echo(json.dumps(out, indent=1, default=float))
            return
        console.print(f"{facts.name} ({source.label}): {facts.n_layers} layers x {facts.n_heads} heads; "
                      f"tokens: {' '.join(ex.batch.tokens[0])}", highlight=False)
        _print_heads(ex, layer)
        if comparison is not None:
            _print_comparison(comparison)
        if table is not None:
            _print_ablation(table)
        console.print(f"wrote {page}" + (f" and {len(pngs)} PNG heatmap(s) in {pngs[0].parent}" if pngs else ""),
                      highlight=False)


def _print_comparison(cmp) -> None:
    from rich.table import Table

    d = cmp.output_distance
    console.print(f"output distance (context A vs B): {d['metric']} = {d['value']:.6g}; max |B - A| = "
                  f"{d['max_abs']:.6g}", highlight=False)
    top = sorted(cmp.differences, key=lambda x: -x.mean_abs)[:12]
    table = Table("layer", "head", "max |B-A|", "mean TV", "A primary", "B primary",
                  title="heads whose map changes most", header_style="bold")
    for x in top:
        table.add_row(str(x.layer), str(x.head), f"{x.max_abs:.4f}", f"{x.mean_abs:.4f}",
                      cmp.a.behavior(x.layer, x.head).primary_pattern, cmp.b.behavior(x.layer, x.head).primary_pattern)
    console.print(table)


def _print_ablation(t) -> None:
    from rich.table import Table

    table = Table("rank", "head", *t.columns, title=f"layer {t.layer}: each head ablated ({t.metric})",
                  header_style="bold")
    for rank, row in enumerate(t.rows, 1):
        table.add_row(str(rank), str(row["head"]), *[f"{row[c]:.5g}" for c in t.columns])
    console.print(table)
    if t.patching:
        console.print(f"patching: each head's hook_z restored from the clean run into a run corrupted by "
                      f"{t.patching}", highlight=False)
