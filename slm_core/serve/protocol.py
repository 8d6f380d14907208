"""The REST protocol, independent of TorchServe: a request's raw body and headers -> (status, JSON).

A request body is one JSON object with the task's field (Task.request); the answer is the task's
(Task.body). A bad request gets 400 {"error": "..."} naming the problem in JSON's terms and the
bound it breaks (415 for an encoded body); a failure of the graph call 500 for the requests in
it. Nothing here raises, except DeviceLost: a device that fails every call from now on, which
only a new process can use again.
"""

import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import orjson

from slm_core.errors import DeviceLost, InputError, bounded, names
from slm_core.serve.deadline import Deadlines
from slm_core.serve.engine import CallStats, Engine

log = logging.getLogger(__name__)
MAX_DIGITS = 32  # of an integer in a request body: a bound of the protocol, not of Python
INT_LIMIT = 10**MAX_DIGITS


@dataclass(frozen=True)
class Request:
    """One request as its host hands it over: its parameters (TorchServe: the body under "body",
    or a form's fields), its HTTP headers (names in lower case) and when the host handed it over
    (time.monotonic())."""

    parameters: Mapping[str, Any]
    headers: Mapping[str, str] = field(default_factory=dict)
    received: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    stats: CallStats | None = None  # set when the graph ran


def encode(obj: Any) -> bytes:
    """Compact, deterministic JSON in UTF-8 (the same answer is the same bytes), by orjson: a W=100
    beam reply in a tenth of the standard library's time. Raises ValueError for what JSON cannot
    carry: a non-finite number (orjson writes it as null, so a reply holding null is checked) or a
    str UTF-8 cannot carry."""
    try:
        out = orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError as e:  # orjson.JSONEncodeError
        raise ValueError(f"not JSON-serialisable: {e}") from None
    if b"null" in out and not _finite(obj):
        raise ValueError("a non-finite number, which JSON cannot carry")
    return out


def _finite(obj: Any) -> bool:
    if isinstance(obj, float):
        return math.isfinite(obj)
    if isinstance(obj, np.ndarray):
        return bool(np.isfinite(obj).all())
    if isinstance(obj, dict):
        return all(_finite(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(_finite(v) for v in obj)
    return True


def error(status: int, message: str) -> Reply:
    """An error reply that cannot fail: bounded, and what UTF-8 cannot carry escaped."""
    safe = bounded(message).encode("utf-8", "backslashreplace").decode("utf-8")
    return Reply(status, encode({"error": safe}))


def request_body(request: Request) -> object:
    """The raw body of one request (TorchServe names a JSON POST's parameter "body", a raw one
    "data"); a form post arrives as fields instead."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise InputError(f"Content-Encoding {bounded(encoding, 32)!r} is not supported: send the JSON body "
                         "uncompressed", status=415)
    for key in ("body", "data"):
        if request.parameters.get(key) is not None:
            return request.parameters[key]
    raise InputError("expected a JSON body (Content-Type: application/json), got form fields "
                     f"{names(request.parameters) or 'none'}")


def _constant(name: str):
    raise InputError(f"request body holds {name}, which is not JSON")


def parse_body(body: object) -> Any:
    """A request body -> its JSON value, parsed once. The body is raw bytes (the handler has
    TorchServe hand bodies over undecoded); a value TorchServe decoded already (its default
    decode_input_request) is taken as it is: a str is then a JSON string, not a request."""
    if isinstance(body, (bytes, bytearray)):
        try:
            text = bytes(body).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"request body is not valid UTF-8 (byte {e.start})") from None
        try:
            value = json.loads(text, parse_constant=_constant)
        except RecursionError:
            raise InputError("request body nests arrays or objects too deeply to parse "
                             "(a request nests them 2 deep)") from None
        except json.JSONDecodeError as e:
            raise InputError(f"request body is not valid JSON: {e.msg} at character {e.pos}") from None
        except InputError:  # NaN or Infinity (_constant)
            raise
        except ValueError:  # an integer past Python's own limit on converting digits
            raise InputError(f"request body holds a number of more than {MAX_DIGITS} digits") from None
        _check_digits(value)
        return value
    return body


def _check_digits(value: Any) -> None:
    """The digit bound, checked on the parsed value: a walk costs ~1 us for a W1 body, where a
    regular expression over its text costs ~80 us and a parse_int hook a Python call per integer."""
    stack = [value]
    while stack:  # no recursion: the parser's nesting limit is deeper than a walk's stack room
        x = stack.pop()
        if type(x) is int:
            if not -INT_LIMIT < x < INT_LIMIT:
                raise InputError(f"request body holds a number of {len(str(abs(x)))} digits (at most {MAX_DIGITS})")
        elif type(x) is list:
            stack.extend(x)
        elif type(x) is dict:
            stack.extend(x.values())


def respond(engine: Engine, request: Request, deadlines: Deadlines | None = None) -> Reply:
    return respond_batch(engine, [request], deadlines)[0]


def respond_batch(engine: Engine, requests: list[Request], deadlines: Deadlines | None = None) -> list[Reply]:
    """The replies to a batch, in order. Up to max_batch requests share one graph call; a bad
    request gets its own 4xx and is left out of the call, as is one that its call would answer
    past its deadline (504, slm_core.serve.deadline); a failure of the call itself is a 500 for the
    requests in it, logged, or DeviceLost raised when the device fails every call after it."""
    task = engine.task
    replies: list[Reply | None] = [None] * len(requests)
    values, members = [], []
    for i, request in enumerate(requests):
        try:
            values.append(task.request(parse_body(request_body(request))))
            members.append(i)
        except InputError as e:
            replies[i] = error(e.status, str(e))
        except Exception:
            log.exception("request failed")
            replies[i] = error(500, "internal error while running the request")
    for start in range(0, len(values), task.max_batch):
        call = list(zip(values[start : start + task.max_batch], members[start : start + task.max_batch]))
        if deadlines is not None:
            call = [(value, i) for value, i in call if not _late(deadlines, requests[i], len(call), replies, i)]
        if call:
            _call(engine, [value for value, _ in call], [i for _, i in call], replies)
    return replies


def _late(deadlines: Deadlines, request: Request, requests: int, replies: list, i: int) -> bool:
    """Whether request i is refused for its deadline (or a bad deadline header); its reply is set."""
    try:
        refusal = deadlines.refusal(request.headers, request.received, requests)
    except InputError as e:
        refusal = e
    if refusal is not None:
        replies[i] = error(refusal.status, str(refusal))
    return refusal is not None


def _call(engine: Engine, values: list, members: list[int], replies: list) -> None:
    """One graph call for up to max_batch requests; their replies go to replies[members]."""
    try:
        results = engine.run(values)
    except Exception as e:  # a bug or a device fault: these requests fail, the worker lives on
        if not engine.usable():  # unless the device is gone for this process
            raise DeviceLost(f"{engine.device} fails every call after: {bounded(str(e))}") from e
        log.exception("graph call failed")
        for i in members:
            replies[i] = error(500, "internal error while running the request")
        return
    for i, result in zip(members, results):
        if result.error is not None:
            replies[i] = error(result.error.status, str(result.error))
            continue
        try:
            replies[i] = Reply(200, encode(engine.task.body(result.answer)), result.stats)
        except ValueError:  # a NaN or infinity from the graph, which JSON cannot carry: this request only
            log.exception("a non-finite number in a graph's output")
            replies[i] = error(500, "internal error: the model produced a non-finite number")
