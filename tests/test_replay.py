"""CUDA-graph buckets (slm_core.replay): the padding a call gets to reach its bucket, and that the
padded call answers exactly as the unpadded one. The capture and replay themselves need a GPU
(the archiver's build check on CUDA runs every check input through them, bench/RESULTS.md)."""

import pytest

from slm_core import Engine
from slm_core.checkpoint import load_checkpoint
from slm_core.replay import bucket, pad_inputs
from slm_core.spec import RuntimeSpec, TaskSpec

SCORE = TaskSpec.from_dict({"task": "score", "labels": ["yes", "no"], "max_texts": 16, "max_text_tokens": 160,
                            "max_batch": 8})
BEAM = TaskSpec.from_dict({"task": "beam", "beam_width": 100, "new_tokens": 5, "max_prompt_tokens": 512,
                           "max_batch": 1})


@pytest.mark.parametrize("task", [SCORE, BEAM], ids=["score", "beam"])
def test_buckets_pad_within_the_graph_bounds(task):
    limit = task.sequence_tokens
    buckets = set()
    for n in range(1, task.call_texts + 1):
        for t in sorted({n, n * limit // 2, n * limit, *range(n, n * limit + 1, 37)}):
            got = bucket(task, n, t)
            assert got is not None, (n, t)
            padded_n, padded_t, lengths = got
            assert padded_n > n and padded_n <= task.graph_texts and padded_t <= task.graph_tokens
            assert len(lengths) == padded_n - n and sum(lengths) == padded_t - t
            assert all(1 <= x <= limit for x in lengths)  # every padding sequence is a valid sequence
            assert padded_t - t <= max(32, (t + len(lengths)) / 16) + len(lengths)  # little padding
            buckets.add((padded_n, padded_t))
    # a W1-like stream (15 texts of 64-160 tokens, 1 to 8 requests per call) needs few graphs
    w1 = {bucket(SCORE, 15 * k, t)[:2] for k in range(1, 9) for t in range(15 * 64 * k, 15 * 160 * k + 1, 7)}
    assert len(w1) <= 128


class PaddedEager:
    """What CudaGraphs replays, without the capture: the call padded to its bucket."""

    def __init__(self, graph, task):
        self.graph, self.task, self.calls = graph, task, []

    def __call__(self, ids, cu, n, t):
        padded_n, padded_t = pad_inputs(ids, cu, n, t, bucket(self.task, n, t)[2])
        self.calls.append((n, t, padded_n, padded_t))
        return self.graph(ids[:padded_t].clone(), cu[: padded_n + 1].clone())


def test_padded_calls_answer_as_unpadded(random_checkpoint):
    from test_hf_equality import engine_for

    ckpt = load_checkpoint(random_checkpoint("qwen3")[0])
    for kind, task, batches in (
        ("score", dict(task="score", labels=["yes", "no"], max_texts=4, max_text_tokens=32, max_batch=2),
         [[["search engines rank documents", "a"]], [["one", "two", "three", "four"], ["the lazy dog " * 5] * 4]]),
        ("beam", dict(task="beam", beam_width=4, new_tokens=3, max_prompt_tokens=24, max_batch=2),
         [["a small language model"], ["search", "the lazy dog jumps over the quick brown fox"]]),
    ):
        plain = engine_for(ckpt, **task)
        fake = PaddedEager(plain.graph, plain.task)
        padded = Engine(plain.graph, plain.tokenizer, plain.task, RuntimeSpec("cpu"), replay=fake)
        for requests in batches:  # the second is a full call: its padding needs the extra sequence
            run = (lambda e: e.run_score_batch(requests)) if kind == "score" else (lambda e: e.run_beam_batch(requests))
            for (a, _), (b, _) in zip(run(plain), run(padded)):
                if kind == "score":
                    assert sum(a, []) == pytest.approx(sum(b, []), abs=1e-5)
                else:
                    assert [c["token_ids"] for c in a] == [c["token_ids"] for c in b]
                    assert [c["score"] for c in a] == pytest.approx([c["score"] for c in b], abs=1e-4)
        assert len(fake.calls) == len(batches) and all(pn > n and pt > t for n, t, pn, pt in fake.calls)
        assert fake.calls[-1][0] == plain.task.call_texts  # a full call was padded too
