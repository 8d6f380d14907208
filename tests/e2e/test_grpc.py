"""TorchServe's gRPC inference API (grpc_inference_port) through a real TorchServe: Predictions and
StreamPredictions answer the REST bytes, StreamPredictions ends its stream after the one answer
without restarting the worker, a bad request gets a gRPC error status, and StreamPredictions2
behaves as TorchServe 0.12 serves it to a model without sequence batching: refused or dropped,
and the one way it loses a worker (docs/protocols.md, gRPC). The client stubs are generated at test time
from the .proto files inside TorchServe's own jar."""

import importlib
import importlib.util
import json
import os
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from handlers.local_server import TorchServe, http

SCORE = json.dumps({"texts": ["search engines rank documents", "a", "the lazy dog"]}).encode()
BEAM = b'{"prompt": "a small language model"}'
BAD = [  # (model, body, what the error says), each also sent over REST for its 400 body
    ("tiny_score", b'{"texts": []}', "'texts' is empty"),
    ("tiny_score", b"this is not json", "not valid JSON"),
    ("tiny_score", b'{"texts": ["\xff\xfe"]}', "not valid UTF-8"),
    ("tiny_score", b'{"texts": ["a", "b", "c", "d", "e", "f", "g", "h", "i"]}', "max_texts=8"),
    ("tiny_beam", b'{"prompt": 7}', "prompt must be a string"),
]
# A restarted worker answers its first request after loading again: seconds even for the tiny
# archives (3.6-4.1 s measured on 2 cores), where a live one answers in milliseconds.
FAST_S = 2.0


def grpc_stubs(folder: Path):
    """(inference_pb2, inference_pb2_grpc, management_pb2, management_pb2_grpc) generated with
    grpcio-tools from the .proto files in TorchServe's frontend jar, the ones its server runs."""
    if importlib.util.find_spec("grpc") is None or importlib.util.find_spec("grpc_tools") is None:
        if os.environ.get("CI"):
            raise RuntimeError("grpcio and grpcio-tools are not installed: pip install -e '.[test]'")
        pytest.skip("grpcio and grpcio-tools are not installed")
    import ts
    from grpc_tools import protoc

    jar = Path(ts.__file__).parent / "frontend" / "model-server.jar"
    protos = ["inference.proto", "management.proto", "google/rpc/status.proto"]  # status: inference's import
    with zipfile.ZipFile(jar) as z:
        for name in protos:
            (folder / "proto" / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / "proto" / name).write_bytes(z.read(name))
    (folder / "out").mkdir()
    well_known = Path(protoc.__file__).parent / "_proto"  # google/protobuf/empty.proto and the like
    assert (
        protoc.main(
            [
                "protoc",
                f"-I{folder / 'proto'}",
                f"-I{well_known}",
                f"--python_out={folder / 'out'}",
                f"--grpc_python_out={folder / 'out'}",
                *(str(folder / "proto" / p) for p in protos),
            ]
        )
        == 0
    )
    sys.path.insert(0, str(folder / "out"))  # google.rpc joins the google namespace package from here
    return tuple(
        importlib.import_module(m)
        for m in ("inference_pb2", "inference_pb2_grpc", "management_pb2", "management_pb2_grpc")
    )


