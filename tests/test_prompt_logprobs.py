"""Prompt logprobs (issue 46 item 1): a with-past export's ``logits_to_keep`` input, the decoder's chunked prefill that
scores a prompt, and OpenAI's legacy ``echo`` + ``logprobs`` and vLLM's ``prompt_logprobs`` on ``attnx serve``.

Every number is checked against transformers itself: the log-softmax of the HF model's logits over the whole prompt
(fp32, within 1e-4), across chunk boundaries (chunks of 4 and 7 tokens here), for a batch of prompts, token-id
prompts and ``max_tokens`` 0; lm-evaluation-harness's own reader (``LocalCompletionsAPI.parse_logprobs``) reads the
exact request it sends. The default decode path feeds nothing new and gives the logits it gave before the input
existed; a file without the input is a one-line 400.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import onnx
import pytest
import torch

import generation_fixtures as gf
from conftest_runtime import running_server
from support import exports

import transformers
transformers.logging.set_verbosity_error()

from attnx.runtime import BatcherConfig, load  # noqa: E402
from attnx.runtime.core.decoding import Decoder  # noqa: E402
from attnx.runtime.core.prompt_logprobs import NoPromptLogits, score  # noqa: E402

CONTEXT, CONTINUATION = "the cat sat on the", " mat and looked at the door"
PROMPTS = ["the cat sat on the mat", "a dog ran after the ball in the park and then"]
CHUNK = 4  # tokens per scoring run on the server: every prompt here spans several


def without_keep_input(path, folder):
    """``path`` as attnx wrote it before ``logits_to_keep`` (the same weights): the input made a plain constant,
    ``attnx.cache`` not naming it. Linked into ``folder``; ``model.onnx`` replaced, never changed in place."""
    copy = exports.linked_copy(path, folder)
    proto = onnx.load(str(copy), load_external_data=False)
    kept = [i for i in proto.graph.input if i.name != "logits_to_keep"]
    del proto.graph.input[:]
    proto.graph.input.extend(kept)
    for prop in proto.metadata_props:
        if prop.key == "attnx.cache":
            cache = json.loads(prop.value)
            cache.pop("logits_to_keep")
            prop.value = json.dumps(cache)
    copy.unlink()
    onnx.save(proto, str(copy))
    return copy


@pytest.fixture(scope="module")
def llm():
    return gf.export(gf.chat_folder(), "mha")


@pytest.fixture(scope="module")
def old(llm, tmp_path_factory):
    return without_keep_input(llm, tmp_path_factory.mktemp("before-logits-to-keep"))


@pytest.fixture(scope="module")
def hf():
    folder = gf.chat_folder()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    return model, transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def server(llm, old):
    with running_server({"llm": llm, "old": old}, batching=BatcherConfig(max_batch_size=8, max_queue_size=64)) as s:
        s.generators["llm"].prompt_chunk = CHUNK
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def log_softmax(model, ids: list[int]) -> np.ndarray:
    """transformers' log-softmax at every position of ``ids`` (row t: the distribution of token t + 1)."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0], -1).double().numpy()


def prompt_rows(model, ids: list[int]):
    """``(log p(ids[t] | ids[:t]) for t >= 1, the rows they come from)``."""
    rows = log_softmax(model, ids)[:-1]
    return rows[np.arange(len(ids) - 1), ids[1:]], rows


# --- the file --------------------------------------------------------------------------------------------------

def test_the_file_gives_logits_to_keep_a_default_of_the_last_position(llm, hf):
    """``logits_to_keep`` is an overridable initializer ``[-1]``: not among the inputs a caller must feed (ONNX
    Runtime's ``get_inputs``, ``attnx.inputs``), named by ``attnx.cache``; fed, it picks any new positions."""
    import onnxruntime as ort

    from attnx.contract import ModelInfo

    proto = onnx.load(str(llm), load_external_data=False)
    default = next(t for t in proto.graph.initializer if t.name == "logits_to_keep")
    assert onnx.numpy_helper.to_array(default).tolist() == [-1]
    assert "logits_to_keep" in [i.name for i in proto.graph.input]
    info = ModelInfo.read(llm)
    assert info.cache["logits_to_keep"] == "logits_to_keep"
    assert "logits_to_keep" not in [e.name for e in info.inputs]
    sess = ort.InferenceSession(str(llm), providers=["CPUExecutionProvider"])
    assert "logits_to_keep" not in [i.name for i in sess.get_inputs()]
    assert [i.name for i in sess.get_overridable_initializers()] == ["logits_to_keep"]

    model, _ = hf
    ids = [1, 17, 42, 99, 7, 250, 3]
    decoder = Decoder(load(llm, device="cpu"))
    _, state = decoder.fresh(ids)
    feeds = decoder._feeds(state, np.array([ids]), np.ones((1, len(ids)), np.int64))
    want = log_softmax(model, ids)
    for keep in ([0, 3, -1], [-7, 6], list(range(len(ids)))):
        logits = decoder.session._run({**feeds, "logits_to_keep": np.array(keep)}, ["logits"])["logits"][0]
        got = torch.log_softmax(torch.from_numpy(logits), -1).double().numpy()
        np.testing.assert_allclose(got, want[keep], atol=1e-4)


