"""Compiled task packages: build (export -> AOTInductor -> numerical check -> manifest) and load.

A package directory holds `graph.pt2` (the AOTInductor package, weights inside), `tokenizer.json`
and `manifest.json`, which is all the serving side reads: nothing is inferred from file names.
"""

import atexit
import contextlib
import dataclasses
import datetime
import itertools
import json
import os
import platform
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
from tokenizers import Tokenizer

from slm_core.checkpoint import Checkpoint
from slm_core.engine import Engine, build_graph, resolve_task
from slm_core.errors import SpecError
from slm_core.export import compile_package, export_graph
from slm_core.replay import CudaGraphs, bucket_grid
from slm_core.spec import PRECISIONS, RuntimeSpec, TaskSpec
from slm_core.tokenizer import PackedTokenizer

FORMAT = 3  # 2: the beam graph takes cu_seqlens and answers B prompts per call; 3: graph bounds leave room for CUDA-graph padding
MANIFEST, GRAPH, TOKENIZER = "manifest.json", "graph.pt2", "tokenizer.json"
# Compiled vs eager on the check inputs: largest allowed |difference| of probabilities / beam scores,
# and the share of compiled beam candidates that eager also returns.
TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2, "fp8-mlp": 5e-2, "fp8-mlp-lmhead": 5e-2, "fp8-static": 5e-2}
# A beam score sums N bf16 log-probs over the whole vocabulary: transformers' own bf16 beam scores
# are 0.08-0.21 from fp32 on the H200 (bench/results/2026-11-29_engine_gpu_*), so a compiled graph
# that fuses differently from eager may differ by as much.
# In fp32 a beam score is a sum of up to new_tokens differences of two numbers of 10-30 (a logit
# and the vocabulary's logsumexp); compiled and eager block the GEMMs differently, and SmolLM2's
# CPU build measured 1.5e-4 once (2026-11-30, same candidates), against 1e-4 as a bound before.
# FP8 beam builds: compiled and eager quantise the post-norm activations from different roundings
# (Inductor fuses the norm into the quantisation without rounding to bf16 between), and values near
# an E4M3 step land apart, which beam search amplifies: on the H200 (run 170240Z) compiled fp8
# against eager fp8 was 0.35-0.38 with 65-69 % of candidates shared (bf16: 0.094, 90 %). For them this
# check only guards against a broken compile; their accuracy criterion is fp8_gate against bf16.
BEAM_TOLERANCE = {"fp32": 1e-3, "bf16": 0.25, "fp8-mlp": 0.5, "fp8-mlp-lmhead": 0.5, "fp8-static": 0.5}
MIN_SHARED = {"fp32": 1.0, "bf16": 0.75, "fp8-mlp": 0.5, "fp8-mlp-lmhead": 0.5, "fp8-static": 0.5}
CHECK_TEXTS = [
    "cheap flights from berlin to rome in may",
    "is this review positive? the battery died after two days",
    "weather",
    "best running shoes for flat feet under 100 dollars",
    "how do i reset my router password",
]
# The FP8 accuracy gate's default thresholds against bf16 (fp8_gate; archiver --fp8-max-diff, --fp8-min-shared).
FP8_MAX_DIFF, FP8_MIN_SHARED = 0.05, 0.6
# The fixed evaluation set of the FP8 accuracy gate (fp8_gate): the check texts and more of the kind.
EVAL_TEXTS = CHECK_TEXTS + [
    "wireless noise cancelling headphones with long battery life",
    "the delivery was late and the package was damaged",
    "vegetarian lasagna recipe without ricotta",
    "what time does the pharmacy on main street close",
    "great hotel, friendly staff, but the breakfast was cold",
    "python list comprehension with two loops",
    "cheap used cars near me with low mileage",
    "is it safe to travel to iceland in winter",
    "return policy for items bought on sale",
    "kids bicycle 20 inch with gears",
    "symptoms of a cold versus the flu",
]


