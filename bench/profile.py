"""Where one request's time goes, in process (no TorchServe): JSON parse, tokenize + pack, the
compiled graph (GPU kernels by torch.profiler), result decode + JSON encode.

    python -m bench.profile --package DIR --workload W1 --tokenizer bench/assets/tokenizer.json --out FILE
(DIR: an unpacked slm_*.mar, e.g. by bench.run)
"""

import argparse
import json
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from bench.workloads import WORKLOADS, TextMaker
from slm_core.package import load_package
from slm_core.protocol import respond


def timed(fn, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) * 1e3 / repeat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--package", type=Path, required=True)
    p.add_argument("--workload", default="W1")
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args()

    engine = load_package(args.package, gpu_id=0 if torch.cuda.is_available() else None)
    workload = WORKLOADS[args.workload]
    body = TextMaker(Tokenizer.from_file(str(args.tokenizer)), seed=2).requests(workload, 1)[0]
    raw = json.dumps(body).encode()
    request = {"body": raw}
    for _ in range(3):
        respond(engine, request)  # warm up

    tok = engine.tokenizer
    if workload.texts:
        pack = lambda: tok.pack_texts(body["texts"], engine._ids.numpy(), engine._cu.numpy())  # noqa: E731
    else:
        pack = lambda: tok.pack_prompt(body["prompt"], engine._ids.numpy())  # noqa: E731
    parts = {
        "json_parse_ms": timed(lambda: json.loads(raw), args.repeat),
        "tokenize_pack_ms": timed(pack, args.repeat),
        "end_to_end_in_process_ms": timed(lambda: respond(engine, request), args.repeat),
    }
    graph_ms = [respond(engine, request).stats.graph_ms for _ in range(args.repeat)]
    parts["graph_ms (copy-in + graph + copy-out)"] = sum(graph_ms) / len(graph_ms)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.repeat):
            respond(engine, request)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    kernels = prof.key_averages().table(sort_by=sort, row_limit=25)
    args.out.write_text(f"{args.workload} request, {args.repeat} repeats, {engine.device}\n"
                        + json.dumps(parts, indent=2) + "\n\n" + kernels + "\n")
    print(json.dumps(parts, indent=2))


if __name__ == "__main__":
    main()
