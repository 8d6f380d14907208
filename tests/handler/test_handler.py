"""The handler's lifecycle with a mock TorchServe context: batches of good and bad requests, what
a worker loads where, and that a worker serves with only serve-time code importable."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from mock_ts import MockContext

from handlers.slm_handler import SlmHandler, workers_share_a_gpu
from slm_core import Engine, SpecError
from slm_core.manifest import MANIFEST
from slm_core.serve.loader import load_package
from slm_core.serving import ServingSpec

REPO = Path(__file__).resolve().parents[2]


def test_a_batch_of_good_and_bad_requests_gets_an_answer_each(archives):
    ctx = MockContext(
        archives["tiny_score"],
        ServingSpec("cpu", 1, 3, 30).model_config(),
        [{}, {}, {}, {}, {}, {"Content-Encoding": "gzip"}],
    )
    handler = SlmHandler()
    handler.initialize(ctx)
    assert os.environ["TS_DECODE_INPUT_REQUEST"] == "false"  # bodies reach the handler undecoded
    batch = [
        {"body": b'{"texts": ["search engines", "a"]}'},
        {"body": b'{"texts": ['},
        {"body": {"texts": "not a list"}},  # as TorchServe decodes a JSON body by default
        {"data": b'{"texts": ["the lazy dog"]}'},
        {"hello": b""},
        {"body": b"\x1f\x8b\x08\x00"},
    ]
    out = handler.handle(batch, ctx)
    assert [ctx.status[i][0] for i in range(6)] == [200, 400, 400, 200, 400, 415]
    assert all(ctx.headers[i]["Content-Type"] == "application/json" for i in range(6))
    for i in (0, 3):  # where each answered request's time went: its batch's handler time holds its graph call
        timing = ctx.headers[i]
        assert 0 < float(timing["X-Slm-Graph-Ms"]) <= float(timing["X-Slm-Handler-Ms"])
        assert timing["X-Slm-Batch"] == "2" and timing["X-Slm-Worker"] == str(os.getpid())
    assert not any(k.startswith("X-Slm") for i in (1, 2, 4, 5) for k in ctx.headers[i])  # refused: no call
    bodies = [json.loads(b) for b in out]
    assert bodies[0]["labels"] == ["yes", "no"] and len(bodies[0]["scores"]) == 2
    assert "not valid JSON" in bodies[1]["error"] and "must be an array of strings" in bodies[2]["error"]
    assert 'form fields "hello"' in bodies[4]["error"] and "Content-Encoding 'gzip'" in bodies[5]["error"]
    # The two good requests shared one graph call (max_batch: 3); each equals its own call.
    assert bodies[3]["scores"][0] == pytest.approx(handler.engine.run_one(["the lazy dog"])[0], abs=1e-6)
    # metrics: the one graph call once (its seconds, its 2 requests), the texts of both, the four
    # refusals by status
    assert ctx.counters["SlmTexts"] == 3 and ctx.counters["SlmTokens"] > 3
    (seconds,) = ctx.histograms[("SlmGraphCallSeconds", "s")]
    assert 0 < seconds * 1e3 == pytest.approx(float(ctx.headers[0]["X-Slm-Graph-Ms"]), abs=1e-3)
    assert ctx.histograms[("SlmRequestsPerCall", "count")] == [2]
    assert ctx.counters[("SlmRefused", "Status=400")] == 3 and ctx.counters[("SlmRefused", "Status=415")] == 1


def test_a_describe_request_gets_the_description_and_its_batch_peers_their_answers(archives):
    """describe-model ?customized=true comes as a request with TorchServe's describe header; in a
    batch beside a prediction, each gets its own reply, and the description counts as no refusal."""
    rest = {"Content-Length": "20"}
    ctx = MockContext(
        archives["tiny_score"], ServingSpec("cpu", 1, 3, 30).model_config(), [{**rest, "describe": "True"}, rest]
    )
    handler = SlmHandler()
    handler.initialize(ctx)
    out = handler.handle([{"body": b""}, {"body": b'{"texts": ["a"]}'}], ctx)
    described, answer = json.loads(out[0]), json.loads(out[1])
    assert described["task"]["labels"] == ["yes", "no"] and described["serving"]["queue"] == 30
    assert answer["labels"] == ["yes", "no"] and len(answer["scores"]) == 1
    assert [ctx.status[i][0] for i in range(2)] == [200, 200]
    assert not any(key[0] == "SlmRefused" for key in ctx.counters if isinstance(key, tuple))


def test_a_worker_whose_gpu_context_is_lost_exits_for_a_new_one(archives, monkeypatch):
    """A sticky device error fails every later call: the worker exits (TorchServe starts another,
    with a fresh context) instead of answering 500 from then on."""
    import handlers.slm_handler as slm_handler

    rest = [{"Content-Length": "20"}]  # a REST request's headers (one without any came through gRPC)
    ctx = MockContext(archives["tiny_score"], ServingSpec("cpu", 1, 3, 30).model_config(), rest)
    handler = SlmHandler()
    handler.initialize(ctx)

    def fail(*inputs):
        raise RuntimeError("CUDA error: unspecified launch failure")

    exits = []
    monkeypatch.setattr(handler.engine, "graph", fail)
    monkeypatch.setattr(handler.engine.context, "replay", None)
    monkeypatch.setattr(slm_handler.os, "_exit", lambda status: exits.append(status) or sys.exit(status))
    out = handler.handle([{"body": b'{"texts": ["a"]}'}], ctx)  # the device still works: a 500, served on
    assert ctx.status[0][0] == 500 and b"internal error" in out[0] and not exits
    monkeypatch.setattr(handler.engine, "usable", lambda: False)
    with pytest.raises(SystemExit):
        handler.handle([{"body": b'{"texts": ["a"]}'}], ctx)
    assert exits == [slm_handler.EXIT_DEVICE_LOST]


def test_a_request_past_its_deadline_is_refused_before_the_graph(archives):
    """X-Slm-Deadline-Ms: a request that its call cannot answer in time gets a 504 naming the
    deadline and is not computed (no X-Slm headers, no texts counted); the others in its batch are
    answered; the refusal is counted by status."""
    ctx = MockContext(
        archives["tiny_score"],
        ServingSpec("cpu", 1, 3, 30).model_config(),
        [{"X-Slm-Deadline-Ms": "0.001"}, {}, {"X-Slm-Deadline-Ms": "60000"}],
    )
    handler = SlmHandler()
    handler.initialize(ctx)
    assert handler.deadlines.default_ms is None and handler.deadlines.call_ms  # a CPU build: the build's timings
    assert handler.deadlines.sizes and all(len(point) == 3 for point in handler.deadlines.sizes)  # and by size
    out = handler.handle(
        [{"body": b'{"texts": ["late"]}'}, {"body": b'{"texts": ["a"]}'}, {"body": b'{"texts": ["b"]}'}], ctx
    )
    assert [ctx.status[i][0] for i in range(3)] == [504, 200, 200]
    assert "deadline of 0.001 ms" in json.loads(out[0])["error"] and "X-Slm-Graph-Ms" not in ctx.headers.get(0, {})
    assert ctx.headers[1]["X-Slm-Batch"] == "2" and ctx.counters["SlmTexts"] == 2
    assert ctx.counters[("SlmRefused", "Status=504")] == 1


SERVE_WITHOUT_BUILD = """
import importlib.abc, json, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        build_time = name.split(".")[0] in ("slm_kernels", "transformers", "gguf")
        if build_time or name.startswith(("slm_core.compile", "slm_core.api")):
            raise ImportError(f"{name} is build-time: a worker must not import it")
