"""KServe's clients against a replica as deploy/kserve.yaml runs it: deploy/serve.sh with
KSERVE_GATEWAY=1 and deploy/config.properties, a real TorchServe (CPU) behind the gateway, the
tiny score and beam archives. The kserve SDK's REST client (v1, v2), tritonclient (JSON and binary
tensors) and KServe's gRPC stubs get the answers /predictions gives for the same requests; over
the gateway's gRPC, a bad request among good ones sent at once gets its own error status."""

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import BEAM_TASK, SCORE_TASK
from deploy_env import CONFIG, SERVE, serve_env, stop_replica

from handlers.local_server import free_ports, http

TEXTS = ["cheap flights to rome", "iphone case", "rome"]


@pytest.fixture(scope="module")
def replica(archives, tmp_path_factory):
    """(gateway URL, TorchServe's inference URL, the gateway's gRPC address) of serve.sh serving
    tiny_score and tiny_beam."""
    root = tmp_path_factory.mktemp("kserve")
    (root / "tasks").mkdir()
    for name, task in (("tiny_score", SCORE_TASK), ("tiny_beam", BEAM_TASK)):
        (root / "tasks" / f"{name}.yaml").write_text(yaml.safe_dump(task))
    (root / "store").mkdir()
    for name in ("tiny_score", "tiny_beam"):  # only these: other tests add archives to the shared store
        shutil.copy(archives["store"] / f"{name}.mar", root / "store")
    gateway, inference, management, metrics, grpc_i, grpc_m, workers, grpc_v2 = free_ports(8)
    config = {
        **CONFIG,
        "inference_address": "http://0.0.0.0:1",  # serve.sh moves it (TS_INFERENCE_ADDRESS)
        "management_address": f"http://127.0.0.1:{management}",
        "metrics_address": f"http://127.0.0.1:{metrics}",
        "grpc_inference_port": str(grpc_i),
        "grpc_management_port": str(grpc_m),
        "initial_worker_port": str(workers),
    }
    (root / "ts.properties").write_text("".join(f"{k}={v}\n" for k, v in config.items()))
    (root / "run" / "tmp").mkdir(parents=True)
    bindir = str(Path(sys.executable).parent)
    env = {
        **serve_env(root, "false", str(archives["checkpoint"]), PATH=f"{bindir}:{os.environ['PATH']}"),
        "BUILD_ONLY": "0",
        "KSERVE_GATEWAY": "1",
        "TS_CONFIG": str(root / "ts.properties"),
        "TS_INFERENCE_ADDRESS": f"http://127.0.0.1:{inference}",
        "GATEWAY_ADDRESS": f"127.0.0.1:{gateway}",
        "GRPC_ADDRESS": f"127.0.0.1:{grpc_v2}",
        "MANAGEMENT": f"http://127.0.0.1:{management}",
        "DRAIN_FILE": str(root / "run" / "draining"),
        "TMPDIR": str(root / "run" / "tmp"),
        "LOG_LOCATION": str(root / "run" / "logs"),
        "METRICS_LOCATION": str(root / "run" / "logs"),
    }
    log = open(root / "run" / "stdout.log", "wb")
    proc = subprocess.Popen(
        [str(SERVE)], env=env, cwd=root / "run", stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    base = f"http://127.0.0.1:{gateway}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (root / "run" / "stdout.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "not ready in 300 s"
            with contextlib.suppress(OSError):
                if http("GET", f"{base}/v2/health/ready", timeout=2)[0] == 200:
                    break
            time.sleep(0.5)
        yield base, f"http://127.0.0.1:{inference}", f"127.0.0.1:{grpc_v2}"
    finally:
        stop_replica(proc, timeout=60)
        log.close()


def strings(x) -> str:
    """A BYTES element as the clients give it: str from a JSON answer, bytes from a binary one."""
    return x.decode() if isinstance(x, bytes) else x


def native(base: str, model: str, body: dict) -> dict:
    status, answer = http(
        "POST",
        f"{base}/predictions/{model}",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
        timeout=60,
    )
    assert status == 200, answer
    return json.loads(answer)


@pytest.mark.slow
def test_kserve_sdk_v1_and_v2(replica):
    from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig

    base, straight, _ = replica
    scores = [native(straight, "tiny_score", {"texts": [t]})["scores"][0] for t in TEXTS]
    # TorchServe itself hands KServe's inference routes to the worker, as /predictions
    v1_body = json.dumps({"instances": [{"texts": [t]} for t in TEXTS]}).encode()
    v2_body = json.dumps({"inputs": [{"name": "texts", "datatype": "BYTES", "shape": [3], "data": TEXTS}]}).encode()
    for route, body in (("/v1/models/tiny_score:predict", v1_body), ("/v2/models/tiny_score/infer", v2_body)):
        status, answer = http("POST", straight + route, body, {"Content-Type": "application/json"}, timeout=60)
        assert status == 200, (route, answer)

    async def calls():
        v1 = InferenceRESTClient(RESTConfig(protocol="v1", timeout=60))
        assert await v1.is_server_live(base) and await v1.is_model_ready(base, "tiny_score")
        answer = await v1.infer(base, {"instances": [{"texts": [t]} for t in TEXTS]}, model_name="tiny_score")
        got = [p["scores"][0] for p in answer["predictions"]]
        assert np.allclose(got, scores, atol=1e-5), (got, scores)
        with pytest.raises(Exception, match="instances\\[1\\]: 'texts' must be an array of strings"):
            await v1.infer(base, {"instances": [{"texts": ["a"]}, {"texts": "b"}]}, model_name="tiny_score")
        v2 = InferenceRESTClient(RESTConfig(protocol="v2", timeout=60))
        assert await v2.is_server_ready(base) and await v2.is_model_ready(base, "tiny_beam")
        for binary in (True, False):
            texts = InferInput("texts", [3], "BYTES")
            texts.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=np.object_), binary_data=binary)
            result = await v2.infer(base, InferRequest("tiny_score", [texts]), model_name="tiny_score")
            out = {o.name: o for o in result.outputs}
            assert [strings(x) for x in out["labels"].as_numpy().tolist()] == SCORE_TASK["labels"]
            assert np.allclose(out["scores"].as_numpy(), scores, atol=1e-5)
        await v1.close()
        await v2.close()

    asyncio.run(calls())


