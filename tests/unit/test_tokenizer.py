"""The tokenizer and the tasks' encode node: the GGUF tokenizer equals transformers' GGUF loader;
templates, bounds and their errors; packing into a call's buffers."""

import pytest
import torch

from slm_core import InputError, SpecError, TaskSpec
from slm_core.serve.runtime import Runtime
from slm_core.tasks import task_for

STRINGS = [
    "hello world",
    "  two  spaces\n\nnew\tline  ",
    "<|im_start|>user\nhi<|im_end|>",
    "ünïcödé 日本語 🤖 ½",
    "123456789 3.14159 -0.5e10",
    "don't I'll we've",
    "<repo_name>x</s><|endoftext|>",
    "a" * 300,
    "\u200b\u00a0\r\n",
    "Ω≈ç√∫˜µ≤≥÷",
    "def f(x):\n    return x**2  # comment",
]


def test_gguf_tokenizer_equals_transformers(smollm2):
    _, ckpt, _, hf_tok = smollm2
    for s in STRINGS:
        assert ckpt.tokenizer.encode(s).ids == hf_tok(s).input_ids, s
        ids = hf_tok(s).input_ids
        assert ckpt.tokenizer.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids)


@pytest.fixture()
def score(smollm2):
    return task_for(
        TaskSpec(
            task="score",
            prompt_template="Q: {text} A:",
            labels=("Yes", "No"),
            max_texts=4,
            max_text_tokens=12,
            max_batch=2,
        ),
        smollm2[1].tokenizer,
    )


def test_texts_encode_each_with_the_template(score):
    texts = ["cheap flights", "x", "hotel in rome"]
    (ids,) = score.encode([texts])
    assert ids == [score.tokenizer.tokenizer.encode(f"Q: {s} A:").ids for s in texts]


def test_packing_writes_contiguous_ids_and_boundaries_and_nothing_for_a_refused_request(score):
    engine = Runtime(lambda ids, cu: None, score, "cpu")
    engine.context.ids.fill_(-1)
    engine.context.cu.fill_(-1)
    values = [["cheap flights", "x"], [], ["hotel in rome"]]
    encoded = score.encode(values)
    spans = engine._pack(encoded, [score.options(v) for v in values])
    assert isinstance(spans[1], InputError)
    a, c = spans[0], spans[2]
    expected = encoded[0] + encoded[2]
    t = sum(map(len, expected))
    assert (a.first, a.count, c.first, c.count, a.tokens + c.tokens) == (0, 2, 2, 1, t)
    assert engine.context.cu[:4].tolist() == torch.tensor([0] + [len(e) for e in expected]).cumsum(0).tolist()
    assert engine.context.ids[:t].tolist() == [i for e in expected for i in e]
    assert (engine.context.ids[t:] == -1).all()  # nothing beyond the real tokens is touched


def test_label_and_stop_ids(score, smollm2):
    hf_tok = smollm2[3]
    assert score.label_ids == [hf_tok("Yes").input_ids[0], hf_tok("No").input_ids[0]]
    beam = task_for(TaskSpec(task="beam", stop=("<|im_end|>",)), smollm2[1].tokenizer)
    assert beam.stop_ids == [2]


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
def test_bad_texts_are_typed_errors_naming_the_bound(score, texts, bound, message):
    good, bad = score.encode([["fine"], texts])
    assert isinstance(good, list)  # the other request of the batch is unaffected
    assert isinstance(bad, InputError) and bad.bound == bound and bad.status == 400
    with pytest.raises(InputError, match=message):
        raise bad


def test_prompt_bound(smollm2):
    task = task_for(TaskSpec(task="beam", max_prompt_tokens=5), smollm2[1].tokenizer)
    fits, long, not_text = task.encode(["hello world", "one two three four five six", None])
    assert len(fits) == 1 and len(fits[0]) == 2
    assert isinstance(long, InputError) and "over max_prompt_tokens=5" in str(long)
    assert long.bound == "max_prompt_tokens" and long.limit == 5
    assert isinstance(not_text, InputError) and "prompt must be a string" in str(not_text)


def test_a_batch_of_prompts_is_encoded_together_each_as_alone(smollm2):
    """One parallel tokenizer call for a beam batch: each valid prompt's ids as encoded alone,
    template and special tokens included; each bad one its own InputError, in place."""
    tok = smollm2[1].tokenizer
    task = task_for(TaskSpec(task="beam", max_prompt_tokens=16, prompt_template="Q: {prompt}\nA:"), tok)
    prompts = ["hello world", 7, " ".join(["word"] * 20), "   ", "naïve café 🙂"]
    got = task.encode(prompts)
    for prompt, ids in zip(prompts, got):
        if not isinstance(ids, InputError):
            assert ids == [tok.encode(task.tokenizer.apply_template(prompt)).ids] and len(ids[0]) <= 16
    assert [type(x).__name__ for x in got] == ["list", "InputError", "InputError", "InputError", "list"]
    assert "must be a string" in str(got[1]) and "over max_prompt_tokens=16" in str(got[2]) and "empty" in str(got[3])
    assert task.encode([]) == []


def test_build_time_errors(smollm2):
    tok = smollm2[1].tokenizer
    with pytest.raises(SpecError, match="must be one token"):
        task_for(TaskSpec(task="beam", stop=("hello world",)), tok)
    with pytest.raises(SpecError, match="do not start with distinct tokens"):
        task_for(TaskSpec(task="score", labels=("Yes", "Yes please")), tok)
    with pytest.raises(SpecError, match="containing '{prompt}'"):
        task_for(TaskSpec(task="beam", prompt_template="{text}"), tok)


def test_template_placeholder_may_repeat(smollm2):
    task = task_for(TaskSpec(task="beam", prompt_template="Complete: {prompt}\n{prompt}"), smollm2[1].tokenizer)
    assert task.tokenizer.apply_template("cheap") == "Complete: cheap\ncheap"
