"""Long texts encoded in pieces (slm_core.pieces) give the whole text's ids, for every byte-level
BPE pre-tokenizer the checkpoints bring; tokenizers whose pieces could encode otherwise are found
at load and encoded whole."""

import json
import random

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, normalizers, pre_tokenizers, processors

from slm_core.build.checkpoint import _GGUF_SPLITS
from slm_core.pieces import Pieces, cut

BENCH_TOKENIZER = "bench/assets/tokenizer.json"
WORDS = ["Cheap", "flights", "to", "Rome", "x2", "12", "345", "3.14", "don't", "WE'LL", "it's", "a-b", "c_d",
         "(per", "item)", ",", ".", "!!", "--", "日本語", "ünïcödé", "🤖", "½", "e.g.", "U.S.A.", "<|im_end|>",
         "<|im_start|>user", "Ω≈ç", "naïve", "ﬁne", "Ａｂｃ", "hello", "World", "a", "I"]
SEPARATORS = [" "] * 12 + ["  ", "   ", "\n", "\n\n", "\t", "\r\n", " \n ", "", "\u00a0", "\u200b"]


def texts(seed: int, count: int = 60) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(WORDS) + rng.choice(SEPARATORS) for _ in range(rng.randint(1, 400)))
            for _ in range(count)]


def with_pre_tokenizer(pre, normalizer=None) -> Tokenizer:
    tok = Tokenizer.from_file(BENCH_TOKENIZER)
    tok.pre_tokenizer = pre
    if normalizer is not None:
        tok.normalizer = normalizer
    return tok


def split(pattern: str):
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
CUTTABLE = {
    "gpt2": lambda: Tokenizer.from_file(BENCH_TOKENIZER),
    "qwen2": lambda: with_pre_tokenizer(split(_GGUF_SPLITS["qwen2"])),
    "llama3": lambda: with_pre_tokenizer(split(LLAMA3)),
    "smollm2 digits": lambda: with_pre_tokenizer(pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])),
    "nfc": lambda: with_pre_tokenizer(pre_tokenizers.ByteLevel(add_prefix_space=False), normalizers.NFC()),
}


def serialized(tok: Tokenizer) -> dict:
    return json.loads(tok.to_str())


@pytest.mark.parametrize("name", CUTTABLE)
def test_pieces_encode_as_the_whole_text(name):
    tok = CUTTABLE[name]()
    pieces = Pieces(tok, serialized(tok), every=8)  # many cuts per text
    assert pieces.usable
    batch = texts(seed=len(name))
    assert sum(len(cut(t, 8)) for t in batch) > 10 * len(batch)  # the texts are cut, many times
    assert pieces.encode(batch) == [e.ids for e in tok.encode_batch(batch)]


def test_the_real_smollm2_tokenizer_is_cut_and_encodes_as_whole(smollm2):
    tok = smollm2[1].tokenizer
    pieces = Pieces(tok, serialized(tok), every=16)
    assert pieces.usable
    batch = texts(seed=7)
    assert pieces.encode(batch) == [e.ids for e in tok.encode_batch(batch)]


def test_a_post_processors_ids_go_around_the_pieces():
    tok = Tokenizer.from_file(BENCH_TOKENIZER)
    bos = tok.token_to_id("<|im_start|>")
    tok.post_processor = processors.TemplateProcessing(single="<|im_start|> $A <|im_end|>",
                                                       special_tokens=[("<|im_start|>", bos),
                                                                       ("<|im_end|>", tok.token_to_id("<|im_end|>"))])
    pieces = Pieces(tok, serialized(tok), every=8)
    assert pieces.usable and pieces.prefix == [bos]
    batch = texts(seed=3, count=10)
    assert pieces.encode(batch) == [e.ids for e in tok.encode_batch(batch)]


def stripping_added_token() -> Tokenizer:
    tok = Tokenizer.from_file(BENCH_TOKENIZER)
    tok.add_tokens([AddedToken("<mask>", rstrip=True)])
    return tok


def spaced_added_token() -> Tokenizer:
    tok = Tokenizer.from_file(BENCH_TOKENIZER)
    tok.add_tokens([AddedToken("new york")])
    return tok


@pytest.mark.parametrize("make", [
    lambda: with_pre_tokenizer(pre_tokenizers.Metaspace(prepend_scheme="always")),
    lambda: with_pre_tokenizer(pre_tokenizers.ByteLevel(add_prefix_space=True)),
    lambda: with_pre_tokenizer(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)),  # splits nothing
    lambda: with_pre_tokenizer(pre_tokenizers.ByteLevel(add_prefix_space=False), normalizers.Replace("  ", " ")),
    lambda: with_pre_tokenizer(pre_tokenizers.ByteLevel(add_prefix_space=False), normalizers.Strip()),
    stripping_added_token, spaced_added_token,
], ids=["metaspace", "prefix space", "no split", "replace", "strip", "rstrip token", "spaced token"])
def test_tokenizers_whose_pieces_could_differ_are_encoded_whole(make):
    tok = make()
    assert not Pieces(tok, serialized(tok)).usable


def test_cuts_fall_before_a_space_between_ascii_words_only():
    text = "ab " * 200 + "日本 語 " * 50 + "x  y " * 50
    pieces = cut(text, 16)
    assert "".join(pieces) == text and len(pieces) > 10
    for p in pieces[1:]:
        assert p[0] == " " and p[1].isascii() and p[1].isalpha()
    assert cut("a" * 1000, 16) == ["a" * 1000]  # no space, no cut
    assert cut("short text", 16) == ["short text"]
