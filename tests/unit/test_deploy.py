"""deploy/: the manifests agree with the TorchServe config and serve.sh (structure only: no cluster
here), and serve.sh builds and reuses archives (with a stand-in archiver;
tests/e2e/test_deploy_serving.py serves a real one)."""

import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from deploy_env import CONFIG, DEPLOY, INFERENCE_PORT, METRICS_PORT, SERVE, SERVE_DEFAULTS, TASK, serve_env


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
    # ready: every archive with a READY worker (deploy/ready.py, where the image puts it); alive: /ping
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["exec"]["command"] == ["python3", "/opt/slm-serve/deploy/ready.py"], probe
    assert container["livenessProbe"]["httpGet"] == {"path": "/ping", "port": INFERENCE_PORT}
    assert "WORKDIR /opt/slm-serve" in (DEPLOY / "Dockerfile").read_text()  # where COPY deploy/ puts ready.py
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
    # KServe's endpoints on the port KServe routes to, TorchServe behind them
    assert {e["name"]: e["value"] for e in container["env"]}["KSERVE_GATEWAY"] == "1"
    gateway = re.search(r'"GATEWAY_ADDRESS", "([\d.]+):(\d+)"', (DEPLOY / "kserve_gateway.py").read_text())
    assert gateway[1] == "0.0.0.0" and int(gateway[2]) == container["ports"][0]["containerPort"] == INFERENCE_PORT


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


def run_serve(env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(SERVE)], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def fake(tmp_path):
    script = tmp_path / "fake-archiver"
    script.write_text(FAKE_ARCHIVER)
    script.chmod(0o755)
    env = serve_env(
        tmp_path,
        str(script),
        str(TASK),
        FAKE_LOG=str(tmp_path / "calls.log"),
        ARCHIVER_ARGS="--deadline-ms 50 --no-cuda-graphs",
    )
    return env, tmp_path / "store"


def test_builds_each_task_once_into_place(fake):
    env, store = fake
    result = run_serve(env)
    assert result.returncode == 0, result.stderr
    assert (store / "smollm2-intent.mar").read_text() == "whole\n"
    assert [p.name for p in store.iterdir() if p.name.startswith(".build")] == []
    [call] = Path(env["FAKE_LOG"]).read_text().splitlines()
    assert call.startswith("-m archiver build --checkpoint ") and "--model-name smollm2-intent" in call
    assert call.endswith("--device cpu --deadline-ms 50 --no-cuda-graphs")

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


