"""Build a TorchServe archive (.mar) for one task.

The archive holds the compiled package (graph.pt2, tokenizer.json, manifest.json), the handler,
model-config.yaml and the slm_core/ and kernels/ sources, so it runs wherever the runtime
dependencies (torch of the same version, tokenizers, numpy, pyyaml) are installed.
"""

import importlib.util
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import yaml

from slm_core.checkpoint import load_checkpoint
from slm_core.errors import SpecError
from slm_core.package import FP8_MAX_DIFF, FP8_MIN_SHARED, build_package
from slm_core.spec import TaskSpec

HANDLER_MODULE = "handlers.slm_handler"
SOURCE_PACKAGES = ("slm_core", "kernels")


def progress(message: str) -> None:
    print(f"[archiver {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def model_config(device: str, workers: int, response_timeout: int, batch: int = 1, batch_delay_ms: int = 1,
                 queue: int = 100, cuda_graphs: bool = True, device_ids: list[int] | None = None,
                 capture_at_load: bool = True, contexts: int = 0) -> dict:
    """TorchServe's per-model settings (model-config.yaml). A worker takes up to `batch` queued
    requests at once and waits at most `batch_delay_ms` for more: with 1 ms, what is queued goes
    at once. It must be at least 1: TorchServe 0.12 reads a maxBatchDelay of 0 in
    model-config.yaml as unset and waits its default 100 ms (ModelManager; measured on the H200,
    bench/RESULTS.md run 052155Z: 110 ms at one request at a time). At
    most `queue` requests wait for a worker; the next ones get an immediate 503. Workers go to the
    GPUs `device_ids` in turn (TorchServe's deviceIds; without them, to all the host's GPUs in
    turn, shared with the other models). The `handler` section is the handler's own
    (ctx.model_yaml_config): CUDA graphs or not, and whether a worker captures every size bucket
    as it loads (else each on its first call). With `contexts` >= 1 the worker runs in TorchServe's
    async mode with that many request contexts (slm_core.scheduler), and `queue` bounds the
    requests waiting inside it (TorchServe's own queue never fills in that mode); TorchServe then
    hands requests over one at a time (its 0.12 async batching breaks on a second request, FACTS.md)
    and the worker batches them itself. A worker has 10 minutes to load (TorchServe's default of 2
    is near a CUDA worker's captures at load)."""
    check_batch_delay(batch_delay_ms)
    config = {
        "minWorkers": workers,
        "maxWorkers": workers,
        "batchSize": batch,
        "maxBatchDelay": batch_delay_ms,
        "jobQueueSize": queue,
        "responseTimeout": response_timeout,
        "startupTimeout": 600,
        "deviceType": "gpu" if device.startswith("cuda") else "cpu",
        **({"deviceIds": list(device_ids)} if device_ids and device.startswith("cuda") else {}),
        "handler": {"cuda_graphs": cuda_graphs, "capture_at_load": cuda_graphs and capture_at_load},
    }
    return serve_async(config, contexts) if contexts else config


def check_batch_delay(ms: int) -> None:
    if ms < 1:
        raise SpecError(f"batch delay {ms} ms: TorchServe reads a maxBatchDelay below 1 in an archive as "
                        "unset and waits 100 ms for every batch; give at least 1")


def serve_async(config: dict, contexts: int) -> dict:
    """A model-config in TorchServe's async mode with `contexts` request contexts per worker: one
    request at a time from TorchServe (batchSize 1; the worker batches), and its jobQueueSize as
    the bound of requests waiting inside the worker."""
    handler = {**(config.get("handler") or {}), "contexts": contexts, "max_waiting": config["jobQueueSize"]}
    return {**config, "asyncCommunication": True, "batchSize": 1, "handler": handler}


def served_queue(config: dict) -> int:
    """The requests a model-config lets wait: an async worker's max_waiting, else TorchServe's queue."""
    return (config.get("handler") or {}).get("max_waiting", config["jobQueueSize"])


