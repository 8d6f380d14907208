"""Typed errors. SpecError: a build-time problem (spec, checkpoint). InputError: a bad request."""


class SpecError(ValueError):
    """A task/model/runtime spec or checkpoint the engine cannot build from."""


class InputError(ValueError):
    """A request that breaks the task's contract. `bound` names the task bound it breaks, if any."""

    def __init__(self, message: str, bound: str | None = None, limit: int | None = None):
        super().__init__(message)
        self.bound = bound
        self.limit = limit
