"""Closed-loop load over HTTP: `concurrency` requests always in flight, the next sent as soon as one
returns. Throughput counts the requests that complete inside the measuring window (after a
warm-up); latency is each of those requests' own send-to-answer time."""

import asyncio
import statistics
import time
from dataclasses import dataclass

import aiohttp


@dataclass(frozen=True)
class Point:
    concurrency: int
    qps: float
    mean_ms: float
    p50_ms: float
    p99_ms: float
    completed: int
    errors: int
    seconds: float
    request_indices: tuple[int, ...]  # which bodies completed in the window (for FLOP counting)
    window_start: float = 0.0  # unix time the measuring window opened (to match TorchServe's metric logs)
    # Means over the window's answers that carry slm's X-Slm-* headers (handlers/slm_handler.py): the
    # handler's time for the request's batch, its graph call, and the requests in that call.
    handler_ms: float = float("nan")
    graph_ms: float = float("nan")
    call_batch: float = float("nan")
    first_error: str = ""  # the window's first failed answer: status and the start of its body (who refused)

    def meets_slo(self, mean_ms: float = 20.0, p99_ms: float = 80.0) -> bool:
        return self.completed > 0 and self.errors == 0 and self.mean_ms < mean_ms and self.p99_ms < p99_ms


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


async def _run(
    url: str, bodies: list[bytes], concurrency: int, warmup: float, duration: float, timeout: float
) -> Point:
    latencies: list[float] = []
    done: list[int] = []
    split: list[tuple[float, ...]] = []  # X-Slm-* headers of the answers in the window
    errors = 0
    first_error = ""
    counter = 0
    start = time.perf_counter()
    window = (start + warmup, start + warmup + duration)
    window_start = time.time() + warmup
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session:

        async def client():
            nonlocal errors, counter, first_error
            while time.perf_counter() < window[1]:
                i = counter % len(bodies)
                counter += 1
                sent = time.perf_counter()
                times = [None] * 3
                try:
                    async with session.post(url, data=bodies[i], headers={"Content-Type": "application/json"}) as r:
                        body = await r.read()
                        ok = r.status == 200
                        times = [r.headers.get(f"X-Slm-{h}") for h in ("Handler-Ms", "Graph-Ms", "Batch")]
                        failure = "" if ok else f"{r.status} {body[:160].decode('utf-8', 'replace')}"
                except (TimeoutError, aiohttp.ClientError) as e:
                    ok, failure = False, type(e).__name__
                end = time.perf_counter()
                if window[0] <= end <= window[1]:  # completed in the window (sent during warm-up is fine)
                    if ok:
                        latencies.append((end - sent) * 1e3)
                        done.append(i)
                        if None not in times:
                            split.append(tuple(map(float, times)))
                    else:
                        errors += 1
                        first_error = first_error or failure

        await asyncio.gather(*(client() for _ in range(concurrency)))
    n = len(latencies)
    return Point(
        concurrency=concurrency,
        qps=n / duration,
        mean_ms=statistics.fmean(latencies) if n else float("nan"),
        p50_ms=percentile(latencies, 50) if n else float("nan"),
        p99_ms=percentile(latencies, 99) if n else float("nan"),
        completed=n,
        errors=errors,
        seconds=duration,
        request_indices=tuple(done),
        window_start=window_start,
        first_error=first_error,
        **(
            {} if not split else dict(zip(("handler_ms", "graph_ms", "call_batch"), map(statistics.fmean, zip(*split))))
        ),
    )


def measure(
    url: str, bodies: list[bytes], concurrency: int, warmup: float = 1.0, duration: float = 5.0, timeout: float = 30.0
) -> Point:
    """One point; a request unanswered after `timeout` seconds counts as an error (the SLO is 80 ms)."""
    return asyncio.run(_run(url, bodies, concurrency, warmup, duration, timeout))


def sweep(
    url: str, bodies: list[bytes], levels: list[int], warmup: float, duration: float, on_point=None, min_points: int = 3
) -> list[Point]:
    """Measure at each concurrency in `levels`; stop once `min_points` are measured and the last two
    missed the SLO (latency only grows past that point in a closed loop). Then bisect the
    concurrencies between the highest level that met the SLO and the next level measured: a grid
    step (6 -> 8) can hide 15 % of capacity."""
    points, misses = [], 0

    def point(c: int) -> Point:
        p = measure(url, bodies, c, warmup, duration)
        points.append(p)
        if on_point:
            on_point(p)
        return p

    for c in levels:
        misses = 0 if point(c).meets_slo() else misses + 1
        if len(points) >= min_points and misses >= 2:
            break
    met = [p.concurrency for p in points if p.meets_slo()]
    if met:
        lo = max(met)
        hi = min((p.concurrency for p in points if p.concurrency > lo), default=lo)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if point(mid).meets_slo() else (lo, mid)
    return points
