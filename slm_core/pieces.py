"""Long texts cut into pieces that encode apart as the whole text does, so that one text's
tokenizing spreads over the tokenizer's threads (encode_batch_fast runs a batch's strings in
parallel, one string per thread). A batch is cut only as far as its threads need: into pieces of
about half a thread's share of its characters, none under PIECE_CHARS; many texts are not cut at
all, since each cut costs a string and a task of its own.

A text is cut before a space that follows an ASCII letter or digit and precedes an ASCII letter.
Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2, SmolLM2) split their pre-tokens there (" word"
begins a pre-token in each of their patterns) and merge only inside a pre-token, so the pieces'
ids joined are the whole text's. Whether a tokenizer is such a one is decided at load, from its
configuration and probes (Pieces.usable); one that is not is encoded whole. The tokenizer must
neither truncate nor pad (PackedTokenizer turns both off): each piece would be cut or padded.
"""

import os
import re

import tokenizers

PIECE_CHARS = 256  # about 50 tokens: a thread's share is worth more than handing it over
CUT = re.compile(r"(?<=[A-Za-z0-9]) (?=[A-Za-z])")  # where a cut may fall: before the space
# the split patterns of the byte-level vocabularies whose " word" pre-tokens are known (Qwen2's
# and Qwen3's, Llama 3's); another Split pattern could match across a space, so it is encoded whole
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLITS = {QWEN2_SPLIT, LLAMA3_SPLIT}
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


def tokenizer_threads() -> int:
    """The threads encode_batch_fast spreads a batch over: its pool's (RAYON_NUM_THREADS, else the
    CPUs this process may run on), or 1 with TOKENIZERS_PARALLELISM off."""
    if os.environ.get("TOKENIZERS_PARALLELISM", "").lower() in ("0", "false", "off", "no"):
        return 1
    configured = os.environ.get("RAYON_NUM_THREADS", "")
    if configured.isascii() and configured.isdigit() and int(configured) > 0:
        return int(configured)
    return len(os.sched_getaffinity(0))


def cut(text: str, every: int = PIECE_CHARS) -> list[str]:
    """`text` in pieces of about `every` characters, cut before spaces between ASCII words."""
    pieces, at = [], 0
    while len(text) - at > 2 * every:
        found = CUT.search(text, at + every)
        if found is None or len(text) - found.start() < every // 2:
            break
        pieces.append(text[at : found.start()])
        at = found.start()
    pieces.append(text[at:])
    return pieces


class Pieces:
    """Whether a tokenizer's texts may be cut (usable), and their ids encoded in pieces (encode)."""

    def __init__(
        self, tokenizer: tokenizers.Tokenizer, config: dict, every: int = PIECE_CHARS, threads: int | None = None
    ):
        """config: the tokenizer's JSON (tokenizer.to_str()), parsed; every: the shortest piece;
        threads: the tokenizer's (tokenizer_threads())."""
        self.tokenizer, self.every = tokenizer, every
        self.threads = threads or tokenizer_threads()
        # the ids the post-processor puts around a text (a BOS, say), which pieces go without
        probe = PROBES[1]
        plain = tokenizer.encode(probe, add_special_tokens=False).ids
        whole = tokenizer.encode(probe).ids
        at = next((k for k in range(len(whole) - len(plain) + 1) if whole[k : k + len(plain)] == plain), None)
        self.prefix = whole[:at] if at is not None else []
        self.suffix = whole[at + len(plain) :] if at is not None else []
        self.usable = at is not None and self._configured(config) and self._probed()

    def _spaced(self, token: dict) -> bool:
        """Whether an added token could match a space: its text holds whitespace, or its text as the
        normalizer makes it (NFKC turns U+00A0 into a space, and U+00A8 into a space and a mark)."""
        content = token["content"]
        if token.get("normalized") and self.tokenizer.normalizer is not None:
            content += self.tokenizer.normalizer.normalize_str(content)
        return any(c.isspace() for c in content)

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids, its pieces encoded in one parallel pass."""
        # pieces of half a thread's share: cut() leaves a text of up to two pieces whole
        every = max(self.every, sum(map(len, texts)) // (2 * self.threads))
        cuts = [cut(t, every) for t in texts]
        encoded = iter(self.tokenizer.encode_batch_fast([p for c in cuts for p in c], add_special_tokens=False))
        out = []
        for c in cuts:
            ids = list(self.prefix)
            for _ in c:
                ids += next(encoded).ids
            out.append(ids + self.suffix)
        return out

    def _configured(self, config: dict) -> bool:
        """A BPE tokenizer whose normalizer and pre-tokenizer act per character or split (a Split
        only by a known pattern), whose added tokens hold no space and take none of their
        neighbours' (lstrip, rstrip)."""
        model = config.get("model") or {}
        if model.get("type") != "BPE" or model.get("dropout"):
            return False
        normalizers = _components(config.get("normalizer"), "normalizers")
        pre = _components(config.get("pre_tokenizer"), "pretokenizers")
        if (
            not pre
            or any(c["type"] not in PRE_TOKENIZERS for c in pre)
            or any(c["type"] not in NORMALIZERS for c in normalizers)
        ):
            return False
        if any(c["type"] == "ByteLevel" and c.get("add_prefix_space") for c in pre):
            return False  # a space put before every piece
        if any(
            c["type"] == "Split"
            and (
                (c.get("pattern") or {}).get("Regex") not in SPLITS
                or c.get("invert")
                or c.get("behavior") != "Isolated"
            )
            for c in pre
        ):
            return False
        return not any(
            self._spaced(t) or t.get("lstrip") or t.get("rstrip") or t.get("single_word")
            for t in config.get("added_tokens") or []
        )

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
            if (
                self.prefix
                + [i for p in cuts for i in self.tokenizer.encode(p, add_special_tokens=False).ids]
                + self.suffix
                != whole
            ):
                return False
        return True
