"""Typed errors. SpecError: a build-time problem (spec, checkpoint). InputError: a bad request.
DeviceLost: a device this process can no longer use."""

import json

MAX_ERROR_CHARS = 400  # an error message's length, whatever the request holds (a reply's bound)
JSON_TYPES = {
    dict: "an object",
    list: "an array",
    tuple: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


class SpecError(ValueError):
    """A task/model/serving spec or checkpoint the engine cannot build from or serve."""


class InputError(ValueError):
    """A request that breaks the task's contract: its HTTP status (400; 415 for an encoded body),
    and the task bound it breaks and that bound's value, if any."""

    def __init__(self, message: str, bound: str | None = None, limit: int | None = None, status: int = 400):
        super().__init__(message)
        self.bound = bound
        self.limit = limit
        self.status = status


class DeviceLost(RuntimeError):
    """The device's context is unusable: a sticky CUDA error (an illegal address, or under NVIDIA
    MPS a fatal fault of any client on the same GPU) fails every later call in this process. Only a
    new process can use the GPU again, and under MPS the GPU serves no new client until every
    process the fault reached has exited."""


def json_type(value: object) -> str:
    """The JSON name of a decoded request value's type, for error messages."""
    return JSON_TYPES.get(type(value), "a value")


def bounded(message: str, limit: int = MAX_ERROR_CHARS) -> str:
    """`message` cut to `limit` characters: an error reply larger than TorchServe's
    max_response_size takes its worker down, and messages echo what requests hold."""
    return message if len(message) <= limit else message[: limit - 1] + "…"


def names(keys) -> str:
    """A few field names, each cut short and escaped (a name may hold a lone surrogate, which UTF-8
    cannot carry), for an error message: a hostile body may hold millions."""
    shown = sorted(str(k) for k in keys)[:5]
    more = len(keys) - len(shown)
    return ", ".join(json.dumps(bounded(k, 32)) for k in shown) + (f" and {more} more" if more > 0 else "")
