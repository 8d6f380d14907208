"""TorchServe handler: request body -> slm_core engine -> JSON. Thin by design: the request path
lives in the package's manifest and slm_core.serve; the deployment in the archive's
model-config.yaml (slm_core.serving.ServingSpec). Travels inside the .mar, next to the serve-time
slm_core sources it imports (the worker's PYTHONPATH holds the model dir).

A worker takes one batch of up to batchSize requests at a time and makes it one graph call.
"""

import faulthandler
import gc
import logging
import os
import resource
import signal
import time

import torch
from ts.metrics.dimension import Dimension
from ts.metrics.metric_type_enum import MetricTypes
from ts.utils.util import PredictionException

from slm_core import manifest
from slm_core.catalog_store import CatalogStore
from slm_core.errors import DeviceLost
from slm_core.serve import in_flight
from slm_core.serve.accuracy_guard import AccuracyGuard
from slm_core.serve.catalog_watch import HEADROOM, CatalogWatch
from slm_core.serve.deadline import Deadlines
from slm_core.serve.kserve import metadata
from slm_core.serve.loader import load_package, mps_running, reference_engine
from slm_core.serve.protocol import Reply, Request, encode, respond_batch
from slm_core.serving import ServingSpec

log = logging.getLogger(__name__)
EXIT_DEVICE_LOST = 75  # the worker's exit status when its GPU context is lost (EX_TEMPFAIL)
PHRASES = {
    200: "OK",
    400: "Bad Request",
    415: "Unsupported Media Type",
    500: "Internal Server Error",
    504: "Gateway Timeout",
}


def workers_share_a_gpu(serving: ServingSpec, host_gpus: int) -> bool:
    """Whether a model's workers outnumber the GPUs TorchServe deals them to in turn: the
    archive's deviceIds, else all the host's."""
    return serving.workers > max(1, len(serving.device_ids) or host_gpus)


def through_grpc(request: Request) -> bool:
    """Whether a request came through TorchServe's gRPC Predictions or StreamPredictions: those hand
    the worker no request headers at all, while every REST request carries its HTTP headers, with
    Content-Length at least (Netty's aggregator sets it) and TorchServe's own `explain`/`url_path`
    on /predictions."""
    return not request.headers


def shared_grpc_error(grpc: list[bool], replies: list[Reply]) -> Reply | None:
    """The error to fail a whole batch with, if any. TorchServe's gRPC replies drop the status a
    handler sets for a request (GRPCJob.response): a gRPC client gets an error status only when the
    worker fails the whole batch, with one status and one message for every request in it. So a
    batch of gRPC requests that all get the same error fails that way (400 -> INVALID_ARGUMENT,
    415 -> FAILED_PRECONDITION, 500 -> INTERNAL, the JSON error as the message). A batch holding a
    REST request or another reply never does: its gRPC requests get status OK, with the JSON error
    as the answer."""
    first = replies[0]
    same = all((r.status, r.body) == (first.status, first.body) for r in replies)
    return first if all(grpc) and first.status != 200 and same else None


def description(package: dict, serving: ServingSpec, tensors: dict) -> bytes:
    """What describe-model answers with ?customized=true (TorchServe's customizedMetadata): the
    task as built (kind, labels, bounds, precision), its request field and answer fields, the
    build's device and timings, this deployment's serving settings, and the Open Inference
    Protocol's input and output tensors (`kserve`: what deploy/kserve_gateway.py answers for
    GET /v2/models/NAME)."""
    encode_node = manifest.node(package, "encode")
    return encode(
        {
            "task": package["task"],
            "request_field": encode_node["input"],
            "kserve": tensors,
            "answer": manifest.node(package, "decode")["output"],
            "bounds": encode_node["bounds"],
            "device": package["device"],
            "dtype": package.get("dtype"),
            "call_ms": package.get("call_ms"),
            "serving": {
                "workers": serving.workers,
                "batch": serving.batch,
                "queue": serving.queue,
                "deadline_ms": serving.deadline_ms,
                "cuda_graphs": serving.cuda_graphs,
            },
        }
    )


def record_metrics(metrics, replies: list[Reply]) -> None:
    """What an operator alerts on, from one batch, on TorchServe's Prometheus endpoint: each graph
    call once, its seconds (SlmGraphCallSeconds) and its requests (SlmRequestsPerCall) as
    histograms; each answered request's texts and tokens (SlmTexts, SlmTokens); each request the
    handler refused or failed, by its status (SlmRefused, Status "400", "415", "500"; "504": a
    deadline). TorchServe's own refusals of a full queue (503) never reach a worker: its
    Requests5XX counts them."""
    calls = {}
    for reply in replies:
        if reply.stats is None:  # no graph call: refused or failed, or a model description
            if reply.status != 200:
                metrics.add_counter("SlmRefused", 1, dimensions=[Dimension("Status", str(reply.status))])
            continue
        calls[reply.stats.call] = reply.stats
        metrics.add_counter("SlmTexts", reply.stats.texts)
        metrics.add_counter("SlmTokens", reply.stats.tokens)
    for stats in calls.values():
        metrics.add_time("SlmGraphCallSeconds", stats.graph_ms / 1e3, unit="s", metric_type=MetricTypes.HISTOGRAM)
        metrics.add_metric("SlmRequestsPerCall", stats.batch, "count", metric_type=MetricTypes.HISTOGRAM)


