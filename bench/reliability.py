"""Bad input through REST, measured: generated malformed and adversarial requests
interleaved with valid ones, sent concurrently to a running TorchServe. Every bad one must get a
4xx JSON error, every valid one its correct answer (the one it gets alone, before the run: exact to
1e-5, or with --archive within what the package's build allows compiled against eager for its
precision, judged per request, since under load a request shares a graph call whose bf16 GEMMs
may round otherwise), and no worker may restart. Each valid one is first sent alone twice: the
second answer must be byte-identical to the first, whichever worker gives it (determinism;
the handler names the worker in X-Slm-Worker).

    python -m bench.reliability --url http://127.0.0.1:8080/predictions/NAME --management \\
        http://127.0.0.1:8081 --model NAME --task score --max-items 16 --max-tokens 160 --bad 1000

Overload and soak (open loop: requests arrive at a fixed rate whatever the answers, as from
many independent clients, sent by several generator processes that take turns in one schedule),
against a running model or a private TorchServe on one archive:

    python -m bench.reliability overload --archive NAME.mar --task score --seconds 60 [--capacity R]
    python -m bench.reliability soak --archive NAME.mar --task score --seconds 600 [--capacity R]
    python -m bench.reliability fuzz,overload --archive NAME.mar --workers 2 --task beam --max-tokens 512 \
        --workload W2 --tokenizer bench/assets/tokenizer.json   # the H200: W2's requests, 2 workers

Several steps, comma-separated, run on one server one after the other (--out then holds
{step: result}). --workload W1|W2|W3 makes overload's and soak's valid requests that
workload's (bench.workloads) instead of the short multilingual ones.

overload offers 0.8x capacity for 10 s, factor (3) x capacity for --seconds, then 0.8x for 10 s
(with --deadline-ms, each request carrying that deadline: refusals are counted for a full queue
and for the deadline, and the answers that came after it);
soak offers 0.8x capacity for --seconds and reports each window. Both sample the workers' host
memory (and GPU memory where nvidia-smi runs) every second.
kill and gpu-fault offer 0.8x capacity for --fault-seconds and, 5 s in, kill -9 one worker or run
bench.gpu_fault beside the workers (an illegal memory access on the GPU): the requests lost, and
when a new worker answers.
Without --capacity, it is measured first (bench.loadgen sweep: the highest closed-loop QPS within
the SLO).

tests/e2e/test_serving.py runs the bad-input part against the CPU test archives in CI.
"""

import argparse
import asyncio
import concurrent.futures
import gzip
import json
import math
import multiprocessing
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from bench.loadgen import percentile
from handlers.local_server import TorchServe, http

JSON = "application/json"
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


def worker_pids(management: str, model: str) -> list[str]:
    """The process ids of a model's workers, sorted (TorchServe's describe-model API)."""
    return sorted(str(w["pid"]) for w in json.loads(http("GET", f"{management}/models/{model}")[1])[0]["workers"])


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


class Record(NamedTuple):
    sent: float  # when it was due, s from the loop's start
    ms: float  # latency, from its actual send
    status: int  # 0: a timeout or a broken connection
    worker: str  # the worker that answered (X-Slm-Worker), "" where none did
    lag_ms: float  # how late the generator sent it: a client-side delay no server figure holds


def open_loop(
    url: str,
    bodies: list[bytes],
    phases: list[tuple[float, float]],
    timeout: float = 30.0,
    deadline_ms: float | None = None,
    processes: int | None = None,
    on_start=None,
    on_records=None,
    report_s: float = 30.0,
) -> list[Record]:
    """Requests at each phase's (rate per second, seconds), one phase after the other, each sent on
    schedule whatever the others are doing (open loop; no client-side limit on connections), from
    `processes` generator processes that take turns in the schedule (default: one per
    RATE_PER_PROCESS req/s of the fastest phase, at most the cores but two), so that one event
    loop's own delays neither hold requests back nor count as server time. With deadline_ms, each
    request carries it (X-Slm-Deadline-Ms) and its send time as a proxy stamps it
    (X-Request-Start). on_start() runs in this process as the schedule starts; on_records(records,
    until) with the answers so far (unsorted), about every `report_s` seconds: every request
    answered before `until` (s into the schedule) is among them (a long run cut short keeps them)."""
    due, begin = [], 0.0
    for rate, seconds in phases:
        due += [begin + i / rate for i in range(math.ceil(rate * seconds - 1e-9))]
        begin += seconds
    fastest = max(rate for rate, _ in phases)
    processes = processes or max(1, min(math.ceil(fastest / RATE_PER_PROCESS), (os.cpu_count() or 1) - 2))
    ctx = multiprocessing.get_context("spawn")  # no fork of this process's threads (Memory's, a fault timer)
    ready, results = ctx.Barrier(processes + 1), ctx.Queue()
    parts = [
        ctx.Process(
            target=_open_loop_part,
            daemon=True,
            args=(url, bodies, due[k::processes], k, processes, timeout, deadline_ms, report_s, ready, results),
        )
        for k in range(processes)
    ]
    for part in parts:
        part.start()
    ready.wait(STARTUP_S)  # every generator started: the schedule starts now, in all at once
    if on_start:
        on_start()
    # read before join: a process does not exit while its records wait in a full pipe
    out: list[Record] = []
    clocks = [0.0] * processes  # per generator: the schedule's time at its last hand-over
    while min(clocks) < math.inf:
        part, clock, chunk = results.get(timeout=begin + timeout + STARTUP_S)
        clocks[part] = clock
        out += chunk
        if on_records:
            on_records(out, min(clocks))
    for part in parts:
        part.join()
    return sorted(out)


