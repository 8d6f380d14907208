"""One command: build the archives, start TorchServe, sweep concurrency per workload for this
project ("slm") and the HF transformers peer ("hf"), measure the no-op ceiling, write results.

H200:  python -m bench.run --device cuda --tokenizer bench/assets/tokenizer.json --commit SHA
CPU smoke (CI, SmolLM2, seconds of load):  python -m bench.run --smoke --out DIR
"""

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import http.client as http_client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
import yaml
from tokenizers import Tokenizer

from archiver.build import configure, read_manifest, read_serving
from bench import flops
from bench.loadgen import measure, sweep
from bench.workloads import WORKLOADS, TextMaker, Workload, catalog_items
from handlers.local_server import TorchServe, http
from slm_core.compile.checks import GateThresholds
from slm_core.serve.loader import mps_running
from slm_core.serving import ServingOptions, ServingSpec
from slm_core.spec import ModelSpec, TaskSpec
from slm_core.tasks import Task, task_for
from slm_core.tasks.embedding import cosine_distance

BENCH = Path(__file__).resolve().parent
OPTION_PRECISION = {"fp8static": "fp8-static"}  # --slm options
PRECISION_SUFFIX = {p: f"_{o}" for o, p in OPTION_PRECISION.items()}  # archive names of the fp8 builds
LEVELS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128]  # finer where the SLO usually binds


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def random_checkpoint(arch: dict, tokenizer: Path, out: Path) -> Path:
    """An HF directory with random bf16 weights of the architecture and the given tokenizer: a
    causal LM, or a sequence classifier when the architecture names num_labels."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    if (out / "config.json").exists():
        return out
    cfg = AutoConfig.for_model(**arch)
    kind = AutoModelForSequenceClassification if "num_labels" in arch else AutoModelForCausalLM
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        torch.manual_seed(0)
        model = kind.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    shutil.copy(tokenizer, out / "tokenizer.json")
    return out


def slm_build(
    name: str, checkpoint: Path, task: dict, store: Path, device: str, work: Path, guard: bool = False
) -> list[str] | None:
    """The archiver command that builds `name`.mar, or None if the store already has it: one
    worker whatever the archiver's defaults (deployments serve copies configured by the archiver).
    guard: with the accuracy reference, so its workers run the online accuracy guard at the
    archiver's default share of requests.
    FP8 builds are measured whatever their accuracy gate says: the gate's figures are recorded, and
    checked against the archiver's default thresholds, with each point (fp8_gate, fp8_gate_passes)."""
    if (store / f"{name}.mar").exists():
        return None
    (work / f"{name}.yaml").write_text(yaml.safe_dump(task))
    return (
        [
            sys.executable,
            "-m",
            "archiver",
            "build",
            "--checkpoint",
            str(checkpoint),
            "--task",
            str(work / f"{name}.yaml"),
            "--model-name",
            name,
            "--export-path",
            str(store),
            "--device",
            device,
            "--response-timeout",
            "600",
            "--workers",
            "1",
        ]
        # no accuracy reference unless asked: the archives compared across runs hold one graph (the
        # guard's cost is its own measurement, a guard variant beside the same one without)
        + ([] if guard else ["--no-accuracy-reference"])
        + (  # each deployment sets its own workers
            ["--device-ids", "0"] if device == "cuda" else []
        )
        + (  # one GPU unless a deployment says gN
            ["--fp8-max-diff", "1", "--fp8-min-shared", "0"] if task["precision"].startswith("fp8") else []
        )
    )


def gate_passes(gate: dict) -> bool:
    """Whether an FP8 build's gate figures pass the archiver's default thresholds."""
    default = GateThresholds()
    if "max_abs_diff" in gate:
        return gate["max_abs_diff"] <= default.max_diff
    return gate["shared_candidates"] >= default.min_shared


