"""``attnx export --from-pretrained DIR --with-past``: a decoder that generates, one file for prefill and decode.

The file (:class:`attnx.pretrained.cached.CachedHost` traced by the usual exporter) takes the new tokens,
``attention_mask`` over past + new, ``position_ids`` and the cache ``past_key_values.{i}.key|value`` (plus
any state a variant keeps beside them, :mod:`attnx.models.cache`), and returns ``logits`` and
``present.{i}.*``: Optimum's and onnxruntime-genai's names, dims ``batch``, ``seq`` (new tokens), ``past``
and ``total`` (past + new), all dynamic. ``attnx.cache`` in the metadata lists every cached tensor with
its layer and grown axis, the special tokens and the positions, which is all a generation loop needs
(:mod:`attnx.runtime.core.decoding`).

By default it goes to its own folder, ``attnx-out/<name>-with-past/model.onnx``, with the weights, the
tokenizer folder, and ``genai_config.json`` plus the tokenizer files onnxruntime-genai reads
(:mod:`attnx.export.genai`). Engine profiles: ``seq`` 1..positions (opt 1: decoding), ``past`` 1..positions
(attnx keeps one masked cache slot, so no tensor is ever empty), ``total`` 2..positions + 1.
"""

from __future__ import annotations

from pathlib import Path

from attnx.contract import BATCH, PAST, SEQ, TOTAL


def default_profiles(positions: int, given: dict | None = None) -> dict:
    """Profiles of a with-past export (``given`` batch/seq kept; the cache's axes follow positions)."""
    opt_past = min(128, positions)
    out = {BATCH: (1, 8, 32), SEQ: (1, 1, positions), PAST: (1, opt_past, positions),
           TOTAL: (2, opt_past + 1, positions + 1)}
    out.update(given or {})
    if out[SEQ][2] > positions:
        raise ValueError(f"seq profile max {out[SEQ][2]} exceeds the model's {positions} positions")
    return out


def check(task: str, attention_outputs, head_mask: bool, source) -> None:
    """Before any work: what a with-past export cannot be."""
    if attention_outputs is not None or head_mask:
        raise ValueError("--with-past exports a decoder that generates: attention outputs and head masks are for "
                         "the full-sequence export (leave out --with-past)")
    if task != "causal-lm":
        raise ValueError(f"--with-past needs a causal LM (a decoder that generates); {source or 'this folder'} "
                         f"is {task} (config.json's architectures; --task causal-lm to choose it)")


def prepare(host, profiles):
    """The cached host and its profiles for :func:`attnx.export.pretrained.export_pretrained`."""
    from attnx.pretrained.cached import CachedHost

    cached = CachedHost.of(host)
    return cached, default_profiles(cached.max_seq, profiles)


def finish(onnx_path: Path, info, hf_config: dict, tokenizer_dir, final_folder: Path) -> list[str]:
    """onnxruntime-genai's files beside the (staged) export; notes for the user (about ``final_folder``)."""
    from attnx.export.genai import CONFIG_NAME, genai_support, write_genai_files

    write_genai_files(onnx_path, info, hf_config, tokenizer_dir)
    why = genai_support(info)
    where = final_folder / CONFIG_NAME
    if why:
        return [f"{where} written, but onnxruntime-genai cannot run this file by itself: " + "; ".join(why)]
    return [f"{where} written: onnxruntime-genai runs this folder (og.Model('{final_folder}'))"]
