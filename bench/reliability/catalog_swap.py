"""The catalog-swap step: 0.8x capacity, open loop, on an archive that follows a catalog store
(`slm-archiver configure --catalog-store DIR`); a baseline, then each catalog published into the
store in turn (`slm-archiver publish`: checked, built, activated), then a rollback. Per event, when
every worker answered with the new version (from the activation, each worker's replies named by
X-Slm-Worker and X-Slm-Catalog-Version) and whether a worker ever answered with an older version
after that; the requests that failed; P99 while the workers swap against P99 before the first
event; the workers' GPU memory before and after."""

import statistics
import threading
import time
from collections import Counter
from pathlib import Path

from bench.loadgen import percentile
from bench.reliability.open_loop import Memory, open_loop, p99_per_second, worker_pids


def catalog_swap(
    url: str,
    management: str,
    model: str,
    bodies: list[bytes],
    capacity: float,
    archive: Path,
    store: Path,
    catalogs: list[Path],
    lead: float = 20.0,
    gap: float = 12.0,
) -> dict:
    """0.8x capacity for lead + gap x (catalogs + 1) + gap seconds: each catalog published and
    activated `gap` s after the one before (the first `lead` s in), then one rollback."""
    from archiver.build import publish
    from slm_core.catalog_store import CatalogStore

    workers = worker_pids(management, model)
    events: list[dict] = []
    seconds = lead + gap * (len(catalogs) + 2)
    started: list[float] = []

    def swaps() -> None:
        time.sleep(lead)
        for i, path in enumerate(catalogs):
            begin = time.perf_counter()
            publish(archive, path, store, f"v{i + 1}", activate=False)  # check and build: the CPU's work
            built = time.perf_counter()
            CatalogStore(store).activate(f"v{i + 1}")
            events.append({"version": f"v{i + 1}", "at": time.perf_counter() - started[0], "publish_s": built - begin})
            time.sleep(max(0.0, gap - (time.perf_counter() - begin)))
        version = CatalogStore(store).rollback()
        events.append({"version": version, "at": time.perf_counter() - started[0], "rollback": True})

    thread = threading.Thread(target=swaps, daemon=True)
    with Memory(management, model) as memory:
        records = open_loop(
            url,
            bodies,
            [(0.8 * capacity, seconds)],
            on_start=lambda: (started.append(time.perf_counter()), thread.start()),
        )
    thread.join()
    failed = [r for r in records if r.status != 200]
    baseline = [r.ms for r in records if r.status == 200 and r.sent < lead]
    offset = started[0] - memory.start  # event times count from the load's start, samples from the sampler's
    for k, event in enumerate(events):
        end = events[k + 1]["at"] if k + 1 < len(events) else seconds
        window = [r for r in records if event["at"] <= r.sent < end]
        firsts, stale = {}, 0
        for r in sorted(window, key=lambda r: r.sent + r.ms / 1e3):
            if r.catalog == event["version"]:
                firsts.setdefault(r.worker, r.sent + r.ms / 1e3)
            elif r.status == 200 and r.worker in firsts:
                stale += 1  # an older version from a worker that had served this one
        swapped = sorted(firsts.values())
        event.update(
            {
                "workers_serving_it": len(firsts),
                "every_worker_s": swapped[-1] - event["at"] if len(firsts) == len(workers) else None,
                "first_worker_s": swapped[0] - event["at"] if swapped else None,
                "stale_after_swap": stale,
                "p99_ms_first_3_s": p99([r.ms for r in window if r.status == 200 and r.sent < event["at"] + 3.0]),
                "p99_ms": p99([r.ms for r in window if r.status == 200]),
                "failed": sum(r.status != 200 for r in window),
                "memory": memory.between(event["at"] + offset, end + offset),  # until the next swap: no growth
            }
        )
    return {
        "capacity": capacity,
        "rate": 0.8 * capacity,
        "seconds": seconds,
        "workers": workers,
        "workers_after": worker_pids(management, model),
        "catalogs": [str(c) for c in catalogs],
        "requests": len(records),
        "failed": len(failed),
        "failed_statuses": dict(Counter(str(r.status) for r in failed)),
        "versions_answered": dict(Counter(r.catalog for r in records if r.status == 200)),
        "p50_ms_before": statistics.median(baseline) if baseline else None,
        "p99_ms_before": p99(baseline),
        "events": events,
        "memory_before": memory.between(0, lead),
        "memory_after": memory.between(seconds - gap, seconds + 5),
        "p99_ms_per_second": p99_per_second(records, seconds),
    }


def p99(values: list[float]) -> float | None:
    return percentile(values, 99) if values else None
