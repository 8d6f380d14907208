"""The bench harness's parts: request generators follow the workload distributions, FLOPs and MFU
as the formula counts them, deployments configured through the archiver, the report, the load
generator, the reliability judge, the profile and the CPU-path tool (tests/e2e/test_bench_smoke.py
runs the whole harness). No timing is asserted."""

import contextlib
import json
import math
import statistics
import sys

import pytest

from bench import flops
from bench.report import label
from bench.workloads import WORKLOADS, TextMaker
from slm_core import flops as counts
from slm_core.spec import ModelSpec, TaskSpec


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
    from slm_core.serve.protocol import Request, respond_batch
    from slm_core.tasks import task_for

    smollm2[1].tokenizer.save(str(tmp_path / "tokenizer.json"))
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "cpu_path",
            "--tokenizer",
            str(tmp_path / "tokenizer.json"),
            "--workloads",
            "W2,W1,W1e",
            "--batches",
            "1,2",
            "--calls",
            "2",
        ],
    )
    cpu_path.main()
    threads, *lines = capsys.readouterr().out.splitlines()
    assert threads == f"tokenizer threads: {cpu_path.tokenizer_threads()}"
    assert [line.split(":")[0] for line in lines] == [f"{w} batch of {b}" for w in ("W2", "W1", "W1e") for b in (1, 2)]
    assert all(float(line.split(": ")[1].split()[0]) > 0 for line in lines)
    tokenizer = smollm2[1].tokenizer
    task = task_for(TaskSpec.from_dict({**WORKLOADS["W2"].task, "max_batch": 2}), tokenizer)
    engine = cpu_path.Runtime(cpu_path.StubGraph(task, tokenizer.get_vocab_size(), 896), task, "cpu")
    replies = respond_batch(
        engine, [Request({"body": b'{"prompt": "a question"}'}), Request({"body": b'{"prompt": 3}'})]
    )
    assert [r.status for r in replies] == [200, 400] and len(json.loads(replies[0].body)["candidates"]) == 100


def test_flops_by_hand():
    spec = ModelSpec.from_hf_config(
        dict(
            model_type="llama",
            hidden_size=8,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=16,
            vocab_size=100,
        )
    )
    # per layer: qkv 8*(8+4+4) + o 8*8 + gate_up 8*32 + down 16*8 = 128+64+256+128 = 576 MACs
    assert counts.linear_flops_per_token(spec) == 2 * 576 * 2
    # texts of 3 and 1 tokens: 4 tokens, 6 + 1 causal pairs in the first layer; the last layer's o and
    # MLP (64 + 256 + 128 MACs) on the 2 last tokens only, whose queries alone attend (3 + 1 pairs)
    attention = 2 * 2 * 2 * 4 * (7 + 4)  # (QK + PV) × 2 FLOPs × heads × head_dim × pairs
    assert counts.prefill_flops(spec, [3, 1]) == 2304 * 4 - 2 * 448 * 2 + attention
    assert counts.head_flops(spec, rows=2, outputs=2) == 2 * 8 * 2 * 2
    # prompt 3, W=2, N=3: 4 decode rows; pairs 2*(3+1) + 2*(3+2) in each decode layer
    assert counts.decode_flops(spec, 3, 2, 3) == 2304 * 4 + 2 * 2 * 2 * 4 * (2 * 4 + 2 * 5) * 2
    # fp8-static: qkv (128 MACs) and the MLP (384) per layer over every row, less the last layer's MLP
    # at the rows a prefill skips
    assert counts.static_fp8_flops(spec, 7, skipped=2) == 2 * 512 * 2 * 7 - 2 * 384 * 2
    assert flops.mfu(100.0, 989e10) == pytest.approx(1.0)
    # effective MFU: each precision at its own peak (FP8's is twice bf16's on the H200)
    assert flops.mfu_effective(100.0, 989e10, 0.0) == pytest.approx(1.0)
    assert flops.mfu_effective(100.0, 989e10, 989e10) == pytest.approx(989 / 1979)


