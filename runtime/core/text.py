"""Text in: tokenise on the serving side, the way the model was trained to be fed.

:class:`TextTokenizer` wraps a ``tokenizer.json`` (the Hugging Face ``tokenizers`` library, Rust, thread-safe) with
the settings an export's metadata states (:attr:`attnx.contract.ModelInfo.tokenizer`: folder, max length, truncation
side, pad id) or, for a file attnx did not write, those of a tokenizer folder (``attnx serve model.onnx --tokenizer
DIR``). The file's own padding is always disabled (the batcher pads, with the pad id) and its own truncation
replaced by the export's: all-MiniLM-L6-v2's ``tokenizer.json`` pads every text to 128 and truncates at 128, while
sentence-transformers truncates at ``max_seq_length`` 256 (docs: /work/shared/spec/environment.md).

Each text, or (query, document) pair for a cross-encoder (:meth:`TextTokenizer.tokenize_pairs`: the pair template,
longest-first truncation), becomes one row of token ids (:class:`Encoded`); :func:`text_feeds` turns it into a
model's inputs (``input_ids``, an all-ones ``attention_mask``, ``token_type_ids``, and any per-example context row)
and :func:`stack_rows` puts per-text outputs back together, padding outputs with a sequence axis with zeros to the
longest text. The server (:mod:`attnx.runtime.serving.encoding`) and the embedded
:class:`~attnx.runtime.core.encode.TextModel` both use them, so both give the same numbers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from attnx.contract import ContractError, ModelInfo, Role
from attnx.runtime.core.errors import Kind
from attnx.runtime.core.session import InputError, TensorSpec

#: Roles a text request fills in itself; a request carrying text must not carry these too.
TEXT_ROLES = (Role.INPUT_IDS, Role.ATTENTION_MASK, Role.TOKEN_TYPE_IDS)
#: Beyond this, ``model_max_length`` in tokenizer_config.json is transformers' "no limit" placeholder.
_NO_LIMIT = 1_000_000
#: The name of the text input of a model with a tokenizer (KServe's ``BYTES`` input, Triton ensembles).
TEXT_INPUT = "text"
#: Optional second text of each row (a cross-encoder's document beside its query): BYTES ``[N]`` like ``text``,
#: tokenised as pairs in the tokenizer's own pair template.
TEXT_PAIR_INPUT = "text_pair"
#: Characters read per token a model takes (:attr:`TextTokenizer.char_cap`): far more than any real text's
#: tokens span (English averages 4-5), so what lies past the cap never reaches the first ``max_length`` tokens.
CHARS_PER_TOKEN = 64
#: Characters per token of the first cut tried (:meth:`TextTokenizer._prefixed`; a second is sized by what it gave):
#: a 20 KB text's first 256 tokens nearly always lie in its first 1-3,000 characters, so only those are tokenised,
#: not the ~5,000 tokens of all of it.
PREFIX_CHARS_PER_TOKEN = 4
#: Pre-tokenizers whose words never span an ASCII space, each word then tokenised on its own (ByteLevel only with its
#: regex, Metaspace only when it splits), what may sit beside them, and normalizers that map characters one by one:
#: with these, a text cut just before a space gives the same tokens as the whole text, up to the cut.
_SPLIT_AT_SPACES = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit", "ByteLevel", "Metaspace"}
_LOCAL_PRE_TOKENIZERS = _SPLIT_AT_SPACES | {"Digits", "Punctuation", "UnicodeScripts"}
_LOCAL_NORMALIZERS = {"BertNormalizer", "NFC", "NFD", "NFKC", "NFKD", "Lowercase", "StripAccents", "Strip", "Prepend"}


class TooLong(InputError):
    """A text past the characters a model can read that cannot be cut (truncation off): a 413, not a stall."""

    kind = Kind.TOO_LARGE


@dataclass(frozen=True)
class Encoded:
    """One tokenised text: its ids and segment ids (int64), and whether it was cut to the max length."""

    ids: np.ndarray
    type_ids: np.ndarray
    truncated: bool

    @property
    def length(self) -> int:
        return int(self.ids.shape[0])


class TextTokenizer:
    """A ``tokenizer.json`` with the export's max length, truncation side and pad id.

    ``max_length=None`` means no truncation (a foreign model whose limit nothing states)."""

    def __init__(self, file: str | os.PathLike, *, max_length: int | None, truncation_side: str = "right",
                 pad_id: int = 0, model_type: str | None = None):
        from tokenizers import Tokenizer

        self.file = Path(file)
        if not self.file.is_file():
            raise FileNotFoundError(f"no tokenizer file at {self.file}")
        if truncation_side not in ("left", "right"):
            raise ContractError(f"truncation side {truncation_side!r} must be left or right")
        if max_length is not None and max_length < 2:
            raise ContractError(f"tokenizer max length {max_length} is too small")
        self.max_length = max_length
        #: Texts are cut to this many characters before tokenising (the tokenizer would otherwise read all of a
        #: 20 MB string to keep its first 256 tokens); None: no cap (nothing states the model's length).
        self.char_cap = max_length * CHARS_PER_TOKEN if max_length is not None else None
        self.truncation_side = truncation_side
        self.pad_id = int(pad_id)
        self.model_type = model_type
        try:
            self._full = Tokenizer.from_file(str(self.file))
            self._cut = Tokenizer.from_file(str(self.file))
        except Exception as e:  # noqa: BLE001 - the Rust side raises plain Exceptions
            raise ContractError(f"{self.file} is not a readable tokenizer.json ({e})") from None
        for tok in (self._full, self._cut):
            tok.no_padding()
            tok.no_truncation()
        if max_length is not None:
            self._cut.enable_truncation(max_length, strategy="longest_first", direction=truncation_side)
        self.vocab_size = self._full.get_vocab_size(with_added_tokens=True)
        self.cuts_at_spaces = _cuts_at_spaces(self._full)

    # --- construction ----------------------------------------------------------
    @classmethod
    def from_export(cls, model_path: str | os.PathLike, info: ModelInfo | None) -> "TextTokenizer | None":
        """The tokenizer an attnx export names in its metadata (None when it has none). The folder must
        lie beside the model (file contents are untrusted)."""
        if info is None or info.tokenizer is None:
            return None
        tok = info.tokenizer  # checked when the metadata was read (attnx.contract.TokenizerSettings)
        file = tok.path(Path(model_path).resolve().parent)
        if not file.is_file():
            raise FileNotFoundError(f"{Path(model_path).name} names the tokenizer {file}, which is missing "
                                    f"(keep the .tokenizer folder beside the model)")
        return cls(file, max_length=tok.max_length, truncation_side=tok.truncation_side, pad_id=tok.pad_id,
                   model_type=tok.model_type)

    @classmethod
    def from_folder(cls, folder: str | os.PathLike, max_length: int | None = None) -> "TextTokenizer":
        """A Hugging Face tokenizer folder (``tokenizer.json`` and, when there, ``tokenizer_config.json``,
        ``sentence_bert_config.json``). ``max_length``: sentence-transformers' ``max_seq_length``, else
        the tokenizer's ``model_max_length``, else the file's own truncation length, else none."""
        folder = Path(folder)
        file = folder / "tokenizer.json" if folder.is_dir() else folder
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder} (only fast tokenizers' files can be served)")
        folder = file.parent
        config = _read_json(folder / "tokenizer_config.json")
        found = max_length or _read_json(folder / "sentence_bert_config.json").get("max_seq_length")
        if not found and isinstance(config.get("model_max_length"), (int, float)):
            found = int(config["model_max_length"]) if config["model_max_length"] < _NO_LIMIT else None
        if not found:
            found = (_read_json(file).get("truncation") or {}).get("max_length")
        side = config.get("truncation_side", "right")
        pad_token = config.get("pad_token")
        pad_token = pad_token.get("content") if isinstance(pad_token, dict) else pad_token
        probe = cls(file, max_length=int(found) if found else None, truncation_side=side)
        pad_id = probe._full.token_to_id(pad_token) if isinstance(pad_token, str) else None
        if pad_id is None:
            pad_id = ((_read_json(file).get("padding") or {}).get("pad_id")) or 0
        probe.pad_id = int(pad_id)
        return probe

    def limit(self, max_length: int) -> None:
        """Truncate at ``max_length`` tokens from now on (a tokenizer that states no limit, on a model that has one)."""
        if max_length < 2:
            raise ContractError(f"tokenizer max length {max_length} is too small")
        self.max_length = max_length
        self.char_cap = max_length * CHARS_PER_TOKEN
        self._cut.enable_truncation(max_length, strategy="longest_first", direction=self.truncation_side)

    def describe(self) -> dict[str, Any]:
        """What clients are told (model metadata parameters)."""
        return {"max_length": self.max_length, "truncation_side": self.truncation_side,
                "truncation": self.max_length is not None, "pad_id": self.pad_id}

    # --- tokenising --------------------------------------------------------------
    def tokenize(self, texts: Sequence[str], *, truncate: bool = True, allow_empty: bool = False,
                 add_special_tokens: bool = True) -> list[Encoded]:
        """Token ids for each text: special tokens added (unless ``add_special_tokens=False``: a chat template
        writes its own), cut to the max length on the truncation side (``truncate=False``: a text past it is
        an :class:`InputError` instead)."""
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise InputError(f"text {i} is {type(text).__name__}, not a string")
            if not text and not allow_empty:
                raise InputError(f"text {i} is empty")
        return self._encode(list(texts), truncate, "text", add_special_tokens)

    def tokenize_pairs(self, pairs: Sequence[tuple[str, str]], *, truncate: bool = True) -> list[Encoded]:
        """Token ids for each ``(first, second)`` pair, in the tokenizer's own pair template (BERT: ``[CLS] a [SEP] b
        [SEP]``, segment ids 1 on ``b``), as a cross-encoder is fed a (query, document).

        Past the max length, tokens come off the longer of the two texts, one at a time, until the pair fits ("longest
        first", on the truncation side): what sentence-transformers' CrossEncoder asks of transformers' tokenizer
        (``truncation="longest_first"``, the same Rust code) and what TEI does, so a long document never pushes the
        query out. Either text may be empty (the template still gives tokens)."""
        for i, pair in enumerate(pairs):
            if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
                raise InputError(f"pair {i} is not two strings")
        return self._encode([tuple(p) for p in pairs], truncate, "pair")

    def tokens(self, text: str, add_special_tokens: bool = True) -> list[tuple[int, str, bool, int, int]]:
        """``(id, text, special, start, stop)`` of each token of ``text`` (not truncated): a special token's
        text is the token itself, another's the characters ``text[start:stop]`` it came from (TEI's Tokenize)."""
        if self.char_cap is not None and len(text) > self.char_cap:
            raise TooLong(f"the text has {len(text)} characters, more than the {self.char_cap} this model reads")
        try:
            enc = self._full.encode(text, add_special_tokens=add_special_tokens)
        except Exception as e:  # noqa: BLE001 - e.g. lone surrogates
            raise InputError(f"cannot tokenise the text: {' '.join(str(e).split())[:200]}") from None
        return [(i, token if special else text[a:b], bool(special), a, b) for i, token, special, (a, b)
                in zip(enc.ids, enc.tokens, enc.special_tokens_mask, enc.offsets)]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Token ids back to text (generation)."""
        return self._full.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def _cap(self, text: str) -> str:
        """``text`` within :attr:`char_cap`, from the end truncation keeps."""
        if self.char_cap is None or len(text) <= self.char_cap:
            return text
        return text[:self.char_cap] if self.truncation_side == "right" else text[-self.char_cap:]

    def _prefix(self, text: str, size: int) -> str | None:
        """The start of a long ``text`` to tokenise in its place when truncating on the right: its first ``size``
        characters, cut back to just before the last space that follows a word (so that word is whole, and every
        word before it tokenises as in the whole text); None when the tokenizer's words may span spaces, the text
        is not longer than ``size`` (or the char cap), or the cut has no such space."""
        if not self.cuts_at_spaces or self.char_cap is None or self.truncation_side != "right":
            return None  # (char_cap is None exactly when max_length is)
        if len(text) <= size or size >= self.char_cap:
            return None
        at = text.rfind(" ", 0, size)
        while at > 0 and text[at - 1] == " ":  # the first space of a run: the word before it ends there
            at -= 1
        return text[:at] if at > 0 and not text[at - 1].isspace() else None

    def _prefixed(self, inputs: list, add_special_tokens: bool) -> dict[int, Encoded]:
        """Texts whose :meth:`_prefix` gives more than max length tokens: the prefix's tokens, cut, are the whole
        text's, cut (the first tokens depend only on the words before the cut). A prefix with fewer tokens could
        miss some of the whole text's: a second, longer one is tried, sized by the characters a token the first
        showed (aiming at 1.5 x max length tokens); after that the text goes the long way."""
        out: dict[int, Encoded] = {}
        if self.max_length is None:
            return out
        sizes = {i: self.max_length * PREFIX_CHARS_PER_TOKEN for i, x in enumerate(inputs) if isinstance(x, str)}
        for _ in range(2):
            found = {i: p for i, size in sizes.items() if (p := self._prefix(inputs[i], size)) is not None}
            if not found:
                break
            try:
                encodings = self._cut.encode_batch(list(found.values()), add_special_tokens=add_special_tokens)
            except Exception:  # noqa: BLE001 - the long way names the fault
                break
            sizes = {}
            for (i, cut), enc in zip(found.items(), encodings):
                if enc.overflowing:
                    out[i] = Encoded(np.asarray(enc.ids, dtype=np.int64), np.asarray(enc.type_ids, dtype=np.int64),
                                     True)
                else:
                    sizes[i] = len(cut) * 3 * self.max_length // (2 * max(1, len(enc.ids))) + 1
        return out

    def _encode(self, inputs: list, truncate: bool, what: str, add_special_tokens: bool = True) -> list[Encoded]:
        short = self._prefixed(inputs, add_special_tokens) if truncate else {}
        if short:
            rest = [i for i in range(len(inputs)) if i not in short]
            done = dict(zip(rest, self._encode([inputs[i] for i in rest], truncate, what, add_special_tokens)))
            return [short[i] if i in short else done[i] for i in range(len(inputs))]
        tok = self._cut if truncate else self._full
        capped = [self._cap(x) if isinstance(x, str) else tuple(map(self._cap, x)) for x in inputs]
        cut = [a is not b if isinstance(a, str) else any(p is not q for p, q in zip(a, b))
               for a, b in zip(capped, inputs)]
        inputs = capped
        try:
            encodings = tok.encode_batch(inputs, add_special_tokens=add_special_tokens)
        except Exception as e:  # noqa: BLE001 - e.g. lone surrogates, which are not UTF-8
            raise InputError(f"cannot tokenise the text: {' '.join(str(e).split())[:200]}") from None
        out = []
        for i, enc in enumerate(encodings):
            ids = np.asarray(enc.ids, dtype=np.int64)
            if not truncate and self.max_length is not None and ids.shape[0] > self.max_length:
                raise InputError(f"{what} {i} has {ids.shape[0]} tokens, more than the model's max length "
                                 f"{self.max_length} (and truncation is off for this request)")
            if not truncate and cut[i]:
                raise TooLong(f"{what} {i} has more than the {self.char_cap} characters this model reads "
                              f"({CHARS_PER_TOKEN} a token at most; truncation is off for this request)")
            if ids.shape[0] == 0:
                raise InputError(f"{what} {i} gives no tokens")
            out.append(Encoded(ids, np.asarray(enc.type_ids, dtype=np.int64), bool(enc.overflowing) or cut[i]))
        return out