def fake_tools(tmp_path: Path, mps: "str | None") -> str:
    """A PATH of stand-ins: torchserve (logs CUDA_MPS_PIPE_DIRECTORY and exits), and
    nvidia-cuda-mps-control unless `mps` is None (exits with status `mps`); python3 and the
    system's tools after them."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    tools = {"torchserve": 'echo "torchserve $* pipes=$CUDA_MPS_PIPE_DIRECTORY" >> "$FAKE_LOG"'}
    if mps is not None:
        tools["nvidia-cuda-mps-control"] = f'echo "mps-control $*" >> "$FAKE_LOG"; exit {mps}'
    for name, body in tools.items():
        (bin_ / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_ / name).chmod(0o755)
    return f"{bin_}:{Path(sys.executable).parent}:/usr/bin:/bin"


@pytest.mark.parametrize("mps", ["0", "1", None], ids=["starts", "fails", "absent"])
def test_mps_starts_under_tmpdir_or_the_replica_refuses_to_serve(fake, tmp_path, mps):
    """On CUDA (MPS=1, the default) serve.sh starts NVIDIA's MPS daemon with its pipe and log
    directories under TMPDIR (the image's user cannot create the defaults), and TorchServe's
    workers get the same pipe directory; a daemon that cannot start, or no daemon binary, stops
    the replica with 2 and says how to serve without it (MPS=0), instead of serving time-sliced."""
    env, store = fake
    store.mkdir()
    (store / "smollm2-intent.mar").write_text("built\n")  # nothing to build
    (tmp_path / "tmp").mkdir()
    result = run_serve(
        {**env, "DEVICE": "cuda", "BUILD_ONLY": "0", "TMPDIR": str(tmp_path / "tmp"), "PATH": fake_tools(tmp_path, mps)}
    )
    calls = Path(env["FAKE_LOG"]).read_text() if Path(env["FAKE_LOG"]).exists() else ""
    if mps == "0":
        assert result.returncode == 0, result.stderr
        assert "mps-control -d" in calls and f"pipes={tmp_path / 'tmp' / 'nvidia-mps'}" in calls
        assert (tmp_path / "tmp" / "nvidia-mps").is_dir() and (tmp_path / "tmp" / "nvidia-mps-log").is_dir()
    else:
        assert result.returncode == 2 and "MPS=0 serves without it" in result.stderr, result.stderr
        assert "torchserve" not in calls
    (tmp_path / "off").mkdir()
    off = run_serve(
        {
            **env,
            "DEVICE": "cuda",
            "BUILD_ONLY": "0",
            "MPS": "0",
            "TMPDIR": str(tmp_path / "tmp"),
            "PATH": fake_tools(tmp_path / "off", None),
        }
    )
    assert off.returncode == 0, off.stderr  # MPS=0: served without a daemon, on purpose


KSERVE_ONLY = {"minReplicas", "maxReplicas", "scaleMetric", "scaleTarget"}  # PredictorSpec's own fields


def kubernetes_documents() -> list[dict]:
    """Every Kubernetes object the manifests hold, and the InferenceService's predictor as the Pod
    it becomes (KServe's PredictorSpec inlines a PodSpec beside its own scaling fields)."""
    docs = [d for name in ("k8s.yaml", "networkpolicy.yaml") for d in yaml.safe_load_all((DEPLOY / name).read_text())]
    [isvc] = yaml.safe_load_all((DEPLOY / "kserve.yaml").read_text())
    pod = {k: v for k, v in isvc["spec"]["predictor"].items() if k not in KSERVE_ONLY}
    return docs + [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "slm-serve-predictor"}, "spec": pod}]


