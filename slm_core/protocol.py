"""The REST protocol of DESIGN.md, independent of TorchServe: raw request body -> (status, JSON bytes).

The body of a request:
Score: {"texts": [str, ...]} -> {"labels": [...], "scores": [[p, ...], ...]}
Beam:  {"prompt": str}       -> {"candidates": [{"text", "token_ids", "score"}, ...]} best first
Bad input: 400 {"error": "..."} naming the problem. Nothing here raises.
"""

import json
import logging
from dataclasses import dataclass
from typing import Any

from slm_core.engine import CallStats, Engine
from slm_core.errors import InputError

log = logging.getLogger(__name__)
FIELDS = {"score": "texts", "beam": "prompt"}


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    stats: CallStats | None = None  # set when the graph ran


def encode(obj: Any) -> bytes:
    # Compact and deterministic: the same answer is the same bytes. No cycle check: every object is
    # built here, and the check costs ~10 % of a beam reply's encoding (its 100 candidate dicts).
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False,
                      check_circular=False).encode("utf-8")


def error(status: int, message: str) -> Reply:
    return Reply(status, encode({"error": message}))


def request_body(request: dict) -> object:
    """The body of one TorchServe request: under "body" (or "data"); a form post arrives as fields."""
    for key in ("body", "data"):
        if request.get(key) is not None:
            return request[key]
    fields = sorted(str(k) for k in request)
    raise InputError(f"expected a JSON body (Content-Type: application/json), got form fields {fields}")


def parse_body(body: object) -> Any:
    """A request body as TorchServe hands it over (decoded JSON, str, or raw bytes) -> JSON value."""
    if isinstance(body, (bytes, bytearray)):
        try:
            body = bytes(body).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"request body is not valid UTF-8 (byte {e.start})") from None
    if isinstance(body, str):
        try:
            return json.loads(body)
        except RecursionError:
            raise InputError("request body is nested too deeply") from None
        except ValueError as e:
            raise InputError(f"request body is not valid JSON: {e}") from None
    return body


def request_field(payload: Any, task: str) -> Any:
    field = FIELDS[task]
    if not isinstance(payload, dict):
        raise InputError(f'request body must be a JSON object like {{"{field}": ...}}, got {type(payload).__name__}')
    unknown = sorted(set(payload) - {field})[:5]  # a few names are enough; a hostile body may hold millions
    if field not in payload:
        raise InputError(f"request body is missing the field {field!r}" + (f" (got {unknown})" if unknown else ""))
    if unknown:
        raise InputError(f"unknown fields {unknown}; a {task} request has only {field!r}")
    return payload[field]


def respond(engine: Engine, request: dict) -> Reply:
    """Run one TorchServe request dict end to end. Input errors -> 400; anything else -> 500 (logged)."""
    return respond_batch(engine, [request])[0]


def respond_batch(engine: Engine, requests: list[dict]) -> list[Reply]:
    """The replies to a TorchServe batch, in order. Requests share one graph call, up to the
    task's max_batch each; a bad request gets its own 400 and is left out of the call; a failure
    of the call itself is a 500 for the requests in it, logged. Nothing here raises."""
    task = engine.task
    replies: list[Reply | None] = [None] * len(requests)
    values, members = [], []
    for i, request in enumerate(requests):
        try:
            values.append(request_field(parse_body(request_body(request)), task.task))
            members.append(i)
        except InputError as e:
            replies[i] = error(400, str(e))
        except Exception:
            log.exception("request failed")
            replies[i] = error(500, "internal error while running the request")
    for start in range(0, len(values), task.max_batch):
        _call(engine, values[start : start + task.max_batch], members[start : start + task.max_batch], replies)
    return replies


def _call(engine: Engine, values: list, members: list[int], replies: list) -> None:
    """One graph call for up to max_batch requests; their replies go to replies[members]."""
    score = engine.task.task == "score"
    try:
        results = engine.run_score_batch(values) if score else engine.run_beam_batch(values)
    except Exception:  # a bug or a device fault: these requests fail, the worker lives on
        log.exception("graph call failed")
        for i in members:
            replies[i] = error(500, "internal error while running the request")
        return
    for i, result in zip(members, results):
        if isinstance(result, InputError):
            replies[i] = error(400, str(result))
            continue
        try:
            body = {"labels": list(engine.task.labels), "scores": result[0]} if score else {"candidates": result[0]}
            replies[i] = Reply(200, encode(body), result[1])
        except ValueError:  # a NaN or infinity from the graph, which JSON cannot carry: this request only
            log.exception("a non-finite number in a graph's output")
            replies[i] = error(500, "internal error: the model produced a non-finite number")
