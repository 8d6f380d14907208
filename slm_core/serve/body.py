"""A request's body: raw bytes -> one JSON value, parsed once, with the protocol's bounds (digits,
nesting) named in JSON's terms."""

import json
from typing import Any

from slm_core.errors import InputError, bounded, names
from slm_core.serve.messages import Request

MAX_DIGITS = 32  # of an integer in a request body: a bound of the protocol, not of Python
INT_LIMIT = 10**MAX_DIGITS


def request_body(request: Request) -> object:
    """The raw body of one request (TorchServe names a JSON POST's parameter "body", a raw one
    "data"); a form post arrives as fields instead."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise InputError(
            f"Content-Encoding {bounded(encoding, 32)!r} is not supported: send the JSON body uncompressed", status=415
        )
    for key in ("body", "data"):
        if request.parameters.get(key) is not None:
            return request.parameters[key]
    raise InputError(
        f"expected a JSON body (Content-Type: application/json), got form fields {names(request.parameters) or 'none'}"
    )


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
            raise InputError(
                "request body nests arrays or objects too deeply to parse (a request nests them 2 deep)"
            ) from None
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
    """The digit bound, checked on the parsed value: a walk over it is far cheaper than a regular
    expression over the body's text, or a parse_int hook (a Python call per integer)."""
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
