"""deploy/kserve_gateway.py against a fake TorchServe (its management and inference APIs as far as
the gateway uses them): KServe's endpoints it answers itself, the paths it rewrites, the headers
and bytes it passes both ways, its errors; then KServe's and Triton's own REST clients through it."""

import asyncio
import http.client
import json
import socket
import sys
import threading
import time

import numpy as np
import pytest
from aiohttp import web
from deploy_env import DEPLOY

from handlers.local_server import free_ports

sys.path.insert(0, str(DEPLOY))  # the gateway is a script beside drain.py and ready.py, which it imports
import kserve_gateway  # noqa: E402

TENSORS = {
    "inputs": [{"name": "texts", "datatype": "BYTES", "shape": [-1]}],
    "outputs": [{"name": "scores", "datatype": "FP32", "shape": [-1, 2]}],
}


def v2_echo(model: str, version: str, body: bytes, header_length: "str | None") -> tuple[bytes, "int | None"]:
    """An Open Inference Protocol answer echoing each input as output "echo_NAME", binary data
    (Triton's extension) where the input's was: (body, its JSON header's length or None)."""
    n = int(header_length) if header_length else len(body)
    request, binary = json.loads(body[:n]), body[n:]
    outputs, chunks, offset = [], [], 0
    for tensor in request["inputs"]:
        out = {"name": "echo_" + tensor["name"], "datatype": tensor["datatype"], "shape": tensor["shape"]}
        size = (tensor.get("parameters") or {}).get("binary_data_size")
        if size is None:
            out["data"] = tensor["data"]
        else:
            out["parameters"] = {"binary_data_size": size}
            chunks.append(binary[offset : offset + size])
            offset += size
        outputs.append(out)
    header = json.dumps(
        {"model_name": model, "model_version": version, "id": request.get("id", ""), "outputs": outputs}
    ).encode()
    return header + b"".join(chunks), len(header) if chunks else None


