"""Generative retrieval end to end through a real TorchServe (CPU, fp32, the random Qwen3): a beam
task with a catalog of token-id items, built once with the archiver CLI, following a catalog store.
Its REST answers are the engine's bytes, with per-request beam_width/new_tokens/top/exclude;
`slm-archiver catalog` writes version 2.0 with another catalog in seconds; TorchServe switches the
model from 1.0 to 2.0 under traffic without failing a request; bad settings get their 400; a
catalog published into the store replaces the served one in place under traffic, each answer
wholly of one catalog and naming it, a bad catalog is refused naming its line, and a rollback
returns to the one before."""

import json
import random
import re
import threading
import time
import zipfile

import pytest
import yaml
from helpers import write_catalog

from handlers.local_server import TorchServe, http
from slm_core import Engine
from slm_core.catalog_store import ARCHIVE, CatalogStore
from slm_core.serve.protocol import Request, respond

NAME = "tiny_catalog"
V2_MAR = f"{NAME}-2.0.mar"
TASK = {
    "task": "beam",
    "beam_width": 6,
    "new_tokens": 3,
    "max_prompt_tokens": 64,
    "stop": ["<|im_end|>"],
    "max_batch": 2,
    "max_exclude": 8,
    "precision": "fp32",
    "catalog": "items1.jsonl",
}
PROMPTS = [
    "a small language model",
    "search engines rank",
    "the quick brown fox",
    "beam search keeps",
    "numbers like 12, 345 and 6789",
    "is this query about shopping",
]


def _catalogs() -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Catalog 1: 60 items of 1-3 tokens (ids 10-199 of the random tokenizer; 2 is <|im_end|>), some
    prefixes of others. Catalog 2: every other item of catalog 1 removed, 30 new ones added."""
    rng = random.Random(11)
    seqs: list[tuple[int, ...]] = []
    while len(seqs) < 90:
        item = tuple(rng.randrange(10, 200) for _ in range(rng.randint(1, 3)))
        if item not in seqs:
            seqs.append(item)
    one = {f"item-{k}": list(s) for k, s in enumerate(seqs[:60])}
    two = {f"item-{k}": list(s) for k, s in enumerate(seqs[:60]) if k % 2}
    two.update({f"new-{k}": list(s) for k, s in enumerate(seqs[60:])})
    return one, two


CATALOG1, CATALOG2 = _catalogs()


def body(request: dict) -> bytes:
    return json.dumps(request).encode()


def ranked(answer: bytes) -> list[tuple[str, list[int]]]:
    """An answer's items, best first, with their token ids (no scores)."""
    return [(c["id"], c["token_ids"]) for c in json.loads(answer)["candidates"]]


def engine_bytes(engine: Engine, request: dict) -> bytes:
    """The engine's answer to one request alone, as the handler encodes it."""
    return respond(engine, Request({"body": body(request)})).body


@pytest.fixture(scope="module")
def built(random_checkpoint, tmp_path_factory):
    """The v1.0 archive built by the archiver CLI (the slow part: minutes), its catalog, and the
    archive unpacked as TorchServe unpacks it."""
    from archiver.__main__ import main

    folder, _ = random_checkpoint("qwen3")
    root = tmp_path_factory.mktemp("catalog-archives")
    store = root / "store"
    catalogs = root / "catalogs"  # the catalog store its workers follow
    write_catalog(root / "items1.jsonl", list(CATALOG1.values()), list(CATALOG1))
    write_catalog(root / "items2.jsonl", list(CATALOG2.values()), list(CATALOG2))
    (root / "task.yaml").write_text(yaml.safe_dump(TASK))
    start = time.monotonic()
    assert (
        main(
            [
                "build",
                "--checkpoint",
                str(folder),
                "--task",
                str(root / "task.yaml"),
                "--model-name",
                NAME,
                "--export-path",
                str(store),
                "--version",
                "1.0",
                "--catalog-store",
                str(catalogs),
            ]
        )
        == 0
    )
    print(f"\nbuild of {NAME}.mar: {time.monotonic() - start:.0f} s")
    zipfile.ZipFile(store / f"{NAME}.mar").extractall(root / "v1")
    return {"root": root, "store": store, "v1": root / "v1", "catalogs": catalogs}


