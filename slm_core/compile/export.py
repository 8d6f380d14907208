"""torch.export of the request graphs with dynamic shapes inside the task bounds, and their
AOTInductor compile."""

import torch
from torch.export import Dim, ExportedProgram
from torch.fx.experimental import _config as fx_config

from slm_core.tasks import Task


def example_inputs(task: Task, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """Inputs to trace with: sequences of 3 and 5 tokens, their options at the task's bounds and
    the task's constants. Dynamic dims get sizes >= 2 (0/1 would specialise to constants)."""
    ids = torch.arange(8, dtype=torch.int32, device=device) + 1
    inputs = [ids, torch.tensor([0, 3, 8], dtype=torch.int32, device=device)]
    if task.option_columns:
        inputs.append(torch.tensor([task.options(task.request_of(["x"]))] * 2, dtype=torch.int32, device=device))
    return (*inputs, *(c.to(device) for c in task.graph_constants()))


def dynamic_shapes(task: Task) -> tuple[dict[int, Dim], ...]:
    """Up to the task's graph bounds, which leave room for CUDA-graph padding (slm_core.serve.replay): so
    even a one-prompt beam task takes a dynamic number of sequences. A constant's first dim is
    dynamic up to its bound, so that other data of the kind (a new catalog) fits the same graph."""
    sequences = Dim("sequences", min=1, max=task.graph_texts)
    shapes = [{0: Dim("tokens", min=1, max=task.graph_tokens)}, {0: sequences + 1}]
    if task.option_columns:
        shapes.append({0: sequences})
    constants = tuple({0: Dim(f"constant{i}", min=2, max=bound)} for i, bound in enumerate(task.constant_bounds()))
    if constants:  # a graph takes its constants as one *varargs parameter
        shapes.append(constants)
    return tuple(shapes)


def export_graph(graph: torch.nn.Module, task: Task) -> ExportedProgram:
    device = next(graph.parameters()).device
    # Size-oblivious: reason about a dynamic dim as "any size in range" instead of guarding on 1
    # (one text gives a cu_seqlens[1:] of size 1, which would otherwise specialise).
    with torch.inference_mode(False), torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
        return torch.export.export(
            graph, example_inputs(task, device), dynamic_shapes=dynamic_shapes(task), strict=False
        )


def compile_package(program: ExportedProgram, path: str, progress=None) -> str:
    """AOTInductor package of an exported graph at `path`. Compiled size-obliviously too: otherwise
    Inductor's own tracing guards on a dynamic size being 1 and, when the example is not 1,
    silently specialises it (found with the beam graph: a batch of 2 prompts became the only size).
    progress(line), if given, gets where the compile's time went: the compile is most of a
    build, and of the device time a GPU build takes."""
    before = _phase_seconds()
    # A CPU graph's C++ kernels stay scalar: vectorizing them is a third of a CPU compile (the
    # index analysis of every kernel under dynamic shapes), while a CPU call's time is its GEMMs,
    # which are library calls (bench/RESULTS.md). CUDA graphs have no C++ kernels.
    inductor = {"cpp.simdlen": 1}
    if _on_cpu(program):
        # The C++ wrapper (one call per kernel or library op, in order) compiles at -O0: at -O1 it
        # is most of a CPU compile's C++ (a 30-layer beam graph: 161 s, against 16 s at -O0 and
        # 7 s for its kernels), and a CPU call's time is its GEMMs.
        inductor["aot_inductor.compile_wrapper_opt_level"] = "O0"
    with fx_config.patch(backed_size_oblivious=True), torch._inductor.config.patch(inductor):
        out = torch._inductor.aoti_compile_and_package(program, package_path=path)
    if progress is not None:
        spent = {k: v - before.get(k, 0.0) for k, v in _phase_seconds().items()}
        top = sorted(((v, k) for k, v in spent.items() if v >= 1.0), reverse=True)[:8]
        progress("AOTInductor's phases (s, nested): " + ", ".join(f"{k} {v:.1f}" for v, k in top))
    return out


def _on_cpu(program: ExportedProgram) -> bool:
    """Whether every tensor the graph takes lives on the CPU."""
    placeholders = [n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"]
    return all(v.device.type == "cpu" for v in placeholders if isinstance(v, torch.Tensor))


def _phase_seconds() -> dict[str, float]:
    """Seconds per timed phase of torch.compile/AOTInductor in this process so far."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # a torch without them: the build goes on without the breakdown
        return {}
    return {k: sum(v) for k, v in compilation_time_metrics.items()}
