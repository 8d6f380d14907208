"""How an archive serves: one frozen spec (ServingSpec) that the archiver writes into the
archive's model-config.yaml and the handler only reads, and the defaults a build takes for what
its user leaves open (plan). The defaults are the deployments that served best on the H200
(docs/operations.md, Defaults; bench/RESULTS.md).

Admission: TorchServe's jobQueueSize bounds the requests waiting for a worker, beyond it a
request is refused at once (503) instead of queueing without bound. The queue is sized for a
deadline: a GPU runs `calls` calls of up to `per_call` requests at once (its workers' batches),
each taking about `call_ms` (the build's timing of a call at the token bounds), so it drains
per_call requests per call_ms. A request behind q others waits q / per_call calls for a worker,
then its own call shares the GPU with the others: it finishes after about
(q / per_call + calls + 1) x call_ms. The queue is the largest q with that within 90 % of the
deadline (the rest is for HTTP, TorchServe and the handler's own work, a few ms, and jitter), at
least 1 per GPU.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from slm_core.errors import SpecError

DEFAULT_DEADLINE_MS = 80.0  # the latency SLO's P99 bound
WORKERS_PER_GPU = 2  # sync workers per GPU on CUDA (docs/operations.md, Defaults)
CPU_QUEUE = 100  # CPU builds, for development, without a deadline: TorchServe's own default
HANDLER = "handler"  # the handler's own section of model-config.yaml (TorchServe hands it over as is)


@dataclass(frozen=True)
class ServingOptions:
    """What a user may choose for a deployment; None takes the default (plan)."""

    workers: int | None = None
    queue: int | None = None  # requests that may wait for a worker
    deadline_ms: float | None = None  # sizes the queue when `queue` is not given
    batch_delay_ms: int = 1  # the longest wait for more requests to batch
    response_timeout_s: int = 120  # a call longer than this: TorchServe restarts the worker
    device_ids: tuple[int, ...] = ()  # the GPUs this model's workers go to, in turn
    cuda_graphs: bool = True  # replay calls from CUDA graphs, each captured at first use (off: GPU memory)
    catalog_store: str | None = None  # catalog tasks: the directory of catalog versions workers follow
    # the online accuracy guard (archives with a reference graph): the share of requests recomputed
    # by the reference, and the thresholds past which one is a breach (the FP8 gate's defaults)
    accuracy_sample: float = 0.001
    accuracy_max_diff: float = 0.05
    accuracy_min_shared: float = 0.6

    def __post_init__(self):
        for name in ("workers", "queue", "response_timeout_s"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise SpecError(f"serving option {name} must be a positive integer, got {value!r}")
        if self.deadline_ms is not None and not 0 < self.deadline_ms < math.inf:
            raise SpecError(f"serving option deadline_ms must be a positive number, got {self.deadline_ms!r}")
        if type(self.cuda_graphs) is not bool:
            raise SpecError(f"serving option cuda_graphs must be true or false, got {self.cuda_graphs!r}")
        for name, top in (("accuracy_sample", 1.0), ("accuracy_max_diff", math.inf), ("accuracy_min_shared", 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= top:
                bound = "at least 0" if top == math.inf else "from 0 to 1"
                raise SpecError(f"serving option {name} must be a number {bound}, got {value!r}")
        if type(self.batch_delay_ms) is not int or self.batch_delay_ms < 1:
            # TorchServe 0.12 reads a maxBatchDelay below 1 in an archive as unset: 100 ms per batch
            raise SpecError(
                f"batch delay {self.batch_delay_ms!r} ms: TorchServe reads a maxBatchDelay below 1 "
                "in an archive as unset and waits 100 ms for every batch; give at least 1"
            )
        if any(type(i) is not int or i < 0 for i in self.device_ids) or len(set(self.device_ids)) != len(
            self.device_ids
        ):
            raise SpecError(f"device_ids {list(self.device_ids)}: GPU indices are distinct and not negative")


@dataclass(frozen=True)
class ServingSpec:
    """A deployment of one archive, as TorchServe and the handler run it."""

    device: str  # "cpu" or "cuda"
    workers: int  # worker processes (TorchServe's minWorkers = maxWorkers)
    batch: int  # requests a worker takes into one graph call (TorchServe's batchSize)
    queue: int  # requests that may wait for a worker (jobQueueSize)
    batch_delay_ms: int = 1
    response_timeout_s: int = 120
    device_ids: tuple[int, ...] = ()
    cuda_graphs: bool = True
    deadline_ms: float | None = None  # the deadline `queue` was sized for, if it was
    catalog_store: str | None = None  # slm_core.catalog_store: the versions its workers swap in
    accuracy_sample: float = 0.001  # slm_core.serve.accuracy_guard, where the package has a reference
    accuracy_max_diff: float = 0.05
    accuracy_min_shared: float = 0.6

    @property
    def gpus(self) -> int:
        return len(self.device_ids) or 1

    def model_config(self) -> dict[str, Any]:
        """TorchServe's per-model settings (model-config.yaml). A worker has 10 minutes to load:
        TorchServe's default of 2 is near a CUDA worker's package load when several start at once."""
        cuda = self.device == "cuda"
        return {
            "minWorkers": self.workers,
            "maxWorkers": self.workers,
            "batchSize": self.batch,
            "maxBatchDelay": self.batch_delay_ms,
            "jobQueueSize": self.queue,
            "responseTimeout": self.response_timeout_s,
            "startupTimeout": 600,
            "deviceType": "gpu" if cuda else "cpu",
            **({"deviceIds": list(self.device_ids)} if self.device_ids and cuda else {}),
            HANDLER: {
                "cuda_graphs": self.cuda_graphs,
                "deadline_ms": self.deadline_ms,
                **({"catalog_store": self.catalog_store} if self.catalog_store else {}),
                "accuracy_sample": self.accuracy_sample,
                "accuracy_max_diff": self.accuracy_max_diff,
                "accuracy_min_shared": self.accuracy_min_shared,
            },
        }

    @classmethod
    def from_model_config(cls, config: Mapping[str, Any]) -> "ServingSpec":
        """The spec an archive's model-config.yaml holds (TorchServe hands it to the handler)."""
        own = dict(config.get(HANDLER) or {})
        known = {
            "cuda_graphs",
            "deadline_ms",
            "catalog_store",
            "accuracy_sample",
            "accuracy_max_diff",
            "accuracy_min_shared",
        }
        unknown = set(own) - known
        if unknown:
            raise SpecError(
                f"unknown keys {sorted(unknown)} in model-config.yaml's {HANDLER!r} section "
                f"(known: {', '.join(sorted(known))}): rebuild the archive with this version"
            )
        if type(own.get("cuda_graphs", True)) is not bool:
            raise SpecError(f"model-config.yaml's cuda_graphs must be true or false, got {own['cuda_graphs']!r}")
        return cls(
            device="cuda" if config.get("deviceType") == "gpu" else "cpu",
            workers=int(config.get("minWorkers", 1)),
            batch=int(config.get("batchSize", 1)),
            queue=int(config.get("jobQueueSize", CPU_QUEUE)),
            batch_delay_ms=int(config.get("maxBatchDelay", 1)),
            response_timeout_s=int(config.get("responseTimeout", 120)),
            device_ids=tuple(config.get("deviceIds") or ()),
            **own,
        )


