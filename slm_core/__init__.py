"""slm_core: the engine. Specs and tasks (shared), compile/ (checkpoint import, model, graphs,
export, checks), serve/ (loading, the runtime, CUDA-graph replay, the protocol). A worker imports
serve-time modules only; `Engine` (the Python API) joins both, and is imported on first use."""

from slm_core.errors import InputError, SpecError
from slm_core.spec import ModelSpec, RuntimeSpec, TaskSpec

__all__ = ["Engine", "InputError", "ModelSpec", "RuntimeSpec", "SpecError", "TaskSpec"]


def __getattr__(name: str):
    if name == "Engine":  # the Python API imports the build half: never on a worker's path
        from slm_core.api import Engine

        return Engine
    raise AttributeError(f"module 'slm_core' has no attribute {name!r}")
