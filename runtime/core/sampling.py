"""Choosing the next token: greedy, or sampled with temperature, top-k, top-p and penalties.

:class:`SamplingParams` is what a caller asks for (``attnx generate`` flags, ``TextModel.generate`` keywords, the
server's request fields), checked once with one-line errors; :func:`next_token` applies it to one row of logits, in
transformers' and vLLM's order: repetition penalty (CTRL's: a seen token's logit divided by the penalty when
positive, multiplied when negative; prompt tokens count as seen), OpenAI's presence and frequency penalties
(``logit - presence * (count > 0) - frequency * count`` over the tokens generated so far, not the prompt's), a
grammar's mask (``allowed``: :mod:`attnx.runtime.core.guided`), then temperature, top-k, top-p (the smallest set of
most likely tokens whose probability reaches ``top_p``, at least one), then a draw from the rest with the request's
own ``numpy`` generator (``seed``: the same tokens every time). OpenAI's ``logit_bias`` (``{token id: bias}``,
-100..100) is added to the model's logits before all of that, as OpenAI documents it (-100 bans a token in effect,
+100 makes it the choice). Greedy (``temperature == 0``, or no sampling asked
for) is the argmax, first on ties, after the penalties: transformers' ``generate(do_sample=False)``.
:func:`logprobs` is the model's own log-softmax (before any of this: vLLM's default ``raw_logprobs``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

#: Longest stop list and stop string accepted (OpenAI allows 4; longer lists cost a scan per token).
MAX_STOPS = 16
MAX_STOP_CHARS = 256
#: Smallest repetition penalty: a seen logit is divided by it, and float32 logits of ~1e4 stay finite in float64.
MIN_PENALTY = 0.01
#: Most alternatives reported per token (vLLM's default ``max_logprobs``; OpenAI's chat allows 20).
MAX_LOGPROBS = 20


class SamplingError(ValueError):
    """A parameter out of range (a 400 when it comes from a request)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How to generate. ``temperature`` 0 (or ``do_sample`` False) is greedy; ``top_k`` 0 and ``top_p`` 1
    keep every token; ``stop``: strings that end the text (not included in it); ``seed``: reproducible draws."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    do_sample: bool = False
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # alternatives reported per token (0..MAX_LOGPROBS); None: no logprobs
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to the logits

    def __post_init__(self) -> None:
        def number(name, value, kind=float):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    (kind is int and not float(value).is_integer()) or not math.isfinite(float(value)):
                raise SamplingError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}",
                                    name)
            return kind(value)

        n = number("max_new_tokens", self.max_new_tokens, int)
        if n < 1:
            raise SamplingError(f"max_new_tokens must be >= 1, got {n}", "max_new_tokens")
        t = number("temperature", self.temperature)
        if not 0.0 <= t <= 100.0:
            raise SamplingError(f"temperature must be in [0, 100], got {t}", "temperature")
        k = number("top_k", self.top_k, int)
        if k < 0:
            raise SamplingError(f"top_k must be >= 0 (0: no limit), got {k}", "top_k")
        p = number("top_p", self.top_p)
        if not 0.0 < p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {p}", "top_p")
        r = number("repetition_penalty", self.repetition_penalty)
        if not MIN_PENALTY <= r <= 100.0:  # below it, penalised logits leave float range
            raise SamplingError(f"repetition_penalty must be in [{MIN_PENALTY}, 100], got {r}", "repetition_penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= number(name, getattr(self, name)) <= 2.0:
                raise SamplingError(f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        if self.logprobs is not None and not 0 <= number("logprobs", self.logprobs, int) <= MAX_LOGPROBS:
            raise SamplingError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", "logprobs")
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise SamplingError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}", "logit_bias")
            if not -100.0 <= number("logit_bias", bias) <= 100.0:
                raise SamplingError(f"logit_bias values must be in [-100, 100], got {bias!r}", "logit_bias")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise SamplingError(f"seed must be a non-negative integer, got {self.seed!r}", "seed")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stop) > MAX_STOPS or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
            raise SamplingError(f"stop must be up to {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} "
                                "characters", "stop")
        for name, value in (("max_new_tokens", n), ("temperature", t), ("top_k", k), ("top_p", p),
                            ("repetition_penalty", r), ("stop", stop)):
            object.__setattr__(self, name, value)

    @functools.cached_property
    def _bias(self) -> tuple[np.ndarray, np.ndarray]:
        """``logit_bias`` as (token ids, biases) arrays, built once per request, not per step (the keys are unique:
        a JSON object's)."""
        return (np.array([t for t, _ in self.logit_bias], dtype=np.int64),
                np.array([b for _, b in self.logit_bias], dtype=np.float64))

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0

    def with_(self, **changes) -> "SamplingParams":
        return replace(self, **changes)

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


