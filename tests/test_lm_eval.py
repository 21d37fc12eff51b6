"""EleutherAI's lm-evaluation-harness against `attnx serve` (issue 46): the numbers its ``hf`` backend gives.

Three small local tasks (``tests/data/lm_eval``: lm-eval's ``dataset_path: json`` on JSONL files, nothing
fetched) cover the three request kinds: multiple choice (loglikelihood: acc, acc_norm), perplexity
(loglikelihood_rolling: word/byte perplexity) and greedy generation (generate_until: exact_match). lm-eval's
``local-completions`` (token ids and text, ``tokenized_requests`` true and false) and
``local-chat-completions`` run them against the tiny random Llama's with-past export served over loopback, and
``hf`` runs them on the folder that export came from: the same accuracy, per-sample loglikelihoods within 1e-3
(read from ``log_samples``), the same greedy text, perplexities within 1e-3 relative. The same requests run on
its ``--weights int8|int4`` exports, whose distance from fp32 is bounded. The ``lm-eval`` command itself and
``HFLM`` on a placed model from ``attnx.pretrained.load`` (docs/evaluation.md's two ways) are tested too.

The served tokenizer adds no BOS (like SmolLM2's, GPT-2's, Qwen's): a text prompt is then scored on the tokens
lm-eval counted. A tokenizer that prepends BOS to text (Llama's) gets lm-eval's ``add_bos_token=True`` on both
sides and token-id requests (docs/evaluation.md); ``test_a_placed_model_through_hflm_and_the_server`` runs that.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import generation_fixtures as gf
from conftest_runtime import running_server
from support import exports

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks read local JSONL; nothing is fetched (HF_HUB_OFFLINE: conftest)

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "data" / "lm_eval"
CHOICE, TEXT, COMPLETE = "attnx_choice", "attnx_text", "attnx_complete"
#: the tiny Llama's positions (hf reads them from config.json; the API backend is told)
POSITIONS = 64


def _without_bos(path: Path) -> None:
    """Replace (never edit: the files may be hard links into the cache) a tokenizer.json by one whose
    post-processor adds nothing: text in, the text's tokens out."""
    spec = json.loads(path.read_text())
    spec["post_processor"] = None
    path.unlink()
    path.write_text(json.dumps(spec))


@pytest.fixture(scope="module")
def tm():
    """lm-eval's index of these tasks only (its thousands of built-in task files take ~20 s to index here).
    lm-eval is imported here, not at collection: ~9 s that every test worker would otherwise pay."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS), include_defaults=False)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The tiny random Llama's folder, its tokenizer without BOS."""
    out = tmp_path_factory.mktemp("lm-eval") / "llama"
    shutil.copytree(gf.folder("llama"), out)
    _without_bos(out / "tokenizer.json")
    return out


def _served_copy(model: Path, tmp: Path) -> Path:
    copy = exports.linked_copy(model, tmp)
    for tok in (copy.parent / "tokenizer.json", copy.parent / "model.tokenizer" / "tokenizer.json"):
        if tok.is_file():
            _without_bos(tok)
    return copy


@pytest.fixture(scope="module")
def paths(tmp_path_factory, folder) -> dict[str, Path]:
    """fp32, int8 and int4 with-past exports of that folder's weights (from the cache), with its tokenizer; and
    the chat-template Llama (same weights, BOS tokenizer, a template that starts with BOS); maw placed in the
    Llama and moved off its neutral values (a trained placement), exported as saved."""
    root = tmp_path_factory.mktemp("lm-eval-served")
    made = {"llm": _served_copy(gf.export(gf.folder("llama"), "mha"), root / "fp32")}
    for bits in (8, 4):
        made[f"llm-int{bits}"] = _served_copy(gf.export(gf.folder("llama"), "mha", weight_only_bits=bits),
                                              root / f"int{bits}")
    made["chat"] = gf.export(gf.chat_folder(), "mha")
    made["maw"] = gf.export(gf.trained_folder("llama", "maw"), None, "plugin")
    return made


@pytest.fixture(scope="module")
def server(paths):
    with running_server(paths) as s:
        yield s


def evaluate(tm, model, model_args, tasks, **kw) -> dict:
    """``lm_eval.simple_evaluate`` with the per-sample records, run where the tasks' relative paths hold."""
    import lm_eval

    with contextlib.chdir(ROOT):
        return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(tasks), task_manager=tm,
                                       log_samples=True, batch_size=1, **kw)


def api_args(server, paths, model: str, *, tokenized: bool = True, **more) -> dict:
    """``local-completions`` against ``model``, with its served tokenizer folder (lm-eval counts the context's
    tokens with it)."""
    return dict(base_url=f"{server.url}/v1/completions", model=model, tokenizer_backend="huggingface",
                tokenizer=str(paths[model].parent / "model.tokenizer"), tokenized_requests=tokenized,
                max_length=POSITIONS, **more)


def hf_args(folder: Path, **more) -> dict:
    return dict(pretrained=str(folder), device="cpu", dtype="float32", **more)


