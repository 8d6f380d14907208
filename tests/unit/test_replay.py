"""CUDA-graph buckets (slm_core.serve.replay): the padding a call gets to reach its bucket, and
that the padded call answers exactly as the unpadded one. The capture and replay themselves need
a GPU (the archiver's build check on CUDA runs every check input through them)."""

import itertools

import pytest
from conftest import train_tokenizer
from helpers import engine_for
from tokenizers import Tokenizer

from slm_core.compile.checkpoint import load_checkpoint
from slm_core.serve.replay import bucket, bucket_grid, even_split, pad_inputs
from slm_core.serve.runtime import Runtime
from slm_core.spec import TaskSpec
from slm_core.tasks import task_for


def _tokenizer():
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        train_tokenizer(Path(d) / "tokenizer.json")
        return Tokenizer.from_file(str(Path(d) / "tokenizer.json"))


TOK = _tokenizer()


def task(**spec):
    return task_for(TaskSpec.from_dict(spec), TOK)


SCORE = task(task="score", labels=["yes", "no"], max_texts=16, max_text_tokens=160, max_batch=8)
BEAM = task(task="beam", beam_width=100, new_tokens=5, max_prompt_tokens=512, max_batch=1)


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
            if task.pad_sequences:  # padding sequences hold all the padding tokens
                assert padded_n > n and sum(lengths) == padded_t - t
            else:  # no padding prompt (it would cost W beams), only a tail
                assert padded_n == n and not lengths
    # a W1-like stream (15 texts of 64-160 tokens, 1 to 8 requests per call) needs few graphs
    w1 = {bucket(SCORE, 15 * k, t)[:2] for k in range(1, 9) for t in range(15 * 64 * k, 15 * 160 * k + 1, 7)}
    assert len(w1) <= 128


def test_beam_buckets_of_w2_and_w3_streams_are_few():
    """The bench's shared beam archive (prompts up to 512 tokens, 8 per call) serves W2 (48-128
    tokens per prompt) and W3 (384-512) from at most 256 graphs, all in the grid captured at load."""
    beam8 = task(**{**BEAM.spec.to_dict(), "max_batch": 8})
    sizes = {
        bucket(beam8, k, t)[:2]
        for k in range(1, 9)
        for lo, hi in ((48, 128), (384, 512))
        for t in range(lo * k, hi * k + 1)
    }
    assert len(sizes) <= 256, len(sizes)
    assert sizes <= {bucket(beam8, n, t)[:2] for n, t in bucket_grid(beam8)}


@pytest.mark.parametrize(
    "task",
    [
        SCORE,
        task(**{**BEAM.spec.to_dict(), "max_batch": 8}),
        task(task="score", labels=["a", "b"], max_texts=3, max_text_tokens=40, max_batch=3),
        task(task="score", labels=["a", "b"], max_texts=1, max_text_tokens=512, max_batch=2),
    ],
    ids=["w1", "beam8", "small", "long"],
)
def test_the_grid_holds_one_call_per_bucket_of_every_call_size(task):
    """bucket_grid (what the build captures, one call per bucket) against every (sequences, tokens) a call
    within the bounds can have, one by one (bisection is only fast if bucket behaves as it assumes)."""
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

    def __init__(self, graph, task):
        self.graph, self.task, self.calls = graph, task, []

    def __call__(self, ids, cu, options, n, t):
        padded_n, padded_t = pad_inputs(ids, cu, n, t, bucket(self.task, n, t))
        self.calls.append((n, t, padded_n, padded_t))
        extra = [] if options is None else [options[:padded_n].clone()]
        return self.graph(ids[:padded_t].clone(), cu[: padded_n + 1].clone(), *extra)


def test_padded_calls_answer_as_unpadded(random_checkpoint):
    ckpt = load_checkpoint(random_checkpoint("qwen3")[0])
    for kind, spec, batches in (
        (
            "score",
            dict(task="score", labels=["yes", "no"], max_texts=4, max_text_tokens=32, max_batch=2),
            [[["search engines rank documents", "a"]], [["one", "two", "three", "four"], ["the lazy dog " * 5] * 4]],
        ),
        (
            "beam",
            dict(task="beam", beam_width=4, new_tokens=3, max_prompt_tokens=24, max_batch=2),
            [["a small language model"], ["search", "the lazy dog jumps over the quick brown fox"]],
        ),
    ):
        plain = engine_for(ckpt, **spec)
        fake = PaddedEager(plain.graph, plain.task)
        padded = Runtime(plain.graph, plain.task, "cpu", fake)
        for requests in batches:  # the second is a full call: its padding needs the extra sequence
            for a, b in zip(plain.run(requests), padded.run(requests)):
                if kind == "score":
                    assert sum(a.answer, []) == pytest.approx(sum(b.answer, []), abs=1e-5)
                else:
                    assert [c["token_ids"] for c in a.answer] == [c["token_ids"] for c in b.answer]
                    assert [c["score"] for c in a.answer] == pytest.approx([c["score"] for c in b.answer], abs=1e-4)
        assert len(fake.calls) == len(batches) and all(pt > t for n, t, pn, pt in fake.calls)
        if kind == "score":  # padding sequences, a full call too
            assert all(pn > n for n, t, pn, pt in fake.calls) and fake.calls[-1][0] == plain.task.call_texts
        else:  # the prompts as they are, and an unowned tail
            assert all(pn == n for n, t, pn, pt in fake.calls)


