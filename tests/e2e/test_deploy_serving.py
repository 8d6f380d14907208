"""deploy/serve.sh as a replica runs it, through a real TorchServe (CPU, the demo's archive)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from deploy_env import CONFIG, DEPLOY, SERVE, TASK, serve_env, stop_replica

from handlers.local_server import free_ports, http


@pytest.mark.slow
def test_serves_the_real_archive_it_finds(tmp_path, demo):
    """The entrypoint as a replica runs it, on CPU, with the demo's smollm2_intent.mar already in
    its model store (building is the stand-in tests' part): it does not build, then serves it with
    the deploy config (its ports moved to free ones). The readiness probe (deploy/ready.py) says
    ready once the model has a READY worker, and a request then is answered at once; /metrics
    answers; a store archive TorchServe does not serve keeps the probe not ready. Then SIGTERM
    to serve.sh alone, as Kubernetes sends it, under load of calls longer than the drain's quiet
    period (DRAIN_QUIET 0.3 s), sent to TorchServe directly and through the KServe gateway
    (KSERVE_GATEWAY=1): the probe says draining at once, the load stops as the Service would stop
    sending, every request sent either way is answered 200, and serve.sh exits 0 once TorchServe
    has stopped."""
    from conftest import smollm2_path

    (tmp_path / "tasks").mkdir()
    shutil.copy(TASK, tmp_path / "tasks" / "smollm2_intent.yaml")
    (tmp_path / "store").mkdir()
    shutil.copy(demo[0] / "model-store" / "smollm2_intent.mar", tmp_path / "store")
    bindir = str(Path(sys.executable).parent)  # torchserve, as the image's PATH has it
    # `false` as Python: the archiver is never run
    env = serve_env(tmp_path, "false", smollm2_path(), PATH=f"{bindir}:{os.environ['PATH']}")

    inference, management, metrics, grpc_i, grpc_m, workers, gateway = free_ports(7)
    config = {
        **CONFIG,
        "inference_address": "http://0.0.0.0:1",  # serve.sh moves it (TS_INFERENCE_ADDRESS)
        "management_address": f"http://127.0.0.1:{management}",
        "metrics_address": f"http://127.0.0.1:{metrics}",
        "grpc_inference_port": str(grpc_i),
        "grpc_management_port": str(grpc_m),
        "initial_worker_port": str(workers),
    }
    (tmp_path / "ts.properties").write_text("".join(f"{k}={v}\n" for k, v in config.items()))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "tmp").mkdir()
    drain_file = str(tmp_path / "run" / "draining")  # the container's one TMPDIR, as serve.sh and the probe share it
    serve = {
        **env,
        "BUILD_ONLY": "0",
        "TS_CONFIG": str(tmp_path / "ts.properties"),
        "DRAIN_FILE": drain_file,
        "DRAIN_QUIET": "0.3",  # shorter than a call here: the drain must wait for the calls in the workers
        "KSERVE_GATEWAY": "1",
        "TS_INFERENCE_ADDRESS": f"http://127.0.0.1:{inference}",
        "GATEWAY_ADDRESS": f"127.0.0.1:{gateway}",
        "GRPC_ADDRESS": "",  # the gateway's gRPC has its own test (test_kserve_serving.py)
        "MANAGEMENT": f"http://127.0.0.1:{management}",
        "TMPDIR": str(tmp_path / "run" / "tmp"),
        "LOG_LOCATION": str(tmp_path / "run" / "logs"),
        "METRICS_LOCATION": str(tmp_path / "run" / "logs"),
    }
    log = open(tmp_path / "run" / "stdout.log", "wb")
    proc = subprocess.Popen(
        [str(SERVE)], env=serve, cwd=tmp_path / "run", stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )  # its own process group: killed whole below

    def ready(store: Path) -> subprocess.CompletedProcess:  # the readiness probe, as the manifests run it
        return subprocess.run(
            [sys.executable, str(DEPLOY / "ready.py")],
            capture_output=True,
            text=True,
            timeout=30,
            env={
                **os.environ,
                "MODEL_STORE": str(store),
                "MANAGEMENT": f"http://127.0.0.1:{management}",
                "DRAIN_FILE": drain_file,
            },
        )

    try:
        start, healthy, deadline = time.monotonic(), None, time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "run" / "stdout.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "not ready in 300 s"
            try:
                if healthy is None and http("GET", f"http://127.0.0.1:{inference}/ping", timeout=2)[0] == 200:
                    healthy = time.monotonic() - start
            except OSError:
                pass
            probe = ready(tmp_path / "store")
            if probe.returncode == 0:
                break
            assert "smollm2_intent" in probe.stderr, probe.stderr  # the reason names the model
            time.sleep(0.5)
        print(f"\n/ping Healthy after {healthy} s, ready.py ready after {time.monotonic() - start:.1f} s")
        # ready means a request is answered at once
        status, body = http(
            "POST",
            f"http://127.0.0.1:{inference}/predictions/smollm2_intent",
            json.dumps({"texts": ["cheap flights to rome"]}).encode(),
            {"Content-Type": "application/json"},
            timeout=30,
        )
        assert status == 200, body
        # an archive in the store that TorchServe does not serve: not ready, named
        (tmp_path / "other").mkdir()
        for name in ("smollm2_intent.mar", "ghost.mar"):
            (tmp_path / "other" / name).touch()
        probe = ready(tmp_path / "other")
        assert probe.returncode == 1 and "ghost: not registered (404)" in probe.stderr, probe.stderr
        assert "smollm2_intent" not in probe.stderr
        answer = json.loads(body)
        assert answer["labels"] == ["Yes", "No"] and sum(answer["scores"][0]) == pytest.approx(1, abs=1e-5)
        status, body = http("GET", f"http://127.0.0.1:{metrics}/metrics")
        assert status == 200 and b"ts_inference_requests_total" in body
        # metrics.yaml through serve.sh: TorchServe's queue wait as a histogram
        assert b"QueueTime_bucket" in body and b"SlmGraphCallSeconds_bucket" in body
        drain_under_load(
            proc,
            [f"http://127.0.0.1:{port}/predictions/smollm2_intent" for port in (inference, gateway)],
            lambda: ready(tmp_path / "store"),
            tmp_path / "run" / "stdout.log",
        )
    finally:
        stop_replica(proc, timeout=30)
        log.close()


def drain_under_load(proc: subprocess.Popen, urls: list[str], ready, log: Path) -> None:
    """SIGTERM to serve.sh while a client per URL sends requests back to back, each a call longer
    than the drain's quiet period. A stand-in for the Service stops sending 0.5 s after the probe
    first says draining (the endpoint update). Every request sent gets its 200; serve.sh says it
    drained and exits 0."""
    import threading

    texts = ["cheap flights to rome and back " * 9, "iphone case with a strap " * 9] * 2  # ~110 tokens each
    body = json.dumps({"texts": texts}).encode()
    statuses: dict[str, list] = {url: [] for url in urls}
    graph_ms: list = []
    sending = threading.Event()
    sending.set()

    def client(url: str):
        while sending.is_set():
            headers: dict = {}
            try:
                statuses[url].append(http("POST", url, body, {"Content-Type": "application/json"}, 60, headers)[0])
                graph_ms.append(float(headers.get("x-slm-graph-ms", 0)))
            except OSError as e:  # a reset or refused connection: a request lost
                statuses[url].append(repr(e))

    clients = [threading.Thread(target=client, args=(url,)) for url in urls]
    for c in clients:
        c.start()
    time.sleep(1.0)
    os.kill(proc.pid, signal.SIGTERM)  # serve.sh only, as the kubelet signals the container's first process
    start = time.monotonic()
    while time.monotonic() - start < 10:
        probe = ready()
        if probe.returncode == 1 and "draining" in probe.stderr:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the probe never said draining: {probe.stderr}")
    time.sleep(0.5)
    sending.clear()
    for c in clients:
        c.join()
    code = proc.wait(timeout=90)
    text = log.read_text(errors="replace")
    sent = {url: len(s) for url, s in statuses.items()}
    print(f"\ndrain: {sent} requests under load, stopped {time.monotonic() - start:.1f} s after SIGTERM")
    for url, got in statuses.items():  # directly and through the gateway alike
        assert got and all(s == 200 for s in got), (url, [s for s in got if s != 200][:5])
    assert code == 0 and "drained" in text, text[-2000:]
    assert min(graph_ms) > 300, graph_ms  # the premise: every call outlasts the quiet period
