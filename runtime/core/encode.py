"""Embedded use, the way people call sentence-transformers: ``TextModel(path).encode(sentences)``.

    from attnx.runtime import TextModel

    model = TextModel("attnx-out/all-MiniLM-L6-v2-smal.onnx")    # or its folder; .engine too
    emb = model.encode(["A man is eating food.", "A man rides a horse."], normalize_embeddings=True)
    emb.shape                                                     # (2, 384) float32
    logits = TextModel("gpt2-mha.onnx").logits(["Hello there"])  # [tokens, vocab] per text
    for piece in TextModel("attnx-out/gpt2-mha-with-past").generate("Hello", max_new_tokens=20):
        print(piece, end="")                                      # a with-past export generates

The model loads once (:func:`attnx.runtime.load`) with its tokenizer (:mod:`attnx.runtime.core.text`: the
export's metadata, or ``tokenizer=DIR`` for a file attnx did not write). ``encode`` tokenises every
text, sorts them by length, runs ``batch_size`` at a time padded to the longest of each batch (the
batcher's own :class:`~attnx.runtime.core.batcher.BatchLayout`, so the same numbers as ``attnx serve``)
and returns them in the order given. No torch is imported.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from attnx.runtime.core.layout import BatchLayout
from attnx.runtime.core.loading import load
from attnx.runtime.core.session import InputError, Session
from attnx.runtime.core.text import TextTokenizer, context_rows, prepare_text_model, text_feeds

#: ``output_value`` names accepted besides the model's own output names (sentence-transformers' words).
ALIASES = {"token_embeddings": "last_hidden_state"}
#: With ``show_progress_bar=None``, a bar appears (on a terminal) from this many batches on.
_AUTO_PROGRESS_BATCHES = 8


def find_model_file(path: str | os.PathLike) -> Path:
    """``path`` itself, or the one ``.onnx`` (else ``.engine``) in the folder ``path``."""
    p = Path(path)
    if p.is_file():
        return p
    if not p.is_dir():
        raise FileNotFoundError(f"no model file or folder at {p}")
    for pattern in ("*.onnx", "*.engine"):
        found = sorted(p.glob(pattern))
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise ValueError(f"{p} holds several models ({', '.join(f.name for f in found)}): name one")
    raise FileNotFoundError(f"no .onnx or .engine file in {p}")


class TextModel:
    """A text model, loaded once: :meth:`encode` (embeddings), :meth:`logits` (causal LMs), :meth:`tokenize`.

    ``session`` may be an already-loaded :class:`~attnx.runtime.core.session.Session` in place of ``path``.
    Thread-safe (the session and the tokenizer are).

    ``spin``: ONNX Runtime's pool threads busy-wait for the next op of a call, ONNX Runtime's own default (and
    fastembed's and sentence-transformers'): one short text is ~20% faster on a quiet machine
    (benchmarks/bench_peers.py). Pass False where the process shares its cores with other busy work (on a
    loaded 2-core machine spinning was 1.2-1.9x slower); ``attnx serve`` keeps it off for its front end."""

    def __init__(self, path: str | os.PathLike | Session, *, tokenizer: str | os.PathLike | None = None,
                 device: str = "auto", threads: int | None = None, axes=None, spin: bool = True):
        if isinstance(path, Session):
            self.session = path
        else:
            self.session = load(find_model_file(path), device=device, threads=threads, axes=axes, spin=spin)
        if tokenizer is None:
            from attnx.runtime.core.decoding import source_info  # an engine: its ONNX's metadata names the tokenizer

            info, source = source_info(self.session)
            found = TextTokenizer.from_export(source, info)
        else:
            found = TextTokenizer.from_folder(tokenizer)
        if found is None:
            raise ValueError(f"{self.session.path.name} carries no tokenizer: pass tokenizer=FOLDER "
                             f"(a folder with tokenizer.json)")
        self.tokenizer = found
        # Refused if the tokenizer cannot feed the model; a file with token embeddings only is pooled as its
        # sentence-transformers folder says (or the mean, said once): the `sentence_embedding` `attnx serve` gives.
        self.session = prepare_text_model(self.session, found, tokenizer,
                                          on_note=lambda m: warnings.warn(m, UserWarning, stacklevel=3))
        self.layout = BatchLayout.of(self.session, found.pad_id)
        self.outputs = {s.name: s for s in self.session.outputs}

    @property
    def max_seq_length(self) -> int | None:
        return self.tokenizer.max_length

    def tokenize(self, texts: Sequence[str]) -> list[np.ndarray]:
        """The token ids each text is run with (special tokens added, truncated)."""
        return [e.ids for e in self.tokenizer.tokenize(list(texts), allow_empty=True)]

    # --- the sentence-transformers call ------------------------------------------------
    def encode(self, sentences: str | Sequence[str], batch_size: int = 32, normalize_embeddings: bool = False,
               show_progress_bar: bool | None = None, convert_to_numpy: bool = True,
               output_value: str | None = "sentence_embedding",
               context: Mapping[str, np.ndarray] | None = None) -> Any:
        """Embeddings of ``sentences``: ``[N, d]`` float32 (one sentence: ``[d]``).

        ``output_value``: ``"sentence_embedding"`` (the export's own pooling; for a file without one,
        ``last_hidden_state`` pooled as the tokenizer folder's sentence-transformers ``modules.json`` says,
        else its mean, as sentence-transformers does for a plain transformer: :mod:`attnx.runtime.core.pooling`),
        ``"token_embeddings"`` / ``"last_hidden_state"`` / ``"logits"`` or any output
        name (a list of ``[tokens, ...]`` arrays, one per sentence), or None for every output (a list
        of dicts). ``context``: per-sentence context inputs of a variant, ``[N, ...]`` each.
        ``convert_to_numpy=False`` gives a list of arrays in place of one stacked array."""
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        single = isinstance(sentences, str)
        texts = [sentences] if isinstance(sentences, str) else list(sentences)
        names = self._outputs_for(output_value)
        rows = self._run_texts(texts, names, batch_size, show_progress_bar, context or {})
        if output_value is None:
            return rows[0] if single else rows
        name = names[0]
        values = [r[name][0] for r in rows]
        if normalize_embeddings:
            values = [v / max(float(np.linalg.norm(v)), 1e-12) for v in values]
        if single:
            return values[0]
        per_token = self.outputs[name].seq_axis is not None
        if convert_to_numpy and not per_token:
            return np.stack(values) if values else np.zeros((0, *self._row_shape(name)), np.float32)
        return values

    # --- generation (with-past exports) -------------------------------------------------
    def generate(self, prompt: str, *, max_new_tokens: int = 64, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, repetition_penalty: float | None = None,
                 stop: str | Sequence[str] | None = None, seed: int | None = None, do_sample: bool | None = None,
                 context: Mapping[str, np.ndarray] | None = None, details: bool = False):
        """Generate from ``prompt`` with a with-past export (``attnx export --with-past``): a Python generator
        of text pieces as they are made (``details=True``: :class:`~attnx.runtime.core.generate.Piece` s, with the
        token ids and, last, ``finish_reason``). Greedy unless sampling is asked for (``temperature`` > 0,
        ``top_k``, ``top_p``, ``do_sample``); ``stop`` strings end the text (and are not part of it);
        ``seed`` makes sampling repeatable; ``context``: a placed variant's context inputs, one row each.
        Parameters are checked before anything runs (ValueError, one line)."""
        from attnx.runtime.core.generate import stream
        from attnx.runtime.core.sampling import sampling_params

        params = sampling_params(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                 repetition_penalty=repetition_penalty, stop=stop, seed=seed, do_sample=do_sample)
        decoder = self.decoder
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("the prompt must be a non-empty string")
        ids = self.tokenizer.tokenize([prompt], truncate=False)[0].ids.tolist()
        pieces = stream(decoder, self.tokenizer, ids, params, context)
        return pieces if details else (p.text for p in pieces if p.text)

    @property
    def decoder(self):
        """The with-past model's step runner (:class:`~attnx.runtime.core.decoding.Decoder`); ValueError for a file
        that cannot generate."""
        if getattr(self, "_decoder", None) is None:
            from attnx.runtime.core.decoding import Decoder

            self._decoder = Decoder(self.session)
        return self._decoder

    def logits(self, texts: str | Sequence[str], batch_size: int = 8,
               show_progress_bar: bool | None = None) -> Any:
        """A causal LM's logits for each text: ``[tokens, vocab]`` per text (a list; one text: an array)."""
        if "logits" not in self.outputs:
            raise ValueError(f"{self.session.path.name} has no 'logits' output (outputs: {list(self.outputs)})")
        return self.encode(texts, batch_size=batch_size, show_progress_bar=show_progress_bar, output_value="logits")

    # --- internals ------------------------------------------------------------------------
    def _outputs_for(self, output_value: str | None) -> list[str]:
        """The outputs to run."""
        if output_value is None:
            return list(self.outputs)
        name = ALIASES.get(output_value, output_value)
        if name in self.outputs:
            return [name]
        raise ValueError(f"output_value {output_value!r}: the model gives {list(self.outputs)}")

    def _row_shape(self, name: str) -> tuple:
        spec = self.outputs[name]
        return tuple(d for i, d in enumerate(spec.shape) if i != spec.batch_axis)

    def _run_texts(self, texts: list[str], names: list[str], batch_size: int, progress: bool | None,
                   context: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        """Each text's outputs (``[1, ...]``), run longest first in batches of ``batch_size``."""
        encoded = self.tokenizer.tokenize(texts, allow_empty=True)
        ctx = context_rows(self.session.inputs, context, len(texts)) if context else [{}] * len(texts)
        prepared = [self.layout.prepare(self.session.check_feeds(text_feeds(self.session.inputs, e, c)))
                    for e, c in zip(encoded, ctx)]
        order = sorted(range(len(texts)), key=lambda i: -encoded[i].length)
        chunks = length_chunks(order, [e.length for e in encoded], batch_size)
        results: list[dict[str, np.ndarray]] = [{} for _ in texts]
        with _progress(len(texts), progress, len(chunks)) as advance:
            for chunk in chunks:
                items = [prepared[i] for i in chunk]
                if self.layout.can_batch:
                    feeds, _ = self.layout.merge(items)
                    parts = self.layout.split(self.session._run(feeds, names), items)
                else:
                    parts = [self.session._run(p.feeds, names) for p in items]
                for i, part in zip(chunk, parts):
                    results[i] = part
                advance(len(chunk))
        return results


#: Longest/shortest text in one run, as the server batches (``attnx serve --max-length-ratio``): padding is
#: compute on a CPU (32 of the built-in sentences, 4-78 tokens, in one encode call: 3.6x faster than one
#: padded batch; benchmarks/bench_peers.py).
MAX_LENGTH_RATIO = 1.5


def length_chunks(order: list[int], lengths: list[int], batch_size: int,
                  ratio: float = MAX_LENGTH_RATIO) -> list[list[int]]:
    """``order`` (longest first) cut into runs of at most ``batch_size`` whose longest is at most ``ratio``
    times their shortest."""
    chunks: list[list[int]] = []
    for i in order:
        if not chunks or len(chunks[-1]) == batch_size or lengths[chunks[-1][0]] > ratio * max(lengths[i], 1):
            chunks.append([])
        chunks[-1].append(i)
    return chunks


@contextlib.contextmanager
def _progress(total: int, show: bool | None, batches: int):
    """``advance(n)`` of a rich progress bar over ``total`` texts when asked for (or, when ``show`` is None, on a
    terminal for a long input); otherwise a no-op."""
    if not (show if show is not None else batches >= _AUTO_PROGRESS_BATCHES and sys.stderr.isatty()):
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("encoding", total=total)
        yield lambda n: bar.advance(task, n)


__all__ = ["TextModel", "find_model_file", "InputError"]