class FakeTorchServe:
    """Models {name: {version: [worker statuses]}} (the first version the default), the handler's
    "kserve" description per model (None: the key left out); records every inference request
    (method, path with query, headers, body) and counts the management calls by path."""

    def __init__(self):
        self.models = {"intent": {"1.0": ["READY"], "2.0": ["READY"]}, "complete": {"1.0": ["READY"]}}
        self.kserve = {"intent": TENSORS, "complete": None}
        self.got: list[tuple[str, str, dict, bytes]] = []
        self.calls: dict[str, int] = {}

    def describe(self, name: str, version: str, customized: bool) -> dict:
        out = {
            "modelName": name,
            "modelVersion": version,
            "modelUrl": f"{name}.mar",
            "workers": [{"id": str(9000 + i), "status": s} for i, s in enumerate(self.models[name][version])],
            "jobQueueStatus": {"remainingCapacity": 100, "pendingRequests": 0},
        }
        if customized:  # TorchServe nests the handler's JSON object
            out["customizedMetadata"] = {"task": {"task": "score"}} | (
                {"kserve": self.kserve[name]} if self.kserve[name] else {}
            )
        return out

    async def management(self, request: web.Request) -> web.Response:
        self.calls[request.path_qs] = self.calls.get(request.path_qs, 0) + 1
        parts = request.path.strip("/").split("/")
        if parts == ["models"]:
            return web.json_response({"models": [{"modelName": n, "modelUrl": f"{n}.mar"} for n in self.models]})
        name = parts[1]
        if name not in self.models:
            return web.json_response({"code": 404, "message": f"Model not found: {name}"}, status=404)
        versions = self.models[name]
        version = parts[2] if len(parts) > 2 else next(iter(versions))
        if version == "all":
            return web.json_response([self.describe(name, v, False) for v in versions])
        if version not in versions:
            return web.json_response({"code": 404, "message": f"Model version {version} not found"}, status=404)
        return web.json_response([self.describe(name, version, request.query.get("customized") == "true")])

    async def inference(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.got.append((request.method, request.path_qs, dict(request.headers), body))
        if request.path == "/ping":
            return web.json_response({"status": "Healthy"})
        name, version = request.match_info["name"], request.match_info.get("version", "1.0")
        if name not in self.models:
            return web.json_response({"code": 404, "message": f"Model not found: {name}"}, status=404)
        headers = {"X-Slm-Queue-Ms": "3", "Proxy-Authenticate": "Basic", "Keep-Alive": "timeout=99"}
        if request.content_type == "application/json" and b'"instances"' in body:
            return web.json_response({"predictions": json.loads(body)["instances"]}, headers=headers)
        if b'"inputs"' in body:
            answer, length = v2_echo(name, version, body, request.headers.get("Inference-Header-Content-Length"))
            if length is not None:
                headers["Inference-Header-Content-Length"] = str(length)
            return web.Response(
                body=answer, headers=headers, content_type="application/octet-stream" if length else "application/json"
            )
        return web.Response(body=body, headers=headers, content_type=request.content_type)


def serve(loop: asyncio.AbstractEventLoop, app: web.Application, port: int = 0, **kwargs) -> tuple[web.AppRunner, int]:
    async def start():
        runner = web.AppRunner(app, access_log=None, **kwargs)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner, runner.addresses[0][1]

    return asyncio.run_coroutine_threadsafe(start(), loop).result(10)


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runners: list[web.AppRunner] = []
    yield loop, runners
    for runner in runners:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def start_gateway(loop, inference: str, management: str) -> int:
    loop, runners = loop
    runner, port = serve(loop, kserve_gateway.make_app(inference, management), auto_decompress=False)
    runners.append(runner)
    return port


@pytest.fixture
def stack(loop, tmp_path, monkeypatch):
    """(gateway port, the fake TorchServe, the drain file); the management answers uncached."""
    monkeypatch.setenv("DRAIN_FILE", str(tmp_path / "draining"))
    monkeypatch.setattr(kserve_gateway, "STATE_S", 0.0)
    fake = FakeTorchServe()
    management, inference = web.Application(), web.Application(client_max_size=64 * 2**20)
    management.router.add_get("/{tail:.*}", fake.management)
    for path in ("/ping", "/predictions/{name}", "/predictions/{name}/{version}"):
        inference.router.add_route("*", path, fake.inference)
    ports = []
    for app in (management, inference):
        runner, port = serve(loop[0], app)
        loop[1].append(runner)
        ports.append(port)
    port = start_gateway(loop, f"http://127.0.0.1:{ports[1]}", f"http://127.0.0.1:{ports[0]}")
    return port, fake, tmp_path / "draining"


def call(
    port: int, method: str, path: str, body: "bytes | None" = None, headers: "dict | None" = None, timeout: float = 5
) -> tuple[int, dict, bytes]:
    """(status, headers with lower-case names, body), the request's headers exactly as given."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body, headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def get(port: int, path: str) -> tuple[int, dict]:
    status, headers, body = call(port, "GET", path)
    assert headers["content-type"] == "application/json", headers
    return status, json.loads(body)


def test_answers_kserve_liveness_listing_and_server_metadata(stack):
    port, _, _ = stack
    assert get(port, "/") == (200, {"status": "alive"})
    assert get(port, "/v2/health/live") == (200, {"live": True})
    assert get(port, "/v1/models") == (200, {"models": ["intent", "complete"]})
    status, server = get(port, "/v2")
    assert status == 200 and server["name"] == "slm-serve" and server["extensions"] == ["binary_tensor_data"]
    assert server["version"] == kserve_gateway.metadata.version("slm-serve")


def test_readiness_follows_the_workers_and_the_drain(stack):
    port, fake, draining = stack
    assert get(port, "/v1/models/intent") == (200, {"name": "intent", "ready": True})
    assert get(port, "/v2/models/intent/ready") == (200, {"name": "intent", "ready": True})
    assert get(port, "/v2/models/intent/versions/2.0/ready") == (200, {"name": "intent", "ready": True})
    assert get(port, "/v2/health/ready") == (200, {"ready": True})

    fake.models["intent"]["1.0"] = ["UNLOADING"]  # the default version's only worker restarting
    status, body = get(port, "/v1/models/intent")
    assert status == 503 and body["ready"] is False and body["name"] == "intent"
    assert "0 of 1 workers READY (UNLOADING)" in body["error"]
    assert get(port, "/v2/models/intent/ready")[0] == 503
    assert get(port, "/v2/models/intent/versions/2.0/ready")[0] == 200  # another version's worker
    status, body = get(port, "/v2/health/ready")
    assert status == 503 and body["ready"] is False and body["error"].startswith("intent:")
    fake.models["intent"]["1.0"] = []
    assert "none started" in get(port, "/v2/models/intent/ready")[1]["error"]
    fake.models["intent"]["1.0"] = ["UNLOADING", "READY"]  # one READY worker is enough
    assert get(port, "/v2/health/ready")[0] == 200

    draining.touch()
    for path in ("/v1/models/intent", "/v2/models/intent/ready", "/v2/health/ready"):
        status, body = get(port, path)
        assert status == 503 and body["ready"] is False and "draining" in body["error"], path
    assert get(port, "/v2/health/live") == (200, {"live": True})  # alive while it drains


@pytest.mark.parametrize(
    "path",
    [
        "/v1/models/ghost",
        "/v2/models/ghost/ready",
        "/v2/models/ghost",
        "/v2/models/intent/versions/9.9",
        "/v2/models/intent/versions/9.9/ready",
    ],
)
def test_an_unknown_model_or_version_is_404(stack, path):
    status, body = get(stack[0], path)
    assert status == 404 and "is not registered" in body["error"]


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/v2/models/%2F"),
        ("GET", "/v2/models/intent%2F2.0/ready"),
        ("GET", "/v1/models/..%2Fmodels"),
        ("GET", "/v2/models/intent/versions/1.0%2F..%2F2.0"),
        ("POST", "/v2/models/%2F/infer"),
        ("POST", "/v1/models/intent%2F2.0:predict"),
        ("POST", "/v2/models/intent/versions/%2E%2E/infer"),
    ],
)
def test_a_name_no_model_can_have_is_404_and_reaches_nothing(stack, method, path):
    """TorchServe decodes a path before it splits it: "/models/%2F" is its model list, and
    "intent%2F2.0" another version. The gateway answers such names itself, as torch-model-archiver
    would refuse them, and asks TorchServe nothing."""
    port, fake, _ = stack
    status, _, body = call(port, method, path, b'{"texts": ["a"]}' if method == "POST" else None)
    assert status == 404 and "is not registered" in json.loads(body)["error"], body
    assert fake.calls == {} and fake.got == []


@pytest.mark.parametrize("bound, asked", [(4096, 3), (2, 6)])
def test_the_kept_management_answers_are_bounded(stack, monkeypatch, bound, asked):
    """The gateway keeps at most CACHED management answers: at the bound it forgets them all and
    asks again, instead of growing."""
    port, fake, _ = stack
    monkeypatch.setattr(kserve_gateway, "STATE_S", 60.0)
    monkeypatch.setattr(kserve_gateway, "CACHED", bound)
    for path in ("/v1/models/intent", "/v1/models/complete", "/v2/models/intent/versions/2.0/ready") * 2:
        assert get(port, path) == (200, {"name": path.split("/")[3], "ready": True})
    assert sum(fake.calls.values()) == asked, fake.calls


def test_v2_model_metadata_from_the_handlers_description(stack):
    port, fake, _ = stack
    expected = {"name": "intent", "versions": ["1.0", "2.0"], "platform": "slm-serve", **TENSORS}
    assert get(port, "/v2/models/intent") == (200, expected)
    assert get(port, "/v2/models/intent/versions/2.0") == (200, expected)
    # a description without the "kserve" key: no tensors to name
    assert get(port, "/v2/models/complete") == (
        200,
        {"name": "complete", "versions": ["1.0"], "platform": "slm-serve", "inputs": [], "outputs": []},
    )
    get(port, "/v2/models/intent")
    # the description (a worker answers it) once per version; the state each time (STATE_S 0 here)
    assert fake.calls["/models/intent/1.0?customized=true"] == 1
    assert fake.calls["/models/intent/2.0?customized=true"] == 1
    assert fake.calls["/models/intent"] == 2 and fake.calls["/models/intent/2.0"] == 1


def test_management_answers_are_kept_for_a_second(stack, monkeypatch):
    port, fake, _ = stack
    monkeypatch.setattr(kserve_gateway, "STATE_S", 60.0)
    for _ in range(10):
        assert get(port, "/v2/health/ready")[0] == 200
        assert get(port, "/v1/models/intent")[0] == 200
    assert fake.calls == {"/models?limit=100&next_page_token=0": 1, "/models/intent": 1, "/models/complete": 1}
    fake.models["intent"]["1.0"] = ["UNLOADING"]
    assert get(port, "/v1/models/intent")[0] == 200  # the kept answer
    monkeypatch.setattr(kserve_gateway, "STATE_S", 0.0)
    assert get(port, "/v1/models/intent")[0] == 503


@pytest.mark.parametrize(
    "method, path, reaches",
    [
        ("POST", "/v1/models/intent:predict", "/predictions/intent"),
        ("POST", "/v2/models/intent/infer", "/predictions/intent"),
        ("POST", "/v2/models/intent/versions/2.0/infer", "/predictions/intent/2.0"),
        ("POST", "/v2/models/intent/infer?trace=1", "/predictions/intent?trace=1"),
        ("POST", "/predictions/intent", "/predictions/intent"),
        ("POST", "/predictions/intent/1.0?x=%2F", "/predictions/intent/1.0?x=%2F"),
        ("GET", "/ping", "/ping"),
    ],
)
def test_rewrites_kserve_inference_paths_to_predictions(stack, method, path, reaches):
    port, fake, _ = stack
    body = b'{"texts": ["cheap flights"]}' if method == "POST" else None
    status, _, answer = call(port, method, path, body, {"Content-Type": "application/json"} if body else {})
    assert status == 200, answer
    [(got_method, got_path, _, got_body)] = fake.got
    assert (got_method, got_path, got_body) == (method, reaches, body or b"")


def test_passes_headers_and_binary_bytes_both_ways(stack):
    port, fake, _ = stack
    header = json.dumps(
        {"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 256}}]}
    ).encode()
    raw = bytes(range(256))  # every byte value, NUL and invalid UTF-8 among them
    status, headers, answer = call(
        port,
        "POST",
        "/v2/models/intent/infer",
        header + raw,
        {
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": str(len(header)),
            "X-Slm-Deadline-Ms": "50",
            "Connection": "keep-alive, X-Hop",
            "X-Hop": "1",
            "Keep-Alive": "timeout=5",
            "Proxy-Authorization": "Basic eA==",
            "TE": "trailers",
        },
    )
    assert status == 200
    [(_, _, sent, body)] = fake.got
    sent = {k.lower(): v for k, v in sent.items()}
    assert body == header + raw
    assert sent["x-slm-deadline-ms"] == "50" and sent["inference-header-content-length"] == str(len(header))
    assert sent["content-type"] == "application/octet-stream"
    # no hop-by-hop header, none added (http.client sends Accept-Encoding: identity itself)
    assert (
        set(sent)
        == {
            "host",
            "content-length",
            "content-type",
            "inference-header-content-length",
            "x-slm-deadline-ms",
            "accept-encoding",
        }
        and sent["accept-encoding"] == "identity"
    )
    # back: TorchServe's headers, less the hop-by-hop ones
    length = int(headers["inference-header-content-length"])
    assert json.loads(answer[:length])["outputs"][0]["parameters"] == {"binary_data_size": 256}
    assert answer[length:] == raw
    assert headers["x-slm-queue-ms"] == "3" and headers["content-type"] == "application/octet-stream"
    assert "proxy-authenticate" not in headers and headers.get("keep-alive") != "timeout=99"


def test_a_body_past_torchserves_bound_is_413_and_below_it_passes_whole(stack):
    port, fake, _ = stack
    big = bytes(range(256)) * (2 * 2**20 // 256)  # 2 MiB, over aiohttp's default bound of 1 MiB
    status, _, answer = call(port, "POST", "/predictions/intent", big, {"Content-Type": "application/octet-stream"})
    assert status == 200 and answer == big and fake.got[0][3] == big
    over = b"x" * (kserve_gateway.MAX_BODY + 1)
    # with a Content-Length, and chunked (none: http.client sends an iterable so)
    for body in (over, iter([over[: 2**20]] * (len(over) // 2**20 + 1))):
        status, headers, answer = call(port, "POST", "/predictions/intent", body)
        assert status == 413 and "at most" in json.loads(answer)["error"]
    assert len(fake.got) == 1  # neither reached TorchServe


def test_a_body_that_does_not_arrive_is_408_and_reaches_nothing(stack, monkeypatch):
    """A body shorter than its Content-Length, or one that stalls: the gateway answers 408 after
    BODY_S instead of holding the connection (TorchServe would hold it until the client goes)."""
    port, fake, _ = stack
    monkeypatch.setattr(kserve_gateway, "BODY_S", 0.5)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v2/models/intent/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        start = time.monotonic()
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.5 s" in answer, answer
    assert time.monotonic() - start < 5 and fake.got == []


@pytest.mark.parametrize(
    "method, path, status",
    [
        ("GET", "/v2/nothing", 404),
        ("GET", "/v1", 404),
        ("GET", "/v2/models/intent/config", 404),
        ("PUT", "/v2/models/intent/infer", 405),
        ("GET", "/v1/models/intent:predict", 405),
        ("DELETE", "/v2/health/live", 405),
        ("POST", "/v2/health/ready", 405),
    ],
)
def test_other_kserve_paths_are_json_errors(stack, method, path, status):
    port, fake, _ = stack
    got, headers, body = call(port, method, path, b"{}" if method in ("POST", "PUT") else None)
    assert got == status and headers["content-type"] == "application/json"
    assert set(json.loads(body)) == {"error"}
    assert fake.got == []


def test_errors_are_bounded(stack):
    status, body = get(stack[0], "/v1/models/" + "a" * 5000)
    assert status == 404 and len(body["error"]) <= 500


def test_torchserves_own_refusals_on_kserve_paths_are_kserve_errors(stack):
    """A model TorchServe does not know, asked on a KServe path: TorchServe's status with KServe's
    {"error": ...}; on TorchServe's own path its answer passes unchanged."""
    port, _, _ = stack
    for path in ("/v2/models/ghost/infer", "/v1/models/ghost:predict"):
        status, headers, body = call(port, "POST", path, b"{}", {"Content-Type": "application/json"})
        assert status == 404 and json.loads(body) == {"error": "Model not found: ghost"}, (path, body)
        assert headers["content-type"] == "application/json"
    status, _, body = call(port, "POST", "/predictions/ghost", b"{}", {"Content-Type": "application/json"})
    assert status == 404 and json.loads(body) == {"code": 404, "message": "Model not found: ghost"}


def test_torchserve_down_is_answered_at_once(loop, tmp_path, monkeypatch):
    """Nothing listens behind the gateway: every endpoint answers within the client's 5 s, never
    hangs; 502 where it proxies, 503 where it asks the management API."""
    monkeypatch.setenv("DRAIN_FILE", str(tmp_path / "draining"))
    inference, management = free_ports(2)
    port = start_gateway(loop, f"http://127.0.0.1:{inference}", f"http://127.0.0.1:{management}")
    for method, path, expected in [
        ("POST", "/v2/models/intent/infer", 502),
        ("GET", "/ping", 502),
        ("GET", "/v2/health/ready", 503),
        ("GET", "/v1/models/intent", 503),
        ("GET", "/v2/models/intent", 503),
        ("GET", "/v1/models", 503),
    ]:
        status, headers, body = call(port, method, path, b"{}" if method == "POST" else None, timeout=5)
        assert status == expected and "TorchServe" in json.loads(body)["error"], (path, body)
    assert get(port, "/v2/health/live") == (200, {"live": True})


def test_kserve_and_triton_clients(stack):
    """KServe's REST client (v1 and v2) and Triton's HTTP client, as a user runs them: liveness,
    readiness, metadata, and inference with JSON and with binary tensors."""
    import tritonclient.http as triton
    from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig

    port, fake, draining = stack
    base = f"http://127.0.0.1:{port}"

    async def kserve_calls() -> None:
        v1 = InferenceRESTClient(RESTConfig(protocol="v1"))
        assert await v1.is_server_live(base) and await v1.is_model_ready(base, "intent")
        answer = await v1.infer(base, {"instances": [{"texts": ["cheap flights"]}]}, model_name="intent")
        assert answer == {"predictions": [{"texts": ["cheap flights"]}]}
        v2 = InferenceRESTClient(RESTConfig(protocol="v2"))
        assert await v2.is_server_live(base) and await v2.is_server_ready(base)
        assert await v2.is_model_ready(base, "intent")
        tensor = InferInput("texts", [2], "BYTES")
        tensor.set_data_from_numpy(np.array([b"cheap flights", b"iphone case"], dtype=np.object_), binary_data=True)
        result = await v2.infer(base, InferRequest("intent", [tensor]), model_name="intent")
        assert result.outputs[0].as_numpy().tolist() == ["cheap flights", "iphone case"]  # decoded by the client
        draining.touch()
        assert not await v1.is_model_ready(base, "intent") and not await v2.is_model_ready(base, "intent")
        draining.unlink()
        await v1.close()
        await v2.close()

    asyncio.run(kserve_calls())
    client = triton.InferenceServerClient(f"127.0.0.1:{port}")
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("intent")
    assert client.is_model_ready("intent", "2.0") and not client.is_model_ready("ghost")
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    assert client.get_model_metadata("intent")["inputs"] == TENSORS["inputs"]
    texts = triton.InferInput("texts", [2], "BYTES")
    texts.set_data_from_numpy(np.array([b"cheap flights", "caf\u00e9".encode()], dtype=np.object_), binary_data=True)
    scores = triton.InferInput("scores", [1, 2], "FP32")
    scores.set_data_from_numpy(np.array([[0.25, 0.75]], dtype=np.float32), binary_data=False)
    result = client.infer("intent", [texts, scores], model_version="2.0", headers={"X-Slm-Deadline-Ms": "80"})
    assert result.as_numpy("echo_texts").tolist() == [b"cheap flights", "caf\u00e9".encode()]
    assert result.as_numpy("echo_scores").tolist() == [[0.25, 0.75]]
    assert result.get_response()["model_version"] == "2.0"
    method, path, headers, _ = fake.got[-1]
    assert path == "/predictions/intent/2.0" and headers["X-Slm-Deadline-Ms"] == "80"
    assert "Inference-Header-Content-Length" in headers
    client.close()


# --- the Open Inference Protocol over gRPC (deploy/kserve_grpc.py) -----------------------------------
def test_grpc_infer_requests_become_binary_v2_bodies_the_handler_reads():
    """Typed contents and raw_input_contents make the same Triton binary body, which the worker's
    v2 reader decodes to the tensors sent; a v2 JSON answer becomes typed output contents."""
    import kserve_grpc
    from kserve_grpc import BadRequest, deadline_ms, infer_body, infer_response, pb

    from slm_core.serve.kserve import _binary

    typed = pb.ModelInferRequest(model_name="m", id="q-1")
    typed.inputs.add(name="texts", datatype="BYTES", shape=[2]).contents.bytes_contents.extend(
        [b"rome", b"\xc3\xa9t\xc3\xa9"]
    )
    typed.inputs.add(name="top", datatype="INT32", shape=[1]).contents.int_contents.append(3)
    body, n = infer_body(typed)
    header = json.loads(body[:n])
    assert header["id"] == "q-1" and [i["name"] for i in header["inputs"]] == ["texts", "top"]
    sizes = [i["parameters"]["binary_data_size"] for i in header["inputs"]]
    blob = body[n:]
    assert _binary(blob[: sizes[0]], "BYTES", 2, "x") == ["rome", "été"]
    assert _binary(blob[sizes[0] :], "INT32", 1, "x") == [3]
    raw = pb.ModelInferRequest(model_name="m", id="q-1")
    raw.inputs.add(name="texts", datatype="BYTES", shape=[2])
    raw.inputs.add(name="top", datatype="INT32", shape=[1])
    raw.raw_input_contents.extend([blob[: sizes[0]], blob[sizes[0] :]])
    assert infer_body(raw) == (body, n)
    raw.raw_input_contents.pop()
    with pytest.raises(BadRequest, match="raw_input_contents holds 1 tensors for 2 inputs"):
        infer_body(raw)
    half = pb.ModelInferRequest(model_name="m")
    half.inputs.add(name="x", datatype="FP16", shape=[1])
    with pytest.raises(BadRequest, match="'FP16' has no typed contents"):
        infer_body(half)
    out = infer_response(
        {
            "model_name": "m",
            "id": "q-1",
            "outputs": [
                {"name": "labels", "datatype": "BYTES", "shape": [2], "data": ["yes", "no"]},
                {"name": "scores", "datatype": "FP32", "shape": [1, 2], "data": [[0.25, 0.75]]},
                {"name": "token_ids", "datatype": "INT64", "shape": [2], "data": [7, -1]},
            ],
        }
    )
    got = {o.name: (o.datatype, list(o.shape), o.contents) for o in out.outputs}
    assert list(got["labels"][2].bytes_contents) == [b"yes", b"no"]
    assert got["scores"][:2] == ("FP32", [1, 2]) and list(got["scores"][2].fp32_contents) == [0.25, 0.75]
    assert list(got["token_ids"][2].int64_contents) == [7, -1] and out.id == "q-1"
    # the deadline passed on: the sooner of the metadata's and the gRPC deadline's time left
    assert deadline_ms(None, None) is None and deadline_ms("50", None) == "50"
    assert deadline_ms(None, 2.0) == "2000" and deadline_ms("50", 2.0) == "50" and deadline_ms("5000", 2.0) == "2000"
    assert deadline_ms("soon", 2.0) == "soon"  # for the handler's 400
    assert deadline_ms(None, 1e9) == str(kserve_grpc.MAX_DEADLINE_MS)