RATE_PER_PROCESS = 150  # req/s one aiohttp event loop sends on schedule, with room (bench/RESULTS.md)
STARTUP_S = 60.0  # a generator process not ready by then has failed


def _open_loop_part(
    url: str,
    bodies: list[bytes],
    due: list[float],
    part: int,
    parts: int,
    timeout: float,
    deadline_ms: float | None,
    report_s: float,
    ready,
    results,
) -> None:
    """open_loop's generator `part` of `parts`: the requests due at `due` (s from the start),
    request i of the schedule at due[i // parts] with body i. Its answers go to `results` in chunks,
    about every `report_s` seconds, as (part, the schedule's time then, answers); inf at the end."""
    import aiohttp

    async def go():
        nonlocal start
        out: list[Record] = []
        handed = [time.perf_counter()]

        def hand_over(end: bool = False) -> None:
            handed[0] = time.perf_counter()
            results.put((part, math.inf if end else handed[0] - start, out[:]))
            out.clear()

        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session:

            async def one(body: bytes, at: float, scheduled: float):
                sent = time.perf_counter()
                headers = {"Content-Type": JSON}
                if deadline_ms is not None:
                    headers.update({"X-Slm-Deadline-Ms": f"{deadline_ms:g}", "X-Request-Start": f"t={time.time():.6f}"})
                worker = ""
                try:
                    async with session.post(url, data=body, headers=headers) as r:
                        await r.read()
                        status, worker = r.status, r.headers.get("X-Slm-Worker", "")
                except (TimeoutError, aiohttp.ClientError):
                    status = 0
                out.append(Record(at, (time.perf_counter() - sent) * 1e3, status, worker, (sent - scheduled) * 1e3))
                if time.perf_counter() - handed[0] > report_s:
                    hand_over()

            await asyncio.get_running_loop().run_in_executor(None, ready.wait, STARTUP_S)
            # Only the requests in flight are held: finished tasks kept to the end would make each
            # full garbage collection walk them all, a pause that grows with the run (77 ms at 90,000
            # requests), in which nothing is sent.
            start, pending = time.perf_counter(), set()
            for j, at in enumerate(due):
                delay = start + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                body = bodies[(j * parts + part) % len(bodies)]
                task = asyncio.ensure_future(one(body, at, start + at))
                pending.add(task)
                task.add_done_callback(pending.discard)
            await asyncio.gather(*pending)
        hand_over(end=True)

    start = time.perf_counter()
    asyncio.run(go())


