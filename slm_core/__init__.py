"""slm_core: the engine. Specs, checkpoint import, packed tokenizer, packed model, request graphs."""

from slm_core.engine import Engine
from slm_core.errors import InputError, SpecError
from slm_core.spec import ModelSpec, RuntimeSpec, TaskSpec

__all__ = ["Engine", "InputError", "ModelSpec", "RuntimeSpec", "SpecError", "TaskSpec"]