sys.meta_path.insert(0, Refuse())
model_dir, tests = sys.argv[1], sys.argv[2]
sys.path[:0] = [model_dir, tests]
from mock_ts import MockContext
from slm_handler import SlmHandler
ctx = MockContext(model_dir)
handler = SlmHandler()
handler.initialize(ctx)
out = handler.handle([{"body": b'{"prompt": "a small language model"}'}], ctx)
print(json.dumps({"status": ctx.status[0][0], "body": out[0].decode(),
                  "modules": sorted(m for m in sys.modules if m.startswith("slm_core"))}))
"""


def test_a_worker_serves_with_the_build_time_modules_unimportable(archives, tmp_path):
    """As TorchServe runs it, from the unpacked archive: the handler loads the package and answers
    a request while slm_core.compile, slm_core.api, slm_kernels, transformers and gguf cannot be
    imported (the compiled graph replaces the Python model); the answer equals the package's."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [sys.executable, "-c", SERVE_WITHOUT_BUILD, str(archives["tiny_beam"]), str(REPO / "tests")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    served = json.loads(run.stdout.splitlines()[-1])
    assert served["status"] == 200
    assert not [m for m in served["modules"] if m.startswith(("slm_core.compile", "slm_core.api"))]
    assert "slm_core.serve.runtime" in served["modules"] and "slm_core.tasks.beam" in served["modules"]
    expected = load_package(archives["tiny_beam"], engine=Engine).beam("a small language model")
    assert [c["token_ids"] for c in json.loads(served["body"])["candidates"]] == [c["token_ids"] for c in expected]


