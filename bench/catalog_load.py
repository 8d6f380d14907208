"""What a catalog swap costs a worker's calls on the host: a worker following a catalog store loads
the new version in a thread beside its calls (slm_core.serve.catalog_watch), so every stretch of
that load that holds the GIL is a stretch in which no call starts or finishes.

W4's task (its tokenizer: bench/assets/tokenizer.json, from python -m bench.assets) over a
synthetic catalog (bench.workloads.catalog_items, 1M items by default) is built once; then,
`--repeat` times, the swap's host work is timed while a thread that wakes every 1 ms records how
late it wakes: Task.with_data (the trie file read and checked, as a worker does) and
Task.graph_constants (the graph's catalog inputs, padded to a following worker's buffers).

    python -m bench.catalog_load [--items N] [--repeat K] [--work DIR] [--out FILE]
"""

import argparse
import json
import threading
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from bench.assets import ASSETS
from bench.workloads import RETRIEVE_TASK, catalog_items
from slm_core.serve.catalog_watch import HEADROOM
from slm_core.spec import TaskSpec
from slm_core.tasks import task_for


class Ticker:
    """A thread that sleeps 1 ms at a time and records how long each sleep really took."""

    def __init__(self):
        self.gaps: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            self.gaps.append(now - last)
            last = now

    def __enter__(self) -> "Ticker":
        self._thread.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def timed(self, fn) -> tuple[object, dict]:
        """fn()'s result, and its ms beside the longest wake-up delay and the ms of delays over 5 ms."""
        self.gaps.clear()
        start = time.perf_counter()
        result = fn()
        took = time.perf_counter() - start
        gaps = np.array(self.gaps or [0.0]) * 1e3
        return result, {
            "ms": round(took * 1e3, 1),
            "longest_stall_ms": round(float(gaps.max()), 1),
            "stalled_ms": round(float(gaps[gaps > 5].sum()), 1),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path(".bench-work"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    source = catalog_items(args.work / f"catalog-{args.items}-0.jsonl", count=args.items)
    start = time.perf_counter()
    task = task_for(
        TaskSpec.from_dict({**RETRIEVE_TASK, "catalog": str(source)}),
        Tokenizer.from_file(str(ASSETS / "tokenizer.json")),
        "cuda",
    )
    built_s = time.perf_counter() - start
    trie = args.work / f"catalog-{args.items}-0.safetensors"
    task.catalog.save(trie)
    sizes = task.constant_capacity(HEADROOM)
    rows = []
    with Ticker() as ticker:
        for k in range(args.repeat):
            swapped, load = ticker.timed(lambda: task.with_data(trie, f"v{k}"))
            _, constants = ticker.timed(lambda: swapped.graph_constants(sizes))
            rows.append({"with_data": load, "graph_constants": constants})
            print(f"swap {k}: with_data {load}, graph_constants {constants}", flush=True)
    result = {"items": task.catalog.size, "task_built_s": round(built_s, 1), "swaps": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
