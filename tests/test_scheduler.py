"""slm_core.scheduler (the async worker's queue): one call per context at once, what waits goes in
the next free context's call (up to max_batch), a full queue refuses at once, nothing hangs."""

import json
import threading

from slm_core.scheduler import Scheduler
from slm_core.spec import TaskSpec


class GatedEngine:
    """Engine stand-in: score calls that block until `gate` opens, recording each call's size."""

    def __init__(self, contexts: int, max_batch: int, fail: bool = False):
        self.task = TaskSpec.from_dict({"task": "score", "labels": ["yes", "no"], "max_batch": max_batch})
        self.contexts = [object()] * contexts
        self.gate, self.fail = threading.Event(), fail
        self.calls: list[int] = []
        self.started = threading.Semaphore(0)

    def run_score_batch(self, requests):
        self.calls.append(len(requests))
        self.started.release()
        self.gate.wait(30)
        if self.fail:
            raise RuntimeError("device fault")
        return [([[0.5, 0.5]] * len(texts), None) for texts in requests]


def body(i: int) -> dict:
    return {"body": json.dumps({"texts": [f"text {i}"]}).encode()}


def test_calls_overlap_per_context_queue_drains_in_batches_and_overflow_is_refused():
    engine = GatedEngine(contexts=2, max_batch=3)
    scheduler = Scheduler(engine, max_waiting=5)
    running = [scheduler.submit(body(0))]
    assert engine.started.acquire(timeout=10)  # the first context took it
    running.append(scheduler.submit(body(1)))
    assert engine.started.acquire(timeout=10)  # the second context too: two calls at once
    queued = [scheduler.submit(body(i)) for i in range(2, 7)]
    assert scheduler.waiting() == 5
    refused = scheduler.submit(body(7)).result(timeout=1)  # at once, without waiting for the gate
    assert refused.reply.status == 503 and "server busy" in json.loads(refused.reply.body)["error"]
    engine.gate.set()
    for future in running + queued:
        served = future.result(timeout=10)
        assert served.reply.status == 200 and json.loads(served.reply.body)["scores"] == [[0.5, 0.5]]
        assert served.wait_ms >= 0 and served.handler_ms > 0
    assert sorted(engine.calls) == [1, 1, 2, 3]  # the five that waited went in calls of up to max_batch


def test_a_failing_call_answers_500_and_the_scheduler_serves_on():
    engine = GatedEngine(contexts=1, max_batch=2, fail=True)
    engine.gate.set()
    scheduler = Scheduler(engine, max_waiting=10)
    bad = [scheduler.submit(body(i)) for i in range(3)] + [scheduler.submit({"body": b"not json"})]
    statuses = sorted(f.result(timeout=10).reply.status for f in bad)
    assert statuses == [400, 500, 500, 500]
    engine.fail = False
    assert scheduler.submit(body(9)).result(timeout=10).reply.status == 200


def test_a_request_cancelled_while_waiting_is_dropped_and_the_thread_serves_on():
    engine = GatedEngine(contexts=1, max_batch=4)
    scheduler = Scheduler(engine, max_waiting=10)
    first = scheduler.submit(body(0))
    assert engine.started.acquire(timeout=10)
    gone = scheduler.submit(body(1))
    assert gone.cancel()  # its client went away (asyncio cancels the future it waits on)
    kept = scheduler.submit(body(2))
    engine.gate.set()
    assert first.result(timeout=10).reply.status == 200 and kept.result(timeout=10).reply.status == 200
    assert engine.calls == [1, 1]  # the cancelled one never ran
    assert scheduler.submit(body(3)).result(timeout=10).reply.status == 200
