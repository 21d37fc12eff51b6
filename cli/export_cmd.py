"""`attnx export` and `attnx inspect`."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import List, Optional

import typer

from attnx.cli._common import StageLines, UserError, console, err_console, guarded, workdir


def parse_sets(variant: str, sets: list[str]) -> dict:
    """``key=value`` pairs, each validated and typed against the variant's (and encoder's) config."""
    from dataclasses import fields

    from attnx.models.encoder import EncoderConfig
    from attnx.models.spec import get_spec

    defaults = {**get_spec(variant).options(), **{f.name: f.default for f in fields(EncoderConfig)}}
    out = {}
    for item in sets:
        if "=" not in item:
            raise UserError(f"--set {item!r}: expected key=value")
        key, raw = (s.strip() for s in item.split("=", 1))
        if key not in defaults:
            raise UserError(f"--set {key}: unknown option for variant {variant!r}; valid: {', '.join(sorted(defaults))}")
        default = defaults[key]
        try:
            if isinstance(default, bool):
                low = raw.lower()
                if low not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                    raise ValueError
                value = low in ("true", "1", "yes", "on")
            elif isinstance(default, int):
                value = int(raw)
            elif isinstance(default, float):
                value = float(raw)
            elif isinstance(default, str):
                value = raw
            else:  # tuple | None (layer_variants)
                value = tuple(v.strip() for v in raw.split(",")) if raw else None
        except ValueError:
            raise UserError(f"--set {key}={raw}: expected {type(default).__name__} (default {default!r})") from None
        out[key] = value
    return out


def parse_layers(text: str | None) -> tuple[int, ...] | None:
    """``--layers-replaced``: ``all`` (None), ``none`` (no layer) or ``0,3,5``."""
    if text is None or text.strip().lower() == "all":
        return None
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(int(v) for v in text.replace(" ", "").split(",") if v != "")
    except ValueError:
        raise UserError(f"--layers-replaced {text!r}: expected all, none, or layer indices like 0,3,5") from None


def export_outputs(output: Path) -> list[Path]:
    """What exporting to ``output`` writes or replaces: the model, its external data, the weights beside it,
    a text model's tokenizer folder, and the staging folder they are written in first."""
    from attnx.export.exporter import export_names
    from attnx.export.staging import MARK

    return [output.with_name(n) for n in sorted(export_names(output))] + \
        [output.with_name(f".{output.name}{MARK}{os.getpid()}")]


def refuse_overwriting_inputs(output: Path, checkpoint: Path | None, pretrained: Path | None) -> None:
    """An export must not replace what it reads: the checkpoint, or any file of the pretrained folder."""
    for written in export_outputs(output):
        target = written.resolve()
        if checkpoint is not None and (target == checkpoint.resolve() or checkpoint.resolve().is_relative_to(target)):
            raise UserError(f"-o {output} would overwrite the checkpoint {checkpoint} it reads (the export writes "
                            f"{written.name}): choose another output name")
        if pretrained is not None:
            folder = pretrained.resolve()
            if (target.is_relative_to(folder) and target.exists()) or folder.is_relative_to(target):
                raise UserError(f"-o {output} would overwrite {written} in the model folder it exports from: "
                                "choose another output name or folder")


#: What each export step shows.
# A --with-past export reads its weights when it writes them: "loading" builds the model, "writing" reads,
# converts or quantizes each weight and writes it.
STEP_LABELS = {"load": "loading the model", "trace": "tracing (torch.export)", "translate": "translating to ONNX",
               "optimise": "optimising the graph", "check": "checking the graph", "save": "writing",
               "int8": "quantizing to int8", "weights": "MatMulNBits in the graph (each weight quantized as written)",
               "commit": "making the files visible"}


