"""The REST protocol, independent of TorchServe: a request's raw body and headers -> (status, JSON).

A request body is one JSON object with the task's field (Task.request); the answer is the task's
(Task.body). KServe's v1 and v2 bodies are answered in their protocols (slm_core.serve.kserve).
A bad request gets 400 {"error": "..."} naming the problem in JSON's terms and the bound it
breaks (415 for an encoded body); a failure of the graph call 500 for the requests in it.
Nothing here raises, except DeviceLost: a device that fails every call from now on, which only a
new process can use again.
"""

import logging
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import orjson

from slm_core.errors import DeviceLost, InputError, bounded
from slm_core.serve import kserve
from slm_core.serve.body import parse_body, request_body
from slm_core.serve.deadline import Deadlines
from slm_core.serve.messages import BodyKind, Decoded, Reply, Request
from slm_core.serve.runtime import Runtime
from slm_core.tasks import Task

__all__ = ["Reply", "Request", "body_kind", "decode", "encode", "error", "respond", "respond_batch"]
log = logging.getLogger(__name__)
BINARY_HEADER = "inference-header-content-length"  # Triton's binary tensor extension (kserve.v2_binary)


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


def body_kind(request: Request, field: str) -> tuple[BodyKind, Any]:
    """Which protocol a request's body speaks, decided once, and the body as that kind's decoder
    reads it: Triton's binary header (the raw bytes); else the parsed JSON: an object without the
    task's own `field` that holds 'instances' (KServe v1) or 'inputs' (v2); else the native body.
    A body with the task's field is native whatever else it holds (its decoder names the rest)."""
    raw = request_body(request)
    if BINARY_HEADER in request.headers:
        return BodyKind.KSERVE_V2_BINARY, raw
    value = parse_body(raw)
    if isinstance(value, dict) and field not in value:
        if "instances" in value:
            return BodyKind.KSERVE_V1, value
        if "inputs" in value:
            return BodyKind.KSERVE_V2, value
    return BodyKind.NATIVE, value


DECODERS = {  # kind -> (task, body, headers, model) -> Decoded
    BodyKind.NATIVE: lambda task, value, headers, model: Decoded(
        [task.request(value)], lambda answers: task.body(answers[0])
    ),
    BodyKind.KSERVE_V1: lambda task, value, headers, model: kserve.v1(task, value),
    BodyKind.KSERVE_V2: lambda task, value, headers, model: kserve.v2(task, value, b"", model),
    BodyKind.KSERVE_V2_BINARY: lambda task, raw, headers, model: kserve.v2_binary(
        task, raw, headers[BINARY_HEADER], model
    ),
}


def decode(task: Task, request: Request, model: tuple[str, str] = ("", "")) -> Decoded:
    """What a request asks of the engine: its body's kind (body_kind), read by that kind's decoder
    (model: the name and version a v2 answer names)."""
    kind, body = body_kind(request, task.field)
    return DECODERS[kind](task, body, request.headers, model)


def respond(
    engine: Runtime, request: Request, deadlines: Deadlines | None = None, model: tuple[str, str] = ("", "")
) -> Reply:
    return respond_batch(engine, [request], deadlines, model)[0]


