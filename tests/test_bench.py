"""The bench harness: request generators follow the workload distributions, FLOPs as DESIGN.md
counts them, and a CPU smoke run of the whole harness (SmolLM2 archives of the demo, the HF peer,
the no-op ceiling) that writes the records and the report. No timing is asserted."""

import json
import math
import statistics
import subprocess
import sys

import pytest

from bench import flops
from bench.report import label, load, plot, table
from bench.workloads import WORKLOADS, TextMaker
from slm_core.spec import ModelSpec, TaskSpec

REQUIRED = {"system", "workload", "concurrency", "qps", "mean_ms", "p50_ms", "p99_ms", "errors", "mfu_effective",
            "mfu_bf16", "commit", "device", "torch", "date"}


@pytest.mark.parametrize("name", ["W1", "W2", "W3"])
def test_request_token_counts_follow_the_workload(smollm2, name):
    tokenizer = smollm2[1].tokenizer
    workload = WORKLOADS[name]
    bodies = TextMaker(tokenizer, seed=3).requests(workload, 40 if workload.texts else 300)
    texts = [t for b in bodies for t in b["texts"]] if workload.texts else [b["prompt"] for b in bodies]
    assert all(len(b["texts"]) == workload.texts for b in bodies) if workload.texts else True
    lengths = [len(tokenizer.encode(t).ids) for t in texts]
    lo, hi = workload.lengths
    assert min(lengths) >= lo and max(lengths) <= hi
    # Uniform on [lo, hi]: mean and spread within sampling error, both ends reached.
    assert statistics.fmean(lengths) == pytest.approx((lo + hi) / 2, abs=0.06 * (hi - lo))
    assert statistics.pstdev(lengths) == pytest.approx((hi - lo) / 12**0.5, rel=0.15)
    assert min(lengths) < lo + 0.1 * (hi - lo) and max(lengths) > hi - 0.1 * (hi - lo)
    words = " ".join(texts).split()
    assert len(set(words)) > 500 and all(w.isalpha() for w in words)  # words, not ids


def test_cpu_path_times_the_handlers_work_around_a_stub_graph(smollm2, tmp_path, monkeypatch, capsys):
    """bench.cpu_path: respond_batch of workload batches around a stub graph that answers in the
    graph's shapes (the replies are real: 200s with W candidates or one row per text)."""
    from bench import cpu_path
    from slm_core.protocol import respond_batch

    smollm2[1].tokenizer.save(str(tmp_path / "tokenizer.json"))
    monkeypatch.setattr(sys, "argv", ["cpu_path", "--tokenizer", str(tmp_path / "tokenizer.json"),
                                      "--workloads", "W2,W1", "--batches", "1,2", "--calls", "2"])
    cpu_path.main()
    lines = capsys.readouterr().out.splitlines()
    assert [l.split(":")[0] for l in lines] == ["W2 batch of 1", "W2 batch of 2", "W1 batch of 1", "W1 batch of 2"]
    assert all(float(l.split(": ")[1].split()[0]) > 0 for l in lines)
    task = TaskSpec.from_dict({**WORKLOADS["W2"].task, "max_batch": 2})
    tokenizer = smollm2[1].tokenizer
    stub = cpu_path.StubGraph(task, tokenizer.get_vocab_size())
    engine = cpu_path.Engine(stub, cpu_path.PackedTokenizer(tokenizer, task), task, cpu_path.RuntimeSpec(device="cpu"))
    replies = respond_batch(engine, [{"body": b'{"prompt": "a question"}'}, {"body": b'{"prompt": 3}'}])
    assert [r.status for r in replies] == [200, 400] and len(json.loads(replies[0].body)["candidates"]) == 100


