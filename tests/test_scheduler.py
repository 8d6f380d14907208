"""slm_core.scheduler (the async worker's queue): one call per context at once, what waits goes in
the next free context's call (up to max_batch), a full queue refuses at once, nothing hangs; with
an engine whose calls take turns (overlap=False), a call takes everything queued during the last."""

import json
import threading

import torch

from slm_core.engine import Engine, build_graph
from slm_core.scheduler import Scheduler
from slm_core.spec import RuntimeSpec, TaskSpec


class GatedEngine:
    """Engine stand-in: score calls that block until `gate` opens, recording each call's size."""

    turn, _end_turn = Engine.turn, Engine._end_turn  # the engine's own device turns (overlap=False)

    def __init__(self, contexts: int, max_batch: int, fail: bool = False, overlap: bool = True):
        self.task = TaskSpec.from_dict({"task": "score", "labels": ["yes", "no"], "max_batch": max_batch})
        self.contexts = [object()] * contexts
        self.gate, self.fail = threading.Event(), fail
        self.calls: list[int] = []
        self.started = threading.Semaphore(0)
        self._device_turn, self._holder = (None if overlap else threading.Lock()), threading.local()

    def run_score_batch(self, requests):
        self.calls.append(len(requests))
        self.started.release()
        self.gate.wait(30)
        if self.fail:
            raise RuntimeError("device fault")
        self._end_turn()  # as Engine._run does once the outputs are on the host
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


def test_serial_calls_take_turns_and_each_takes_what_queued_meanwhile():
    """overlap=False: the second context does not start a call of one while the first runs; it
    waits for the device, then takes all that queued (here 4) in one call."""
    engine = GatedEngine(contexts=2, max_batch=8, overlap=False)
    scheduler = Scheduler(engine, max_waiting=10)
    first = scheduler.submit(body(0))
    assert engine.started.acquire(timeout=10)
    queued = [scheduler.submit(body(i)) for i in range(1, 5)]
    assert not engine.started.acquire(timeout=0.3)  # no second call while the first holds the device
    assert scheduler.waiting() == 4
    engine.gate.set()
    for future in [first] + queued:
        assert future.result(timeout=10).reply.status == 200
    assert engine.calls == [1, 4]
    engine.fail = True  # a failing call gives its turn back too: the next call still runs
    assert scheduler.submit(body(5)).result(timeout=10).reply.status == 500
    engine.fail = False
    assert scheduler.submit(body(6)).result(timeout=10).reply.status == 200


def test_engine_gives_its_turn_back_once_the_outputs_are_on_the_host(random_checkpoint):
    """A real engine (CPU, eager): inside turn(), after a call, another thread may take the device
    while this one still decodes and encodes; a thread without the turn is not held back."""
    folder, _ = random_checkpoint("qwen3")
    from slm_core.checkpoint import load_checkpoint

    task, runtime = TaskSpec.from_dict({"task": "score", "labels": ["yes", "no"], "precision": "fp32"}), RuntimeSpec()
    graph, tokenizer = build_graph(load_checkpoint(folder), task, runtime)
    engine = Engine(graph, tokenizer, task, runtime, [None, None], overlap=False)
    expected = engine.score(["a short text"])  # no turn taken: runs as before
    with engine.turn():
        assert not engine._device_turn.acquire(blocking=False)  # held
        assert engine.score(["a short text"]) == expected
        assert engine._device_turn.acquire(blocking=False)  # given back by the call
        engine._device_turn.release()
    torch.testing.assert_close(torch.tensor(engine.score(["a short text"])), torch.tensor(expected))