def build_all(commands: dict[str, list[str]], jobs: int, work: Path) -> set[str]:
    """Run the archiver commands, `jobs` at a time (AOTInductor compiles are mostly single-threaded
    C++ and Triton compiles, so independent archives overlap well on a many-core host). Each build
    logs to work/build-<name>.log; its archiver lines are echoed when it ends. Returns the names that
    failed (their tail is logged): the run goes on without them."""

    def one(name: str, argv: list[str]) -> bool:
        path = work / f"build-{name}.log"
        start = time.monotonic()
        with path.open("wb") as f:
            rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT).returncode
        lines = path.read_text(errors="replace").splitlines()
        for line in lines:
            if line.startswith("[archiver"):
                print(f"{name}: {line}", file=sys.stderr, flush=True)
        if rc:
            log(f"FAILED building {name} ({rc}):\n" + "\n".join(lines[-40:]))
            return False
        log(f"built {name} in {time.monotonic() - start:.0f} s")
        return True

    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        futures = {n: pool.submit(one, n, argv) for n, argv in commands.items()}
    return {n for n, f in futures.items() if not f.result()}


def archive_handler(name: str, handler: Path, extra: dict, store: Path, device: str, work: Path) -> None:
    """A bench-only archive (peer or no-op) around `handler`, with `extra` as JSON files."""
    from model_archiver.model_archiver_config import ModelArchiverConfig
    from model_archiver.model_packaging import generate_model_archive

    stage = work / f"{name}-stage"
    stage.mkdir(exist_ok=True)
    for file, content in extra.items():
        (stage / file).write_text(json.dumps(content))
    config = work / f"{name}-config.yaml"
    serving = ServingSpec(
        "cuda" if device == "cuda" else "cpu",
        workers=1,
        batch=1,
        queue=100,
        response_timeout_s=600,
        device_ids=(0,) if device == "cuda" else (),
    )
    config.write_text(yaml.safe_dump(serving.model_config()))
    generate_model_archive(
        ModelArchiverConfig(
            model_name=name,
            handler=str(handler),
            version="1.0",
            extra_files=str(stage),
            export_path=str(store),
            archive_format="zip-store",
            force=True,
            config_file=str(config),
        )
    )


def workload_task(workload: Workload, tokenizer: Tokenizer) -> Task:
    """The task a workload's archives serve (a classifier's label names from its architecture)."""
    labels = workload.task.get("labels") or list(workload.arch.get("id2label", {}).values())
    return task_for(TaskSpec.from_dict({**workload.task, "labels": labels, "max_batch": 1}), tokenizer)