def _as_cuda_package(archives, tmp_path) -> Path:
    """A copy of tiny_score whose manifest says it was built for CUDA capability 9.0."""
    copy = tmp_path / "pkg"
    shutil.copytree(archives["tiny_score"], copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest.update(device="cuda")
    manifest["versions"]["capability"] = [9, 0]
    (copy / MANIFEST).write_text(json.dumps(manifest))
    return copy


class FakeCuda:
    """Two H200s as torch.cuda reports them, recording what the worker does with them; the graph
    loader, CUDA-graph replay and engine record where they were put instead of touching a GPU."""

    def __init__(self, monkeypatch):
        import slm_core.serve.loader as loader

        self.calls = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: self.record("capability", d) or (9, 0))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: self.record("set_device", d))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 0)
        monkeypatch.setattr(
            loader,
            "load_graph",
            lambda path, device, run_single_threaded=False: (
                self.record("load", (device, run_single_threaded)) or "graph"
            ),
        )
        monkeypatch.setattr(
            loader,
            "CudaGraphs",
            lambda graph, task, device, constants, stream: (
                self.record("replay", (device, stream)) or SimpleNamespace(graphs={})
            ),
        )
        monkeypatch.setattr(
            loader,
            "Runtime",
            lambda graph, task, device, replay=None, headroom=0.0: (
                self.record("engine", (graph, device))
                or SimpleNamespace(
                    task=task,
                    device=device,
                    constants=(),
                    context=SimpleNamespace(replay=replay, stream="s"),
                    synthetic_call=lambda sequences, tokens: self.record("call", (sequences, tokens)),
                )
            ),
        )

    def record(self, what, arg):
        self.calls.append((what, arg))


@pytest.mark.parametrize("gpu_id, index", [(1, 1), (0, 0), (None, 0)])
def test_worker_places_everything_on_its_gpu(archives, tmp_path, monkeypatch, gpu_id, index):
    """TorchServe gives each worker a gpu_id (round-robin over the GPUs or the archive's
    deviceIds): the worker makes it the current device before anything is loaded, then loads the
    compiled graph, the CUDA-graph replay and the engine onto cuda:{gpu_id}, and makes its first
    call there before any request's."""
    cuda = FakeCuda(monkeypatch)
    ctx = MockContext(_as_cuda_package(archives, tmp_path), ServingSpec("cuda", 2, 2, 8).model_config())
    ctx.system_properties["gpu_id"] = gpu_id
    handler = SlmHandler()
    handler.initialize(ctx)
    device = torch.device("cuda", index)
    assert handler.engine.device == device
    assert cuda.calls == [
        ("set_device", device),
        ("capability", device),
        ("load", (device, True)),
        ("engine", ("graph", device)),
        ("replay", (device, "s")),  # on the request context's stream
        ("call", (1, 1)),  # one call at load, of one 1-token sequence: the process's first call
    ]


def test_worker_without_cuda_graphs_loads_the_runner_for_several_threads(archives, tmp_path, monkeypatch):
    cuda = FakeCuda(monkeypatch)
    ctx = MockContext(
        _as_cuda_package(archives, tmp_path), ServingSpec("cuda", 1, 2, 8, cuda_graphs=False).model_config()
    )
    SlmHandler().initialize(ctx)
    assert ("load", (torch.device("cuda", 0), False)) in cuda.calls
    assert not [c for c in cuda.calls if c[0] == "replay"]


def test_worker_given_a_gpu_the_host_lacks_is_refused(archives, tmp_path, monkeypatch):
    cuda = FakeCuda(monkeypatch)
    with pytest.raises(SpecError, match="worker was given GPU 2, this host has 2"):
        load_package(_as_cuda_package(archives, tmp_path), gpu_id=2)
    assert cuda.calls == []  # refused before touching any device


def test_mps_running_finds_the_control_daemon_by_its_program(tmp_path):
    """mps_running reads each process's program from /proc/PID/cmdline (its name in
    /proc/PID/comm stops at 15 characters, nvidia-cuda-mps, the server's too)."""
    from slm_core.serve.loader import mps_running

    fake = tmp_path / "proc"
    (fake / "1").mkdir(parents=True)
    (fake / "1" / "cmdline").write_bytes(b"/usr/bin/python3\0-m\0nvidia-cuda-mps-control\0")
    (fake / "self").mkdir()
    assert not mps_running(fake)  # named as an argument only
    (fake / "77").mkdir()
    (fake / "77" / "cmdline").write_bytes(b"/usr/local/nvidia/bin/nvidia-cuda-mps-control\0-d\0")
    assert mps_running(fake)
    already = mps_running()  # the real /proc: a process that calls itself the daemon is found
    with subprocess.Popen(["nvidia-cuda-mps-control", "30"], executable="/bin/sleep") as daemon:
        try:  # its /proc/PID/cmdline reads empty until the child has exec'd (a loaded host: milliseconds)
            deadline = time.monotonic() + 5
            while not mps_running() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert mps_running()
        finally:
            daemon.kill()
    assert mps_running() == already


