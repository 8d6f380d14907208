"""Graph calls at once in one process (no TorchServe): T threads, each calling the engine with a
batch of B requests of a workload, on an engine with C request contexts (CUDA streams, own CUDA
graphs). What one worker in async mode can get from overlapping calls on the GPU, against one call
at a time (T = 1), which is what a sync worker gets (two sync workers time-slice the GPU instead).

    python -m bench.contexts --package DIR --workload W2 --tokenizer bench/assets/tokenizer.json --out FILE.json
(DIR: an unpacked slm_*.mar, e.g. by bench.run)
"""

import argparse
import dataclasses
import faulthandler
import json
import signal
import statistics
import threading
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from bench.workloads import WORKLOADS, TextMaker
from slm_core.package import load_package
from slm_core.protocol import respond_batch


def run(engine, batches: list[list[dict]], threads: int, seconds: float, reference: list | None = None) -> dict:
    """`threads` threads calling respond_batch back to back for `seconds` (at least one call each):
    requests/s, mean call ms, and how many answers differ from `reference` (each batch's answers,
    one call at a time): calls at once must not touch each other's buffers."""
    calls: list[list[float]] = [[] for _ in range(threads)]
    differ = [0] * threads
    begin = time.perf_counter()
    end = begin + seconds

    def loop(i: int) -> None:
        k = i
        while time.perf_counter() < end or not calls[i]:  # at least one call each
            start = time.perf_counter()
            replies = respond_batch(engine, batches[k % len(batches)])
            calls[i].append((time.perf_counter() - start) * 1e3)
            assert all(r.status == 200 for r in replies), replies[0].body[:200]
            if reference is not None:
                differ[i] += sum(r.body != want for r, want in zip(replies, reference[k % len(batches)]))
            k += threads

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - begin
    done = [ms for c in calls for ms in c]
    return {"threads": threads, "calls": len(done), "requests_per_s": len(done) * len(batches[0]) / elapsed,
            "call_ms_mean": statistics.fmean(done), "call_ms_p50": statistics.median(done),
            "answers_unlike_one_at_a_time": sum(differ)}


def seal(engine, sealed: bool) -> None:
    for ctx in engine.contexts:
        if ctx.replay is not None:
            ctx.replay.sealed = sealed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--package", type=Path, required=True)
    p.add_argument("--workload", default="W2")
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--contexts", type=int, default=4, help="request contexts of the engine (most threads measured)")
    p.add_argument("--batches", default="1,2", help="requests per call")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--lengths", help="LO,HI tokens per text or prompt instead of the workload's (small test packages)")
    args = p.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where each thread is, should a call never return
    workload = WORKLOADS[args.workload]
    if args.lengths:
        workload = dataclasses.replace(workload, lengths=tuple(int(n) for n in args.lengths.split(",")))

    engine = load_package(args.package, gpu_id=0 if torch.cuda.is_available() else None, contexts=args.contexts)
    maker = TextMaker(Tokenizer.from_file(str(args.tokenizer)), seed=3)
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        bodies = maker.requests(workload, 8 * batch)
        batches = [[{"body": json.dumps(b).encode()} for b in bodies[i : i + batch]] for i in range(0, len(bodies), batch)]
        seal(engine, False)  # open again for this batch size's sizes
        for _ in engine.each_context():  # one context at a time captures the sizes these calls use
            for b in batches:
                respond_batch(engine, b)
        seal(engine, True)  # a capture must not overlap another context's call
        reference = [[r.body for r in respond_batch(engine, b)] for b in batches]
        for threads in range(1, args.contexts + 1):
            r = {"workload": args.workload, "batch": batch, "contexts": args.contexts,
                 **run(engine, batches, threads, args.seconds, reference)}
            results.append(r)
            print(json.dumps(r), flush=True)
    graphs = [len(c.replay.graphs) if c.replay is not None else 0 for c in engine.contexts]
    args.out.write_text(json.dumps({"device": str(engine.device), "graphs_per_context": graphs,
                                    "points": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