def request_flops(task: Task, spec: ModelSpec, body: dict, precision: str = "bf16") -> tuple[int, int]:
    """A request's logical FLOPs and, of them, those an fp8 `precision` runs in E4M3 (Task.flops)."""
    return task.flops(spec, task.request(body), precision)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokenizer", help="tokenizer.json for the random-weight models (bench/README.md)")
    p.add_argument("--work", default="/tmp/slm-bench")
    p.add_argument("--out", default=str(BENCH / "results"))
    p.add_argument("--workloads", default="W1,W2,W3")
    p.add_argument("--systems", default="slm,hf")
    p.add_argument(
        "--slm",
        help="slm deployments to measure, comma-separated WORKERS:BATCH[:OPTION...], e.g. 2:8 "
        "(BATCH: the task's max_batch, requests per graph call, split between the workers "
        "of a GPU as the archiver splits it). Options: fp8static (built with precision "
        "fp8-static), nographs (the same archive served without CUDA graphs), gN (the "
        "workers spread over GPUs 0..N-1 in turn; otherwise all on GPU 0), e.g. 4:8:g2, "
        "score / beam (the deployment serves only that task's archives), guard (built with the "
        "accuracy reference: the online accuracy guard runs at the archiver's default share). "
        "Default: 1:1,1:1:nographs on cuda, 1:1 on cpu",
    )
    p.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrency levels swept")
    p.add_argument("--hf-workers", default="1,4", help="peer worker counts to try; the best is kept")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument(
        "--prewarm",
        type=float,
        default=0.5,
        help="seconds per concurrency of an unrecorded pass before each sweep, up to 2 x batch x workers "
        "in flight: each worker has seen each batch size once",
    )
    p.add_argument("--requests", type=int, default=64, help="distinct request bodies per workload")
    p.add_argument("--jobs", type=int, default=1, help="archives built at once")
    p.add_argument("--build-only", action="store_true", help="build the archives into --work and stop")
    p.add_argument("--no-build", action="store_true", help="measure only the slm archives already in --work")
    p.add_argument("--load-timeout", type=float, default=420.0, help="seconds for every deployment to load")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--smoke", action="store_true", help="CPU, SmolLM2, tiny requests, 1 s points")
    args = p.parse_args()

    work, out = Path(args.work).resolve(), Path(args.out).resolve()
    store = work / "model-store"
    for d in (work, store, out):
        d.mkdir(parents=True, exist_ok=True)
    workloads, checkpoints, tokenizers, specs = plan(args, work)
    systems = args.systems.split(",")
    levels = [int(c) for c in args.levels.split(",")]
    variants = [
        parse_variant(v) for v in (args.slm or ("1:1,1:1:nographs" if args.device == "cuda" else "1:1")).split(",")
    ]
    hf_workers = [int(n) for n in args.hf_workers.split(",")]
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H%M%SZ")
    results = out / f"{stamp}_{'smoke' if args.smoke else 'bench'}.jsonl"
    meta = {
        "commit": args.commit,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": stamp,
        "host_gpus": torch.cuda.device_count(),
        "mps": mps_running(),
    }

    # One archive per model (W2 and W3 share one) and build option; deployments choose workers.
    deployments, builds = [], {}
    for model, w in {w.model: w for w in workloads.values()}.items():
        if "slm" in systems:
            for v in [v for v in variants if v.task in (None, w.task["task"])]:
                precision = v.precision or w.task.get("precision", "bf16")
                mar = f"slm_{model}_b{v.batch}" + PRECISION_SUFFIX.get(precision, "") + "_guard" * v.guard
                task = {**w.task, "max_batch": v.batch, "precision": precision}
                if mar not in builds and (
                    argv := slm_build(mar, checkpoints[w.name], task, store, args.device, work, v.guard)
                ):
                    builds[mar] = argv
                # served from a copy of the archive configured by the archiver for these workers and options
                served = mar + ("_nographs" if v.nographs else "") + (f"_g{v.gpus}" if v.gpus > 1 else "")
                d = Deployment(
                    "slm",
                    f"{served}_x{v.workers}",
                    f"{served}_x{v.workers}.mar",
                    v.workers,
                    v.batch,
                    cuda_graphs=not v.nographs,
                    gpus=v.gpus,
                    built=f"{mar}.mar",
                    precision=precision,
                )
                if d not in deployments:
                    deployments.append(d)
        # the peer scores label tokens only, and constrains no beam to a catalog
        if "hf" in systems and w.task.get("head", "labels") == "labels" and "catalog" not in w.task:
            archive_handler(
                f"hf_{model}",
                BENCH / "peer_handler.py",
                {"peer.json": {"checkpoint": str(checkpoints[w.name]), "task": w.task}},
                store,
                args.device,
                work,
            )
            deployments += [Deployment("hf", f"hf_{model}_x{n}", f"hf_{model}.mar", n) for n in hf_workers]
    archive_handler("noop", BENCH / "noop_handler.py", {}, store, "cpu", work)
    failed = set(builds) if args.no_build else build_all(builds, args.jobs, work)
    deployments = [d for d in deployments if d.built.removesuffix(".mar") not in failed]
    if failed:
        log(f"SKIPPED (not built): {sorted(failed)}")
    for d in deployments:
        if d.built and d.mar != d.built and (store / d.built).exists():  # made again: settings may change
            configure(store / d.built, store, deployment_options(d, args.device), d.mar.removesuffix(".mar"))
    deployments = [d for d in deployments if d.system != "slm" or (store / d.mar).exists()]
    gates = {d.built: read_manifest(store / d.built).get("fp8_gate") for d in deployments if d.system == "slm"}
    kernels = {d.built: read_manifest(store / d.built).get("kernels") for d in deployments if d.system == "slm"}
    for name, gate in gates.items():
        if gate:
            verdict = "passes" if gate_passes(gate) else "FAILS"
            log(f"{name}: fp8 accuracy gate against bf16: {gate}: {verdict} the archiver's default thresholds")
    if args.build_only:
        sys.exit(1 if failed else 0)

    server_dir = work / f"server-{stamp}"
    server_dir.mkdir()
    server = TorchServe(server_dir, store).start()

    totals: dict[str, dict[str, float]] = {}  # per deployment, TorchServe's counters at its last point
    placed: dict[str, list[int | None]] = {}  # per deployment, its workers' GPUs

    def record(d: Deployment, workload: str, point, flops_per_request: float, fp8_per_request: float = 0.0) -> None:
        before, totals[d.name] = totals.get(d.name, {}), frontend_totals(server, d.name)
        rec = {
            "system": d.system,
            "kernels": kernels.get(d.built),
            "batch": d.batch,
            "cuda_graphs": d.cuda_graphs,
            "gpus": d.gpus,
            "worker_gpus": placed.get(d.name),
            **served_settings(store / d.mar, d),
            "workload": workload,
            **frontend_means(before, totals[d.name]),
            "workers": d.workers,
            **dataclasses.asdict(point),
            **meta,
            "flops_per_request": flops_per_request,
            "precision": d.precision,
            "fp8_flops_per_request": fp8_per_request,
            "fp8_gate": gates.get(d.built),
            "fp8_gate_passes": gate_passes(gates[d.built]) if gates.get(d.built) else None,
            # each precision's FLOPs at its own peak; mfu_bf16 counts them all at the bf16 peak
            "mfu_effective": flops.mfu_effective(point.qps, flops_per_request, fp8_per_request),
            "mfu_bf16": flops.mfu(point.qps, flops_per_request),
        }
        rec.pop("request_indices")
        with results.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        log(
            f"{d.name:34s} {workload} c={point.concurrency:3d}: {point.qps:8.1f} req/s mean {point.mean_ms:7.1f} ms "
            f"p99 {point.p99_ms:7.1f} ms errors {point.errors}"
        )

    try:
        server.register("noop.mar")
        for c in (1, 16, 64):
            record(
                Deployment("noop", "noop", "noop.mar", 1),
                "ceiling",
                measure(f"{server.inference}/predictions/noop", [b"{}"], c, 1.0, args.duration),
                0.0,
            )
        # Every deployment loads at once (their workers start in parallel) and stays loaded; idle
        # workers wait on their sockets, and one deployment is measured at a time.
        start = time.monotonic()
        for d in deployments:
            server.register(d.mar, d.workers, name=d.name, synchronous=False)
        ready = set()
        for d in deployments:
            try:  # one deployment that does not come up is reported and skipped, not waited on forever
                server.wait_ready(d.name, d.workers, timeout=max(60.0, args.load_timeout - (time.monotonic() - start)))
                ready.add(d)
                placed[d.name] = worker_gpus(server, d.name)
                log(
                    f"{d.name}: {d.workers} worker(s) ready after {time.monotonic() - start:.0f} s, "
                    f"on GPUs {placed[d.name]}"
                )
            except TimeoutError as e:
                log(f"SKIPPED {e}")
        model_log = server_dir / "logs" / "model_log.log"  # what each worker's load and capture took
        for line in model_log.read_text(errors="replace").splitlines() if model_log.exists() else []:
            if "loaded a" in line or "graph package loaded" in line or "GPU memory reserved" in line:
                log(line[-220:])
        bodies = {w.name: TextMaker(tokenizers[w.name], seed=1).requests(w, args.requests) for w in workloads.values()}
        serving = {
            w.name: [d for d in deployments if d in ready and d.name.startswith(f"{d.system}_{w.model}_")]
            for w in workloads.values()
        }  # the loaded deployments of each workload's model
        checks = [served_check(server, w.name, bodies[w.name][:3], serving[w.name]) for w in workloads.values()]
        (out / f"{stamp}_served_check.json").write_text(json.dumps(checks, indent=1))
        silent: set[str] = set()  # deployments that stopped answering: skipped from then on
        for w in workloads.values():
            spec, task = specs[w.name], workload_task(w, tokenizers[w.name])
            encoded = [json.dumps(b).encode() for b in bodies[w.name]]
            for d in serving[w.name]:
                per_body = [request_flops(task, spec, b, d.precision) for b in bodies[w.name]]
                url = f"{server.inference}/predictions/{d.name}"
                for c in [] if args.smoke else [c for c in levels if c <= max(2, 2 * d.batch * d.workers)]:
                    if d.name in silent:
                        break
                    warm = measure(url, encoded, c, 0.0, args.prewarm)  # steady state first: not recorded
                    if warm.completed == 0 and not answers(url, encoded[0]):
                        silent.add(d.name)
                        dump_stacks(server, d.name)
                        log(
                            f"SKIPPED {d.name}: no answer on {w.name} at c={c} ({warm.errors} errors); its "
                            "workers' log follows the records"
                        )
                        save_logs(server_dir, out, f"{stamp}_{d.name}_silent")
                if d.name in silent:
                    continue
                totals[d.name] = frontend_totals(server, d.name)
                sweep(
                    url,
                    encoded,
                    levels[:2] if args.smoke else levels,
                    args.warmup,
                    args.duration,
                    on_point=lambda pt: record(d, w.name, pt, *mean_flops(pt, per_body)),
                )
    finally:
        server.stop()
        save_logs(server_dir, out, stamp)
    log(f"wrote {results}")