@pytest.mark.slow
def test_tritonclient_metadata_binary_tensors_and_errors(replica):
    import tritonclient.http as triton
    from tritonclient.utils import InferenceServerException

    base, straight, _ = replica
    client = triton.InferenceServerClient(base.removeprefix("http://"), network_timeout=60)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("tiny_beam")
    meta = client.get_model_metadata("tiny_beam")
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [
        ("prompt", "BYTES", [1]),
        ("beam_width", "INT32", [1]),
        ("new_tokens", "INT32", [1]),
        ("top", "INT32", [1]),
    ]
    assert [t["name"] for t in meta["outputs"]] == ["text", "token_ids", "score"]
    want = native(straight, "tiny_beam", {"prompt": "rome", "top": 3})["candidates"]
    prompt = triton.InferInput("prompt", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([b"rome"], dtype=np.object_))  # binary, tritonclient's default
    top = triton.InferInput("top", [1], "INT32")
    top.set_data_from_numpy(np.array([3], dtype=np.int32))
    result = client.infer("tiny_beam", [prompt, top], request_id="q-1")
    assert result.get_response()["id"] == "q-1" and result.get_response()["model_name"] == "tiny_beam"
    assert [strings(t) for t in result.as_numpy("text").tolist()] == [c["text"] for c in want]
    ids = result.as_numpy("token_ids")
    assert ids.shape == (len(want), BEAM_TASK["new_tokens"])
    assert [[t for t in row if t >= 0] for row in ids.tolist()] == [c["token_ids"] for c in want]
    assert np.allclose(result.as_numpy("score"), [c["score"] for c in want], atol=1e-4)
    bad = triton.InferInput("top", [1], "INT32")
    bad.set_data_from_numpy(np.array([99], dtype=np.int32))
    with pytest.raises(InferenceServerException, match="'top' must be an integer from 1 to 4"):
        client.infer("tiny_beam", [prompt, bad])
    client.close()


