"""End to end through a real TorchServe: register both archives, scale, answers equal to the
engine, metrics, and bad requests answered with 4xx JSON without hurting the workers."""

import json
import os
import re
import signal
import threading
import time

import pytest

from handlers.local_server import TorchServe, http
from slm_core import Engine
from slm_core.serve.loader import load_package
from slm_core.serve.protocol import Request, respond

pytestmark = pytest.mark.rates  # overload, soak, kill and scale-up under load


def copy_archive(src, dst, member: str, edit) -> None:
    """A copy of the archive src at dst, with edit(bytes) -> bytes applied to one member."""
    import zipfile

    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            zout.writestr(item, edit(data) if item.filename == member else data)


@pytest.fixture(scope="module")
def server(archives, tmp_path_factory):
    ts = TorchServe(tmp_path_factory.mktemp("torchserve"), archives["store"]).start()
    try:
        ts.register("tiny_score.mar")
        ts.register("tiny_beam.mar")
        yield ts
    finally:
        ts.stop()


def test_answers_equal_the_engine_and_repeat_byte_identical(server, archives):
    score_engine, beam_engine = Engine.from_package(archives["tiny_score"]), Engine.from_package(archives["tiny_beam"])
    texts = ["search engines rank documents", "a", "the lazy dog"]
    status, body = server.predict("tiny_score", json.dumps({"texts": texts}).encode())
    assert status == 200
    answer = json.loads(body)
    assert answer["labels"] == ["yes", "no"]
    for row, ref in zip(answer["scores"], score_engine.score(texts)):
        assert row == pytest.approx(ref, abs=1e-6)
    assert server.predict("tiny_score", json.dumps({"texts": texts}).encode()) == (200, body)
    # byte-identical across processes too: this test's own engine answers the same bytes
    assert respond(score_engine, Request({"body": json.dumps({"texts": texts}).encode()})).body == body

    status, body = server.predict("tiny_beam", b'{"prompt": "a small language model"}')
    assert status == 200
    candidates = json.loads(body)["candidates"]
    ref = beam_engine.beam("a small language model")
    assert [c["token_ids"] for c in candidates] == [c["token_ids"] for c in ref]
    assert [c["text"] for c in candidates] == [c["text"] for c in ref]
    assert [c["score"] for c in candidates] == pytest.approx([c["score"] for c in ref], abs=1e-6)
    assert server.predict("tiny_beam", b'{"prompt": "a small language model"}') == (200, body)
    assert respond(beam_engine, Request({"body": b'{"prompt": "a small language model"}'})).body == body


def test_scale_to_two_workers_both_answer(server, archives):
    status, body = http("PUT", f"{server.management}/models/tiny_score?min_worker=2&synchronous=true")
    assert status == 200, body
    workers = server.workers("tiny_score")
    assert len(workers) == 2 and all(w["status"] == "READY" for w in workers)
    assert len({w["pid"] for w in workers}) == 2

    engine = Engine.from_package(archives["tiny_score"])
    requests = [[f"query number {i}", "search"] for i in range(24)]
    results: dict[int, tuple] = {}

    def send(i):
        results[i] = server.predict("tiny_score", json.dumps({"texts": requests[i]}).encode())

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, texts in enumerate(requests):
        status, body = results[i]
        assert status == 200
        for row, ref in zip(json.loads(body)["scores"], engine.score(texts)):
            assert row == pytest.approx(ref, abs=1e-6)
    # Each worker logs the requests it served under its own thread name, W-<port>-<model>.
    log = (server.workdir / "logs" / "ts_log.log").read_text()
    served = set(re.findall(r"(W-\d+-tiny_score)_1\.0 \S+ - Backend response time", log))
    assert len(served) == 2, served
    # one request sent alone, again and again, to whichever worker is free: the same bytes each
    # time, those of this test's own engine (deterministic across workers)
    body = json.dumps({"texts": requests[0]}).encode()
    answers = {server.predict("tiny_score", body) for _ in range(12)}
    assert answers == {(200, respond(engine, Request({"body": body})).body)}, answers
    # The archive batches up to 3 queued requests into one graph call (max_batch: 3), as the
    # handler's histogram of requests per call shows: more requests than calls.
    text = http("GET", f"{server.metrics}/metrics")[1].decode()
    calls = re.findall(r'SlmRequestsPerCall_count\{[^}]*ModelName="tiny_score"[^}]*\} (\S+)', text)
    served = re.findall(r'SlmRequestsPerCall_sum\{[^}]*ModelName="tiny_score"[^}]*\} (\S+)', text)
    assert calls and served and float(served[0]) > float(calls[0]), (calls, served)