def plan(options: ServingOptions, device: str, max_batch: int, call_ms: dict[str, float]) -> tuple[ServingSpec, str]:
    """The deployment for `options`, the defaults taken for what they leave open: on CUDA
    WORKERS_PER_GPU sync workers per GPU splitting max_batch between them, and the queue for the
    deadline (DEFAULT_DEADLINE_MS unless given); CPU builds one worker and CPU_QUEUE unless given
    a deadline. `call_ms`: the build's call timings (slm_core.compile.checks.time_calls). Returns
    the spec and a line saying how the queue was sized."""
    cuda = device.startswith("cuda")
    gpus = len(options.device_ids) or 1
    workers = options.workers or (WORKERS_PER_GPU * gpus if cuda else 1)
    batch = worker_batch(max_batch, workers, gpus)
    deadline = options.deadline_ms or (DEFAULT_DEADLINE_MS if cuda else None)
    if options.queue is not None:
        queue, note = options.queue, f"queue of {options.queue}, as given"
    elif deadline is None:
        queue, note = CPU_QUEUE, f"queue of {CPU_QUEUE} (a CPU build without a deadline)"
    else:
        calls = -(-workers // gpus)
        call = call_time(call_ms, batch)
        room = deadline_room(deadline, call, batch, calls)
        queue = max(1, int(room)) * gpus
        note = (
            f"queue of {queue} for a {deadline:g} ms deadline: a call of {batch} request(s) at the token bounds "
            f"takes {call:.1f} ms, {calls} such call(s) at once per GPU, on {gpus} GPU(s)"
            + (
                ""
                if room >= 1
                else "; the calls at once and a request's own call already take most of the "
                "deadline: under overload, admitted requests may miss it (lower max_batch or the bounds)"
            )
        )
    spec = ServingSpec(
        "cuda" if cuda else "cpu",
        workers,
        batch,
        queue,
        options.batch_delay_ms,
        options.response_timeout_s,
        tuple(options.device_ids) if cuda else (),
        options.cuda_graphs,
        deadline if options.queue is None else None,
        options.catalog_store,
        options.accuracy_sample,
        options.accuracy_max_diff,
        options.accuracy_min_shared,
    )
    return spec, note


def worker_batch(max_batch: int, workers: int, gpus: int = 1) -> int:
    """TorchServe's batchSize: workers that share a GPU split max_batch between them, so that
    their calls together hold about one full call. A GPU drains about max_batch requests per full
    call whatever its worker count, and two workers taking max_batch each put two full calls ahead
    of every queued request (past the P99 bound under overload: bench/RESULTS.md)."""
    return -(-max_batch // -(-workers // gpus))


def call_time(call_ms: dict[str, float], requests: int) -> float:
    """A call of `requests` requests at the bounds: the smallest timed call that holds them."""
    return call_ms[str(min((int(b) for b in call_ms if int(b) >= requests), default=max(map(int, call_ms))))]


def deadline_room(deadline_ms: float, call_ms: float, per_call: int, calls: int) -> float:
    """Requests per GPU that may wait within 90 % of the deadline, before rounding: below 1, the
    calls at once and a request's own call already take most of it."""
    return (0.9 * deadline_ms / call_ms - calls - 1) * per_call