def test_deployments_are_configured_by_the_archiver():
    """Each bench deployment is a copy of a built archive that the archiver configures (archiver
    configure): its workers on GPU 0 or spread over gN's GPUs, CUDA graphs off for nographs, the
    rest the archiver's defaults."""
    from bench.run import Deployment, deployment_options
    from slm_core.serving import ServingOptions

    d = Deployment("slm", "n_x2", "n_x2.mar", workers=2, batch=8, built="n.mar")
    assert deployment_options(d, "cuda") == ServingOptions(workers=2, response_timeout_s=600, device_ids=(0,))
    spread = Deployment("slm", "n_g2_x4", "n_g2_x4.mar", workers=4, batch=8, gpus=2, cuda_graphs=False)
    assert deployment_options(spread, "cuda") == ServingOptions(
        4, response_timeout_s=600, device_ids=(0, 1), cuda_graphs=False
    )
    assert deployment_options(d, "cpu").device_ids == ()


def test_variants_parse_options_and_refuse_unknown_ones():
    from bench.run import Variant, parse_variant

    assert parse_variant("2:8") == Variant(2, 8)
    assert parse_variant("4:8:g2:nographs") == Variant(4, 8, nographs=True, gpus=2)
    assert parse_variant("3:4:fp8static:score") == Variant(3, 4, precision="fp8-static", task="score")
    assert parse_variant("2:8").precision is None  # the workload's own
    assert parse_variant("2:8:beam").task == "beam" and parse_variant("2:8").task is None
    assert parse_variant("2:4:fp8static:score:guard").guard and not parse_variant("2:4").guard
    for bad in ("1:8:gpu2", "1:8:g0", "1:8:fast", "1:8:ctx2", "1:8:lazy", "1:8:fp8"):
        with pytest.raises(SystemExit, match="unknown option"):
            parse_variant(bad)


def test_fp8_archives_are_built_whatever_their_gate_says(tmp_path):
    """The bench measures every FP8 build (its gate's figures go with each point): the archiver
    command opens the gate's thresholds for fp8 precisions only."""
    from bench.run import gate_passes, slm_build

    def argv(precision):
        return slm_build(
            f"m_{precision}", tmp_path / "ckpt", {"task": "beam", "precision": precision}, tmp_path, "cuda", tmp_path
        )

    assert argv("fp8-static")[-4:] == ["--fp8-max-diff", "1", "--fp8-min-shared", "0"]
    assert "--fp8-min-shared" not in argv("bf16") and argv("bf16")[-2:] == ["--device-ids", "0"]
    # the accuracy reference only in a guard build: the archives compared across runs hold one graph
    assert "--no-accuracy-reference" in argv("bf16")
    guarded = slm_build(
        "g", tmp_path / "ckpt", {"task": "score", "precision": "fp8-static"}, tmp_path, "cuda", tmp_path, True
    )
    assert "--no-accuracy-reference" not in guarded
    assert gate_passes({"max_abs_diff": 0.035}) and not gate_passes({"max_abs_diff": 0.06})
    assert gate_passes({"shared_candidates": 0.7}) and not gate_passes({"shared_candidates": 0.5})


def test_report_labels_name_each_build_and_serving_option():
    base = {"system": "slm", "kernels": "triton", "workers": 1, "batch": 8, "device": "NVIDIA H200"}
    assert label(base) == "slm (triton, batch 8)"
    assert label({**base, "workers": 2, "cuda_graphs": False}) == "slm (triton, ×2 workers, batch 8, no CUDA graphs)"
    assert label({**base, "workers": 4, "gpus": 2}) == "slm (triton, ×4 workers, 2 GPUs, batch 8)"
    assert label({"system": "hf", "workers": 4}) == "hf"
    assert label({**base, "precision": "fp8-static", "fp8_gate_passes": False}) == (
        "slm (triton, batch 8, FP8 qkv + MLP, static scales, fails the FP8 accuracy gate)"
    )
    assert label({**base, "precision": "bf16"}) == "slm (triton, batch 8)"
    assert label({**base, "accuracy_guard": 0.001}) == "slm (triton, batch 8, accuracy guard on 0.1% of requests)"
    assert label({**base, "accuracy_guard": 0.0}) == "slm (triton, batch 8)"
    old = {k: v for k, v in base.items() if k != "kernels"}
    assert label({**old, "attention": "triton"}) == "slm (triton, batch 8)"  # records from before "kernels"