def _cuts_at_spaces(tokenizer) -> bool:
    """Whether a text cut just before a space tokenises as the whole text does up to there (the module's
    :data:`_SPLIT_AT_SPACES`): local normalizers, pre-tokenizers that split at spaces, no added token with a space."""
    def parts(component, key: str) -> list[dict]:
        if component is None:
            return []
        state = json.loads(component.__getstate__())
        return state.get(key, []) if state.get("type") == "Sequence" else [state]

    try:
        pre, norm = parts(tokenizer.pre_tokenizer, "pretokenizers"), parts(tokenizer.normalizer, "normalizers")
        added = [t.content for t in tokenizer.get_added_tokens_decoder().values()]
    except Exception:  # noqa: BLE001 - a component this cannot read: take the long way
        return False
    splits = [p for p in pre if p.get("type") in _SPLIT_AT_SPACES and p.get("use_regex", True) and p.get("split", True)]
    return (bool(splits) and all(p.get("type") in _LOCAL_PRE_TOKENIZERS for p in pre)
            and all(n.get("type") in _LOCAL_NORMALIZERS for n in norm) and not any(" " in t for t in added))


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ContractError(f"{path}: not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def decode_text(value: Any, index: int) -> str:
    """One element of a BYTES tensor as text: bytes must be UTF-8, strings must encode to it."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"text {index} is not valid UTF-8 (byte {bytes(value)[e.start]:#04x} at "
                             f"position {e.start})") from None
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InputError(f"text {index} is not valid UTF-8 (a lone surrogate at position {e.start})") from None
        return value
    raise InputError(f"text {index} is {type(value).__name__}, not a string")


# --------------------------------------------------------------------------------------
# Texts -> model inputs, per-text outputs -> one response
# --------------------------------------------------------------------------------------


def text_inputs(inputs: Sequence[TensorSpec]) -> dict[str, TensorSpec]:
    """The model's inputs a text fills: ``{role: spec}`` for token ids, mask and segment ids."""
    found = {s.role: s for s in inputs if s.role in TEXT_ROLES}
    if Role.INPUT_IDS not in found:
        raise InputError("the model has no token-id input, so it cannot take text")
    return found


def text_feeds(inputs: Sequence[TensorSpec], enc: Encoded,
               context: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """One text as one row of the model's inputs (``[1, length]`` each), plus its context row."""
    feeds: dict[str, np.ndarray] = {}
    roles = text_inputs(inputs)
    for role, spec in roles.items():
        value = {Role.INPUT_IDS: enc.ids, Role.ATTENTION_MASK: np.ones_like(enc.ids),
                 Role.TOKEN_TYPE_IDS: enc.type_ids}[role]
        feeds[spec.name] = value.astype(spec.dtype, copy=False)[None, :]
    feeds.update(context or {})
    return feeds


def context_rows(inputs: Sequence[TensorSpec], context: Mapping[str, np.ndarray], count: int
                 ) -> list[dict[str, np.ndarray]]:
    """Split per-example context inputs (no sequence axis) into one row per text."""
    rows: list[dict[str, np.ndarray]] = [{} for _ in range(count)]
    specs = {s.name: s for s in inputs}
    for name, arr in context.items():
        spec = specs.get(name)
        if spec is None:
            raise InputError(f"unknown input {name!r}")
        if spec.seq_axis is not None:
            raise InputError(f"input {name!r} has one value per token, which a text request cannot line up "
                             f"with its tokens: send token ids instead")
        axis = spec.batch_axis
        if axis is None or arr.ndim != spec.rank or arr.shape[axis] != count:
            raise InputError(f"input {name!r}: needs {count} rows (one per text) along its batch axis, "
                             f"got shape {list(arr.shape)}")
        for i in range(count):
            rows[i][name] = np.take(arr, [i], axis=axis)
    return rows


def stack_rows(parts: Sequence[Mapping[str, np.ndarray]], outputs: Sequence[TensorSpec]) -> dict[str, np.ndarray]:
    """Per-text results back into one result: rows stacked along the batch axis; an output with a
    sequence axis is padded with zeros to the longest text (each text's own length stays exact)."""
    if len(parts) == 1:
        return dict(parts[0])
    specs = {s.name: s for s in outputs}
    merged: dict[str, np.ndarray] = {}
    for name in parts[0]:
        spec = specs[name]
        arrays = [p[name] for p in parts]
        b, s = spec.batch_axis, spec.seq_axis
        if s is not None:
            longest = max(a.shape[s] for a in arrays)
            padded = []
            for a in arrays:
                widths = [(0, 0)] * a.ndim
                widths[s] = (0, longest - a.shape[s])
                padded.append(np.pad(a, widths))
            arrays = padded
        merged[name] = np.concatenate(arrays, axis=b)
    return merged


def prepare_text_model(session, tokenizer: TextTokenizer, folder: str | os.PathLike | None, on_note=None):
    """A session ready to be fed by ``tokenizer`` (its folder: ``folder``, else the tokenizer file's own):
    refused when the tokenizer cannot feed it (:func:`attnx.runtime.core.model_checks.check_text_model`), and
    given a pooled ``sentence_embedding`` when it has only token embeddings
    (:func:`attnx.runtime.core.pooling.with_pooling`; ``on_note`` hears which pooling, when nothing says)."""
    from attnx.runtime.core.model_checks import check_text_model
    from attnx.runtime.core.pooling import with_pooling

    folder = Path(folder) if folder is not None else tokenizer.file.parent
    folder = folder.parent if folder.is_file() else folder  # --tokenizer may name the tokenizer.json itself
    check_text_model(session, tokenizer, folder)
    return with_pooling(session, folder, on_note=on_note)