def serving_defaults(device: str, task: TaskSpec, gpus: int = 1) -> tuple[int, int]:
    """(workers, request contexts per worker) when the archiver is not told: two sync workers per
    GPU of `--device-ids`, score and beam alike; CPU builds (development) one sync worker.

    Beam: the fastest on the H200 (bench/RESULTS.md, runs 200552Z to 015205Z): W2 257.7-300.0 and
    W3 109.3-150.7 req/s at the SLO, against 157.3-166.0 / 102.7-105.3 for an async worker with 2
    contexts (TorchServe's batching puts 2-3 requests in a call, almost free for beams). Score: an
    async worker with 2 contexts serves more (W1 236.7-257.7 against 203.3-211.0), but at 3x
    overload its refusals take 17-37 ms (they travel the async path) and its admitted P99 was
    86 ms, against 1.2 ms and 60 ms for two sync workers (run 015205Z); in run 234007Z it refused
    everything for 80 s, its worker apparently reloading (not recurred, not explained). So async
    is `--contexts 2`, chosen knowingly. Under NVIDIA MPS (runs 2026-12-01T094554Z and 095503Z) two
    sync workers served W2 356.0-379.0, W3 153.7-205.0 and W1 (fp8-static) 272.7-304.3 req/s at
    the SLO, three 370.0, 206.3 and 314.7: inside the spread, so two stay."""
    if not device.startswith("cuda"):
        return 1, 0
    return 2 * gpus, 0


