"""The Task interface: a task YAML names its kind; each kind owns its schema, bounds, request
path, verdicts and FLOPs."""

import re

import pytest
from conftest import train_tokenizer
from test_spec import QWEN3
from tokenizers import Tokenizer

from slm_core import InputError, SpecError, TaskSpec
from slm_core.spec import ModelSpec
from slm_core.tasks import BeamTask, ClassifierTask, Difference, EmbeddingTask, LabelsTask, task_class, task_for
from slm_core.tasks.beam import BeamRequest


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(path)
    return Tokenizer.from_file(str(path))


def test_a_task_yaml_names_its_kind():
    assert task_class(TaskSpec(task="score")) is LabelsTask
    assert task_class(TaskSpec(task="score", head="classifier")) is ClassifierTask
    assert task_class(TaskSpec(task="score", head="embedding")) is EmbeddingTask
    assert task_class(TaskSpec(task="beam")) is BeamTask
    with pytest.raises(SpecError, match=r"task must be one of \['beam', 'score'\], got 'rank'"):
        task_class(TaskSpec(task="rank"))
    with pytest.raises(SpecError, match=r"'head' must be one of \['classifier', 'embedding', 'labels', 'mlp'\]"):
        task_class(TaskSpec(task="score", head="pooler"))


@pytest.mark.parametrize(
    "spec, message",
    [
        (TaskSpec(task="score", labels=("a",)), "at least two 'labels'"),
        (TaskSpec(task="score", labels=("a", "b"), output="probability"), "'output' must be 'probs' or 'logits'"),
        (TaskSpec(task="beam", output="logits"), "are for score tasks"),
        (TaskSpec(task="beam", labels=("a", "b")), "are for score tasks"),
        (TaskSpec(task="beam", prompt_template="Q: {text}"), "containing '{prompt}'"),
    ],
)
def test_each_kind_refuses_keys_it_cannot_serve(tok, spec, message):
    with pytest.raises(SpecError, match=message):
        task_for(spec, tok)


def test_max_batch_defaults_to_the_kinds_measured_best_on_cuda_and_1_on_cpu(tok):
    score, beam = TaskSpec(task="score", labels=("yes", "no")), TaskSpec(task="beam")
    assert (task_for(score, tok).max_batch, task_for(beam, tok).max_batch) == (1, 1)
    assert (task_for(score, tok, "cuda").max_batch, task_for(beam, tok, "cuda").max_batch) == (4, 8)
    assert task_for(TaskSpec(task="beam", max_batch=3), tok, "cuda").max_batch == 3


def test_bounds_follow_the_kind(tok):
    score = task_for(TaskSpec(task="score", labels=("yes", "no"), max_texts=16, max_text_tokens=160, max_batch=4), tok)
    assert (score.request_sequences, score.sequence_tokens, score.max_positions) == (16, 160, 160)
    assert (score.call_texts, score.call_tokens) == (64, 64 * 160)
    assert (score.graph_texts, score.graph_tokens) == (64 + 4 + 2, 2 * 64 * 160 + 64)
    beam = task_for(TaskSpec(task="beam", max_prompt_tokens=512, new_tokens=5, max_batch=8), tok)
    assert (beam.request_sequences, beam.sequence_tokens, beam.max_positions) == (1, 512, 517)
    assert score.pad_sequences and not beam.pad_sequences


def test_the_request_schema_is_the_tasks(tok):
    score = task_for(TaskSpec(task="score", labels=("yes", "no")), tok)
    assert score.request({"texts": ["a"]}) == ["a"]
    for payload, message in (
        ({"prompt": "a"}, "missing the field 'texts' (got \"prompt\")"),
        ({"texts": [], "x": 1}, 'unknown fields "x"'),
        ([], "got an array"),
    ):
        with pytest.raises(InputError, match=re.escape(message)):
            score.request(payload)
    beam = task_for(TaskSpec(task="beam"), tok)
    assert beam.request({"prompt": "a"}) == BeamRequest("a")
    assert beam.request({"prompt": "a", "beam_width": 5, "top": 2}) == BeamRequest("a", 5, None, 2)