class Grpc:
    """A TorchServe's gRPC inference and management stubs, on the ports its config gives them."""

    def __init__(self, server: TorchServe, stubs):
        import grpc

        self.grpc, (self.pb, inference, self.mpb, management) = grpc, stubs
        settings = server.config.read_text().splitlines()
        config = dict(line.split("=", 1) for line in settings if "=" in line and line[0] != "#")
        self.options = [("grpc.enable_http_proxy", 0)]  # loopback: never through a proxy the environment names
        self.address, self.inference_module = f"127.0.0.1:{config['grpc_inference_port']}", inference
        self.channels = [
            grpc.insecure_channel(a, options=self.options)
            for a in (self.address, f"127.0.0.1:{config['grpc_management_port']}")
        ]
        self.inference = inference.InferenceAPIsServiceStub(self.channels[0])
        self.management = management.ManagementAPIsServiceStub(self.channels[1])

    def fresh_inference(self):
        """(an inference stub, its channel) on a connection of its own."""
        channel = self.grpc.insecure_channel(self.address, options=self.options)
        return self.inference_module.InferenceAPIsServiceStub(channel), channel

    def request(self, model: str, body: bytes, key: str = "body", **fields):
        return self.pb.PredictionsRequest(model_name=model, input={key: body}, **fields)

    def workers(self, model: str) -> list[tuple[str, int, str]]:
        """(id, pid, status) of each worker, from the gRPC management API's DescribeModel."""
        described = json.loads(
            self.management.DescribeModel(self.mpb.DescribeModelRequest(model_name=model), timeout=30).msg
        )
        return [(w["id"], w["pid"], w["status"]) for w in described[0]["workers"]]


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    out = grpc_stubs(tmp_path_factory.mktemp("grpc-stubs"))
    yield out
    sys.path.remove(str(Path(out[0].__file__).parent))


@pytest.fixture(scope="module")
def served(stubs, archives, tmp_path_factory):
    """(TorchServe serving tiny_score and tiny_beam, its gRPC client)."""
    ts = TorchServe(tmp_path_factory.mktemp("torchserve-grpc"), archives["store"]).start()
    client = None
    try:
        ts.register("tiny_score.mar")
        ts.register("tiny_beam.mar")
        client = Grpc(ts, stubs)
        yield ts, client
    finally:
        if client is not None:
            for channel in client.channels:
                channel.close()
        ts.stop()


def held(request, until: threading.Event):
    """A client stream of one request whose sending side stays open until `until` is set."""
    yield request
    until.wait(30)


def rest_after(server: TorchServe, model: str, body: bytes) -> tuple[int, bytes, float]:
    start = time.monotonic()
    status, answer = server.predict(model, body)
    return status, answer, time.monotonic() - start


def test_predictions_answer_the_rest_bytes(served):
    """Predictions, the body under input "body" (or "data"): the very bytes REST answers, for a
    score and a beam request; the gRPC management API describes the same workers as REST's."""
    server, client = served
    for model, body in (("tiny_score", SCORE), ("tiny_beam", BEAM)):
        status, rest = server.predict(model, body)
        assert status == 200, rest
        for key in ("body", "data"):
            assert client.inference.Predictions(client.request(model, body, key), timeout=60).prediction == rest
        assert client.workers(model) == [(w["id"], w["pid"], w["status"]) for w in server.workers(model)]


def test_stream_predictions_answer_once_and_the_worker_stays(served):
    """StreamPredictions, 4 calls in a row per model: each stream holds one message, the REST bytes,
    and ends; the worker keeps its pid throughout and a REST request right after each call answers
    at once (a restarted worker would first load again)."""
    server, client = served
    for model, body in (("tiny_score", SCORE), ("tiny_beam", BEAM)):
        expected = server.predict(model, body)[1]
        before = client.workers(model)
        calls = []
        for _ in range(4):
            start = time.monotonic()
            try:
                messages = [
                    m.prediction for m in client.inference.StreamPredictions(client.request(model, body), timeout=60)
                ]
                outcome = "OK"
            except client.grpc.RpcError as e:
                messages, outcome = [], f"{e.code().name}: {e.details()}"
            stream_s = time.monotonic() - start
            status, answer, rest_s = rest_after(server, model, body)
            calls.append((outcome, messages, stream_s, status, answer, rest_s, client.workers(model)))
        print(
            f"\n{model} StreamPredictions x4: workers before {before}; per call (outcome, stream s, REST after s, "
            f"workers after): {[(c[0], round(c[2], 3), round(c[5], 3), c[6]) for c in calls]}"
        )
        for outcome, messages, _, status, answer, rest_s, workers in calls:
            assert (outcome, messages) == ("OK", [expected])
            assert (status, answer) == (200, expected) and rest_s < FAST_S
            assert workers == before and all(w[2] == "READY" for w in workers)
    log = (server.workdir / "logs" / "ts_log.log").read_text()
    assert "NullPointerException" not in log and "Backend worker thread exception" not in log


