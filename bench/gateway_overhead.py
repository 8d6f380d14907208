"""What deploy/kserve_gateway.py costs a request: one private TorchServe serving an archive, and
the same open-loop load sent to it straight and through the gateway, in turns (straight,
gateway, straight, gateway), each at `rate` req/s for `seconds`.

    python -m bench.gateway_overhead --archive A.mar --workers 2 --workload W1 \
        --tokenizer bench/assets/tokenizer.json --rate 186 --seconds 20 --out F.json
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.reliability.open_loop import open_loop, summary
from handlers.local_server import TorchServe, free_ports

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archive", type=Path, required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--workload", required=True)
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--rate", type=float, required=True)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    from tokenizers import Tokenizer

    from bench.workloads import WORKLOADS, TextMaker

    bodies = [
        json.dumps(b).encode()
        for b in TextMaker(Tokenizer.from_file(str(args.tokenizer)), seed=2).requests(WORKLOADS[args.workload], 500)
    ]
    server = TorchServe(Path(tempfile.mkdtemp(prefix="gateway-")), args.archive.parent).start()
    (port,) = free_ports(1)
    env = {
        **os.environ,
        "GATEWAY_ADDRESS": f"127.0.0.1:{port}",
        "INFERENCE": server.inference,
        "MANAGEMENT": server.management,
    }
    gateway = subprocess.Popen([sys.executable, str(REPO / "deploy" / "kserve_gateway.py")], env=env)
    result = {
        "archive": args.archive.name,
        "workers": args.workers,
        "workload": args.workload,
        "rate": args.rate,
        "seconds": args.seconds,
        "turns": [],
    }
    try:
        server.register(args.archive.name, args.workers, name=args.archive.stem)
        time.sleep(2)
        urls = {
            "straight": f"{server.inference}/predictions/{args.archive.stem}",
            "gateway": f"http://127.0.0.1:{port}/v1/models/{args.archive.stem}:predict",
        }
        v1 = [json.dumps({"instances": [json.loads(b)]}).encode() for b in bodies]
        open_loop(urls["straight"], bodies, [(args.rate, 5.0)])  # warm-up
        for name in ("straight", "gateway", "straight", "gateway"):
            records = open_loop(urls[name], v1 if name == "gateway" else bodies, [(args.rate, args.seconds)])
            turn = {"path": name, **summary(records, args.seconds)}
            result["turns"].append(turn)
            print(json.dumps(turn), flush=True)
        # the v1 body through the gateway against the native body through it: the protocol's cost
        records = open_loop(
            f"http://127.0.0.1:{port}/predictions/{args.archive.stem}", bodies, [(args.rate, args.seconds)]
        )
        result["turns"].append({"path": "gateway, native body", **summary(records, args.seconds)})
        print(json.dumps(result["turns"][-1]), flush=True)
    finally:
        gateway.terminate()
        server.stop()
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