def test_the_request_path_is_three_nodes_with_their_interfaces(tok):
    beam = task_for(
        TaskSpec(task="beam", beam_width=4, new_tokens=3, max_prompt_tokens=64, stop=("<|im_end|>",), max_batch=2), tok
    )
    encode, graph, decode = beam.pipeline("cuda", "graph.pt2")
    assert (encode["node"], encode["device"], encode["op"]) == ("encode", "cpu", "BeamTask.encode")
    assert encode["bounds"] == {"requests": 2, "sequences_per_request": 1, "tokens_per_sequence": 64}
    assert (graph["device"], graph["file"], graph["constants"]) == ("cuda", "graph.pt2", {"stop_ids": beam.stop_ids})
    assert graph["outputs"] == [
        "tokens int64 [prompts, 4, 3]",
        "lengths int64 [prompts, 4]",
        "scores float32 [prompts, 4]",
    ]
    assert encode["output"] == graph["inputs"] and decode["input"] == graph["outputs"]
    assert (decode["op"], decode["output"]) == ("BeamTask.unpack", "answer ['candidates']")


def test_verdicts_are_the_tasks(tok):
    score = task_for(TaskSpec(task="score", labels=("yes", "no"), precision="bf16"), tok)
    d = score.difference([[0.9, 0.1], [0.5, 0.5]], [[0.88, 0.12], [0.5, 0.5]])
    assert d.values == pytest.approx((0.02, 0.02, 0.0, 0.0)) and d.shared == 1.0
    assert score.check([d], "bf16") == {
        "inputs": 1,
        "max_abs_diff": pytest.approx(0.02),
        "tolerance": 0.05,
        "passes": True,
    }
    assert score.gate([d], 0.01, 0.6)["passes"] is False
    beam = task_for(TaskSpec(task="beam", precision="bf16"), tok)
    want = [{"token_ids": [1, 2], "score": -1.0}, {"token_ids": [3], "score": -2.0}]
    got = [{"token_ids": [1, 2], "score": -1.1}, {"token_ids": [4], "score": -2.0}]
    d = beam.difference(want, got)
    assert d.values == pytest.approx((0.1,)) and d.shared == 0.5
    check = beam.check([d], "bf16")
    assert check["shared_candidates"] == 0.5 and check["passes"] is False  # under 75 % shared
    gate = beam.gate([d, Difference((), 1.0)], 0.05, 0.6)
    assert (gate["shared_candidates"], gate["worst_prompt"], gate["passes"]) == (0.75, 0.5, True)


def test_flops_of_a_request_by_hand(tok):
    """The MFU formula's FLOPs on the W1 architecture: linears, the label rows of the head and
    causal attention pairs; the last layer's o-projection and MLP at the last token only."""
    spec = ModelSpec.from_hf_config(QWEN3)
    score = task_for(TaskSpec(task="score", labels=("yes", "no"), max_text_tokens=512), tok)
    (n,) = score.token_lengths(["search engines rank documents"])
    h, q, kv, i, layers = 1024, 2048, 1024, 3072, 28
    linear = 2 * (h * (q + 2 * kv) + q * h + 3 * h * i)
    rest = 2 * (q * h + 3 * h * i)
    attention = 4 * 16 * 128 * (n * (n + 1) // 2 * (layers - 1) + n)
    total, fp8 = score.flops(spec, ["search engines rank documents"], "bf16")
    assert total == linear * layers * n - rest * (n - 1) + attention + 2 * h * 2 and fp8 == 0
    _, fp8 = score.flops(spec, ["search engines rank documents"], "fp8-static")
    assert fp8 == 2 * (h * (q + 2 * kv) + 3 * h * i) * layers * n - 2 * 3 * h * i * (n - 1)