def apply_repetition_penalty(logits: np.ndarray, seen: Sequence[int] | np.ndarray, penalty: float) -> np.ndarray:
    if penalty == 1.0 or len(seen) == 0:
        return logits
    ids = np.unique(np.asarray(seen, dtype=np.int64))
    ids = ids[(ids >= 0) & (ids < logits.shape[-1])]
    out = logits.copy()
    values = out[ids]
    out[ids] = np.where(values > 0, values / penalty, values * penalty)
    return out


def processed(logits: np.ndarray, params: SamplingParams, seen: Sequence[int] | np.ndarray = (),
              generated: Sequence[int] = (), allowed: np.ndarray | None = None) -> np.ndarray:
    """One row of logits after the penalties and a grammar's mask (``float64 [vocab]``, module docstring): what
    greedy takes the argmax of. Logits that are not finite raise :class:`SamplingError` (the scheduler fails that
    request alone); a mask that leaves no token raises it too."""
    row = np.asarray(logits, dtype=np.float64)
    if not np.isfinite(row).all():
        raise SamplingError("the model's logits for this step are not finite")
    if params.logit_bias:
        ids, biases = params._bias
        row = row.copy()
        row[ids[ids < row.shape[0]]] += biases[ids < row.shape[0]]
    row = apply_repetition_penalty(row, seen, params.repetition_penalty)
    if len(generated) and (params.presence_penalty or params.frequency_penalty):
        ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
        row = row.copy()
        row[ids] -= params.presence_penalty + params.frequency_penalty * counts
    if allowed is not None:
        row = np.where(allowed[:row.shape[0]], row, -np.inf)
        if not np.isfinite(row).any():
            raise SamplingError("the grammar of this request allows no token here")
    return row


def distribution(logits: np.ndarray, params: SamplingParams, seen: Sequence[int] | np.ndarray = (),
                 generated: Sequence[int] = (), allowed: np.ndarray | None = None) -> np.ndarray:
    """The probabilities a sampled token is drawn from (``float64 [vocab]``; module docstring).

    In float64, and the best logit is taken off before dividing by the temperature: the scaled scores are then
    all <= 0, so a subnormal temperature sends the others to -inf (greedy in effect) instead of inf / inf = NaN."""
    row = processed(logits, params, seen, generated, allowed)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        scores = (row - row.max()) / params.temperature
    if params.top_k and params.top_k < scores.shape[0]:
        kth = np.partition(scores, -params.top_k)[-params.top_k]
        scores = np.where(scores < kth, -np.inf, scores)
    probs = np.exp(scores)
    probs /= probs.sum()
    if params.top_p < 1.0:
        # transformers' order: keep the most likely tokens until their total reaches top_p (ties broken as its
        # ascending stable sort breaks them), and at least one
        order = np.argsort(probs, kind="stable")[::-1]
        cumulative = np.cumsum(probs[order])
        keep = int(np.searchsorted(cumulative, params.top_p, side="left")) + 1
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[:keep]] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return probs


def next_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
               seen: Sequence[int] | np.ndarray = (), generated: Sequence[int] = (),
               allowed: np.ndarray | None = None) -> int:
    """The next token from one row of logits ``[vocab]`` (module docstring)."""
    if params.greedy:
        return int(np.argmax(processed(logits, params, seen, generated, allowed)))
    probs = distribution(logits, params, seen, generated, allowed)
    return int(rng.choice(probs.shape[0], p=probs))


def logprobs(logits: np.ndarray, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """``(log p(token), the top most likely (id, log p), best first)`` of the model's own distribution."""
    row = np.asarray(logits, dtype=np.float64)
    peak = row.max()
    row = row - (peak + np.log(np.exp(row - peak).sum()))
    best = np.argpartition(row, -top)[-top:] if top else np.empty(0, np.int64)
    best = best[np.argsort(-row[best], kind="stable")]
    return float(row[token]), tuple((int(i), float(row[i])) for i in best)


def sampling_params(*, max_new_tokens: int = 64, temperature: float | None = None, top_k: int | None = None,
                    top_p: float | None = None, repetition_penalty: float | None = None, stop=None,
                    seed: int | None = None, do_sample: bool | None = None, ignore_eos: bool = False,
                    **more) -> SamplingParams:
    """Parameters as people give them: greedy unless sampling is asked for (``do_sample``, or a temperature
    above 0, a top-k or a top-p given); ``temperature=0`` is greedy whatever else is set."""
    if do_sample is None:
        do_sample = (temperature is None or temperature > 0) and any(v is not None for v in (temperature, top_k, top_p))
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0 if temperature is None else temperature,
                          top_k=0 if top_k is None else top_k, top_p=1.0 if top_p is None else top_p,
                          repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
                          do_sample=bool(do_sample), stop=tuple([stop] if isinstance(stop, str) else stop or ()),
                          seed=seed, ignore_eos=ignore_eos, **more)
