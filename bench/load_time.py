"""Where a worker's package load goes. The compiled graph's package (graph.pt2, a zip whose .so
holds the weights) is timed:
- extracted to a directory, on the disk and on /dev/shm (memory);
- dlopen'ed alone;
- loaded by AOTInductor (torch._inductor.aoti_load_package: it extracts the package into TMPDIR,
  loads the .so and copies the weights to the GPU; Inductor compiles its CPU capability checks
  into its cache directory, which follows TMPDIR unless TORCHINDUCTOR_CACHE_DIR is set), TMPDIR
  on the disk or on /dev/shm, alone and two at once (two workers starting together);
- loaded as a worker loads it (slm_core.serve.loader.load_graph: Python's zipfile extracts it,
  the runner is built from the extracted .so), alone, two and six at once.

    python -m bench.load_time --package DIR [--out FILE] [--profile FILE] [--only TEXT]
(DIR: an unpacked slm_*.mar, e.g. by bench.run; --profile: one more load under torch.profiler,
its CPU ops and CUDA runtime calls by self time into FILE, for each loader --only keeps; --only:
the steps whose name holds TEXT, e.g. load_graph)
"""

import argparse
import contextlib
import json
import multiprocessing
import os
import shutil
import tempfile
import time
import zipfile
from pathlib import Path

SHM = Path("/dev/shm")


def extract(pt2: Path, under: Path) -> float:
    """Seconds to unzip the package into a fresh directory under `under` (removed after)."""
    target = Path(tempfile.mkdtemp(dir=under))
    start = time.perf_counter()
    with zipfile.ZipFile(pt2) as z:
        z.extractall(target)
    os.sync()
    seconds = time.perf_counter() - start
    shutil.rmtree(target)
    return seconds


def _spawn(target, *args) -> tuple:
    """A fresh process running target(*args, send), and the end its result arrives on: closed on
    this side, so that the child's death ends recv() with EOFError instead of a hang."""
    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(*args, send))
    proc.start()
    send.close()
    return proc, recv


def _dlopen(so: str, out) -> None:
    """Seconds to dlopen the package's .so alone (its weights are in it), in a fresh process that
    has torch loaded already, as a worker has (the .so's undefined symbols are libtorch's)."""
    import ctypes

    import torch  # noqa: F401

    start = time.perf_counter()
    ctypes.CDLL(so, mode=os.RTLD_NOW | os.RTLD_LOCAL)
    out.send(time.perf_counter() - start)


def dlopen(pt2: Path, under: Path) -> float:
    target = Path(tempfile.mkdtemp(dir=under))
    with zipfile.ZipFile(pt2) as z:
        z.extractall(target)
    so = max(target.rglob("*.so"), key=lambda p: p.stat().st_size)
    proc, recv = _spawn(_dlopen, str(so))
    seconds = recv.recv()
    proc.join()
    shutil.rmtree(target)
    return seconds


def _load(pt2: str, under: str, cache: str | None, profiled: bool, how: str, out) -> None:
    """A package load as a worker does it (on CUDA: a single-threaded runner on cuda:0), `how`:
    "aoti" (torch._inductor.aoti_load_package) or "slm" (slm_core.serve.loader.load_graph: the
    package extracted by Python's zipfile, the runner built from the extracted .so), with TMPDIR a
    fresh directory under `under` (where the package is extracted) and Inductor's cache in `cache`
    (None: under that TMPDIR, so cold); sends its seconds and the files Inductor compiled into its
    cache meanwhile, or, `profiled`, the table of what took them under torch.profiler (CUDA
    runtime calls, allocations and copies among them), by self CPU time."""
    tmp = tempfile.mkdtemp(dir=under)
    os.environ["TMPDIR"] = tmp
    if cache is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.init()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    start = time.perf_counter()
    with profile(activities=activities) if profiled else contextlib.nullcontext() as prof:
        if how == "slm":
            from slm_core.serve.loader import load_graph

            load_graph(pt2, "cuda:0" if cuda else "cpu", run_single_threaded=cuda)
        else:
            torch._inductor.aoti_load_package(pt2, run_single_threaded=cuda, **({"device_index": 0} if cuda else {}))
        if cuda:
            torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if profiled:
        out.send((seconds, prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)))
    else:
        out.send((seconds, sum(1 for f in Path(cache or tmp).rglob("*.so"))))
    shutil.rmtree(tmp, ignore_errors=True)


