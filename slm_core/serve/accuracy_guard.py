"""An online accuracy guard: a share of live requests recomputed, off the hot path, by a reference
engine of higher precision (the archive's reference graph: bf16 for an fp8-static archive, fp32 for
a bf16 one), and each served answer compared with the reference's (Task.difference).

    guard = AccuracyGuard(reference_engine, share=0.001, max_diff=0.05, min_shared=0.6).start()
    guard.offer(request_id, value, answer, task)   # after a call, each request: sampled at `share`
    guard.drain()                            # the comparisons done since the last drain

The reference runs in a thread of its own, on its own request context (and CUDA stream), one
sampled request at a time. A sampled request
that finds GUARD_QUEUE others waiting is dropped (counted): the guard never holds back serving.
A comparison breaches when the task's FP8 gate, applied to
that one request with the spec's thresholds, fails (Task.gate): |Δp| above max_diff for score
tasks, fewer shared candidates than min_shared for beams.
"""

import logging
import queue
import random
import threading
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)
GUARD_QUEUE = 16  # sampled requests waiting for the reference at most


@dataclass(frozen=True)
class Comparison:
    """One sampled request: its id, the largest |difference| of the numbers both answers hold
    (probabilities; shared candidates' scores), the share of the reference's candidates the
    served answer holds (1.0 for rows of numbers), whether the best candidate is the same, and
    whether it breaches the thresholds."""

    request_id: str
    max_abs_diff: float
    shared: float
    best_same: bool
    breach: bool


class AccuracyGuard:
    def __init__(self, reference: Any, share: float, max_diff: float, min_shared: float, seed: int | None = None):
        self.reference = reference  # the reference engine (a Runtime), loaded with the worker
        self.share = share
        self.max_diff, self.min_shared = max_diff, min_shared
        self.dropped = 0  # sampled requests the guard had no room for
        self.failed = 0  # reference calls that failed
        self._random = random.Random(seed)
        self._queue: queue.Queue = queue.Queue(GUARD_QUEUE)
        self._done: list[Comparison] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="accuracy-guard", daemon=True)

    def start(self) -> "AccuracyGuard":
        self._thread.start()
        return self

    def offer(self, request_id: str, value: Any, answer: Any, task: Any) -> bool:
        """Sample a served request (its value, its answer and the task that answered it) at the
        guard's share; whether it was taken."""
        if self.share <= 0 or self._random.random() >= self.share:
            return False
        try:
            self._queue.put_nowait((request_id, value, answer, task))
        except queue.Full:
            self.dropped += 1
            return False
        return True

    def drain(self) -> list[Comparison]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def wait(self) -> None:
        """Until every sampled request so far is compared (tests, a benchmark's end)."""
        self._queue.join()

    def _run(self) -> None:
        while True:
            request_id, value, answer, task = self._queue.get()
            try:
                comparison = self.compare(request_id, value, answer, task)
            except Exception:  # the reference failed: counted and logged, serving goes on
                self.failed += 1
                log.exception("the accuracy guard's reference failed on request %s", request_id)
            else:
                with self._lock:
                    self._done.append(comparison)
                if comparison.breach:
                    log.warning(
                        "accuracy guard: request %s differs from the reference past the thresholds: %s",
                        request_id,
                        comparison,
                    )
            finally:
                self._queue.task_done()

    def compare(self, request_id: str, value: Any, answer: Any, task: Any) -> Comparison:
        engine = self.reference
        if engine.task.data_version != task.data_version:  # a catalog swapped since: the same one
            engine.swap(task)
        want = engine.run_one(value)
        difference = engine.task.difference(want, answer)
        verdict = engine.task.gate([difference], self.max_diff, self.min_shared)
        return Comparison(
            request_id,
            max(difference.values, default=0.0),
            difference.shared,
            difference.best_same,
            not verdict["passes"],
        )
