"""The linears of W1 (prefill, ~1,700 rows a request) and of W2/W3's beam decode steps (100 rows a
prompt) on the GPU, one kernel per option: what the graphs run now (cuBLAS via `F.linear`, bf16),
FP8 E4M3 through `torch._scaled_mm`, with one scale per tensor and with per-row/per-column scales;
bf16 through cuBLASLt (`torch.backends.cuda.preferred_blas_library`), whose heuristics may pick other kernels
than cuBLAS's (its split-K reduced inside the kernel); bf16 with the weight stored [in, out]. FP8
times the GEMM alone: its activation quantisation would be fused into the kernel before it. Each
figure is the GPU time of one call replayed from a CUDA graph (bench.kernels_bench.graph_ms), with
its TFLOP/s and the weight bytes it reads per µs. The calls take LAYERS weights in turn, as a
graph's layers do, so that the decode shapes' weights (2-17 MB each) come from HBM, not from the
H200's L2.

    python -m bench.gemm_bench --out FILE.json
"""

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from bench.kernels_bench import blas, graph_ms

E4M3 = torch.float8_e4m3fn
# (name, in, out) of each model's linears (bench/workloads.py's architectures)
QWEN3_06B = [("qkv", 1024, 4096), ("o", 2048, 1024), ("gate_up", 1024, 6144), ("down", 3072, 1024)]
QWEN25_05B = [("qkv", 896, 1152), ("o", 896, 896), ("gate_up", 896, 9728), ("down", 4864, 896)]
CASES = (
    [("W1", m, *lin) for m in (1700, 3400) for lin in QWEN3_06B]
    + [("W2/W3 decode", m, *lin) for m in (100, 200, 400, 800) for lin in QWEN25_05B]
    + [("W2/W3 decode", m, "lm_head", 896, 151936) for m in (100, 200)]
)


LAYERS = 24  # weights per case, taken in turn (W2's layers)
CUBLASLT = "bf16 F.linear through cuBLASLt"


def options(x: torch.Tensor, ws: list[torch.Tensor]) -> dict:
    """Each option: a function that multiplies x by the next of ws (each weight [out, in])."""
    n = itertools.count()

    def each(weights):
        return lambda: weights[next(n) % len(weights)]

    w = each(ws)
    wt = each([w.t().contiguous() for w in ws])
    wq = each([w.to(E4M3) for w in ws])  # random data in N(0, 1) fits E4M3 without scaling
    xq = x.to(E4M3)
    one = torch.ones((), device=x.device)
    rows, cols = torch.ones(x.shape[0], 1, device=x.device), torch.ones(1, ws[0].shape[0], device=x.device)
    out = {
        "bf16 F.linear (cuBLAS, as the graphs)": lambda: F.linear(x, w()),
        CUBLASLT: lambda: F.linear(x, w()),
        "bf16 mm, weight stored [in, out]": lambda: torch.mm(x, wt()),
        "fp8 _scaled_mm, per-tensor scales": lambda: torch._scaled_mm(xq, wq().t(), one, one, out_dtype=torch.bfloat16),
        "fp8 _scaled_mm, row/column scales": lambda: torch._scaled_mm(
            xq, wq().t(), rows, cols, out_dtype=torch.bfloat16
        ),
    }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": []}
    for workload, m, name, k, n in CASES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        layers = 2 if n * k * 2 > 2**27 else LAYERS  # a weight past 128 MB comes from HBM anyway (the LM head)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(layers)]
        case = {"workload": workload, "rows": m, "linear": name, "in": k, "out": n, "results": {}}
        for label, fn in options(x, ws).items():
            try:
                with blas("cublaslt" if label == CUBLASLT else "cublas"):
                    ms = graph_ms(fn, calls=layers)
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