@contextlib.contextmanager
def export_progress(label: str):
    """``step(name, done=None, total=None)`` for the exporter: each step on its own line with its time, and a
    bar where it counts (bytes written), drawn on a terminal; elsewhere (logs, pipes) one plain line per step
    (:class:`~attnx.cli._common.StageLines`)."""
    import time

    from rich.progress import BarColumn, DownloadColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    class Counted:  # a column shown only for a step that counts
        def __init__(self, column):
            self.column = column

        def __getattr__(self, name):
            return getattr(self.column, name)

        def __call__(self, task):
            return self.column(task) if task.total is not None else ""

    shown = console.is_terminal and err_console.is_terminal
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), Counted(BarColumn()), Counted(DownloadColumn()),
                  TimeElapsedColumn(), console=console, transient=True, disable=not shown) as progress:
        current = {"name": None, "task": None, "started": time.monotonic()}
        lines = None if shown else StageLines(f"export {label}")

        def step(name: str, done: int | None = None, total: int | None = None) -> None:
            if name != current["name"]:  # a new step: the last one's time stays on screen
                if current["task"] is not None:
                    progress.remove_task(current["task"])
                if current["task"] is not None and shown:
                    progress.console.print(f"  [dim]{STEP_LABELS.get(current['name'], current['name'])}: "
                                           f"{time.monotonic() - current['started']:.1f}s[/dim]", highlight=False)
                current.update(name=name, started=time.monotonic(),
                               task=progress.add_task(f"export {label}: {STEP_LABELS.get(name, name)}", total=total))
            progress.update(current["task"], total=total, completed=done or 0)
            if lines is not None:
                lines(STEP_LABELS.get(name, name))

        yield step
        if lines is not None:
            lines.finish()