def answers(url: str, body: bytes, timeout: float = 30.0) -> bool:
    """Whether one request gets a 200 within `timeout` seconds (a slow deployment does; a stuck one not)."""
    try:
        return http("POST", url, body, {"Content-Type": "application/json"}, timeout=timeout)[0] == 200
    except (OSError, http_client.HTTPException):  # the timeout, a broken answer
        return False


def dump_stacks(server: TorchServe, model: str) -> None:
    """Have each of a model's workers write its threads' Python stacks to the model log
    (handlers/slm_handler.py registers SIGUSR1), so a stuck worker's log says where it waits."""
    for worker in server.workers(model):
        with contextlib.suppress(KeyError, ValueError, OSError):
            os.kill(int(worker["pid"]), signal.SIGUSR1)
    time.sleep(2)


def save_logs(server_dir: Path, out: Path, stamp: str) -> None:
    """The server's own account (and its per-request metric lines), next to the records: the
    last 500 kB of each log."""
    for name in ("ts_log.log", "model_log.log", "ts_metrics.log", "model_metrics.log"):
        if (path := server_dir / "logs" / name).exists():
            (out / f"{stamp}_{name.replace('.log', '.txt')}").write_bytes(path.read_bytes()[-500_000:])


@dataclasses.dataclass(frozen=True)
class Deployment:
    """One registered model: `workers` workers of archive `mar`, served as `name`."""

    system: str  # "slm", "hf" or "noop"
    name: str
    mar: str
    workers: int
    batch: int = 1  # slm: the task's max_batch, requests per graph call
    cuda_graphs: bool = True  # slm on CUDA: calls replay CUDA graphs
    gpus: int = 1  # workers spread over GPUs 0..gpus-1 (TorchServe deviceIds)
    built: str = ""  # slm: the archive built, when `mar` is a copy of it configured by the archiver
    precision: str = "bf16"  # slm: the task's precision (bf16, fp8-static)


