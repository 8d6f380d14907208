"""RESULTS.md tables and latency-vs-QPS plots from bench/results/*.jsonl.

python -m bench.report bench/results/<run>.jsonl [--png-dir bench/results]
"""

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

SLO = "mean < 20 ms and P99 < 80 ms"


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def meets(r: dict) -> bool:
    return r["completed"] > 0 and r["errors"] == 0 and r["mean_ms"] < 20 and r["p99_ms"] < 80


def capacity(records: list[dict]) -> dict | None:
    """The highest-QPS point that meets the SLO, or None."""
    ok = [r for r in records if meets(r)]
    return max(ok, key=lambda r: r["qps"]) if ok else None


def fmt(x: float, digits: int = 1) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def label(r: dict) -> str:
    """ "slm (triton)", "slm (triton, ×2 workers, batch 8)", "hf" (its worker counts share one row:
    the best is its capacity), "noop". The kernels are the archive's (older records: "attention")."""
    kernels = r.get("kernels") or r.get("attention")
    if r["system"] != "slm" or not kernels:
        return r["system"]
    extra = (
        ([f"×{r['workers']} workers"] if r["workers"] > 1 else [])
        + ([f"{r['gpus']} GPUs"] if r.get("gpus", 1) > 1 else [])
        + ([f"batch {r['batch']}"] if r.get("batch", 1) > 1 else [])
        + (["no CUDA graphs"] if r.get("cuda_graphs") is False and r.get("device") != "cpu" else [])
        + (["FP8 qkv + MLP, static scales"] if r.get("precision") == "fp8-static" else [])
        + (["fails the FP8 accuracy gate"] if r.get("fp8_gate_passes") is False else [])
        + ([f"accuracy guard on {r['accuracy_guard']:.1%} of requests"] if r.get("accuracy_guard") else [])
    )
    return f"slm ({', '.join([kernels, *extra])})"


def table(records: list[dict]) -> str:
    by = defaultdict(list)
    for r in records:
        if r["system"] != "noop":
            by[(r["workload"], label(r))].append(r)
    lines = [
        f"Capacity = highest completed QPS with {SLO}, closed loop, concurrency swept.",
        "",
        "| workload | system | capacity (req/s) | at concurrency | mean / P99 (ms) | effective MFU | "
        "best QPS at any latency | ratio to hf |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for workload in sorted({w for w, _ in by}):
        caps = {s: capacity(by[(workload, s)]) for s in sorted(s for w, s in by if w == workload)}
        for system, cap in caps.items():
            best = max(by[(workload, system)], key=lambda r: r["qps"])
            ratio = ""
            if system.startswith("slm") and caps.get("hf") and cap:
                ratio = f"{cap['qps'] / caps['hf']['qps']:.1f}×"
            elif system.startswith("slm") and cap and "hf" in caps:
                ratio = "hf meets no point"
            cap_workers = f" ×{cap['workers']} workers" if cap and cap["workers"] > 1 else ""
            best_workers = f", ×{best['workers']} workers" if best["workers"] > 1 else ""
            lines.append(
                f"| {workload} | {system} | {fmt(cap['qps']) if cap else 'none'} | "
                f"{cap['concurrency'] if cap else '–'}{cap_workers} | "
                f"{fmt(cap['mean_ms']) + ' / ' + fmt(cap['p99_ms']) if cap else '–'} | "
                f"{fmt(100 * cap['mfu_effective'], 2) + ' %' if cap else '–'} | "
                f"{fmt(best['qps'])} (c={best['concurrency']}{best_workers}, "
                f"mean {fmt(best['mean_ms'])} ms, MFU {fmt(100 * best['mfu_effective'], 2)} %) | {ratio} |"
            )
    split = [
        (w, s, cap)
        for (w, s), rs in sorted(by.items())
        if (cap := capacity(rs) or max(rs, key=lambda r: r["qps"])) and "ts_frontend_ms" in cap
    ]
    if split:  # TorchServe's own counters over the same point (bench.run.frontend_means), the handler's headers
        lines += [
            "",
            "Per request at the capacity point (else the best point): client latency split by "
            "TorchServe's counters and the handler's X-Slm-* headers (handler: parse, tokenize, graph "
            "call, encode of the request's whole batch; graph call: copy in, GPU, copy out).",
            "",
            "| workload | system | at | client mean (ms) | in TorchServe | of which queued | handler | "
            "of which graph call | requests per call | IPC + batching wait | HTTP + client |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for w, s, r in split:
            handler = r.get("handler_ms", float("nan"))
            lines.append(
                f"| {w} | {s} | c={r['concurrency']} | {fmt(r['mean_ms'])} | {fmt(r['ts_frontend_ms'])} | "
                f"{fmt(r['ts_queue_ms'])} | {fmt(handler)} | "
                f"{fmt(r.get('graph_ms', float('nan')))} | {fmt(r.get('call_batch', float('nan')))} | "
                f"{fmt(r['ts_frontend_ms'] - r['ts_queue_ms'] - handler)} | "
                f"{fmt(r['mean_ms'] - r['ts_frontend_ms'])} |"
            )
    noop = [r for r in records if r["system"] == "noop"]
    if noop:
        top = max(noop, key=lambda r: r["qps"])
        lines += [
            "",
            f"Load generator + TorchServe ceiling (no-op handler, same run): {fmt(top['qps'])} req/s at "
            f"concurrency {top['concurrency']} (mean {fmt(top['mean_ms'])} ms).",
        ]
    return "\n".join(lines)


def plot(records: list[dict], out_dir: Path, stem: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for workload in sorted({r["workload"] for r in records if r["system"] != "noop"}):
        fig, ax = plt.subplots(figsize=(6, 4))
        for system in sorted({label(r) for r in records if r["system"] != "noop"}):
            for workers in sorted({r["workers"] for r in records if label(r) == system}):
                pts = sorted(
                    (
                        r
                        for r in records
                        if r["workload"] == workload
                        and label(r) == system
                        and r["workers"] == workers
                        and r["completed"]
                    ),
                    key=lambda r: r["concurrency"],
                )
                if not pts:
                    continue
                name = system + (f" ×{workers}" if system == "hf" else "")
                (line,) = ax.plot([r["qps"] for r in pts], [r["mean_ms"] for r in pts], "o-", label=f"{name} mean")
                ax.plot(
                    [r["qps"] for r in pts],
                    [r["p99_ms"] for r in pts],
                    "x--",
                    color=line.get_color(),
                    label=f"{name} P99",
                )
        ax.axhline(20, color="grey", lw=0.8, ls=":")
        ax.axhline(80, color="grey", lw=0.8, ls="-.")
        ax.set(xlabel="completed QPS (req/s)", ylabel="latency (ms)", yscale="log", title=f"{workload}: latency vs QPS")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{stem}_{workload}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path)
    p.add_argument("--png-dir", type=Path)
    args = p.parse_args()
    records = load(args.results)
    print(table(records))
    if args.png_dir:
        for path in plot(records, args.png_dir, args.results.stem):
            print(f"\n![{path.stem}]({path.name})")


if __name__ == "__main__":
    main()