@pytest.fixture(scope="module")
def swapped(built):
    """`slm-archiver catalog` with catalog 2: NAME-2.0.mar beside v1.0 (timed), and it unpacked."""
    from archiver.__main__ import main

    start = time.monotonic()
    assert (
        main(
            [
                "catalog",
                "--archive",
                str(built["store"] / f"{NAME}.mar"),
                "--catalog",
                str(built["root"] / "items2.jsonl"),
                "--version",
                "2.0",
                "--export-path",
                str(built["store"]),
            ]
        )
        == 0
    )
    seconds = time.monotonic() - start
    zipfile.ZipFile(built["store"] / V2_MAR).extractall(built["root"] / "v2")
    return {"seconds": seconds, "v2": built["root"] / "v2"}


@pytest.fixture(scope="module")
def v1(built):
    """The v1.0 package as a worker loads it, in this process."""
    return Engine.from_package(built["v1"])


@pytest.fixture(scope="module")
def v2(swapped):
    return Engine.from_package(swapped["v2"])


@pytest.fixture(scope="module")
def server(built, tmp_path_factory):
    ts = TorchServe(tmp_path_factory.mktemp("torchserve-catalog"), built["store"]).start()
    try:
        ts.register(f"{NAME}.mar")
        yield ts
    finally:
        ts.stop()


def versions(server) -> dict[str, dict]:
    status, answer = http("GET", f"{server.management}/models/{NAME}/all")
    assert status == 200, answer
    return {m["modelVersion"]: m for m in json.loads(answer)}


def test_rest_answers_are_the_engine_bytes_with_per_request_settings(server, v1):
    first = json.loads(engine_bytes(v1, {"prompt": PROMPTS[0]}))["candidates"]
    assert len(first) == TASK["beam_width"]
    top = first[0]["id"]
    requests = [{"prompt": p} for p in PROMPTS] + [
        {"prompt": PROMPTS[0], "beam_width": 3},
        {"prompt": PROMPTS[0], "new_tokens": 2},
        {"prompt": PROMPTS[0], "top": 2},
        {"prompt": PROMPTS[0], "exclude": [top]},
        {"prompt": PROMPTS[0], "exclude": [top, first[1]["id"], "not-an-item"], "top": 3},
        {"prompt": PROMPTS[1], "beam_width": 4, "new_tokens": 2, "top": 3, "exclude": [top]},
    ]
    for request in requests:
        status, answer = server.predict(NAME, body(request))
        assert status == 200, answer
        assert answer == engine_bytes(v1, request), request  # the same bytes, not just equal JSON
        candidates = json.loads(answer)["candidates"]
        assert 0 < len(candidates) <= min(request.get("beam_width", 6), request.get("top", 6))
        for c in candidates:  # each candidate is an item of catalog 1: its tokens, then the stop if it is short
            item = CATALOG1[c["id"]]
            assert c["token_ids"] == item + v1.task.stop_ids * (len(item) < request.get("new_tokens", 3))
        assert not {c["id"] for c in candidates} & set(request.get("exclude", []))
    # per-request settings change the answer: top cuts the full list, exclude drops the item
    full = json.loads(server.predict(NAME, body({"prompt": PROMPTS[0]}))[1])["candidates"]
    assert json.loads(server.predict(NAME, body({"prompt": PROMPTS[0], "top": 2}))[1])["candidates"] == full[:2]
    answer = json.loads(server.predict(NAME, body({"prompt": PROMPTS[0], "exclude": [top, "not-an-item"]}))[1])
    assert answer["unknown_exclude"] == 1 and top not in {c["id"] for c in answer["candidates"]}


def test_bad_settings_are_400s_and_unknown_exclude_ids_are_counted(server, v1):
    for request, message in (
        ({"prompt": "x", "beam_width": 7}, "'beam_width' must be an integer from 1 to 6 (the archive's bound), got 7"),
        ({"prompt": "x", "new_tokens": 4}, "'new_tokens' must be an integer from 1 to 3"),
        ({"prompt": "x", "exclude": "item-1"}, "'exclude' must be an array of item ids, got a string"),
        ({"prompt": "x", "exclude": [None]}, "'exclude' must hold item ids"),
        ({"prompt": "x", "exclude": ["a"] * 9}, "'exclude' holds 9 ids, over max_exclude=8"),
    ):
        status, answer = server.predict(NAME, body(request))
        assert status == 400 and message in json.loads(answer)["error"], (request, status, answer)
    status, answer = server.predict(NAME, body({"prompt": PROMPTS[1], "exclude": ["nope", "nada", 7]}))
    assert status == 200
    answer = json.loads(answer)
    assert answer["unknown_exclude"] == 3
    # nothing excluded: the candidates of the plain request
    assert answer["candidates"] == json.loads(engine_bytes(v1, {"prompt": PROMPTS[1]}))["candidates"]
    assert server.predict(NAME, body({"prompt": "still fine"}))[0] == 200


