"""The REST protocol of DESIGN.md, independent of TorchServe: raw request body -> (status, JSON bytes).

The body of a request:
Score: {"texts": [str, ...]} -> {"labels": [...], "scores": [[p, ...], ...]}
Beam:  {"prompt": str}       -> {"candidates": [{"text", "token_ids", "score"}, ...]} best first
Bad input: 400 {"error": "..."} naming the problem in JSON's terms and the bound; an encoded body
415. Nothing here raises.
"""

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

from slm_core.engine import CallStats, Engine
from slm_core.errors import InputError, json_type

log = logging.getLogger(__name__)
FIELDS = {"score": "texts", "beam": "prompt"}
# An error message is at most this many characters whatever the request holds: it echoes field
# names and values, and a reply larger than TorchServe's max_response_size takes its worker down.
MAX_ERROR_CHARS = 400
MAX_NAME_CHARS = 32  # of one echoed field name
MAX_DIGITS = 32  # of an integer in a request body (a bound of the protocol, not of Python)


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    stats: CallStats | None = None  # set when the graph ran


@dataclass(frozen=True)
class Request:
    """One request as its host hands it over: its parameters (TorchServe: the body under "body",
    or a form's fields) and its HTTP headers, names in lower case."""

    parameters: Mapping[str, Any]
    headers: Mapping[str, str] = field(default_factory=dict)


def encode(obj: Any) -> bytes:
    # Compact and deterministic: the same answer is the same bytes. No cycle check: every object is
    # built here, and the check costs ~10 % of a beam reply's encoding (its 100 candidate dicts).
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False,
                      check_circular=False).encode("utf-8")


def error(status: int, message: str) -> Reply:
    if len(message) > MAX_ERROR_CHARS:
        message = message[: MAX_ERROR_CHARS - 1] + "…"
    return Reply(status, encode({"error": message}))


def names(keys) -> str:
    """A few field names, each cut short, for an error message: a hostile body may hold millions."""
    shown = sorted(str(k) for k in keys)[:5]
    cut = [json.dumps(k if len(k) <= MAX_NAME_CHARS else k[:MAX_NAME_CHARS] + "…", ensure_ascii=False) for k in shown]
    more = len(keys) - len(shown)
    return ", ".join(cut) + (f" and {more} more" if more > 0 else "")


class UnsupportedEncoding(InputError):
    """A body sent with a Content-Encoding (gzip, ...): HTTP 415."""


def request_body(request: Request) -> object:
    """The raw body of one request (TorchServe names a JSON POST's parameter "body"; an
    un-named raw body arrives as "data"); a form post arrives as fields instead."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise UnsupportedEncoding(f"Content-Encoding {encoding[:MAX_NAME_CHARS]!r} is not supported: send the "
                                  "JSON body uncompressed")
    for key in ("body", "data"):
        if request.parameters.get(key) is not None:
            return request.parameters[key]
    raise InputError("expected a JSON body (Content-Type: application/json), got form fields "
                     f"{names(request.parameters) or 'none'}")


def _int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_DIGITS:
        raise InputError(f"request body holds a number of {len(digits.lstrip('-'))} digits (at most {MAX_DIGITS})")
    return int(digits)


def _constant(name: str):
    raise InputError(f"request body holds {name}, which is not JSON")


def parse_body(body: object) -> Any:
    """A request body -> its JSON value, parsed once. The body is raw bytes (the handler has
    TorchServe hand bodies over undecoded); a value TorchServe decoded already (its default
    decode_input_request) is taken as it is, except a str: that is a JSON string, not a request."""
    if isinstance(body, (bytes, bytearray)):
        try:
            text = bytes(body).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"request body is not valid UTF-8 (byte {e.start})") from None
        try:
            return json.loads(text, parse_int=_int, parse_constant=_constant)
        except RecursionError:
            raise InputError("request body nests arrays or objects too deeply to parse "
                             "(a request nests them 2 deep)") from None
        except json.JSONDecodeError as e:
            raise InputError(f"request body is not valid JSON: {e.msg} at character {e.pos}") from None
    return body


def request_field(payload: Any, task: str) -> Any:
    field_name = FIELDS[task]
    if not isinstance(payload, dict):
        raise InputError(f'request body must be a JSON object like {{"{field_name}": ...}}, got {json_type(payload)}')
    unknown = set(payload) - {field_name}
    if field_name not in payload:
        raise InputError(f"request body is missing the field {field_name!r}" + (f" (got {names(unknown)})" if unknown else ""))
    if unknown:
        raise InputError(f"unknown fields {names(unknown)}; a {task} request has only {field_name!r}")
    return payload[field_name]


def respond(engine: Engine, request: "Request | Mapping[str, Any]") -> Reply:
    """Run one request end to end. Input errors -> 400 (415 for an encoded body); anything else
    -> 500 (logged)."""
    return respond_batch(engine, [request])[0]


def respond_batch(engine: Engine, requests: "list[Request | Mapping[str, Any]]") -> list[Reply]:
    """The replies to a TorchServe batch, in order (a mapping is a request's parameters, without
    headers). Requests share one graph call, up to the
    task's max_batch each; a bad request gets its own 400 and is left out of the call; a failure
    of the call itself is a 500 for the requests in it, logged. Nothing here raises."""
    task = engine.task
    replies: list[Reply | None] = [None] * len(requests)
    values, members = [], []
    for i, request in enumerate(requests):
        if not isinstance(request, Request):
            request = Request(request)
        try:
            values.append(request_field(parse_body(request_body(request)), task.task))
            members.append(i)
        except UnsupportedEncoding as e:
            replies[i] = error(415, str(e))
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
