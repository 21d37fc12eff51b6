"""Issue 45: a long text is tokenised from a prefix of its characters, never all of it, and the result is the
whole text's tokens cut to the max length, exactly (the real all-MiniLM-L6-v2 tokenizer, and a byte-level BPE)."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from attnx.pretrained import minilm_path
from attnx.runtime.core.text import PREFIX_CHARS_PER_TOKEN, TextTokenizer

LOREM = ("lorem ipsum dolor sit amet " * 760)[:20_000]
#: name: (text, whether the prefix alone decides it)
TEXTS = {
    "lorem 20 KB": (LOREM, True),
    "prose with punctuation": ("The quick brown fox, jumping over 3 lazy dogs; then (again) it ran! " * 300, True),
    "long words": (" ".join(["antidisestablishmentarianism" + "x" * (i % 40) for i in range(900)]), True),
    "words past WordPiece's 100 characters": ((("y" * 130) + " ") * 120, False),
    "no spaces": ("abc" * 7000, False),
    "no spaces, punctuated": ("a.b,c;d" * 2000, False),
    "newlines only": ("word\n" * 4000, False),
    "tabs and space runs": ("alpha\t beta     gamma  \u00a0delta " * 700, True),  # 8.25 a token: the second cut
    "tabs and spaces, denser": ("al\tbe  ga \u00a0de " * 1500, True),
    "accents and combining marks": ("cafe\u0301 naïve ﬁancé Ångström " * 800, True),
    "CJK with spaces": ("日本語のテキスト 中文文本 한국어 " * 900, True),
    "emoji and surrogate pairs": ("🙂👍🏽 mixed ✨text🚀 " * 900, True),
    "a space ends the prefix exactly": ("x" * (256 * PREFIX_CHARS_PER_TOKEN - 1) + " " + "tail " * 50, False),
    "short": ("a short sentence", False),
    "spaces first": (" " * 3000 + "words after spaces " * 300, False),
}


def reference(tok: TextTokenizer, text: str) -> tuple[list[int], bool]:
    """The whole text through the same tokenizer.json, cut to the max length: what truncation promises."""
    whole = Tokenizer.from_file(str(tok.file))
    whole.no_padding()
    whole.enable_truncation(tok.max_length, strategy="longest_first", direction="right")
    enc = whole.encode(text)
    return enc.ids, bool(enc.overflowing)


@pytest.fixture(scope="module")
def minilm() -> TextTokenizer:
    return TextTokenizer.from_folder(minilm_path())


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory) -> TextTokenizer:
    """A GPT-2-style byte-level BPE (regex pre-tokenizer: a space joins the word after it), trained here."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = [text for text, _ in TEXTS.values()] * 2
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(corpus, trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    bpe.save(str(path))
    return TextTokenizer(path, max_length=128)


def test_minilm_splits_at_spaces(minilm):
    assert minilm.cuts_at_spaces and minilm.max_length == 256 and minilm.truncation_side == "right"


@pytest.mark.parametrize("name", list(TEXTS))
def test_prefix_gives_the_whole_texts_tokens(minilm, name):
    text, by_prefix = TEXTS[name]
    assert (0 in minilm._prefixed([text], True)) is by_prefix, name  # which way it went
    if by_prefix:
        assert minilm._prefix(text, 256 * PREFIX_CHARS_PER_TOKEN) is not None  # a first cut was tried
    got = minilm.tokenize([text])[0]
    ids, cut = reference(minilm, text)
    np.testing.assert_array_equal(got.ids, ids)
    assert got.length == len(ids)
    if by_prefix or len(text) <= minilm.char_cap:  # past the char cap a text counts as cut, whatever its tokens
        assert got.truncated is cut


def test_a_batch_mixes_both_ways_in_order(minilm):
    texts = [t for t, _ in TEXTS.values()]
    got = minilm.tokenize(texts)
    for text, enc in zip(texts, got):
        np.testing.assert_array_equal(enc.ids, reference(minilm, text)[0])


@pytest.mark.parametrize("name", [n for n, (_, p) in TEXTS.items() if p])
def test_byte_level_prefix_gives_the_whole_texts_tokens(byte_level, name):
    text = TEXTS[name][0]
    assert byte_level.cuts_at_spaces
    np.testing.assert_array_equal(byte_level.tokenize([text])[0].ids, reference(byte_level, text)[0])


def test_tokenizers_whose_words_span_spaces_take_the_long_way(tmp_path):
    whole = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))  # no pre-tokenizer: one word
    whole.save(str(tmp_path / "tokenizer.json"))
    tok = TextTokenizer(tmp_path / "tokenizer.json", max_length=16)
    assert not tok.cuts_at_spaces and tok._prefix(LOREM, 1024) is None
    left = TextTokenizer.from_folder(minilm_path())
    left.truncation_side = "left"
    assert left._prefix(LOREM, 1024) is None
