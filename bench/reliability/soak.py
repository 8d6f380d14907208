"""The soak step: 0.8x capacity for a long while, open loop, reported per window: latency and
memory flat, no restarts."""

import math
import time

from bench.reliability.open_loop import Memory, Record, open_loop, summary, worker_pids


def soak(
    url: str,
    management: str,
    model: str,
    bodies: list[bytes],
    capacity: float,
    seconds: float,
    window: float = 60.0,
    on_window=None,
    timeout: float = 30.0,
) -> dict:
    """0.8x capacity for `seconds`, reported per window of `window` seconds: latency and memory;
    and the workers' pids before and after (a restarted worker has a new one). on_window(report)
    gets the report so far each time a window's requests have all been answered."""
    before = worker_pids(management, model)
    started: list[float] = []
    windows: list[dict] = []

    def report(records: list[Record], until: float = math.inf) -> dict:
        while len(windows) < int(seconds // window):
            k = len(windows)
            if until < (k + 1) * window + timeout:  # a request of the window may still be answered
                break
            windows.append(
                {
                    "from_s": k * window,
                    **summary([r for r in records if k * window <= r.sent < (k + 1) * window], window),
                    **memory.between(started[0] + k * window, started[0] + (k + 1) * window),
                }
            )
        return {
            "capacity": capacity,
            "rate": 0.8 * capacity,
            "seconds": seconds,
            "windows": windows[:],
            "workers_before": before,
        }

    def progress(records: list[Record], until: float) -> None:
        done = len(windows)
        now = report(records, until)
        if on_window and len(windows) > done:
            on_window(now)

    with Memory(management, model) as memory:
        records = open_loop(
            url,
            bodies,
            [(0.8 * capacity, seconds)],
            timeout=timeout,
            on_start=lambda: started.append(time.perf_counter() - memory.start),
            on_records=progress,
            report_s=min(30.0, window / 2),
        )
    return {**report(records), "workers_after": worker_pids(management, model)}
