"""Prompt logprobs: how likely a with-past export found each token of a prompt, given the tokens before it.

What OpenAI's legacy ``echo`` + ``logprobs`` and vLLM's ``prompt_logprobs`` report, and what lm-evaluation-harness
reads for every loglikelihood task. A with-past file returns the logits of the new positions its
``logits_to_keep`` input names (:mod:`attnx.pretrained.cached`; default: the last one, which is all decoding
needs). :func:`score` runs the prompt as a prefill in chunks of :data:`PROMPT_CHUNK` tokens, the KV cache carried
from one to the next (exact: the same masked cache a decode step extends), each asking for every position of the
chunk, so a 4k-token prompt holds ``[chunk, vocab]`` logits at a time, never ``[4k, vocab]``. Of each row it keeps
the prompt token's log-probability, its rank and the ``top`` most likely tokens: the model's own log-softmax
(before any sampling setting, as vLLM reports), its sum taken in float64.

A file exported before the input existed, or a TensorRT engine (which reads the input's default as a constant),
returns the last position only: :class:`NoPromptLogits`, one line that the server answers as a 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import numpy as np

from attnx.runtime.core.decoding import DecodeState
from attnx.runtime.core.session import Session

if TYPE_CHECKING:
    from attnx.runtime.core.decoding import Decoder

#: New tokens per run when a prompt is scored: the logits held at once are ``[PROMPT_CHUNK, vocab]``.
PROMPT_CHUNK = 256


class NoPromptLogits(ValueError):
    """A decoder whose file gives the last position's logits only (no ``logits_to_keep`` input it can feed)."""


@dataclass
class PromptLogprobs:
    """A scored prompt: for each token after the first (the first has no context to be scored in),
    ``logprobs[t - 1]`` = log p(tokens[t] | tokens[:t]), ``ranks[t - 1]`` = 1 + the tokens the model found
    likelier, ``top[t - 1]`` = the most likely ``(id, logprob)``, best first."""

    tokens: list[int]
    logprobs: np.ndarray  # float64 [len - 1]
    ranks: np.ndarray  # int64 [len - 1]
    top: list[tuple[tuple[int, float], ...]]


def keep_input(session: Session, name: str | None) -> str | None:
    """The ``logits_to_keep`` input ``attnx.cache`` names, if this session can feed it: an input, or on ONNX
    Runtime an overridable initializer (an input with a default, which ``get_inputs`` leaves out)."""
    if name is None or name in session.input_names:
        return name
    overridable = getattr(getattr(session, "_sess", None), "get_overridable_initializers", None)
    return name if overridable is not None and name in {i.name for i in overridable()} else None


def why_not(decoder: "Decoder") -> str:
    """One line for a decoder that cannot score a prompt."""
    name = decoder.session.path.name
    if decoder.layout.logits_to_keep is None:
        return (f"{name} computes the last position's logits only (exported before attnx had prompt logprobs): "
                "re-export it with this attnx (attnx export --with-past) to get prompt logprobs")
    return (f"{name} ({decoder.session.provider}) computes the last position's logits only (a TensorRT engine "
            "keeps the last position): serve the with-past .onnx to get prompt logprobs")


def score(decoder: "Decoder", prompt: Sequence[int], top: int = 0, context: Mapping[str, np.ndarray] | None = None,
          chunk: int | None = None, stop: Callable[[], bool] | None = None) -> PromptLogprobs | None:
    """``prompt`` scored by ``decoder``'s file, ``chunk`` (default :data:`PROMPT_CHUNK`) new tokens per run; None
    when ``stop()`` turns true between two runs (a client gone)."""
    name = keep_input(decoder.session, decoder.layout.logits_to_keep)
    if name is None:
        raise NoPromptLogits(why_not(decoder))
    chunk = chunk or PROMPT_CHUNK
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    ids, state = decoder.fresh(prompt, context)
    tokens = ids[0]
    logprobs, ranks, tops = [], [], []
    # positions 0 .. n-2 predict tokens 1 .. n-1; the last token predicts nothing in the prompt, so it is not run
    for begin in range(0, len(tokens) - 1, chunk):
        if stop is not None and stop():
            return None
        end = min(begin + chunk, len(tokens) - 1)
        logits, state = _run(decoder, state, ids[:, begin:end], name, validate=begin == 0)
        chosen, rank, best = rows(logits, tokens[begin + 1:end + 1], top)
        logprobs.append(chosen)
        ranks.append(rank)
        tops.extend(best)
    empty = len(tokens) < 2
    return PromptLogprobs([int(t) for t in tokens], np.zeros(0) if empty else np.concatenate(logprobs),
                          np.zeros(0, np.int64) if empty else np.concatenate(ranks), tops)


def _run(decoder: "Decoder", state: DecodeState, ids: np.ndarray, name: str, validate: bool):
    """One chunk's run with the logits of each of its positions: ``(logits [n, vocab], the state after it)``."""
    feeds = decoder._feeds(state, ids, np.ones_like(ids))
    if validate:  # the cache and context as the first run of a prompt has them (the input with a default aside)
        feeds = decoder.session.check_feeds(feeds)
    feeds[name] = np.arange(ids.shape[1], dtype=np.int64)
    # a plain run, on a GPU too: ONNX Runtime's IOBinding cannot bind an input that has a default
    out = decoder.session._run(feeds, decoder._outputs)
    cache = {t.input: out[t.output] for t in decoder.layout.tensors}
    mask = feeds[decoder._mask.name]
    return out["logits"][0], DecodeState(cache, mask, state.positions + ids.shape[1], state.context)


def rows(logits: np.ndarray, targets: np.ndarray, top: int):
    """Of each row of ``logits [n, vocab]``: the log-probability of its target token (float64), its rank (1 = the
    likeliest) and the ``top`` likeliest ``(id, logprob)``; the log-sum-exp over a row shifted by its maximum
    (no overflow) and summed in float64."""
    x = np.asarray(logits, dtype=np.float32)
    n = np.arange(x.shape[0])
    peak = x.max(axis=1, keepdims=True)
    norm = peak[:, 0].astype(np.float64) + np.log(np.exp(x - peak).sum(axis=1, dtype=np.float64))
    picked = x[n, targets]
    chosen = picked.astype(np.float64) - norm
    rank = (x > picked[:, None]).sum(axis=1).astype(np.int64) + 1
    if not top:
        return chosen, rank, [()] * x.shape[0]
    k = min(top, x.shape[1])
    best = np.argpartition(-x, k - 1, axis=1)[:, :k]
    order = np.argsort(-x[n[:, None], best], axis=1, kind="stable")
    best = np.take_along_axis(best, order, axis=1)
    values = x[n[:, None], best].astype(np.float64) - norm[:, None]
    return chosen, rank, [tuple(zip(map(int, b), map(float, v))) for b, v in zip(best, values)]
