"""Write docs/models.md from the support-matrix results the tests record (never typed by hand).

    ATTNX_SUPPORT_MATRIX=$PWD/attnx-out/support-matrix.json .venv/bin/pytest tests/test_families.py tests/test_holdout_families.py
    .venv/bin/python tools/support_matrix.py [--results attnx-out/support-matrix.json] [--out docs/models.md]

Each row is one family with one variant, as ``tests/test_families.py`` (the matrix CI runs) and
``tests/test_holdout_families.py`` (families and sizes beyond it) measured it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

HEADER = """# Supported models

attnx places its variants in **transformers' own models**: any family whose attention goes through
transformers' `AttentionInterface` (transformers 5 has hundreds). The table is the support matrix
the tests measure on random-weight folders made with `save_pretrained` (tokenizers trained
in-process), written by `tools/support_matrix.py` from the results `tests/test_families.py` and
`tests/test_holdout_families.py` record: do not edit it by hand.

Columns: the placed variant (`mha` = plain attention with attnx's hooks; the others at their
neutral values, where the placed model equals the original); **ORT vs eager**: max abs difference of
ONNX Runtime on the export against transformers' own `eager` model on padded batches (decoders:
left and right padding, positions from the mask); **ORT vs reference**: against attnx's torch
reference of the placed model; **check**: `attnx check` (against the original model and the
reference, on real text); **engine**: `attnx build-engine --fp16` with TensorRT-RTX (sm89);
**served**: text through `attnx serve` against the same text run directly (`TextModel`).

Families without the attention interface (MPNet, DeBERTa-v2, T5, Bloom, Falcon, GPT-J...) are
refused in one line naming the family.
"""


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "0" if value == 0 else f"{value:.1e}"
    if value is True:
        return "yes"
    return str(value)


def render(results: dict) -> str:
    versions = results.get("_versions", {})
    rows = [v for k, v in results.items() if not k.startswith("_")]
    matrix = sorted((r for r in rows if not r.get("holdout")), key=lambda r: (r["family"], r["variant"] != "mha"))
    holdout = sorted((r for r in rows if r.get("holdout")), key=lambda r: (r["family"], r["variant"] != "mha"))
    lines = [HEADER]
    if versions:
        lines.append("Measured with " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())) + ".\n")
    lines += ["## The matrix (CI)\n",
              "| family | architecture | task | variant | ORT vs eager | padding | ORT vs reference | check | engine fp16 "
              "| served vs direct |",
              "|---|---|---|---|---:|---|---:|---|---|---:|"]
    for r in matrix:
        lines.append(f"| {r['family']} | {fmt(r.get('architecture'))} | {fmt(r.get('task'))} | {r['variant']} | "
                     f"{fmt(r.get('ort_vs_eager'))} | {fmt(r.get('padding'))} | {fmt(r.get('ort_vs_reference'))} | "
                     f"{fmt(r.get('check'))} | {fmt(r.get('engine_fp16'))} | {fmt(r.get('served_vs_direct'))} |")
    if holdout:
        lines += ["", "## Hold-out families and sizes\n",
                  "Families the matrix does not name, at other sizes (`tests/test_holdout_families.py`): ONNX Runtime "
                  "on the export against transformers' `eager` model on padded batches.\n",
                  "| family | architecture | size | variant | ORT vs eager | padding |",
                  "|---|---|---|---|---:|---|"]
        for r in holdout:
            lines.append(f"| {r['family']} | {fmt(r.get('architecture'))} | {fmt(r.get('size'))} | {r['variant']} | "
                         f"{fmt(r.get('ort_vs_eager'))} | {fmt(r.get('padding'))} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=ROOT / "attnx-out" / "support-matrix.json")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "models.md")
    args = parser.parse_args(argv)
    if not args.results.is_file():
        parser.error(f"{args.results}: no results; run the tests that record them first (see this script's doc)")
    args.out.write_text(render(json.loads(args.results.read_text())))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