def test_flops_by_hand():
    spec = ModelSpec.from_hf_config(dict(model_type="llama", hidden_size=8, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, intermediate_size=16,
                                         vocab_size=100))
    # per layer: qkv 8*(8+4+4) + o 8*8 + gate_up 8*32 + down 16*8 = 128+64+256+128 = 576 MACs
    assert flops.linear_flops_per_token(spec) == 2 * 576 * 2
    # texts of 3 and 1 tokens: 4 tokens, 6 + 1 causal pairs in the first layer; the last layer's o and
    # MLP (64 + 256 + 128 MACs) on the 2 last tokens only, whose queries alone attend (3 + 1 pairs)
    attention = 2 * 2 * 2 * 4 * (7 + 4)  # (QK + PV) × 2 FLOPs × heads × head_dim × pairs
    assert flops.score_flops(spec, [3, 1], 2) == 2304 * 4 - 2 * 448 * 2 + attention + 2 * 8 * 2 * 2
    # prompt 3, W=2, N=3: the prefill (3 tokens, its last layer past q/k/v at 1), then 4 decode rows;
    # pairs 6 + 3 in the prefill, 2*(3+1) + 2*(3+2) in each decode layer; LM head on 1 + 4 rows
    prefill = 2304 * 3 - 2 * 448 * 2 + 2 * 2 * 2 * 4 * (6 + 3)
    decode = 2304 * 4 + 2 * 2 * 2 * 4 * (2 * 4 + 2 * 5) * 2
    assert flops.beam_flops(spec, 3, 2, 3) == prefill + decode + 2 * 8 * 100 * 5
    assert flops.mfu(100.0, 989e10) == pytest.approx(1.0)
    # fp8: the MLP's share (gate_up + down, 256 + 128 MACs per layer) of each token, the LM head with lmhead
    assert flops.mlp_flops_per_token(spec) == 2 * 384 * 2
    assert flops.fp8_flops(spec, "bf16", 7, head=1600) == 0
    assert flops.fp8_flops(spec, "fp8-mlp", 7, head=1600) == 1536 * 7
    assert flops.fp8_flops(spec, "fp8-mlp-lmhead", 7, head=1600) == 1536 * 7 + 1600
    assert flops.fp8_flops(spec, "fp8-mlp", 7, skipped=2) == 1536 * 7 - 768 * 2  # the last layer's MLP on 2 rows less
    assert flops.beam_fp8_flops(spec, "fp8-mlp", 3, 2, 3) == 1536 * 7 - 768 * 2
    # fp8-static: qkv (128 MACs per layer) over every row too, the last layer's included
    assert flops.fp8_flops(spec, "fp8-static", 7, head=1600, skipped=2) == 1536 * 7 - 768 * 2 + 2 * 128 * 2 * 7
    # effective MFU: each precision at its own peak (FP8's is twice bf16's on the H200)
    assert flops.mfu_effective(100.0, 989e10, 0.0) == pytest.approx(1.0)
    assert flops.mfu_effective(100.0, 989e10, 989e10) == pytest.approx(989 / 1979)


@pytest.mark.slow
def test_harness_smoke_on_cpu(demo, tmp_path):
    work, _ = demo
    store = tmp_path / "work" / "model-store"
    store.mkdir(parents=True)
    for name in ("smollm2_intent", "smollm2_complete"):  # reuse the demo's archives
        (store / f"slm_{name}_reference_b1.mar").symlink_to(work / "model-store" / f"{name}.mar")
    out = tmp_path / "out"
    subprocess.run([sys.executable, "-m", "bench.run", "--smoke", "--device", "cpu", "--work", str(tmp_path / "work"),
                    "--out", str(out), "--duration", "3", "--warmup", "0.5", "--requests", "4", "--hf-workers", "1",
                    "--commit", "test"], check=True, timeout=900)
    (results,) = out.glob("*_smoke.jsonl")
    records = load(results)
    assert all(REQUIRED <= set(r) for r in records)
    seen = {(r["system"], r["workload"]) for r in records}
    assert {r["attention"] for r in records if r["system"] == "slm"} == {"reference"}
    assert {("slm", "W1"), ("hf", "W1"), ("slm", "W2"), ("hf", "W2"), ("noop", "ceiling")} <= seen
    assert all(r["errors"] == 0 for r in records)
    # Liveness, not speed: a 3 s window holds several CPU requests of under a second each.
    assert all(r["completed"] > 0 and r["flops_per_request"] > 0 for r in records
               if r["system"] != "noop" and r["concurrency"] == 1)
    report = table(records)
    assert "| W1 | slm (reference) |" in report and "| W2 | hf |" in report and "ceiling" in report
    assert len(plot(records, out, results.stem)) == 2
    # served answers compared with the peer's: the fp32 CPU engine and transformers agree closely
    checks = {c["workload"]: c for c in json.loads(next(out.glob("*_served_check.json")).read_text())}
    assert checks["W1"]["against"] == "hf_smollm2_intent_x1"
    assert checks["W1"]["deployments"]["slm_smollm2_intent_reference_b1_x1"]["max_abs_dp"] < 1e-2
    assert checks["W2"]["deployments"]["slm_smollm2_complete_reference_b1_x1"]["same_best"] == 3
    assert all(r["window_start"] > 0 for r in records)
    # TorchServe's counters split each point (warm-up included): queue time is part of frontend time
    split = [r for r in records if r["system"] != "noop" and r["completed"]]
    assert split and all(r["ts_requests"] >= r["completed"] and 0 <= r["ts_queue_ms"] <= r["ts_frontend_ms"]
                         for r in split)
    assert "| in TorchServe |" in report
    # the handler's X-Slm-* headers come through TorchServe, averaged over the same answers as the
    # client latency: per answer, graph call <= handler <= client latency
    slm = [r for r in split if r["system"] == "slm"]
    assert slm and all(0 < r["graph_ms"] <= r["handler_ms"] <= r["mean_ms"] and r["call_batch"] >= 1
                       for r in slm), [(r["graph_ms"], r["handler_ms"], r["mean_ms"], r["call_batch"]) for r in slm]
    assert all(math.isnan(r["handler_ms"]) for r in split if r["system"] == "hf")
    assert "| of which graph call |" in report


