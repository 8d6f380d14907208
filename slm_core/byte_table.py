"""Beam candidates decoded from a table of each token's bytes, for tokenizers whose decoder is
byte-level (GPT-2, Llama 3, Qwen2, SmolLM2): a candidate's text is its tokens' bytes joined, read
as UTF-8 with U+FFFD for what is not, as the tokenizer's own ByteLevel decoder makes it, in a third
of its time (no call into the tokenizer per candidate).
"""

import re
from functools import lru_cache

import tokenizers


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (byte-level BPE spells every token with it):
    printable Latin-1 stands for itself, the other bytes for the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(rest)}}


class ByteTable:
    """Each token id's bytes, special tokens as none (skip_special_tokens). `usable` is False for
    a tokenizer whose decoder is not ByteLevel alone, or whose table disagrees with its decode."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, config: dict):
        """config: the tokenizer's JSON (tokenizer.to_str()), parsed."""
        self.table: list[bytes] = []
        self.usable = False
        if (config.get("decoder") or {}).get("type") != "ByteLevel":
            return
        spelling = byte_alphabet()
        to_latin1 = {ord(c): b for b, c in spelling.items()}  # str.translate: each character to its byte's
        foreign = re.compile("[^" + re.escape("".join(spelling.values())) + "]")
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        table = [b""] * (max(vocab.values()) + 1)
        for token, i in vocab.items():
            # a token with a character outside the alphabet (an added token's) is its UTF-8, as
            # the ByteLevel decoder takes it
            table[i] = token.encode() if foreign.search(token) else token.translate(to_latin1).encode("latin-1")
        for i, added in tokenizer.get_added_tokens_decoder().items():
            if added.special:
                table[i] = b""
        self.table = table
        self.usable = self._agrees(tokenizer)

    def decode_each(self, sequences: list[list[int]]) -> list[str]:
        """Each sequence's text: tokenizer.decode(ids, skip_special_tokens=True). An id past the
        tokenizer's vocabulary (a model's embedding has spare rows) decodes to nothing, as there."""
        table = self.table
        try:
            return [b"".join([table[i] for i in ids]).decode("utf-8", "replace") for ids in sequences]
        except IndexError:
            top = max(i for ids in sequences for i in ids)
            if top < len(table):  # an id below -len(table): none comes from a graph
                raise ValueError("a negative token id") from None
            table += [b""] * (1 + top - len(table))
            return self.decode_each(sequences)

    def _agrees(self, tokenizer: tokenizers.Tokenizer) -> bool:
        """The table decodes as the tokenizer does: every added token and every 61st id alone, and
        runs of byte tokens that split characters (invalid UTF-8 where they end)."""
        added = list(tokenizer.get_added_tokens_decoder())
        ids = [[i] for i in (*added, *range(0, len(self.table), 61))]
        singles = [i for i, b in enumerate(self.table) if len(b) == 1 and b[0] >= 0x80][:64]  # UTF-8's parts
        ids += [singles[k : k + n] for n in (2, 3, 5) for k in range(0, len(singles) - n, n)]
        return self.decode_each(ids) == [tokenizer.decode(s, skip_special_tokens=True) for s in ids]