def test_manifests_validate_against_the_kubernetes_schema():
    """kubernetes-validate, strict (no unknown field), at the newest Kubernetes it knows: each
    object, and the KServe predictor's pod spec; a misspelt field fails it."""
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    docs = kubernetes_documents()
    assert [d["kind"] for d in docs] == ["Deployment", "Service", "NetworkPolicy", "NetworkPolicy", "Pod"]
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    broken = next(
        yaml.safe_load_all(
            (DEPLOY / "k8s.yaml").read_text().replace("terminationGracePeriodSeconds", "terminationGracePeriod")
        )
    )
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def test_network_policies_select_the_pods_and_admit_their_ports():
    """Each manifest's pods are selected by one policy, which admits exactly the container ports
    (inference, metrics)."""
    policies = list(yaml.safe_load_all((DEPLOY / "networkpolicy.yaml").read_text()))
    deployment = next(yaml.safe_load_all((DEPLOY / "k8s.yaml").read_text()))
    [isvc] = yaml.safe_load_all((DEPLOY / "kserve.yaml").read_text())
    pod_labels = [
        deployment["spec"]["template"]["metadata"]["labels"],
        {"serving.kserve.io/inferenceservice": isvc["metadata"]["name"]},
    ]
    for policy, labels in zip(policies, pod_labels):
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
        ports = sorted(p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"])
        assert ports == [INFERENCE_PORT, METRICS_PORT]


@pytest.mark.parametrize("index", [0, 1], ids=["kserve", "k8s"])
def test_a_stop_drains_within_the_grace_period_and_disk_is_bounded(index):
    """SIGTERM reaches serve.sh alone (tini without -g), which drains for up to DRAIN_TIMEOUT s
    before TorchServe stops: the pod's grace period leaves room for both. Ephemeral storage is
    requested and limited, and the emptyDir store is bounded inside that limit."""
    pod, _ = replicas()[index]
    [container] = pod["containers"]
    entry = re.search(r"^ENTRYPOINT (.+)$", (DEPLOY / "Dockerfile").read_text(), re.M)[1]
    assert '"-g"' not in entry and "tini" in entry
    drain_timeout = float(re.search(r"DRAIN_TIMEOUT\", \"(\d+)\"", (DEPLOY / "drain.py").read_text())[1])
    assert pod["terminationGracePeriodSeconds"] >= drain_timeout + 15
    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    assert int(requests["ephemeral-storage"][:-2]) <= int(limits["ephemeral-storage"][:-2])
    [store] = [v for v in pod["volumes"] if v["name"] == "model-store"]
    assert int(store["emptyDir"]["sizeLimit"][:-2]) < int(limits["ephemeral-storage"][:-2])


# The InferenceService against the kserve SDK's generated models, which hold KServe's field names
# (attribute_map) and types (openapi_types); nested Kubernetes types are the kubernetes client's.
SCALARS = {
    "str": (str, int, float),  # quantities ("1", 1) are strings in the models, numbers in YAML
    "int": int,
    "float": (int, float),
    "bool": bool,
    "object": object,
    "ResourceQuantity": (str, int, float),
    "datetime": str,
}


def unknown_fields(value, type_name: str, where: str = "") -> list[str]:
    """Where `value` holds a key that the SDK model `type_name` does not know, or a value of another
    shape (a mapping, a list, a scalar) than the field's type: empty when it has none."""
    import kserve.models
    import kubernetes.client

    if inner := re.fullmatch(r"(?:list|List)\[(.+)\]", type_name):
        if not isinstance(value, list):
            return [f"{where}: not a list ({type_name})"]
        return [e for i, item in enumerate(value) for e in unknown_fields(item, inner[1], f"{where}[{i}]")]
    if inner := re.fullmatch(r"dict\(str, (.+)\)|Dict\[str, (.+)\]", type_name):
        if not isinstance(value, dict):
            return [f"{where}: not a mapping ({type_name})"]
        return [e for k, item in value.items() for e in unknown_fields(item, inner[1] or inner[2], f"{where}.{k}")]
    if type_name in SCALARS:
        bad = (
            isinstance(value, (dict, list))
            or not isinstance(value, SCALARS[type_name])
            or (type_name == "int" and isinstance(value, bool))
        )
        return [f"{where}: {value!r} is not {type_name}"] if bad else []
    model = getattr(kserve.models, type_name, None) or getattr(kubernetes.client, type_name, None)
    if model is None:
        return [f"{where}: no model {type_name} in the kserve SDK or the kubernetes client"]
    if not isinstance(value, dict):
        return [f"{where}: not a mapping ({type_name})"]
    fields = {key: attr for attr, key in model.attribute_map.items()}
    found = []
    for key, item in value.items():
        if key not in fields:
            found.append(f"{where}.{key}: not a field of {type_name}")
        else:
            found += unknown_fields(item, model.openapi_types[fields[key]], f"{where}.{key}")
    return found


def test_inference_service_is_kserves():
    """Every field of kserve.yaml, recursively, is a field of the kserve SDK's V1beta1InferenceService
    (its predictor, the pod fields inlined there, the Kubernetes types below); a misspelt key is
    named, at any depth."""
    text = (DEPLOY / "kserve.yaml").read_text()
    [isvc] = yaml.safe_load_all(text)
    assert unknown_fields(isvc, "V1beta1InferenceService") == []
    for right, wrong, where in [
        ("minReplicas", "minReplica", ".spec.predictor.minReplica"),
        ("periodSeconds: 5", "periodSecond: 5", ".spec.predictor.containers[0].readinessProbe"),
        ("sizeLimit", "size_limit", ".spec.predictor.volumes[0].emptyDir.size_limit"),
        ("  name: slm-serve\n", "  name: slm-serve\n  label: {app: slm}\n", ".metadata.label"),
    ]:
        assert right in text
        [broken] = yaml.safe_load_all(text.replace(right, wrong, 1))
        [error] = unknown_fields(broken, "V1beta1InferenceService")
        assert error.startswith(where), error


FAKE_TORCHSERVE = """#!/usr/bin/env bash
# Stands in for TorchServe: --start serves GET /ping ("Healthy") at TS_INFERENCE_ADDRESS until --stop,
# which logs whether the gateway still answers then.
echo "torchserve $1 inference=${TS_INFERENCE_ADDRESS:-}" >> "$FAKE_LOG"
if [[ $1 == --stop ]]; then
  python3 -c "import sys, urllib.request as u; print('gateway', u.urlopen(sys.argv[1], timeout=2).status)" \\
    "http://$GATEWAY_ADDRESS/v2/health/live" >> "$FAKE_LOG"
  kill "$(cat "$FAKE_PID")"
  exit 0
fi
echo $$ > "$FAKE_PID"
exec python3 -m http.server --bind 127.0.0.1 "${TS_INFERENCE_ADDRESS##*:}" --directory "$FAKE_ROOT"
"""


@pytest.fixture
def gateway_replica(fake, tmp_path):
    """serve.sh's environment with KSERVE_GATEWAY=1, a built archive and a stand-in TorchServe; its
    ports free ones: (env, gateway address, TorchServe's inference port)."""
    from handlers.local_server import free_ports

    env, store = fake
    store.mkdir()
    (store / "smollm2-intent.mar").write_text("built\n")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "torchserve").write_text(FAKE_TORCHSERVE)
    (tmp_path / "bin" / "torchserve").chmod(0o755)
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "ping").write_text("Healthy")
    gateway, inference, management, metrics = free_ports(4)
    return (
        {
            **env,
            "BUILD_ONLY": "0",
            "KSERVE_GATEWAY": "1",
            "PATH": f"{tmp_path / 'bin'}:{Path(sys.executable).parent}:/usr/bin:/bin",
            "TS_INFERENCE_ADDRESS": f"http://127.0.0.1:{inference}",
            "GATEWAY_ADDRESS": f"127.0.0.1:{gateway}",
            "MANAGEMENT": f"http://127.0.0.1:{management}",
            "METRICS": f"http://127.0.0.1:{metrics}",
            "DRAIN_FILE": str(tmp_path / "draining"),
            "FAKE_PID": str(tmp_path / "torchserve.pid"),
            "FAKE_ROOT": str(tmp_path / "root"),
        },
        f"127.0.0.1:{gateway}",
        inference,
    )