def test_workers_share_a_gpu_counts_the_gpus_they_are_dealt_to():
    """The handler's MPS warning is for workers that share a GPU: more of them than GPUs, the
    archive's deviceIds when it names some, else the host's."""

    def spec(workers, ids=()):
        return ServingSpec("cuda", workers, 1, 1, device_ids=ids)

    assert workers_share_a_gpu(spec(2), host_gpus=1)
    assert not workers_share_a_gpu(spec(2), host_gpus=2)
    assert not workers_share_a_gpu(spec(2, (0, 1)), host_gpus=8)
    assert workers_share_a_gpu(spec(4, (0, 1)), host_gpus=8)
    assert workers_share_a_gpu(spec(3, (0, 1)), host_gpus=2)
    assert not workers_share_a_gpu(spec(1), host_gpus=0)


def test_a_batch_is_marked_in_flight_while_it_is_handled(archives, tmp_path, monkeypatch):
    """What deploy/drain.py waits for: the batch's requests marked in SLM_IN_FLIGHT_DIR while the
    handler computes them, the mark gone once they are answered."""
    import handlers.slm_handler as slm_handler

    monkeypatch.setenv("SLM_IN_FLIGHT_DIR", str(tmp_path))
    ctx = MockContext(archives["tiny_score"], ServingSpec("cpu", 1, 3, 30).model_config())
    handler = SlmHandler()
    handler.initialize(ctx)
    marks, respond = [], slm_handler.respond_batch

    def watched(*args):
        marks.append([p.read_text() for p in tmp_path.iterdir()])
        return respond(*args)

    monkeypatch.setattr(slm_handler, "respond_batch", watched)
    out = handler.handle([{"body": b'{"texts": ["a"]}'}, {"body": b'{"texts": ["b", "c"]}'}], ctx)
    assert len(out) == 2 and marks == [["2"]] and list(tmp_path.iterdir()) == []


def test_the_accuracy_guard_histograms_move_when_the_served_graph_is_perturbed(archives, caplog):
    """The online accuracy guard in a worker (every request sampled): against a reference that
    answers as the served graph, its histograms hold differences of ~0 and no breach; with the
    served graph's probabilities perturbed by 0.05, the same requests' differences move to 0.05,
    each one past the 0.01 threshold is a breach counted and logged with its request id. A CPU fp32
    archive has no reference: its worker runs no guard."""
    from slm_core.serve.accuracy_guard import AccuracyGuard

    ctx = MockContext(archives["tiny_score"], ServingSpec("cpu", 1, 3, 30).model_config(), [{}, {}, {}])
    ctx.request_ids = {0: "req-a", 1: "req-b", 2: "req-c"}
    handler = SlmHandler()
    handler.initialize(ctx)
    assert handler.guard is None
    reference = Engine.from_package(archives["tiny_score"])
    handler.guard = AccuracyGuard(reference, share=1.0, max_diff=0.01, min_shared=0.6).start()
    batch = [
        {"body": b'{"texts": ["search engines", "a"]}'},
        {"body": b'{"texts": ["the lazy dog"]}'},
        {"body": b'{"texts": 7}'},  # refused: nothing to compare
    ]

    def observed(name: str) -> list[float]:
        handler.guard.wait()
        share, handler.guard.share = handler.guard.share, 0.0
        handler.handle(batch[1:2], ctx)  # the next batch (not sampled) records what the guard compared
        handler.guard.share = share
        return ctx.histograms.pop((name, "count"), [])

    handler.handle(batch, ctx)
    diffs = observed("SlmAccuracyMaxAbsDiff")
    assert len(diffs) == 2 and max(diffs) < 1e-5
    assert "SlmAccuracyBreaches" not in ctx.counters
    assert ctx.histograms[("SlmAccuracyBestSame", "count")] == [1.0, 1.0]
    graph = handler.engine.graph

    def perturbed(*args):
        out = graph(*args)
        return (out[0] + 0.05, *out[1:]) if isinstance(out, tuple) else out + 0.05

    handler.engine.graph = perturbed
    with caplog.at_level("WARNING"):
        handler.handle(batch, ctx)
        diffs = observed("SlmAccuracyMaxAbsDiff")
    assert len(diffs) == 2 and all(d == pytest.approx(0.05, abs=1e-4) for d in diffs)
    assert ctx.counters["SlmAccuracyBreaches"] == 2
    assert "req-a" in caplog.text and "req-b" in caplog.text