@contextlib.contextmanager
def stand_in_server(respond):
    """A local HTTP/1.1 server whose every POST is answered by respond(body) -> (status, headers,
    payload); yields its URL."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # else headers and body wait on a delayed ACK: ~40 ms per request

        def do_POST(self):
            status, headers, payload = respond(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(status)
            for key, value in {**headers, "Content-Length": str(len(payload))}.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/"
    finally:
        server.shutdown()


def test_loadgen_averages_the_handler_headers_and_keeps_the_first_refusal():
    """bench.loadgen against a stand-in server whose every fourth answer refuses: the point
    averages the X-Slm-* timings of the answers, counts the refusals and keeps the first one's words."""
    import itertools

    from bench.loadgen import measure

    calls = itertools.count()

    def respond(body):
        if next(calls) % 4 == 3:
            return 503, {}, b'{"error":"server busy"}\n'
        return 200, {f"X-Slm-{k}": v for k, v in (("Handler-Ms", "3.0"), ("Graph-Ms", "2.0"), ("Batch", "2"))}, b"{}"

    with stand_in_server(respond) as url:
        point = measure(url, [b"{}"], concurrency=1, warmup=0.0, duration=1.0)
    assert point.completed >= 6 and point.errors >= 2  # CI ran 10 in 0.5 s with the delayed ACKs
    assert point.first_error == '503 {"error":"server busy"}\n'
    assert (point.handler_ms, point.graph_ms, point.call_batch) == (3.0, 2.0, 2.0)


@pytest.mark.parametrize(
    "capacity, expected",
    [
        (7, [1, 2, 3, 4, 6, 8, 12, 7]),
        (13, [1, 2, 3, 4, 6, 8, 12, 16, 24, 14, 13]),
        (0, [1, 2, 3]),
        (100, [1, 2, 3, 4, 6, 8, 12]),
    ],
)
def test_the_sweep_bisects_between_the_last_level_that_met_the_slo_and_the_next(monkeypatch, capacity, expected):
    """A grid of levels then bisection: a server meeting the SLO up to `capacity` requests in
    flight is measured at exactly that concurrency; none met, or none missed, bisects nothing."""
    import bench.loadgen as loadgen

    def measure(url, bodies, c, warmup, duration):
        ms = 10.0 if c <= capacity else 30.0
        return loadgen.Point(c, c * 50.0, ms, ms, ms, 10, 0, duration, ())

    monkeypatch.setattr(loadgen, "measure", measure)
    seen = []
    points = loadgen.sweep(
        "url",
        [b"{}"],
        [1, 2, 3, 4, 6, 8, 12, 16, 24][: len(expected) if capacity == 100 else None],
        0.0,
        1.0,
        on_point=lambda p: seen.append(p.concurrency),
    )
    assert [p.concurrency for p in points] == seen == expected
    met = [p.concurrency for p in points if p.meets_slo()]
    assert max(met, default=0) == min(capacity, max(expected))


def test_the_open_loop_sends_every_phase_on_schedule_from_several_processes():
    """bench.reliability.open_loop: the phases' rates back to back, each request once, at the time
    it is due, split between the generator processes; each body in turn; per request its status,
    the worker named in X-Slm-Worker and how late it was sent; on_start runs as the schedule starts."""
    import time

    from bench.reliability.open_loop import open_loop

    seen: list[bytes] = []

    def respond(body):
        seen.append(body)
        return 200 if body != b"3" else 503, {"X-Slm-Worker": "w1"}, b"{}"

    started: list[float] = []
    with stand_in_server(respond) as url:
        records = open_loop(
            url,
            [b"0", b"1", b"2", b"3"],
            [(20, 1.0), (40, 0.5)],
            processes=3,
            on_start=lambda: started.append(time.perf_counter()),
        )
        took = time.perf_counter() - started[0]
    assert [round(r.sent, 6) for r in records] == [round(i / 20, 6) for i in range(20)] + [
        round(1 + i / 40, 6) for i in range(20)
    ]
    assert sorted(seen) == sorted([b"0", b"1", b"2", b"3"] * 10)  # 40 requests, each body in turn
    assert [r.status for r in records].count(503) == 10 and {r.worker for r in records} == {"w1"}
    assert all(r.ms > 0 and r.lag_ms > -1 for r in records)
    assert 1.45 < took < 10


