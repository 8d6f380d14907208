"""Compiled packages: equal to eager, manifest contents, refusal of incompatible builds, and the
handler lifecycle with a mock TorchServe context."""

import argparse
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import BEAM_TASK, SCORE_TASK
from handlers.slm_handler import SlmHandler
from slm_core import Engine, SpecError
from slm_core.package import MANIFEST, load_package
from slm_core.spec import TaskSpec

TEXTS = ["a", "search engines rank documents", "the lazy dog " * 4, "12, 345 and 6789", "x y", "beam", "fox", "z"]


def test_compiled_score_equals_eager(archives):
    compiled = load_package(archives["tiny_score"])
    eager = Engine.from_checkpoint(archives["checkpoint"], task=SCORE_TASK)
    for texts in (TEXTS[:1], TEXTS[1:3], TEXTS):
        for row, ref in zip(compiled.score(texts), eager.score(texts)):
            assert row == pytest.approx(ref, abs=1e-5)
    assert compiled.score(TEXTS) == compiled.score(TEXTS)


def test_compiled_beam_equals_eager(archives):
    compiled = load_package(archives["tiny_beam"])
    eager = Engine.from_checkpoint(archives["checkpoint"], task=BEAM_TASK)
    for prompt in ("a", "a small language model", "search engines rank documents for a query"):
        ours, ref = compiled.beam(prompt), eager.beam(prompt)
        assert [c["token_ids"] for c in ours] == [c["token_ids"] for c in ref]
        for c, r in zip(ours, ref):
            assert c["score"] == pytest.approx(r["score"], abs=1e-5)
    assert compiled.beam("a small language model") == compiled.beam("a small language model")


def test_compiled_graphs_take_a_batch_of_any_size_up_to_max_batch(archives):
    """The archives batch requests (score max_batch 3, beam 2): every batch size from 1 to the
    bound runs in one compiled call and answers each request as its own call does."""
    score = load_package(archives["tiny_score"])
    requests = [TEXTS[:1], TEXTS[1:3], TEXTS]
    for size in (1, 2, 3):
        for texts, (rows, stats) in zip(requests, score.run_score_batch(requests[:size])):
            assert stats.batch == size
            for row, ref in zip(rows, score.score(texts)):
                assert row == pytest.approx(ref, abs=1e-6)
    beam = load_package(archives["tiny_beam"])
    prompts = ["a", "search engines rank documents for a query"]
    for size in (1, 2):
        for prompt, (candidates, stats) in zip(prompts, beam.run_beam_batch(prompts[:size])):
            assert stats.batch == size
            assert [c["token_ids"] for c in candidates] == [c["token_ids"] for c in beam.beam(prompt)]


def test_manifest_records_what_serving_needs(archives):
    manifest = json.loads((archives["tiny_score"] / MANIFEST).read_text())
    assert manifest["device"] == "cpu" and manifest["dtype"] == "float32"
    assert manifest["task"]["labels"] == ["yes", "no"] and len(manifest["label_ids"]) == 2
    assert manifest["architecture"]["arch"] == "qwen3" and manifest["versions"]["torch"] == torch.__version__
    assert manifest["check"]["max_abs_diff"] <= manifest["check"]["tolerance"]
    assert "cu_seqlens" in " ".join(manifest["graph"]["signature"]["inputs"])
    beam = json.loads((archives["tiny_beam"] / MANIFEST).read_text())
    assert beam["stop_ids"] and beam["check"]["shared_candidates"] == 1.0
    assert 0 < beam["full_call_ms"] < 60_000 and 0 < manifest["full_call_ms"] < 60_000


