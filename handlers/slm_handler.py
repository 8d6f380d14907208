"""TorchServe handler: request body -> slm_core engine -> JSON. Thin by design: the protocol lives in
slm_core.protocol, the compiled graph and its checks in slm_core.package. Travels inside the .mar,
next to the slm_core/ and kernels/ sources it imports (the worker's PYTHONPATH holds the model dir).

Two ways to run, set in the archive's model-config.yaml (archiver --contexts):
- sync (TorchServe's default): the worker gets one batch at a time and makes it one graph call;
- async (`asyncCommunication: true`, handler setting `contexts` >= 1): the worker takes requests as
  they come, and slm_core.scheduler runs them on `contexts` request contexts at once, each on its
  own CUDA stream, refusing with 503 beyond `max_waiting` queued requests.
"""

import asyncio
import faulthandler
import gc
import logging
import os
import resource
import signal
import threading
import time

import torch
from ts.protocol.otf_message_handler import create_predict_response

from slm_core.errors import SpecError
from slm_core.package import capture_all, load_package, mps_running
from slm_core.protocol import Request, error, respond_batch
from slm_core.scheduler import Scheduler, Served

log = logging.getLogger(__name__)
SOCKET = threading.Lock()  # async mode: our replies and TorchServe's own go out on one socket


def _send_responses_one_at_a_time(service) -> None:
    """TorchServe 0.12's AsyncService.send_responses, writing under SOCKET: it runs in a thread of
    its own, and two threads' sendall on one socket may interleave their bytes."""
    while True:
        message = asyncio.run_coroutine_threadsafe(service.out_queue.get(), service.loop).result()
        with SOCKET:
            service.service.cl_socket.sendall(message)
PHRASES = {200: "OK", 400: "Bad Request", 415: "Unsupported Media Type", 500: "Internal Server Error",
           503: "Service Unavailable"}


def workers_share_a_gpu(config: dict, host_gpus: int) -> bool:
    """Whether a model's workers (model-config.yaml's minWorkers) outnumber the GPUs TorchServe
    deals them to in turn: the archive's deviceIds, else all the host's."""
    return int(config.get("minWorkers", 1)) > max(1, len(config.get("deviceIds") or ()) or host_gpus)


def requests(data: list[dict], ctx) -> list[Request]:
    """TorchServe's batch as protocol Requests: each one's parameters and its HTTP headers (names
    as the client spelled them in TorchServe: lower-cased here)."""
    out = []
    for i, parameters in enumerate(data):
        try:
            headers = ctx.get_all_request_header(i) or {}
        except (AttributeError, IndexError, KeyError, TypeError):  # a host without request headers
            headers = {}
        out.append(Request(parameters, {str(k).lower(): v for k, v in headers.items() if isinstance(v, str)}))
    return out


