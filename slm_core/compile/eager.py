"""A checkpoint and a task spec -> the task and its eager request graph on the runtime's device:
what the build exports, checks against, and what Engine.from_checkpoint runs."""

import torch
from torch import nn

from slm_core.compile.checkpoint import Checkpoint
from slm_core.compile.fp8 import CALIBRATION_TEXTS, calibrate, quantize_linears
from slm_core.compile.graphs import GRAPHS
from slm_core.compile.model import Transformer
from slm_core.serve.runtime import Runtime
from slm_core.spec import PRECISIONS, RuntimeSpec, TaskSpec
from slm_core.tasks import Task, task_class, task_for


def prepare(ckpt: Checkpoint, spec: TaskSpec, runtime: RuntimeSpec) -> Task:
    """The task as it serves this checkpoint on the runtime's device: what the checkpoint
    decides resolved (a classifier's label names), max_batch resolved."""
    spec = GRAPHS[task_class(spec).graph].resolve(spec, ckpt)
    return task_for(spec, ckpt.tokenizer, runtime.device)


def build_graph(ckpt: Checkpoint, task: Task, runtime: RuntimeSpec) -> nn.Module:
    """The task's request graph over the checkpoint's weights, on the runtime's device, with the
    runtime's kernels; fp8-static's E4M3 linears calibrated on the graph in bf16 first."""
    graph_class = GRAPHS[task.graph]
    dtype = getattr(torch, PRECISIONS[task.spec.precision])
    model = Transformer.empty(ckpt.spec, task.max_positions, dtype, runtime.device, runtime.kernels)
    model.load_hf_weights(ckpt.weights, lm_head=graph_class.lm_head)
    graph = graph_class.build(task, model, ckpt, runtime).to(runtime.device).eval()
    if task.spec.precision == "fp8-static":
        engine = Runtime(graph, task, runtime.device)  # still bf16: each calibration text as a request alone
        amax = calibrate(model, lambda: [engine.run([task.request_of([text])]) for text in CALIBRATION_TEXTS])
        quantize_linears(model, amax, runtime.kernels == "triton")
    return graph


def eager_engine(ckpt: Checkpoint, spec: TaskSpec, runtime: RuntimeSpec, engine: type[Runtime] = Runtime) -> Runtime:
    task = prepare(ckpt, spec, runtime)
    return engine(build_graph(ckpt, task, runtime), task, runtime.device)