def test_a_bad_request_gets_invalid_argument_with_the_rest_error(served):
    """A bad body through Predictions and StreamPredictions: gRPC status INVALID_ARGUMENT whose
    message starts with the JSON error REST answers with its 400 (TorchServe appends a line naming
    its exception class); no worker restarts."""
    server, client = served
    before = {m: client.workers(m) for m in ("tiny_score", "tiny_beam")}
    for model, body, message in BAD:
        status, rest = server.predict(model, body)
        assert status == 400 and message in json.loads(rest)["error"], rest
        for call in (
            client.inference.Predictions,
            lambda r, timeout: list(client.inference.StreamPredictions(r, timeout=timeout)),
        ):
            with pytest.raises(client.grpc.RpcError) as raised:
                call(client.request(model, body), timeout=60)
            assert raised.value.code() == client.grpc.StatusCode.INVALID_ARGUMENT, (body[:40], raised.value)
            assert raised.value.details().split("\n")[0] == rest.decode(), raised.value.details()
    # no body at all: the protocol's own words
    with pytest.raises(client.grpc.RpcError) as raised:
        client.inference.Predictions(client.request("tiny_score", b"", key="text"), timeout=60)
    assert raised.value.code() == client.grpc.StatusCode.INVALID_ARGUMENT
    assert "expected a JSON body" in raised.value.details()
    assert {m: client.workers(m) for m in before} == before
    assert (
        client.inference.Predictions(client.request("tiny_score", SCORE), timeout=60).prediction
        == server.predict("tiny_score", SCORE)[1]
    )


