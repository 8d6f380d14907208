"""Loading a built package for serving: the manifest's request path, on the worker's own device.

    engine = load_package(model_dir, gpu_id)   # refuses, with the reason, what this worker cannot run

A worker imports only serve-time code: the compiled graph replaces the Python model.
"""

import atexit
import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
import time
import zipfile
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from tokenizers import Tokenizer

from slm_core import manifest as package
from slm_core.errors import SpecError
from slm_core.serve.replay import CudaGraphs
from slm_core.serve.runtime import Runtime
from slm_core.spec import TaskSpec
from slm_core.tasks import Task, task_for

log = logging.getLogger(__name__)
SCRATCH = "slm-aoti"  # under TMPDIR, one root per user: one directory per process that loads packages
_mine: tuple[Path, object] | None = None  # this process's directory and the lock it holds on it


def load_package(
    model_dir: "str | Path",
    gpu_id: int | None = None,
    cuda_graphs: bool = True,
    engine: type[Runtime] | None = None,
    headroom: float = 0.0,
) -> Runtime:
    """The Runtime (or `engine` class) of a built package: its task as the manifest records it,
    its compiled graph on `cuda:{gpu_id}` for CUDA builds, there replaying every size bucket from
    a CUDA graph captured now (unless cuda_graphs is False); `headroom`: Runtime's."""
    engine = engine or Runtime
    model_dir = Path(model_dir)
    manifest = package.read(model_dir)
    task = load_task(model_dir, manifest)
    graph_node = package.node(manifest, "graph")
    path = str(model_dir / graph_node["file"])
    if manifest["device"] != "cuda":
        return engine(load_graph(path, "cpu"), task, "cpu", headroom=headroom)
    device = worker_device(gpu_id)
    built = manifest["versions"]
    if list(torch.cuda.get_device_capability(device)) != built["capability"]:
        raise SpecError(
            f"package was built for GPU capability {built['capability']} ({built['gpu']}), "
            f"this GPU is {torch.cuda.get_device_name(device)}: rebuild it on this GPU type"
        )
    return serving_engine(path, task, device, cuda_graphs, engine, headroom)


def serving_engine(
    path: str,
    task: Task,
    device: torch.device,
    cuda_graphs: bool,
    engine: type[Runtime] | None = None,
    headroom: float = 0.0,
) -> Runtime:
    """A CUDA package's engine on `device`: with cuda_graphs, its calls replayed from CUDA graphs in
    the engine's request context, each bucket captured at its first call (the smallest at load)."""
    engine = engine or Runtime
    # CUDA-graph capture needs the package's runner loaded single-threaded
    start = time.perf_counter()
    graph = load_graph(path, device, run_single_threaded=cuda_graphs)
    log.info("graph package loaded on %s in %.1f s", device, time.perf_counter() - start)
    if not cuda_graphs:
        return engine(graph, task, device, headroom=headroom)
    served = engine(graph, task, device, headroom=headroom)
    served.context.replay = CudaGraphs(graph, task, device, served.constants, served.context.stream)
    # One call now, of one 1-token sequence (the smallest bucket): a process's first call loads
    # the graph's kernels and sets up cuBLAS and the graphs' memory pool. Left to the first
    # requests, that wait put answers 200-270 ms after receipt, past an 80 ms deadline (W2's
    # default on an H100). Each other bucket is captured at its first call.
    start = time.perf_counter()
    served.synthetic_call(1, 1)
    log.info("first call (the smallest bucket, captured) at load in %.2f s", time.perf_counter() - start)
    return served


def reference_engine(model_dir: "str | Path", task: Task, device: "torch.device | str") -> Runtime:
    """The package's accuracy reference (manifest "reference": the task's graph in a higher
    precision) serving `task` on `device`, without CUDA graphs: it runs a few requests off the
    hot path (slm_core.serve.accuracy_guard)."""
    node = package.read(Path(model_dir)).get("reference")
    if not node:
        raise SpecError(f"the package in {model_dir} holds no accuracy reference: build it with --accuracy-reference")
    device = torch.device(device)
    graph = load_graph(str(Path(model_dir) / node["file"]), device)
    return Runtime(graph, task, device)


def load_task(model_dir: Path, manifest: dict) -> Task:
    """The manifest's task, checked against the request path it records."""
    tokenizer = Tokenizer.from_file(str(model_dir / package.TOKENIZER))
    task = task_for(TaskSpec.from_dict(manifest["task"]).located(model_dir), tokenizer, manifest["device"])
    expected = task.pipeline(manifest["device"], package.node(manifest, "graph")["file"])
    if [(n["node"], n.get("op")) for n in manifest["pipeline"]] != [(n["node"], n.get("op")) for n in expected]:
        raise SpecError(
            f"the manifest's request path {[n.get('op') for n in manifest['pipeline']]} is not "
            f"this version's for its task: rebuild the package"
        )
    return task