def test_the_queue_is_sized_for_the_deadline(archives):
    """Without --queue the archiver allows as many waiting requests as finish within 90 % of the
    deadline (tiny_beam: --deadline-ms 80, the CUDA default), from the calls it timed at build,
    behind the calls that run at once; --queue overrides it. Sync workers sharing a GPU split
    max_batch, so that their calls together hold one full call."""
    import yaml

    from archiver.build import Admission, admission, call_time, model_config, queue_for_deadline, worker_batch

    # 2 calls of 4 at once, 12 ms each: a request behind 12 others finishes after (12 / 4 + 2 + 1) x 12 = 72 ms
    assert queue_for_deadline(80, 12, per_call=4, calls=2) == 12
    assert queue_for_deadline(80, 40, 2, 1) == 1 and queue_for_deadline(80, 200, 8, 1) == 1
    assert queue_for_deadline(80, 12, 4, 2, gpus=2) == 24  # workers spread over two GPUs serve twice as many
    assert worker_batch(8, 1) == 8 and worker_batch(8, 2) == 4 and worker_batch(8, 3) == 3
    assert worker_batch(8, 4, gpus=2) == 4 and worker_batch(8, 2, contexts=2) == 1
    # TorchServe's batch delay: 1 ms unless told; never 0, which TorchServe reads in an archive as 100 ms
    assert model_config("cuda", 2, 60, batch=2)["maxBatchDelay"] == 1
    assert model_config("cuda", 2, 60, batch=2, batch_delay_ms=5)["maxBatchDelay"] == 5  # --batch-delay-ms
    with pytest.raises(SpecError, match="100 ms"):
        model_config("cuda", 2, 60, batch=2, batch_delay_ms=0)
    beam = {"1": 8.0, "2": 9.6, "4": 12.5, "8": 18.1}  # the H200 beam archive's calls at the bounds (ms)
    assert call_time(beam, 3) == 12.5 and call_time(beam, 8) == 18.1 and call_time(beam, 9) == 18.1
    assert admission(80, beam, 8, workers=2) == Admission(batch=4, queue=11, call_ms=12.5, per_call=4, calls=2)
    assert admission(80, beam, 8, workers=1) == Admission(8, 15, 18.1, 8, 1)
    assert admission(80, beam, 8, workers=1, contexts=2) == Admission(1, 7, 18.1, 8, 2)  # 2 contexts: 2 calls of 8
    assert admission(80, beam, 8, workers=2, batch=2) == Admission(2, 9, 9.6, 2, 2)  # TorchServe's batch given
    # async workers bound their own queues: 2 of them on one GPU (4 calls of 8 at once) share its queue
    assert admission(80, {"8": 10.0}, 8, workers=2, contexts=2) == Admission(1, 8, 10.0, 8, 4)  # 17 // 2
    assert admission(80, {"8": 10.0}, 8, workers=2, contexts=2, gpus=2) == Admission(1, 33, 10.0, 8, 2)
    manifest = json.loads((archives["tiny_beam"] / MANIFEST).read_text())
    b = manifest["task"]["max_batch"]
    assert set(manifest["call_ms"]) == {"1", "2", str(b)} and manifest["full_call_ms"] == manifest["call_ms"][str(b)]
    config = yaml.safe_load((archives["tiny_beam"] / "model-config.yaml").read_text())
    assert (config["batchSize"], config["jobQueueSize"]) == admission(80, manifest["call_ms"], b, 1)[:2]
    score = yaml.safe_load((archives["tiny_score"] / "model-config.yaml").read_text())
    assert score["jobQueueSize"] == 30  # built with --queue 30


