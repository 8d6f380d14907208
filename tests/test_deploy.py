"""deploy/: the manifests agree with the TorchServe config and serve.sh (structure only: no cluster
here), and serve.sh builds, reuses and serves archives (on CPU, with the embedded SmolLM2)."""

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from handlers.local_server import free_ports, http

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
SERVE = DEPLOY / "serve.sh"
TASK = REPO / "archiver" / "tasks" / "smollm2-intent.yaml"


def properties(path: Path) -> dict[str, str]:
    lines = [l.strip() for l in path.read_text().splitlines()]
    return dict(l.split("=", 1) for l in lines if l and not l.startswith("#"))


CONFIG = properties(DEPLOY / "config.properties")
INFERENCE_PORT = urlparse(CONFIG["inference_address"]).port
METRICS_PORT = urlparse(CONFIG["metrics_address"]).port
# The settings serve.sh reads, from its `NAME=${NAME:-default}` lines.
SERVE_DEFAULTS = dict(re.findall(r"^(\w+)=\$\{\1:-([^}]*)\}", SERVE.read_text(), re.M))


def replicas() -> list[tuple[dict, dict]]:
    """(pod spec, annotations that reach the pod) of every workload in the two manifests."""
    found = []
    for name in ("kserve.yaml", "k8s.yaml"):
        for doc in yaml.safe_load_all((DEPLOY / name).read_text()):
            if doc["kind"] == "InferenceService":
                found.append((doc["spec"]["predictor"], doc["metadata"]["annotations"]))
            elif doc["kind"] == "Deployment":
                template = doc["spec"]["template"]
                found.append((template["spec"], template["metadata"]["annotations"]))
    assert len(found) == 2
    return found


def test_config_one_gpu_per_replica_and_management_on_loopback():
    assert CONFIG["number_of_gpu"] == "1"
    assert urlparse(CONFIG["management_address"]).hostname == "127.0.0.1"
    assert urlparse(CONFIG["inference_address"]).hostname == "0.0.0.0"
    assert CONFIG["metrics_address"] == "http://0.0.0.0:8082" and CONFIG["metrics_mode"] == "prometheus"
    assert CONFIG["load_models"] == "all" and CONFIG["model_store"] == SERVE_DEFAULTS["MODEL_STORE"]


@pytest.mark.parametrize("index", [0, 1], ids=["kserve", "k8s"])
def test_manifest_agrees_with_config_and_serve_sh(index):
    pod, annotations = replicas()[index]
    [container] = pod["containers"]
    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    assert limits["nvidia.com/gpu"] == 1 and requests["nvidia.com/gpu"] == 1
    ports = [p["containerPort"] for p in container["ports"]]
    assert ports == [INFERENCE_PORT, METRICS_PORT]  # KServe routes to the first
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/ping", "port": INFERENCE_PORT}, probe
    assert annotations["prometheus.io/port"] == str(METRICS_PORT)
    assert annotations["prometheus.io/path"] == "/metrics"

    env = {e["name"]: e["value"] for e in container["env"]}
    assert set(env) - {"STORAGE_URI"} <= set(SERVE_DEFAULTS)
    assert {"CHECKPOINT", "TASKS_DIR", "MODEL_STORE"} <= set(env)
    assert env["CHECKPOINT"] == "/mnt/models/checkpoint" and env["TASKS_DIR"] == "/mnt/models/tasks"
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert not mounts[env["MODEL_STORE"]].get("readOnly", False)  # archives are built into it
    volume = {v["name"]: v for v in pod["volumes"]}[mounts[env["MODEL_STORE"]]["name"]]
    assert "emptyDir" in volume or "persistentVolumeClaim" in volume


def test_kserve_specifics():
    docs = list(yaml.safe_load_all((DEPLOY / "kserve.yaml").read_text()))
    [isvc] = docs
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1"
    assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"
    # "true" would point prometheus.io/port at Knative's queue-proxy, absent in RawDeployment.
    assert isvc["metadata"]["annotations"]["serving.kserve.io/enable-prometheus-scraping"] == "false"
    predictor = isvc["spec"]["predictor"]
    assert 1 <= predictor["minReplicas"] <= predictor["maxReplicas"]
    [container] = predictor["containers"]
    assert container["name"] == "kserve-container"
    assert any(e["name"] == "STORAGE_URI" for e in container["env"])  # triggers the storage initializer


