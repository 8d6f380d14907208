"""deploy/'s settings and serve.sh's environment, as the deploy tests read them."""

import contextlib
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
SERVE = DEPLOY / "serve.sh"
TASK = REPO / "archiver" / "tasks" / "smollm2-intent.yaml"


def properties(path: Path) -> dict[str, str]:
    lines = [line.strip() for line in path.read_text().splitlines()]
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


CONFIG = properties(DEPLOY / "config.properties")
INFERENCE_PORT = urlparse(CONFIG["inference_address"]).port
METRICS_PORT = urlparse(CONFIG["metrics_address"]).port
# The settings serve.sh reads, from its `NAME=${NAME:-default}` lines.
SERVE_DEFAULTS = dict(re.findall(r"^(\w+)=\$\{\1:-([^}]*)\}", SERVE.read_text(), re.M))


def serve_env(tmp_path: Path, python: str, checkpoint: str, **extra) -> dict:
    tasks = tmp_path / "tasks"
    if not tasks.exists():
        tasks.mkdir()
        shutil.copy(TASK, tasks)
    return {
        **os.environ,
        "PYTHON": python,
        "CHECKPOINT": checkpoint,
        "TASKS_DIR": str(tasks),
        "MODEL_STORE": str(tmp_path / "store"),
        "DEVICE": "cpu",
        "BUILD_ONLY": "1",
        **extra,
    }


def stop_replica(proc: subprocess.Popen, timeout: float) -> None:
    """serve.sh and everything it started (its own process group): SIGTERM, as a pod stops, then
    after `timeout` s SIGKILL; and SIGKILL for whatever the stop left behind."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