def test_configured_copies_change_only_their_settings(tmp_path):
    """Each bench deployment serves a copy of the archive whose model-config.yaml is what the
    archiver writes for its workers (archiver.build.admission: TorchServe's batch and the queue
    for 80 ms, from the calls timed at build), with its options (:nographs, :lazy, :gN, :tsbN,
    :ctxN); everything else in it is byte for byte the same."""
    import zipfile

    import yaml

    from archiver.build import admission, model_config
    from bench.run import configured_copy

    src = tmp_path / "a.mar"
    built = model_config("cuda", 1, 60, batch=8, queue=6, device_ids=[0])
    with zipfile.ZipFile(src, "w") as z:
        z.writestr("model-config.yaml", yaml.safe_dump(built))
        z.writestr("manifest.json", json.dumps({"call_ms": {"1": 8.0, "2": 9.6, "4": 12.5, "8": 18.1},
                                                "task": {"max_batch": 8}, "device": "cuda"}))
        z.writestr("graph.pt2", b"\x00weights" * 100)

    def config(name: str, **options) -> dict:
        configured_copy(src, tmp_path / f"{name}.mar", **options)
        with zipfile.ZipFile(src) as a, zipfile.ZipFile(tmp_path / f"{name}.mar") as b:
            assert a.read("graph.pt2") == b.read("graph.pt2") and a.read("manifest.json") == b.read("manifest.json")
            return yaml.safe_load(b.read("model-config.yaml"))

    def base(workers: int, batch: int, queue: int) -> dict:
        return {**built, "minWorkers": workers, "maxWorkers": workers, "batchSize": batch, "jobQueueSize": queue}

    # one worker, calls of 8 (18.1 ms): a request behind 15 others finishes after (15 / 8 + 2) x 18.1 = 70 ms
    assert config("x1") == base(1, 8, 15)
    assert config("x2", workers=2) == base(2, 4, 11) == base(2, *admission(80, {"4": 12.5}, 8, 2)[:2])
    assert config("nographs", cuda_graphs=False) == {**base(1, 8, 15), "handler": {"cuda_graphs": False,
                                                                                  "capture_at_load": True}}
    assert config("lazy", lazy=True)["handler"] == {"cuda_graphs": True, "capture_at_load": False}
    assert config("g2", workers=4, gpus=2) == {**base(4, 4, 22), "deviceIds": [0, 1]}  # 2 GPUs: twice the queue
    assert config("tsb2", workers=2, ts_batch=2) == base(2, 2, 9)
    # as the archiver writes it with --contexts 2, the queue inside the worker
    assert config("ctx2", contexts=2) == model_config("cuda", 1, 60, batch=8, queue=7, device_ids=[0], contexts=2)
    cpu = tmp_path / "cpu.mar"  # a CPU build (development) keeps the queue it was built with, as the archiver's
    with zipfile.ZipFile(cpu, "w") as z:
        z.writestr("model-config.yaml", yaml.safe_dump(built))
        z.writestr("manifest.json", json.dumps({"call_ms": {"8": 900.0}, "task": {"max_batch": 8}, "device": "cpu"}))
    configured_copy(cpu, tmp_path / "cpu_x2.mar", workers=2)
    with zipfile.ZipFile(tmp_path / "cpu_x2.mar") as z:
        assert yaml.safe_load(z.read("model-config.yaml")) == base(2, 4, 6)


