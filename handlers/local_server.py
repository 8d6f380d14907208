"""A private local TorchServe (tests, the demo, bench): own TMPDIR, working directory and free
loopback ports, the repository's config.properties otherwise; stopped by killing its own process
group only (never `torchserve --stop`, which could hit another server on the host)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def http(
    method: str,
    url: str,
    body: bytes | None = None,
    headers: dict | None = None,
    timeout: float = 120,
    response_headers: dict | None = None,
):
    """(status, body bytes); HTTP errors are returned, not raised. The response's headers go into
    `response_headers` when given, their names in lower case."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            response = r
            status, data = r.status, r.read()
    except urllib.error.HTTPError as e:
        response = e
        status, data = e.code, e.read()
    if response_headers is not None:
        response_headers.update((k.lower(), v) for k, v in response.headers.items())
    return status, data


def model_workers(management: str, model: str) -> list[dict]:
    """A model's workers as TorchServe's describe-model API lists them (id, pid, status, ...)."""
    status, body = http("GET", f"{management}/models/{model}")
    if status != 200:
        raise RuntimeError(f"describing {model}: {status} {body[:200]!r}")
    return json.loads(body)[0]["workers"]


def scale(management: str, model: str, workers: int, synchronous: bool = False) -> None:
    """min_worker = max_worker = `workers`; asynchronously TorchServe answers 202 at once."""
    status, body = http(
        "PUT",
        f"{management}/models/{model}?min_worker={workers}&max_worker={workers}&synchronous={str(synchronous).lower()}",
        timeout=600,
    )
    if status not in (200, 202):
        raise RuntimeError(f"scaling {model} to {workers}: {status} {body[:200]!r}")


class TorchServe:
    def __init__(self, workdir: Path, model_store: Path):
        self.workdir, self.model_store = workdir.resolve(), model_store.resolve()  # the server runs in workdir
        inference, management, metrics, grpc_i, grpc_m, workers = free_ports(6)
        self.inference = f"http://127.0.0.1:{inference}"
        self.management = f"http://127.0.0.1:{management}"
        self.metrics = f"http://127.0.0.1:{metrics}"
        settings = (REPO / "config.properties").read_text().splitlines()
        overrides = {
            "inference_address": self.inference,
            "management_address": self.management,
            "metrics_address": self.metrics,
            "grpc_inference_port": grpc_i,
            "grpc_management_port": grpc_m,
            "initial_worker_port": workers,  # worker sockets live under the private TMPDIR too
            "metrics_config": REPO / "metrics.yaml",  # the server runs in workdir
        }
        lines = [line for line in settings if line.split("=", 1)[0].strip() not in overrides]
        lines += [f"{k}={v}" for k, v in overrides.items()]
        self.config = workdir / "config.properties"
        self.config.write_text("\n".join(lines) + "\n")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120) -> "TorchServe":
        tmp = self.workdir / "tmp"
        tmp.mkdir(exist_ok=True)
        # This interpreter's environment first (a virtualenv used without activating it): its
        # torchserve, and the python its workers run with.
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        # TEMP: TorchServe's JVM extracts archives there (java.io.tmpdir); TMPDIR: its workers' temporaries
        env = {
            **os.environ,
            "PATH": path,
            "TMPDIR": str(tmp),
            "TEMP": str(tmp),
            "LOG_LOCATION": str(self.workdir / "logs"),
            "METRICS_LOCATION": str(self.workdir / "logs"),
        }
        self.proc = subprocess.Popen(
            [
                shutil.which("torchserve", path=path) or "torchserve",
                "--start",
                "--foreground",
                "--ncs",
                "--ts-config",
                str(self.config),
                "--model-store",
                str(self.model_store),
            ],
            cwd=self.workdir,
            env=env,
            stdout=open(self.workdir / "stdout.log", "wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() kills exactly this server and its workers
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"torchserve exited: {(self.workdir / 'stdout.log').read_text()[-3000:]}")
            try:
                if http("GET", self.management + "/models", timeout=2)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError("torchserve did not come up")

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc = None

    def register(self, mar: str, workers: int = 1, name: str | None = None, synchronous: bool = True) -> dict:
        """Register `mar` from the model store (as `name` if given, else the archive's own name). With
        synchronous=False it returns once the archive is accepted; wait_ready() waits for the workers."""
        query = f"url={mar}&initial_workers={workers}&synchronous={str(synchronous).lower()}" + (
            f"&model_name={name}" if name else ""
        )
        status, body = http("POST", f"{self.management}/models?{query}", timeout=600)
        assert status in (200, 202), body
        if not synchronous and workers > 1:
            # TorchServe 0.12 starts only the archive's own minWorkers when registering
            # asynchronously; scaling afterwards starts the rest.
            self.scale(name or Path(mar).stem, workers)
        return json.loads(body)

    def scale(self, model: str, workers: int, synchronous: bool = False) -> None:
        scale(self.management, model, workers, synchronous)

    def wait_ready(self, model: str, workers: int, timeout: float = 900) -> None:
        """Block until `model` has `workers` READY workers; TimeoutError (with the log tail) if not."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sum(w["status"] == "READY" for w in self.workers(model)) >= workers:
                return
            time.sleep(0.5)
        log = self.workdir / "logs" / "model_log.log"
        tail = log.read_text()[-3000:] if log.exists() else ""
        raise TimeoutError(f"{model}: {workers} worker(s) not ready after {timeout:.0f} s\n{tail}")

    def workers(self, model: str) -> list[dict]:
        return model_workers(self.management, model)

    def predict(self, model: str, body: bytes, content_type: str = "application/json"):
        return http("POST", f"{self.inference}/predictions/{model}", body, {"Content-Type": content_type})
