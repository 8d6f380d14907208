#!/usr/bin/env python3
"""Readiness of one replica, for the container's readiness probe: every archive in the model
store is registered and has at least one READY worker, and the replica is not draining
(deploy/drain.py). TorchServe's /ping says Healthy as soon as the server is up, while workers may
still be loading (a CUDA worker loads for about a minute); a replica that takes traffic then
queues it.

    python3 deploy/ready.py     # exit 0 when ready; else 1, with what is not ready on stderr

Settings (environment, defaults in brackets): MODEL_STORE [/models/model-store], MANAGEMENT
[http://127.0.0.1:8081: the management address of deploy/config.properties], DRAIN_FILE
[$TMPDIR/slm-draining: drain.py's]. The standard library only, and one request per model: it
runs every few seconds.
"""

import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

from drain import drain_file  # deploy/drain.py, beside this file


def not_ready(store: Path, management: str, timeout: float = 2.0) -> list[str]:
    """What keeps the replica from being ready: a drain begun, a model of the store not
    registered, or without a READY worker (empty: ready)."""
    if drain_file().exists():
        return [f"draining ({drain_file()} exists): the replica is stopping"]
    names = sorted(p.stem for p in store.glob("*.mar"))
    if not names:
        return [f"no archive in {store}"]
    reasons = []
    for name in names:
        try:
            with urllib.request.urlopen(f"{management}/models/{name}", timeout=timeout) as r:
                workers = json.loads(r.read())[0]["workers"]
        except urllib.error.HTTPError as e:
            reasons.append(f"{name}: not registered ({e.code})")
            continue
        except (OSError, ValueError, LookupError) as e:  # not listening yet, or an answer of another shape
            reasons.append(f"{name}: management API at {management}: {e}")
            continue
        reason = unready(name, workers)
        if reason:
            reasons.append(reason)
    return reasons


def unready(name: str, workers: list[dict]) -> "str | None":
    """Why a model version does not serve, from its describe-model workers: none READY (None:
    one is)."""
    if any(w.get("status") == "READY" for w in workers):
        return None
    states = ", ".join(sorted({str(w.get("status")) for w in workers})) or "none started"
    return f"{name}: 0 of {len(workers)} workers READY ({states})"


def main() -> int:
    store = Path(os.environ.get("MODEL_STORE", "/models/model-store"))
    reasons = not_ready(store, os.environ.get("MANAGEMENT", "http://127.0.0.1:8081").rstrip("/"))
    for reason in reasons:
        print(f"not ready: {reason}", file=sys.stderr)
    return 1 if reasons else 0


if __name__ == "__main__":
    sys.exit(main())
