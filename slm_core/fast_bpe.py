"""User text through tiktoken's BPE where it gives the tokenizer's own ids: 4.5-6.6x faster per
thread than `tokenizers` on W1's texts (bench/RESULTS.md, bench/bpe_compare.py).

tiktoken merges whichever adjacent pair's concatenation has the lowest id; `tokenizers` merges by
its merge list. The two agree for a byte-level BPE whose merges' ids grow with their place in the
list, read by the same split pattern, with no normalizer. Whether a tokenizer is such a one is
decided at load, from its configuration and by encoding every vocabulary string (but those that
spell an added token) and probes both ways. tiktoken matches no added tokens: it is for the
pieces of a template where user text goes, whose special tokens the tokenizer does not match
(slm_core.tokenizer).
"""

import tiktoken
import tokenizers

from slm_core.byte_table import byte_alphabet
from slm_core.pieces import SPLITS, _components

GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
PROBES = (
    "Cheap flights to Rome in May, don't we'd 12 345 6789 x2 3.5kg (per item) -- tickets & hotels; "
    "  two  spaces,\ttabs\nnew lines\r\n and ünïcödé 日本語 🤖 words: e.g. U.S.A. or a-b c_d it's OK!",
    "  leading\n\n\ttrailing   ",
    "x",
    "1234567890",
    "\u00a0\u3000\u2028 mixed\u200bspaces",
)


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet read backwards: each vocabulary character -> the byte it stands for."""
    return {c: b for b, c in byte_alphabet().items()}


def split_pattern(config: dict) -> str | None:
    """The pattern the tokenizer splits pre-tokens by, where tiktoken can take it: ByteLevel with
    its regex (GPT-2's), or a known Split pattern then ByteLevel without one; else None."""
    if config.get("normalizer") is not None:
        return None
    pre = _components(config.get("pre_tokenizer"), "pretokenizers")
    if any(p["type"] == "ByteLevel" and p.get("add_prefix_space") for p in pre):
        return None
    if len(pre) == 1 and pre[0]["type"] == "ByteLevel" and pre[0].get("use_regex", True):
        return GPT2_SPLIT
    if (
        len(pre) == 2
        and pre[0]["type"] == "Split"
        and pre[1]["type"] == "ByteLevel"
        and not pre[1].get("use_regex", True)
        and pre[0].get("behavior") == "Isolated"
        and not pre[0].get("invert")
        and (pre[0].get("pattern") or {}).get("Regex") in SPLITS
    ):
        return pre[0]["pattern"]["Regex"]
    return None


class FastBpe:
    """tiktoken's encoder of a tokenizer's vocabulary (usable: it gives the tokenizer's ids)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, config: dict):
        """config: the tokenizer's JSON (tokenizer.to_str()), parsed."""
        self.encoding = None
        model, pattern = config.get("model") or {}, split_pattern(config)
        if (
            pattern is None
            or model.get("type") != "BPE"
            or model.get("dropout")
            or model.get("byte_fallback")
            or model.get("continuing_subword_prefix")
            or model.get("end_of_word_suffix")
        ):
            self.usable = False
            return
        decode, vocab = byte_decoder(), model["vocab"]
        try:
            ranks = {bytes(decode[c] for c in token): i for token, i in vocab.items()}
            merged = [vocab["".join(m) if isinstance(m, list) else m.replace(" ", "", 1)] for m in model["merges"]]
        except KeyError:  # a character outside the byte-level alphabet, or a merge without its token
            self.usable = False
            return
        if len(ranks) != len(vocab) or any(a >= b for a, b in zip(merged, merged[1:])):
            self.usable = False
            return
        self.encoding = tiktoken.Encoding("slm", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
        added = [t.content for t in tokenizer.get_added_tokens_decoder().values()]
        spelled = [bytes(decode[c] for c in token).decode("utf-8", "replace") for token in vocab]
        samples = [s for s in (*spelled, *PROBES) if s and not any(a in s for a in added)]
        theirs = tokenizer.encode_batch_fast(samples, add_special_tokens=False)
        self.usable = all(e.ids == self.encoding.encode_ordinary(s) for s, e in zip(samples, theirs))

    def encode(self, text: str) -> list[int]:
        """text's ids, no added token matched (`tokenizer.encode(text, add_special_tokens=False)`
        where the text spells none)."""
        return self.encoding.encode_ordinary(text)
