"""The KV cache's memory, stated at load and bounded by an option (issue 44, item 5).

- the stated bytes per token equal layers x 2 (key, value) x kv heads x head dim x 4 bytes computed from the source
  folder's config.json, and equal what a decoder's cache really holds after a prefill and some steps;
- ``max_positions`` (``--max-positions`` of ``attnx generate`` / ``attnx serve``) bounds the positions served: a
  generation stops there ("length"), a prompt that does not fit is a one-line error naming the bound (a 400 from the
  server), and the statement at load is made at the bound;
- a bound above the model's own positions keeps the model's.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest

import generation_fixtures as gf
from conftest_runtime import running_server
from support.cli import run as attnx

from attnx.runtime import load
from attnx.runtime.core.decoding import Decoder
from attnx.runtime.core.generate import stream
from attnx.runtime.core.sampling import sampling_params
from attnx.runtime.core.text import TextTokenizer
from attnx.runtime.wire.limits import Limits


@pytest.fixture(scope="module")
def export():
    return gf.export(gf.folder("llama"), "mha")


def config_token_bytes() -> int:
    """layers x 2 x kv heads x head dim x 4 bytes, from the folder's own config.json (fp32 cache)."""
    cfg = json.loads((gf.folder("llama") / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * 4


def test_the_stated_kv_bytes_equal_the_config_and_the_cache_really_held(export):
    decoder = Decoder(load(export, device="cpu"))
    footprint = decoder.kv_footprint()
    per_token = config_token_bytes()
    positions = json.loads((gf.folder("llama") / "config.json").read_text())["max_position_embeddings"]
    assert footprint.token_bytes == per_token and footprint.row_bytes == 0
    assert footprint.positions == positions == decoder.max_positions
    assert footprint.bytes(rows=3) == 3 * positions * per_token
    assert f"{per_token:,} bytes per token" in footprint.describe()
    _, state = decoder.start([5, 6, 7, 8, 9])
    for token in (10, 11, 12):
        _, state = decoder.step(state, [token])
    held = sum(a.nbytes for a in state.host_cache().values())
    assert held == state.slots * per_token  # one masked slot + 5 prompt + 3 steps, each at the stated size
    assert state.slots == 9


def test_a_bound_stops_generation_and_states_the_cache_at_it(export):
    session = load(export, device="cpu")
    decoder = Decoder(session, max_positions=10)
    assert decoder.max_positions == 10 and decoder.model_positions == 64
    assert decoder.kv_footprint().bytes() == 10 * config_token_bytes()
    tokenizer = TextTokenizer.from_export(session.path, session.info)
    pieces = list(stream(decoder, tokenizer, [5, 6, 7, 8], sampling_params(max_new_tokens=50, ignore_eos=True)))
    assert sum(p.token is not None for p in pieces) == 6 and pieces[-1].finish_reason == "length"
    with pytest.raises(ValueError, match=r"11 tokens, more than the 10 positions \(max_positions 10; the model has 64\)"):
        decoder.start(list(range(4, 15)))
    assert Decoder(session, max_positions=1000).max_positions == 64  # never above the model's own


def test_generate_refuses_a_prompt_beyond_the_bound_in_one_line(export):
    out = attnx("generate", str(export), "the cat sat on the mat and the dog sat on the log", "--max-positions", "4",
                "-n", "2")
    assert out.returncode == 2, out.output
    (line,) = out.errors()
    assert "--max-positions 4" in line and "shorter than 4 tokens" in line
    assert f"KV cache: {config_token_bytes():,} bytes per token" in out.stderr


def test_generate_within_the_bound_stops_at_it(export):
    out = attnx("generate", str(export), "the cat", "--max-positions", "6", "-n", "50")
    assert out.returncode == 0, out.output
    assert "(length)" in out.stderr
    tokenizer = TextTokenizer.from_export(export, load(export, device="cpu").info)
    prompt = len(tokenizer.tokenize(["the cat"], truncate=False)[0].ids)
    assert f"{6 - prompt} tokens (length)" in out.stderr


def test_the_server_refuses_requests_beyond_its_bound_with_a_400_naming_it(export):
    with running_server({"llm": export}, limits=Limits(max_positions=8)) as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        long = http.post("/v1/completions", json={"model": "llm", "prompt": list(range(4, 14)), "max_tokens": 1})
        assert long.status_code == 400 and "--max-positions 8" in long.json()["error"]["message"]
        room = http.post("/v1/completions", json={"model": "llm", "prompt": [5, 6, 7], "max_tokens": 6})
        assert room.status_code == 400 and "--max-positions 8" in room.json()["error"]["message"]
        ok = http.post("/v1/completions", json={"model": "llm", "prompt": [5, 6, 7], "max_tokens": 5,
                                                "temperature": 0, "ignore_eos": True})
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 5
        metadata = http.get("/v2/models/llm").json()
        assert metadata["parameters"]["max_positions"] == 8
        assert any(f"{8 * config_token_bytes() / 1e3:.1f} KB per sequence" in line
                   for line in server.describe().splitlines())


# --- memory at load: the weights stay mapped ------------------------------------------------------------------

#: A decoder whose tied embedding and head (65536 x 256) outweigh the rest, so what a load copies shows in MB.
WIDE_VOCAB = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=1024, vocab_size=65536, max_position_embeddings=64, tie_word_embeddings=True,
                  bos_token_id=0, eos_token_id=2, pad_token_id=1)

#: Loads a file (options as JSON), prefills 3 tokens and runs 2 steps; prints its anonymous memory grown by the load
#: (``loaded``) and by the end (``anon``), the mappings of its ``.onnx.data`` and of a prepacked copy's data (count,
#: bytes mapped, bytes resident, from /proc/self/smaps) and a digest of every logit computed.
PROBE = r"""
import json, sys
def anon():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("RssAnon:"))
def mapped(name):
    count = size = rss = 0
    current = None
    for line in open("/proc/self/smaps"):
        parts = line.split()
        if "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:
            current = parts[5] if len(parts) > 5 else ""
        elif current and current.endswith(name) and parts[0] == "Size:":
            count, size = count + 1, size + int(parts[1]) * 1024
        elif current and current.endswith(name) and parts[0] == "Rss:":
            rss += int(parts[1]) * 1024
    return count, size, rss
import onnxruntime
from attnx.runtime import load
from attnx.runtime.core.decoding import Decoder
import hashlib
import numpy as np
before = anon()
decoder = Decoder(load(sys.argv[1], device="cpu", threads=1, **json.loads(sys.argv[2])))
loaded = anon() - before
logits, state = decoder.start([5, 6, 7])
steps = [np.asarray(logits)]
for token in (8, 9):
    logits, state = decoder.step(state, [token])
    steps.append(np.asarray(logits))
print(json.dumps({"anon": anon() - before, "loaded": loaded, "mapped": mapped("model.onnx.data"),
                  "prepacked": mapped("model.prepacked.onnx.data"),
                  "logits": hashlib.sha256(b"".join(a.tobytes() for a in steps)).hexdigest()}))
"""


@pytest.fixture(scope="module")
def wide_int4():
    import shutil

    from support import cache, exports

    def make(out):
        import torch
        import transformers

        cfg = transformers.LlamaConfig(**WIDE_VOCAB)
        cfg.architectures = ["LlamaForCausalLM"]
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(cfg).save_pretrained(out)
        for f in gf.folder("llama").iterdir():
            if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
                shutil.copyfile(f, out / f.name)

    folder = cache.entry("llama-wide-vocab", make, kind="folder", shape=WIDE_VOCAB)
    return exports.pretrained(folder, "mha", with_past=True, weight_only_bits=4).path


def _initializer_bytes(path) -> dict[str, int]:
    """Bytes of the MatMulNBits packed weights (``b``; ``b_own``: those no other node reads, whose mapping ORT can
    release), of all their inputs (``quantized``: weights, scales, zero points: what ONNX Runtime repacks) and of
    every initializer (``total``)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    sizes = {}
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            sizes[t.name] = int({e.key: e.value for e in t.external_data}["length"])
        else:
            sizes[t.name] = len(t.raw_data) if t.raw_data else onnx.numpy_helper.to_array(t).nbytes
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    shared = {i for n in model.graph.node if n.op_type != "MatMulNBits" for i in n.input}
    return {"b": sum(sizes[n.input[1]] for n in nbits),
            "b_own": sum(sizes[n.input[1]] for n in nbits if n.input[1] not in shared),
            "quantized": sum(sizes.get(i, 0) for n in nbits for i in set(n.input[1:])), "total": sum(sizes.values())}


def _probe(path, options: dict, env: dict | None = None) -> dict:
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", PROBE, str(path), json.dumps(options)], capture_output=True,
                         text=True, timeout=300, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_an_int4_export_loads_mapped_and_repacks_its_projections_in_place_of_the_originals(wide_int4):
    """ONNX Runtime maps ``model.onnx.data``; MatMulNBits repacks its weights into anonymous memory and unmaps the
    originals, so a load holds each weight once: the repacked projections, the rest (the quantized embedding's
    table, norms) mapped from the file. The tied table, which the head repacks and the embedding's gather reads,
    stays mapped: the pages the repacking read are released (``release_read_weights``), the gather reads its rows
    again. Without repacking every weight stays mapped and nothing is copied."""
    sizes = _initializer_bytes(wide_int4)
    shared_table = sizes["b"] - sizes["b_own"]
    assert shared_table > 16e6 and sizes["b_own"] > 1.5e6  # the tied 8-bit table, the layers' projections
    repacked = _probe(wide_int4, {"prepacked": False})
    plain = _probe(wide_int4, {"prepacked": False, "extra_session_config": {"session.disable_prepacking": "1"}})
    assert plain["mapped"][1] >= 0.9 * sizes["total"]  # everything mapped, nothing read into memory
    assert repacked["mapped"][1] <= sizes["total"] - 0.9 * sizes["b_own"]  # the repacked originals are unmapped ...
    assert repacked["mapped"][1] >= 0.9 * shared_table  # ... the tied table stays mapped ...
    assert repacked["mapped"][2] < 0.02 * shared_table  # ... but not resident: 3 rows of it were read since
    # anonymous memory beyond the session's own (the run without repacking): the repacked copies, once
    assert repacked["anon"] - plain["anon"] <= 1.3 * sizes["quantized"] + 4e6, (repacked, plain, sizes)


# --- memory at load: the repacked weights mapped from a prepacked copy -------------------------------------------

@pytest.fixture()
def wide_int4_copy(wide_int4, tmp_path, monkeypatch):
    """The wide int4 export copied to a folder of the test's own (its prepacked copy is written beside it)."""
    import shutil

    monkeypatch.setenv("ATTNX_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "export"
    shutil.copytree(wide_int4.parent, folder, ignore=shutil.ignore_patterns(".attnx-prepacked", "*.safetensors"))
    return folder / wide_int4.name


def test_an_int4_export_loads_its_repacked_weights_mapped_from_a_prepacked_copy(wide_int4_copy):
    """Asked to (``ATTNX_PREPACKED=1``), a with-past int4 export loads through ``<name>.prepacked.onnx`` (made once,
    beside it): ONNX
    Runtime maps the repacked projections from its data file instead of repacking them into anonymous memory.
    The anonymous-repacking load holds ~1.2x the quantized weights in anonymous memory; this one holds almost
    none of them, and computes the same logits bit for bit."""
    sizes = _initializer_bytes(wide_int4_copy)
    env = {"ATTNX_CACHE": str(wide_int4_copy.parent.parent / "cache"), "ATTNX_PREPACKED": "1"}
    anonymous = _probe(wide_int4_copy, {"prepacked": False}, env)
    plain = _probe(wide_int4_copy, {"prepacked": False, "extra_session_config": {"session.disable_prepacking": "1"}},
                   env)
    first = _probe(wide_int4_copy, {}, env)  # makes the copy (in a child process), then loads it
    assert (wide_int4_copy.parent / ".attnx-prepacked" / "model.prepacked.onnx").is_file()
    assert sorted(f.name for f in wide_int4_copy.parent.glob("*.onnx")) == ["model.onnx"]  # the folder's one model
    mapped = _probe(wide_int4_copy, {}, env)
    assert anonymous["loaded"] - plain["loaded"] >= 0.9 * sizes["quantized"]  # the design this replaces
    for run in (first, mapped):
        assert run["loaded"] - plain["loaded"] <= 0.5 * sizes["quantized"], (run, plain, sizes)  # ORT's own few MB
        assert run["prepacked"][1] >= 0.9 * sizes["b"]  # the repacked weights are file-backed
        assert run["logits"] == anonymous["logits"]
    assert _probe(wide_int4_copy, {}, {**env, "ATTNX_PREPACKED": "0"})["prepacked"][0] == 0  # turned off
    assert _probe(wide_int4_copy, {}, {k: v for k, v in env.items() if k != "ATTNX_PREPACKED"})["prepacked"][0] == 0


def test_a_stale_or_foreign_prepacked_copy_is_never_used(wide_int4_copy, monkeypatch):
    """The copy is keyed on the export's files (size + mtime), ONNX Runtime's version, the CPU and the settings,
    and on the identity of the files written: an export changed since, or a key or file from elsewhere, makes a new
    copy; a folder that cannot be written puts the copy in attnx's cache."""
    import os

    from attnx.runtime.core import prepacked

    settings = {"optimization": "all", "disabled_optimizers": []}
    made = prepacked.prepared_model(wide_int4_copy, settings)
    key_file = made.with_name("model.prepacked.json")
    first = key_file.read_text()
    assert prepacked.prepared_model(wide_int4_copy, settings) == made and key_file.read_text() == first  # reused
    data = wide_int4_copy.with_name("model.onnx.data")
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 10**9))  # the export changed
    assert prepacked.prepared_model(wide_int4_copy, settings) == made and key_file.read_text() != first
    second = key_file.read_text()
    made.with_name("model.prepacked.onnx.data").write_bytes(b"foreign")  # a file the key did not record
    assert prepacked.prepared_model(wide_int4_copy, settings) == made and key_file.read_text() != second
    assert prepacked.prepared_model(wide_int4_copy, {**settings, "optimization": "basic"}) == made
    assert json.loads(key_file.read_text())["key"]["settings"]["optimization"] == "basic"
    monkeypatch.setattr(prepacked, "_writable", lambda folder: False)  # a read-only export folder
    cached = prepacked.prepared_model(wide_int4_copy, settings)
    assert cached.parent.parent == Path(os.environ["ATTNX_CACHE"]) / "prepacked" and cached.is_file()
