"""Build a task package: eager graph -> torch.export -> AOTInductor -> checks -> call timings ->
manifest (slm_core.manifest). The graph is checked the way it serves: loaded by the serve-time
loader, on CUDA replayed from CUDA graphs too."""

import dataclasses
import datetime
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from slm_core import manifest as package
from slm_core.compile.checkpoint import Checkpoint
from slm_core.compile.checks import GateThresholds, check_compiled, fp8_gate, time_calls, time_sizes
from slm_core.compile.eager import build_graph, prepare
from slm_core.compile.export import compile_package, export_graph
from slm_core.errors import SpecError
from slm_core.serve.loader import load_graph, serving_engine
from slm_core.serve.replay import bucket_grid
from slm_core.serve.runtime import Runtime
from slm_core.spec import PRECISIONS, RuntimeSpec, TaskSpec


def versions(device: torch.device) -> dict[str, Any]:
    out = {"torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        import triton

        out.update(
            triton=triton.__version__,
            cuda=torch.version.cuda,
            gpu=torch.cuda.get_device_name(device),
            capability=list(torch.cuda.get_device_capability(device)),
        )
    return out


def build_package(
    ckpt: Checkpoint,
    spec: TaskSpec,
    runtime: RuntimeSpec,
    out_dir: Path,
    progress: Callable[[str], None] = print,
    gate: GateThresholds = GateThresholds(),
    reference: bool = False,
) -> dict[str, Any]:
    """Compile the task for the runtime's device into out_dir; returns the manifest. Raises
    SpecError when the compiled graph disagrees with the eager one, or an fp8 build fails its
    accuracy gate against bf16. With `reference`, also the task's graph in the next precision up
    (manifest.REFERENCE_PRECISION), for the online accuracy guard."""
    dev = torch.device(runtime.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda" and runtime.kernels == "triton":
        raise SpecError("the Triton kernels compile for CUDA only: CPU builds use the PyTorch references")
    task = prepare(ckpt, spec, runtime)
    out_dir.mkdir(parents=True, exist_ok=True)

    def step(what: str, fn):
        start = time.perf_counter()
        progress(f"{what} ...")
        result = fn()
        progress(f"{what}: done in {time.perf_counter() - start:.1f} s")
        return result

    graph = step("building the eager graph", lambda: build_graph(ckpt, task, runtime))
    program = step("torch.export", lambda: export_graph(graph, task))
    path = step(
        f"AOTInductor compile for {dev.type} (2 CPU cores: 1-2 min for a 30-layer score graph, ~8 for a beam graph)",
        lambda: compile_package(program, str(out_dir / package.GRAPH), progress),
    )
    eager = Runtime(graph, task, dev)
    compiled = Runtime(load_graph(path, dev), task, dev)
    check = step("checking the compiled graph against eager", lambda: check_compiled(eager, compiled))
    if dev.type == "cuda":  # the way it serves: replayed from CUDA graphs, padded to size buckets
        del compiled
        compiled = step("capturing the CUDA graphs", lambda: serving_engine(path, task, dev, cuda_graphs=True))
        check["cuda_graphs"] = step(
            "checking the compiled graph replayed from CUDA graphs against eager",
            lambda: check_compiled(eager, compiled),
        )
        # every bucket once, as a worker captures it at its first call: a graph that cannot be
        # captured, or faults on replay, does so here rather than on a request
        step("capturing every bucket", lambda: [compiled.synthetic_call(n, t) for n, t in bucket_grid(task)])
        check["cuda_graphs"]["captured"] = len(compiled.context.replay.graphs)  # 0: a capture failed
    up = package.REFERENCE_PRECISION.get(task.spec.precision)
    if reference and up is None:
        raise SpecError(f"a {task.spec.precision} build has no higher precision for an accuracy reference")
    higher = None  # the task one precision up, eager: the FP8 gate's bf16 and the guard's reference
    if task.spec.precision == "fp8-static" or reference:
        spec_up = prepare(ckpt, dataclasses.replace(task.spec, precision=up), runtime)
        higher = Runtime(build_graph(ckpt, spec_up, runtime), spec_up, dev)
    fp8 = None
    if task.spec.precision == "fp8-static":  # what serves, against the same task in bf16
        fp8 = step("accuracy gate: compiled fp8-static against bf16", lambda: fp8_gate(higher, compiled, gate))
        progress(f"accuracy gate passed: {fp8}")
    reference_node = None
    if reference:
        ref_path = step(
            f"AOTInductor compile of the accuracy guard's reference ({up})",
            lambda: compile_package(
                export_graph(higher.graph, higher.task), str(out_dir / package.REFERENCE), progress
            ),
        )
        ref_check = step(
            "checking the reference against its eager graph",
            lambda: check_compiled(higher, Runtime(load_graph(ref_path, dev), higher.task, dev)),
        )
        reference_node = {"file": package.REFERENCE, "precision": up, "check": ref_check}
    call_ms = step("timing calls at the token bounds (1, 2, 4 ... max_batch requests)", lambda: time_calls(compiled))
    progress("calls at the token bounds: " + ", ".join(f"{b} request(s) {ms:.1f} ms" for b, ms in call_ms.items()))
    sizes = step(
        "timing calls by their size (sequences x tokens, for deadlines)",
        lambda: time_sizes(compiled, call_ms[str(task.max_batch)]),
    )
    task.tokenizer.tokenizer.save(str(out_dir / package.TOKENIZER))
    manifest = {
        "format": package.FORMAT,
        "task": task.write_data(out_dir).to_dict(),
        "architecture": dataclasses.asdict(ckpt.spec),
        "dtype": PRECISIONS[task.spec.precision],
        "device": dev.type,
        "kernels": runtime.kernels,
        "versions": versions(dev),
        "pipeline": task.pipeline(dev.type, package.GRAPH),
        "check": check,
        "fp8_gate": fp8,
        "reference": reference_node,
        "call_ms": call_ms,
        "call_ms_by_size": sizes,
        "built": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    (out_dir / package.MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