def profiled(pt2: Path, under: Path, cache: Path, how: str = "aoti") -> tuple[float, str, list[dict]]:
    """A load's seconds and torch.profiler table (_load), and what the loading process did each
    second, read from /proc: its CPU seconds in user and kernel mode, bytes read (all, and from
    the disk) and RSS, which tell a load that computes from one that reads or one that waits."""
    proc, recv = _spawn(_load, str(pt2), str(under), str(cache), True, how)
    tick, timeline, start = os.sysconf("SC_CLK_TCK"), [], time.perf_counter()
    while not recv.poll(1.0):
        try:
            stat = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            io = dict(line.split(": ") for line in Path(f"/proc/{proc.pid}/io").read_text().splitlines())
            rss = int(stat[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
        timeline.append(
            {
                "s": round(time.perf_counter() - start, 1),
                "user_s": int(stat[11]) / tick,
                "sys_s": int(stat[12]) / tick,
                "read_mb": int(io["rchar"]) / 2**20,
                "disk_read_mb": int(io["read_bytes"]) / 2**20,
                "rss_mb": rss / 2**20,
            }
        )
    seconds, table = recv.recv()
    proc.join()
    return seconds, table, timeline


def loads(pt2: Path, under: Path, cache: Path | None, at_once: int, how: str = "aoti") -> list:
    """(seconds, .so files in Inductor's cache) of `at_once` loads started together, each in its
    own process, as workers are; `how` as _load's."""
    started = [_spawn(_load, str(pt2), str(under), cache and str(cache), False, how) for _ in range(at_once)]
    results = [recv.recv() for _, recv in started]
    for proc, _ in started:
        proc.join()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--package", type=Path, required=True)
    p.add_argument("--out", type=Path)
    p.add_argument("--profile", type=Path, help="one more load under torch.profiler: its table into this file")
    p.add_argument("--only", default="", help="run only the steps whose name holds this text")
    args = p.parse_args()
    pt2 = args.package / "graph.pt2"
    disk = Path(tempfile.gettempdir())
    with zipfile.ZipFile(pt2) as z:
        members = z.infolist()
    result = {
        "package_mb": pt2.stat().st_size / 2**20,
        "members": len(members),
        "stored_uncompressed": all(m.compress_type == zipfile.ZIP_STORED for m in members),
        "largest_mb": {m.filename: m.file_size / 2**20 for m in sorted(members, key=lambda m: -m.file_size)[:3]},
        "cubins": sum(m.filename.endswith(".cubin") for m in members),
        "free_gb": {str(d): shutil.disk_usage(d).free / 2**30 for d in (disk, SHM)},
    }
    cache = Path(tempfile.mkdtemp(dir=disk))  # one Inductor cache the loads share, as a server's workers do
    steps = {
        "extract_s disk": lambda: extract(pt2, disk),
        "extract_s shm": lambda: extract(pt2, SHM),
        "dlopen_s of the .so alone": lambda: dlopen(pt2, disk),
        "load disk, first (s, .so in Inductor's cache)": lambda: loads(pt2, disk, cache, 1),
        "load disk": lambda: loads(pt2, disk, cache, 1),
        "load shm": lambda: loads(pt2, SHM, cache, 1),
        "load disk, two at once": lambda: loads(pt2, disk, cache, 2),
        "load_graph disk": lambda: loads(pt2, disk, cache, 1, "slm"),
        "load_graph disk, two at once": lambda: loads(pt2, disk, cache, 2, "slm"),
        "load_graph disk, six at once": lambda: loads(pt2, disk, cache, 6, "slm"),
    }
    for name, step in steps.items():
        if args.only not in name:
            continue
        try:
            result[name] = step()
        except Exception as e:  # a full /dev/shm, say: recorded, the other steps still run
            result[name] = f"failed: {e!r}"
        print(name, result[name], flush=True)
    if args.profile:
        tables = []
        for label, how in (("load", "aoti"), ("load_graph", "slm")):
            if args.only not in label + " disk, profiled":
                continue
            try:
                seconds, table, timeline = profiled(pt2, disk, cache, how)
            except Exception as e:
                result[f"{label} disk, profiled (s)"] = f"failed: {e!r}"
                continue
            result[f"{label} disk, profiled (s)"] = seconds
            result[f"{label} disk, profiled: the process each second"] = timeline
            tables.append(f"{label} under torch.profiler: {seconds:.2f} s\n\n{table}\n")
        args.profile.write_text("\n\n".join(tables))
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