def test_catalog_swap_writes_version_2_in_seconds_and_serves_the_new_catalog(server, built, swapped, v1, v2):
    print(f"\nslm-archiver catalog: {V2_MAR} in {swapped['seconds']:.2f} s (no recompile)")
    assert swapped["seconds"] < 60
    # the same compiled graph, another catalog
    with zipfile.ZipFile(built["store"] / f"{NAME}.mar") as a, zipfile.ZipFile(built["store"] / V2_MAR) as b:
        assert a.getinfo("graph.pt2").CRC == b.getinfo("graph.pt2").CRC
        assert a.read("catalog.safetensors") != b.read("catalog.safetensors")
        assert json.loads(b.read("MAR-INF/MANIFEST.json"))["model"]["modelVersion"] == "2.0"
    # registered beside 1.0 (which stays the default), asked by version
    server.register(V2_MAR)
    served: set[str] = set()
    try:
        assert set(versions(server)) == {"1.0", "2.0"}
        for prompt in PROMPTS:
            for request in (
                {"prompt": prompt},
                {"prompt": prompt, "beam_width": 4, "top": 2},
                {"prompt": prompt, "exclude": ["item-0", "item-1"]},
            ):  # item-0: removed
                status, answer = http(
                    "POST",
                    f"{server.inference}/predictions/{NAME}/2.0",
                    body(request),
                    {"Content-Type": "application/json"},
                )
                assert status == 200 and answer == engine_bytes(v2, request), (request, answer)
                ids = {c["id"] for c in json.loads(answer)["candidates"]}
                assert ids <= set(CATALOG2), ids
                assert json.loads(answer).get("unknown_exclude") == (1 if "exclude" in request else None)
                served |= ids
            status, answer = server.predict(NAME, body({"prompt": prompt}))  # the default: still 1.0
            assert status == 200 and answer == engine_bytes(v1, {"prompt": prompt})
        assert any(i.startswith("new-") for i in served), served  # the added items are found
    finally:  # idle now: nothing in flight to lose
        status, answer = http("DELETE", f"{server.management}/models/{NAME}/2.0", timeout=120)
        assert status == 200, answer
    assert set(versions(server)) == {"1.0"}