def scrape(server, name: str, model: str, **labels) -> dict[str, float]:
    """The samples of one metric for one model (None: any) with these labels: {"NAME_bucket{le=X}" or
    "NAME_count" ...: value}."""
    text = http("GET", f"{server.metrics}/metrics")[1].decode()
    out = {}
    for sample, tags, value in re.findall(rf"^({name}(?:_bucket|_count|_sum)?)\{{([^}}]*)\}} (\S+)$", text, re.M):
        tags = dict(re.findall(r'(\w+)="([^"]*)"', tags))
        if (model is None or tags.get("ModelName") == model) and all(tags.get(k) == v for k, v in labels.items()):
            out[sample + (f"{{le={tags['le']}}}" if "le" in tags else "")] = float(value)
    return out


def test_metrics_an_operator_alerts_on(server):
    """Scraped from TorchServe's Prometheus endpoint: each graph call's seconds and requests as
    histograms (one observation per call), the handler's refusals by status, and TorchServe's
    own queue wait as a histogram (metrics.yaml)."""
    before = scrape(server, "SlmGraphCallSeconds", "tiny_beam")
    refused = scrape(server, "SlmRefused", "tiny_beam", Status="400").get("SlmRefused", 0.0)
    queued = scrape(server, "QueueTime", None).get("QueueTime_count", 0.0)
    for _ in range(3):
        assert server.predict("tiny_beam", b'{"prompt": "search"}')[0] == 200
    assert server.predict("tiny_beam", b'{"prompt": 7}')[0] == 400
    seconds = scrape(server, "SlmGraphCallSeconds", "tiny_beam")
    assert seconds["SlmGraphCallSeconds_count"] - before.get("SlmGraphCallSeconds_count", 0) == 3  # sent one by one
    assert 0 < seconds["SlmGraphCallSeconds_sum"] - before.get("SlmGraphCallSeconds_sum", 0) < 60
    assert seconds["SlmGraphCallSeconds_bucket{le=+Inf}"] == seconds["SlmGraphCallSeconds_count"]
    assert scrape(server, "SlmRequestsPerCall", "tiny_beam")["SlmRequestsPerCall_count"] >= 3
    assert scrape(server, "SlmRefused", "tiny_beam", Status="400")["SlmRefused"] == refused + 1
    assert scrape(server, "QueueTime", None)["QueueTime_count"] >= queued + 4  # every request, the refused one too
    for name in ("SlmTexts", "SlmTokens"):
        assert scrape(server, name, "tiny_beam"), name


BAD = [
    (b"this is not json", "not valid JSON"),
    (b'{"texts": ["a"', "not valid JSON"),  # truncated body
    (b'{"prompt": "a"}', "missing the field 'texts'"),
    (b'{"texts": ["a"], "extra": 1}', 'unknown fields "extra"'),
    (b'{"texts": "a"}', "must be an array of strings, got a string"),
    (b'{"texts": {"a": 1}}', "must be an array of strings, got an object"),
    (b'{"texts": [null]}', "texts[0] must be a string, got null"),
    (json.dumps(json.dumps({"texts": ["a"]})).encode(), 'must be a JSON object like {"texts": ...}, got a string'),
    (b'{"texts": [1, 2]}', "texts[0] must be a string"),
    (b'{"texts": []}', "'texts' is empty"),
    (b'{"texts": [""]}', "texts[0] is empty"),
    (b'{"texts": ["a", "b", "c", "d", "e", "f", "g", "h", "i"]}', "max_texts=8"),
    (json.dumps({"texts": ["word " * 200]}).encode(), "max_text_tokens=64"),
    (b'{"texts": ["\xff\xfe"]}', "not valid UTF-8"),
    (b"[" * 100000 + b"]" * 100000, "nests arrays or objects too deeply"),
    (b'{"texts": [' + b"1" * 5000 + b"]}", "a number of more than 32 digits"),
    (b'{"texts": [' + b"1" * 40 + b"]}", "a number of 40 digits (at most 32)"),
    (b'{"texts": [NaN]}', "holds NaN, which is not JSON"),
    (b"[1, 2, 3]", "must be a JSON object"),
    (b'{"texts": ["' + b"a" * (10 * 1024 * 1024) + b'"]}', "characters, more than max_text_tokens=64"),
    (b'{"texts": ["ok", "lone \\ud800"]}', "texts[1] is not valid Unicode: a lone surrogate \\ud800"),
]


