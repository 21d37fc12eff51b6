"""`attnx bench --text` (issue 12, item 6): real texts through the model's tokenizer, every answer under
load compared with the same text run alone; a variant's per-example context rides along."""

from __future__ import annotations

import json

import numpy as np
import pytest

from attnx.contract import BATCH, SEQ, Role
from attnx.deploy import loadtest as b
from attnx.runtime.core.session import TensorSpec
from support.cli import run as attnx


def spec(name, shape, role=Role.CONTEXT, dtype=np.float32):
    return TensorSpec(name, np.dtype(dtype), shape, role)


TOKENS = [  # a text model's token inputsspec("input_ids", (BATCH, SEQ), Role.INPUT_IDS, np.int64),
          spec("attention_mask", (BATCH, SEQ), Role.ATTENTION_MASK, np.int64),
          spec("head_mask", (6, 12), Role.HEAD_MASK)]


def test_text_requests_carry_per_example_context_and_refuse_per_token_context():
    context = b.text_context_specs([*TOKENS, spec("cultural", (BATCH, 8)), spec("kind", (BATCH,), dtype=np.int64)])
    assert [s.name for s in context] == ["cultural", "kind"]  # token inputs from the text, head mask optional
    with pytest.raises(ValueError, match="metaphor.*one value per token"):
        b.text_context_specs([*TOKENS, spec("metaphor", (BATCH, SEQ, 4))])

    class Tok:  # the two things text_pool reads of a TextTokenizer
        max_length = 64
        _full = __import__("tokenizers").Tokenizer(__import__("tokenizers").models.WordLevel(
            {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(["alpha", "bravo", "charlie", "delta", "tango"])}},
            unk_token="[UNK]"))

    Tok._full.pre_tokenizer = __import__("tokenizers").pre_tokenizers.Whitespace()
    pool = b.text_pool(Tok, 6, min_tokens=2, max_tokens=20, context=context)
    lengths = sorted(n for _, _, n in pool)  # spread over [2, 20], each at least its target
    assert len(pool) == 6 and all(n >= t for n, t in zip(lengths, [2, 6, 9, 13, 16, 20])) and lengths[0] < 6
    for feeds, rows, n in pool:
        assert rows == 1 and len(feeds["text"].split()) == n
        assert feeds["cultural"].shape == (1, 8) and feeds["cultural"].dtype == np.float32
        assert feeds["kind"].shape == (1,) and feeds["kind"].dtype == np.int64


def test_cli_text_bench_in_process_checks_every_answer(minilm_export, tmp_path):
    model = minilm_export().path
    report = tmp_path / "bench.json"
    run = attnx("bench", str(model), "--text", "--concurrency", "6", "--duration", "3", "--texts", "12", "--max-tokens",
                "60", "--threads", "1", "--compare-batch-1", "--report", str(report))
    assert run.returncode == 0, run.stderr
    numbers = json.loads(report.read_text())
    assert numbers["lost"] == 0 and numbers["mismatched"] == 0
    batched, single = numbers["runs"]
    assert batched["ok"] > 0 and single["ok"] > 0
    assert "dynamic batching:" in run.stderr and "0 lost, 0 different from the single runs" in run.stderr