def test_the_default_decode_feeds_nothing_new_and_its_logits_are_unchanged(llm, old, hf):
    """A prefill and decode steps feed the inputs they fed before ``logits_to_keep`` existed, get ``[rows, 1,
    vocab]`` logits (the last position), bit for bit those of the same weights exported without the input, and
    equal to transformers' last-position logits."""
    model, _ = hf
    new, before = load(llm, device="cpu"), load(old, device="cpu")
    assert new.input_names == before.input_names
    fed, run = [], new._run

    def spy(feeds, names):
        fed.append(set(feeds))
        out = run(feeds, names)
        assert out["logits"].shape[1] == 1
        return out

    new._run = spy
    ids = [1, 17, 42, 99, 7, 250, 3]
    runs = [Decoder(s) for s in (new, before)]
    (first, state), (first_before, state_before) = (d.start(ids) for d in runs)
    np.testing.assert_array_equal(first, first_before)
    with torch.no_grad():
        np.testing.assert_allclose(first, model(torch.tensor([ids])).logits[0, -1].numpy(), atol=1e-4)
    token = int(np.argmax(first))
    for _ in range(3):
        (logits, state), (logits_before, state_before) = runs[0].step(state, [token]), runs[1].step(state_before,
                                                                                                    [token])
        np.testing.assert_array_equal(logits, logits_before)
        token = int(np.argmax(logits[0]))
    assert fed and all(f == set(new.input_names) for f in fed), fed


# --- the decoder -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk", [1, 7, 256])
def test_prompt_logprobs_equal_transformers_across_chunks(llm, hf, chunk, capfd):
    """Each prompt token's log-probability, its rank and the top 5: transformers' log-softmax of the whole prompt,
    whether the prompt is one chunk or 40; ONNX Runtime prints nothing (its warnings about the input with a default
    and the logits' declared shape are expected: off in decoder sessions)."""
    model, _ = hf
    ids = np.random.default_rng(3).integers(0, model.config.vocab_size, 40).tolist()
    capfd.readouterr()
    scored = score(Decoder(load(llm, device="cpu")), ids, top=5, chunk=chunk)
    assert "onnxruntime" not in capfd.readouterr().err
    want, rows = prompt_rows(model, ids)
    assert scored.tokens == ids and scored.logprobs.shape == (len(ids) - 1,)
    np.testing.assert_allclose(scored.logprobs, want, atol=1e-4)
    np.testing.assert_array_equal(scored.ranks, (rows > want[:, None] + 1e-5).sum(axis=1) + 1)
    for top, row in zip(scored.top, rows):
        assert [t for t, _ in top] == np.argsort(-row, kind="stable")[:5].tolist()
        np.testing.assert_allclose([v for _, v in top], np.sort(row)[::-1][:5], atol=1e-4)
    assert score(Decoder(load(llm, device="cpu")), ids[:1]).logprobs.shape == (0,)


def test_a_file_without_the_input_says_so_in_one_line(old):
    with pytest.raises(NoPromptLogits, match="re-export it with this attnx") as e:
        score(Decoder(load(old, device="cpu")), [1, 2, 3])
    assert "\n" not in str(e.value)


# --- the API -----------------------------------------------------------------------------------------------

