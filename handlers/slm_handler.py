"""TorchServe handler: request body -> slm_core engine -> JSON. Thin by design: the protocol lives in
slm_core.protocol, the compiled graph and its checks in slm_core.package. Travels inside the .mar,
next to the slm_core/ and kernels/ sources it imports (the worker's PYTHONPATH holds the model dir).
"""

import logging
import resource
import time

import torch

from slm_core.package import capture_all, load_package
from slm_core.protocol import respond_batch

log = logging.getLogger(__name__)
PHRASES = {200: "OK", 400: "Bad Request", 500: "Internal Server Error"}


class SlmHandler:
    def __init__(self):
        self.engine = None

    def initialize(self, ctx) -> None:
        props = ctx.system_properties
        settings = (getattr(ctx, "model_yaml_config", None) or {}).get("handler") or {}
        self.engine = load_package(props["model_dir"], props.get("gpu_id"), settings.get("cuda_graphs", True))
        log.info("loaded %s task on %s (CUDA graphs: %s)", self.engine.task.task, self.engine.device,
                 self.engine.replay is not None)
        if self.engine.replay is not None and settings.get("capture_at_load", False):  # archiver --cuda-graphs on
            start = time.perf_counter()
            captured = capture_all(self.engine)
            log.info("captured %d CUDA graphs at load in %.1f s; GPU memory reserved %.2f GiB, host peak RSS %.2f GiB",
                     captured, time.perf_counter() - start, torch.cuda.memory_reserved(self.engine.device) / 2**30,
                     resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)

    def handle(self, data: list[dict], ctx) -> list[bytes]:
        start = time.perf_counter()
        batch = respond_batch(self.engine, data)
        handler_ms = f"{(time.perf_counter() - start) * 1e3:.3f}"  # parse, tokenize, graph call, encode
        replies = []
        for i, reply in enumerate(batch):
            ctx.set_response_status(reply.status, PHRASES.get(reply.status, ""), i)
            ctx.set_response_content_type(i, "application/json")
            if reply.stats is not None:  # where the request's time went (bench.loadgen averages these)
                ctx.set_response_header(i, "X-Slm-Handler-Ms", handler_ms)
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
