"""Requests to graph calls inside one worker, for TorchServe's async mode (handlers/slm_handler.py).

TorchServe's sync mode gives a worker one batch at a time, so a worker's GPU idles while it
tokenizes and encodes, and two workers on one GPU are two CUDA contexts that time-slice it. Here one
worker holds several request contexts (slm_core.engine.Context, each with its own CUDA stream and
CUDA graphs) and the requests of any number of TorchServe batches go into one queue. One thread per
context takes everything queued, up to the task's max_batch, as its next graph call: calls of
different contexts overlap on the GPU, and one context's host work (parse, tokenize, decode, JSON)
overlaps the others' GPU work.

Admission: a request that finds `max_waiting` others queued is answered 503 at once; TorchServe's
own queue does not hold it back in this mode (archiver: sized from the deadline like jobQueueSize).
"""

import collections
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from slm_core.engine import Engine
from slm_core.protocol import Reply, Request, error, respond_batch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Served:
    """A request's reply, the milliseconds it waited in the queue, and its call's handler time
    (parse, tokenize, graph call, encode of the whole call)."""

    reply: Reply
    wait_ms: float = 0.0
    handler_ms: float = 0.0


class Scheduler:
    def __init__(self, engine: Engine, max_waiting: int):
        self.engine = engine
        self.max_waiting = max_waiting
        self._queue: collections.deque[tuple[Request, Future, float]] = collections.deque()
        self._ready = threading.Condition()
        self._threads = [threading.Thread(target=self._serve, name=f"slm-context-{i}", daemon=True)
                         for i in range(len(engine.contexts))]
        for thread in self._threads:
            thread.start()

    def submit(self, request: Request) -> "Future[Served]":
        """Queue one request; the future's result is its Served (never an exception)."""
        future: Future[Served] = Future()
        with self._ready:
            if len(self._queue) >= self.max_waiting:
                future.set_result(Served(error(503, f"server busy: {len(self._queue)} requests already wait "
                                                    "for this worker; retry later")))
                return future
            self._queue.append((request, future, time.perf_counter()))
            self._ready.notify()
        return future

    def waiting(self) -> int:
        return len(self._queue)

    def _serve(self) -> None:
        """One context's thread. Nothing may end it: a request whose thread died would wait forever."""
        batch_limit = self.engine.task.max_batch
        while True:
            with self._ready:
                while not self._queue:
                    self._ready.wait()
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), batch_limit))]
            # a future cancelled while it waited (its client went away) is dropped, not run
            batch = [item for item in batch if item[1].set_running_or_notify_cancel()]
            start = time.perf_counter()
            try:
                replies = respond_batch(self.engine, [request for request, _, _ in batch])
            except Exception:  # respond_batch answers bad input itself: this is a bug; no request may hang
                log.exception("a call failed outside the protocol's own error handling")
                replies = [error(500, "internal error while running the request")] * len(batch)
            handler_ms = (time.perf_counter() - start) * 1e3
            for (_, future, queued), reply in zip(batch, replies):
                future.set_result(Served(reply, (start - queued) * 1e3, handler_ms))