def deployment_options(d: Deployment, device: str) -> ServingOptions:
    """The archiver's serving options for a deployment: its workers on GPU 0 (or spread over its
    GPUs), everything else the archiver's default."""
    ids = tuple(range(d.gpus)) if device == "cuda" else ()
    return ServingOptions(workers=d.workers, response_timeout_s=600, device_ids=ids, cuda_graphs=d.cuda_graphs)


class Variant(NamedTuple):
    """One --slm entry, WORKERS:BATCH[:OPTION...]."""

    workers: int
    batch: int
    nographs: bool = False
    precision: str | None = None  # the workload's, or OPTION_PRECISION's
    gpus: int = 1
    task: str | None = None  # "score" or "beam": the variant serves only that task's archives
    guard: bool = False  # built with the accuracy reference: the online accuracy guard runs


def parse_variant(text: str) -> Variant:
    workers, batch, *options = text.split(":")
    v = Variant(int(workers), int(batch))
    for o in options:
        if o == "nographs":
            v = v._replace(nographs=True)
        elif o in ("score", "beam"):
            v = v._replace(task=o)
        elif o == "guard":
            v = v._replace(guard=True)
        elif o in OPTION_PRECISION:
            v = v._replace(precision=OPTION_PRECISION[o])
        elif re.fullmatch(r"g[1-9][0-9]*", o):
            v = v._replace(gpus=int(o[1:]))
        else:
            raise SystemExit(f"--slm {text}: unknown option {o!r} (fp8static, nographs, gN, score, beam, guard)")
    return v


