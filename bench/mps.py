"""GPU work of P processes at once: does a second worker process overlap the first on the GPU?

Two TorchServe workers are two processes, two CUDA contexts. Without NVIDIA's Multi-Process Service
(MPS) the GPU time-slices between contexts, so two workers' kernels never run side by side; under
MPS they share the GPU like two streams of one process. Each process here replays one CUDA graph of
a beam decode step's layers (W2/W3's model: hidden 896, MLP 4864, 24 layers, ROWS rows, weights of
its own, read from HBM) back to back for --seconds, started together; the figure is decode steps
per second of all processes together (and the GPU time a layer-step takes at that rate), against
one process alone.

    python -m bench.mps --procs 1,2 --out FILE.json        # run it once without, once under MPS
"""

import argparse
import json
import multiprocessing as mp
import time

import torch
import torch.nn.functional as F

HIDDEN, MLP, QKV, LAYERS = 896, 4864, 1152, 24


def decode_graph(rows: int) -> torch.cuda.CUDAGraph:
    torch.manual_seed(0)
    w = [
        [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            for n, k in ((QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * MLP, HIDDEN), (HIDDEN, MLP))
        ]
        for _ in range(LAYERS)
    ]
    x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        h = x
        for qkv, o, gate_up, down in w:
            a = F.linear(F.linear(h, qkv)[:, :HIDDEN], o)
            g, u = F.linear(F.rms_norm(h + a, (HIDDEN,)), gate_up).chunk(2, dim=1)
            h = h + F.linear(F.silu(g) * u, down)
        return h

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        step()  # warm cuBLAS
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def worker(rows: int, seconds: float, ready, go, out) -> None:
    graph = decode_graph(rows)
    ready.wait()
    go.wait()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
        n += 10
    out.put((n, time.perf_counter() - start))


def measure(procs: int, rows: int, seconds: float) -> dict:
    ctx = mp.get_context("spawn")
    ready, go, out = ctx.Barrier(procs + 1), ctx.Barrier(procs + 1), ctx.Queue()
    ps = [ctx.Process(target=worker, args=(rows, seconds, ready, go, out)) for _ in range(procs)]
    for p in ps:
        p.start()
    ready.wait()
    go.wait()
    results = [out.get(timeout=seconds + 120) for _ in ps]
    for p in ps:
        p.join()
    steps_per_s = sum(n / t for n, t in results)
    return {
        "procs": procs,
        "rows": rows,
        "steps_per_s": steps_per_s,
        "layer_step_us": 1e6 / (steps_per_s * LAYERS) if steps_per_s else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", default="1,2")
    ap.add_argument("--rows", default="100,250")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--label", default="")
    ap.add_argument("--out")
    a = ap.parse_args()
    found = []
    for rows in map(int, a.rows.split(",")):
        for procs in map(int, a.procs.split(",")):
            r = measure(procs, rows, a.seconds) | {"label": a.label}
            found.append(r)
            print(
                f"{a.label:8} rows {rows:4}  {procs} process(es): {r['steps_per_s']:8.1f} decode steps/s, "
                f"{r['layer_step_us']:6.2f} us a layer-step",
                flush=True,
            )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()
