"""The linears of W1 (prefill, ~1,700 rows a request) and of W2/W3's beam decode steps (100 rows a
prompt) on the GPU, one kernel per option: what the graphs run now (cuBLAS via `F.linear`, bf16),
Inductor's max-autotune choice (its Triton templates against cuBLAS) and FP8 E4M3 through
`torch._scaled_mm`, with one scale per tensor and with per-row/per-column scales. FP8 times the GEMM alone:
its activation quantisation would be fused into the kernel before it. Each figure is the GPU time
of one call replayed from a CUDA graph (bench.kernels_bench.graph_ms), with its TFLOP/s and the
weight bytes it reads per µs. The replays reuse one weight, which for the decode shapes (2-17 MB)
stays in the H200's 50 MB L2: those figures are optimistic against a graph, whose every layer
reads its own weights from HBM (the W2 profile's decode GEMMs: 25.8 µs a layer and step, against
23.1 here).

    python -m bench.gemm_bench --out FILE.json
"""

import argparse
import json

import torch
import torch.nn.functional as F

from bench.kernels_bench import graph_ms

E4M3 = torch.float8_e4m3fn
# (name, in, out) of each model's linears (bench/workloads.py's architectures)
QWEN3_06B = [("qkv", 1024, 4096), ("o", 2048, 1024), ("gate_up", 1024, 6144), ("down", 3072, 1024)]
QWEN25_05B = [("qkv", 896, 1152), ("o", 896, 896), ("gate_up", 896, 9728), ("down", 4864, 896)]
CASES = (
    [("W1", m, *lin) for m in (1700, 3400) for lin in QWEN3_06B]
    + [("W2/W3 decode", m, *lin) for m in (100, 200, 400) for lin in QWEN25_05B]
    + [("W2/W3 decode", m, "lm_head", 896, 151936) for m in (100, 200)]
)
AUTOTUNED = {
    ("W1", 1700, "o"),
    ("W1", 1700, "down"),
    ("W1", 1700, "gate_up"),
    ("W1", 1700, "qkv"),
    ("W2/W3 decode", 200, "gate_up"),
    ("W2/W3 decode", 200, "down"),
}


def options(x: torch.Tensor, w: torch.Tensor, autotune: bool) -> dict:
    xq, wq = x.to(E4M3), w.to(E4M3)  # random data in N(0, 1) fits E4M3 without scaling
    one = torch.ones((), device=x.device)
    rows, cols = torch.ones(x.shape[0], 1, device=x.device), torch.ones(1, w.shape[0], device=x.device)
    out = {
        "bf16 F.linear (cuBLAS, as the graphs)": lambda: F.linear(x, w),
        "fp8 _scaled_mm, per-tensor scales": lambda: torch._scaled_mm(xq, wq.t(), one, one, out_dtype=torch.bfloat16),
        "fp8 _scaled_mm, row/column scales": lambda: torch._scaled_mm(xq, wq.t(), rows, cols, out_dtype=torch.bfloat16),
    }
    if autotune:
        compiled = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
        out["bf16 Inductor max-autotune (Triton templates or cuBLAS)"] = lambda: compiled(x, w)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": []}
    for workload, m, name, k, n in CASES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        case = {"workload": workload, "rows": m, "linear": name, "in": k, "out": n, "results": {}}
        for label, fn in options(x, w, (workload, m, name) in AUTOTUNED).items():
            try:
                ms = graph_ms(fn)
                case["results"][label] = {
                    "gpu_us": ms * 1e3,
                    "tflops": 2 * m * k * n / ms / 1e9,
                    "weight_GB_per_s": n * k * (1 if "fp8" in label else 2) / ms / 1e6,
                }
            except Exception as e:  # an option this torch or GPU lacks is reported, not fatal
                case["results"][label] = {"error": f"{type(e).__name__}: {e}"[:300]}
        results["cases"].append(case)
        print(f"\n{workload} {name} [{m} x {k}] -> {n}")
        for label, r in case["results"].items():
            print(
                f"  {label:58s} "
                + (
                    f"{r['gpu_us']:8.1f} us {r['tflops']:6.0f} TFLOP/s {r['weight_GB_per_s']:6.0f} GB/s"
                    if "gpu_us" in r
                    else r["error"]
                ),
                flush=True,
            )
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
