"""Packed tokenizer: the GGUF tokenizer equals transformers' GGUF loader; packing and bounds."""

import numpy as np
import pytest

from slm_core import InputError, SpecError, TaskSpec
from slm_core.tokenizer import PackedTokenizer

STRINGS = [
    "hello world", "  two  spaces\n\nnew\tline  ", "<|im_start|>user\nhi<|im_end|>", "ünïcödé 日本語 🤖 ½",
    "123456789 3.14159 -0.5e10", "don't I'll we've", "<repo_name>x</s><|endoftext|>", "a" * 300,
    "\u200b\u00a0\r\n", "Ω≈ç√∫˜µ≤≥÷", "def f(x):\n    return x**2  # comment",
]


def test_gguf_tokenizer_equals_transformers(smollm2):
    _, ckpt, _, hf_tok = smollm2
    for s in STRINGS:
        assert ckpt.tokenizer.encode(s).ids == hf_tok(s).input_ids, s
        ids = hf_tok(s).input_ids
        assert ckpt.tokenizer.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids)


@pytest.fixture()
def packer(smollm2):
    task = TaskSpec(task="score", prompt_template="Q: {text} A:", labels=("Yes", "No"), max_texts=4,
                    max_text_tokens=12, stop=("<|im_end|>",))
    return PackedTokenizer(smollm2[1].tokenizer, task)


def buffers(task: TaskSpec):
    return np.full(task.max_texts * task.max_text_tokens, -1, np.int32), np.full(task.max_texts + 1, -1, np.int32)


def test_pack_texts_writes_contiguous_ids_and_boundaries(packer):
    ids, cu = buffers(packer.task)
    texts = ["cheap flights", "x", "hotel in rome"]
    n, t = packer.pack_texts(texts, ids, cu)
    expected = [packer.tokenizer.encode(f"Q: {s} A:").ids for s in texts]
    assert (n, t) == (3, sum(map(len, expected)))
    assert cu[: n + 1].tolist() == np.cumsum([0] + [len(e) for e in expected]).tolist()
    assert ids[:t].tolist() == [i for e in expected for i in e]
    assert (ids[t:] == -1).all()  # nothing beyond the real tokens is touched


def test_label_and_stop_ids(packer, smollm2):
    hf_tok = smollm2[3]
    assert packer.label_ids() == [hf_tok("Yes").input_ids[0], hf_tok("No").input_ids[0]]
    assert packer.stop_ids() == [2]


@pytest.mark.parametrize(
    "texts, bound, message",
    [
        ([], "max_texts", "empty"),
        (["a"] * 5, "max_texts", "5 texts exceed max_texts=4"),
        (["word " * 20], "max_text_tokens", r"texts\[0\] is \d+ tokens with the template, over max_text_tokens=12"),
        (["ok", "word " * 20], "max_text_tokens", r"texts\[1\] is \d+ tokens"),
        (["ok", ""], None, r"texts\[1\] is empty"),
        (["ok", "  \n"], None, r"texts\[1\] is empty"),
        (["ok", 3], None, r"texts\[1\] must be a string, got a number"),
        ("a string", None, "'texts' must be an array of strings, got a string"),
    ],
)
def test_bad_texts_raise_typed_errors_naming_the_bound(packer, texts, bound, message):
    ids, cu = buffers(packer.task)
    with pytest.raises(InputError, match=message) as err:
        packer.pack_texts(texts, ids, cu)
    assert err.value.bound == bound
    assert (ids == -1).all()  # a refused request writes nothing


def test_prompt_bound(smollm2):
    task = TaskSpec(task="beam", max_prompt_tokens=5)
    packer = PackedTokenizer(smollm2[1].tokenizer, task)
    fits, long, not_text = packer.encode_prompts(["hello world", "one two three four five six", None])
    assert len(fits) == 2
    assert isinstance(long, InputError) and "over max_prompt_tokens=5" in str(long)
    assert long.bound == "max_prompt_tokens" and long.limit == 5
    assert isinstance(not_text, InputError) and "prompt must be a string" in str(not_text)


def test_a_batch_of_prompts_is_encoded_together_each_as_alone(smollm2):
    """encode_prompts (one parallel tokenizer call for a beam batch): each valid prompt's ids as
    encoded alone, template and special tokens included; each bad one its own InputError, in place."""
    tok = smollm2[1].tokenizer
    task = TaskSpec(task="beam", max_prompt_tokens=16, prompt_template="Q: {prompt}\nA:")
    packer = PackedTokenizer(tok, task)
    prompts = ["hello world", 7, " ".join(["word"] * 20), "   ", "naïve café 🙂"]
    got = packer.encode_prompts(prompts)
    for prompt, ids in zip(prompts, got):
        if isinstance(ids, InputError):
            continue
        assert ids == tok.encode(packer.apply_template(prompt)).ids and len(ids) <= 16
    assert [type(x).__name__ for x in got] == ["list", "InputError", "InputError", "InputError", "list"]
    assert "must be a string" in str(got[1]) and "over max_prompt_tokens=16" in str(got[2]) and "empty" in str(got[3])
    assert packer.encode_prompts([]) == []


def test_build_time_errors(smollm2):
    tok = smollm2[1].tokenizer
    with pytest.raises(SpecError, match="must be one token"):
        PackedTokenizer(tok, TaskSpec(task="beam", stop=("hello world",))).stop_ids()
    with pytest.raises(SpecError, match="do not start with distinct tokens"):
        PackedTokenizer(tok, TaskSpec(task="score", labels=("Yes", "Yes please"))).label_ids()


def test_template_placeholder_may_repeat(smollm2):
    task = TaskSpec(task="beam", prompt_template="Complete: {prompt}\n{prompt}")
    assert PackedTokenizer(smollm2[1].tokenizer, task).apply_template("cheap") == "Complete: cheap\ncheap"
