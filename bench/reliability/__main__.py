"""The command line of bench.reliability (the package's docstring says what each step does)."""

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

from bench import reliability
from bench.reliability.catalog_swap import catalog_swap
from bench.reliability.faults import FAULTS, fault
from bench.reliability.fuzz import Tolerance, bad_requests, run, valid_requests
from bench.reliability.overload import overload
from bench.reliability.soak import soak
from bench.reliability.start_up import ready, scale_up
from handlers.local_server import TorchServe


def measured_capacity(url: str, bodies: list[bytes]) -> float:
    from bench.loadgen import sweep

    points = sweep(url, bodies, [1, 2, 3, 4, 6, 8], warmup=1.0, duration=3.0)
    return max((p.qps for p in points if p.meets_slo()), default=0.0)


def main() -> None:
    p = argparse.ArgumentParser(description=reliability.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "steps",
        help="fuzz, overload, soak, kill, gpu-fault, catalog-swap, ready or scale-up; several comma-separated run "
        "one after the other",
    )
    p.add_argument("--url", help="the model's predictions URL (a running TorchServe)")
    p.add_argument("--management", help="TorchServe's management address")
    p.add_argument("--model")
    p.add_argument("--archive", type=Path, help="instead of --url: serve this .mar on a private TorchServe")
    p.add_argument("--workers", type=int, help="with --archive: its workers (default: its model-config's)")
    p.add_argument("--workload", choices=["W1", "W2", "W3", "W4"], help="overload/soak: that workload's requests")
    p.add_argument("--tokenizer", type=Path, help="with --workload: the tokenizer its texts are made for")
    p.add_argument("--logs", type=Path, help="with --archive: copy the private TorchServe's logs here at the end")
    p.add_argument("--task", choices=["score", "beam"], required=True)
    p.add_argument("--max-items", type=int, default=16, help="the task's max_texts (score)")
    p.add_argument("--max-tokens", type=int, default=160, help="the task's max_text_tokens / max_prompt_tokens")
    p.add_argument("--bad", type=int, default=1000)
    p.add_argument("--valid", type=int, default=200)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--capacity", type=float, help="req/s at the SLO (default: measured first)")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument(
        "--deadline-ms",
        type=float,
        help="overload: every request carries this deadline (X-Slm-Deadline-Ms, "
        "its send time as X-Request-Start); the result counts refusals by reason and answers after it",
    )
    p.add_argument("--fault-seconds", type=float, default=60.0, help="kill, gpu-fault, scale-up: the load's seconds")
    p.add_argument(
        "--catalogs",
        help="catalog-swap: JSONL catalogs, comma-separated, published in turn into --store (then a rollback)",
    )
    p.add_argument("--ready-counts", default="1,6", help="ready: the workers started together, each count in turn")
    p.add_argument("--store", type=Path, help="catalog-swap: the catalog store the --archive's workers follow")
    p.add_argument("--out", type=Path, help="also write the JSON result here")
    args = p.parse_args()
    steps = args.steps.split(",")
    # what each fault step does to the workers under load (scale-up: doubles them)
    faults = {**FAULTS, "scale-up": lambda before: scale_up(args.management, args.model, before)}
    known = ["fuzz", "overload", "soak", "catalog-swap", "ready", *faults]
    if not steps or not set(steps) <= set(known):
        p.error(f"steps {args.steps!r}: each one of {', '.join(known)}")
    if "catalog-swap" in steps and not (args.archive and args.store and args.catalogs):
        p.error("catalog-swap needs --archive (following the store), --store and --catalogs")
    if args.workload and not args.tokenizer:
        p.error("--workload needs --tokenizer")
    server, results, tolerance = None, {}, Tolerance()
    if args.archive:  # the deployment the archive's serving spec makes, and its precision
        from archiver.build import read_manifest, read_serving  # imports torch: only with --archive

        serving, manifest = read_serving(args.archive), read_manifest(args.archive)
        precision = manifest["task"]["precision"]
        args.workers = args.workers or serving.workers
        results["served"] = {
            "workers": args.workers,
            "batchSize": serving.batch,
            "queue": serving.queue,
            "precision": precision,
        }
        tolerance = Tolerance.of_precision(precision)
        server = TorchServe(Path(tempfile.mkdtemp(prefix="reliability-")), args.archive.parent).start()
        args.model = args.archive.stem
        args.url, args.management = f"{server.inference}/predictions/{args.model}", server.management
    try:
        if server:
            server.register(args.archive.name, args.workers, name=args.model)
        rng = random.Random(1)
        valid = valid_requests(args.task, args.max_items, rng, args.valid)
        bodies = [v.body for v in valid]
        if args.workload:
            from tokenizers import Tokenizer

            from bench.workloads import WORKLOADS, TextMaker

            maker = TextMaker(Tokenizer.from_file(str(args.tokenizer)), seed=2)
            bodies = [json.dumps(b).encode() for b in maker.requests(WORKLOADS[args.workload], args.valid)]
        capacity = args.capacity
        for name in steps:
            print(f"[reliability {time.strftime('%H:%M:%S')}] {name}", flush=True)
            if name == "fuzz":
                results[name] = run(
                    args.url,
                    args.management,
                    args.model,
                    bad_requests(args.task, args.max_items, args.max_tokens, rng, args.bad),
                    valid,
                    args.threads,
                    tolerance=tolerance,
                )
                continue
            if name == "ready":
                results[name] = ready(args.management, args.model, [int(c) for c in args.ready_counts.split(",")])
                continue
            capacity = capacity or measured_capacity(args.url, bodies)
            if not capacity:
                raise SystemExit("no concurrency met the SLO (mean < 20 ms, P99 < 80 ms): pass --capacity R")
            if name == "overload":
                results[name] = overload(
                    args.url, args.management, args.model, bodies, capacity, args.seconds, deadline_ms=args.deadline_ms
                )
            elif name == "catalog-swap":
                results[name] = catalog_swap(
                    args.url,
                    args.management,
                    args.model,
                    bodies,
                    capacity,
                    args.archive,
                    args.store,
                    [Path(c) for c in args.catalogs.split(",")],
                )
            elif name in faults:
                results[name] = fault(
                    args.url, args.management, args.model, bodies, capacity, faults[name], args.fault_seconds
                )
            else:

                def partial(report: dict, name=name) -> None:  # a run cut short keeps the minutes it finished
                    if args.out:
                        args.out.write_text(json.dumps({**results, name: report}, indent=1, ensure_ascii=False) + "\n")

                results[name] = soak(
                    args.url, args.management, args.model, bodies, capacity, args.seconds, on_window=partial
                )
            if args.out:  # after every step: a run cut short keeps the steps it finished
                args.out.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    finally:
        if server:
            server.stop()
            if args.logs:  # what the workers said (a worker that died, a 503's reason)
                shutil.copytree(server.workdir / "logs", args.logs, dirs_exist_ok=True)
    result = results[steps[0]] if len(results) == 1 else results
    text = json.dumps(result, indent=1, ensure_ascii=False)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