def test_lm_eval_loglikelihood_requests_read_transformers_numbers(http, hf):
    """lm-evaluation-harness's ``local-completions`` loglikelihood request, exactly (a batch of two string prompts,
    ``echo``, ``logprobs`` 1, ``max_tokens`` 1), read by lm-eval's own ``parse_logprobs``: the continuation's
    summed logprob and greediness are transformers'."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    model, tok = hf
    prompts = [CONTEXT + CONTINUATION, PROMPTS[1]]
    body = {"model": "llm", "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    ctxlens = [len(tok(CONTEXT)["input_ids"]), 3]
    parsed = LocalCompletionsAPI.parse_logprobs(outputs=answer, ctxlens=ctxlens)
    for (total, greedy), prompt, ctxlen, choice in zip(parsed, prompts, ctxlens, answer["choices"]):
        ids = tok(prompt)["input_ids"]
        want, rows = prompt_rows(model, ids)
        assert abs(total - want[ctxlen - 1:].sum()) < 1e-3
        assert greedy == bool(np.all(rows[ctxlen - 1:].argmax(axis=1) == ids[ctxlen:]))
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1  # the prompt's and the generated token
        assert lp["tokens"][:len(ids)] == [tok.decode([t]) for t in ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        np.testing.assert_allclose(lp["token_logprobs"][1:len(ids)], want, atol=1e-4)
        for t, top in enumerate(lp["top_logprobs"][1:len(ids)]):  # the likeliest token and the prompt's own
            assert top == pytest.approx({tok.decode([int(rows[t].argmax())]): rows[t].max(),
                                         tok.decode([ids[t + 1]]): want[t]}, abs=1e-4)
        assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
        assert choice["text"].startswith(tok.decode(ids, skip_special_tokens=True))


def test_token_id_prompts_with_max_tokens_0_return_the_prompt_alone(http, hf):
    """``max_tokens`` 0 with ``echo``: the prompt only (no generated token), its logprobs transformers'; prompts
    given as token ids (what lm-eval sends with ``tokenized_requests``), a batch of them, ``n`` 2."""
    model, tok = hf
    batch = [tok(p)["input_ids"] for p in PROMPTS]
    r = http.post("/v1/completions", json={"model": "llm", "prompt": batch, "max_tokens": 0, "echo": True,
                                           "logprobs": 2, "n": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["usage"] == {"prompt_tokens": sum(map(len, batch)), "completion_tokens": 0,
                               "total_tokens": sum(map(len, batch))}
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    for choice, ids in zip(answer["choices"], [batch[0], batch[0], batch[1], batch[1]]):
        lp = choice["logprobs"]
        assert choice["text"] == tok.decode(ids, skip_special_tokens=True)
        assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
        want, rows = prompt_rows(model, ids)
        np.testing.assert_allclose(lp["token_logprobs"][1:], want, atol=1e-4)
        assert all(len(top) in (2, 3) for top in lp["top_logprobs"][1:])


def test_vllm_prompt_logprobs_on_completions_and_chat(http, hf):
    """vLLM's ``prompt_logprobs`` k: per prompt token (the first null) ``{id: {logprob, rank, decoded_token}}`` with
    the token itself and the k likeliest; on each completion choice, at the top level of a chat answer."""
    model, tok = hf
    ids = tok(PROMPTS[1])["input_ids"]
    r = http.post("/v1/completions", json={"model": "llm", "prompt": PROMPTS[1], "max_tokens": 2, "temperature": 0,
                                           "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["logprobs"] is None and len(choice["text"]) > 0
    check_vllm(choice["prompt_logprobs"], ids, model, tok, 3)

    messages = [{"role": "user", "content": "Where is the cat?"}]
    r = http.post("/v1/chat/completions", json={"model": "llm", "messages": messages, "max_tokens": 2,
                                                "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    check_vllm(r.json()["prompt_logprobs"], tok(rendered, add_special_tokens=False)["input_ids"], model, tok, 0)


def check_vllm(entries, ids, model, tok, k):
    want, rows = prompt_rows(model, ids)
    assert len(entries) == len(ids) and entries[0] is None
    for t, entry in enumerate(entries[1:]):
        token = ids[t + 1]
        own = entry[str(token)]
        assert abs(own["logprob"] - want[t]) < 1e-4 and own["decoded_token"] == tok.decode([token])
        assert own["rank"] == int((rows[t] > want[t] + 1e-5).sum()) + 1
        best = np.argsort(-rows[t], kind="stable")[:k].tolist()
        assert set(map(int, entry)) == set(best) | {token}
        for place, b in enumerate(best, 1):
            if b != token:
                assert entry[str(b)]["rank"] == place and abs(entry[str(b)]["logprob"] - rows[t, b]) < 1e-4


@pytest.mark.parametrize("body,param,match", [
    ({"model": "old", "prompt": "the cat", "echo": True, "logprobs": 1, "max_tokens": 1}, "logprobs",
     "re-export it with this attnx"),
    ({"model": "old", "prompt": "the cat", "prompt_logprobs": 1}, "prompt_logprobs", "re-export it with this attnx"),
    ({"model": "llm", "prompt": "the cat", "max_tokens": 0}, "max_tokens", "needs 'echo': true"),
    ({"model": "llm", "prompt": "the cat", "echo": True, "logprobs": 1, "stream": True}, "stream", "cannot be streamed"),
    ({"model": "llm", "prompt": "the cat", "prompt_logprobs": 21}, "prompt_logprobs", "<= 20"),
    ({"model": "llm", "prompt": "the cat", "max_tokens": -1}, "max_tokens", ">= 0"),
])
def test_what_cannot_be_scored_is_a_one_line_400(http, body, param, match):
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert match in error["message"] and "\n" not in error["message"] and error["param"] == param


def test_the_old_file_still_echoes_and_generates(http):
    """Without ``logprobs``, ``echo`` needs no scoring: a file without the input answers as before."""
    r = http.post("/v1/completions", json={"model": "old", "prompt": "the cat", "echo": True, "max_tokens": 2,
                                           "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("the cat")
