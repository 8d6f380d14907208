"""Bad input, measured: generated malformed and adversarial requests among valid ones, sent
concurrently. Every bad one must get a bounded 4xx JSON error, every valid one the answer it gets
alone (within its precision's tolerance), and no worker may restart."""

import concurrent.futures
import gzip
import json
import math
import random
import re
import time
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

from bench.reliability.open_loop import JSON, worker_pids
from handlers.local_server import http

TEN_MB = 10 * 1024 * 1024


@dataclass(frozen=True)
class Probe:
    body: bytes
    kind: str  # the category of a bad request, or "valid"
    content_type: str = JSON
    encoding: str | None = None  # its Content-Encoding header

    def headers(self) -> dict[str, str]:
        return {"Content-Type": self.content_type, **({"Content-Encoding": self.encoding} if self.encoding else {})}


# An error message names JSON's types and the protocol's bounds, never Python's internals.
PYTHON_WORDS = re.compile(r"NoneType|\bdict\b|\bstr\b|\bfloat\b|\bint\b|\blist\b|sys\.|Traceback|Error:")


MAX_ERROR_BYTES = 1024  # the handler's bound on an error reply, whatever the request


def _field(task: str) -> str:
    return "texts" if task == "score" else "prompt"


def _wrap(task: str, value) -> dict:
    return {_field(task): value}


def valid_requests(task: str, max_items: int, rng: random.Random, n: int) -> list[Probe]:
    """Well-formed requests within the bounds, with the text a client may legitimately send:
    emoji, combining marks, right-to-left and zero-width characters, escaped control characters."""
    pieces = [
        "cheap flights to rome",
        "naïve café",
        "日本語のテキスト",
        "emoji 😀🚀",
        "e\u0301 combining",
        "\u202eright to left\u202c",
        "zero\u200bwidth",
        "tab\tand\nnewline",
        "bell \u0007 escaped",
        'quote " and backslash \\',
        "BOM \ufeff inside",
        "١٢٣ digits",
        "rome<|im_end|>",
        "<|im_start|>assistant",
    ]
    out = []
    for _ in range(n):
        if task == "score":
            value = [" ".join(rng.sample(pieces, 2)) for _ in range(rng.randint(1, max_items))]
        else:
            value = " ".join(rng.sample(pieces, 3))
        out.append(Probe(json.dumps(_wrap(task, value), ensure_ascii=rng.random() < 0.5).encode(), "valid"))
    return out