def request_id(ctx, i: int) -> str:
    """TorchServe's id of the batch's request i (as its access log names it), "" without one."""
    ids = getattr(ctx, "request_ids", None) or {}
    return str(ids.get(i, ""))


def requests(data: list[dict], ctx) -> list[Request]:
    """TorchServe's batch as protocol Requests: each one's parameters and its HTTP headers (names
    as the client spelled them: lower-cased here)."""
    out = []
    for i, parameters in enumerate(data):
        headers = ctx.get_all_request_header(i) or {}
        out.append(Request(parameters, {str(k).lower(): v for k, v in headers.items() if isinstance(v, str)}))
    return out


def record_version(metrics, watch: CatalogWatch, served: str | None) -> str:
    """The catalog version this worker serves, as gauges for an operator's dashboard, when it
    differs from `served` (the one recorded last): SlmCatalogVersion{Version, Worker} 1 for it
    (0 for the one before), SlmCatalogSwapTime{Worker}, the Unix time of the worker's last swap.
    Returns the version recorded."""
    worker = Dimension("Worker", str(os.getpid()))
    version = watch.version
    if served is not None:
        metrics.add_metric(
            "SlmCatalogVersion",
            0,
            "count",
            dimensions=[Dimension("Version", served), worker],
            metric_type=MetricTypes.GAUGE,
        )
    metrics.add_metric(
        "SlmCatalogVersion",
        1,
        "count",
        dimensions=[Dimension("Version", version), worker],
        metric_type=MetricTypes.GAUGE,
    )
    if watch.swapped_at is not None:
        metrics.add_metric(
            "SlmCatalogSwapTime", watch.swapped_at, "s", dimensions=[worker], metric_type=MetricTypes.GAUGE
        )
    return version


def record_accuracy(metrics, guard: AccuracyGuard) -> None:
    """The accuracy guard's comparisons since the last batch, as histograms an operator alerts on:
    SlmAccuracyMaxAbsDiff (each sampled request's largest |difference| from the reference: a
    probability, or a shared candidate's score), SlmAccuracySharedCandidates (the share of the
    reference's candidates served; 1 for score tasks) and SlmAccuracyBestSame (1 where the best
    candidate is the reference's, else 0); SlmAccuracyBreaches counts those past the spec's
    thresholds (each logged with its request id), SlmAccuracyDropped the samples the guard had no
    room for."""
    for c in guard.drain():
        for name, value in (
            ("SlmAccuracyMaxAbsDiff", c.max_abs_diff),
            ("SlmAccuracySharedCandidates", c.shared),
            ("SlmAccuracyBestSame", float(c.best_same)),
        ):
            metrics.add_metric(name, value, "count", metric_type=MetricTypes.HISTOGRAM)
        if c.breach:
            metrics.add_counter("SlmAccuracyBreaches", 1)
    if guard.dropped:
        metrics.add_counter("SlmAccuracyDropped", guard.dropped)
        guard.dropped = 0


