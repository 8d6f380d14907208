"""Where one request's time goes, in process (no TorchServe): JSON parse, tokenize + pack, the
compiled graph (GPU kernels by torch.profiler), result decode + JSON encode.

    python -m bench.profile --package DIR --workload W1 --tokenizer bench/assets/tokenizer.json --out FILE
(DIR: an unpacked slm_*.mar, e.g. by bench.run). Several workloads share one package load (tens of
seconds on the H200): --workload W2,W3 --out 'profile_{workload}.txt'.
"""

import argparse
import json
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from bench.workloads import WORKLOADS, TextMaker
from slm_core import manifest
from slm_core.compile.checks import time_calls
from slm_core.serve.loader import load_package
from slm_core.serve.protocol import Request, respond_batch


def timed(fn, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) * 1e3 / repeat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--package", type=Path, required=True)
    p.add_argument("--workload", default="W1", help="one or several, comma-separated")
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--out", required=True, help="a file; {workload} in it is replaced by each workload's name")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--batch", type=int, default=1, help="requests per handler call (score: the archive's max_batch)")
    p.add_argument("--cuda-graphs", choices=["on", "off"], default="on")
    args = p.parse_args()

    engine = load_package(
        args.package, gpu_id=0 if torch.cuda.is_available() else None, cuda_graphs=args.cuda_graphs == "on"
    )
    for name in args.workload.split(","):
        out = Path(args.out.format(workload=name))
        print(name, json.dumps(profile(engine, name, args, out), indent=2))


def profile(engine, name: str, args, out: Path) -> dict:
    workload = WORKLOADS[name]
    bodies = TextMaker(Tokenizer.from_file(str(args.tokenizer)), seed=2).requests(workload, args.batch)
    body = bodies[0]
    raw = json.dumps(body).encode()
    batch = [Request({"body": json.dumps(b).encode()}) for b in bodies]  # as TorchServe hands a batch over
    for _ in range(3):
        respond_batch(engine, batch)  # warm up

    value = engine.task.request(body)
    parts = {
        "json_parse_ms": timed(lambda: json.loads(raw), args.repeat),
        "tokenize_pack_ms": timed(
            lambda: engine._pack(engine.task.encode([value]), [engine.task.options(value)]), args.repeat
        ),
        "end_to_end_in_process_ms (the whole batch)": timed(lambda: respond_batch(engine, batch), args.repeat),
    }
    graph_ms = [respond_batch(engine, batch)[0].stats.graph_ms for _ in range(args.repeat)]
    parts["graph_ms (copy-in + graph + copy-out)"] = sum(graph_ms) / len(graph_ms)
    # the build's timing of calls at the token bounds, here with the GPU to itself: what the
    # archive's admission would plan with on a quiet GPU, against the manifest's call_ms
    parts["calls_at_the_bounds_ms (per requests in the call)"] = time_calls(engine)
    parts["build_call_ms (the manifest's)"] = manifest.read(args.package).get("call_ms")

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.repeat):
            respond_batch(engine, batch)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    averages = prof.key_averages()
    if torch.cuda.is_available():
        # GPU busy time per call against the graph call's wall time: what is left is launch
        # overhead and other host work the GPU waits on.
        on_gpu = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]  # kernels, copies
        busy = sum(e.self_device_time_total for e in on_gpu) / 1e3 / args.repeat
        kernels_launched = sum(e.count for e in on_gpu)
        parts["gpu_kernel_ms_per_call"] = busy
        parts["gpu_kernels_per_call"] = kernels_launched / args.repeat
        parts["gpu_busy_share_of_graph_call"] = busy / parts["graph_ms (copy-in + graph + copy-out)"]
    kernels = averages.table(sort_by=sort, row_limit=25)
    if torch.cuda.is_available():
        # every kernel and copy, per call: a lever's before and after line up name by name
        rows = sorted(
            ((e.self_device_time_total / args.repeat, e.count / args.repeat, e.key) for e in on_gpu), reverse=True
        )
        kernels += "\n\nEvery kernel per call: us, launches, name\n" + "\n".join(
            f"{us:10.1f} {count:7.1f}  {name}" for us, count, name in rows
        )
    out.write_text(
        f"{name}, {args.batch} request(s) per call, {args.repeat} repeats, {engine.device}, "
        f"CUDA graphs {args.cuda_graphs}\n" + json.dumps(parts, indent=2) + "\n\n" + kernels + "\n"
    )
    return parts


if __name__ == "__main__":
    main()