def bad_requests(
    task: str,
    max_items: int,
    max_tokens: int,
    rng: random.Random,
    n: int,
    ten_mb: int = 4,
    near_limit: int = 2,
    limit: int = 16 * 1024 * 1024,
) -> list[Probe]:
    """`n` requests that must each get a 4xx JSON error, drawn from every category below (`ten_mb`
    of them 10 MB bodies, `near_limit` of them bodies of long field names just under the
    request-size `limit`, a JSON object's and a form's). For a score task "items" are texts, for
    beam the prompt."""
    field, other = _field(task), "prompt" if task == "score" else "texts"
    good = ["a valid text"] if task == "score" else "a valid prompt"
    good_body = json.dumps(_wrap(task, good)).encode()
    long_text = "word " * (max_tokens * 2)

    def item(value):  # the value in the request's field: a list of one for score, itself for beam
        return _wrap(task, [value] if task == "score" else value)

    makers = {
        "invalid JSON": lambda: rng.choice(
            [
                b"not json",
                b"{",
                b"}",
                b"{'texts': ['a']}",
                b'{"texts": ["a"]} trailing',
                b'{"texts": ["a",]}',
                b"nul\x00l",
                b"NaN",
                b"[1, 2",
                b'{"a" 1}',
            ]
        ),
        "truncated body": lambda: good_body[: rng.randint(1, len(good_body) - 1)],
        "empty body": lambda: rng.choice([b"", b" ", b"\n", b"{}", b"null", b'""', b"[]"]),
        "wrong type": lambda: json.dumps(
            _wrap(
                task,
                rng.choice(
                    [
                        1,
                        1.5,
                        None,
                        True,
                        {"a": 1},
                        [1, 2],
                        [None],
                        [["nested"]],
                        [{"a": "b"}],
                        "a" if task == "score" else ["a"],
                    ]
                ),
            )
        ).encode(),
        "huge number": lambda: rng.choice(
            [
                b'{"%s": 1e400}' % field.encode(),
                b'{"%s": [%s]}' % (field.encode(), b"9" * rng.randint(5000, 50000)),
                b'{"%s": -1e999}' % field.encode(),
                b'{"%s": 123456789012345678901234567890}' % field.encode(),
            ]
        ),
        "deep nesting": lambda: rng.choice(
            [
                b"[" * 100_000 + b"]" * 100_000,
                b'{"%s": ' % field.encode() + b"[" * 5000 + b"]" * 5000 + b"}",
                b'{"a": ' * 20_000 + b"1" + b"}" * 20_000,
            ]
        ),
        "invalid unicode": lambda: rng.choice(
            [
                b'{"%s": ["\xff\xfe"]}' % field.encode(),
                b'{"%s": "\xc0\xaf"}' % field.encode(),
                b"\xef\xbb\xbf" + good_body,  # a UTF-8 byte order mark before the JSON
                json.dumps(item("lone \ud800 surrogate")).encode(),
                json.dumps(item("\udfff")).encode(),
                b'{"%s": "\xed\xa0\x80"}' % field.encode(),
            ]
        ),
        "raw control character": lambda: (
            b'{"%s": ["a\x01b"]}' % field.encode() if task == "score" else b'{"prompt": "a\x01b"}'
        ),
        "empty or blank text": lambda: json.dumps(item(rng.choice(["", " ", "\t\n", "\u3000"]))).encode(),
        "over the bounds": lambda: json.dumps(
            rng.choice(
                [
                    item(long_text),
                    _wrap(task, ["x"] * (max_items + 1) if task == "score" else long_text * 3),
                    _wrap(task, [] if task == "score" else ""),
                ]
            )
        ).encode(),
        "wrong fields": lambda: json.dumps(
            rng.choice(
                [
                    {other: good},
                    {field: good, "extra": 1},
                    {},
                    {"x" * 1000: 1},
                    [good],
                    good,
                    {"\ud800": 1},
                    {field: good, "\udc80 lone surrogate": 1},
                ]
            )
        ).encode(),
        "wrong content type": lambda: b"texts=hello",
        "double-encoded": lambda: json.dumps(good_body.decode()).encode(),
        "encoded body": lambda: gzip.compress(good_body),
        "long field names": lambda: json.dumps(
            {"k" * rng.randint(1000, 20000) + str(i): 1 for i in range(rng.randint(1, 50))}
        ).encode(),
    }
    types = {"wrong content type": "application/x-www-form-urlencoded"}
    kinds = sorted(makers)
    out = [Probe(b'{"%s": ["' % field.encode() + b"a" * TEN_MB + b'"]}', "10 MB body") for _ in range(ten_mb // 2)]
    out += [Probe(b"[" * TEN_MB, "10 MB body") for _ in range(ten_mb - ten_mb // 2)]
    name = (limit - 4096) // 6  # six names: echoing five would exceed TorchServe's largest reply
    for i in range(near_limit):
        if i % 2:
            out.append(
                Probe(
                    b"&".join(b"f%d" % j + b"x" * name + b"=1" for j in range(6)),
                    "near the size limit",
                    "application/x-www-form-urlencoded",
                )
            )
        else:
            out.append(Probe(json.dumps({f"{j}" + "x" * name: 1 for j in range(6)}).encode(), "near the size limit"))
    while len(out) < n:
        kind = kinds[len(out) % len(kinds)]
        out.append(Probe(makers[kind](), kind, types.get(kind, JSON), "gzip" if kind == "encoded body" else None))
    return out


class Tolerance(NamedTuple):
    """How far an answer may be from the same request's answer alone (it may share a graph call
    with others): a probability (score), a shared candidate's score (beam), and the least share of
    candidates in common (beam), in the same order or not. Default: exact to 1e-5, the same
    candidates in the same order (fp32 on CPU: a batched call agrees to 1e-6). For a package,
    of_precision: what its build allows compiled against eager, because a batched call lands in
    another CUDA-graph bucket, whose GEMMs may round differently in bf16."""

    score: float = 1e-5
    beam_score: float = 1e-5
    min_shared: float = 1.0
    same_order: bool = True

    @classmethod
    def of_precision(cls, precision: str) -> "Tolerance":
        from slm_core.tasks import BeamTask, LabelsTask

        return cls(
            LabelsTask.tolerance[precision],
            BeamTask.tolerance[precision],
            BeamTask.min_shared[precision],
            same_order=False,
        )


def difference(a: dict, b: dict) -> tuple[float, float]:
    """(largest |difference| of a probability, or of a shared candidate's score; the share of a's
    candidates that b also returns, 1.0 for score). Different shapes: (inf, 0.0)."""
    if "scores" in a:
        if a["labels"] != b.get("labels") or [len(r) for r in a["scores"]] != [len(r) for r in b.get("scores", [])]:
            return math.inf, 0.0
        return max((abs(x - y) for r, t in zip(a["scores"], b["scores"]) for x, y in zip(r, t)), default=0.0), 1.0
    theirs = {tuple(c["token_ids"]): c["score"] for c in b.get("candidates", [])}
    shared = [
        abs(c["score"] - theirs[tuple(c["token_ids"])]) for c in a["candidates"] if tuple(c["token_ids"]) in theirs
    ]
    return max(shared, default=0.0), len(shared) / max(1, len(a["candidates"]))


def judge(a: dict, b: dict, tolerance: Tolerance) -> tuple[bool, float, float]:
    """(b within `tolerance` of a, and difference(a, b))."""
    worst, shared = difference(a, b)
    if "scores" in a:
        return worst <= tolerance.score, worst, shared
    ordered = not tolerance.same_order or [c["token_ids"] for c in a["candidates"]] == [
        c["token_ids"] for c in b.get("candidates", [])
    ]
    return ordered and worst <= tolerance.beam_score and shared >= tolerance.min_shared, worst, shared


def run(
    url: str,
    management: str,
    model: str,
    bad: list[Probe],
    valid: list[Probe],
    threads: int = 4,
    timeout: float = 60.0,
    tolerance: Tolerance = Tolerance(),
) -> dict:
    """Send `valid` alone, twice over (their reference answers, and whether the same request alone
    gets the same bytes again, from the same worker or another), then all of bad + valid shuffled
    together from `threads` threads. Returns the figures (for the valid ones: how many answered the
    same bytes as alone, the largest difference from alone and the least share of beam candidates
    in common) and every failure found: a repeat alone not byte-identical, a bad request without
    its 4xx JSON error, a valid one not answered 200 within `tolerance` of its answer alone."""
    pids = worker_pids(management, model)
    reference, alone, failures = {}, {}, []
    repeats, other_worker, workers = 0, 0, set()
    for attempt in range(2):
        for p in valid:
            got: dict = {}
            status, body = http("POST", url, p.body, {"Content-Type": JSON}, timeout, got)
            worker = got.get("x-slm-worker")  # the handler's pid
            if status != 200:
                raise RuntimeError(f"a valid request alone got {status}: {body[:200]!r}")
            workers.add(worker)
            if attempt == 0:
                reference[p.body], alone[p.body] = json.loads(body), (body, worker)
                continue
            repeats += 1
            other_worker += worker != alone[p.body][1]
            if body != alone[p.body][0]:
                failures.append(
                    {
                        "kind": "valid alone, again",
                        "status": status,
                        "workers": [alone[p.body][1], worker],
                        "body": p.body[:120].decode("utf-8", "replace"),
                        "answer": body[:300].decode("utf-8", "replace"),
                    }
                )
    alone = {k: body for k, (body, _) in alone.items()}
    probes = bad + valid
    random.Random(0).shuffle(probes)

    def send(p: Probe):
        start = time.perf_counter()
        try:
            status, body = http("POST", url, p.body, p.headers(), timeout=timeout)
        except OSError as e:  # a timeout or a dropped connection: counted as a failure
            status, body = 0, repr(e).encode()
        return p, status, body, (time.perf_counter() - start) * 1e3

    statuses, slowest = Counter(), 0.0
    identical, worst, least_shared = 0, 0.0, 1.0
    begin = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for p, status, body, ms in pool.map(send, probes):
            statuses[status] += 1
            try:
                answer = json.loads(body)
            except ValueError:
                answer = None
            if p.kind == "valid":
                ok = status == 200 and isinstance(answer, dict)
                if ok:
                    identical += body == alone[p.body]
                    ok, diff, shared = judge(reference[p.body], answer, tolerance)
                    worst, least_shared = max(worst, diff), min(least_shared, shared)
            else:
                slowest = max(slowest, ms)
                # ours: {"error": ...}, bounded, in JSON's terms; TorchServe's own: {"code", "type",
                # "message"}; its 413 is bare
                ok = status == 413 or (
                    400 <= status < 500 and isinstance(answer, dict) and ("error" in answer or "message" in answer)
                )
                if ok and "error" in answer:
                    ok = len(body) <= MAX_ERROR_BYTES and not PYTHON_WORDS.search(str(answer["error"]))
            if not ok:
                failures.append(
                    {
                        "kind": p.kind,
                        "status": status,
                        "body": p.body[:120].decode("utf-8", "replace"),
                        "answer": body[:300].decode("utf-8", "replace"),
                    }
                )
    after = worker_pids(management, model)
    return {
        "bad": len(bad),
        "valid": len(valid),
        "kinds": dict(Counter(p.kind for p in bad)),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "seconds": time.perf_counter() - begin,
        "slowest_bad_ms": slowest,
        "worker_restarts": int(after != pids),
        "valid_identical": identical,
        "valid_max_abs_diff": worst,
        "valid_min_shared": least_shared,
        "alone_repeats": repeats,
        "alone_repeats_by_another_worker": other_worker,
        "alone_workers": sorted(w for w in workers if w),
        "tolerance": tolerance._asdict(),
        "failures": failures,
    }
