#!/usr/bin/env python3
"""Drain one replica before it stops: mark it unready, then wait until its requests are answered.

    python3 deploy/drain.py [--config TS_CONFIG]  # exit 0 once drained; 1 if requests still came at DRAIN_TIMEOUT
    python3 deploy/drain.py --clear                # not draining (serve.sh, as the replica starts)

1. It creates DRAIN_FILE: deploy/ready.py answers "not ready" from then on, so the Service takes
   the replica out of its endpoints and sends new requests to the others.
2. It waits until no request has arrived for DRAIN_QUIET seconds (TorchServe's
   ts_inference_requests_total, counted at arrival, has not moved) and no model has a request in
   its queue. A request lives at most its deadline plus one call, far under the quiet time, so by
   then every request that arrived has had its answer.

deploy/serve.sh runs it when the replica gets SIGTERM, then stops TorchServe. Settings
(environment, defaults in brackets): DRAIN_FILE [$TMPDIR/slm-draining], DRAIN_QUIET [2],
DRAIN_TIMEOUT [25: keep it under the pod's terminationGracePeriodSeconds], MANAGEMENT and METRICS
[the management_address and metrics_address of --config, the TorchServe config serve.sh serves
with; else deploy/config.properties' http://127.0.0.1:8081 and :8082]. The standard library only.
"""

import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ARRIVALS = "ts_inference_requests_total"


def drain_file() -> Path:
    return Path(os.environ.get("DRAIN_FILE") or Path(tempfile.gettempdir()) / "slm-draining")


def arrivals(metrics: str, timeout: float = 2.0) -> float:
    """Requests TorchServe has received so far, all models together."""
    with urllib.request.urlopen(f"{metrics}/metrics", timeout=timeout) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(ARRIVALS + "{") or line.startswith(ARRIVALS + " ")
    )


def queued(management: str, timeout: float = 2.0) -> int:
    """Requests waiting in the models' queues for a worker."""
    with urllib.request.urlopen(f"{management}/models", timeout=timeout) as r:
        names = [m["modelName"] for m in json.loads(r.read())["models"]]
    total = 0
    for name in names:
        with urllib.request.urlopen(f"{management}/models/{name}/all", timeout=timeout) as r:
            for version in json.loads(r.read()):
                total += int((version.get("jobQueueStatus") or {}).get("pendingRequests") or 0)
    return total


def drain(management: str, metrics: str, quiet: float, timeout: float, poll: float = 0.2) -> bool:
    """Mark the replica draining, then wait (up to `timeout` s) for `quiet` s without an arrival
    and with empty queues; whether that came."""
    drain_file().touch()
    end = time.monotonic() + timeout
    seen, since = arrivals(metrics), time.monotonic()
    while time.monotonic() < end:
        time.sleep(poll)
        now = arrivals(metrics)
        if now != seen or queued(management):
            seen, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return True
    return False


def addresses(config: "Path | None") -> tuple[str, str]:
    """(management, metrics) URLs to reach this replica's TorchServe at: the environment's, else
    the config's (an address on every interface is reached on loopback), else the defaults."""
    props = {}
    if config is not None:
        for line in config.read_text().splitlines():
            if "=" in line and not line.lstrip().startswith("#"):
                key, value = line.split("=", 1)
                props[key.strip()] = value.strip().replace("0.0.0.0", "127.0.0.1")
    management = os.environ.get("MANAGEMENT") or props.get("management_address", "http://127.0.0.1:8081")
    metrics = os.environ.get("METRICS") or props.get("metrics_address", "http://127.0.0.1:8082")
    return management.rstrip("/"), metrics.rstrip("/")


def main() -> int:
    if sys.argv[1:] == ["--clear"]:
        drain_file().unlink(missing_ok=True)
        return 0
    config = Path(sys.argv[2]) if sys.argv[1:2] == ["--config"] and len(sys.argv) == 3 else None
    management, metrics = addresses(config)
    quiet, timeout = float(os.environ.get("DRAIN_QUIET", "2")), float(os.environ.get("DRAIN_TIMEOUT", "25"))
    start = time.monotonic()
    try:
        drained = drain(management, metrics, quiet, timeout)
    except OSError as e:  # TorchServe is not answering: nothing to wait for
        print(f"drain: TorchServe does not answer ({e}): stopping without waiting", file=sys.stderr)
        return 1
    took = time.monotonic() - start
    if drained:
        print(f"drain: no request for {quiet:g} s and the queues empty after {took:.1f} s: drained")
        return 0
    print(f"drain: requests still arriving after {took:.1f} s (DRAIN_TIMEOUT): stopping anyway", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