@pytest.fixture(scope="module")
def hf(tm, folder) -> dict:
    """lm-eval's ``hf`` backend on the folder: every number of the three tasks."""
    return evaluate(tm, "hf", hf_args(folder), [CHOICE, TEXT, COMPLETE])


def loglikelihoods(result: dict, task: str) -> np.ndarray:
    """Per-sample loglikelihoods in document order: each question's choices in turn (multiple choice), one value
    per text (rolling)."""
    return np.array([r[0][0] if isinstance(r[0], (list, tuple)) else r[0]
                     for sample in sorted(result["samples"][task], key=lambda s: s["doc_id"])
                     for r in sample["resps"]], dtype=np.float64)


def generations(result: dict, task: str = COMPLETE) -> list[str]:
    return [s["resps"][0][0] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


def metric(result: dict, task: str, name: str) -> float:
    (value,) = [v for k, v in result["results"][task].items() if k.split(",")[0] == name]
    return float(value)


# --- generate_until: greedy text -------------------------------------------------------------------------------------

@pytest.mark.parametrize("tokenized", [True, False], ids=["token-ids", "text"])
def test_completions_generate_what_hf_generates(tm, server, paths, hf, tokenized):
    got = evaluate(tm, "local-completions", api_args(server, paths, "llm", tokenized=tokenized), [COMPLETE])
    assert generations(got) == generations(hf)
    assert metric(got, COMPLETE, "exact_match") == metric(hf, COMPLETE, "exact_match")


def test_chat_completions_generate_what_hf_generates_with_the_chat_template(tm, server, paths):
    """lm-eval renders no template for chat completions (and needs no tokenizer): the server renders the model's;
    ``hf`` renders the folder's with ``apply_chat_template`` (its ``<s>`` then tokenized as the one BOS)."""
    got = evaluate(tm, "local-chat-completions", {"base_url": f"{server.url}/v1/chat/completions", "model": "chat"},
                   [COMPLETE], apply_chat_template=True)
    want = evaluate(tm, "hf", hf_args(gf.chat_folder()), [COMPLETE], apply_chat_template=True)
    assert generations(got) == generations(want)
    assert len(set(generations(got))) > 1  # prompts that differ give texts that differ: the prompt reached the model


# --- loglikelihood and loglikelihood_rolling: the prompt's logprobs ------------------------------------------------

@pytest.mark.parametrize("tokenized", [True, False], ids=["token-ids", "text"])
def test_completions_score_what_hf_scores(tm, server, paths, hf, tokenized):
    """Multiple choice and perplexity through ``echo`` + ``logprobs``: the same choices win, every sample's
    loglikelihood within 1e-3 of transformers' (fp32 here, ONNX Runtime there: ~1e-5 apart), the same greedy
    flags, perplexities within 1e-3 relative."""
    got = evaluate(tm, "local-completions", api_args(server, paths, "llm", tokenized=tokenized), [CHOICE, TEXT])
    for task in (CHOICE, TEXT):
        np.testing.assert_allclose(loglikelihoods(got, task), loglikelihoods(hf, task), rtol=0, atol=1e-3,
                                   err_msg=task)
    greedy = [[r[0][1] for r in s["resps"]] for s in sorted(got["samples"][CHOICE], key=lambda s: s["doc_id"])]
    want = [[r[0][1] for r in s["resps"]] for s in sorted(hf["samples"][CHOICE], key=lambda s: s["doc_id"])]
    assert greedy == want
    for name in ("acc", "acc_norm"):
        assert metric(got, CHOICE, name) == metric(hf, CHOICE, name), name
    for name in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert metric(got, TEXT, name) == pytest.approx(metric(hf, TEXT, name), rel=1e-3), name


def test_the_remote_tokenizer_backend_needs_no_local_folder(tm, paths, hf):
    """``tokenizer_backend=remote``: lm-eval reads ``GET /tokenizer_info`` and tokenizes through ``/tokenize`` and
    ``/detokenize`` (vLLM's, without a model name: a server of one model), with no tokenizer folder of its own; the
    scores are ``hf``'s."""
    import httpx

    with running_server({"llm": paths["llm"]}) as one:
        info = httpx.get(f"{one.url}/tokenizer_info").json()
        assert info["model_max_length"] == POSITIONS and info["eos_token"] and "chat_template" in info
        args = dict(base_url=f"{one.url}/v1/completions", model="llm", tokenizer_backend="remote",
                    tokenized_requests=True, max_length=POSITIONS)
        got = evaluate(tm, "local-completions", args, [CHOICE])
    np.testing.assert_allclose(loglikelihoods(got, CHOICE), loglikelihoods(hf, CHOICE), rtol=0, atol=1e-3)
    assert metric(got, CHOICE, "acc") == metric(hf, CHOICE, "acc")


def test_tokenizer_info_names_the_model_when_several_generate(server):
    import httpx

    several = httpx.get(f"{server.url}/tokenizer_info")
    assert several.status_code == 400 and "name one in 'model'" in several.json()["error"]["message"]
    named = httpx.get(f"{server.url}/tokenizer_info", params={"model": "chat"}).json()
    assert named["chat_template"] and named["bos_token"] == "<s>"


# --- quantized exports ------------------------------------------------------------------------------------------------

#: Largest |loglikelihood - fp32's| / |fp32's| over the samples, and the byte perplexity's relative change. Measured on
#: this tiny random Llama: int8 0.36% (choices) / 0.26% (texts), byte perplexity +0.14%; int4 6.8% / 1.2%, +1.2%
#: (its logits are ~10x further from fp32's than int8's: tests/test_weight_only.py). Bounds ~3x that; a wrong scale,
#: zero point or nibble order moves logits by >= 100% of their size, and these numbers with them.
QUANTIZED = {"llm-int8": (0.01, 0.005), "llm-int4": (0.15, 0.04)}


@pytest.fixture(scope="module")
def served_fp32(tm, server, paths) -> dict:
    return evaluate(tm, "local-completions", api_args(server, paths, "llm"), [CHOICE, TEXT, COMPLETE])


@pytest.mark.parametrize("model", list(QUANTIZED))
def test_int8_and_int4_exports_run_every_task_near_fp32(tm, server, paths, served_fp32, model):
    got = evaluate(tm, "local-completions", api_args(server, paths, model), [CHOICE, TEXT, COMPLETE])
    sample_bound, perplexity_bound = QUANTIZED[model]
    for task in (CHOICE, TEXT):
        ours, fp32 = loglikelihoods(got, task), loglikelihoods(served_fp32, task)
        relative = np.abs(ours - fp32) / np.abs(fp32)
        assert 0 < relative.max() < sample_bound, (task, relative.max())  # > 0: the quantized file answered
    byte = metric(got, TEXT, "byte_perplexity") / metric(served_fp32, TEXT, "byte_perplexity") - 1
    assert abs(byte) < perplexity_bound, byte
    assert len(generations(got)) == len(generations(served_fp32)) and all(generations(got))


# --- the lm-eval command, and HFLM on a placed model --------------------------------------------------------------

def test_the_lm_eval_command_against_the_server(server, paths, hf, tmp_path, monkeypatch):
    """``lm-eval --model local-completions ... --include_path tests/data/lm_eval`` (its console entry point, in
    process) as docs/evaluation.md runs it: text requests, results and samples written under --output_path. Its
    task index leaves out lm-eval's built-in tasks (~20 s to index here; none is used)."""
    import functools

    import lm_eval.tasks
    from lm_eval.__main__ import cli_evaluate
    from lm_eval.tasks import TaskManager

    args = api_args(server, paths, "llm", tokenized=False)
    del args["tokenizer_backend"]  # lm-eval's default: it asks the server for /tokenizer_info, then takes the folder
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", functools.partial(TaskManager, include_defaults=False))
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [
        "lm-eval", "--model", "local-completions", "--model_args", ",".join(f"{k}={v}" for k, v in args.items()),
        "--tasks", f"{CHOICE},{COMPLETE}", "--include_path", str(TASKS.relative_to(ROOT)),
        "--output_path", str(tmp_path / "out"), "--log_samples"])
    cli_evaluate()
    (results_file,) = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]
    for name in ("acc", "acc_norm"):
        assert metric({"results": results}, CHOICE, name) == metric(hf, CHOICE, name), name
    (samples_file,) = (tmp_path / "out").rglob(f"samples_{COMPLETE}_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert generations({"samples": {COMPLETE: samples}}) == generations(hf)


def test_a_placed_model_through_hflm_and_the_server(tm, server, paths):
    """A trained maw placement: lm-eval's ``HFLM`` wraps the model ``attnx.pretrained.load`` gives (the variant in
    transformers' model), and ``local-completions`` scores its export the same. Its tokenizer prepends BOS to text,
    so both sides are told ``add_bos_token`` and the server gets token ids (what lm-eval counted)."""
    import transformers
    from lm_eval.models.huggingface import HFLM

    from attnx import pretrained

    trained = gf.trained_folder("llama", "maw")
    tokenizer = transformers.AutoTokenizer.from_pretrained(trained)
    placed = HFLM(pretrained=pretrained.load(trained).hf, tokenizer=tokenizer, batch_size=1, add_bos_token=True)
    want = evaluate(tm, placed, None, [CHOICE, TEXT])
    got = evaluate(tm, "local-completions", api_args(server, paths, "maw", add_bos_token=True), [CHOICE, TEXT])
    for task in (CHOICE, TEXT):
        np.testing.assert_allclose(loglikelihoods(got, task), loglikelihoods(want, task), rtol=0, atol=1e-3,
                                   err_msg=task)
    assert metric(got, CHOICE, "acc") == metric(want, CHOICE, "acc")
    # the placement is what was scored: the neutral Llama (the same base weights) scores otherwise
    neutral = HFLM(pretrained=pretrained.load(gf.folder("llama")).hf, tokenizer=tokenizer, batch_size=1,
                   add_bos_token=True)
    base = evaluate(tm, neutral, None, [CHOICE])
    assert np.abs(loglikelihoods(base, CHOICE) - loglikelihoods(want, CHOICE)).max() > 0.1
