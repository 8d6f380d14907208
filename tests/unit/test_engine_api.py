"""The Python API end to end: checkpoint path + task YAML -> answers; clear errors."""

import json

import pytest
from conftest import CHAT, smollm2_path
from helpers import engine_for

from slm_core import Engine, InputError, SpecError
from slm_core.compile.checkpoint import load_checkpoint


def write_yaml(path, text):
    path.write_text(text)
    return path


def test_from_checkpoint_with_yaml_tasks(tmp_path):
    score_yaml = write_yaml(
        tmp_path / "score.yaml",
        f"task: score\nprompt_template: {json.dumps(CHAT)}\n"
        'labels: ["Yes", "No"]\nmax_texts: 4\nmax_text_tokens: 128\nprecision: fp32\n',
    )
    eng = Engine.from_checkpoint(smollm2_path(), task=score_yaml, device="cpu")
    rows = eng.score(["Is Paris in France? Answer Yes or No.", "Is the sun cold? Answer Yes or No."])
    assert len(rows) == 2 and all(len(r) == 2 and abs(sum(r) - 1) < 1e-5 for r in rows)
    assert rows[0][0] > rows[1][0]  # the real model's answers: more "Yes" for the true statement
    with pytest.raises(InputError, match="max_texts=4"):
        eng.score(["a"] * 5)
    with pytest.raises(TypeError, match=r"runs a 'score' task: call engine.score\(...\)"):
        eng.beam("hello")

    beam_yaml = write_yaml(
        tmp_path / "beam.yaml",
        f"task: beam\nprompt_template: {json.dumps(CHAT.replace('{text}', '{prompt}'))}\n"
        'beam_width: 3\nnew_tokens: 4\nstop: ["<|im_end|>"]\nprecision: fp32\n',
    )
    eng = Engine.from_checkpoint(smollm2_path(), task=beam_yaml)
    out = eng.beam("What is the capital of France?")
    assert len(out) == 3 and [c["score"] for c in out] == sorted((c["score"] for c in out), reverse=True)
    assert out[0]["text"] == "The capital of France"  # the real model's best 4-token answer
    assert all(c["text"] == eng.tokenizer.decode(c["token_ids"]) for c in out)


def test_checkpoint_errors(tmp_path, random_checkpoint):
    with pytest.raises(SpecError, match="neither an HF-style directory nor a .gguf"):
        load_checkpoint(tmp_path / "nothing.bin")
    with pytest.raises(SpecError, match="has no config.json"):
        load_checkpoint(tmp_path)
    folder, _ = random_checkpoint("qwen2")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in folder.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    from safetensors.torch import load_file, save_file

    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(SpecError, match="lacks 1 weights.*up_proj"):
        Engine.from_checkpoint(broken, task={"task": "score", "labels": ["yes", "no"]})