def test_k8s_service_targets_the_container_ports():
    deployment, service = yaml.safe_load_all((DEPLOY / "k8s.yaml").read_text())
    assert deployment["spec"]["replicas"] >= 1
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert sorted(p["targetPort"] for p in service["spec"]["ports"]) == [INFERENCE_PORT, METRICS_PORT]


def test_dockerfile_exposes_the_config_ports_and_runs_serve_sh():
    text = (DEPLOY / "Dockerfile").read_text()
    [exposed] = re.findall(r"^EXPOSE (.+)$", text, re.M)
    assert sorted(map(int, exposed.split())) == [INFERENCE_PORT, METRICS_PORT]
    assert "/opt/slm-serve/deploy/serve.sh" in re.search(r"^ENTRYPOINT (.+)$", text, re.M)[1]
    assert re.search(r"^USER (?!root|0\b)", text, re.M)
    assert os.access(SERVE, os.X_OK)


def test_serve_sh_passes_shell_checks():
    subprocess.run(["bash", "-n", str(SERVE)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", str(SERVE)], check=True)


# serve.sh itself, with a stand-in archiver (fast) and then the real one.

FAKE_ARCHIVER = """#!/usr/bin/env bash
# Stands in for `python -m archiver build ...`: logs its arguments, writes NAME.mar where it is told.
echo "$*" >> "$FAKE_LOG"
while (($#)); do case $1 in --model-name) name=$2 ;; --export-path) out=$2 ;; esac; shift; done
echo half > "$out/$name.mar"
[[ ${FAKE_FAIL:-0} == 1 ]] && exit 1
echo whole > "$out/$name.mar"
"""


def serve_env(tmp_path: Path, python: str, checkpoint: str, **extra) -> dict:
    tasks = tmp_path / "tasks"
    if not tasks.exists():
        tasks.mkdir()
        shutil.copy(TASK, tasks)
    return {**os.environ, "PYTHON": python, "CHECKPOINT": checkpoint, "TASKS_DIR": str(tasks),
            "MODEL_STORE": str(tmp_path / "store"), "DEVICE": "cpu", "BUILD_ONLY": "1", **extra}


def run_serve(env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(SERVE)], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def fake(tmp_path):
    script = tmp_path / "fake-archiver"
    script.write_text(FAKE_ARCHIVER)
    script.chmod(0o755)
    env = serve_env(tmp_path, str(script), str(TASK), FAKE_LOG=str(tmp_path / "calls.log"),
                    ARCHIVER_ARGS="--deadline-ms 50 --cuda-graphs off")
    return env, tmp_path / "store"


def test_builds_each_task_once_into_place(fake):
    env, store = fake
    result = run_serve(env)
    assert result.returncode == 0, result.stderr
    assert (store / "smollm2-intent.mar").read_text() == "whole\n"
    assert [p.name for p in store.iterdir() if p.name.startswith(".build")] == []
    [call] = Path(env["FAKE_LOG"]).read_text().splitlines()
    assert call.startswith("-m archiver build --checkpoint ") and "--model-name smollm2-intent" in call
    assert call.endswith("--device cpu --deadline-ms 50 --cuda-graphs off")

    again = run_serve(env)
    assert again.returncode == 0 and "reusing" in again.stdout
    assert len(Path(env["FAKE_LOG"]).read_text().splitlines()) == 1


def test_a_failed_build_leaves_no_archive(fake):
    env, store = fake
    result = run_serve({**env, "FAKE_FAIL": "1"})
    assert result.returncode != 0
    assert not (store / "smollm2-intent.mar").exists()  # the half archive stays hidden
    assert run_serve(env).returncode == 0  # the next start cleans up and builds
    assert [p.name for p in store.iterdir() if not p.name.endswith(".lock")] == ["smollm2-intent.mar"]


def test_waits_for_a_replica_building_the_same_archive(fake):
    env, store = fake
    store.mkdir()
    with open(store / ".smollm2-intent.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another replica is building
        proc = subprocess.Popen([str(SERVE)], env={**env, "PYTHON": "false"}, stdout=subprocess.PIPE, text=True)
        time.sleep(1)  # had it not waited, it would have run `false` by now and failed
        (store / "smollm2-intent.mar").write_text("built elsewhere\n")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "built by another replica" in out


@pytest.mark.parametrize("what", ["tasks", "checkpoint"])
def test_refuses_without_tasks_or_checkpoint(tmp_path, what):
    (tmp_path / "empty").mkdir()
    env = serve_env(tmp_path, sys.executable, str(TASK))
    if what == "tasks":
        env["TASKS_DIR"] = str(tmp_path / "empty")
    else:
        env["CHECKPOINT"] = str(tmp_path / "missing.gguf")
    result = run_serve(env)
    assert result.returncode == 2
    assert {"tasks": "no task YAML in TASKS_DIR", "checkpoint": "no checkpoint at CHECKPOINT"}[what] in result.stderr
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").iterdir())


@pytest.mark.slow
def test_serves_the_real_archive_it_finds(tmp_path, demo):
    """The entrypoint as a replica runs it, on CPU, with the demo's smollm2_intent.mar already in
    its model store (building is the stand-in tests' part): it does not build, then serves it with
    the deploy config (its ports moved to free ones) and answers /ping, a prediction and /metrics."""
    from conftest import smollm2_path

    (tmp_path / "tasks").mkdir()
    shutil.copy(TASK, tmp_path / "tasks" / "smollm2_intent.yaml")
    (tmp_path / "store").mkdir()
    shutil.copy(demo[0] / "model-store" / "smollm2_intent.mar", tmp_path / "store")
    bindir = str(Path(sys.executable).parent)  # torchserve, as the image's PATH has it
    # `false` as Python: the archiver is never run
    env = serve_env(tmp_path, "false", smollm2_path(), PATH=f"{bindir}:{os.environ['PATH']}")

    inference, management, metrics, grpc_i, grpc_m, workers = free_ports(6)
    config = {**CONFIG, "inference_address": f"http://127.0.0.1:{inference}",
              "management_address": f"http://127.0.0.1:{management}",
              "metrics_address": f"http://127.0.0.1:{metrics}", "grpc_inference_port": str(grpc_i),
              "grpc_management_port": str(grpc_m), "initial_worker_port": str(workers)}
    (tmp_path / "ts.properties").write_text("".join(f"{k}={v}\n" for k, v in config.items()))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "tmp").mkdir()
    serve = {**env, "BUILD_ONLY": "0", "TS_CONFIG": str(tmp_path / "ts.properties"),
             "TMPDIR": str(tmp_path / "run" / "tmp"), "LOG_LOCATION": str(tmp_path / "run" / "logs"),
             "METRICS_LOCATION": str(tmp_path / "run" / "logs")}
    log = open(tmp_path / "run" / "stdout.log", "wb")
    proc = subprocess.Popen([str(SERVE)], env=serve, cwd=tmp_path / "run", stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # its own process group: killed whole below
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "run" / "stdout.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "not healthy in 300 s"
            try:
                if http("GET", f"http://127.0.0.1:{inference}/ping", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(1)
        status, body = http("POST", f"http://127.0.0.1:{inference}/predictions/smollm2_intent",
                            json.dumps({"texts": ["cheap flights to rome"]}).encode(),
                            {"Content-Type": "application/json"})
        assert status == 200, body
        answer = json.loads(body)
        assert answer["labels"] == ["Yes", "No"] and sum(answer["scores"][0]) == pytest.approx(1, abs=1e-5)
        status, body = http("GET", f"http://127.0.0.1:{metrics}/metrics")
        assert status == 200 and b"ts_inference_requests_total" in body
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