def test_device_ids_reach_model_config_of_cuda_builds():
    from archiver.__main__ import _ids
    from archiver.build import model_config

    assert model_config("cuda", 2, 60, device_ids=[0, 1])["deviceIds"] == [0, 1]
    assert "deviceIds" not in model_config("cuda", 2, 60) and "deviceIds" not in model_config("cpu", 1, 60, device_ids=[0])
    assert _ids("0,1") == [0, 1]
    for bad in ("0,0", "-1", "a"):
        with pytest.raises(argparse.ArgumentTypeError):
            _ids(bad)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m["versions"].update(torch="1.0.0"), "built with torch 1.0.0, this worker has"),
        (lambda m: m.update(format=99), "package format 99"),
    ],
)
def test_incompatible_packages_are_refused(archives, tmp_path, edit, message):
    import shutil

    copy = tmp_path / "pkg"
    shutil.copytree(archives["tiny_score"], copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    edit(manifest)
    (copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(SpecError, match=message):
        load_package(copy)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_package_refused_without_cuda(archives, tmp_path):
    import shutil

    copy = tmp_path / "pkg"
    shutil.copytree(archives["tiny_score"], copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["device"] = "cuda"
    (copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(SpecError, match="built for cuda, but this worker has no CUDA device"):
        load_package(copy)


def _as_cuda_package(archives, tmp_path) -> Path:
    """A copy of tiny_score whose manifest says it was built for CUDA capability 9.0."""
    import shutil

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
        import slm_core.package as package

        self.calls = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: self.record("capability", d) or (9, 0))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: self.record("set_device", d))
        monkeypatch.setattr(torch._inductor, "aoti_load_package",
                            lambda path, **kw: self.record("load", kw) or "graph")
        monkeypatch.setattr(package, "CudaGraphs", lambda graph, task, device: self.record("replay", device) or "replay")
        monkeypatch.setattr(package, "Engine", lambda graph, tok, task, runtime, replays=(None,):
                            self.record("engine", (getattr(graph, "fn", graph), runtime.device, list(replays)))
                            or SimpleNamespace(task=task, device=torch.device(runtime.device),
                                               contexts=[SimpleNamespace(replay=r) for r in replays]))

    def record(self, what, arg):
        self.calls.append((what, arg))


@pytest.mark.parametrize("gpu_id, index", [(1, 1), (0, 0), (None, 0)])
def test_worker_places_everything_on_its_gpu(archives, tmp_path, monkeypatch, gpu_id, index):
    """TorchServe gives each worker a gpu_id (round-robin over the GPUs or the archive's
    deviceIds): the handler makes it the current device before anything is loaded, then loads the
    compiled graph, the CUDA-graph replay and the engine's buffers onto cuda:{gpu_id}."""
    cuda = FakeCuda(monkeypatch)
    ctx = MockContext(_as_cuda_package(archives, tmp_path))
    ctx.system_properties["gpu_id"] = gpu_id
    handler = SlmHandler()
    handler.initialize(ctx)
    device = torch.device("cuda", index)
    assert handler.engine.device == device
    assert cuda.calls == [("set_device", device), ("capability", device),
                          ("load", {"run_single_threaded": True, "device_index": index}),
                          ("replay", device), ("engine", ("graph", str(device), ["replay"]))]


def test_worker_given_a_gpu_the_host_lacks_is_refused(archives, tmp_path, monkeypatch):
    cuda = FakeCuda(monkeypatch)
    with pytest.raises(SpecError, match="worker was given GPU 2, this host has 2"):
        load_package(_as_cuda_package(archives, tmp_path), gpu_id=2)
    assert cuda.calls == []  # refused before touching any device


class MockContext:
    """What SlmHandler uses of ts.context.Context."""

    def __init__(self, model_dir):
        self.system_properties = {"model_dir": str(model_dir), "gpu_id": None}
        self.status, self.headers, self.counters = {}, {}, {}
        self.metrics = self

    def set_response_status(self, code, phrase, idx):
        self.status[idx] = (code, phrase)

    def set_response_content_type(self, idx, value):
        self.set_response_header(idx, "Content-Type", value)

    def set_response_header(self, idx, key, value):
        self.headers.setdefault(idx, {})[key] = value

    def add_counter(self, name, value):
        self.counters[name] = self.counters.get(name, 0) + value

    def add_time(self, name, value):
        self.counters[name] = value


def test_handler_batch_with_good_and_bad_requests(archives):
    ctx = MockContext(archives["tiny_score"])
    handler = SlmHandler()
    handler.initialize(ctx)
    batch = [
        {"body": {"texts": ["search engines", "a"]}},
        {"body": b'{"texts": ['},
        {"body": {"texts": "not a list"}},
        {"data": b'{"texts": ["the lazy dog"]}'},
        {"hello": b""},
    ]
    out = handler.handle(batch, ctx)
    assert [ctx.status[i][0] for i in range(5)] == [200, 400, 400, 200, 400]
    assert all(ctx.headers[i]["Content-Type"] == "application/json" for i in range(5))
    # where each answered request's time went: its batch's handler time holds its graph call
    for i in (0, 3):
        timing = ctx.headers[i]
        assert 0 < float(timing["X-Slm-Graph-Ms"]) <= float(timing["X-Slm-Handler-Ms"])
        assert timing["X-Slm-Batch"] == "2" and timing["X-Slm-Captured"] == "0"  # no CUDA graphs on CPU
        assert timing["X-Slm-Worker"] == str(os.getpid())  # the worker that answered (bench.reliability)
    assert not any(k.startswith("X-Slm") for i in (1, 2, 4) for k in ctx.headers[i])  # refused: no call
    bodies = [json.loads(b) for b in out]
    assert bodies[0]["labels"] == ["yes", "no"] and len(bodies[0]["scores"]) == 2
    assert "not valid JSON" in bodies[1]["error"] and "must be an array of strings" in bodies[2]["error"]
    assert 'form fields "hello"' in bodies[4]["error"]
    # The two good requests shared one graph call (max_batch: 3); each equals its own call.
    assert bodies[3]["scores"][0] == pytest.approx(handler.engine.score(["the lazy dog"])[0], abs=1e-6)
    assert ctx.counters["SlmTexts"] == 3 and ctx.counters["SlmTokens"] > 3 and ctx.counters["SlmGraphTime"] > 0
    assert ctx.counters["SlmBatchedRequests"] == 2


def test_triton_kernels_are_refused_on_cpu_builds(random_checkpoint, tmp_path):
    """--attention triton / --topk triton compile for CUDA only: a CPU build says so before compiling."""
    from slm_core.checkpoint import load_checkpoint
    from slm_core.package import build_package
    from slm_core.spec import TaskSpec

    ckpt = load_checkpoint(random_checkpoint("qwen2")[0])
    task = TaskSpec.from_dict({"task": "beam", "beam_width": 2, "new_tokens": 2, "max_prompt_tokens": 16})
    for kernels in (dict(attention="triton"), dict(topk="triton")):
        with pytest.raises(SpecError, match="compile for CUDA only"):
            build_package(ckpt, task, "cpu", tmp_path / "pkg", **kernels)
    assert not (tmp_path / "pkg").exists()


def test_archiver_contexts_write_async_mode_and_defaults_follow_the_h200(capsys):
    """archiver --contexts N writes TorchServe's async mode with N request contexts (batchSize 1:
    the worker batches). Unset: 2 sync workers per GPU on CUDA (the async worker failed the H200
    overload, archiver.build.serving_defaults), CPU one sync worker."""
    from archiver.__main__ import main
    from archiver.build import model_config, serving_defaults

    score, beam = TaskSpec.from_dict(SCORE_TASK), TaskSpec.from_dict(BEAM_TASK)
    assert serving_defaults("cuda", score) == serving_defaults("cuda", beam) == (2, 0)
    assert serving_defaults("cuda", beam, gpus=2) == serving_defaults("cuda:0", score, gpus=2) == (4, 0)
    assert serving_defaults("cpu", score) == serving_defaults("cpu", beam) == (1, 0)

    config = model_config("cpu", 1, 60, batch=8, queue=20, contexts=3)
    assert config["asyncCommunication"] is True and config["batchSize"] == 1
    assert config["handler"] == {"cuda_graphs": True, "capture_at_load": True, "contexts": 3, "max_waiting": 20}
    assert "asyncCommunication" not in model_config("cpu", 1, 60, batch=8) and model_config("cpu", 1, 60, batch=8)["batchSize"] == 8
    for argv, message in ((["--workers", "0"], "at least 1"), (["--contexts", "-1"], "must be 0")):
        with pytest.raises(SystemExit):
            main(["build", "--checkpoint", "x", "--task", "t.yaml", "--model-name", "m", "--export-path", "o", *argv])
        assert message in capsys.readouterr().err
    # refused before anything is loaded or compiled (the checkpoint "x" does not exist)
    assert main(["build", "--checkpoint", "x", "--task", "t.yaml", "--model-name", "m", "--export-path", "o",
                 "--batch-delay-ms", "0"]) == 2
    assert "waits 100 ms" in capsys.readouterr().err


@pytest.mark.parametrize("config, message", [
    ({"handler": {"contexts": 2}}, "needs asyncCommunication"),
    ({"asyncCommunication": True, "batchSize": 8, "handler": {"contexts": 2, "capture_at_load": True}}, "batchSize: 1"),
    ({"asyncCommunication": True, "batchSize": 1, "handler": {"contexts": 2}}, "capture their CUDA graphs at load"),
])
def test_handler_refuses_async_settings_that_cannot_work(tmp_path, config, message):
    """The worker refuses, before loading anything, what would hang or fail later: several contexts
    in sync mode, TorchServe batching in async mode (0.12 kills the worker thread on a batch of
    two), several contexts capturing CUDA graphs lazily (captures must not overlap calls)."""
    ctx = MockContext(tmp_path)
    ctx.model_yaml_config = config
    with pytest.raises(SpecError, match=message):
        SlmHandler().initialize(ctx)


def test_mps_running_finds_the_control_daemon_by_its_program(tmp_path):
    """slm_core.package.mps_running reads each process's program from /proc/PID/cmdline (its name
    in /proc/PID/comm stops at 15 characters, nvidia-cuda-mps, the server's too)."""
    import subprocess

    from slm_core.package import mps_running

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
        try:
            assert mps_running()
        finally:
            daemon.kill()
    assert mps_running() == already


def test_workers_share_a_gpu_counts_the_gpus_they_are_dealt_to():
    """The handler's MPS warning is for workers that share a GPU: more of them than GPUs, the
    archive's deviceIds when it names some, else the host's."""
    from handlers.slm_handler import workers_share_a_gpu

    assert workers_share_a_gpu({"minWorkers": 2}, host_gpus=1)
    assert not workers_share_a_gpu({"minWorkers": 2}, host_gpus=2)
    assert not workers_share_a_gpu({"minWorkers": 2, "deviceIds": [0, 1]}, host_gpus=8)
    assert workers_share_a_gpu({"minWorkers": 4, "deviceIds": [0, 1]}, host_gpus=8)
    assert workers_share_a_gpu({"minWorkers": 3, "deviceIds": [0, 1]}, host_gpus=2)
    assert not workers_share_a_gpu({}, host_gpus=0)