def test_bad_requests_get_4xx_json_and_hurt_nobody(server):
    pids = sorted(w["pid"] for w in server.workers("tiny_score"))
    for body, message in BAD:
        status, answer = server.predict("tiny_score", body)
        assert 400 <= status < 500, (body[:60], status, answer[:200])
        assert message in json.loads(answer)["error"], (body[:60], answer[:300])
    status, answer = server.predict("tiny_score", b"text=hello", "application/x-www-form-urlencoded")
    assert status == 400 and "expected a JSON body" in json.loads(answer)["error"]
    status, answer = server.predict("tiny_beam", b'{"prompt": 7}')
    assert status == 400 and "prompt must be a string" in json.loads(answer)["error"]
    assert sorted(w["pid"] for w in server.workers("tiny_score")) == pids
    assert server.predict("tiny_score", b'{"texts": ["still fine"]}')[0] == 200


def test_a_thousand_bad_requests_among_valid_ones_hurt_nobody(server):
    """bench.reliability: 1,000 generated bad score requests and 300 bad beam requests
    of every kind (invalid, truncated and empty bodies, wrong types, huge numbers, deep nesting,
    invalid Unicode and raw control characters, blank and over-bound texts, wrong fields and
    content types, 10 MB bodies) shuffled among valid ones with emoji, right-to-left, zero-width
    and escaped control characters, 4 at a time: every bad one gets a 4xx JSON error, every valid
    one the answer it gets alone, and no worker restarts."""
    import random

    from bench.reliability.fuzz import bad_requests, run, valid_requests

    for model, task, items, n_bad, n_valid in (
        ("tiny_score", "score", 8, 1000, 100),
        ("tiny_beam", "beam", 1, 300, 50),
    ):
        rng = random.Random(7)
        bad = bad_requests(task, items, 64, rng, n_bad)
        result = run(
            f"{server.inference}/predictions/{model}",
            server.management,
            model,
            bad,
            valid_requests(task, items, rng, n_valid),
        )
        print(f"\n{model}: {json.dumps({k: v for k, v in result.items() if k != 'failures'})}")
        assert result["failures"] == [], result["failures"][:5]
        assert result["worker_restarts"] == 0 and result["bad"] == n_bad and len(result["kinds"]) == 17
        assert (
            result["alone_repeats"] == n_valid and result["alone_workers"]
        )  # each repeat alone: same bytes; the handler names its worker
        assert sum(v for k, v in result["statuses"].items() if k.startswith("4")) == n_bad


