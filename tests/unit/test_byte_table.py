"""Candidates decoded by the table of token bytes (slm_core.byte_table) read as the tokenizer's own
decode(skip_special_tokens=True) does, invalid UTF-8 included, on SmolLM2's tokenizer; a decoder
that is not byte-level keeps the tokenizer's decode."""

import json
import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders

from slm_core.byte_table import ByteTable


def table(tok: Tokenizer) -> ByteTable:
    return ByteTable(tok, json.loads(tok.to_str()))


def sequences(tok: Tokenizer, seed: int, count: int = 20_000) -> list[list[int]]:
    """Random candidates, half of them of single-byte tokens that split characters."""
    rng = random.Random(seed)
    vocab = tok.get_vocab(with_added_tokens=True)
    size = max(vocab.values()) + 1
    single = [i for t, i in vocab.items() if len(t) == 1]
    added = list(tok.get_added_tokens_decoder())
    out = []
    for _ in range(count):
        pool = single if rng.random() < 0.5 else range(size)
        seq = [rng.choice(pool) for _ in range(rng.randint(0, 6))]
        if rng.random() < 0.2:
            seq.insert(rng.randint(0, len(seq)), rng.choice(added))
        out.append(seq)
    return out


def test_the_table_decodes_as_the_tokenizer(byte_level):
    tok = byte_level()
    tok.add_tokens([AddedToken("new york"), AddedToken("日本")])  # added, not special: their own text
    bytes_ = table(tok)
    assert bytes_.usable
    seqs = sequences(tok, seed=0)
    assert bytes_.decode_each(seqs) == [tok.decode(s, skip_special_tokens=True) for s in seqs]
    assert any("\ufffd" in t for t in bytes_.decode_each(seqs))  # invalid UTF-8 was among them


def test_ids_past_the_vocabulary_decode_to_nothing_as_in_the_tokenizer(byte_level):
    tok = byte_level()
    bytes_ = table(tok)
    past = tok.get_vocab_size() + 1000  # a model's spare embedding rows
    seqs = [[past, tok.token_to_id("Ġthe") or 300, past + 5], [past]]
    assert bytes_.decode_each(seqs) == [tok.decode(s, skip_special_tokens=True) for s in seqs]
    with pytest.raises(ValueError, match="negative"):
        bytes_.decode_each([[-10 * len(bytes_.table)]])


def test_a_decoder_that_is_not_byte_level_keeps_the_tokenizers_decode(byte_level):
    tok = byte_level()
    tok.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])
    assert not table(tok).usable
