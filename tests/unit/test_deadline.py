"""Deadlines at run time (slm_core.serve.deadline): a request past its deadline, or one that the
call it would join cannot finish in time, gets a 504 and is never computed; the others are."""

import json
import re
import time

import pytest
import torch
from conftest import smollm2_path

from slm_core import Engine, InputError
from slm_core.compile.checkpoint import load_checkpoint
from slm_core.serve.deadline import HEADER, Deadlines, waited_ms
from slm_core.serve.protocol import Request, respond_batch
from slm_core.spec import TaskSpec
from slm_core.tasks import task_for

TIMED = Deadlines(None, {"1": 5.0, "2": 8.0, "4": 13.0})


def test_a_call_is_predicted_by_the_smallest_timed_call_that_holds_it():
    assert [TIMED.call(n) for n in (1, 2, 3, 4, 9)] == [5.0, 8.0, 13.0, 13.0, 13.0]
    assert Deadlines(None).call(3) == 0.0  # a build without timings predicts nothing


@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan", "inf", "1e12", ""])
def test_a_bad_deadline_header_is_a_400_naming_it(value):
    with pytest.raises(InputError, match="X-Slm-Deadline-Ms must be a positive number") as e:
        TIMED.budget({"x-slm-deadline-ms": value})
    assert e.value.status == 400


def test_the_archive_deadline_unless_the_request_brings_its_own():
    assert Deadlines(80.0).budget({}) == 80.0 and Deadlines(None).budget({}) is None
    assert Deadlines(80.0).budget({"x-slm-deadline-ms": "250"}) == 250.0


@pytest.mark.parametrize("scale, prefix", [(1, "t="), (1, ""), (1e3, ""), (1e6, "")])  # seconds, ms, us since the epoch
def test_arrival_from_a_proxys_request_start_stamp(scale, prefix):
    stamp = f"{prefix}{(time.time() - 0.5) * scale:.6f}"
    assert 450 < waited_ms({"x-request-start": stamp}, time.monotonic()) < 5000


@pytest.mark.parametrize(
    "stamp",
    [lambda: "soon", lambda: "-3", lambda: f"{time.time() + 60:.3f}", lambda: "nan"],
    ids=["a word", "negative", "a minute ahead", "nan"],
)
def test_an_unusable_stamp_counts_from_when_the_worker_took_the_request(stamp):
    taken = time.monotonic() - 0.2  # the stamp is made now: one a minute ahead is ahead when it is read
    assert 200 <= waited_ms({"x-request-start": stamp()}, taken) < 5000


class CountingGraph(torch.nn.Module):
    """A score graph that counts its calls and the texts it computed."""

    def __init__(self):
        super().__init__()
        self.calls, self.texts = 0, 0

    def forward(self, ids, cu):
        self.calls += 1
        self.texts += cu.shape[0] - 1
        return torch.full((cu.shape[0] - 1, 2), 0.5)


def test_late_requests_get_a_504_and_are_not_computed():
    task = task_for(
        TaskSpec.from_dict(dict(task="score", labels=["Yes", "No"], max_texts=4, max_text_tokens=32, max_batch=4)),
        load_checkpoint(smollm2_path()).tokenizer,
    )
    graph = CountingGraph()
    engine = Engine(graph, task, "cpu")
    deadlines = Deadlines(50.0, {"1": 5.0, "4": 20.0})
    long_ago = f"t={time.time() - 1.5:.6f}"
    batch = [
        Request({"body": b'{"texts": ["on time"]}'}),  # the archive's 50 ms: a call of 4 takes 20
        Request({"body": b'{"texts": ["waited 1.5 s"]}'}, {"x-request-start": long_ago}),
        Request({"body": b'{"texts": ["too tight"]}'}, {"x-slm-deadline-ms": "10"}),  # < the call's 20 ms
        Request({"body": b'{"texts": ["generous"]}'}, {"x-slm-deadline-ms": "5000", "x-request-start": long_ago}),
        Request({"body": b'{"texts": ["bad header"]}'}, {"x-slm-deadline-ms": "soon"}),
    ]
    replies = respond_batch(engine, batch[:4], deadlines) + respond_batch(engine, batch[4:], deadlines)
    assert [r.status for r in replies] == [200, 504, 504, 200, 400]
    assert re.search(rb"deadline of 50 ms: waited 1[5-9][0-9]{2}\.[0-9] ms", replies[1].body)  # 1.5 s and more
    assert b"not computed" in replies[1].body
    assert b"deadline of 10 ms" in replies[2].body and b"takes up to 20.0 ms" in replies[2].body
    assert graph.calls == 1 and graph.texts == 2  # one call, the two requests that could make it
    assert replies[0].stats.batch == 2


