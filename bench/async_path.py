"""Where a request's time goes outside the handler, per model, on a private TorchServe: the client's
mean latency minus the handler's own time (X-Slm-Handler-Ms) and, in async mode, the time in the
worker's queue (X-Slm-Wait-Ms). That rest is HTTP, the frontend, TorchServe's IPC and, in sync
mode, the batching delay. Compares a sync and an async archive of the same model (issue 6).

    python -m bench.async_path --store DIR --models tiny_sync,tiny_ctx2 [--levels 1,2] [--repeats 2]
"""

import argparse
import json
import math
import tempfile
from pathlib import Path

from bench.loadgen import measure
from handlers.local_server import TorchServe


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", type=Path, required=True, help="model store holding MODEL.mar for each model")
    p.add_argument("--models", required=True, help="comma-separated archive names (score tasks)")
    p.add_argument("--levels", default="1,2")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seconds", type=float, default=5.0)
    args = p.parse_args()
    models = args.models.split(",")
    server = TorchServe(Path(tempfile.mkdtemp(prefix="async-path-")), args.store).start()
    try:
        for model in models:
            server.register(f"{model}.mar", name=model)
        bodies = [json.dumps({"texts": [f"cheap flights to rome number {i}", "a short text"]}).encode()
                  for i in range(50)]
        for _ in range(args.repeats):
            for model in models:
                for c in (int(x) for x in args.levels.split(",")):
                    pt = measure(f"{server.inference}/predictions/{model}", bodies, c, 1.0, args.seconds)
                    wait = 0.0 if math.isnan(pt.wait_ms) else pt.wait_ms
                    print(f"{model} c={c}: {pt.qps:.1f} req/s, mean {pt.mean_ms:.2f} ms, handler {pt.handler_ms:.2f}, "
                          f"worker queue {wait:.2f}, outside the handler {pt.mean_ms - pt.handler_ms - wait:.2f}",
                          flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
