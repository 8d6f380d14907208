"""How fast workers start: `ready` times a model's workers from the scale request until each is
READY, one alone and several together, with no traffic; `scale_up` is the event of the
scale-up step (bench.reliability.faults.fault runs it under 0.8x capacity): the workers doubled
a few seconds in, the requests lost, and when the new ones answer."""

import time

from handlers.local_server import model_workers, scale

POLL_S = 0.1


def _until_ready(management: str, model: str, workers: int, known: set[str], timeout: float) -> list[float]:
    """Seconds from now until each worker not in `known` is READY, in the order they became so,
    once `workers` are READY; TimeoutError otherwise."""
    start, seen = time.monotonic(), {}
    while time.monotonic() - start < timeout:
        ready = [str(w["pid"]) for w in model_workers(management, model) if w["status"] == "READY"]
        for pid in ready:
            if pid not in known and pid not in seen:
                seen[pid] = time.monotonic() - start
        if len(ready) >= workers:
            return sorted(seen.values())
        time.sleep(POLL_S)
    raise TimeoutError(f"{model}: {workers} worker(s) not READY after {timeout:.0f} s ({len(seen)} new ones were)")


def _stopped(management: str, model: str, timeout: float) -> None:
    """Scaled to 0 and waited until no worker is listed (their GPU memory freed with their process)."""
    scale(management, model, 0)
    end = time.monotonic() + timeout
    while model_workers(management, model) and time.monotonic() < end:
        time.sleep(POLL_S)


def ready(management: str, model: str, counts: list[int], timeout: float = 600) -> dict:
    """For each count: every worker stopped, then `count` started together; seconds from the scale
    request until each is READY (TorchServe's worker process started, the handler's initialize
    done: package loaded, request contexts made). The model ends with the workers it had."""
    had = len(model_workers(management, model))
    result = {}
    for count in counts:
        _stopped(management, model, timeout)
        scale(management, model, count)
        result[f"{count} together"] = [round(s, 2) for s in _until_ready(management, model, count, set(), timeout)]
        print(f"[ready] {count} worker(s) together: {result[f'{count} together']} s", flush=True)
    _stopped(management, model, timeout)
    scale(management, model, had)
    _until_ready(management, model, had, set(), timeout)
    return result


def scale_up(management: str, model: str, before: list[str], timeout: float = 600) -> dict:
    """The workers `before` doubled (an asynchronous PUT, as an autoscaler sends it): when it was
    sent, and seconds from then until each new worker was READY."""
    at = time.time()
    scale(management, model, 2 * len(before))
    ready_s = _until_ready(management, model, 2 * len(before), set(before), timeout)
    return {"at": at, "scaled_to": 2 * len(before), "new_workers_ready_s": [round(s, 2) for s in ready_s]}