def test_kserve_gateway_fronts_torchserve_and_stops_after_it(gateway_replica):
    """KSERVE_GATEWAY=1: TorchServe's inference moves to TS_INFERENCE_ADDRESS and the gateway,
    started after it, proxies to it (/ping through the gateway is TorchServe's); on SIGTERM the drain
    runs, TorchServe stops while the gateway still answers, then the gateway stops, and serve.sh
    exits 0."""
    import signal

    from handlers.local_server import http

    env, gateway, inference = gateway_replica
    proc = subprocess.Popen(
        [str(SERVE)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (
                proc.stdout.read() if proc.poll() else "no gateway"
            )
            try:
                if http("GET", f"http://{gateway}/ping", timeout=2) == (200, b"Healthy"):
                    break
            except OSError:
                pass
            time.sleep(0.1)
        assert http("GET", f"http://{gateway}/v2/health/live")[0] == 200
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert "drain: TorchServe does not answer" in out  # the drain ran first (nothing at MANAGEMENT here)
        assert Path(env["FAKE_LOG"]).read_text().splitlines() == [
            f"torchserve --start inference=http://127.0.0.1:{inference}",
            f"torchserve --stop inference=http://127.0.0.1:{inference}",
            "gateway 200",
        ]
        with pytest.raises(OSError):  # stopped with the replica
            http("GET", f"http://{gateway}/v2/health/live", timeout=2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_the_replica_ends_when_its_gateway_does(gateway_replica):
    """A gateway that exits (here: its port taken) stops TorchServe and the replica with 1, rather
    than leave a replica that ready.py calls ready with nothing on its port."""
    import socket

    env, gateway, _ = gateway_replica
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", int(gateway.rsplit(":", 1)[1])))
        taken.listen()
        result = run_serve(env, timeout=30)
    assert result.returncode == 1 and "the KServe gateway exited" in result.stderr, result.stderr
    assert "torchserve --stop" in Path(env["FAKE_LOG"]).read_text()