def respond_batch(
    engine: Runtime,
    requests: list[Request],
    deadlines: Deadlines | None = None,
    model: tuple[str, str] = ("", ""),
    answered: Callable[[int, Any, Any], None] | None = None,
) -> list[Reply]:
    """The replies to a batch, in order. Up to max_batch request values share one graph call, a
    request's values (a v1 body's instances) the same one; a bad request gets its own 4xx and is
    left out of the call, as is one that its call would answer past its deadline (504,
    slm_core.serve.deadline); a failure of the call itself is a 500 for the requests in it,
    logged, or DeviceLost raised when the device fails every call after it. `answered(i, value,
    answer)` sees each answered value of request i (the accuracy guard's sample)."""
    task = engine.task
    replies: list[Reply | None] = [None] * len(requests)
    decoded: dict[int, Decoded] = {}
    for i, request in enumerate(requests):
        try:
            decoded[i] = decode(task, request, model)
        except InputError as e:
            replies[i] = error(e.status, str(e))
        except Exception:
            log.exception("request failed")
            replies[i] = error(500, "internal error while running the request")
    calls: list[list[int]] = [[]]
    sizes = [0]  # each call's request values
    for i, d in decoded.items():  # in order, a call filled up before the next begins
        if sizes[-1] + len(d.values) > task.max_batch:
            calls.append([])
            sizes.append(0)
        calls[-1].append(i)
        sizes[-1] += len(d.values)
    for call, size in zip(calls, sizes):
        if not call:  # every request of the batch refused
            continue
        encoded = _encode(engine, decoded, call, replies)
        members = list(encoded)
        if deadlines is not None:  # the call's size as it will run, its tokens known
            held = [seqs for i in members for seqs in encoded[i] if not isinstance(seqs, InputError)]
            shape = (size, sum(map(len, held)), max((len(seq) for seqs in held for seq in seqs), default=0))
            members = [i for i in members if not _late(deadlines, requests[i], shape, replies, i)]
        if members:
            _call(engine, decoded, members, replies, encoded, answered)
    return replies


def _encode(engine: Runtime, decoded: dict[int, Decoded], call: list[int], replies: list) -> dict[int, list]:
    """The call's request values tokenized in one pass (Task.encode), per request: each value's
    sequences or its InputError. A failure of the tokenizer itself is a 500 for the call."""
    try:
        encoded = iter(engine.task.encode([v for i in call for v in decoded[i].values]))
    except Exception:
        log.exception("tokenizing a call failed")
        for i in call:
            replies[i] = error(500, "internal error while running the request")
        return {}
    return {i: [next(encoded) for _ in decoded[i].values] for i in call}


def _late(deadlines: Deadlines, request: Request, size: tuple, replies: list, i: int) -> bool:
    """Whether request i is refused for its deadline (or a bad deadline header) in a call of `size`
    (requests, sequences, the longest's tokens); its reply is set."""
    try:
        refusal = deadlines.refusal(request.headers, request.received, *size)
    except InputError as e:
        refusal = e
    if refusal is not None:
        replies[i] = error(refusal.status, str(refusal))
    return refusal is not None


def _call(
    engine: Runtime,
    decoded: dict[int, Decoded],
    members: list[int],
    replies: list,
    encoded: dict[int, list],
    answered: Callable[[int, Any, Any], None] | None = None,
) -> None:
    """One graph call for the values of requests `members` (tokenized: `encoded`); their replies go
    to replies[members]."""
    try:
        results = iter(
            engine.run([v for i in members for v in decoded[i].values], [e for i in members for e in encoded[i]])
        )
    except Exception as e:  # a bug or a device fault: these requests fail, the worker lives on
        if not engine.usable():  # unless the device is gone for this process
            raise DeviceLost(f"{engine.device} fails every call after: {bounded(str(e))}") from e
        log.exception("graph call failed")
        for i in members:
            replies[i] = error(500, "internal error while running the request")
        return
    for i in members:
        d = decoded[i]
        mine = [next(results) for _ in d.values]
        failed = [(k, r.error) for k, r in enumerate(mine) if r.error is not None]
        if failed:
            k, e = failed[0]
            replies[i] = error(e.status, d.where(k) + str(e))
            continue
        if answered is not None:
            for value, result in zip(d.values, mine):
                answered(i, value, result.answer)
        stats = mine[0].stats
        if len(mine) > 1:  # one call: its time and batch; the request's texts and tokens, all of them
            stats = replace(stats, texts=sum(r.stats.texts for r in mine), tokens=sum(r.stats.tokens for r in mine))
        try:
            replies[i] = Reply(200, encode(d.answer([r.answer for r in mine])), stats)
        except ValueError:  # a NaN or infinity from the graph, which JSON cannot carry: this request only
            log.exception("a non-finite number in a graph's output")
            replies[i] = error(500, "internal error: the model produced a non-finite number")