def worker_gpus(server: TorchServe, model: str) -> list[int | None]:
    """The GPU of each of a model's workers, from TorchServe's own account (gpuUsage names it)."""
    found = [re.search(r"gpuId::(\d+)", w.get("gpuUsage") or "") for w in server.workers(model)]
    return [int(m.group(1)) if m else None for m in found]


FRONTEND = ("ts_inference_requests_total", "ts_inference_latency_microseconds", "ts_queue_latency_microseconds")


def frontend_totals(server: TorchServe, model: str) -> dict[str, float]:
    """TorchServe's cumulative counters for one model (Prometheus, see config.properties): requests
    answered, and microseconds they spent in the frontend in all (receipt to response) and in its
    queue waiting for a worker."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{server.metrics}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:  # no breakdown for this point; the measurement stands
        return {}
    out = dict.fromkeys(FRONTEND, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in out and f'model_name="{model}"' in line:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def frontend_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per request over one point (its warm-up included): milliseconds inside TorchServe and in its
    queue. Client latency minus the first is HTTP and the load generator; the first minus the
    queue is the worker (IPC, batching, the handler)."""
    n = after.get(FRONTEND[0], 0.0) - before.get(FRONTEND[0], 0.0)
    if n <= 0:
        return {}
    per = {key: (after[key] - before.get(key, 0.0)) / n / 1e3 for key in FRONTEND[1:]}
    return {"ts_requests": n, "ts_frontend_ms": per[FRONTEND[1]], "ts_queue_ms": per[FRONTEND[2]]}


def served_settings(mar: Path, d: Deployment) -> dict:
    """What a deployment's archive configures: TorchServe's batch and the queue (slm: its serving
    spec; others: the graph batch, unknown queue), and the share of requests the online accuracy
    guard recomputes (0 where the package holds no reference)."""
    if d.system != "slm":
        return {"ts_batch": d.batch, "queue": None, "batch_delay_ms": None, "accuracy_guard": 0.0}
    serving = read_serving(mar)
    guard = serving.accuracy_sample if read_manifest(mar).get("reference") else 0.0
    return {
        "ts_batch": serving.batch,
        "queue": serving.queue,
        "batch_delay_ms": serving.batch_delay_ms,
        "accuracy_guard": guard,
    }


