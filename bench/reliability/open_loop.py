"""The open loop the load steps share: requests sent at a fixed rate whatever the answers, by
several generator processes taking turns in one schedule; the workers' memory sampled each
second; and the figures of a run (latency, refusals, P99 per second)."""

import asyncio
import math
import multiprocessing
import os
import statistics
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

from bench.loadgen import percentile
from handlers.local_server import model_workers

JSON = "application/json"


def worker_pids(management: str, model: str) -> list[str]:
    """The process ids of a model's workers, sorted."""
    return sorted(str(w["pid"]) for w in model_workers(management, model))


class Record(NamedTuple):
    sent: float  # when it was due, s from the loop's start
    ms: float  # latency, from its actual send
    status: int  # 0: a timeout or a broken connection
    worker: str  # the worker that answered (X-Slm-Worker), "" where none did
    lag_ms: float  # how late the generator sent it: a client-side delay no server figure holds
    catalog: str = ""  # the catalog version that answered (X-Slm-Catalog-Version), "" where none


def open_loop(
    url: str,
    bodies: list[bytes],
    phases: list[tuple[float, float]],
    timeout: float = 30.0,
    deadline_ms: float | None = None,
    processes: int | None = None,
    on_start=None,
    on_records=None,
    report_s: float = 30.0,
) -> list[Record]:
    """Requests at each phase's (rate per second, seconds), one phase after the other, each sent on
    schedule whatever the others are doing (open loop; no client-side limit on connections), from
    `processes` generator processes that take turns in the schedule (default: one per
    RATE_PER_PROCESS req/s of the fastest phase, at most the cores but two), so that one event
    loop's own delays neither hold requests back nor count as server time. With deadline_ms, each
    request carries it (X-Slm-Deadline-Ms) and its send time as a proxy stamps it
    (X-Request-Start). on_start() runs in this process as the schedule starts; on_records(records,
    until) with the answers so far (unsorted), about every `report_s` seconds: every request
    answered before `until` (s into the schedule) is among them (a long run cut short keeps them)."""
    due, begin = [], 0.0
    for rate, seconds in phases:
        due += [begin + i / rate for i in range(math.ceil(rate * seconds - 1e-9))]
        begin += seconds
    fastest = max(rate for rate, _ in phases)
    processes = processes or max(1, min(math.ceil(fastest / RATE_PER_PROCESS), (os.cpu_count() or 1) - 2))
    ctx = multiprocessing.get_context("spawn")  # no fork of this process's threads (Memory's, a fault timer)
    ready, results = ctx.Barrier(processes + 1), ctx.Queue()
    parts = [
        ctx.Process(
            target=_open_loop_part,
            daemon=True,
            args=(url, bodies, due[k::processes], k, processes, timeout, deadline_ms, report_s, ready, results),
        )
        for k in range(processes)
    ]
    for part in parts:
        part.start()
    ready.wait(STARTUP_S)  # every generator started: the schedule starts now, in all at once
    if on_start:
        on_start()
    # read before join: a process does not exit while its records wait in a full pipe
    out: list[Record] = []
    clocks = [0.0] * processes  # per generator: the schedule's time at its last hand-over
    while min(clocks) < math.inf:
        part, clock, chunk = results.get(timeout=begin + timeout + STARTUP_S)
        clocks[part] = clock
        out += chunk
        if on_records:
            on_records(out, min(clocks))
    for part in parts:
        part.join()
    return sorted(out)


RATE_PER_PROCESS = 150  # req/s one aiohttp event loop sends on schedule, with room (bench/RESULTS.md)


STARTUP_S = 60.0  # a generator process not ready by then has failed


