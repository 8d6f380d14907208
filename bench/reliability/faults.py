"""The fault steps: 0.8x capacity, open loop, and a few seconds in, kill -9 of a worker or an
illegal memory access on the GPU beside the workers: the requests lost, and when a new worker
answers."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

from bench.reliability.open_loop import open_loop, p99_per_second, worker_pids


def fault(
    url: str,
    management: str,
    model: str,
    bodies: list[bytes],
    capacity: float,
    inject,
    seconds: float,
    lead: float = 5.0,
) -> dict:
    """0.8x capacity for `seconds`; `lead` s in, inject() (a thread: kill a worker, or fault the GPU
    beside the workers) returns what it did. Counts what failed, split into the requests sent
    before the fault (in flight at it) and after it; when the first request answered by a new
    worker came back and when the last failure did (s from the fault); statuses and P99 per
    second; the workers before and after."""
    before = worker_pids(management, model)
    report: dict = {}
    timer = threading.Timer(lead, lambda: report.update(inject(before)))
    started: list[float] = []
    records = open_loop(
        url, bodies, [(0.8 * capacity, seconds)], on_start=lambda: (started.append(time.time()), timer.start())
    )
    timer.join()
    at = report.pop("at") - started[0]  # the fault, in the open loop's seconds
    failed = [(r.sent - at, r.ms, r.status) for r in records if r.status != 200]
    new = [
        r.sent + r.ms / 1e3 - at
        for r in records
        if r.status == 200 and r.worker and r.worker not in before and r.sent >= at
    ]
    return {
        "capacity": capacity,
        "rate": 0.8 * capacity,
        "seconds": seconds,
        "fault_at_s": at,
        **report,
        "workers_before": before,
        "workers_after": worker_pids(management, model),
        "requests": len(records),
        "failed": len(failed),
        "failed_in_flight": sum(t < 0 for t, _, _ in failed),
        "failed_after": sum(t >= 0 for t, _, _ in failed),
        "failed_statuses": dict(Counter(str(s) for _, _, s in failed)),
        "last_failure_answered_s": max((t + ms / 1e3 for t, ms, _ in failed), default=None),
        "first_answer_by_a_new_worker_s": min(new, default=None),
        "statuses_per_second": [
            dict(Counter(str(r.status) for r in records if k <= r.sent < k + 1)) for k in range(int(seconds))
        ],
        "p99_ms_per_second": p99_per_second(records, seconds),
    }


def kill_worker(workers: list[str]) -> dict:
    """kill -9 of the first worker."""
    at = time.time()
    os.kill(int(workers[0]), signal.SIGKILL)
    return {"at": at, "killed": workers[0]}


def gpu_fault(workers: list[str]) -> dict:
    """A process beside the workers that makes an illegal memory access on the GPU
    (bench.gpu_fault), with the MPS server's processes before and after it."""
    servers = _mps_servers()
    run = subprocess.run([sys.executable, "-m", "bench.gpu_fault"], capture_output=True, text=True, timeout=120)
    said = (run.stdout + run.stderr).strip()
    launched = re.search(r"launched at ([0-9.]+)", said)  # the bad kernel's launch, by this host's clock
    time.sleep(1.0)
    return {
        "at": float(launched.group(1)) if launched else time.time(),
        "fault_exit": run.returncode,
        "fault_said": said[-600:],
        "mps_servers_before": servers,
        "mps_servers_after": _mps_servers(),
    }


def _mps_servers() -> list[str]:
    """The pids of NVIDIA MPS servers running on this host."""
    out = subprocess.run(["pgrep", "-f", "nvidia-cuda-mps-server"], capture_output=True, text=True).stdout
    return sorted(out.split())


FAULTS = {"kill": kill_worker, "gpu-fault": gpu_fault}
