"""Long texts encoded in pieces (slm_core.pieces) give the whole text's ids, for every byte-level
BPE pre-tokenizer the checkpoints bring; tokenizers whose pieces could encode otherwise are found
at load and encoded whole."""

import json
import os
import random
from types import SimpleNamespace

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, normalizers, pre_tokenizers, processors

from slm_core.pieces import LLAMA3_SPLIT, QWEN2_SPLIT, Pieces, cut, tokenizer_threads

WORDS = [
    "Cheap",
    "flights",
    "to",
    "Rome",
    "x2",
    "12",
    "345",
    "3.14",
    "don't",
    "WE'LL",
    "it's",
    "a-b",
    "c_d",
    "(per",
    "item)",
    ",",
    ".",
    "!!",
    "--",
    "日本語",
    "ünïcödé",
    "🤖",
    "½",
    "e.g.",
    "U.S.A.",
    "<|im_end|>",
    "<|im_start|>user",
    "Ω≈ç",
    "naïve",
    "ﬁne",
    "Ａｂｃ",
    "hello",
    "World",
    "a",
    "I",
]
SEPARATORS = [" "] * 12 + ["  ", "   ", "\n", "\n\n", "\t", "\r\n", " \n ", "", "\u00a0", "\u200b"]


def texts(seed: int, count: int = 60) -> list[str]:
    rng = random.Random(seed)
    return [
        "".join(rng.choice(WORDS) + rng.choice(SEPARATORS) for _ in range(rng.randint(1, 400))) for _ in range(count)
    ]


def with_pre_tokenizer(tok: Tokenizer, pre, normalizer=None) -> Tokenizer:
    tok.pre_tokenizer = pre
    if normalizer is not None:
        tok.normalizer = normalizer
    return tok


def split(pattern: str):
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


CUTTABLE = {  # each from a fresh SmolLM2 tokenizer (GPT-2's ByteLevel split, digits apart)
    "smollm2": lambda tok: tok,
    "gpt2": lambda tok: with_pre_tokenizer(tok, pre_tokenizers.ByteLevel(add_prefix_space=False)),
    "qwen2": lambda tok: with_pre_tokenizer(tok, split(QWEN2_SPLIT)),
    "llama3": lambda tok: with_pre_tokenizer(tok, split(LLAMA3_SPLIT)),
    "nfkc": lambda tok: with_pre_tokenizer(tok, pre_tokenizers.ByteLevel(add_prefix_space=False), normalizers.NFKC()),
}


def serialized(tok: Tokenizer) -> dict:
    return json.loads(tok.to_str())


@pytest.mark.parametrize("name", CUTTABLE)
def test_pieces_encode_as_the_whole_text(name, byte_level):
    tok = CUTTABLE[name](byte_level())
    pieces = Pieces(tok, serialized(tok), every=8, threads=10**6)  # many cuts per text
    assert pieces.usable
    batch = texts(seed=len(name))
    assert sum(len(cut(t, 8)) for t in batch) > 10 * len(batch)  # the texts are cut, many times
    assert pieces.encode(batch) == [e.ids for e in tok.encode_batch(batch)]


def test_a_post_processors_ids_go_around_the_pieces(byte_level):
    tok = byte_level()
    bos = tok.token_to_id("<|im_start|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A <|im_end|>",
        special_tokens=[("<|im_start|>", bos), ("<|im_end|>", tok.token_to_id("<|im_end|>"))],
    )
    pieces = Pieces(tok, serialized(tok), every=8, threads=10**6)
    assert pieces.usable and pieces.prefix == [bos]
    batch = texts(seed=3, count=10)
    assert pieces.encode(batch) == [e.ids for e in tok.encode_batch(batch)]