class SlmHandler:
    def __init__(self):
        self.engine = None
        self.scheduler = None  # async mode

    def initialize(self, ctx) -> None:
        # Bodies reach handle() as the bytes the client sent, for slm_core.protocol to parse once:
        # TorchServe's worker would otherwise decode JSON bodies itself (config decode_input_request),
        # parsing a JSON string that holds a request as if it were one, and logging a traceback for
        # every body that is not JSON. It reads this variable at every request.
        os.environ["TS_DECODE_INPUT_REQUEST"] = "false"
        # `kill -USR1 <worker pid>` writes every thread's Python stack to the model log (a stuck
        # worker's account: bench.run sends it to a deployment that stopped answering)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        props = ctx.system_properties
        config = getattr(ctx, "model_yaml_config", None) or {}
        settings = config.get("handler") or {}
        asynchronous = bool(config.get("asyncCommunication", False))
        contexts = int(settings.get("contexts", 1))
        if contexts < 1 or (contexts > 1 and not asynchronous):
            raise SpecError(f"handler setting contexts={contexts}: more than one request context needs "
                            "asyncCommunication: true (a sync worker runs one call at a time); rebuild with "
                            "archiver --contexts")
        if contexts > 1 and settings.get("cuda_graphs", True) and not settings.get("capture_at_load", False):
            raise SpecError("several request contexts capture their CUDA graphs at load (a capture must not "
                            "overlap another context's call): set capture_at_load, archiver --cuda-graphs on")
        if asynchronous and config.get("batchSize", 1) != 1:  # the frontend's worker thread dies on the 2nd
            raise SpecError("asyncCommunication needs batchSize: 1 (TorchServe 0.12's async batching fails a "
                            "batch of two; this worker batches requests itself): rebuild with archiver --contexts")
        self.engine = load_package(props["model_dir"], props.get("gpu_id"), settings.get("cuda_graphs", True),
                                   contexts)
        replays = self.engine.contexts[0].replay is not None
        cuda = self.engine.device.type == "cuda"
        mps = cuda and mps_running()
        log.info("loaded %s task on %s (CUDA graphs: %s, %s mode, %d request context(s), NVIDIA MPS: %s)",
                 self.engine.task.task, self.engine.device, replays, "async" if asynchronous else "sync", contexts,
                 "on" if mps else "off")
        if cuda and not mps and workers_share_a_gpu(config, torch.cuda.device_count()):
            log.warning("%s workers on %s without NVIDIA MPS: workers sharing a GPU time-slice it instead of "
                        "running side by side. Start `nvidia-cuda-mps-control -d` before TorchServe "
                        "(deploy/serve.sh does; README.md, Serving on a GPU)", config.get("minWorkers"),
                        self.engine.device)
        if replays and settings.get("capture_at_load", False):  # archiver --cuda-graphs on
            start = time.perf_counter()
            captured = capture_all(self.engine)
            log.info("captured %d CUDA graphs at load in %.1f s; GPU memory reserved %.2f GiB, host peak RSS %.2f GiB",
                     captured, time.perf_counter() - start, torch.cuda.memory_reserved(self.engine.device) / 2**30,
                     resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
        # What loading made lives as long as the worker: freeze it out of the full garbage collections
        # that beam replies' candidate dicts set off (W2, 4 prompts a call: one in ~750 calls, a 70 ms
        # stall of the worker on 2 cores; 0.1 ms frozen).
        gc.collect()
        gc.freeze()
        if asynchronous:  # its threads start serving now
            self.scheduler = Scheduler(self.engine, int(settings.get("max_waiting", 100)))
            from ts.async_service import AsyncService  # the worker starts it after initialize returns

            AsyncService.send_responses = _send_responses_one_at_a_time

    def handle(self, data: list[dict], ctx):
        """The replies to a batch, in order. In async mode this returns a coroutine, which TorchServe
        awaits (its async worker awaits whatever handle returns); the requests go to the scheduler."""
        if self.scheduler is not None:
            return self._handle_async(data, ctx)
        start = time.perf_counter()
        batch = respond_batch(self.engine, requests(data, ctx))
        handler_ms = (time.perf_counter() - start) * 1e3  # parse, tokenize, graph call, encode
        return self._answer([Served(reply, 0.0, handler_ms) for reply in batch], ctx)

    async def _handle_async(self, data: list[dict], ctx) -> list[bytes]:
        """TorchServe 0.12's async frontend forgets a request only once a reply says it is the last
        of a stream (FACTS.md), and an exception escaping here fails every request in flight. So
        nothing escapes; a 200 goes out as a stream of one chunk and an error as a whole reply
        (an error's stream would lose its body); the empty replies returned end each stream."""
        messages: list[bytes] = []
        try:
            served = await asyncio.gather(*(asyncio.wrap_future(self.scheduler.submit(r)) for r in requests(data, ctx)))
            bodies = self._answer(served, ctx)
            ok = {i: ctx.request_ids[i] for i, s in enumerate(served) if s.reply.status < 400}
            failed = {i: ctx.request_ids[i] for i, s in enumerate(served) if s.reply.status >= 400}
            if ok:
                messages.append(create_predict_response(bodies, ok, "Prediction success", 200, ctx, True))
        except Exception:  # the scheduler answers every request itself: this is a bug
            log.exception("async handle failed")
            messages, failed = [], dict(ctx.request_ids)  # none was sent: all get the 500
            bodies = [error(500, "internal error while running the request").body] * len(data)
            for i in failed:
                ctx.set_response_status(500, PHRASES[500], i)
                ctx.set_response_content_type(i, "application/json")
                ctx.set_response_header(i, "ts_stream_next", "")  # a whole reply, not a stream's first chunk
        if failed:
            messages.append(create_predict_response(bodies, failed, "Prediction success", 200, ctx))
        with SOCKET:
            for message in messages:
                ctx.cl_socket.sendall(message)
        for i in failed:  # what the final reply below tells the frontend about them: done
            ctx.set_response_header(i, "ts_stream_next", "false")
        return [b""] * len(data)

    def _answer(self, served: list[Served], ctx) -> list[bytes]:
        replies = []
        for i, s in enumerate(served):
            reply = s.reply
            ctx.set_response_status(reply.status, PHRASES.get(reply.status, ""), i)
            ctx.set_response_content_type(i, "application/json")
            if reply.stats is not None:  # where the request's time went (bench.loadgen averages these)
                ctx.set_response_header(i, "X-Slm-Worker", str(os.getpid()))  # bench.reliability: across workers
                ctx.set_response_header(i, "X-Slm-Handler-Ms", f"{s.handler_ms:.3f}")
                ctx.set_response_header(i, "X-Slm-Wait-Ms", f"{s.wait_ms:.3f}")
                ctx.set_response_header(i, "X-Slm-Graph-Ms", f"{reply.stats.graph_ms:.3f}")
                ctx.set_response_header(i, "X-Slm-Batch", str(reply.stats.batch))
                ctx.set_response_header(i, "X-Slm-Captured", str(int(reply.stats.captured)))
                if ctx.metrics is not None:
                    ctx.metrics.add_counter("SlmTexts", reply.stats.texts)
                    ctx.metrics.add_counter("SlmTokens", reply.stats.tokens)
                    ctx.metrics.add_time("SlmGraphTime", reply.stats.graph_ms)
                    ctx.metrics.add_counter("SlmBatchedRequests", int(reply.stats.batch > 1))  # shared a graph call
            replies.append(reply.body)
        return replies