def test_version_switch_under_traffic_fails_no_request(server, v1, v2):
    """1.0 serves two clients sending back to back (20 ms apart) while 2.0 is registered, made the
    default and 1.0 unregistered. Every request gets its 200; each answer is 1.0's or 2.0's (the
    engine's on that catalog), 1.0's up to the switch and 2.0's from it on.

    Why 1.0 is unregistered only once it is idle (TorchServe 0.12, frontend wlm/): a request is
    bound to a version when the frontend receives it (ModelManager.addJob puts it in the queue of
    the version that is default at that moment), so after set-default new requests go to 2.0 only.
    But DELETE /models/NAME/1.0 does not drain 1.0: ModelManager.unregisterModel removes the version
    and WorkLoadManager.modelChanged calls WorkerThread.shutdown(), which closes the worker's
    channel, interrupts its thread and hands the batch in flight back to the queue
    (BatchAggregator.sendError(null, ...) -> handleErrorJob -> model.addFirst), then kills the worker
    (kill -9). That queue belongs to the removed version, which has no worker any more: those
    requests, and any still waiting in it, are never answered (the client waits until its own
    timeout). Measured with the SmolLM2 retrieval archive (calls of seconds): three requests to
    /predictions/NAME/1.0, one in flight and two pending, then DELETE: 200 in 0.18 s, the log says
    "Unexpected job in sendError()", and none of the three was ever answered (60 s client
    timeouts). No registration or unregistration option waits for them (unregister_model_timeout
    only bounds the kill). So: set-default, then wait until 1.0 holds no request (its
    jobQueueStatus.pendingRequests is 0 and the requests received before set-default returned are
    answered; the management API shows no per-worker busy state, so a server-side operator waits
    for pendingRequests 0 and then one call's time), then unregister."""
    expected = {p: (engine_bytes(v1, {"prompt": p}), engine_bytes(v2, {"prompt": p})) for p in PROMPTS}
    assert all(a != b for a, b in expected.values())  # every answer tells its catalog
    items = {p: [ranked(a) for a in answers] for p, answers in expected.items()}
    assert all(a != b for a, b in items.values())
    assert set(versions(server)) == {"1.0"}
    results: list[tuple[int, float, float, str, int, bytes]] = []  # (client, sent, done, prompt, status, body)
    current: dict[int, float | None] = {0: None, 1: None}  # each client's request in flight: when it was sent
    lock, stop = threading.Lock(), threading.Event()

    def client(k: int) -> None:
        n = k
        while not stop.is_set():
            prompt = PROMPTS[n % len(PROMPTS)]
            n += 1
            with lock:
                current[k] = sent = time.monotonic()
            try:
                status, answer = http(
                    "POST",
                    f"{server.inference}/predictions/{NAME}",
                    body({"prompt": prompt}),
                    {"Content-Type": "application/json"},
                    timeout=30,
                )
            except OSError as e:  # a dropped connection, or a request never answered (the timeout)
                status, answer = 0, repr(e).encode()
            with lock:
                results.append((k, sent, time.monotonic(), prompt, status, answer))
                current[k] = None
            time.sleep(0.02)

    def answered_since(when: float, count: int, limit: float = 30) -> None:
        """Wait until `count` requests sent after `when` are answered (at least a second, at most `limit`)."""
        deadline, least = time.monotonic() + limit, time.monotonic() + 1.0
        while time.monotonic() < least or (
            time.monotonic() < deadline and sum(r[1] > when for r in list(results)) < count
        ):
            time.sleep(0.05)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in current]
    t: dict[str, float] = {"start": time.monotonic()}
    for thread in threads:
        thread.start()
    try:
        answered_since(t["start"], 20)
        # synchronous=true holds the Netty event loop that reads this management request until the
        # worker is up (ApiUtils.updateModel: future.get()), and the REST connectors share those
        # loops (2 x cores): a new connection that lands on it waits for the registration too (a
        # request of ~10 ms took the registration's seconds here; the latency printed below).
        # synchronous=false and polling for READY avoids that; on 2 cores the new worker's start
        # then slows 1.0's calls instead (its graph from 1 ms to up to 1.5 s, measured).
        t["register_sent"] = time.monotonic()
        status, answer = http(
            "POST", f"{server.management}/models?url={V2_MAR}&initial_workers=1&synchronous=true", timeout=300
        )
        assert status == 200, answer
        t["registered"] = time.monotonic()
        time.sleep(0.5)
        t["switch_sent"] = time.monotonic()
        status, answer = http("PUT", f"{server.management}/models/{NAME}/2.0/set-default")
        t["switched"] = time.monotonic()
        assert status == 200, answer
        polls = 0
        while True:  # drain 1.0: its queue empty, and the requests sent before the switch answered
            polls += 1
            status, answer = http("GET", f"{server.management}/models/{NAME}/1.0")
            assert status == 200, answer
            pending = json.loads(answer)[0]["jobQueueStatus"]["pendingRequests"]
            with lock:
                older = [s for s in current.values() if s is not None and s < t["switched"]]
            if pending == 0 and not older:
                break
            assert time.monotonic() - t["switched"] < 60, (pending, older)
            time.sleep(0.01)
        t["drained"] = time.monotonic()
        status, answer = http("DELETE", f"{server.management}/models/{NAME}/1.0", timeout=120)
        t["unregistered"] = time.monotonic()
        assert status == 200, answer
        answered_since(t["unregistered"], 20)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    assert set(versions(server)) == {"2.0"}

    failed = [(k, prompt, status, answer[:200]) for k, _, _, prompt, status, answer in results if status != 200]
    # The catalog each answer is of: 1, 2, or 0 for neither. Two clients' requests often share a
    # graph call (max_batch 2), whose fp32 GEMMs may round a score differently from the call of one
    # request alone (docs/protocols.md, Determinism): an answer is its catalog's items in the same order, with
    # the same tokens, its scores within 1e-5 of the engine's answer alone.
    which, identical, score_diff = [], 0, 0.0
    for _, _, _, prompt, status, answer in results:
        got = ranked(answer) if status == 200 else None
        which.append(1 + items[prompt].index(got) if got in items[prompt] else 0)
        if which[-1]:
            want = json.loads(expected[prompt][which[-1] - 1])["candidates"]
            score_diff = max(
                [score_diff] + [abs(c["score"] - w["score"]) for c, w in zip(json.loads(answer)["candidates"], want)]
            )
            identical += answer == expected[prompt][which[-1] - 1]
    during = [r for r in results if r[1] < t["registered"] and r[2] > t["register_sent"]]
    after_delete = [r for r in results if r[1] > t["unregistered"]]
    latency = sorted(done - sent for _, sent, done, *_ in results)
    others = sorted(r[2] - r[1] for r in results if r not in during)
    ms = {
        k: (t[b] - t[a]) * 1e3
        for k, a, b in (
            ("set_default", "switch_sent", "switched"),
            ("drain", "switched", "drained"),
            ("unregister", "drained", "unregistered"),
        )
    }
    print(
        f"\nversion switch under traffic: {len(results)} requests from 2 clients, {len(failed)} failed; "
        f"{which.count(1)} answered by 1.0, {which.count(2)} by 2.0, {which.count(0)} by neither "
        f"({identical} the bytes of the engine's answer alone, scores within {score_diff:.1e}); "
        f"{len(during)} overlapped registering 2.0 ({t['registered'] - t['register_sent']:.1f} s); "
        f"set-default {ms['set_default']:.0f} ms; 1.0 drained {ms['drain']:.0f} ms after it ({polls} polls); "
        f"unregistering 1.0 {ms['unregister']:.0f} ms; {len(after_delete)} requests after it; "
        f"latency median {latency[len(latency) // 2] * 1e3:.0f} ms, max {latency[-1] * 1e3:.0f} ms "
        f"(max {others[-1] * 1e3:.0f} ms outside the registration)"
    )
    assert failed == [], failed
    assert 0 not in which and score_diff <= 1e-5
    for (_, sent, done, *_), w in zip(results, which):
        if done < t["switch_sent"]:
            assert w == 1, (sent, done, t)
        if sent > t["switched"]:
            assert w == 2, (sent, done, t)
    for k in current:  # each client, sending one request after the other, sees 1.0 then 2.0 only
        seen = [w for (c, *_), w in zip(results, which) if c == k]
        assert seen == sorted(seen) and seen[0] == 1 and seen[-1] == 2, seen
    assert during and len(after_delete) >= 20


