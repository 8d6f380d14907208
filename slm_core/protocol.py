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
    # Compact and deterministic: the same answer is the same bytes.
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


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
    task = engine.task
    try:
        value = request_field(parse_body(request_body(request)), task.task)
        if task.task == "score":
            rows, stats = engine.run_score(value)
            return Reply(200, encode({"labels": list(task.labels), "scores": rows}), stats)
        candidates, stats = engine.run_beam(value)
        return Reply(200, encode({"candidates": candidates}), stats)
    except InputError as e:
        return error(400, str(e))
    except Exception:  # a bug or a device fault: this request fails, the worker lives on
        log.exception("request failed")
        return error(500, "internal error while running the request")