class CompiledGraph:
    """An AOTInductor package's model, called as the package's exported graph is: flat tensors in,
    its outputs in their exported structure (a tensor, or a tuple of them) out."""

    def __init__(self, runner):
        self.runner = runner
        self.out_spec = pytree.treespec_loads(runner.get_call_spec()[1])

    def __call__(self, *args: torch.Tensor):
        return pytree.tree_unflatten(self.runner.run(list(args)), self.out_spec)


def load_graph(path: str, device: "torch.device | str", run_single_threaded: bool = False) -> CompiledGraph:
    """The package at `path` (graph.pt2: a zip whose .so holds the weights, hundreds of MB), built
    for `device`'s type, on `device`. run_single_threaded: one runner used by one thread at a time
    (what CUDA-graph capture needs).

    The package is extracted into this process's own directory under TMPDIR/slm-aoti-UID, and the
    model runner built from the extracted .so. torch._inductor.aoti_load_package, AOTInductor's
    own package loader, is several times slower (a 541 MB package on 2 cores, in a fresh process:
    4.8-7.0 s against 1.0-1.6 s), and on the way imports torch._inductor and compiles Inductor's
    CPU capability checks; it stays as the fallback for a torch whose binding lacks the CUDA
    runner's constructor with run_single_threaded. The extraction stays until the
    process exits, and a worker that TorchServe kills never does: so the directories of
    processes that are gone are removed here first, and this process's at its exit where it gets one."""
    device = torch.device(device)
    target = Path(tempfile.mkdtemp(dir=_scratch()))
    with zipfile.ZipFile(path) as archive:
        archive.extractall(target)
    (so,) = target.glob("**/*.so")  # the model's wrapper; CUDA kernels are cubins beside it
    if device.type != "cuda":  # one thread at a time either way: a CPU call is the worker's whole call
        return CompiledGraph(torch._C._aoti.AOTIModelContainerRunnerCpu(str(so), 1))
    index = torch.cuda.current_device() if device.index is None else device.index
    try:
        runner = torch._C._aoti.AOTIModelContainerRunnerCuda(
            str(so), 1, f"cuda:{index}", str(so.parent), run_single_threaded
        )
    except TypeError as e:  # a torch whose binding lacks this constructor: AOTInductor's own loader
        log.warning("loading %s through aoti_load_package (%s)", path, e)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "torchinductor_slm"))
        with _env("TMPDIR", str(target)):  # where it extracts: this process's directory, removed with it
            return torch._inductor.aoti_load_package(path, run_single_threaded=run_single_threaded, device_index=index)
    return CompiledGraph(runner)


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
    """This process's directory, PID-random, holding an exclusive lock on its .lock for the
    process's life: a directory whose lock can be taken belongs to no live process (in any PID
    namespace that shares TMPDIR), and is removed before this one is made."""
    global _mine
    if _mine is None:
        root = Path(tempfile.gettempdir()) / f"{SCRATCH}-{os.getuid()}"
        root.mkdir(mode=0o700, exist_ok=True)
        for other in root.iterdir():
            _remove_if_stale(other)
        mine = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=root))
        lock = open(mine / ".lock", "w")
        fcntl.flock(lock, fcntl.LOCK_EX)
        atexit.register(shutil.rmtree, mine, ignore_errors=True)
        _mine = (mine, lock)
    return _mine[0]


def _remove_if_stale(directory: Path) -> None:
    try:
        with open(directory / ".lock") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while its process lives
            shutil.rmtree(directory, ignore_errors=True)
    except FileNotFoundError:  # no lock: being made (a second ago), or left half made
        with contextlib.suppress(OSError):
            if time.time() - directory.stat().st_mtime > 60:
                shutil.rmtree(directory, ignore_errors=True)
    except OSError:  # held: its process lives
        pass


def worker_device(gpu_id: int | None) -> torch.device:
    """`cuda:{gpu_id}` (TorchServe's GPU for this worker; cuda:0 without one), made the process's
    current device before anything is loaded, so that what follows without an explicit device
    (AOTInductor's kernels, pinned buffers, CUDA-graph streams and pool) lands there too: a worker
    never touches another GPU."""
    index = 0 if gpu_id is None else int(gpu_id)
    if not 0 <= index < torch.cuda.device_count():
        raise SpecError(
            f"worker was given GPU {gpu_id}, this host has {torch.cuda.device_count()} "
            "(TorchServe's number_of_gpu or the archive's deviceIds name a GPU that is not there)"
        )
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


def mps_running(proc: Path = Path("/proc")) -> bool:
    """Whether NVIDIA's Multi-Process Service control daemon (`nvidia-cuda-mps-control -d`) runs
    where this process can see it. CUDA processes started after it share the GPU through one
    server and run their kernels side by side; without it a GPU time-slices between processes, so
    a second worker on a GPU adds no GPU throughput."""
    for cmdline in proc.glob("[0-9]*/cmdline"):
        try:
            program = cmdline.read_bytes().split(b"\0", 1)[0]
        except OSError:  # gone, or not ours to read
            continue
        if program.rsplit(b"/", 1)[-1] == b"nvidia-cuda-mps-control":
            return True
    return False