def test_a_published_catalog_is_swapped_in_place_under_traffic_and_rolled_back(server, built, v1, v2, capfd):
    """Two clients send back to back (requests with and without exclude) to the model's one worker
    (by now 2.0, whose own catalog is catalog 2, "archive") while catalog 1 is published into the
    store as version c1, a bad catalog is refused, and c1 is rolled back. Every request gets its
    200; every answer names the catalog version that answered it (X-Slm-Catalog-Version and
    catalog_version, the same) and is that catalog's answer (its items, in the engine's order);
    each client sees archive, then c1, then archive; the worker's gauges say what it serves."""
    from archiver.__main__ import main

    store = CatalogStore(built["catalogs"])
    assert store.current() == ARCHIVE
    requests = [{"prompt": p} for p in PROMPTS] + [{"prompt": PROMPTS[0], "exclude": ["item-1", "new-0", "nope"]}]
    expected = {  # version -> request index -> the engine's items
        ARCHIVE: [ranked(engine_bytes(v2, r)) for r in requests],
        "c1": [ranked(engine_bytes(v1, r)) for r in requests],
    }
    assert all(a != b for a, b in zip(*expected.values()))  # every answer tells its catalog
    results: list[tuple[int, float, int, int, str, bytes]] = []  # (client, done, request, status, header, body)
    workers: set[str] = set()  # the pids that answered (X-Slm-Worker)
    lock, stop = threading.Lock(), threading.Event()

    def client(k: int) -> None:
        n = k
        while not stop.is_set():
            headers: dict = {}
            try:
                status, answer = http(
                    "POST",
                    f"{server.inference}/predictions/{NAME}",
                    body(requests[n % len(requests)]),
                    {"Content-Type": "application/json"},
                    timeout=30,
                    response_headers=headers,
                )
            except OSError as e:
                status, answer = 0, repr(e).encode()
            with lock:
                results.append(
                    (k, time.monotonic(), n % len(requests), status, headers.get("x-slm-catalog-version", ""), answer)
                )
                workers.add(headers.get("x-slm-worker", ""))
            n += 1
            time.sleep(0.01)

    def served_since(when: float, version: str, limit: float = 30) -> float:
        """When the first answer of `version` arrived after `when`, waiting for one."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            with lock:
                done = [d for _, d, _, s, v, _ in results if d > when and v == version]
            if done:
                return done[0]
            time.sleep(0.02)
        raise AssertionError(f"no answer of catalog version {version} within {limit} s")

    def publish(catalog, version: str) -> int:  # slm-archiver publish into the workers' store
        args = ["--archive", str(built["store"] / V2_MAR), "--catalog", str(catalog), "--version", version]
        return main(["publish", *args, "--store", str(built["catalogs"])])

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in (0, 1)]
    for thread in threads:
        thread.start()
    t: dict[str, float] = {}
    try:
        served_since(0, ARCHIVE)
        t["publish"] = time.monotonic()
        assert publish(built["root"] / "items1.jsonl", "c1") == 0
        t["published"] = time.monotonic()
        t["c1"] = served_since(t["publish"], "c1")
        # a bad catalog: refused with its line; the store and the served catalog stay as they were
        bad = built["root"] / "bad.jsonl"
        bad.write_text('{"id": "a", "tokens": [10]}\n{"id": "b", "tokens": [11]}\n{"id": "a", "tokens": [12]}\n')
        capfd.readouterr()
        assert publish(bad, "bad") == 2
        assert "line 3: id 'a' is also on line 1" in capfd.readouterr().err
        assert store.versions() == ["c1"] and store.current() == "c1"
        time.sleep(1.5)  # more than a poll: still c1
        t["rollback"] = time.monotonic()
        assert main(["rollback", "--store", str(built["catalogs"])]) == 0
        t["archive"] = served_since(t["rollback"], ARCHIVE)
        time.sleep(0.5)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert store.current() == ARCHIVE
    failed = [(status, answer[:200]) for *_, status, _, answer in results if status != 200]
    assert failed == [], failed
    for k, _, i, _, version, answer in results:
        assert json.loads(answer)["catalog_version"] == version, (version, answer[:200])
        assert ranked(answer) == expected[version][i], (k, version, i)
    for k in (0, 1):  # each client: archive, then c1, then archive again
        seen = [version for c, _, _, _, version, _ in results if c == k]
        runs = [v for j, v in enumerate(seen) if j == 0 or seen[j - 1] != v]
        assert runs == [ARCHIVE, "c1", ARCHIVE], runs
    print(
        f"\ncatalog hot swap under traffic: {len(results)} requests from 2 clients, 0 failed; "
        f"publish (check + build + activate) {(t['published'] - t['publish']) * 1e3:.0f} ms, first c1 answer "
        f"{(t['c1'] - t['published']) * 1e3:.0f} ms after it; first answer after the rollback "
        f"{(t['archive'] - t['rollback']) * 1e3:.0f} ms after it"
    )
    # what the worker serves, on TorchServe's Prometheus endpoint (the workers of earlier tests,
    # gone, keep their series)
    (worker,) = workers
    text = http("GET", f"{server.metrics}/metrics")[1].decode()
    gauges = {
        m.group(1): float(m.group(2))
        for m in re.finditer(
            rf'^SlmCatalogVersion\{{[^}}]*Version="([^"]+)"[^}}]*Worker="{worker}"[^}}]*\}} (\S+)$', text, re.M
        )
    }
    assert gauges == {ARCHIVE: 1, "c1": 0}, gauges
    (swapped,) = re.findall(rf'^SlmCatalogSwapTime\{{[^}}]*Worker="{worker}"[^}}]*\}} (\S+)$', text, re.M)
    assert t["rollback"] - 5 < float(swapped) - time.time() + time.monotonic() < t["archive"] + 5
