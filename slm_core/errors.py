"""Typed errors. SpecError: a build-time problem (spec, checkpoint). InputError: a bad request."""


class SpecError(ValueError):
    """A task/model/runtime spec or checkpoint the engine cannot build from."""


class InputError(ValueError):
    """A request that breaks the task's contract. `bound` names the task bound it breaks, if any."""

    def __init__(self, message: str, bound: str | None = None, limit: int | None = None):
        super().__init__(message)
        self.bound = bound
        self.limit = limit


JSON_TYPES = {dict: "an object", list: "an array", tuple: "an array", str: "a string", int: "a number",
              float: "a number", bool: "a boolean", type(None): "null"}


def json_type(value: object) -> str:
    """The JSON name of a decoded request value's type, for error messages."""
    return JSON_TYPES.get(type(value), "a value")