def served_check(server: TorchServe, workload: str, bodies: list[dict], deployments: list[Deployment]) -> dict:
    """Send the same requests to every deployment of a workload and compare each answer with the HF
    peer's (or the first deployment's): score, the largest label-probability difference (an
    embedding's largest cosine distance); beam, the share of candidate token sequences in common
    and whether the best candidate is the same."""
    import urllib.request

    def ask(d: Deployment, body: dict) -> dict:
        req = urllib.request.Request(
            f"{server.inference}/predictions/{d.name}", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    if not deployments:
        return {"workload": workload, "against": None, "deployments": {}}
    base = next((d for d in deployments if d.system == "hf"), deployments[0])
    try:
        want = [ask(base, b) for b in bodies]
    except OSError as e:  # urllib's HTTP and connection errors
        log(f"served check {workload}: {base.name} failed: {e}")
        return {"workload": workload, "against": base.name, "error": str(e)}
    result = {}
    for d in deployments:
        if d is base:
            continue
        try:
            got = [ask(d, b) for b in bodies]
        except OSError as e:
            got, result[d.name] = None, {"error": str(e)}
        if got is None:
            pass
        elif "embeddings" in want[0]:
            result[d.name] = {
                "max_cosine_distance": max(
                    cosine_distance(ra, rb)
                    for a, b in zip(want, got)
                    for ra, rb in zip(a["embeddings"], b["embeddings"])
                )
            }
        elif "scores" in want[0]:
            result[d.name] = {
                "max_abs_dp": max(
                    abs(p - q)
                    for a, b in zip(want, got)
                    for ra, rb in zip(a["scores"], b["scores"])
                    for p, q in zip(ra, rb)
                )
            }
        else:
            shared = [
                len({tuple(c["token_ids"]) for c in a["candidates"]} & {tuple(c["token_ids"]) for c in b["candidates"]})
                / len(a["candidates"])
                for a, b in zip(want, got)
            ]
            result[d.name] = {
                "min_shared": min(shared),
                "same_best": sum(
                    a["candidates"][0]["token_ids"] == b["candidates"][0]["token_ids"] for a, b in zip(want, got)
                ),
            }
        log(f"served check {workload} {d.name} vs {base.name}: {result[d.name]}")
    return {"workload": workload, "against": base.name, "requests": len(bodies), "deployments": result}


def mean_flops(point, per_body: list[tuple[int, int]]) -> tuple[float, float]:
    """Mean FLOPs, and fp8 FLOPs, of the requests a point completed."""
    n = max(1, len(point.request_indices))
    return (
        sum(per_body[i][0] for i in point.request_indices) / n,
        sum(per_body[i][1] for i in point.request_indices) / n,
    )


def plan(args, work: Path):
    """The workloads to run and, per workload, the checkpoint serving it, the tokenizer its texts are
    made with and its architecture (for FLOPs)."""
    if args.smoke:
        from handlers.demo import TASKS, smollm2
        from slm_core.compile.checkpoint import load_checkpoint

        gguf = Path(smollm2())
        ckpt = load_checkpoint(gguf)
        arch = {}
        chosen = {
            "W1": Workload(
                "W1",
                "smollm2_intent",
                arch,
                yaml.safe_load((TASKS / "smollm2-intent.yaml").read_text()),
                texts=3,
                lengths=(8, 24),
            ),
            "W2": Workload(
                "W2",
                "smollm2_complete",
                arch,
                yaml.safe_load((TASKS / "smollm2-complete.yaml").read_text()),
                texts=0,
                lengths=(8, 24),
            ),
        }
        return chosen, {k: gguf for k in chosen}, {k: ckpt.tokenizer for k in chosen}, {k: ckpt.spec for k in chosen}
    if not args.tokenizer:
        sys.exit("--tokenizer is required (see bench/README.md)")
    tok_path = Path(args.tokenizer)
    chosen = {k: WORKLOADS[k] for k in args.workloads.split(",")}
    for k, w in chosen.items():
        if "max_items" in w.task:  # a retrieval workload: its catalog, written once per work dir
            chosen[k] = dataclasses.replace(
                w, task={**w.task, "catalog": str(catalog_items(work / "catalog-1000000-0.jsonl"))}
            )
    checkpoints = {}
    for k, w in chosen.items():
        log(f"random {w.arch['model_type']} checkpoint for {k}")
        same = next(j for j in chosen if chosen[j].arch == w.arch)  # one checkpoint per architecture
        checkpoints[k] = random_checkpoint(w.arch, tok_path, work / f"ckpt-{chosen[same].model}")
    specs = {k: ModelSpec.from_hf_config(w.arch) for k, w in chosen.items()}
    return chosen, checkpoints, {k: Tokenizer.from_file(str(tok_path)) for k in chosen}, specs


if __name__ == "__main__":
    main()
