"""The prompt's logprobs on ``attnx serve``: OpenAI's legacy ``echo`` + ``logprobs`` and vLLM's ``prompt_logprobs``.

What lm-evaluation-harness's ``local-completions`` sends for every loglikelihood task (``{"prompt": context +
continuation, "echo": true, "logprobs": 1, "max_tokens": 0 or 1, "temperature": 0}``, the prompt as a string or
token ids, one request for a batch of prompts) and reads back (``choices[i].logprobs.token_logprobs``, ``tokens``,
``top_logprobs``). Shapes:

- ``/v1/completions`` with ``echo`` and ``logprobs`` k: ``choices[i].logprobs`` lists the prompt's tokens first,
  then the generated ones (OpenAI's legacy columns ``tokens``, ``token_logprobs``, ``top_logprobs``,
  ``text_offset``); the first prompt token has no context, so its ``token_logprobs`` and ``top_logprobs`` are
  ``null``; each ``top_logprobs`` entry holds the k likeliest tokens and the token itself. ``max_tokens`` 0 with
  ``echo`` returns the prompt alone;
- vLLM's ``prompt_logprobs`` k (completions and chat): a list per prompt token, the first ``null``, each a dict
  ``{"token id": {"logprob", "rank", "decoded_token"}}`` holding the token itself (rank: 1 + the tokens the model
  found likelier) and the k likeliest (ranks 1..k); on ``choices[i].prompt_logprobs`` for completions, at the top
  level for chat (as vLLM puts them). ``echo`` + ``logprobs`` without ``prompt_logprobs`` reports k alternatives
  there too, as vLLM does.

Each prompt is scored once, whatever ``n``, on its model's scoring thread (a prefill in chunks,
:mod:`attnx.runtime.core.prompt_logprobs`): off the event loop and beside the scheduler's decode steps. A file
without the ``logits_to_keep`` input (exported before it, or a TensorRT engine) is a one-line 400; streaming them is
refused (vLLM refuses it too).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from typing import Any, Callable

from attnx.runtime.core.prompt_logprobs import NoPromptLogits, PromptLogprobs, keep_input, why_not
from attnx.runtime.core.prompt_logprobs import score as score_prompt
from attnx.runtime.core.session import InputError
from attnx.runtime.wire.errors import Kind, ProtocolError, bad_input, overloaded


def asked(body) -> tuple[int | None, int | None, str]:
    """``(alternatives per prompt token in OpenAI's legacy echo, in vLLM's prompt_logprobs, the field that asked)``;
    None: that shape is not asked for."""
    legacy = body.logprobs if getattr(body, "echo", False) else None  # completions only: chat has no echo
    return legacy, body.prompt_logprobs, "prompt_logprobs" if body.prompt_logprobs is not None else "logprobs"


def check(model, param: str) -> None:
    """A one-line 400 before any work when ``model``'s file cannot score a prompt."""
    decoder = model.decoder
    if keep_input(decoder.session, decoder.layout.logits_to_keep) is None:
        raise bad_input(why_not(decoder), param)


class Scoring:
    """A model's scoring thread, and the prompts waiting for it (bounded as its generation queue is)."""

    def __init__(self, name: str):
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"attnx-score-{name}")
        self.pending = 0

    def done(self, _future) -> None:
        self.pending -= 1

    def shutdown(self, wait: bool = False, cancel_futures: bool = True) -> None:
        self.pool.shutdown(wait=wait, cancel_futures=cancel_futures)


async def score(model, prompts: list[list[int]], top: int, context, request, param: str) -> list[PromptLogprobs]:
    """Each prompt scored on ``model``'s scoring thread, one after another; a client that disconnects stops it
    between two chunks."""
    scoring = model.scoring = model.scoring or Scoring(model.name)
    if scoring.pending + len(prompts) > model.max_queue:
        raise overloaded(f"model {model.name!r}: {scoring.pending} prompts waiting to be scored (at most "
                         f"{model.max_queue}); retry later")
    gone, loop = threading.Event(), asyncio.get_running_loop()
    jobs = [loop.run_in_executor(scoring.pool, functools.partial(score_prompt, model.decoder, ids, top, context,
                                                                 model.prompt_chunk, gone.is_set)) for ids in prompts]
    scoring.pending += len(jobs)
    for job in jobs:  # counted on the loop's thread only
        job.add_done_callback(scoring.done)
    every = asyncio.gather(*jobs)
    try:
        while True:
            done, _ = await asyncio.wait({every}, timeout=0.25)
            if done:
                scored = every.result()
                if any(r is None for r in scored):  # a prompt stopped by ``gone``, which is set once this call ends
                    raise ProtocolError(Kind.CLIENT_GONE, "client disconnected")
                return [r for r in scored if r is not None]
            if request is not None and await request.is_disconnected():
                raise ProtocolError(Kind.CLIENT_GONE, "client disconnected")
    except NoPromptLogits as e:
        raise bad_input(str(e), param) from None
    except InputError as e:
        raise e.refused(param="context" if context else "prompt") from None
    finally:
        gone.set()  # the prompts not scored yet end at their next chunk
        every.cancel()


def legacy(scored: PromptLogprobs, word: Callable[[int], str], k: int) -> dict[str, list]:
    """OpenAI's legacy columns of the prompt's tokens, ``k`` alternatives each (``text_offset``: :func:`joined`)."""
    rest = zip(scored.tokens[1:], scored.logprobs.tolist(), (top[:k] for top in scored.top))
    return {"tokens": [word(t) for t in scored.tokens],
            "token_logprobs": [None, *scored.logprobs.tolist()],
            "top_logprobs": [None, *({word(t): v for t, v in (*top, (token, lp))} for token, lp, top in rest)]}


def joined(prompt: dict[str, list], generated: dict[str, Any] | None) -> dict[str, list]:
    """The prompt's columns, then the generated tokens', with ``text_offset`` counted over both (the echoed text)."""
    out = {k: list(prompt[k]) + list((generated or {}).get(k) or []) for k in ("tokens", "token_logprobs",
                                                                                 "top_logprobs")}
    offsets, at = [], 0
    for text in out["tokens"]:
        offsets.append(at)
        at += len(text)
    return {**out, "text_offset": offsets}


def vllm(scored: PromptLogprobs, word: Callable[[int], str], k: int) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` k: per prompt token (the first None) ``{id: {logprob, rank, decoded_token}}``, the
    token itself first, then the k likeliest."""
    out: list[dict | None] = [None]
    for token, lp, rank, top in zip(scored.tokens[1:], scored.logprobs.tolist(), scored.ranks.tolist(), scored.top):
        entry = {str(token): {"logprob": lp, "rank": rank, "decoded_token": word(token)}}
        for place, (t, v) in enumerate(top[:k], 1):
            entry.setdefault(str(t), {"logprob": v, "rank": place, "decoded_token": word(t)})
        out.append(entry)
    return out
