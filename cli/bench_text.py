"""``attnx bench --text``: load a text model with real-word texts and check every answer.

Against a running server (``--url``, texts sent as ``BYTES`` through ``tritonclient.http``) or in
this process (the model's batcher, tokenising as the server does). Each pool text is first run alone,
one at a time; every answer under load is compared with that single run (``wrong`` in the table),
failures are counted (``errors``), and the (server's) resident memory is read before and after.
``--compare-batch-1`` (in-process) runs the same load with batching off, in interleaved rounds, and
prints the throughput ratio.
"""

from __future__ import annotations

from pathlib import Path

from attnx.cli._common import UserError, console, err_console, latest_export


def _mib(value: int | None) -> str:
    return f"{value / (1 << 20):.0f} MiB" if value is not None else "unknown"


def _remote_model(url: str, model: str | None) -> tuple[str, dict]:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url.split("://", 1)[-1].rstrip("/"))
    try:
        if model is None:
            index = client.get_model_repository_index()
            if not index:
                raise UserError(f"the server at {url} lists no models")
            model = index[0]["name"]
        return model, client.get_model_metadata(model)
    finally:
        client.close()


def bench_text(model: str | None, *, url: str | None, concurrency: int, duration: float, min_tokens: int,
               max_tokens: int, count: int, outputs: list[str] | None, tokenizer: Path | None, batching,
               device: str, threads: int | None, compare_batch_1: bool, rounds: int) -> dict:
    """Run the load, print the table and memory lines; returns the numbers (for ``--report``)."""
    from attnx.deploy import loadtest as b
    from attnx.runtime.core.text import TextTokenizer

    if not 1 <= min_tokens <= max_tokens or count < 1 or rounds < 1:
        raise UserError("need 1 <= --min-tokens <= --max-tokens, --texts >= 1 and --rounds >= 1")
    configs: list[tuple[str, object]] = []
    if url:
        model, meta = _remote_model(url, model)
        if not any(i["datatype"] == "BYTES" for i in meta.get("inputs", [])):
            raise UserError(f"model {model!r} at {url} takes no text (no BYTES input)")
        if tokenizer is None:
            raise UserError("--text with --url needs --tokenizer DIR (the export's .tokenizer folder) to size texts")
        tok = TextTokenizer.from_folder(tokenizer, meta.get("parameters", {}).get("max_length"))
        names = outputs or (["sentence_embedding"] if any(o["name"] == "sentence_embedding"
                                                           for o in meta["outputs"]) else None)
        configs.append((f"{model} @ {url}", b.HttpTarget(url, model, text=True, outputs=names).factory))
        batchers = []

        specs = specs_from_metadata(meta)
    else:
        from attnx.runtime import DynamicBatcher, load

        path = Path(model) if model else latest_export()
        if not path.is_file():
            raise UserError(f"no model file at {path}")
        session = load(path, device=device, threads=threads)
        tok = TextTokenizer.from_folder(tokenizer) if tokenizer else TextTokenizer.from_export(path, session.info)
        if tok is None:
            raise UserError(f"{path.name} carries no tokenizer: pass --tokenizer DIR")
        names = outputs or (["sentence_embedding"] if "sentence_embedding" in session.output_names else None)
        specs = session.inputs
        variants = [(f"max batch {batching.max_batch_size}", batching)]
        if compare_batch_1:
            from dataclasses import replace

            variants.append(("max batch 1", replace(batching, max_batch_size=1)))
        batchers = [DynamicBatcher(session, cfg, name=label, pad_id=tok.pad_id) for label, cfg in variants]
        for (label, _), batcher in zip(variants, batchers):
            configs.append((f"{path.name} in-process, {label}", b.TextInProcessTarget(batcher, tok, names).factory))
    try:
        context = b.text_context_specs(specs)
    except ValueError as e:
        raise UserError(str(e)) from None
    pool = b.text_pool(tok, count, min_tokens=min_tokens, max_tokens=max_tokens, context=context)
    rss_before = b.rss_bytes(url)
    try:
        reference = b.single_answers(configs[0][1], pool)  # each text alone: the answers load must reproduce
        verify = b.answers_match(reference)
        parts: dict[str, list] = {label: [] for label, _ in configs}
        for _ in range(rounds):  # interleaved, so background load hits every configuration alike
            for (label, factory), batcher in zip(configs, batchers or [None] * len(configs)):
                before = (batcher.stats.batches, batcher.stats.rows) if batcher else None
                part = b.run_load(factory, pool, concurrency=concurrency, duration_s=duration / rounds,
                                  label=label, verify=verify)
                if batcher is not None:
                    batches = batcher.stats.batches - before[0]
                    part.mean_batch_rows = (batcher.stats.rows - before[1]) / batches if batches else None
                parts[label].append(part)
    finally:
        for batcher in batchers:
            batcher.close()
    rss_after = b.rss_bytes(url)
    results = [b.merge_results(p, label) for label, p in parts.items()]
    baseline = results[1] if len(results) > 1 else None
    console.print(b.render(results, title=f"attnx bench --text: {count} texts of {min_tokens}-{max_tokens} tokens, "
                                          f"{concurrency} clients", baseline=baseline))
    lost = sum(sum(r.errors.values()) for r in results)
    wrong = sum(r.mismatched for r in results)
    whose = "server" if url else "this process"
    err_console.print(f"RSS of {whose}: {_mib(rss_before)} before, {_mib(rss_after)} after; "
                      f"{lost} lost, {wrong} different from the single runs", highlight=False)
    if baseline is not None and baseline.sequences_per_s:
        err_console.print(f"dynamic batching: {results[0].sequences_per_s / baseline.sequences_per_s:.2f}x the "
                          f"throughput of --max-batch 1", highlight=False)
    numbers = {"runs": [r.summary() for r in results], "rss_before": rss_before, "rss_after": rss_after,
               "lost": lost, "mismatched": wrong}
    if sum(r.ok for r in results) == 0:
        raise UserError(f"no request succeeded; errors: {[dict(r.errors) for r in results]}", code=1)
    return numbers


def specs_from_metadata(meta: dict):
    """TensorSpecs from KServe model metadata (-1 dims: batch first, then seq where the rank says so)."""
    import numpy as np

    from attnx.contract import BATCH, SEQ, default_role
    from attnx.runtime.serving.signature import TRITON_TO_NUMPY
    from attnx.runtime.core.session import TensorSpec

    specs = []
    for t in meta.get("inputs", []):
        if t["datatype"] == "BYTES":  # a text model's text input: its token-id inputs are used instead
            continue
        dims: list = []
        for axis, d in enumerate(t["shape"]):
            if d != -1:
                dims.append(d)
            else:
                dims.append(BATCH if axis == 0 else SEQ if SEQ not in dims else "?")
        specs.append(TensorSpec(t["name"], np.dtype(TRITON_TO_NUMPY[t["datatype"]]), tuple(dims),
                                default_role(t["name"], True)))
    return specs
