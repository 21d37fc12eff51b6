"""Interoperability (issue 23): onnxruntime-genai (the real PyPI wheel, CPU) generates from attnx's with-past
exports of random-weight Llama- and GPT-2-shaped folders, with ``genai_config.json`` and the tokenizer files
attnx writes beside them, the same greedy tokens as ``attnx generate`` (and so as transformers).

What it cannot run is said in the config (and by ``attnx export``): a cache holding more than k and v
(smal's key term, maw's per-depth keys and pool), which onnxruntime-genai never feeds back; context inputs,
which onnxruntime-genai 0.18 cannot feed to a text decoder.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import generation_fixtures as gf

import onnxruntime_genai as og

from attnx.contract import ModelInfo  # noqa: E402
from attnx.export.genai import genai_support  # noqa: E402
from attnx.runtime import TextModel  # noqa: E402

PROMPT = "the cat sat on the mat"


def genai_greedy(folder, ids: list[int], n: int, extra: dict | None = None) -> list[int]:
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + n, do_sample=False)
    generator = og.Generator(model, params)
    if extra:
        inputs = og.NamedTensors()
        for name, value in extra.items():
            inputs[name] = value
        generator.set_inputs(inputs)
    generator.append_tokens(np.asarray(ids, dtype=np.int32))
    out = []
    while not generator.is_done():
        generator.generate_next_token()
        out.append(int(generator.get_next_tokens()[0]))
    return out


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_onnxruntime_genai_generates_the_tokens_attnx_generates(family):
    path = gf.export(gf.folder(family), "mha")
    config = json.loads((path.parent / "genai_config.json").read_text())
    assert config["model"]["decoder"]["filename"] == "model.onnx" and not genai_support(ModelInfo.read(path))
    assert (path.parent / "tokenizer.json").is_file()
    model = TextModel(path)
    ids = model.tokenizer.tokenize([PROMPT])[0].ids.tolist()
    pieces = list(model.generate(PROMPT, max_new_tokens=12, details=True))
    ours = [p.token for p in pieces if p.token is not None]
    theirs = genai_greedy(path.parent, ids, 12)
    assert theirs[:len(ours)] == ours  # onnxruntime-genai stops at the same end of sequence, or runs on past it
    tok = og.Tokenizer(og.Model(str(path.parent)))  # its tokenizer reads the files attnx put beside the model
    assert tok.decode(tok.encode(PROMPT)) == PROMPT


def test_a_variant_with_context_inputs_is_refused_as_said():
    """cultural keeps k and v only, but takes a context input, which onnxruntime-genai 0.18 cannot feed to a text
    decoder (set_inputs is refused for its model types): the reason attnx gives is the one it hits."""
    path = gf.export(gf.trained_folder("gpt2", "cultural"), None)
    why = " ".join(genai_support(ModelInfo.read(path)))
    assert "cultural" in why and "set_inputs" in why.lower()
    with pytest.raises(RuntimeError, match="SetInputs is not supported"):
        genai_greedy(path.parent, [1, 5, 6], 4, {"cultural": np.full((1, 32), 0.7, np.float32)})


def test_what_onnxruntime_genai_cannot_run_is_said():
    path = gf.export(gf.trained_folder("llama", "smal"), None, "rewrite")
    why = " ".join(genai_support(ModelInfo.read(path)))
    assert "key_term" in why and "self_state" in why
    with pytest.raises(Exception):  # it never feeds past_key_values.{i}.key_term
        genai_greedy(path.parent, [1, 5, 6], 4)