def test_a_bucket_is_captured_at_its_first_call_and_replayed_after(monkeypatch):
    """CudaGraphs captures nothing before a call. A call in a new bucket runs once outside and once
    inside a capture on the context's stream, from its own padded inputs in the static buffers,
    and is answered by the new graph's replay; the next call of that bucket only replays. Every
    bucket of bucket_grid (what the build captures) takes a valid call of its size; a call outside
    the bounds runs without; drop() forgets the graphs, and a failed capture turns replay off."""
    import contextlib

    import torch

    from slm_core.serve.replay import CudaGraphs

    class FakeGraph:  # torch.cuda.CUDAGraph, recording replays
        replays = []

        def replay(self):
            FakeGraph.replays.append(self)

        def pool(self):
            return "pool"

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    captures = []
    monkeypatch.setattr(
        torch.cuda,
        "graph",
        lambda graph, pool=None, stream=None, capture_error_mode="global": (
            captures.append((stream, capture_error_mode)) or contextlib.nullcontext()
        ),
    )
    for spec in (
        dict(task="score", labels=["yes", "no"], max_texts=2, max_text_tokens=24, max_batch=2),
        dict(task="beam", beam_width=2, new_tokens=2, max_prompt_tokens=40, max_batch=3),
    ):
        t_ = task(**spec)
        calls = []

        def graph(ids, cu, *options, t_=t_):
            lengths = (cu[1:] - cu[:-1]).tolist()
            assert cu[0] == 0 and cu[-1] <= ids.shape[0] and all(1 <= x <= t_.sequence_tokens for x in lengths)
            calls.append((cu.shape[0] - 1, ids.shape[0]))
            return ("outputs", len(calls))

        replay = CudaGraphs(graph, t_, torch.device("cpu"), stream="context stream")
        assert not replay.graphs and not calls
        ids, cu = torch.zeros(t_.graph_tokens, dtype=torch.int32), torch.zeros(t_.graph_texts + 1, dtype=torch.int32)
        options = (
            torch.zeros(t_.graph_texts, max(1, t_.option_columns), dtype=torch.int32) if t_.option_columns else None
        )
        ids[:5], cu[1] = 7, 5
        key = bucket(t_, 1, 5)[:2]
        first = replay(ids, cu, options, 1, 5)
        assert list(replay.graphs) == [key] and first is replay.graphs[key][1] and len(calls) == 2
        assert calls[0] == calls[1] == key and replay.ids[:5].tolist() == [7] * 5  # the call's own inputs
        assert FakeGraph.replays[-1] is replay.graphs[key][0]  # the answer is the replay's
        assert captures[-1] == ("context stream", "thread_local")  # the worker's other threads may use CUDA
        assert replay(ids, cu, options, 1, 5) is first and len(calls) == 2  # replayed, not run again
        assert replay(ids, cu, options, 1, t_.graph_tokens + 1) is None
        grid = bucket_grid(t_)
        for n, t in grid:
            cu[: n + 1] = torch.tensor([0, *itertools.accumulate(even_split(t, n))])
            replay(ids, cu, options, n, t)
        assert set(replay.graphs) == {bucket(t_, n, t)[:2] for n, t in grid} and len(calls) == 2 * len(grid)
        replay.drop(("new",))
        assert not replay.graphs and replay.constants == ("new",)

    runs = []

    def uncapturable(*args):  # runs outside a capture, fails inside one
        runs.append(len(runs))
        if len(runs) == 2:
            raise RuntimeError("operation not permitted when stream is capturing")

    broken = CudaGraphs(uncapturable, task(**spec), torch.device("cpu"))
    assert broken(ids, cu, options, 1, 5) is None and broken.failed and not broken.graphs
    assert broken(ids, cu, options, 1, 5) is None and len(runs) == 2  # no second try