def test_variants_parse_options_and_refuse_unknown_ones():
    from bench.run import Variant, parse_variant

    assert parse_variant("triton:2:8") == Variant("triton", 2, 8)
    assert parse_variant("triton:4:8:g2:topk") == Variant("triton", 4, 8, topk=True, gpus=2)
    assert parse_variant("triton:4:8:g2:tsb2:nographs") == Variant("triton", 4, 8, nographs=True, gpus=2, ts_batch=2)
    assert parse_variant("triton:2:8:lazy") == Variant("triton", 2, 8, lazy=True)
    assert parse_variant("triton:2:8:fp8").precision == "fp8-mlp"
    assert parse_variant("triton:2:8:topk:fp8head").precision == "fp8-mlp-lmhead"
    assert parse_variant("triton:1:4:ctx2:fp8static").precision == "fp8-static"
    assert parse_variant("triton:2:8").precision is None  # the workload's own
    assert parse_variant("triton:1:8:topk:ctx3") == Variant("triton", 1, 8, topk=True, contexts=3)
    assert parse_variant("triton:2:8:topk:beam").task == "beam" and parse_variant("triton:2:8").task is None
    for bad in ("triton:1:8:gpu2", "triton:1:8:g0", "triton:1:8:fast", "triton:1:8:tsb9", "triton:1:8:tsb0",
                "triton:1:8:ctx0", "triton:1:8:ctx2:serial"):
        with pytest.raises(SystemExit, match="unknown option"):
            parse_variant(bad)


def test_fp8_archives_are_built_whatever_their_gate_says(tmp_path):
    """The bench measures every FP8 build (its gate's figures go with each point): the archiver
    command opens the gate's thresholds for fp8 precisions only."""
    from bench.run import slm_build

    def argv(precision):
        return slm_build(f"m_{precision}", tmp_path / "ckpt", {"task": "beam", "precision": precision}, tmp_path,
                         "cuda", "triton", tmp_path)

    assert argv("fp8-mlp")[-4:] == ["--fp8-max-diff", "1", "--fp8-min-shared", "0"]
    assert "--fp8-min-shared" not in argv("bf16")


def test_report_labels_name_each_build_and_serving_option():
    base = {"system": "slm", "attention": "triton", "workers": 1, "batch": 8, "device": "NVIDIA H200"}
    assert label(base) == "slm (triton, batch 8)"
    assert label({**base, "workers": 2, "cuda_graphs": False}) == "slm (triton, ×2 workers, batch 8, no CUDA graphs)"
    assert label({**base, "topk": True}) == "slm (triton, batch 8, Triton top-k)"
    assert label({**base, "workers": 4, "gpus": 2}) == "slm (triton, ×4 workers, 2 GPUs, batch 8)"
    assert label({**base, "ts_batch": 2}) == "slm (triton, batch 8, TorchServe batch 2)"
    assert label({**base, "ts_batch": 8}) == "slm (triton, batch 8)"
    assert label({**base, "contexts": 3}) == "slm (triton, batch 8, async, 3 contexts)"
    assert label({**base, "contexts": 2, "overlap": False}) == "slm (triton, batch 8, async, 2 contexts, calls taking turns)"
    assert label({**base, "capture_at_load": True}) == "slm (triton, batch 8)"
    assert label({**base, "cuda_graphs": True, "capture_at_load": False}) == (
        "slm (triton, batch 8, graphs captured on first call)")
    assert label({"system": "hf", "workers": 4}) == "hf"
    assert label({**base, "precision": "fp8-mlp"}) == "slm (triton, batch 8, FP8 MLP)"
    assert label({**base, "precision": "fp8-mlp-lmhead", "fp8_gate_passes": False}) == (
        "slm (triton, batch 8, FP8 MLP + LM head, fails the FP8 accuracy gate)")
    assert label({**base, "precision": "bf16"}) == "slm (triton, batch 8)"


