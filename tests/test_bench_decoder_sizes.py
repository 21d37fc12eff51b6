"""``benchmarks/bench_decoder_sizes.py``'s model files (issue 44, item 6): the published shapes, folders written
shard by shard that transformers reads, and the llama.cpp GGUF of the same weights (``_sizes_gguf.py``).
The benchmark's figures themselves are measured by running it, not asserted here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import transformers
transformers.logging.set_verbosity_error()

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_decoder_sizes as bench  # noqa: E402

#: Parameter counts the models' own cards publish (SmolLM2-135M; Llama-3.2-3B, tied; Llama-3.1-8B, untied).
PUBLISHED = {"135m": 134_515_008, "3b": 3_212_749_824, "8b": 8_030_261_248}
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=512, tie_word_embeddings=False, max_position_embeddings=128, rope_theta=10000.0)


@pytest.mark.parametrize("name", list(bench.SHAPES))
def test_the_shapes_are_transformers_models_of_the_published_sizes(name):
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**bench.config_of(name)))
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        want.pop("lm_head.weight")
    assert dict(bench.tensor_shapes(bench.SHAPES[name])) == want
    if name in PUBLISHED:
        assert bench.parameters(bench.SHAPES[name]) == PUBLISHED[name]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    bench.SHAPES["tiny-test"] = TINY
    bench.SHARD_BYTES = 40_000  # several shards for a model of ~0.2 MB
    try:
        return bench.write_folder(tmp_path_factory.mktemp("sizes") / "tiny", "tiny-test")
    finally:
        bench.SHAPES.pop("tiny-test")
        bench.SHARD_BYTES = 2 << 30


def test_a_folder_is_written_in_shards_that_transformers_loads(tiny_folder):
    index = json.loads((tiny_folder / "model.safetensors.index.json").read_text())
    shards = sorted(tiny_folder.glob("*.safetensors"))
    assert len(shards) > 3 and set(index["weight_map"].values()) == {s.name for s in shards}
    assert all(s.stat().st_size <= 40_000 + 2 * 512 * 64 + 4096 for s in shards)  # a shard, or one tensor past it
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder, local_files_only=True)
    assert model.dtype == torch.bfloat16
    q = model.model.layers[1].self_attn.q_proj.weight.float()
    assert q.std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.equal(model.model.norm.weight.float(), torch.ones(64))
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # untied: its own tensor


def test_the_gguf_holds_the_folders_weights_in_llama_cpps_layout(tiny_folder, tmp_path):
    from _sizes_gguf import write_gguf

    gguf = write_gguf(tiny_folder, tmp_path / "tiny.Q8_0.gguf", "Q8_0")
    read = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf.name, dtype=torch.float32)
    own = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder, local_files_only=True, dtype=torch.float32)
    theirs, ours = read.state_dict(), own.state_dict()
    assert set(theirs) == set(ours)
    for name, value in ours.items():  # transformers undoes the q/k permutation: equal up to Q8_0's rounding
        assert (theirs[name] - value).abs().max().item() <= 0.01 * value.abs().max().item() + 1e-6, name
