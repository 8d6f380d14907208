"""Long texts cut into pieces that encode apart as the whole text does, so that one text's
tokenizing spreads over the tokenizer's threads (encode_batch_fast runs a batch's strings in
parallel, one string per thread).

A text is cut before a space that follows an ASCII letter or digit and precedes an ASCII letter.
Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2, SmolLM2) split their pre-tokens there (" word"
begins a pre-token in each of their patterns) and merge only inside a pre-token, so the pieces'
ids joined are the whole text's. Whether a tokenizer is such a one is decided at load, from its
configuration and probes (Pieces.usable); one that is not is encoded whole.
"""

import tokenizers

PIECE_CHARS = 256  # about 50 tokens: a thread's share is worth more than handing it over
WORD = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
LETTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
# components that act on characters or split at boundaries, never joining across a cut
NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}
PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits", "Whitespace", "WhitespaceSplit", "Punctuation"}
PROBES = (
    "Cheap flights to Rome in May, don't we'd 12 345 6789 x2 3.5kg (per item) -- tickets & hotels; "
    "  two  spaces,\ttabs\nnew lines\r\n and ünïcödé 日本語 🤖 words: e.g. U.S.A. or a-b c_d it's OK!",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z 0 A 1 B 22 CC 333 DDD",
)


def _components(node: dict | None, key: str) -> list[dict]:
    if node is None:
        return []
    if node["type"] == "Sequence":
        return [c for n in node[key] for c in _components(n, key)]
    return [node]


def cut(text: str, every: int = PIECE_CHARS) -> list[str]:
    """`text` in pieces of about `every` characters, cut before spaces between ASCII words."""
    pieces, at = [], 0
    while len(text) - at > 2 * every:
        i = text.find(" ", at + every)
        while i != -1 and not (text[i - 1] in WORD and text[i + 1 : i + 2] in LETTERS):
            i = text.find(" ", i + 1)
        if i == -1 or len(text) - i < every // 2:
            break
        pieces.append(text[at:i])
        at = i
    pieces.append(text[at:])
    return pieces


class Pieces:
    """Whether a tokenizer's texts may be cut (usable), and their ids encoded in pieces (encode)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, config: dict, every: int = PIECE_CHARS):
        """config: the tokenizer's JSON (tokenizer.to_str()), parsed."""
        self.tokenizer, self.every = tokenizer, every
        # the ids the post-processor puts around a text (a BOS, say), which pieces go without
        probe = PROBES[1]
        plain = tokenizer.encode(probe, add_special_tokens=False).ids
        whole = tokenizer.encode(probe).ids
        at = next((k for k in range(len(whole) - len(plain) + 1) if whole[k : k + len(plain)] == plain), None)
        self.prefix = whole[:at] if at is not None else []
        self.suffix = whole[at + len(plain):] if at is not None else []
        self.usable = at is not None and self._configured(config) and self._probed()

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids, its pieces encoded in one parallel pass."""
        cuts = [cut(t, self.every) for t in texts]
        encoded = iter(self.tokenizer.encode_batch_fast([p for c in cuts for p in c], add_special_tokens=False))
        out = []
        for c in cuts:
            ids = list(self.prefix)
            for _ in c:
                ids += next(encoded).ids
            out.append(ids + self.suffix)
        return out

    def _configured(self, config: dict) -> bool:
        """A BPE tokenizer whose normalizer and pre-tokenizer act per character or split, whose
        added tokens hold no space and take none of their neighbours' (lstrip, rstrip)."""
        model = config.get("model") or {}
        if model.get("type") != "BPE" or model.get("dropout"):
            return False
        normalizers = _components(config.get("normalizer"), "normalizers")
        pre = _components(config.get("pre_tokenizer"), "pretokenizers")
        if not pre or any(c["type"] not in PRE_TOKENIZERS for c in pre) or any(
                c["type"] not in NORMALIZERS for c in normalizers):
            return False
        if any(c["type"] == "ByteLevel" and c.get("add_prefix_space") for c in pre):
            return False  # a space put before every piece
        return not any(" " in t["content"] or t.get("lstrip") or t.get("rstrip") or t.get("single_word")
                       for t in config.get("added_tokens") or [])

    def _probed(self) -> bool:
        """The pre-tokenizer begins a pre-token at every cut of the probes, and their pieces encode
        as the whole does."""
        pre = self.tokenizer.pre_tokenizer
        for probe in PROBES:
            starts = {start for _, (start, _) in pre.pre_tokenize_str(probe)}
            cuts, at = cut(probe, 8), 0
            for piece in cuts[:-1]:
                at += len(piece)
                if at not in starts:
                    return False
            whole = self.tokenizer.encode(probe).ids
            if self.prefix + [i for p in cuts for i in self.tokenizer.encode(p, add_special_tokens=False).ids] \
                    + self.suffix != whole:
                return False
        return True