def test_loadgen_averages_the_handler_headers_and_counts_captures():
    """bench.loadgen against a stand-in server whose every third answer says its graph call
    captured a CUDA graph and every fourth refuses: the point counts the captures among the
    answers, averages the X-Slm-* timings, counts the refusals and keeps the first one's words."""
    import http.server
    import itertools
    import threading

    from bench.loadgen import measure

    calls = itertools.count()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # else headers and body wait on a delayed ACK: ~40 ms per request

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            n = next(calls)
            if n % 4 == 3:
                self.send_response(503)
                self.send_header("Content-Length", "24")
                self.end_headers()
                self.wfile.write(b'{"error":"server busy"}\n')
                return
            self.send_response(200)
            for key, value in (("Handler-Ms", "3.0"), ("Graph-Ms", "2.0"), ("Batch", "2"), ("Wait-Ms", "0.5"),
                               ("Captured", str(int(n % 3 == 0)))):
                self.send_header(f"X-Slm-{key}", value)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        point = measure(f"http://127.0.0.1:{server.server_port}/", [b"{}"], concurrency=1, warmup=0.0, duration=1.0)
    finally:
        server.shutdown()
    assert point.completed >= 6 and point.errors >= 2  # CI ran 10 in 0.5 s with the delayed ACKs
    assert point.first_error == '503 {"error":"server busy"}\n'
    assert (point.handler_ms, point.graph_ms, point.call_batch, point.wait_ms) == (3.0, 2.0, 2.0, 0.5)
    assert abs(point.captured - point.completed / 3) <= 2


def test_reliability_judges_answers_under_load_against_the_answer_alone():
    """bench.reliability: a valid request's answer under load is compared with its answer alone,
    exactly (1e-5, the CPU default) or within its package's compiled-against-eager tolerance
    (a batched bf16 call on the GPU rounds otherwise): score rows by their largest difference,
    beam candidates by the share in common and their scores."""
    from bench.reliability import Tolerance, difference, judge

    def within(a, b, tolerance):
        return judge(a, b, tolerance)[0]

    alone = {"labels": ["yes", "no"], "scores": [[0.5, 0.5], [0.2, 0.8]]}
    batched = {"labels": ["yes", "no"], "scores": [[0.51, 0.49], [0.2, 0.8]]}
    assert difference(alone, batched) == (pytest.approx(0.01), 1.0)
    assert not within(alone, batched, Tolerance()) and within(alone, batched, Tolerance.of_precision("bf16"))
    assert difference(alone, {"labels": ["no", "yes"], "scores": alone["scores"]})[0] == math.inf
    beams = {"candidates": [{"token_ids": [1, 2], "score": -1.0}, {"token_ids": [3], "score": -2.0}]}
    other = {"candidates": [{"token_ids": [1, 2], "score": -1.1}, {"token_ids": [4], "score": -2.0}]}
    assert difference(beams, other) == (pytest.approx(0.1), 0.5)
    assert within(beams, beams, Tolerance()) and not within(beams, other, Tolerance())
    assert Tolerance.of_precision("bf16") == Tolerance(5e-2, 0.25, 0.75, same_order=False)
    swapped = {"candidates": beams["candidates"][::-1]}  # the same candidates in another order
    assert not within(beams, swapped, Tolerance()) and within(beams, swapped, Tolerance.of_precision("bf16"))
    assert not within(beams, {"candidates": [{"token_ids": [5], "score": -1.0}] * 2}, Tolerance.of_precision("bf16"))


@pytest.mark.parametrize("archive,workload", [("tiny_score", "W1"), ("tiny_beam", "W2")])
def test_profile_splits_a_request_of_each_task(archives, smollm2, tmp_path, monkeypatch, archive, workload):
    """bench.profile on the tests' CPU archives, with the workload's requests (SmolLM2's words) shrunk
    to their bounds: every part is timed and the profiler's table is written (the H200's profile step
    runs it)."""
    import dataclasses

    from bench import profile

    shrunk = dataclasses.replace(WORKLOADS[workload], lengths=(4, 8), texts=3 if WORKLOADS[workload].texts else 0)
    smollm2[1].tokenizer.save(str(tmp_path / "tokenizer.json"))
    monkeypatch.setitem(profile.WORKLOADS, workload, shrunk)
    out = tmp_path / "profile.txt"
    monkeypatch.setattr(sys, "argv", ["profile", "--package", str(archives[archive]), "--workload", workload,
                                      "--tokenizer", str(tmp_path / "tokenizer.json"), "--out", str(out),
                                      "--repeat", "2"])
    profile.main()
    head, table = out.read_text().split("\n\n", 1)
    parts = json.loads(head.split("\n", 1)[1])
    assert parts["tokenize_pack_ms"] > 0 and parts["end_to_end_in_process_ms (the whole batch)"] > parts["json_parse_ms"]
    assert parts["graph_ms (copy-in + graph + copy-out)"] > 0 and "Self CPU" in table