def worker_batch(max_batch: int, workers: int, contexts: int = 0, gpus: int = 1) -> int:
    """TorchServe's batchSize. Sync workers that share a GPU split max_batch between them, so that
    their calls together hold about one full call: a GPU drains about max_batch requests per full
    call whatever its worker count, and two workers taking max_batch each would put two full calls
    ahead of every queued request (run 234007Z: admitted P99 211 ms at 3x overload). Async mode
    takes requests one at a time (the worker batches them itself)."""
    if contexts:
        return 1
    return -(-max_batch // -(-workers // gpus))


def queue_for_deadline(deadline_ms: float, call_ms: float, per_call: int, calls: int, gpus: int = 1) -> int:
    """Requests that may wait for a worker so that the last of them still finishes within 90 % of
    the deadline (the rest is for the time outside the calls: HTTP, TorchServe, the handler's own
    work, 2-5 ms on the H200, and jitter). A GPU runs `calls` calls of up to `per_call` requests at
    once, each taking about `call_ms` of the GPU, so it drains per_call requests per call_ms. A
    request behind q others waits q / per_call calls' time for a worker to take it, then its own
    call shares the GPU with the others: it finishes after about (q / per_call + calls + 1) x
    call_ms (with call_ms from the drain rate measured at 3x overload, the admitted P99 of three
    H200 overload runs within 6 %, bench/RESULTS.md).
    At least 1 per GPU."""
    return max(1, int(deadline_room(deadline_ms, call_ms, per_call, calls))) * gpus


def deadline_room(deadline_ms: float, call_ms: float, per_call: int, calls: int) -> float:
    """queue_for_deadline's requests per GPU before rounding: below 1, the calls at once and a
    request's own call already take most of the deadline."""
    return (0.9 * deadline_ms / call_ms - calls - 1) * per_call


DEFAULT_DEADLINE_MS = 80.0  # the latency SLO's P99 bound


class Admission(NamedTuple):
    batch: int  # TorchServe's batchSize
    queue: int  # its jobQueueSize, or each async worker's max_waiting
    call_ms: float  # a call of per_call requests at the bounds (the build's timing)
    per_call: int  # requests one call may hold
    calls: int  # calls at once on one GPU


def call_time(call_ms: dict[str, float], requests: int) -> float:
    """A call of `requests` requests at the bounds, from the build's timings (slm_core.package.time_calls):
    the smallest timed call that holds them."""
    return call_ms[str(min((int(b) for b in call_ms if int(b) >= requests), default=max(map(int, call_ms))))]


def admission(deadline_ms: float, call_ms: dict[str, float], max_batch: int, workers: int, contexts: int = 0,
              gpus: int = 1, batch: int | None = None) -> Admission:
    """A deployment's TorchServe batch (worker_batch unless given) and its queue for the deadline:
    on each GPU its sync workers' calls of `batch` requests, or its async workers' contexts'
    calls of up to max_batch requests each, run at once. TorchServe's queue serves all the
    workers; an async worker bounds its own (max_waiting): its share of its GPU's."""
    batch = batch or worker_batch(max_batch, workers, contexts, gpus)
    per_call = max_batch if contexts else batch
    per_gpu = -(-workers // gpus)
    calls = per_gpu * (contexts or 1)
    call = call_time(call_ms, per_call)
    if contexts:
        queue = max(1, queue_for_deadline(deadline_ms, call, per_call, calls) // per_gpu)
    else:
        queue = queue_for_deadline(deadline_ms, call, per_call, calls, gpus)
    return Admission(batch, queue, call, per_call, calls)


def build(
    checkpoint: str, task_path: str, model_name: str, export_path: str, device: str = "cpu",
    workers: int | None = None, response_timeout: int = 120, attention: str = "reference", batch_delay_ms: int = 1,
    queue: int | None = None, cuda_graphs: bool = True, deadline_ms: float | None = None, topk: str = "torch",
    device_ids: list[int] | None = None, capture_at_load: bool = True, fp8_max_diff: float = FP8_MAX_DIFF,
    fp8_min_shared: float = FP8_MIN_SHARED, contexts: int | None = None,
) -> Path:
    """Build `model_name`.mar into export_path; workers and contexts left None take
    serving_defaults."""
    from model_archiver.model_archiver_config import ModelArchiverConfig
    from model_archiver.model_packaging import generate_model_archive

    check_batch_delay(batch_delay_ms)  # before minutes of compiling
    task = TaskSpec.load(task_path)
    default_workers, default_contexts = serving_defaults(device, task, len(device_ids) if device_ids else 1)
    workers = default_workers if workers is None else workers
    contexts = default_contexts if contexts is None else contexts
    export = Path(export_path)
    export.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"{model_name}-") as tmp:
        stage = Path(tmp) / "stage"
        progress(f"loading checkpoint {checkpoint}")
        ckpt = load_checkpoint(checkpoint)
        manifest = build_package(ckpt, task, device, stage, progress, attention, topk, fp8_max_diff, fp8_min_shared)
        progress(f"compiled graph matches eager: {manifest['check']}")
        if queue is None and deadline_ms is None and not device.startswith("cuda"):
            queue = 100  # CPU serving is for development: the latency target is the GPU's
        gpus = len(device_ids) if device_ids else 1
        batch = worker_batch(task.max_batch, workers, contexts, gpus)
        if queue is None:
            deadline_ms = deadline_ms or DEFAULT_DEADLINE_MS
            _, queue, call, per_call, calls = admission(deadline_ms, manifest["call_ms"], task.max_batch, workers,
                                                        contexts, gpus, batch)
            fits = deadline_room(deadline_ms, call, per_call, calls) >= 1
            progress(f"queue of {queue} for a {deadline_ms:g} ms deadline: a call of {per_call} request(s) at the "
                     f"token bounds takes {call:.1f} ms, {calls} such call(s) at once per GPU, on {gpus} GPU(s)"
                     + ("" if fits else "; the calls at once and a request's own call already take most of the "
                        "deadline: under overload, admitted requests may miss it (lower max_batch or the bounds)"))
        for name in SOURCE_PACKAGES:
            src = Path(importlib.util.find_spec(name).submodule_search_locations[0])
            shutil.copytree(src, stage / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        config = Path(tmp) / "model-config.yaml"
        settings = model_config(device, workers, response_timeout, batch, batch_delay_ms, queue, cuda_graphs,
                                device_ids, capture_at_load, contexts)
        config.write_text(yaml.safe_dump(settings, sort_keys=False))
        progress(f"serving: {workers} worker(s), "
                 + (f"async mode with {contexts} request contexts each" if contexts else "sync mode"))
        progress(f"writing {export / (model_name + '.mar')}")
        generate_model_archive(ModelArchiverConfig(
            model_name=model_name,
            handler=importlib.util.find_spec(HANDLER_MODULE).origin,
            version="1.0",
            extra_files=str(stage),
            export_path=str(export),
            archive_format="zip-store",  # graph.pt2 is already a zip of weights: storing is as small and much faster
            force=True,
            config_file=str(config),
        ))
    mar = export / f"{model_name}.mar"
    progress(f"done: {mar} ({mar.stat().st_size / 1e6:.0f} MB)")
    return mar
