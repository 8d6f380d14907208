#!/usr/bin/env python3
"""Drain one replica before it stops: mark it unready, then wait until its requests are answered.

    python3 deploy/drain.py [--config TS_CONFIG]  # exit 0 once drained; 1 if requests still came at DRAIN_TIMEOUT
    python3 deploy/drain.py --clear                # not draining (serve.sh, as the replica starts)

1. It creates DRAIN_FILE: deploy/ready.py answers "not ready" from then on, so the Service takes
   the replica out of its endpoints and sends new requests to the others.
2. It waits until, for DRAIN_QUIET seconds together, no request has arrived (TorchServe's
   ts_inference_requests_total, counted at arrival, has not moved), no model has a request in its
   queue and no worker holds one. TorchServe stops counting a request as pending once a worker has
   taken it, so the workers mark the requests they hold (slm_core/serve/in_flight.py: a file per
   batch in SLM_IN_FLIGHT_DIR, else $TMPDIR/slm-in-flight); a mark whose process is gone (a
   killed worker) does not count. So a call of any length is answered before TorchServe stops.

deploy/serve.sh runs it when the replica gets SIGTERM, then stops TorchServe. Settings
(environment, defaults in brackets): DRAIN_FILE [$TMPDIR/slm-draining], DRAIN_QUIET [2],
DRAIN_TIMEOUT [25: keep it under the pod's terminationGracePeriodSeconds], SLM_IN_FLIGHT_DIR
[$TMPDIR/slm-in-flight], MANAGEMENT and METRICS
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


def held() -> int:
    """Requests the workers of this replica hold now: the marks of live processes (their files are
    named PID-BATCH and hold the batch's request count)."""
    folder = Path(os.environ.get("SLM_IN_FLIGHT_DIR") or Path(tempfile.gettempdir()) / "slm-in-flight")
    total = 0
    for mark in folder.glob("*-*") if folder.is_dir() else ():
        try:
            os.kill(int(mark.name.split("-")[0]), 0)
            total += int(mark.read_text() or 1)  # a mark being written counts as one
        except (ProcessLookupError, ValueError):  # its process is gone, or not a mark
            continue
        except PermissionError:  # a live process of another user
            total += 1
        except FileNotFoundError:  # answered meanwhile
            continue
    return total


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
    """Mark the replica draining, then wait (up to `timeout` s) for `quiet` s without an arrival,
    with empty queues and no request held by a worker; whether that came."""
    drain_file().touch()
    end = time.monotonic() + timeout
    seen, since = arrivals(metrics), time.monotonic()
    while time.monotonic() < end:
        time.sleep(poll)
        now = arrivals(metrics)
        if now != seen or queued(management) or held():
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
        print(f"drain: no request for {quiet:g} s, the queues empty and none in a worker after {took:.1f} s: drained")
        return 0
    print(f"drain: requests still arriving after {took:.1f} s (DRAIN_TIMEOUT): stopping anyway", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