class Memory:
    """Samples, every second in a thread, the host RSS (MiB) of a model's workers and, where
    nvidia-smi runs, the GPU memory they use (MiB): series of (seconds since start, rss, gpu)."""

    def __init__(self, management: str, model: str):
        self.management, self.model = management, model
        self.samples: list[tuple[float, float, float | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self.start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            pids = worker_pids(self.management, self.model)
            rss = 0.0
            for pid in pids:
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                    rss += int(next(s for s in status.splitlines() if s.startswith("VmRSS")).split()[1]) / 1024
                except (OSError, StopIteration):
                    pass
            self.samples.append((time.perf_counter() - self.start, rss, _gpu_mib(pids)))

    def between(self, t0: float, t1: float) -> dict:
        window = [s for s in self.samples if t0 <= s[0] <= t1]
        if not window:
            return {}
        out = {"rss_mib_first": window[0][1], "rss_mib_last": window[-1][1], "rss_mib_max": max(s[1] for s in window)}
        if window[0][2] is not None:
            out.update(gpu_mib_first=window[0][2], gpu_mib_last=window[-1][2])
        return out


def _gpu_mib(pids: list[str]) -> float | None:
    try:
        text = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return sum(
        float(m) for p, m in (line.split(",") for line in text.strip().splitlines() if "," in line) if p.strip() in pids
    )


def summary(records: list[Record], seconds: float, deadline_ms: float | None = None) -> dict:
    """Offered and answered rates, admitted (200) latency, refused (429/503: a full queue; 504:
    a deadline) latency, the rest; with deadline_ms, the answers that came after it."""
    ok = sorted(r.ms for r in records if r.status == 200)
    refused = sorted(r.ms for r in records if r.status in (429, 503, 504))
    lag = sorted(r.lag_ms for r in records)

    def pct(values, q):
        return percentile(values, q) if values else None

    return {
        "offered_per_s": len(records) / seconds,
        "answered_per_s": len(ok) / seconds,
        "admitted_mean_ms": statistics.fmean(ok) if ok else None,
        "admitted_p50_ms": pct(ok, 50),
        "admitted_p99_ms": pct(ok, 99),
        "refused": len(refused),
        "refused_p50_ms": pct(refused, 50),
        "refused_p99_ms": pct(refused, 99),
        "refused_max_ms": refused[-1] if refused else None,
        "refused_queue_full": sum(r.status in (429, 503) for r in records),
        "refused_deadline": sum(r.status == 504 for r in records),
        **({"answered_after_deadline": sum(ms > deadline_ms for ms in ok)} if deadline_ms is not None else {}),
        "other_statuses": dict(Counter(str(r.status) for r in records if r.status not in (200, 429, 503, 504))),
        "send_lag_p99_ms": pct(lag, 99),
        "send_lag_max_ms": lag[-1] if lag else None,
    }


def p99_per_second(records: list[Record], seconds: float) -> list[float | None]:
    """The admitted P99 of the requests sent in each whole second."""
    return [summary([r for r in records if k <= r.sent < k + 1], 1)["admitted_p99_ms"] for k in range(int(seconds))]


def overload(
    url: str,
    management: str,
    model: str,
    bodies: list[bytes],
    capacity: float,
    seconds: float,
    factor: float = 3.0,
    settle: float = 10.0,
    deadline_ms: float | None = None,
) -> dict:
    """0.8x capacity for `settle` s, factor x capacity for `seconds`, 0.8x again for `settle` s
    (recovery: also per second), one schedule without a pause between them, with the workers'
    memory over each phase; with deadline_ms, every request carries that deadline."""
    phases = [("before", 0.8, settle), ("burst", factor, seconds), ("after", 0.8, settle)]
    result: dict = {"capacity": capacity, "factor": factor, "deadline_ms": deadline_ms}
    started: list[float] = []
    with Memory(management, model) as memory:
        records = open_loop(
            url,
            bodies,
            [(x * capacity, secs) for _, x, secs in phases],
            deadline_ms=deadline_ms,
            on_start=lambda: started.append(time.perf_counter() - memory.start),
        )
    begin = 0.0
    for name, _, secs in phases:
        mine = [r._replace(sent=r.sent - begin) for r in records if begin <= r.sent < begin + secs]
        t0 = started[0] + begin
        result[name] = {**summary(mine, secs, deadline_ms), **memory.between(t0, t0 + secs)}
        if name == "after":
            result[name]["p99_ms_per_second"] = p99_per_second(mine, secs)
        begin += secs
    return result


def soak(
    url: str,
    management: str,
    model: str,
    bodies: list[bytes],
    capacity: float,
    seconds: float,
    window: float = 60.0,
    on_window=None,
    timeout: float = 30.0,
) -> dict:
    """0.8x capacity for `seconds`, reported per window of `window` seconds: latency and memory;
    and the workers' pids before and after (a restarted worker has a new one). on_window(report)
    gets the report so far each time a window's requests have all been answered."""
    before = worker_pids(management, model)
    started: list[float] = []
    windows: list[dict] = []

    def report(records: list[Record], until: float = math.inf) -> dict:
        while len(windows) < int(seconds // window):
            k = len(windows)
            if until < (k + 1) * window + timeout:  # a request of the window may still be answered
                break
            windows.append(
                {
                    "from_s": k * window,
                    **summary([r for r in records if k * window <= r.sent < (k + 1) * window], window),
                    **memory.between(started[0] + k * window, started[0] + (k + 1) * window),
                }
            )
        return {
            "capacity": capacity,
            "rate": 0.8 * capacity,
            "seconds": seconds,
            "windows": windows[:],
            "workers_before": before,
        }

    def progress(records: list[Record], until: float) -> None:
        done = len(windows)
        now = report(records, until)
        if on_window and len(windows) > done:
            on_window(now)

    with Memory(management, model) as memory:
        records = open_loop(
            url,
            bodies,
            [(0.8 * capacity, seconds)],
            timeout=timeout,
            on_start=lambda: started.append(time.perf_counter() - memory.start),
            on_records=progress,
            report_s=min(30.0, window / 2),
        )
    return {**report(records), "workers_after": worker_pids(management, model)}


def fault(
    url: str,
    management: str,
    model: str,
    bodies: list[bytes],
    capacity: float,
    inject,
    seconds: float,
    lead: float = 5.0,
) -> dict:
    """0.8x capacity for `seconds`; `lead` s in, inject() (a thread: kill a worker, or fault the GPU
    beside the workers) returns what it did. Counts what failed, split into the requests sent
    before the fault (in flight at it) and after it; when the first request answered by a new
    worker came back and when the last failure did (s from the fault); statuses and P99 per
    second; the workers before and after."""
    before = worker_pids(management, model)
    report: dict = {}
    timer = threading.Timer(lead, lambda: report.update(inject(before)))
    started: list[float] = []
    records = open_loop(
        url, bodies, [(0.8 * capacity, seconds)], on_start=lambda: (started.append(time.time()), timer.start())
    )
    timer.join()
    at = report.pop("at") - started[0]  # the fault, in the open loop's seconds
    failed = [(r.sent - at, r.ms, r.status) for r in records if r.status != 200]
    new = [
        r.sent + r.ms / 1e3 - at
        for r in records
        if r.status == 200 and r.worker and r.worker not in before and r.sent >= at
    ]
    return {
        "capacity": capacity,
        "rate": 0.8 * capacity,
        "seconds": seconds,
        "fault_at_s": at,
        **report,
        "workers_before": before,
        "workers_after": worker_pids(management, model),
        "requests": len(records),
        "failed": len(failed),
        "failed_in_flight": sum(t < 0 for t, _, _ in failed),
        "failed_after": sum(t >= 0 for t, _, _ in failed),
        "failed_statuses": dict(Counter(str(s) for _, _, s in failed)),
        "last_failure_answered_s": max((t + ms / 1e3 for t, ms, _ in failed), default=None),
        "first_answer_by_a_new_worker_s": min(new, default=None),
        "statuses_per_second": [
            dict(Counter(str(r.status) for r in records if k <= r.sent < k + 1)) for k in range(int(seconds))
        ],
        "p99_ms_per_second": p99_per_second(records, seconds),
    }


def kill_worker(workers: list[str]) -> dict:
    """kill -9 of the first worker."""
    at = time.time()
    os.kill(int(workers[0]), signal.SIGKILL)
    return {"at": at, "killed": workers[0]}


def gpu_fault(workers: list[str]) -> dict:
    """A process beside the workers that makes an illegal memory access on the GPU
    (bench.gpu_fault), with the MPS server's processes before and after it."""
    servers = _mps_servers()
    run = subprocess.run([sys.executable, "-m", "bench.gpu_fault"], capture_output=True, text=True, timeout=120)
    said = (run.stdout + run.stderr).strip()
    launched = re.search(r"launched at ([0-9.]+)", said)  # the bad kernel's launch, by this host's clock
    time.sleep(1.0)
    return {
        "at": float(launched.group(1)) if launched else time.time(),
        "fault_exit": run.returncode,
        "fault_said": said[-600:],
        "mps_servers_before": servers,
        "mps_servers_after": _mps_servers(),
    }


def _mps_servers() -> list[str]:
    """The pids of NVIDIA MPS servers running on this host."""
    out = subprocess.run(["pgrep", "-f", "nvidia-cuda-mps-server"], capture_output=True, text=True).stdout
    return sorted(out.split())


FAULTS = {"kill": kill_worker, "gpu-fault": gpu_fault}


def measured_capacity(url: str, bodies: list[bytes]) -> float:
    from bench.loadgen import sweep

    points = sweep(url, bodies, [1, 2, 3, 4, 6, 8], warmup=1.0, duration=3.0)
    return max((p.qps for p in points if p.meets_slo()), default=0.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "steps", help="fuzz, overload, soak, kill or gpu-fault; several comma-separated run one after the other"
    )
    p.add_argument("--url", help="the model's predictions URL (a running TorchServe)")
    p.add_argument("--management", help="TorchServe's management address")
    p.add_argument("--model")
    p.add_argument("--archive", type=Path, help="instead of --url: serve this .mar on a private TorchServe")
    p.add_argument("--workers", type=int, help="with --archive: its workers (default: its model-config's)")
    p.add_argument("--workload", choices=["W1", "W2", "W3"], help="overload/soak: that workload's requests")
    p.add_argument("--tokenizer", type=Path, help="with --workload: the tokenizer its texts are made for")
    p.add_argument("--logs", type=Path, help="with --archive: copy the private TorchServe's logs here at the end")
    p.add_argument("--task", choices=["score", "beam"], required=True)
    p.add_argument("--max-items", type=int, default=16, help="the task's max_texts (score)")
    p.add_argument("--max-tokens", type=int, default=160, help="the task's max_text_tokens / max_prompt_tokens")
    p.add_argument("--bad", type=int, default=1000)
    p.add_argument("--valid", type=int, default=200)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--capacity", type=float, help="req/s at the SLO (default: measured first)")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument(
        "--deadline-ms",
        type=float,
        help="overload: every request carries this deadline (X-Slm-Deadline-Ms, "
        "its send time as X-Request-Start); the result counts refusals by reason and answers after it",
    )
    p.add_argument(
        "--fault-seconds", type=float, default=60.0, help="kill, gpu-fault: the load's seconds (the fault 5 s in)"
    )
    p.add_argument("--out", type=Path, help="also write the JSON result here")
    args = p.parse_args()
    steps = args.steps.split(",")
    if not steps or not set(steps) <= {"fuzz", "overload", "soak", *FAULTS}:
        p.error(f"steps {args.steps!r}: each one of fuzz, overload, soak, {', '.join(FAULTS)}")
    if args.workload and not args.tokenizer:
        p.error("--workload needs --tokenizer")
    server, results, tolerance = None, {}, Tolerance()
    if args.archive:  # the deployment the archive's serving spec makes, and its precision
        from archiver.build import read_manifest, read_serving  # imports torch: only with --archive

        serving, manifest = read_serving(args.archive), read_manifest(args.archive)
        precision = manifest["task"]["precision"]
        args.workers = args.workers or serving.workers
        results["served"] = {
            "workers": args.workers,
            "batchSize": serving.batch,
            "queue": serving.queue,
            "precision": precision,
        }
        tolerance = Tolerance.of_precision(precision)
        server = TorchServe(Path(tempfile.mkdtemp(prefix="reliability-")), args.archive.parent).start()
        args.model = args.archive.stem
        args.url, args.management = f"{server.inference}/predictions/{args.model}", server.management
    try:
        if server:
            server.register(args.archive.name, args.workers, name=args.model)
        rng = random.Random(1)
        valid = valid_requests(args.task, args.max_items, rng, args.valid)
        bodies = [v.body for v in valid]
        if args.workload:
            from tokenizers import Tokenizer

            from bench.workloads import WORKLOADS, TextMaker

            maker = TextMaker(Tokenizer.from_file(str(args.tokenizer)), seed=2)
            bodies = [json.dumps(b).encode() for b in maker.requests(WORKLOADS[args.workload], args.valid)]
        capacity = args.capacity
        for name in steps:
            print(f"[reliability {time.strftime('%H:%M:%S')}] {name}", flush=True)
            if name == "fuzz":
                results[name] = run(
                    args.url,
                    args.management,
                    args.model,
                    bad_requests(args.task, args.max_items, args.max_tokens, rng, args.bad),
                    valid,
                    args.threads,
                    tolerance=tolerance,
                )
                continue
            capacity = capacity or measured_capacity(args.url, bodies)
            if not capacity:
                raise SystemExit("no concurrency met the SLO (mean < 20 ms, P99 < 80 ms): pass --capacity R")
            if name == "overload":
                results[name] = overload(
                    args.url, args.management, args.model, bodies, capacity, args.seconds, deadline_ms=args.deadline_ms
                )
            elif name in FAULTS:
                results[name] = fault(
                    args.url, args.management, args.model, bodies, capacity, FAULTS[name], args.fault_seconds
                )
            else:

                def partial(report: dict, name=name) -> None:  # a run cut short keeps the minutes it finished
                    if args.out:
                        args.out.write_text(json.dumps({**results, name: report}, indent=1, ensure_ascii=False) + "\n")

                results[name] = soak(
                    args.url, args.management, args.model, bodies, capacity, args.seconds, on_window=partial
                )
            if args.out:  # after every step: a run cut short keeps the steps it finished
                args.out.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    finally:
        if server:
            server.stop()
            if args.logs:  # what the workers said (a worker that died, a 503's reason)
                shutil.copytree(server.workdir / "logs", args.logs, dirs_exist_ok=True)
    result = results[steps[0]] if len(results) == 1 else results
    text = json.dumps(result, indent=1, ensure_ascii=False)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