def _open_loop_part(
    url: str,
    bodies: list[bytes],
    due: list[float],
    part: int,
    parts: int,
    timeout: float,
    deadline_ms: float | None,
    report_s: float,
    ready,
    results,
) -> None:
    """open_loop's generator `part` of `parts`: the requests due at `due` (s from the start),
    request i of the schedule at due[i // parts] with body i. Its answers go to `results` in chunks,
    about every `report_s` seconds, as (part, the schedule's time then, answers); inf at the end."""
    import aiohttp

    async def go():
        nonlocal start
        out: list[Record] = []
        handed = [time.perf_counter()]

        def hand_over(end: bool = False) -> None:
            handed[0] = time.perf_counter()
            results.put((part, math.inf if end else handed[0] - start, out[:]))
            out.clear()

        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session:

            async def one(body: bytes, at: float, scheduled: float):
                sent = time.perf_counter()
                headers = {"Content-Type": JSON}
                if deadline_ms is not None:
                    headers.update({"X-Slm-Deadline-Ms": f"{deadline_ms:g}", "X-Request-Start": f"t={time.time():.6f}"})
                worker = catalog = ""
                try:
                    async with session.post(url, data=body, headers=headers) as r:
                        await r.read()
                        status, worker = r.status, r.headers.get("X-Slm-Worker", "")
                        catalog = r.headers.get("X-Slm-Catalog-Version", "")
                except (TimeoutError, aiohttp.ClientError):
                    status = 0
                ms = (time.perf_counter() - sent) * 1e3
                out.append(Record(at, ms, status, worker, (sent - scheduled) * 1e3, catalog))
                if time.perf_counter() - handed[0] > report_s:
                    hand_over()

            await asyncio.get_running_loop().run_in_executor(None, ready.wait, STARTUP_S)
            # Only the requests in flight are held: finished tasks kept to the end would make each
            # full garbage collection walk them all, a pause that grows with the run (77 ms at 90,000
            # requests), in which nothing is sent.
            start, pending = time.perf_counter(), set()
            for j, at in enumerate(due):
                delay = start + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                body = bodies[(j * parts + part) % len(bodies)]
                task = asyncio.ensure_future(one(body, at, start + at))
                pending.add(task)
                task.add_done_callback(pending.discard)
            await asyncio.gather(*pending)
        hand_over(end=True)

    start = time.perf_counter()
    asyncio.run(go())


class Memory:
    """Samples, every second in a thread, the host RSS (MiB) of a model's workers and, where
    nvidia-smi runs, the GPU memory they use (MiB): series of (seconds since start, rss, gpu)."""

    def __init__(self, management: str, model: str):
        self.management, self.model = management, model
        self.samples: list[tuple[float, float, float | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self.start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            pids = worker_pids(self.management, self.model)
            rss = 0.0
            for pid in pids:
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                    rss += int(next(s for s in status.splitlines() if s.startswith("VmRSS")).split()[1]) / 1024
                except (OSError, StopIteration):
                    pass
            self.samples.append((time.perf_counter() - self.start, rss, _gpu_mib(pids)))

    def between(self, t0: float, t1: float) -> dict:
        window = [s for s in self.samples if t0 <= s[0] <= t1]
        if not window:
            return {}
        out = {"rss_mib_first": window[0][1], "rss_mib_last": window[-1][1], "rss_mib_max": max(s[1] for s in window)}
        if window[0][2] is not None:
            out.update(gpu_mib_first=window[0][2], gpu_mib_last=window[-1][2])
        return out


def _gpu_mib(pids: list[str]) -> float | None:
    try:
        text = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return sum(
        float(m) for p, m in (line.split(",") for line in text.strip().splitlines() if "," in line) if p.strip() in pids
    )


def summary(records: list[Record], seconds: float, deadline_ms: float | None = None) -> dict:
    """Offered and answered rates, admitted (200) latency, refused (429/503: a full queue; 504:
    a deadline) latency, the rest; with deadline_ms, the answers that came after it."""
    ok = sorted(r.ms for r in records if r.status == 200)
    refused = sorted(r.ms for r in records if r.status in (429, 503, 504))
    lag = sorted(r.lag_ms for r in records)

    def pct(values, q):
        return percentile(values, q) if values else None

    return {
        "offered_per_s": len(records) / seconds,
        "answered_per_s": len(ok) / seconds,
        "admitted_mean_ms": statistics.fmean(ok) if ok else None,
        "admitted_p50_ms": pct(ok, 50),
        "admitted_p99_ms": pct(ok, 99),
        "refused": len(refused),
        "refused_p50_ms": pct(refused, 50),
        "refused_p99_ms": pct(refused, 99),
        "refused_max_ms": refused[-1] if refused else None,
        "refused_queue_full": sum(r.status in (429, 503) for r in records),
        "refused_deadline": sum(r.status == 504 for r in records),
        **({"answered_after_deadline": sum(ms > deadline_ms for ms in ok)} if deadline_ms is not None else {}),
        "other_statuses": dict(Counter(str(r.status) for r in records if r.status not in (200, 429, 503, 504))),
        "send_lag_p99_ms": pct(lag, 99),
        "send_lag_max_ms": lag[-1] if lag else None,
    }


def p99_per_second(records: list[Record], seconds: float) -> list[float | None]:
    """The admitted P99 of the requests sent in each whole second."""
    return [summary([r for r in records if k <= r.sent < k + 1], 1)["admitted_p99_ms"] for k in range(int(seconds))]