@pytest.mark.slow
def test_grpc_open_inference_gives_each_request_its_own_status(replica):
    """The gateway's Open Inference Protocol over gRPC, called with KServe's own gRPC stubs: its
    health, metadata and ModelInfer answer as /predictions does (typed contents and raw
    contents); bursts of score requests sent at once, one of them bad, share TorchServe's batches
    (x-slm-batch > 1 in the good ones' trailing metadata) and the bad one gets INVALID_ARGUMENT
    with the handler's message every time, the good ones OK with their own answers; a call whose
    deadline its call would miss gets DEADLINE_EXCEEDED with the handler's reason; an unknown
    model NOT_FOUND."""
    import grpc
    from kserve.protocol.grpc import grpc_predict_v2_pb2 as pb
    from kserve.protocol.grpc.grpc_predict_v2_pb2_grpc import GRPCInferenceServiceStub

    _, straight, address = replica
    channel = grpc.insecure_channel(address)
    stub = GRPCInferenceServiceStub(channel)
    assert stub.ServerLive(pb.ServerLiveRequest()).live and stub.ServerReady(pb.ServerReadyRequest()).ready
    assert stub.ModelReady(pb.ModelReadyRequest(name="tiny_score")).ready
    meta = stub.ModelMetadata(pb.ModelMetadataRequest(name="tiny_beam"))
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs][0] == ("prompt", "BYTES", [1])
    want = native(straight, "tiny_beam", {"prompt": "rome", "top": 3})["candidates"]
    for raw in (False, True):
        request = pb.ModelInferRequest(model_name="tiny_beam", id="g-1")
        prompt = request.inputs.add(name="prompt", datatype="BYTES", shape=[1])
        top = request.inputs.add(name="top", datatype="INT32", shape=[1])
        if raw:  # as Triton's binary layout: a 4-byte length, then the bytes
            request.raw_input_contents.extend([len(b"rome").to_bytes(4, "little") + b"rome", np.int32(3).tobytes()])
        else:
            prompt.contents.bytes_contents.append(b"rome")
            top.contents.int_contents.append(3)
        answer = stub.ModelInfer(request)
        out = {o.name: o for o in answer.outputs}
        assert answer.id == "g-1" and answer.model_name == "tiny_beam"
        assert [t.decode() for t in out["text"].contents.bytes_contents] == [c["text"] for c in want]
        assert np.allclose(list(out["score"].contents.fp32_contents), [c["score"] for c in want], atol=1e-4)
    request.ClearField("raw_input_contents")
    request.inputs[0].contents.bytes_contents[:] = [b"rome"]
    request.inputs[1].contents.int_contents[:] = [99]
    with pytest.raises(grpc.RpcError) as bad:
        stub.ModelInfer(request)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'top' must be an integer from 1 to 4" in bad.value.details()
    with pytest.raises(grpc.RpcError) as unknown:
        stub.ModelInfer(pb.ModelInferRequest(model_name="no_such_model"))
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND, unknown.value.details()

    def score(texts: list[str]):
        r = pb.ModelInferRequest(model_name="tiny_score")
        r.inputs.add(name="texts", datatype="BYTES", shape=[len(texts)]).contents.bytes_contents.extend(
            t.encode() for t in texts
        )
        return r

    scores = {t: native(straight, "tiny_score", {"texts": [t]})["scores"][0] for t in TEXTS}
    sent = TEXTS * 2
    shared, rounds = 0, 0
    while rounds < 20 and (rounds < 3 or not shared):  # until a burst's good requests shared a call
        rounds += 1
        calls = [stub.ModelInfer.future(score([t])) for t in sent]
        calls.insert(3, stub.ModelInfer.future(score([])))  # bad: no text
        for k, call in enumerate(calls):
            if k == 3:
                assert call.code() == grpc.StatusCode.INVALID_ARGUMENT, call.code()
                assert "'texts' is empty" in call.details(), call.details()
                continue
            assert call.code() == grpc.StatusCode.OK, (call.code(), call.details())
            out = {o.name: o for o in call.result().outputs}
            assert np.allclose(list(out["scores"].contents.fp32_contents), scores[sent[k - (k > 3)]], atol=1e-5)
            shared += int(dict(call.trailing_metadata()).get("x-slm-batch", "1")) > 1
    assert shared, f"no two requests of {rounds} bursts shared a call"
    # a deadline its call would miss (x-slm-deadline-ms, as REST's header): the handler refuses it
    # before the graph, and the call ends DEADLINE_EXCEEDED with its reason
    with pytest.raises(grpc.RpcError) as refused:
        stub.ModelInfer(score(TEXTS), metadata=(("x-slm-deadline-ms", "0.001"),), timeout=30)
    assert refused.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "not computed" in refused.value.details(), refused.value.details()
    channel.close()