def test_beam_width_must_fit_the_vocabulary(random_checkpoint):
    folder, _ = random_checkpoint("qwen3")
    vocab = load_checkpoint(folder).spec.vocab_size
    with pytest.raises(SpecError, match="needs 2 \\* beam_width <= vocab size"):
        Engine.from_checkpoint(folder, task={"task": "beam", "beam_width": vocab // 2 + 1})


def test_score_batch_packs_requests_into_one_call(random_checkpoint):
    """max_batch requests share one graph call: each answer equals the request run alone; a bad
    request gets its own InputError and the rest still run; more than max_batch is refused."""
    ckpt = load_checkpoint(random_checkpoint("qwen2")[0])
    engine = engine_for(ckpt, task="score", labels=["yes", "no"], max_texts=4, max_text_tokens=32, max_batch=3)
    requests = [["search engines rank documents", "a"], ["the lazy dog " * 5], ["one", "two", "three", "four"]]
    results = engine.run(requests)
    assert [r.stats.batch for r in results] == [3, 3, 3]
    assert len({r.stats.graph_ms for r in results}) == 1  # one call served all three
    for texts, result in zip(requests, results):
        assert result.stats.texts == len(texts) and len(result.answer) == len(texts) and result.error is None
        for row, ref in zip(result.answer, engine.score(texts)):
            assert row == pytest.approx(ref, abs=1e-6)

    mixed = engine.run([["fine"], ["a"] * 5, "not a list"])
    assert isinstance(mixed[1].error, InputError) and "max_texts=4" in str(mixed[1].error)
    assert isinstance(mixed[2].error, InputError) and mixed[0].stats.batch == 1
    assert mixed[0].answer[0] == pytest.approx(engine.score(["fine"])[0], abs=1e-6)
    with pytest.raises(ValueError, match="max_batch=3"):
        engine.run([["a"]] * 4)


def test_beam_batch_packs_prompts_into_one_call(random_checkpoint):
    """Several beam prompts in one graph call: each prompt's candidates equal its own call (same
    tokens in the same order, scores within fp32 noise); a bad prompt is refused alone."""
    ckpt = load_checkpoint(random_checkpoint("qwen3")[0])
    engine = engine_for(ckpt, task="beam", beam_width=4, new_tokens=3, max_prompt_tokens=24, max_batch=3)
    prompts = ["a small language model", "search", "the lazy dog jumps over the quick brown fox"]
    results = engine.run(prompts)
    assert [r.stats.batch for r in results] == [3, 3, 3]
    for prompt, result in zip(prompts, results):
        alone = engine.beam(prompt)
        assert [c["token_ids"] for c in result.answer] == [c["token_ids"] for c in alone]
        assert [c["score"] for c in result.answer] == pytest.approx([c["score"] for c in alone], abs=1e-5)
        assert result.stats.tokens == len(engine.tokenizer.tokenizer.encode(prompt).ids)
    mixed = engine.run(["word " * 40, "search"])
    assert isinstance(mixed[0].error, InputError) and "max_prompt_tokens=24" in str(mixed[0].error)
    assert [c["token_ids"] for c in mixed[1].answer] == [c["token_ids"] for c in engine.beam("search")]


def test_a_non_finite_output_is_a_500_for_its_request_only():
    """JSON has no NaN: a graph answering one is a 500 for the request it belongs to, the batch's
    bad request still gets its 400, and respond_batch does not raise."""
    import torch

    from slm_core.serve.protocol import Request, respond_batch
    from slm_core.spec import TaskSpec
    from slm_core.tasks import task_for

    class NanGraph(torch.nn.Module):
        def forward(self, ids, cu):
            return torch.full((cu.shape[0] - 1, 2), float("nan"))

    task = task_for(
        TaskSpec.from_dict(dict(task="score", labels=["Yes", "No"], max_texts=4, max_text_tokens=32, max_batch=2)),
        load_checkpoint(smollm2_path()).tokenizer,
    )
    engine = Engine(NanGraph(), task, "cpu")
    replies = respond_batch(engine, [Request({"body": b'{"texts": ["a"]}'}), Request({"body": b'{"texts": 3}'})])
    assert [r.status for r in replies] == [500, 400] and b"non-finite" in replies[0].body


@pytest.mark.parametrize("device_usable", [True, False])
def test_a_failed_call_is_a_500_unless_the_device_is_lost(device_usable):
    """A graph call that raises fails the requests in it with a 500 and the engine serves on; when
    the device no longer runs work after it (a sticky CUDA error), respond_batch raises DeviceLost
    instead, for the host to replace the process."""
    import torch

    from slm_core.errors import DeviceLost
    from slm_core.serve.protocol import Request, respond_batch
    from slm_core.spec import TaskSpec
    from slm_core.tasks import task_for

    class FaultyGraph(torch.nn.Module):
        def forward(self, ids, cu):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    task = task_for(
        TaskSpec.from_dict(dict(task="score", labels=["Yes", "No"], max_texts=4, max_text_tokens=32, max_batch=2)),
        load_checkpoint(smollm2_path()).tokenizer,
    )
    engine = Engine(FaultyGraph(), task, "cpu")
    assert engine.usable()  # a CPU engine always is
    engine.usable = lambda: device_usable
    batch = [Request({"body": b'{"texts": ["a"]}'}), Request({"body": b'{"texts": ["b", "c"]}'})]
    if device_usable:
        replies = respond_batch(engine, batch)
        assert [r.status for r in replies] == [500, 500] and b"internal error" in replies[0].body
    else:
        with pytest.raises(DeviceLost, match="fails every call after: CUDA error: an illegal memory access"):
            respond_batch(engine, batch)


def test_reply_encoding_is_compact_json_and_refuses_what_json_cannot_carry():
    """The replies' encoder: compact UTF-8 JSON that the standard library reads back as the same
    value, the same bytes every time; null where the answer holds None, but a ValueError for a
    NaN or infinity anywhere (JSON has none) and for a str UTF-8 cannot carry."""
    from slm_core.serve.protocol import encode

    answer = {
        "candidates": [{"text": 'é \u2028 "q"', "token_ids": [1, 2], "score": -0.1 * i} for i in range(3)],
        "id": None,
        "probs": [[1e-05, 0.99999]],
    }
    out = encode(answer)
    assert json.loads(out) == answer and out == encode(answer)
    del answer["probs"]  # the standard library writes 1e-05 where orjson writes 0.00001; all else alike
    assert encode(answer) == json.dumps(answer, separators=(",", ":"), ensure_ascii=False).encode()
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="non-finite"):
            encode({"candidates": [{"score": -1.0}, {"score": bad, "id": None}]})
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        encode({"text": "\ud800"})


def test_float32_rows_are_written_as_the_shortest_decimal_of_each_float32():
    """An embedding answer (a float32 array) is written value by value as the shortest decimal
    that reads back as the same float32, far shorter than the float64 of the same value; a NaN or
    infinity in it is refused as in lists."""
    import numpy as np

    from slm_core.serve.protocol import encode

    rows = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    out = encode({"embeddings": rows})
    assert np.array(json.loads(out)["embeddings"], dtype=np.float32).tobytes() == rows.tobytes()
    assert len(out) < 0.7 * len(encode({"embeddings": rows.tolist()}))
    rows[1, 5] = np.inf
    with pytest.raises(ValueError, match="non-finite"):
        encode({"embeddings": rows})
