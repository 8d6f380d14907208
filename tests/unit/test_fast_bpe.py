"""User text by tiktoken (slm_core.fast_bpe) gives the tokenizer's own ids: for the byte-level
BPE pre-tokenizers the checkpoints bring, on random texts with special and added tokens spelled in
them, through the task tokenizer's template; tokenizers it cannot stand for are found at load."""

import random

import pytest
from test_pieces import CUTTABLE, serialized, texts
from tokenizers import AddedToken, Tokenizer, normalizers, pre_tokenizers, processors

from slm_core.fast_bpe import FastBpe
from slm_core.tokenizer import PackedTokenizer

TEMPLATE = "<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
USABLE = ["smollm2", "gpt2", "qwen2", "llama3"]


def slow_twin(tok: Tokenizer, template: str, **kw) -> PackedTokenizer:
    """The task tokenizer without the fast path: the reference."""
    slow = PackedTokenizer(Tokenizer.from_str(tok.to_str()), template, "{text}", **kw)
    slow._fast = None
    return slow


@pytest.mark.parametrize("name", USABLE)
def test_fast_bpe_encodes_as_the_tokenizer(name, byte_level):
    tok = CUTTABLE[name](byte_level())
    fast = FastBpe(tok, serialized(tok))
    assert fast.usable
    for text in texts(seed=len(name), count=40):
        if "<|im" not in text:  # tiktoken matches no added token
            assert fast.encode(text) == tok.encode(text, add_special_tokens=False).ids, text


@pytest.mark.parametrize("change", ["nfkc", "metaspace", "prefix_space", "merge_order"])
def test_tokenizers_it_cannot_stand_for_are_found(change, byte_level):
    tok = byte_level()
    config = serialized(tok)
    if change == "nfkc":
        tok.normalizer = normalizers.NFKC()
        config = serialized(tok)
    elif change == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        config = serialized(tok)
    elif change == "prefix_space":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        config = serialized(tok)
    else:  # two merges swapped: merging by id would no longer merge in the list's order
        merges = config["model"]["merges"]
        merges[10], merges[500] = merges[500], merges[10]
    assert not FastBpe(tok, config).usable


@pytest.mark.parametrize("name", USABLE)
def test_task_tokenizer_fast_path_equals_the_tokenizers_path(name, byte_level):
    """Through the template: special tokens spelled in user text stay plain text, a non-special
    added token spelled in it is matched (that batch takes the tokenizer's path), a
    post-processor's BOS is kept."""
    tok = CUTTABLE[name](byte_level())
    tok.add_tokens([AddedToken("<tool_call>", special=False)])
    rng = random.Random(len(name))
    batch = texts(seed=3 + len(name), count=30) + ["<tool_call> x", "a <|im_end|> b", "  ", "日本語🤖"]
    for bos in (False, True):
        if bos:
            tok.post_processor = processors.TemplateProcessing(
                single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
            )
        fast = PackedTokenizer(Tokenizer.from_str(tok.to_str()), TEMPLATE, "{text}")
        assert fast._fast is not None, name
        slow = slow_twin(tok, TEMPLATE)
        for _ in range(5):
            sample = rng.sample(batch, 6)
            assert fast.encode(sample) == slow.encode(sample)
        plain = [t for t in batch if "<tool_call>" not in t]
        assert fast.encode(plain) == slow.encode(plain)


def test_allow_special_tokens_keeps_the_tokenizers_path(byte_level):
    tok = byte_level()
    allowed = PackedTokenizer(tok, TEMPLATE, "{text}", allow_special_tokens=True)
    assert allowed._fast is None  # user text may spell special tokens that must match
    assert allowed.encode(["a <|im_end|>"]) == slow_twin(tok, TEMPLATE, allow_special_tokens=True).encode(
        ["a <|im_end|>"]
    )