def test_grpc_and_rest_requests_at_once_each_get_their_own_answer(served):
    """Good and bad gRPC requests (both calls) and good and bad REST requests at once, so that the
    worker batches them (max_batch 3) in whatever mix: every good one gets its answer (its bytes
    alone; batched, its rows within 1e-6 as docs/protocols.md's determinism says), every bad REST one its 400;
    a bad gRPC one gets INVALID_ARGUMENT, or status OK with the JSON error as its answer where
    TorchServe batched it with other requests (it carries one status per batch to gRPC); no worker
    restarts."""
    server, client = served
    bad = b'{"texts": []}'
    expected, error = server.predict("tiny_score", SCORE)[1], server.predict("tiny_score", bad)[1]
    before = client.workers("tiny_score")
    results: dict[tuple, object] = {}

    def send(kind: str, good: bool, i: int):
        body = SCORE if good else bad
        try:
            if kind == "rest":
                results[kind, good, i] = server.predict("tiny_score", body)
            elif kind == "unary":
                results[kind, good, i] = (
                    "OK",
                    client.inference.Predictions(client.request("tiny_score", body), timeout=60).prediction,
                )
            else:
                messages = list(client.inference.StreamPredictions(client.request("tiny_score", body), timeout=60))
                results[kind, good, i] = ("OK", *[m.prediction for m in messages])
        except client.grpc.RpcError as e:
            results[kind, good, i] = (e.code().name, e.details().split("\n")[0].encode())

    jobs = [(kind, good, i) for i in range(4) for kind in ("rest", "unary", "stream") for good in (True, False)]
    threads = [threading.Thread(target=send, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == len(jobs)  # none hung
    flat = [x for row in json.loads(expected)["scores"] for x in row]

    def answers(result, status) -> bool:
        ok = len(result) == 2 and result[0] == status
        rows = json.loads(result[1])["scores"] if ok else []
        return ok and [x for row in rows for x in row] == pytest.approx(flat, abs=1e-6)

    for (kind, good, _), result in results.items():
        if kind == "rest":
            assert answers(result, 200) if good else result == (400, error), result
        elif good:
            assert answers(result, "OK"), result
        else:
            assert result in (("INVALID_ARGUMENT", error), ("OK", error)), result
    shared = sum(results[k] == ("OK", error) for k in results if k[0] != "rest")
    print(
        f"\n{len(jobs)} requests at once: {shared} of 8 bad gRPC requests answered OK with the error "
        "(batched with others)"
    )
    assert client.workers("tiny_score") == before


def test_stream_predictions2_refuses_and_drops_yet_hurts_no_worker(served):
    """StreamPredictions2 as TorchServe 0.12 serves a model without sequence batching. Without a
    sequence_id it refuses in the stream (one message with status INTERNAL, "Parameter sequenceId
    is required.", even when the request asks to start a sequence: a flag it cannot read) and the
    call ends OK, no job queued. With one, the worker answers but the call ends UNKNOWN with no
    message (the server fails looking up the sequence's job group, after queueing the job); a
    client that keeps its side open until then loses nothing else. Either way the worker keeps its
    pid and REST answers at once."""
    server, client = served
    log = server.workdir / "logs" / "ts_log.log"
    failures = log.read_text().count("Backend worker thread exception")
    expected = server.predict("tiny_score", SCORE)[1]
    before = client.workers("tiny_score")
    stub, channel = client.fresh_inference()  # calls cut short can leave the connection unusable
    try:
        for start in ({}, {"ts_request_sequence_start": b"true"}):
            request = client.pb.PredictionsRequest(model_name="tiny_score", input={"body": SCORE, **start})
            messages = list(stub.StreamPredictions2(iter([request]), timeout=60))
            assert [(m.prediction, m.status.code, m.status.message) for m in messages] == [
                (b"", 13, "Parameter sequenceId is required.")
            ]
        for i in range(4):
            done = threading.Event()
            with pytest.raises(client.grpc.RpcError) as raised:
                list(
                    stub.StreamPredictions2(
                        held(client.request("tiny_score", SCORE, sequence_id=f"held-{i}"), done), timeout=60
                    )
                )
            assert raised.value.code() == client.grpc.StatusCode.UNKNOWN
            time.sleep(0.5)  # the worker's answer to it, dropped, lands meanwhile
            done.set()
            status, answer, rest_s = rest_after(server, "tiny_score", SCORE)
            assert (status, answer) == (200, expected) and rest_s < FAST_S
    finally:
        channel.close()
    assert client.workers("tiny_score") == before
    assert log.read_text().count("Backend worker thread exception") == failures


def test_stream_predictions2_closed_early_with_a_sequence_id_can_lose_the_worker(served, archives):
    """The trap docs/protocols.md names: a StreamPredictions2 call with a sequence_id whose client closes its
    side at once (as `StreamPredictions2(iter([request]))` does) ends UNKNOWN, and TorchServe may
    then complete the response stream before the worker's answer, fail sending it, and lose that
    worker for good: it stays listed READY under its old pid while requests queue for it.
    On a copy of tiny_score: each call ends UNKNOWN and either leaves the worker as it was or loses
    it so; unregistering and registering again brings the model back; tiny_score never notices."""
    import shutil

    server, client = served
    shutil.copy(archives["store"] / "tiny_score.mar", archives["store"] / "tiny_sp2.mar")
    server.register("tiny_sp2.mar", name="tiny_sp2")
    expected = server.predict("tiny_sp2", SCORE)[1]
    before = client.workers("tiny_sp2")
    stub, channel = client.fresh_inference()
    outcomes = []
    try:
        for i in range(6):
            with pytest.raises(client.grpc.RpcError) as raised:
                list(
                    stub.StreamPredictions2(
                        iter([client.request("tiny_sp2", SCORE, sequence_id=f"early-{i}")]), timeout=60
                    )
                )
            assert raised.value.code() == client.grpc.StatusCode.UNKNOWN
            time.sleep(0.5)
            try:
                answered = http(
                    "POST",
                    f"{server.inference}/predictions/tiny_sp2",
                    SCORE,
                    {"Content-Type": "application/json"},
                    timeout=5,
                ) == (200, expected)
            except TimeoutError:
                answered = False
            assert client.workers("tiny_sp2") == before  # listed as it was, lost or not
            outcomes.append("dropped" if answered else "worker lost")
            if not answered:
                break
        print(f"\nStreamPredictions2 with a sequence_id, client side closed at once: {outcomes}")
    finally:
        channel.close()
        assert http("DELETE", f"{server.management}/models/tiny_sp2", timeout=60)[0] == 200
    server.register("tiny_sp2.mar", name="tiny_sp2")
    assert server.predict("tiny_sp2", SCORE) == (200, expected)
    assert http("DELETE", f"{server.management}/models/tiny_sp2", timeout=60)[0] == 200
    assert server.predict("tiny_score", SCORE) == (200, expected)


def test_the_handler_marks_grpc_replies_and_fails_only_an_all_grpc_batch(archives):
    """The handler's rule, on TorchServe's Context as a mock (tests/mock_ts.py), for the batch
    mixes a live server makes only by chance: a request with no headers (gRPC) gets
    ts_stream_next=false and a REST one never does; a batch is failed with one error only when its
    requests all came through gRPC and all got that error."""
    from mock_ts import MockContext
    from ts.utils.util import PredictionException

    from handlers.slm_handler import SlmHandler
    from slm_core.serving import ServingSpec

    rest = {"Content-Type": "application/json", "Content-Length": "13"}
    config = ServingSpec("cpu", 1, 3, 30).model_config()
    handler = SlmHandler()
    handler.initialize(MockContext(archives["tiny_score"], config))
    bad, other = {"body": b'{"texts": []}'}, {"body": b"not json"}

    ctx = MockContext(archives["tiny_score"], config, [{}, rest, {}])
    out = handler.handle([bad, bad, {"body": SCORE}], ctx)
    assert [ctx.status[i][0] for i in range(3)] == [400, 400, 200] and out[0] == out[1]
    assert [ctx.headers[i].get("ts_stream_next") for i in range(3)] == ["false", None, "false"]
    for batch in ([bad, other], [bad, {"body": SCORE}]):  # gRPC only, but different replies
        ctx = MockContext(archives["tiny_score"], config, [{}, {}])
        handler.handle(batch, ctx)
        assert [ctx.headers[i]["ts_stream_next"] for i in range(2)] == ["false", "false"]
    ctx = MockContext(archives["tiny_score"], config, [rest, rest])
    handler.handle([bad, bad], ctx)  # REST: each its own 400, as ever
    assert [ctx.status[i][0] for i in range(2)] == [400, 400] and "ts_stream_next" not in ctx.headers[0]
    for batch in ([bad], [bad, bad]):
        with pytest.raises(PredictionException) as raised:
            handler.handle(batch, MockContext(archives["tiny_score"], config, [{}] * len(batch)))
        assert raised.value.error_code == 400 and "'texts' is empty" in json.loads(raised.value.message)["error"]


@pytest.mark.slow
def test_the_demo_archives_answer_through_grpc(stubs, demo, tmp_path):
    """The demo's SmolLM2 archives (CPU) through gRPC: Predictions and StreamPredictions answer the
    REST bytes, four streams in a row leave the worker as it was."""
    (tmp_path / "ts").mkdir()
    server = TorchServe(tmp_path / "ts", demo[0] / "model-store").start()
    client = None
    try:
        server.register("smollm2_intent.mar")
        server.register("smollm2_complete.mar")
        client = Grpc(server, stubs)
        for model, body in (
            ("smollm2_intent", b'{"texts": ["cheap flights to rome", "iphone 15 case"]}'),
            ("smollm2_complete", b'{"prompt": "cheap flights to"}'),
        ):
            status, expected = server.predict(model, body)
            assert status == 200, expected
            assert client.inference.Predictions(client.request(model, body), timeout=120).prediction == expected
            before = client.workers(model)
            for _ in range(4):
                assert [
                    m.prediction for m in client.inference.StreamPredictions(client.request(model, body), timeout=120)
                ] == [expected]
            assert client.workers(model) == before
            assert http(
                "POST", f"{server.inference}/predictions/{model}", body, {"Content-Type": "application/json"}
            ) == (200, expected)
    finally:
        if client is not None:
            for channel in client.channels:
                channel.close()
        server.stop()
