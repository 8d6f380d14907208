"""CUDA-graph buckets (slm_core.replay): the padding a call gets to reach its bucket, and that the
padded call answers exactly as the unpadded one. The capture and replay themselves need a GPU
(the archiver's build check on CUDA runs every check input through them, bench/RESULTS.md)."""

import pytest

from slm_core import Engine
from slm_core.checkpoint import load_checkpoint
from slm_core.replay import bucket, bucket_grid, pad_inputs
from slm_core.spec import RuntimeSpec, TaskSpec

SCORE = TaskSpec.from_dict({"task": "score", "labels": ["yes", "no"], "max_texts": 16, "max_text_tokens": 160,
                            "max_batch": 8})
BEAM = TaskSpec.from_dict({"task": "beam", "beam_width": 100, "new_tokens": 5, "max_prompt_tokens": 512,
                           "max_batch": 1})


@pytest.mark.parametrize("task", [SCORE, BEAM], ids=["score", "beam"])
def test_buckets_pad_within_the_graph_bounds(task):
    limit = task.sequence_tokens
    for n in range(1, task.call_texts + 1):
        for t in sorted({n, n * limit // 2, n * limit, *range(n, n * limit + 1, 37)}):
            got = bucket(task, n, t)
            assert got is not None, (n, t)
            padded_n, padded_t, lengths = got
            assert padded_n <= task.graph_texts and padded_t <= task.graph_tokens
            assert len(lengths) == padded_n - n and sum(lengths) <= padded_t - t
            assert all(1 <= x <= limit for x in lengths)  # every padding sequence is a valid sequence
            assert padded_t - t <= max(32, (t + len(lengths)) / 16) + len(lengths)  # little padding
            if task.task == "score":  # padding sequences hold all the padding tokens
                assert padded_n > n and sum(lengths) == padded_t - t
            else:  # no padding prompt (it would cost W beams), only a tail
                assert padded_n == n and not lengths
    # a W1-like stream (15 texts of 64-160 tokens, 1 to 8 requests per call) needs few graphs
    w1 = {bucket(SCORE, 15 * k, t)[:2] for k in range(1, 9) for t in range(15 * 64 * k, 15 * 160 * k + 1, 7)}
    assert len(w1) <= 128


def test_beam_buckets_of_w2_and_w3_streams_fit_the_graph_budget():
    """The bench's shared beam archive (prompts up to 512 tokens, 8 per call) serves W2 (48-128
    tokens per prompt) and W3 (384-512): every call size of both gets a captured graph."""
    from slm_core.replay import CudaGraphs

    beam8 = TaskSpec.from_dict({**BEAM.to_dict(), "max_batch": 8})
    sizes = {bucket(beam8, k, t)[:2] for k in range(1, 9)
             for lo, hi in ((48, 128), (384, 512)) for t in range(lo * k, hi * k + 1)}
    assert len(sizes) <= CudaGraphs.__init__.__defaults__[0], len(sizes)


@pytest.mark.parametrize("task", [
    SCORE, TaskSpec.from_dict({**BEAM.to_dict(), "max_batch": 8}),
    TaskSpec.from_dict({"task": "score", "labels": ["a", "b"], "max_texts": 3, "max_text_tokens": 40, "max_batch": 3}),
    TaskSpec.from_dict({"task": "score", "labels": ["a", "b"], "max_texts": 1, "max_text_tokens": 512, "max_batch": 2}),
], ids=["w1", "beam8", "small", "long"])
def test_the_grid_holds_one_call_per_bucket_of_every_call_size(task):
    """bucket_grid (what capture_at_load captures) against every (sequences, tokens) a call within
    the bounds can have, one by one (bisection is only fast if bucket behaves as it assumes)."""
    every = {}
    step = 1 if task.call_tokens < 3000 else 3  # W1's 2.7M sizes in steps of 3: still each bucket of them
    for n in range(1, task.call_texts + 1):
        for t in range(n, n * task.sequence_tokens + 1, step):
            if (b := bucket(task, n, t)) is not None:
                every.setdefault(b[:2], (n, t))
    grid = bucket_grid(task)
    keys = [bucket(task, n, t)[:2] for n, t in grid]
    assert len(set(keys)) == len(keys) and set(every) <= set(keys)
    assert all(1 <= n <= task.call_texts and n <= t <= n * task.sequence_tokens for n, t in grid)
    if step == 1:
        assert set(keys) == set(every)


class PaddedEager:
    """What CudaGraphs replays, without the capture: the call padded to its bucket."""

    graphs: dict = {}  # it never captures

    def __init__(self, graph, task):
        self.graph, self.task, self.calls = graph, task, []

    def __call__(self, ids, cu, n, t):
        padded_n, padded_t = pad_inputs(ids, cu, n, t, bucket(self.task, n, t))
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
        padded = Engine(plain.graph, plain.tokenizer, plain.task, RuntimeSpec("cpu"), [fake])
        for requests in batches:  # the second is a full call: its padding needs the extra sequence
            run = (lambda e: e.run_score_batch(requests)) if kind == "score" else (lambda e: e.run_beam_batch(requests))
            for (a, _), (b, _) in zip(run(plain), run(padded)):
                if kind == "score":
                    assert sum(a, []) == pytest.approx(sum(b, []), abs=1e-5)
                else:
                    assert [c["token_ids"] for c in a] == [c["token_ids"] for c in b]
                    assert [c["score"] for c in a] == pytest.approx([c["score"] for c in b], abs=1e-4)
        assert len(fake.calls) == len(batches) and all(pt > t for n, t, pn, pt in fake.calls)
        if kind == "score":  # padding sequences, a full call too
            assert all(pn > n for n, t, pn, pt in fake.calls) and fake.calls[-1][0] == plain.task.call_texts
        else:  # the prompts as they are, and an unowned tail
            assert all(pn == n for n, t, pn, pt in fake.calls)


class CapturingEager(PaddedEager):
    """PaddedEager that keeps a "graph" per bucket, as CudaGraphs does."""

    def __init__(self, graph, task):
        super().__init__(graph, task)
        self.graphs, self.enabled, self.max_graphs = {}, True, 256

    def __call__(self, ids, cu, n, t):
        lengths = (cu[1 : n + 1] - cu[:n]).tolist()
        assert cu[0] == 0 and sum(lengths) == t and all(1 <= x <= self.task.sequence_tokens for x in lengths)
        self.graphs[bucket(self.task, n, t)[:2]] = None
        return super().__call__(ids, cu, n, t)


def test_capture_all_captures_each_bucket_once_and_answers_still_match(random_checkpoint):
    """capture_all (the handler's capture_at_load) calls the graph once per bucket of bucket_grid,
    with valid packed calls, raising the graph budget to the grid; the engine answers as before."""
    from test_hf_equality import engine_for

    from slm_core.package import capture_all

    ckpt = load_checkpoint(random_checkpoint("qwen2")[0])
    for task in (dict(task="score", labels=["yes", "no"], max_texts=2, max_text_tokens=24, max_batch=2),
                 dict(task="beam", beam_width=2, new_tokens=2, max_prompt_tokens=40, max_batch=3)):
        plain = engine_for(ckpt, **task)
        fake = CapturingEager(plain.graph, plain.task)
        fake.max_graphs = 3
        warm = Engine(plain.graph, plain.tokenizer, plain.task, RuntimeSpec("cpu"), [fake])
        grid = bucket_grid(plain.task)
        assert capture_all(warm) == len(fake.graphs) == len(fake.calls) == len(grid) > fake.calls[0][0]
        assert fake.max_graphs == len(grid)
        if task["task"] == "score":
            assert warm.score(["a b c"])[0] == pytest.approx(plain.score(["a b c"])[0], abs=1e-5)
        else:
            assert [c["token_ids"] for c in warm.beam("a b c")] == [c["token_ids"] for c in plain.beam("a b c")]
