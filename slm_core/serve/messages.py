"""The request and reply types of every protocol a worker answers, in one place:
- Request: one request as its host hands it over;
- BodyKind: what its body is: the native body, KServe v1, KServe v2 (the Open Inference Protocol)
  as JSON or in Triton's binary tensor extension. slm_core.serve.protocol.body_kind decides it
  once per request, and that kind's decoder reads the body;
- Decoded: what a body asks of the engine: its engine request values, how their answers make the
  reply's JSON, and how an error of value i is named;
- Reply: the status and body bytes sent back, with the call's figures when the graph ran.
"""

import enum
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from slm_core.serve.runtime import CallStats


@dataclass(frozen=True)
class Request:
    """One request as its host hands it over: its parameters (TorchServe: the body under "body",
    or a form post's fields), its HTTP headers (names in lower case) and when the host handed it
    over (time.monotonic())."""

    parameters: Mapping[str, Any]
    headers: Mapping[str, str] = field(default_factory=dict)
    received: float = field(default_factory=time.monotonic)


class BodyKind(enum.Enum):
    NATIVE = "native"  # {"texts": ...} / {"prompt": ...}: the task's own field (Task.request)
    KSERVE_V1 = "kserve v1"  # {"instances": [native body, ...]}
    KSERVE_V2 = "kserve v2"  # {"inputs": [tensor, ...], ...}
    KSERVE_V2_BINARY = "kserve v2, binary tensors"  # a JSON header, then the inputs' bytes


@dataclass(frozen=True)
class Decoded:
    """What one request body asks: the engine request values it holds (one, or a KServe v1 body's
    instances), how their answers make the reply's JSON object, and how an error of value i is
    prefixed in the reply (a v1 body's "instances[i]: ")."""

    values: list
    answer: Callable[[list], Any]
    where: Callable[[int], str] = lambda i: ""


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    stats: CallStats | None = None  # set when the graph ran
