"""The kinds of task, one module each (slm_core.tasks.base says what a task owns). A task YAML's
`task` and `head` keys name the kind; adding a kind adds a module here and its graph builder
(slm_core.compile.graphs), not handler or runtime code."""

from dataclasses import replace

from tokenizers import Tokenizer

from slm_core.errors import SpecError
from slm_core.spec import TaskSpec
from slm_core.tasks.base import Difference, Task
from slm_core.tasks.beam import BeamTask
from slm_core.tasks.catalog import CatalogTask
from slm_core.tasks.classifier import ClassifierTask
from slm_core.tasks.embedding import EmbeddingTask
from slm_core.tasks.labels import LabelsTask
from slm_core.tasks.mlp import MlpTask

KINDS: tuple[type[Task], ...] = (LabelsTask, ClassifierTask, EmbeddingTask, MlpTask, BeamTask, CatalogTask)

__all__ = [
    "KINDS",
    "BeamTask",
    "CatalogTask",
    "ClassifierTask",
    "Difference",
    "EmbeddingTask",
    "LabelsTask",
    "MlpTask",
    "Task",
    "task_class",
    "task_for",
]


def task_class(spec: TaskSpec) -> type[Task]:
    """The kind a task YAML names (`task`, and `head` where a kind has several)."""
    for kind in KINDS:
        if kind.matches(spec):
            return kind
    heads = sorted(k.head for k in KINDS if k.kind == spec.task and k.head)
    if heads:
        raise SpecError(f"task key 'head' must be one of {heads} for a {spec.task} task, got {spec.head!r}")
    raise SpecError(f"task must be one of {sorted({k.kind for k in KINDS})}, got {spec.task!r}")


def task_for(spec: TaskSpec, tokenizer: Tokenizer, device: str = "cpu") -> Task:
    """The task a spec describes, its max_batch resolved: the spec's, else the kind's best-served
    one on CUDA (Task.cuda_max_batch) and 1 on CPU, where serving is for development."""
    kind = task_class(spec)
    if spec.max_batch is None:
        spec = replace(spec, max_batch=kind.cuda_max_batch if device.startswith("cuda") else 1)
    return kind(spec, tokenizer)