def test_the_open_loop_hands_its_answers_over_while_it_runs():
    """on_records gets the answers so far during the run, and with them a time before which every
    request answered is among them: a soak cut short keeps the minutes it finished."""
    from bench.reliability.open_loop import open_loop

    calls: list[tuple[int, float]] = []
    with stand_in_server(lambda body: (200, {}, b"{}")) as url:
        records = open_loop(
            url,
            [b"0"],
            [(40, 2.0)],
            processes=2,
            report_s=0.3,
            on_records=lambda so_far, until: calls.append((len(so_far), until)),
        )
    assert len(records) == 80
    during = [(n, until) for n, until in calls if until < math.inf]
    assert len([n for n, _ in during if n < 80]) >= 3  # handed over while requests were still due
    assert calls[-1] == (80, math.inf)
    for n, until in during:  # every request answered before `until` was handed over by then
        assert n >= sum(r.sent + (r.lag_ms + r.ms) / 1e3 < until - 0.05 for r in records), (n, until)
    assert [u for _, u in calls] == sorted(u for _, u in calls)


def test_a_soak_reports_each_window_once_its_requests_are_answered(monkeypatch):
    """soak's on_window: the report so far, a window more each time, before the run ends."""
    from bench.reliability import open_loop, soak

    for module in (soak, open_loop):  # soak's own calls and its memory sampler's
        monkeypatch.setattr(module, "worker_pids", lambda management, model: ["1"])
    reports: list[dict] = []
    with stand_in_server(lambda body: (200, {}, b"{}")) as url:
        result = soak.soak(
            url,
            "unused",
            "m",
            [b"0"],
            capacity=50,
            seconds=3.0,
            window=1.0,
            timeout=0.5,
            on_window=lambda report: reports.append(report),
        )
    counts = [len(r["windows"]) for r in reports]
    assert counts and counts[0] < 3 and counts == sorted(set(counts)) and counts[-1] == 3, counts
    assert len(result["windows"]) == 3 and result["workers_after"] == ["1"]
    assert [w["from_s"] for w in result["windows"]] == [0.0, 1.0, 2.0]
    assert reports[0]["windows"][0] == result["windows"][0]


def test_reliability_judges_answers_under_load_against_the_answer_alone():
    """bench.reliability: a valid request's answer under load is compared with its answer alone,
    exactly (1e-5, the CPU default) or within its package's compiled-against-eager tolerance
    (a batched bf16 call on the GPU rounds otherwise): score rows by their largest difference,
    beam candidates by the share in common and their scores."""
    from bench.reliability.fuzz import Tolerance, difference, judge

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
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "profile",
            "--package",
            str(archives[archive]),
            "--workload",
            workload,
            "--tokenizer",
            str(tmp_path / "tokenizer.json"),
            "--out",
            str(out),
            "--repeat",
            "2",
        ],
    )
    profile.main()
    head, table = out.read_text().split("\n\n", 1)
    parts = json.loads(head.split("\n", 1)[1])
    assert (
        parts["tokenize_pack_ms"] > 0 and parts["end_to_end_in_process_ms (the whole batch)"] > parts["json_parse_ms"]
    )
    assert parts["graph_ms (copy-in + graph + copy-out)"] > 0 and "Self CPU" in table
    at_bounds = parts["calls_at_the_bounds_ms (per requests in the call)"]  # beside the build's own timing
    assert at_bounds.keys() == parts["build_call_ms (the manifest's)"].keys() and min(at_bounds.values()) > 0
