"""The overload step: 0.8x capacity, then `factor` x capacity for a while, then 0.8x again, open
loop: refusals fast, admitted latency bounded, memory flat."""

import time

from bench.reliability.open_loop import Memory, open_loop, p99_per_second, summary


def overload(
    url: str,
    management: str,
    model: str,
    bodies: list[bytes],
    capacity: float,
    seconds: float,
    factor: float = 3.0,
    settle: float = 10.0,
    deadline_ms: float | None = None,
) -> dict:
    """0.8x capacity for `settle` s, factor x capacity for `seconds`, 0.8x again for `settle` s
    (recovery: also per second), one schedule without a pause between them, with the workers'
    memory over each phase; with deadline_ms, every request carries that deadline."""
    phases = [("before", 0.8, settle), ("burst", factor, seconds), ("after", 0.8, settle)]
    result: dict = {"capacity": capacity, "factor": factor, "deadline_ms": deadline_ms}
    started: list[float] = []
    with Memory(management, model) as memory:
        records = open_loop(
            url,
            bodies,
            [(x * capacity, secs) for _, x, secs in phases],
            deadline_ms=deadline_ms,
            on_start=lambda: started.append(time.perf_counter() - memory.start),
        )
    begin = 0.0
    for name, _, secs in phases:
        mine = [r._replace(sent=r.sent - begin) for r in records if begin <= r.sent < begin + secs]
        t0 = started[0] + begin
        result[name] = {**summary(mine, secs, deadline_ms), **memory.between(t0, t0 + secs)}
        if name == "after":
            result[name]["p99_ms_per_second"] = p99_per_second(mine, secs)
        begin += secs
    return result