def register(app: typer.Typer) -> None:
    @app.command("export")
    @guarded
    def export(
        variant: Optional[str] = typer.Option(None, "--variant", help="A registered variant (see `attnx variants`); "
                                              "with --from-pretrained, default mha (or the placement a folder saved "
                                              "from a placed model carries)."),
        pretrained: Optional[Path] = typer.Option(None, "--from-pretrained", help="A local Hugging Face folder of any "
                                                  "family whose attention goes through transformers' attention "
                                                  "interface (encoders, decoders, classifiers) to place the variant in."),
        task: Optional[str] = typer.Option(None, "--task", help="With --from-pretrained: feature-extraction | "
                                           "causal-lm | sequence-classification (default: from config.json's "
                                           "architectures)."),
        layers_replaced: Optional[str] = typer.Option(None, "--layers-replaced", help="With --from-pretrained: the "
                                                      "layers whose attention the variant replaces: all | none | 0,3,5 "
                                                      "(default all; none for a variant appended by default)."),
        append: Optional[int] = typer.Option(None, "--append", help="With --from-pretrained: variant layers appended "
                                             "after the encoder (MAW's own form; default 1 for maw, else 0)."),
        output: Optional[Path] = typer.Option(None, "-o", "--output", help="Output .onnx (default: attnx-out/<name>.onnx)."),
        lowering: str = typer.Option("plugin", "--lowering", help="plugin (custom ops) | rewrite (standard ops only)"),
        fp16: bool = typer.Option(False, "--fp16", help="fp16 weights/activations; softmax, LayerNorm, reductions in fp32."),
        int8: bool = typer.Option(False, "--int8", help="CPU int8: MatMul/Gemm weights int8, activations quantized "
                                  "per token at run time (smoothed, calibrated on built-in sentences); softmax, "
                                  "LayerNorm and custom ops stay float."),
        int8_weight_bits: Optional[int] = typer.Option(None, "--int8-weight-bits", help="With --int8: 7 (default; "
                                                       "exact on every CPU) or 8 (more accurate; only for CPUs with "
                                                       "VNNI, AMX or ARM: AVX2 without VNNI saturates them)."),
        weights: Optional[str] = typer.Option(None, "--weights", help="With --with-past: int4 | int8 weight-only "
                                              "quantization of the decoder's MatMul weights (ONNX Runtime's MatMulNBits "
                                              "in blocks of 64 where they divide every weight, else 32: int8 "
                                              "asymmetric; int4 symmetric, its lm_head at 8 bits); "
                                              "no calibration. Decode reads ~3.5x (int8) / ~5x (int4) fewer bytes."),
        block_size: Optional[int] = typer.Option(None, "--block-size", help="With --weights: weights per block (one "
                                                 "scale each) along K, a power of 2 >= 16 (default 64 where it divides "
                                                 "every K and the source holds no GGUF blocks of these bits, else 32; "
                                                 "larger: a smaller file, faster kernels, coarser rounding)."),
        lm_head_bits: Optional[int] = typer.Option(None, "--lm-head-bits", help="With --weights: the lm_head's bits, "
                                                   "4 or 8 (default: 8 for int4, more accurate for ~8% more decode "
                                                   "time; 4 as onnxruntime-genai's and llama.cpp's 4-bit files)."),
        no_fuse: bool = typer.Option(False, "--no-fuse", help="Skip the exact graph fusions (packed Q/K/V, 3-D "
                                     "attention), e.g. to compare against them."),
        sets: List[str] = typer.Option([], "--set", help="Config option key=value (repeatable); see `attnx variants`."),
        checkpoint: Optional[Path] = typer.Option(None, "--checkpoint", help="safetensors weights to load (with "
                                                  "--from-pretrained: the placed variant's trained parameters)."),
        layers: Optional[int] = typer.Option(None, "--layers", help="Number of encoder layers (default 2; not with "
                                             "--from-pretrained)."),
        opset: int = typer.Option(23, "--opset", help="ONNX opset (default 23: plain attention is one Attention op)."),
        seed: int = typer.Option(0, "--seed", help="Seed for the initial weights."),
        batch: Optional[str] = typer.Option(None, "--batch", help="Batch profile min,opt,max for engines (default 1,8,32)."),
        seq: Optional[str] = typer.Option(None, "--seq", help="Sequence profile min,opt,max (default 1,128,512; "
                                          "pretrained: up to the model's max length)."),
        attention_outputs: Optional[str] = typer.Option(None, "--attention-outputs", help="Add outputs "
                                                        "attentions.{i} [batch, heads, seq, seq]: all | 0,3,5."),
        head_mask: bool = typer.Option(False, "--head-mask", help="Add an input head_mask [layers, heads] "
                                       "(1 = keep, 0 = ablate a head)."),
        copy_weights: bool = typer.Option(False, "--copy-weights", help="With --from-pretrained: also store the "
                                          "pretrained weights beside the export, so `attnx check` needs no source "
                                          "folder (default: check reads them from the folder, its sha256 recorded)."),
        with_past: bool = typer.Option(False, "--with-past", help="With --from-pretrained (a causal LM): the "
                                       "decoder that generates, KV cache in (past_key_values.*) and out (present.*), "
                                       "one file for prefill and decode, in its own folder with genai_config.json "
                                       "for onnxruntime-genai (`attnx generate`, `attnx serve`)."),
        no_verify: bool = typer.Option(False, "--no-verify", help="Skip the check after export (one case, batch 1 "
                                       "and 8 tokens, through ONNX Runtime against the PyTorch model still in "
                                       "memory, at `attnx check`'s tolerance; run where the weights are in memory "
                                       "and under 2 GiB)."),
    ) -> None:
        """Export a variant to ONNX (custom ops in domain attnx): attnx's own encoder stack, or a real
        pretrained model with the variant placed in it (--from-pretrained)."""
        from attnx.contract import DEFAULT_PROFILES, parse_profile
        from attnx.export.exporter import LOWERINGS, default_path, export_variant

        if lowering not in LOWERINGS:
            raise UserError(f"--lowering {lowering!r}: valid: {', '.join(LOWERINGS)}")
        if int8 and fp16:
            raise UserError("--int8 and --fp16 cannot be combined: int8 quantizes the fp32 export (choose one)")
        if int8_weight_bits is not None and not int8:
            raise UserError("--int8-weight-bits needs --int8")
        if int8_weight_bits not in (None, 7, 8):
            raise UserError(f"--int8-weight-bits {int8_weight_bits}: valid: 7 (every CPU) or 8 (VNNI, AMX, ARM)")
        if weights is not None:
            from attnx.export.weight_only import WEIGHTS

            if weights not in WEIGHTS:
                raise UserError(f"--weights {weights}: valid: {', '.join(WEIGHTS)}")
            if not with_past or int8 or fp16:
                raise UserError("--weights quantizes the weights of a --with-past decoder (fp32 activations): add "
                                "--with-past, and leave out --int8 and --fp16 (choose one precision)")
        if (block_size is not None or lm_head_bits is not None) and weights is None:
            raise UserError("--block-size and --lm-head-bits set --weights' blocks: add --weights int4|int8")
        if block_size is not None and (block_size < 16 or block_size & (block_size - 1)):
            raise UserError(f"--block-size {block_size}: a power of 2 >= 16 (16, 32, 64, 128, ...)")
        if lm_head_bits not in (None, 4, 8):
            raise UserError(f"--lm-head-bits {lm_head_bits}: valid: 4, 8")
        if variant is None and pretrained is None:
            raise UserError("--variant is required (or --from-pretrained FOLDER to export a real model)")
        if variant is not None and not variant.strip():
            from attnx.models.spec import variant_names

            raise UserError(f"--variant is empty; valid: {', '.join(variant_names())}")
        if copy_weights and pretrained is None:
            raise UserError("--copy-weights stores a pretrained folder's weights beside the export: add "
                            "--from-pretrained (attnx's own encoders always carry their weights)")
        if task is not None and pretrained is None:
            raise UserError("--task chooses the head of a --from-pretrained model: add --from-pretrained")
        if with_past and pretrained is None:
            raise UserError("--with-past exports a pretrained decoder with its KV cache: add --from-pretrained")
        if with_past and (attention_outputs is not None or head_mask):
            raise UserError("--with-past cannot be combined with --attention-outputs or --head-mask (they belong to "
                            "the full-sequence export)")
        asked_variant = variant
        folder = None
        if pretrained is not None:
            from attnx.pretrained import read_folder

            folder = read_folder(pretrained)
            if variant is None and folder.placement is not None:
                variant = folder.placement["variant"]
        variant = "mha" if variant is None else variant
        if output is not None and output.suffix.lower() != ".onnx":
            raise UserError(f"-o {output}: the output must be a .onnx file (the weights and tokenizer are written "
                            "beside it)")
        if pretrained is None and (layers_replaced is not None or append is not None):
            raise UserError("--layers-replaced and --append place a variant in a pretrained model: add --from-pretrained")
        if pretrained is not None and layers is not None:
            raise UserError("--layers sets the size of attnx's own encoder; with --from-pretrained use --layers-replaced")
        profiles = None if pretrained is not None and batch is None and seq is None else dict(DEFAULT_PROFILES)
        for axis, text in (("batch", batch), ("seq", seq)):
            if text is not None:
                profiles[axis] = parse_profile(text, f"--{axis}")
        planned = output
        if planned is None and pretrained is None:
            planned = default_path(variant, lowering, fp16, workdir())
        elif planned is None:
            from attnx.export.pretrained import default_name

            planned = workdir() / f"{default_name(folder, variant, lowering, fp16)}.onnx"
            if with_past:  # a quantized one in a folder of its own: genai_config.json names one file
                planned = output = workdir() / (f"{default_name(folder, variant, lowering, fp16)}-with-past"
                                                + (f"-{weights}" if weights else "")) / "model.onnx"
        if int8 and output is None:
            planned = output = planned.with_name(f"{planned.stem}-int8.onnx")
        refuse_overwriting_inputs(planned, checkpoint, pretrained)
        label = f"{pretrained.name} + {variant}" if pretrained is not None else variant
        with export_progress(label) as step:
            if pretrained is not None:
                from attnx.export.pretrained import export_pretrained
                from attnx.models.spec import get_spec

                options = parse_sets(variant, sets)
                shared = {"d_model", "n_heads", "dropout", "is_causal", "qkv_bias", "head_size"}
                bad = sorted(set(options) - set(get_spec(variant).options()) | (set(options) & shared))
                if bad:
                    raise UserError(f"--set {bad[0]}: with --from-pretrained only the variant's own options can be "
                                    "set (sizes come from the model's config.json)")
                saved = folder.placement is not None and asked_variant is None and layers_replaced is None \
                    and append is None and not options
                result = export_pretrained(pretrained, output, variant=None if saved else variant,
                                           layers=parse_layers(layers_replaced), append=append, options=options,
                                           checkpoint=checkpoint, task=task, lowering=lowering,
                                           fp16=fp16, profiles=profiles, folder_out=workdir(), progress=step,
                                           attention_outputs=attention_outputs, head_mask=head_mask,
                                           fuse=not no_fuse, with_past=with_past, copy_weights=copy_weights,
                                           int8_weight_bits=(int8_weight_bits or 7) if int8 else None,
                                           weight_only_bits=WEIGHTS[weights] if weights else None,
                                           weight_only_options={k: v for k, v in (("block_size", block_size),
                                                                                  ("lm_head_bits", lm_head_bits))
                                                                if v is not None})
            else:
                if layers is not None and layers < 1:
                    raise UserError(f"--layers must be >= 1, got {layers}")
                overrides = parse_sets(variant, sets)
                path = output or default_path(variant, lowering, fp16, workdir())
                result = export_variant(variant, path, overrides=overrides, n_layers=layers, lowering=lowering,
                                        fp16=fp16, checkpoint=checkpoint, opset=opset, seed=seed, profiles=profiles,
                                        progress=step, attention_outputs=attention_outputs, head_mask=head_mask,
                                        fuse=not no_fuse, int8_weight_bits=(int8_weight_bits or 7) if int8 else None)
        info = result.info
        for note in result.notes:
            console.print(f"[yellow]note:[/yellow] {note}", highlight=False)
        if int8_weight_bits == 8:
            from attnx.runtime.core.cpu import int8_dot_product, saturates_8bit_weights

            if saturates_8bit_weights():  # the file is fine; this CPU is the wrong one to serve it on
                console.print(f"[yellow]note:[/yellow] this CPU's integer dot product is {int8_dot_product()}: "
                              "serve this file on a CPU with VNNI, AMX or ARM dot products", highlight=False)
        if info.reference:
            console.print(f"reference for `attnx check`: the pretrained weights of {info.reference['source']} "
                          f"(sha256 recorded; --copy-weights stores them beside the export instead)", highlight=False)
        size = sum(p.stat().st_size for p in (result.path, result.path.with_name(result.path.name + ".data"))
                   if p.is_file())
        console.print(f"wrote [bold]{result.path}[/bold] ({info.lowering}, {info.precision}, "
                      f"{sum(p.numel() for p in result.model.parameters()):,} parameters, {size / 1e6:,.1f} MB)",
                      highlight=False)
        if not no_verify:
            from attnx.parity.after_export import verify_export

            verified = verify_export(result.model, result.path, info)
            if verified.passed is False:  # the file stays: `attnx check` tells the whole story
                raise UserError(verified.line, code=1)
            console.print(verified.line, highlight=False)
        typer.echo(str(result.path))

    @app.command("inspect")
    @guarded
    def inspect(model: Path = typer.Argument(..., help="Any .onnx file."),
                as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
        """Show an ONNX file's inputs/outputs, opsets, custom ops, metadata and size."""
        from rich.markup import escape
        from rich.table import Table

        from attnx.export.describe import describe_model
        from attnx.export.ops import register_schemas

        register_schemas()  # the attnx ops' schemas live in this process only once registered
        info = describe_model(model)
        if as_json:
            typer.echo(json.dumps(info, indent=2))
            return
        console.print(f"[bold]{escape(info['path'])}[/bold]  IR {info['ir_version']}  producer {escape(info['producer'] or '?')}")
        console.print("opsets: " + ", ".join(f"{d} {v}" for d, v in info["opsets"].items()))
        table = Table("", "name", "dtype", "shape", header_style="bold")
        for kind in ("inputs", "outputs"):
            for t in info[kind]:
                table.add_row(kind[:-1], t["name"], t["dtype"], escape(str(t["shape"])))
        console.print(table)
        if info["custom_ops"]:
            ct = Table("custom op", "count", "function body", "schema registered", header_style="bold")
            for c in info["custom_ops"]:
                ct.add_row(f"{c['domain']}::{c['op']}", str(c["count"]), "yes" if c["function_body"] else "NO",
                           "yes" if c["schema"] else "no")
            console.print(ct)
        else:
            console.print("custom ops: none")
        console.print(f"nodes: {info['nodes']}  parameters: {info['parameters']:,}"
                      + ("  (external data)" if info["external_data"] else ""))
        console.print("ops: " + ", ".join(f"{k} x{v}" for k, v in info["op_counts"].items()), highlight=False)
        if info["metadata"]:
            mt = Table("metadata key", "value", header_style="bold")
            for k, v in info["metadata"].items():
                mt.add_row(k, escape(v if len(v) <= 160 else v[:157] + "..."))
            console.print(mt)