def versions(device: torch.device) -> dict[str, Any]:
    out = {"torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        import triton

        out.update(triton=triton.__version__, cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(device),
                   capability=list(torch.cuda.get_device_capability(device)))
    return out


def build_package(
    ckpt: Checkpoint, task: TaskSpec, device: str, out_dir: Path, progress: Callable[[str], None] = print,
    attention: str = "reference", topk: str = "torch", fp8_max_diff: float = FP8_MAX_DIFF,
    fp8_min_shared: float = FP8_MIN_SHARED,
) -> dict[str, Any]:
    """Compile `task` for `device` into out_dir; returns the manifest. Raises SpecError when the
    compiled graph disagrees with the eager one, or an fp8 precision fails its accuracy gate
    against bf16 (fp8_gate: fp8_max_diff for score, fp8_min_shared for beam)."""
    runtime = RuntimeSpec(device, attention, topk)
    task = resolve_task(ckpt, task)  # a classifier's label names, as the manifest's task keeps them
    dev = torch.device(device)
    if dev.type != "cuda" and "triton" in (attention, topk):
        raise SpecError("the Triton kernels (--attention triton, --topk triton) compile for CUDA only; "
                        "CPU builds use the PyTorch references")
    out_dir.mkdir(parents=True, exist_ok=True)

    def step(what: str, fn):
        start = time.perf_counter()
        progress(f"{what} ...")
        result = fn()
        progress(f"{what}: done in {time.perf_counter() - start:.1f} s")
        return result

    graph, tokenizer = step("building the eager graph", lambda: build_graph(ckpt, task, runtime))
    program = step("torch.export", lambda: export_graph(graph, task))
    package = step(
        f"AOTInductor compile for {dev.type} (on 2 CPU cores: ~1 min for a 30-layer score graph, ~4 for a beam graph)",
        lambda: compile_package(program, str(out_dir / GRAPH)),
    )
    compiled = Engine(load_graph(package), tokenizer, task, runtime)
    eager = Engine(graph, tokenizer, task, runtime)
    check = step("checking the compiled graph against eager", lambda: check_compiled(eager, compiled))
    if dev.type == "cuda":  # the way it serves: replayed from CUDA graphs (padded to size buckets)
        replayed = _cuda_engine(package, tokenizer, task, runtime, dev, cuda_graphs=True)
        check["cuda_graphs"] = step("checking the compiled graph replayed from CUDA graphs against eager",
                                    lambda: check_compiled(eager, replayed))
        # a graph that cannot be captured serves without CUDA graphs (the worker falls back alike)
        replay = replayed.contexts[0].replay
        check["cuda_graphs"]["captured"] = len(replay.graphs) if replay.enabled else 0
        compiled = replayed
    gate = None
    if task.precision.startswith("fp8"):  # what serves, against the same task in bf16
        gate = step(f"accuracy gate: compiled {task.precision} against bf16 on {len(EVAL_TEXTS)} evaluation texts",
                    lambda: fp8_gate(ckpt, runtime, compiled, fp8_max_diff, fp8_min_shared))
        progress(f"accuracy gate passed: {gate}")
    call_ms = step("timing calls at the token bounds (1, 2, 4 ... max_batch requests)", lambda: time_calls(compiled))
    progress("calls at the token bounds: " + ", ".join(f"{b} request(s) {ms:.1f} ms" for b, ms in call_ms.items()))
    tokenizer.tokenizer.save(str(out_dir / TOKENIZER))
    manifest = {
        "format": FORMAT,
        "task": task.to_dict(),
        "architecture": dataclasses.asdict(ckpt.spec),
        "label_ids": tokenizer.label_ids() if task.task == "score" and task.head == "labels" else [],
        "stop_ids": tokenizer.stop_ids() if task.task == "beam" else [],
        "dtype": PRECISIONS[task.precision],
        "device": dev.type,
        "attention": attention,
        "topk": topk,
        "versions": versions(dev),
        "graph": {"file": GRAPH, "signature": signature(task)},
        "check": check,
        "fp8_gate": gate,
        "full_call_ms": call_ms[str(task.max_batch)],  # max_batch requests
        "call_ms": call_ms,
        "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def signature(task: TaskSpec) -> dict[str, list[str]]:
    if task.task == "score":
        return {
            "inputs": [f"input_ids int32 [tokens <= {task.graph_tokens}]",
                       f"cu_seqlens int32 [texts + 1 <= {task.graph_texts + 1}]"],
            "outputs": [f"{task.output} float32 [texts, {len(task.labels)}]"],
        }
    w, n = task.beam_width, task.new_tokens
    return {
        "inputs": [f"input_ids int32 [tokens <= {task.graph_tokens}]",
                   f"cu_seqlens int32 [prompts + 1 <= {task.graph_texts + 1}]"],
        "outputs": [f"tokens int64 [prompts, {w}, {n}]", f"lengths int64 [prompts, {w}]",
                    f"scores float32 [prompts, {w}]"],
    }


def fp8_gate(ckpt: Checkpoint, runtime: RuntimeSpec, quantized: Engine, max_diff: float, min_shared: float,
             ) -> dict[str, Any]:
    """The fp8 engine (the build's compiled one) against the same task in bf16, eager, on EVAL_TEXTS: score, the largest and
    the mean |difference| of label probabilities; beam (the first 8 that fit), the share of the
    bf16 graph's W candidates that the fp8 graph also returns, mean and worst prompt. Raises
    SpecError past max_diff (score) or below min_shared (beam)."""
    task = dataclasses.replace(quantized.task, precision="bf16")
    graph, tokenizer = build_graph(ckpt, task, runtime)
    reference = Engine(graph, tokenizer, task, runtime)
    samples = [s for s in EVAL_TEXTS if _fits(tokenizer, s)]
    if not samples:
        raise SpecError("no evaluation text fits the task bounds: does the template alone exceed them?")
    gate: dict[str, Any] = {"against": "bf16"}
    if task.task == "score":
        diffs = [abs(x - y) for i in range(0, len(samples), task.max_texts)
                 for a, b in zip(reference.score(samples[i : i + task.max_texts]),
                                 quantized.score(samples[i : i + task.max_texts]))
                 for x, y in zip(a, b)]
        gate.update(texts=len(samples), max_abs_diff=max(diffs), mean_abs_diff=sum(diffs) / len(diffs),
                    max_allowed=max_diff)
    else:
        shares = []
        for prompt in samples[:8]:
            want = {tuple(c["token_ids"]) for c in reference.beam(prompt)}
            shares.append(len(want & {tuple(c["token_ids"]) for c in quantized.beam(prompt)}) / len(want))
        gate.update(prompts=len(shares), shared_candidates=sum(shares) / len(shares), worst_prompt=min(shares),
                    min_allowed=min_shared)
    if not gate_passes(gate, max_diff, min_shared):
        raise SpecError(f"the {quantized.task.precision} build fails its accuracy gate against bf16: {gate} "
                        "(thresholds: archiver --fp8-max-diff, --fp8-min-shared)")
    return gate


def gate_passes(gate: dict[str, Any], max_diff: float = FP8_MAX_DIFF, min_shared: float = FP8_MIN_SHARED) -> bool:
    """Whether fp8_gate's figures pass these thresholds (by default the archiver's)."""
    if "max_abs_diff" in gate:
        return gate["max_abs_diff"] <= max_diff
    return gate["shared_candidates"] >= min_shared


def check_compiled(eager: Engine, compiled: Engine) -> dict[str, Any]:
    """Run the check inputs through both; record the differences; raise SpecError past the tolerance."""
    task = eager.task
    samples = [s for s in CHECK_TEXTS if _fits(eager.tokenizer, s)]
    if not samples:
        raise SpecError("no check text fits the task bounds: does the template alone exceed them?")
    worst, shared, total = 0.0, 0, 0
    if task.task == "score":
        for batch in ([samples[0]], samples[: task.max_texts]):
            for a, b in zip(eager.score(batch), compiled.score(batch)):
                worst = max(worst, max(abs(x - y) for x, y in zip(a, b)))
        if task.max_batch > 1:  # a full call of max_batch requests against each request alone in eager
            requests = [samples[i % len(samples) :][: task.max_texts] for i in range(task.max_batch)]
            for texts, result in zip(requests, compiled.run_score_batch(requests)):
                for a, b in zip(eager.score(texts), result[0]):
                    worst = max(worst, max(abs(x - y) for x, y in zip(a, b)))
    else:
        prompts = samples[:3]
        # One prompt per call, then (when the task batches) a full call of max_batch prompts.
        answers = [compiled.beam(p) for p in prompts]
        if task.max_batch > 1:
            batch = [samples[i % len(samples)] for i in range(task.max_batch)]
            prompts = prompts + batch
            answers += [result[0] for result in compiled.run_beam_batch(batch)]
        for prompt, answer in zip(prompts, answers):
            ref = {tuple(c["token_ids"]): c["score"] for c in eager.beam(prompt)}
            for c in answer:
                total += 1
                if tuple(c["token_ids"]) in ref:
                    shared += 1
                    worst = max(worst, abs(c["score"] - ref[tuple(c["token_ids"])]))
    tolerance = (TOLERANCE if task.task == "score" else BEAM_TOLERANCE)[task.precision]
    check = {"inputs": len(samples), "max_abs_diff": worst, "tolerance": tolerance}
    if task.task == "beam":
        check.update(shared_candidates=shared / total, min_shared=MIN_SHARED[task.precision])
    if worst > check["tolerance"] or check.get("shared_candidates", 1.0) < check.get("min_shared", 0.0):
        raise SpecError(f"the compiled graph disagrees with the eager graph: {check}")
    return check


def time_calls(engine: Engine, repeat: int = 5) -> dict[str, float]:
    """Milliseconds of one graph call at the task's bounds, copy-in to results on the host, per
    number of requests in the call (1, 2, 4, ... and max_batch; JSON keys), each request max_texts
    texts of max_text_tokens tokens (score) or one prompt of max_prompt_tokens (beam); the median
    of `repeat` after one warm-up. The slowest call a worker makes with that many requests, which
    admission control plans with (archiver.build.admission)."""
    task = engine.task
    texts, length = task.request_sequences, task.sequence_tokens

    def pack(_, ids_out, cu_out):  # token ids straight into the packed buffers: no text needed
        ids_out[: texts * length] = 1
        cu_out[: texts + 1] = [i * length for i in range(texts + 1)]
        return texts, texts * length

    def median(batch: int) -> float:
        times = [engine._call([None] * batch, pack)[2] for _ in range(repeat + 1)]
        return sorted(times[1:])[repeat // 2]

    batches = sorted({1 << i for i in range(task.max_batch.bit_length())} | {task.max_batch})
    return {str(b): median(b) for b in batches}


def capture_all(engine: Engine) -> int:
    """Capture the CUDA graph of every bucket a call within the task's bounds lands in
    (slm_core.replay.bucket_grid), in every request context, so that no served call pays a capture
    (about three calls' time); returns how many graphs the engine holds. The calls are token ids 1
    in even sequences, one context at a time. With several contexts the graphs are then sealed:
    a capture must not overlap another context's call (on the H200 concurrent captures failed and
    took the process down, bench/RESULTS.md), so a later call of an uncaptured size runs as is."""
    calls = bucket_grid(engine.task)
    for ctx in engine.each_context():
        ctx.replay.max_graphs = max(ctx.replay.max_graphs, len(calls))
        for n, t in calls:
            def pack(_, ids_out, cu_out, n=n, t=t):
                ids_out[:t] = 1
                cu_out[: n + 1] = [0, *itertools.accumulate(t // n + (i < t % n) for i in range(n))]
                return n, t

            engine._call([None], pack)  # its outputs are read back: the host buffers are free again
            if not ctx.replay.enabled:  # a capture failed: the engine runs without CUDA graphs, in every context
                for other in engine.contexts:
                    other.replay.enabled = False
                return 0
    for ctx in engine.contexts:
        ctx.replay.sealed = len(engine.contexts) > 1
    return sum(len(ctx.replay.graphs) for ctx in engine.contexts)


def _fits(tokenizer: PackedTokenizer, text: str) -> bool:
    return len(tokenizer.tokenizer.encode(tokenizer.apply_template(text)).ids) <= tokenizer.task.sequence_tokens


def load_package(model_dir: str | Path, gpu_id: int | None = None, cuda_graphs: bool = True,
                 contexts: int = 1) -> Engine:
    """The Engine of a built package, on `cuda:{gpu_id}` for CUDA builds (replaying CUDA graphs
    unless cuda_graphs is False), with `contexts` request contexts (calls that may run at once).
    Refuses, with the reason, a package built for another device type, torch version or GPU
    architecture."""
    model_dir = Path(model_dir)
    manifest = json.loads((model_dir / MANIFEST).read_text())
    if manifest.get("format") != FORMAT:
        raise SpecError(f"package format {manifest.get('format')!r} is not {FORMAT}: rebuild it with this version")
    built = manifest["versions"]
    if built["torch"] != torch.__version__:
        raise SpecError(f"package was built with torch {built['torch']}, this worker has {torch.__version__}: "
                        "rebuild it on this machine type")
    if manifest["device"] == "cuda":
        if not torch.cuda.is_available():
            raise SpecError("package was built for cuda, but this worker has no CUDA device: rebuild with --device cpu")
        device = worker_device(gpu_id)
        if list(torch.cuda.get_device_capability(device)) != built["capability"]:
            raise SpecError(f"package was built for GPU capability {built['capability']} ({built['gpu']}), "
                            f"this GPU is {torch.cuda.get_device_name(device)}: rebuild it on this GPU type")
    else:
        device = torch.device("cpu")
    task = TaskSpec.from_dict(manifest["task"])
    tokenizer = PackedTokenizer(Tokenizer.from_file(str(model_dir / TOKENIZER)), task)
    runtime = RuntimeSpec(str(device), manifest.get("attention", "reference"), manifest.get("topk", "torch"))
    path = str(model_dir / manifest["graph"]["file"])
    if device.type == "cuda":
        return _cuda_engine(path, tokenizer, task, runtime, device, cuda_graphs, contexts)
    # a CPU package's runner has its own lock: contexts take turns on it
    return Engine(load_graph(path), tokenizer, task, runtime, [None] * contexts)


SCRATCH = "slm-aoti"  # under TMPDIR: one directory per process that loads packages


def load_graph(path: str, **kwargs):
    """torch._inductor.aoti_load_package(path, **kwargs), extracting the package (its .so holds
    the weights: hundreds of MB) into this process's own directory under TMPDIR/slm-aoti. The
    loader removes its extraction only when destroyed, which a worker that is killed or exits
    never does: so the directory goes at this process's exit, and the directories of processes
    that are gone are removed here first."""
    scratch = _scratch()
    with _env("TMPDIR", str(scratch)):  # where AOTInductor's C++ loader extracts to
        return torch._inductor.aoti_load_package(path, **kwargs)


@contextlib.contextmanager
def _env(name: str, value: str):
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _scratch() -> Path:
    root = Path(tempfile.gettempdir()) / SCRATCH  # gettempdir() caches the real TMPDIR before _env changes it
    root.mkdir(exist_ok=True)
    mine = root / _process_key(os.getpid())
    for stale in root.iterdir():
        if stale != mine and not _alive(stale.name):
            shutil.rmtree(stale, ignore_errors=True)
    if not mine.exists():
        mine.mkdir()
        atexit.register(shutil.rmtree, mine, ignore_errors=True)
    return mine


def _process_key(pid: int) -> str:
    """pid-starttime: a pid the system reuses for a later process names another directory."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return str(pid)
    return f"{pid}-{stat.rsplit(')', 1)[1].split()[19]}"  # field 22, after the command's parentheses


def _alive(key: str) -> bool:
    pid = key.split("-", 1)[0]
    if not pid.isdigit():
        return True  # not ours to judge
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return _process_key(int(pid)) == key or "-" not in key


def worker_device(gpu_id: int | None) -> torch.device:
    """`cuda:{gpu_id}` (TorchServe's GPU for this worker; cuda:0 without one), made the process's
    current device before anything is loaded, so that what follows without an explicit device
    (AOTInductor's kernels, pinned buffers, CUDA-graph capture streams and pool) lands there too:
    a worker never touches another GPU."""
    index = 0 if gpu_id is None else int(gpu_id)
    if not 0 <= index < torch.cuda.device_count():
        raise SpecError(f"worker was given GPU {gpu_id}, this host has {torch.cuda.device_count()} "
                        "(TorchServe's number_of_gpu or the archive's deviceIds name a GPU that is not there)")
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


def mps_running(proc: Path = Path("/proc")) -> bool:
    """Whether NVIDIA's Multi-Process Service control daemon (`nvidia-cuda-mps-control -d`) runs
    where this process can see it. CUDA processes started after it share the GPU through one server
    and run their kernels side by side; without it a GPU time-slices between processes, so a second
    sync worker adds no GPU throughput (bench/RESULTS.md, run 2026-12-01T0937Z: two processes of
    beam decode steps did 0.98x one process's work without MPS, 1.23-1.32x under it)."""
    for cmdline in proc.glob("[0-9]*/cmdline"):
        try:
            program = cmdline.read_bytes().split(b"\0", 1)[0]
        except OSError:  # gone, or not ours to read
            continue
        if program.rsplit(b"/", 1)[-1] == b"nvidia-cuda-mps-control":
            return True
    return False


def _cuda_engine(path: str, tokenizer: PackedTokenizer, task: TaskSpec, runtime: RuntimeSpec, device: torch.device,
                 cuda_graphs: bool, contexts: int = 1) -> Engine:
    """A CUDA package's Engine with `contexts` request contexts; with cuda_graphs, its calls replay
    CUDA graphs (slm_core.replay), one set per context, which needs the package loaded
    single-threaded (FACTS.md): its one runner then takes one call at a time (OneAtATime). Replays
    do not go through the runner, so contexts replay at once."""
    index = torch.cuda.current_device() if device.index is None else device.index  # AOTI takes no None
    graph = load_graph(path, run_single_threaded=cuda_graphs, device_index=index)
    if not cuda_graphs:
        return Engine(graph, tokenizer, task, runtime, [None] * contexts)
    graph = OneAtATime(graph)
    return Engine(graph, tokenizer, task, runtime, [CudaGraphs(graph, task, device) for _ in range(contexts)])


class OneAtATime:
    """A callable that callers from several threads take turns on: an AOTInductor package loaded
    with run_single_threaded=True has no lock of its own. CUDA-graph capture and calls that do not
    replay go through it."""

    def __init__(self, fn):
        self.fn = fn
        self._lock = threading.Lock()

    def __call__(self, *args):
        with self._lock:
            return self.fn(*args)