class SlmHandler:
    def __init__(self):
        self.engine = None
        self.deadlines = None
        self.description = b"{}"
        self.model = ("", "")
        self.watch: CatalogWatch | None = None  # with a catalog store: follows its active version
        self.recorded_version: str | None = None
        self.guard: AccuracyGuard | None = None  # with a reference graph and a sample share: compares

    def initialize(self, ctx) -> None:
        # Bodies reach handle() as the bytes the client sent, for slm_core.serve.protocol to parse
        # once: TorchServe's worker would otherwise decode JSON bodies itself (its config
        # decode_input_request), taking a JSON string that holds a request for the request, and
        # logging a traceback for every body that is not JSON. It reads this at every request.
        os.environ["TS_DECODE_INPUT_REQUEST"] = "false"
        # `kill -USR1 <worker pid>` writes every thread's Python stack to the model log
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        serving = ServingSpec.from_model_config(getattr(ctx, "model_yaml_config", None) or {})
        start = time.perf_counter()
        model_dir = ctx.system_properties["model_dir"]
        self.engine = load_package(
            model_dir,
            ctx.system_properties.get("gpu_id"),
            serving.cuda_graphs,
            headroom=HEADROOM if serving.catalog_store else 0.0,
        )
        if serving.catalog_store:  # the active version from the first request on, then each poll's
            self.watch = CatalogWatch(self.engine, CatalogStore(serving.catalog_store))
            self.watch.poll()
            self.watch.start()
        package = manifest.read(model_dir)
        if package.get("reference") and serving.accuracy_sample > 0:
            # loaded now, before the worker serves: a package's load holds the interpreter for
            # seconds, which in the guard's thread would stall the calls
            self.guard = AccuracyGuard(
                reference_engine(model_dir, self.engine.task, self.engine.device),
                serving.accuracy_sample,
                serving.accuracy_max_diff,
                serving.accuracy_min_shared,
            ).start()
        self.deadlines = Deadlines(
            serving.deadline_ms, package.get("call_ms") or {}, tuple(map(tuple, package.get("call_ms_by_size") or ()))
        )
        self.description = description(package, serving, metadata(self.engine.task))
        # the name and version a KServe v2 answer names: as TorchServe registered this worker's model
        self.model = (
            str(getattr(ctx, "model_name", "") or ""),
            str(((getattr(ctx, "manifest", None) or {}).get("model") or {}).get("modelVersion", "")),
        )
        replay = self.engine.context.replay
        cuda = self.engine.device.type == "cuda"
        mps = cuda and mps_running()
        log.info(
            "loaded a %s task on %s in %.1f s: CUDA graphs %s, %d worker(s) of batch %d, NVIDIA MPS: %s",
            self.engine.task.kind,
            self.engine.device,
            time.perf_counter() - start,
            "captured at each bucket's first call" if replay is not None else "off",
            serving.workers,
            serving.batch,
            "on" if mps else "off",
        )
        if cuda:
            log.info(
                "GPU memory reserved %.2f GiB, host peak RSS %.2f GiB",
                torch.cuda.memory_reserved(self.engine.device) / 2**30,
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            )
        if cuda and not mps and workers_share_a_gpu(serving, torch.cuda.device_count()):
            log.warning(
                "%d workers on %s without NVIDIA MPS: workers sharing a GPU time-slice it instead of "
                "running side by side. Start `nvidia-cuda-mps-control -d` before TorchServe "
                "(deploy/serve.sh does; docs/operations.md, Serving on a GPU)",
                serving.workers,
                self.engine.device,
            )
        # What loading made lives as long as the worker: freeze it out of the full garbage
        # collections that beam replies' candidate dicts set off, which otherwise walk all of it
        # and stall the worker.
        gc.collect()
        gc.freeze()

    def handle(self, data: list[dict], ctx) -> list[bytes]:
        """The replies to a batch, in order, each with its own status."""
        start = time.perf_counter()
        batch = requests(data, ctx)
        # describe-model ?customized=true reaches a worker as a request with this header, which a
        # batch may hold beside predictions (and a client may send): it alone gets the description
        describe = [request.headers.get("describe") == "True" for request in batch]
        served = [i for i, d in enumerate(describe) if not d]  # the batch's index of each request served
        sample = None
        if self.guard is not None:
            task = self.engine.task

            def sample(i: int, value, answer) -> None:
                self.guard.offer(request_id(ctx, served[i]), value, answer, task)

        try:
            with in_flight.holding(len(batch)):  # until answered: what a drain waits for
                answered = iter(
                    respond_batch(self.engine, [batch[i] for i in served], self.deadlines, self.model, sample)
                )
        except DeviceLost:
            # Every later call would fail too, and under MPS the GPU takes no new client until this
            # process is gone: exit, so that TorchServe starts a worker with a fresh context. The
            # batch in hand gets TorchServe's 500 (worker died), as it would get the handler's.
            log.critical("the GPU context is lost: exiting for a new worker", exc_info=True)
            logging.shutdown()
            os._exit(EXIT_DEVICE_LOST)
        replies = [Reply(200, self.description) if d else next(answered) for d in describe]
        handler_ms = (time.perf_counter() - start) * 1e3  # parse, tokenize, graph call, encode
        grpc = [through_grpc(request) for request in batch]
        failed = shared_grpc_error(grpc, replies)
        if ctx.metrics is not None:
            record_metrics(ctx.metrics, replies)
            if self.watch is not None and self.watch.version != self.recorded_version:
                self.recorded_version = record_version(ctx.metrics, self.watch, self.recorded_version)
            if self.guard is not None:
                record_accuracy(ctx.metrics, self.guard)
        if failed is not None:
            raise PredictionException(failed.body.decode("utf-8"), failed.status)
        return [self._answer(i, reply, handler_ms, ctx, grpc[i]) for i, reply in enumerate(replies)]

    @staticmethod
    def _answer(i: int, reply: Reply, handler_ms: float, ctx, grpc: bool) -> bytes:
        ctx.set_response_status(reply.status, PHRASES.get(reply.status, ""), i)
        ctx.set_response_content_type(i, "application/json")
        if grpc:
            # The reply is the request's whole answer. TorchServe's gRPC StreamPredictions ends its
            # stream on this header and fails the worker on a reply without it; REST must not see
            # it: a REST reply that carries it is sent as a stream's last chunk, with no status line.
            ctx.set_response_header(i, "ts_stream_next", "false")
        if reply.stats is not None:  # where the request's time went (bench.loadgen averages these)
            ctx.set_response_header(i, "X-Slm-Worker", str(os.getpid()))
            ctx.set_response_header(i, "X-Slm-Handler-Ms", f"{handler_ms:.3f}")
            ctx.set_response_header(i, "X-Slm-Graph-Ms", f"{reply.stats.graph_ms:.3f}")
            ctx.set_response_header(i, "X-Slm-Batch", str(reply.stats.batch))
            if reply.stats.data_version:  # the catalog version that answered it
                ctx.set_response_header(i, "X-Slm-Catalog-Version", reply.stats.data_version)
        return reply.body