def test_a_batch_is_cut_into_about_a_threads_share(byte_level, monkeypatch):
    """Texts are cut into pieces of about half a thread's share of the batch's characters, never
    below `every`: one long text over 8 threads in 16 pieces or so; 40 texts over 2 threads not at
    all."""
    tok = byte_level()
    handed = []
    encode = tok.encode_batch_fast
    pieces = Pieces(tok, serialized(tok), every=8, threads=8)
    monkeypatch.setattr(
        pieces,
        "tokenizer",
        SimpleNamespace(encode_batch_fast=lambda batch, **kw: handed.append(len(batch)) or encode(batch, **kw)),
    )
    long = " ".join(["word"] * 1000)  # 4,999 characters
    assert pieces.encode([long]) == [e.ids for e in tok.encode_batch([long])]
    assert 12 <= handed[-1] <= 20, handed
    pieces.threads = 2
    batch = texts(seed=5, count=40)
    assert pieces.encode(batch) == [e.ids for e in tok.encode_batch(batch)]
    assert handed[-1] == 40
    pieces.threads, pieces.every = 10**6, 600  # a floor: no piece shorter than `every`
    assert pieces.encode([long]) == [e.ids for e in tok.encode_batch([long])]
    assert 4 <= handed[-1] <= 8, handed


def test_the_threads_follow_the_tokenizers_settings(monkeypatch):
    monkeypatch.setenv("RAYON_NUM_THREADS", "3")
    assert tokenizer_threads() == 3
    for unset in ("", "0", "\u00b2", "x"):  # rayon's own default then: the CPUs
        monkeypatch.setenv("RAYON_NUM_THREADS", unset)
        assert tokenizer_threads() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("RAYON_NUM_THREADS", "3")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    assert tokenizer_threads() == 1
    monkeypatch.delenv("TOKENIZERS_PARALLELISM")
    monkeypatch.delenv("RAYON_NUM_THREADS")
    assert tokenizer_threads() == len(os.sched_getaffinity(0))


def added(token: AddedToken, normalizer=None):
    def make(tok: Tokenizer) -> Tokenizer:
        if normalizer is not None:
            tok.normalizer = normalizer
        tok.add_tokens([token])
        return tok

    return make


@pytest.mark.parametrize(
    "make",
    [
        lambda tok: with_pre_tokenizer(tok, pre_tokenizers.Metaspace(prepend_scheme="always")),
        lambda tok: with_pre_tokenizer(tok, pre_tokenizers.ByteLevel(add_prefix_space=True)),
        lambda tok: with_pre_tokenizer(tok, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)),
        lambda tok: with_pre_tokenizer(tok, split("new york")),  # a pattern that matches across a space
        lambda tok: with_pre_tokenizer(
            tok, pre_tokenizers.ByteLevel(add_prefix_space=False), normalizers.Replace("  ", " ")
        ),
        lambda tok: with_pre_tokenizer(tok, pre_tokenizers.ByteLevel(add_prefix_space=False), normalizers.Strip()),
        added(AddedToken("<mask>", rstrip=True)),
        added(AddedToken("new york")),
        added(AddedToken("New\u00a0York", normalized=True), normalizers.NFKC()),  # NFKC makes its space
    ],
    ids=[
        "metaspace",
        "prefix space",
        "no split",
        "unknown split",
        "replace",
        "strip",
        "rstrip token",
        "spaced token",
        "normalized space",
    ],
)
def test_tokenizers_whose_pieces_could_differ_are_encoded_whole(make, byte_level):
    tok = make(byte_level())
    assert not Pieces(tok, serialized(tok)).usable


def test_the_unsafe_cases_would_differ(byte_level):
    """What the refusals above guard against: a normalized added token with a space, cut."""
    tok = added(AddedToken("New\u00a0York", normalized=True), normalizers.NFKC())(byte_level())
    pieces = ["I am flying to New", " York on Monday"]  # a cut where `cut` may make one
    assert [i for p in pieces for i in tok.encode(p).ids] != tok.encode("".join(pieces)).ids


def test_cuts_fall_before_a_space_between_ascii_words_only():
    text = "ab " * 200 + "日本 語 " * 50 + "x  y " * 50
    pieces = cut(text, 16)
    assert "".join(pieces) == text and len(pieces) > 10
    for p in pieces[1:]:
        assert p[0] == " " and p[1].isascii() and p[1].isalpha()
    assert cut("a" * 1000, 16) == ["a" * 1000]  # no space, no cut
    assert cut("short text", 16) == ["short text"]
    assert cut("1 " * 500_000) == ["1 " * 500_000]  # spaces, but none between words: one scan
