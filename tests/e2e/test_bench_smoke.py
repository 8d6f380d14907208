"""A CPU smoke run of the whole bench harness through a real TorchServe: the demo's SmolLM2
archives, the HF peer and the no-op ceiling; it writes the records, the served-answer check and
the report. No timing is asserted."""

import json
import math
import subprocess
import sys

import pytest

from bench.report import load, plot, table

REQUIRED = {
    "system",
    "workload",
    "concurrency",
    "qps",
    "mean_ms",
    "p50_ms",
    "p99_ms",
    "errors",
    "mfu_effective",
    "mfu_bf16",
    "commit",
    "device",
    "torch",
    "date",
}


@pytest.mark.slow
def test_harness_smoke_on_cpu(demo, tmp_path):
    work, _ = demo
    store = tmp_path / "work" / "model-store"
    store.mkdir(parents=True)
    for name in ("smollm2_intent", "smollm2_complete"):  # reuse the demo's archives
        (store / f"slm_{name}_b1.mar").symlink_to(work / "model-store" / f"{name}.mar")
    out = tmp_path / "out"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.run",
            "--smoke",
            "--device",
            "cpu",
            "--work",
            str(tmp_path / "work"),
            "--out",
            str(out),
            "--duration",
            "2",
            "--warmup",
            "0.5",
            "--requests",
            "4",
            "--hf-workers",
            "1",
            "--commit",
            "test",
        ],
        check=True,
        timeout=900,
    )
    (results,) = out.glob("*_smoke.jsonl")
    records = load(results)
    assert all(REQUIRED <= set(r) for r in records)
    seen = {(r["system"], r["workload"]) for r in records}
    assert {r["kernels"] for r in records if r["system"] == "slm"} == {"reference"}
    assert {("slm", "W1"), ("hf", "W1"), ("slm", "W2"), ("hf", "W2"), ("noop", "ceiling")} <= seen
    assert all(r["errors"] == 0 for r in records)
    # Liveness, not speed: a 2 s window holds several CPU requests of under a second each.
    assert all(
        r["completed"] > 0 and r["flops_per_request"] > 0
        for r in records
        if r["system"] != "noop" and r["concurrency"] == 1
    )
    report = table(records)
    assert "| W1 | slm (reference) |" in report and "| W2 | hf |" in report and "ceiling" in report
    assert len(plot(records, out, results.stem)) == 2
    # served answers compared with the peer's: the fp32 CPU engine and transformers agree closely
    checks = {c["workload"]: c for c in json.loads(next(out.glob("*_served_check.json")).read_text())}
    assert checks["W1"]["against"] == "hf_smollm2_intent_x1"
    assert checks["W1"]["deployments"]["slm_smollm2_intent_b1_x1"]["max_abs_dp"] < 1e-2
    assert checks["W2"]["deployments"]["slm_smollm2_complete_b1_x1"]["same_best"] == 3
    assert all(r["window_start"] > 0 for r in records)
    # TorchServe's counters split each point (warm-up included): queue time is part of frontend time
    split = [r for r in records if r["system"] != "noop" and r["completed"]]
    assert split and all(
        r["ts_requests"] >= r["completed"] and 0 <= r["ts_queue_ms"] <= r["ts_frontend_ms"] for r in split
    )
    assert "| in TorchServe |" in report
    # the handler's X-Slm-* headers come through TorchServe, averaged over the same answers as the
    # client latency: per answer, graph call <= handler <= client latency
    slm = [r for r in split if r["system"] == "slm"]
    assert slm and all(0 < r["graph_ms"] <= r["handler_ms"] <= r["mean_ms"] and r["call_batch"] >= 1 for r in slm), [
        (r["graph_ms"], r["handler_ms"], r["mean_ms"], r["call_batch"]) for r in slm
    ]
    assert all(math.isnan(r["handler_ms"]) for r in split if r["system"] == "hf")
    assert "| of which graph call |" in report