def test_broken_archives_fail_to_register_with_the_reason_logged_and_no_crash_loop(server, archives):
    """A corrupt, a truncated and two incompatible copies of tiny_score (built for another torch
    version, for CUDA): a synchronous registration fails within seconds, leaves no model behind
    whose worker would restart forever, and the worker's log names the reason; the other models
    keep serving."""
    store = archives["store"]
    source = (store / "tiny_score.mar").read_bytes()
    (store / "broken_corrupt.mar").write_bytes(bytes(range(256)) * 400)
    (store / "broken_truncated.mar").write_bytes(source[: len(source) // 2])
    reasons = {
        "broken_corrupt": None,
        "broken_truncated": None,
        "broken_torch": "package was built with torch 1.0.0",
        "broken_device": "package was built for cuda",
    }
    for name, change in (("broken_torch", {"versions": {"torch": "1.0.0"}}), ("broken_device", {"device": "cuda"})):

        def edit(data: bytes, change=change) -> bytes:
            manifest = json.loads(data)
            manifest.update({k: {**manifest[k], **v} if isinstance(v, dict) else v for k, v in change.items()})
            return json.dumps(manifest).encode()

        copy_archive(store / "tiny_score.mar", store / f"{name}.mar", "manifest.json", edit)
    for name, reason in reasons.items():
        start = time.monotonic()
        status, body = http(
            "POST",
            f"{server.management}/models?url={name}.mar&model_name={name}&initial_workers=1&synchronous=true",
            timeout=120,
        )
        assert 400 <= status < 600 and time.monotonic() - start < 60, (name, status, body)
        assert json.loads(body)["message"], body
        registered = [m["modelName"] for m in json.loads(http("GET", f"{server.management}/models")[1])["models"]]
        assert name not in registered, registered  # nothing left to restart
        if reason:
            assert reason in (server.workdir / "logs" / "model_log.log").read_text(), name
    assert server.predict("tiny_score", b'{"texts": ["still fine"]}')[0] == 200


def test_a_worker_killed_under_load_comes_back_and_no_request_hangs(server, archives):
    """kill -9 of a worker while 3 clients send requests back to back: TorchServe starts
    a new worker; the requests in flight end with an error or their answer, none hangs; answers
    after the restart are the engine's again. Prints the time to recovery."""
    import shutil

    shutil.copy(archives["store"] / "tiny_score.mar", archives["store"] / "tiny_kill.mar")
    server.register("tiny_kill.mar", name="tiny_kill")
    url = f"{server.inference}/predictions/tiny_kill"
    texts = ["search engines rank documents for a query", "a second text"]
    expected = load_package(archives["tiny_score"], engine=Engine).score(texts)
    results: list[tuple[float, float, int, bytes]] = []
    stop = threading.Event()

    def client():
        while not stop.is_set():
            sent = time.monotonic()
            try:
                status, body = http(
                    "POST", url, json.dumps({"texts": texts}).encode(), {"Content-Type": "application/json"}, timeout=60
                )
            except OSError as e:  # a connection TorchServe dropped counts as an error, a timeout as a hang
                status, body = 0, repr(e).encode()
            results.append((sent, time.monotonic(), status, body))

    threads = [threading.Thread(target=client) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        time.sleep(1.5)
        (worker,) = server.workers("tiny_kill")
        killed = time.monotonic()
        os.kill(int(worker["pid"]), signal.SIGKILL)
        back = None
        while back is None and time.monotonic() - killed < 60:
            if any(w["status"] == "READY" and w["pid"] != worker["pid"] for w in server.workers("tiny_kill")):
                back = time.monotonic()
            time.sleep(0.1)
        assert back is not None, "no new worker within 60 s"
        time.sleep(2)
        # The killed worker's extracted package (hundreds of MB on a real model) is gone: the new
        # one removed it as it loaded. One extraction per live worker, none at TMPDIR's top.
        tmp = server.workdir / "tmp"
        live = {str(w["pid"]) for m in ("tiny_score", "tiny_beam", "tiny_kill") for w in server.workers(m)}
        extracted = {d.name.split("-")[0] for d in (tmp / f"slm-aoti-{os.getuid()}").iterdir()}
        assert extracted <= live and str(worker["pid"]) not in extracted, (extracted, live)
        assert not list(tmp.glob("aotinductor_*"))
    finally:
        stop.set()
        for t in threads:
            t.join(90)
        http("DELETE", f"{server.management}/models/tiny_kill")
    assert not any(t.is_alive() for t in threads)  # none hung
    assert all(done - sent < 60 for sent, done, _, _ in results)
    errors = [(status, body[:200]) for _, _, status, body in results if status != 200]
    assert all(status == 0 or status >= 500 for status, _ in errors), errors
    for _, _, status, body in results:
        if status == 200:
            for row, ref in zip(json.loads(body)["scores"], expected):
                assert row == pytest.approx(ref, abs=1e-6)
    after = [r for r in results if r[0] > back]
    assert after and all(status == 200 for _, _, status, _ in after), after[:3]
    first_ok = min(done for sent, done, status, _ in results if status == 200 and sent > killed)
    print(
        f"\nkill -9 under load: {len(results)} requests, {len(errors)} errors {sorted({s for s, _ in errors})}, "
        f"new worker READY after {back - killed:.1f} s, first answer after the kill at {first_ok - killed:.1f} s, "
        f"slowest request {max(d - s for s, d, _, _ in results):.1f} s"
    )


def test_overload_and_soak_short_versions(server):
    """bench.reliability's overload (open loop: 0.8x, 3x, 0.8x an assumed capacity of 30 req/s)
    and soak, a few seconds each: every request ends, with its answer or a 503, none hangs or fails
    otherwise; after the burst everything offered is answered again; the workers' memory is sampled."""
    import random

    from bench.reliability.fuzz import valid_requests
    from bench.reliability.overload import overload
    from bench.reliability.soak import soak

    url = f"{server.inference}/predictions/tiny_score"
    bodies = [p.body for p in valid_requests("score", 8, random.Random(3), 20)]
    result = overload(
        url, server.management, "tiny_score", bodies, capacity=30, seconds=3, settle=2, deadline_ms=60_000
    )
    print(f"\noverload, short: {json.dumps(result)}")
    for phase in ("before", "burst", "after"):
        assert result[phase]["other_statuses"] == {}, result[phase]
        assert result[phase]["rss_mib_last"] > 0
        # a deadline of a minute: nothing refused for it, nothing answered after it
        assert result[phase]["refused_deadline"] == 0 and result[phase]["answered_after_deadline"] == 0
    assert result["burst"]["offered_per_s"] == pytest.approx(90, rel=0.05)
    assert result["after"]["answered_per_s"] == pytest.approx(result["after"]["offered_per_s"], rel=0.1)
    result = soak(url, server.management, "tiny_score", bodies, capacity=30, seconds=4, window=2)
    assert [w["from_s"] for w in result["windows"]] == [0, 2]
    assert all(w["other_statuses"] == {} and w["answered_per_s"] > 0 for w in result["windows"]), result
    assert result["workers_after"] == result["workers_before"] and result["workers_before"]  # no restart


def test_the_kill_step_records_what_a_killed_worker_loses(server, archives):
    """bench.reliability's kill step: kill -9 of one of two workers under an open-loop load. The
    other worker answers on, every second; what fails is the killed worker's call (TorchServe's 500
    or 507, worker died) and fast refusals of a full queue while the survivor serves alone (on 2 cores
    beside the new worker's load); nothing hangs; a new worker answers, and the model has two
    workers again, the killed one not among them."""
    import random

    from archiver.build import configure
    from bench.reliability.faults import fault, kill_worker
    from bench.reliability.fuzz import valid_requests
    from slm_core.serving import ServingOptions

    configure(archives["store"] / "tiny_score.mar", archives["store"], ServingOptions(workers=2), "tiny_kill2")
    server.register("tiny_kill2.mar", workers=2)
    try:
        url = f"{server.inference}/predictions/tiny_kill2"
        bodies = [p.body for p in valid_requests("score", 8, random.Random(4), 20)]
        result = fault(
            url, server.management, "tiny_kill2", bodies, capacity=10, inject=kill_worker, seconds=30, lead=3
        )
    finally:
        http("DELETE", f"{server.management}/models/tiny_kill2")
    print(f"\nkill step, short: {json.dumps(result)}")
    assert result["killed"] in result["workers_before"] and len(result["workers_before"]) == 2
    assert len(result["workers_after"]) == 2 and result["killed"] not in result["workers_after"]
    assert result["requests"] == pytest.approx(8 * 30, rel=0.05)
    # no dropped connection, no timeout: TorchServe answers the killed worker's call 500 or 507
    # (worker died), by when it sees the death, and refuses with 503 while its queue is full
    assert set(result["failed_statuses"]) <= {"500", "503", "507"}, result
    died = result["failed_statuses"].get("500", 0) + result["failed_statuses"].get("507", 0)
    assert died <= 3, result  # the one call the killed worker held, if any: up to batchSize 3
    assert all(second.get("200", 0) > 0 for second in result["statuses_per_second"]), result["statuses_per_second"]
    assert result["first_answer_by_a_new_worker_s"] is not None


def test_the_start_up_steps_time_workers_and_a_scale_up_loses_nothing(server, archives):
    """bench.reliability's ready and scale-up steps on a copy of tiny_score: ready stops the
    workers and starts 1, then 2 together, timing each until READY, and leaves the model with the
    worker it had; scale-up doubles one worker 3 s into an open-loop load: nothing fails, the new
    worker is READY and answers, and the model ends with two."""
    import random

    from archiver.build import configure
    from bench.reliability.faults import fault
    from bench.reliability.fuzz import valid_requests
    from bench.reliability.start_up import ready, scale_up
    from slm_core.serving import ServingOptions

    configure(archives["store"] / "tiny_score.mar", archives["store"], ServingOptions(workers=1), "tiny_start")
    server.register("tiny_start.mar", workers=1)
    try:
        times = ready(server.management, "tiny_start", [1, 2], timeout=120)
        assert [len(times["1 together"]), len(times["2 together"])] == [1, 2], times
        assert all(0 < s < 120 for counts in times.values() for s in counts), times
        assert len(server.workers("tiny_start")) == 1
        url = f"{server.inference}/predictions/tiny_start"
        bodies = [p.body for p in valid_requests("score", 8, random.Random(5), 20)]
        result = fault(
            url,
            server.management,
            "tiny_start",
            bodies,
            capacity=10,
            inject=lambda before: scale_up(server.management, "tiny_start", before, timeout=120),
            seconds=20,
            lead=3,
        )
    finally:
        http("DELETE", f"{server.management}/models/tiny_start")
    print(f"\nready, short: {times}\nscale-up, short: {json.dumps(result)}")
    assert result["scaled_to"] == 2 and len(result["new_workers_ready_s"]) == 1, result
    assert result["failed"] == 0, result
    assert len(result["workers_after"]) == 2 and set(result["workers_before"]) < set(result["workers_after"])
    assert result["first_answer_by_a_new_worker_s"] is not None, result


def test_scaling_down_under_traffic_loses_at_most_the_stopped_workers_call(server, archives):
    """Two workers of a copy of tiny_score serve two clients sending back to back; scaled to one
    (PUT min_worker=1&max_worker=1). TorchServe 0.12 stops a worker without waiting for its call:
    if the one it stops is busy, that call's requests fail (500 or 507, worker died, or the
    connection closed unanswered), and a request it was still gathering into a batch may get no
    answer at all (its thread clears the batch it was interrupted in: the client's timeout ends
    the wait). At most one batch is lost, and the PUT itself may answer 500; nothing else fails;
    one worker serves on. docs/operations.md, Deploying, says how to change the count losing nothing."""
    from archiver.build import configure
    from slm_core.serving import ServingOptions

    configure(archives["store"] / "tiny_score.mar", archives["store"], ServingOptions(workers=2), "tiny_scale2")
    server.register("tiny_scale2.mar", workers=2)
    url = f"{server.inference}/predictions/tiny_scale2"
    statuses: list[tuple[float, int]] = []
    unanswered: list[float] = []  # seconds until the connection closed, or the timeout, without an answer
    stop = threading.Event()

    def client():
        while not stop.is_set():
            sent = time.monotonic()
            try:
                status = http(
                    "POST",
                    url,
                    b'{"texts": ["cheap flights", "rome"]}',
                    {"Content-Type": "application/json"},
                    timeout=30,
                )[0]
            except OSError:
                status = 0
                unanswered.append(time.monotonic() - sent)
            statuses.append((sent, status))

    threads = [threading.Thread(target=client) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        time.sleep(2.0)
        scaled = time.monotonic()
        status, body = http("PUT", f"{server.management}/models/tiny_scale2?min_worker=1&max_worker=1&synchronous=true")
        # TorchServe 0.12's management thread fails the stopped worker's jobs while that worker's
        # own thread clears them; when the two meet, the PUT answers 500 ConcurrentModificationException
        # after the worker was already taken out. docs/operations.md tells operators to check the count.
        assert status == 200 or (status == 500 and b"ConcurrentModificationException" in body), body
        time.sleep(2.0)
        workers = server.workers("tiny_scale2")
        batch = json.loads(http("GET", f"{server.management}/models/tiny_scale2")[1])[0]["batchSize"]
    finally:
        stop.set()
        for t in threads:
            t.join(90)
        http("DELETE", f"{server.management}/models/tiny_scale2")
    failed = [s for _, s in statuses if s != 200]
    print(
        f"\nscale-down 2 -> 1 under traffic: {len(statuses)} requests, {len(failed)} failed {sorted(set(failed))}; "
        f"{sum(t > scaled for t, _ in statuses)} after it"
    )
    assert not any(t.is_alive() for t in threads)
    assert len(workers) == 1
    # the stopped worker's call: 500 or 507 (worker died), or no answer (status 0: the connection
    # closed, or the client's timeout ended a wait on a batch TorchServe dropped)
    assert set(failed) <= {0, 500, 507} and len(failed) <= batch, (failed, unanswered)
    assert sum(t > scaled + 0.5 and s == 200 for t, s in statuses) > 0  # one worker serves on


def test_a_request_past_its_deadline_gets_a_504_through_torchserve(server):
    """X-Slm-Deadline-Ms from the arrival a proxy stamps (X-Request-Start): a request that arrived
    1.5 s ago with a 500 ms deadline gets a 504 naming it, at once; with 60 s it is answered; a
    deadline that is no number is a 400."""
    url = f"{server.inference}/predictions/tiny_score"
    body = b'{"texts": ["search engines"]}'
    arrived = f"t={time.time() - 1.5:.6f}"
    start = time.perf_counter()
    status, answer = http(
        "POST", url, body, {"Content-Type": "application/json", "X-Request-Start": arrived, "X-Slm-Deadline-Ms": "500"}
    )
    assert status == 504, answer
    assert re.search(r"deadline of 500 ms: waited 1[5-9][0-9]{2}\.[0-9] ms", json.loads(answer)["error"]), answer
    assert time.perf_counter() - start < 5
    status, _ = http(
        "POST",
        url,
        body,
        {"Content-Type": "application/json", "X-Request-Start": arrived, "X-Slm-Deadline-Ms": "60000"},
    )
    assert status == 200
    status, answer = http("POST", url, body, {"Content-Type": "application/json", "X-Slm-Deadline-Ms": "soon"})
    assert status == 400 and "X-Slm-Deadline-Ms must be a positive number" in json.loads(answer)["error"]


def test_a_full_queue_refuses_at_once_and_nothing_hangs(server, archives):
    """tiny_score lets 30 requests wait for a worker (archiver --queue 30): the management API
    shows that bound, and under a burst far above it every request ends with a correct 200 or
    TorchServe's immediate 503 JSON, none hangs."""
    status, body = http("GET", f"{server.management}/models/tiny_score")
    assert json.loads(body)[0]["jobQueueStatus"]["remainingCapacity"] == 30, body
    engine = Engine.from_package(archives["tiny_score"])
    texts = ["search engines rank documents for a query"] * 8  # max_texts
    expected = engine.score(texts)
    results = []

    def send():
        results.append(server.predict("tiny_score", json.dumps({"texts": texts}).encode()))

    threads = [threading.Thread(target=send) for _ in range(200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 200  # none hung
    for status, body in results:
        assert status in (200, 503), (status, body)
        if status == 200:
            for row, ref in zip(json.loads(body)["scores"], expected):
                assert row == pytest.approx(ref, abs=1e-6)
        else:
            assert json.loads(body)["code"] == 503
    print(f"\n200 at once against a queue of 30: {sum(s == 503 for s, _ in results)} refused with 503")


def test_sigusr1_writes_each_thread_stack_to_the_log_and_the_worker_serves_on(server):
    """bench.run's account of a stuck worker: `kill -USR1 <worker pid>` writes every thread's
    Python stack into the model log; the worker goes on answering."""
    worker = server.workers("tiny_score")[0]
    log = server.workdir / "logs" / "model_log.log"
    before = log.read_text().count("most recent call first")
    os.kill(int(worker["pid"]), signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while log.read_text().count("most recent call first") == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert log.read_text().count("most recent call first") > before
    assert server.predict("tiny_score", b'{"texts": ["still fine"]}')[0] == 200


def test_describe_model_customized_names_the_task(server):
    """describe-model ?customized=true: TorchServe asks a worker, whose handler answers the task
    as built (kind, labels, bounds, precision), its request and answer fields, and its serving."""
    status, body = http("GET", f"{server.management}/models/tiny_score?customized=true")
    assert status == 200, body
    (described,) = json.loads(body)
    meta = described["customizedMetadata"]
    assert isinstance(meta, dict)  # TorchServe nests the handler's JSON answer as an object
    assert meta["task"]["task"] == "score" and meta["task"]["labels"] == ["yes", "no"]
    assert meta["task"]["precision"] == "fp32" and meta["request_field"] == "request field 'texts'"
    assert meta["bounds"] == {"requests": 3, "sequences_per_request": 8, "tokens_per_sequence": 64}
    assert meta["serving"]["queue"] == 30 and meta["device"] == "cpu"
    status, _ = server.predict("tiny_score", b'{"texts": ["still answering"]}')
    assert status == 200