SIZED = Deadlines(None, {"1": 40.0, "4": 90.0}, ((1, 8, 2.0), (1, 64, 6.0), (4, 8, 5.0), (4, 64, 30.0), (8, 64, 50.0)))


def test_a_call_is_bounded_by_the_smallest_timed_call_of_its_size_or_more():
    """The cheapest timed call with at least the call's sequences, none shorter than its longest;
    the token bounds where no timed call covers it or its size is not known."""
    assert SIZED.call(1, 1, 8) == 2.0 and SIZED.call(1, 2, 8) == 5.0 and SIZED.call(1, 1, 9) == 6.0
    assert SIZED.call(2, 3, 40) == 30.0 and SIZED.call(4, 8, 64) == 50.0
    assert SIZED.call(4, 9, 10) == 90.0 and SIZED.call(1, 1, 65) == 40.0  # past every timed size
    assert SIZED.call(2) == 90.0  # no size: the token bounds (the smallest timed count that holds 2)


def test_the_refusal_names_the_calls_size():
    refusal = SIZED.refusal({"x-slm-deadline-ms": "20"}, time.monotonic(), 2, 3, 40)
    assert refusal.status == 504 and "a call of 2 request(s) (3 sequence(s), the longest 40 tokens)" in str(refusal)
    assert "takes up to 30.0 ms" in str(refusal)
    assert SIZED.refusal({"x-slm-deadline-ms": "20"}, time.monotonic(), 1, 2, 8) is None  # 5 ms


def test_a_small_request_meets_a_deadline_that_a_call_at_the_bounds_would_miss(random_checkpoint):
    """A score task with wide bounds (8 texts of 512 tokens), its calls timed by size on this CPU
    as a build times them (time_sizes): a request of four short texts is answered within a
    deadline shorter than a call at the bounds, and one at the bounds is refused at once (504),
    not computed."""
    from helpers import engine_for

    from slm_core.compile.checks import time_sizes

    ckpt = load_checkpoint(random_checkpoint("qwen2")[0])
    engine = engine_for(ckpt, task="score", labels=["yes", "no"], max_texts=8, max_text_tokens=512, max_batch=1)
    small = ["the quick brown fox", "a", "search engines rank documents", "beam search"]
    sizes = time_sizes(engine)
    for _ in range(3):  # the premise, a short request far cheaper, is timed again while other work inflates it
        timed = Deadlines(None, {}, tuple(map(tuple, sizes)))
        bounds = timed.call(1, 8, engine.task.sequence_tokens)  # a call at the bounds
        estimate = timed.call(1, 4, max(len(s) for s in engine.task.encode([small])[0]))
        if estimate * 4 < bounds:
            break
        sizes = [[n, length, min(ms, again)] for (n, length, ms), (_, _, again) in zip(sizes, time_sizes(engine))]
    assert estimate * 4 < bounds, (estimate, bounds)
    deadline = f"{(estimate * 2 + bounds) / 3:.1f}"  # within the bound's call, well above the request's
    for _ in range(3):  # admitted every time; its time is taken again where other work slowed a call
        start = time.perf_counter()
        (answered,) = respond_batch(
            engine, [Request({"body": json.dumps({"texts": small}).encode()}, {HEADER: deadline})], timed
        )
        took = (time.perf_counter() - start) * 1e3
        assert answered.status == 200, answered.body
        if took < float(deadline):
            break
    assert took < float(deadline), (took, deadline)
    longest = "the lazy dog"
    while not isinstance(engine.task.encode([[longest + " the lazy dog"]])[0], InputError):
        longest += " the lazy dog"  # the longest text of these words within the 512 tokens
    at_bounds = json.dumps({"texts": [longest] * 8})
    start = time.perf_counter()
    (refused,) = respond_batch(engine, [Request({"body": at_bounds.encode()}, {HEADER: deadline})], timed)
    took = (time.perf_counter() - start) * 1e3
    assert refused.status == 504 and b"not computed" in refused.body, refused.body
    assert took < bounds, (took, bounds)  # refused before the call (its tokenizing only)
