#!/usr/bin/env python3
"""KServe's REST and gRPC endpoints in front of one replica's TorchServe (deploy/serve.sh, KSERVE_GATEWAY=1).

TorchServe 0.12 passes KServe's inference calls to the handler, which reads KServe v1 and Open
Inference Protocol v2 bodies, but it answers 404 to the readiness and metadata endpoints that
KServe's and Triton's clients ask first. This gateway answers those from TorchServe's management
API and proxies the rest to TorchServe's inference address, bodies and headers as they are.
KServe's TorchServe runtime and TorchServe's service_envelope=kserve/kservev2 are not used: the
archives are built on the serving GPU at first start, and the envelopes are batch-unsafe (they
fail on this handler's batches).

It also serves the Open Inference Protocol over gRPC (`inference.GRPCInferenceService`, as
KServe's and Triton's gRPC clients call it): each ModelInfer is one REST request to TorchServe
(its tensors as Triton's binary extension), so each gets its own status, whatever it shares a
batch with: 400 -> INVALID_ARGUMENT, 503 (a full queue) -> RESOURCE_EXHAUSTED, 504 (a deadline)
-> DEADLINE_EXCEEDED, 404 -> NOT_FOUND, 500 -> INTERNAL. A call's gRPC deadline becomes its
X-Slm-Deadline-Ms, and the answer's X-Slm-* headers come back as trailing metadata. TorchServe's
own gRPC API cannot do this: it gives a request in a batch with others no status of its own.

    python3 deploy/kserve_gateway.py

Settings (environment, defaults in brackets): GATEWAY_ADDRESS [0.0.0.0:8080], GRPC_ADDRESS
[0.0.0.0:8090; empty: no gRPC], INFERENCE [http://127.0.0.1:8085: TorchServe's inference address
behind it], MANAGEMENT [http://127.0.0.1:8081]. It measures nothing: TorchServe's metrics count
every request it passes.
"""

import asyncio
import json
import logging
import os
import re
import time
from importlib import metadata
from typing import Any
from urllib.parse import quote

import aiohttp
from aiohttp import web
from drain import drain_file  # deploy/drain.py, beside this file
from multidict import CIMultiDict
from ready import unready  # deploy/ready.py, beside this file
from yarl import URL

MAX_BODY = 17 * 2**20  # TorchServe's max_request_size (16 MiB) and a margin: it answers 413 itself below
READ_S = 180.0  # above TorchServe's default responseTimeout (120 s), after which it answers itself
BODY_S = 60.0  # a request's body arrives within this (16 MiB at 0.3 MB/s), or the request is a 408
STATE_S = 1.0  # readiness probes and clients' polls reach the management API at most once a second
METADATA_S = 300.0  # a registered version's description does not change
DRAINING = "draining: the replica is stopping (deploy/drain.py)"
# torch-model-archiver's model names, and versions alike: TorchServe decodes a path before it splits
# it, so a name holding "/" (%2F) would reach another resource (the model list, another version)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,199}")
CACHED = 4096  # management answers kept at most (one per registered model and version: far fewer)
HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host", "content-length", "expect"}


def reply(status: int, body: dict) -> web.Response:
    # exactly application/json: KServe's client reads an error's text only then
    return web.Response(status=status, body=json.dumps(body).encode(), content_type="application/json")


def error(status: int, message: str, **extra: Any) -> web.Response:
    return reply(status, {**extra, "error": message[:500]})


def error_body(message: str) -> bytes:
    return json.dumps({"error": message[:500]}).encode()


def end_to_end(headers) -> CIMultiDict:
    """The headers a proxy passes on: not the hop-by-hop ones, nor those Connection names."""
    named = {h.strip().lower() for h in headers.get("Connection", "").split(",")}
    return CIMultiDict(
        (k, v) for k, v in headers.items() if k.lower() not in HOP | named and not k.lower().startswith("proxy-")
    )


def named(name: str, version: "str | None") -> bool:
    """Whether a path's model name and version can be a registered model's (NAME)."""
    return NAME.fullmatch(name) is not None and (version is None or NAME.fullmatch(version) is not None)


def unregistered(name: str, version: "str | None") -> str:
    return f"model {name[:200]}{f' version {version[:200]}' if version else ''} is not registered"


def path(*parts: "str | None") -> str:
    return "".join(f"/{quote(p, safe='')}" for p in parts if p)


class Unavailable(Exception):
    """The management API did not answer, or not as it does when up."""


class Gateway:
    def __init__(self, inference: str, management: str):
        self.inference, self.management = inference.rstrip("/"), management.rstrip("/")
        self.cache: dict[str, tuple[float, Any]] = {}
        self.session: aiohttp.ClientSession | None = None

    async def connect(self, app: web.Application):
        """One keep-alive pool for the app's life, unbounded: TorchServe's job queue is the bound
        (503 when full). Requests go with their own headers only, none of aiohttp's defaults, and
        answers come back as they are, never decompressed on the way."""
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=2, sock_read=READ_S),
            skip_auto_headers=("Accept", "Accept-Encoding", "Content-Type", "User-Agent"),
        )
        yield
        await self.session.close()

    async def manage(self, url: str, ttl: float, timeout: float = 2.0, may_miss: bool = False) -> tuple[int, Any]:
        """(status, JSON) of a management GET: 200, kept for `ttl` s, or 404 if it `may_miss`."""
        hit = self.cache.get(url)
        if hit and time.monotonic() - hit[0] < ttl:
            return 200, hit[1]
        try:
            async with self.session.get(self.management + url, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                status, body = r.status, await r.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            raise Unavailable(f"TorchServe's management API at {self.management}: {e!r}") from e
        if status == 200:
            if len(self.cache) >= CACHED:  # never reached by names TorchServe knows; a bound all the same
                self.cache.clear()
            self.cache[url] = (time.monotonic(), body)
        elif status != 404 or not may_miss:
            raise Unavailable(f"TorchServe's management API: {status} for {url}")
        return status, body

    async def describe(self, name: str, version: "str | None") -> tuple[int, Any]:
        """(200, describe-model of the version, the default one for None) or (404, why)."""
        if not named(name, version):
            return 404, unregistered(name, version)
        status, body = await self.manage(path("models", name, version), STATE_S, may_miss=True)
        if status == 404:
            return 404, unregistered(name, version)
        if not (isinstance(body, list) and body and isinstance(body[0], dict)):
            raise Unavailable(f"TorchServe's management API: no description of {name} ({json.dumps(body)[:100]})")
        return 200, body[0]

    async def names(self) -> list[str]:
        names, token = [], "0"
        while token:
            _, page = await self.manage(f"/models?limit=100&next_page_token={token}", STATE_S)
            names += [m["modelName"] for m in page["models"]]
            token = page.get("nextPageToken")
        return names

    async def why_unready(self, name: str, version: "str | None" = None) -> "tuple[int, str | None]":
        """(404, why) for an unknown model; else (200, None) when it serves, or (503, why not)."""
        status, described = await self.describe(name, version)
        if status != 200:
            return status, described
        if drain_file().exists():
            return 503, DRAINING
        reason = unready(name, described.get("workers", []))
        return (503, reason) if reason else (200, None)

    async def v1_models(self, request: web.Request) -> web.Response:
        return reply(200, {"models": await self.names()})

    async def model_ready(self, request: web.Request) -> web.Response:
        name, version = request.match_info["name"], request.match_info.get("version")
        status, why = await self.why_unready(name, version)
        if status == 404:
            return error(404, why)
        return reply(200, {"name": name, "ready": True}) if why is None else error(503, why, name=name, ready=False)

    async def unready_reasons(self) -> list[str]:
        """Why the server is not ready (draining, no model, a model without a ready worker); [] when it is."""
        if drain_file().exists():
            return [DRAINING]
        names = await self.names()
        found = await asyncio.gather(*(self.why_unready(name) for name in names))
        return [why for _, why in found if why] or ([] if names else ["no model registered"])

    async def server_ready(self, request: web.Request) -> web.Response:
        reasons = await self.unready_reasons()
        return error(503, "; ".join(reasons), ready=False) if reasons else reply(200, {"ready": True})

    async def model_metadata(self, name: str, version: "str | None") -> tuple[int, Any]:
        """(200, v2 model metadata) or (404, why). The tensors come from the handler's description
        (describe-model ?customized=true, which TorchServe nests as an object), under its "kserve"
        key; kept per version. A worker answers it, after the requests queued for the model."""
        status, described = await self.describe(name, version)
        if status != 200:
            return status, described
        _, versions = await self.manage(path("models", name, "all"), STATE_S)
        _, [custom] = await self.manage(
            path("models", name, described["modelVersion"]) + "?customized=true", METADATA_S, timeout=10.0
        )
        tensors = (custom.get("customizedMetadata") or {}).get("kserve") or {}
        return 200, {
            "name": name,
            "versions": [v["modelVersion"] for v in versions],
            "platform": "slm-serve",
            "inputs": tensors.get("inputs", []),
            "outputs": tensors.get("outputs", []),
        }

    async def v2_metadata(self, request: web.Request) -> web.Response:
        status, body = await self.model_metadata(request.match_info["name"], request.match_info.get("version"))
        return reply(200, body) if status == 200 else error(status, body)

    async def forward(
        self, method: str, target: str, body: "bytes | None", headers, timeout: "float | None" = None
    ) -> tuple[int, "str | None", bytes, Any]:
        """(status, reason, body, headers) of TorchServe's answer to `target`; the gateway's own
        KServe error (502; 504 past READ_S or `timeout` s) when TorchServe does not answer."""
        try:
            async with self.session.request(
                method,
                URL(self.inference + target, encoded=True),
                data=body,
                headers=headers,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=timeout, sock_connect=2, sock_read=READ_S),
            ) as r:
                return r.status, r.reason, await r.read(), r.headers
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:  # not listening
            return 502, None, error_body(f"TorchServe at {self.inference}: {e!r}"), {}
        except TimeoutError:
            return 504, None, error_body(f"TorchServe at {self.inference} did not answer in time"), {}
        except aiohttp.ClientError as e:
            return 502, None, error_body(f"TorchServe at {self.inference}: {e!r}"), {}

    async def proxy(self, request: web.Request) -> web.Response:
        """To TorchServe's inference address: KServe's inference paths become /predictions/NAME[/V]
        (TorchServe has no route for a versioned v2 call), any other is passed as it is."""
        target = request.raw_path
        if "name" in request.match_info:
            name, version = request.match_info["name"], request.match_info.get("version")
            if not named(name, version):
                return error(404, unregistered(name, version))
            target = path("predictions", name, version)
            target += f"?{request.query_string}" if request.query_string else ""
        if (request.content_length or 0) > MAX_BODY:
            return error(413, f"a request body is at most {MAX_BODY} bytes")
        try:
            body = await asyncio.wait_for(request.read(), BODY_S)
        except web.HTTPRequestEntityTooLarge:  # a chunked one
            return error(413, f"a request body is at most {MAX_BODY} bytes")
        except TimeoutError:  # shorter than its Content-Length, or a client that stalls
            return error(408, f"the request body did not arrive within {BODY_S:g} s")
        status, reason, answer, headers = await self.forward(
            request.method, target, body or None, end_to_end(request.headers)
        )
        if "name" in request.match_info and status >= 400:
            refusal = torchserve_refusal(answer)
            if refusal is not None:  # TorchServe's own (an unknown model, a full queue): KServe's shape
                return error(status, refusal)
        if not headers:  # the gateway's own error
            return reply(status, json.loads(answer))
        return web.Response(status=status, reason=reason or None, body=answer, headers=end_to_end(headers))


def torchserve_refusal(body: bytes) -> "str | None":
    """The message of an error TorchServe itself answered ({"code", "type", "message"}), or None
    for any other body (the handler's errors are KServe's {"error": ...} already)."""
    try:
        answer = json.loads(body)
    except ValueError:
        return None
    if isinstance(answer, dict) and "error" not in answer and isinstance(answer.get("message"), str):
        return answer["message"]
    return None


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error as KServe's {"error": ...}: unknown routes, wrong methods, the management API down."""
    try:
        return await handler(request)
    except Unavailable as e:
        return error(503, str(e))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        response = error(e.status, f"{e.reason}: {request.method} {request.path[:200]}")
        if "Allow" in e.headers:
            response.headers["Allow"] = e.headers["Allow"]
        return response
    except Exception as e:  # a bug here: logged, and still answered in KServe's shape
        logging.getLogger("kserve_gateway").exception("%s %s", request.method, request.path)
        return error(500, f"the gateway failed: {e!r}")


def constant(body: dict):
    async def answer(request: web.Request) -> web.Response:
        return reply(200, body)

    return answer


def server_version() -> str:
    try:
        return metadata.version("slm-serve")
    except metadata.PackageNotFoundError:
        return "unknown"


def make_app(inference: str, management: str, grpc_address: str = "") -> web.Application:
    """The REST routes, and with `grpc_address` the Open Inference Protocol's gRPC service beside
    them (deploy/kserve_grpc.py)."""
    gateway = Gateway(inference, management)
    version = server_version()
    name, ver = "{name:[^/:]+}", "{version:[^/]+}"
    app = web.Application(client_max_size=MAX_BODY, middlewares=[json_errors])
    app.cleanup_ctx.append(gateway.connect)
    if grpc_address:
        from kserve_grpc import serving  # generates the protocol's stubs: only where gRPC is served

        app.cleanup_ctx.append(serving(gateway, grpc_address))
    app.add_routes(
        [
            web.get("/", constant({"status": "alive"})),
            web.get("/v1/models", gateway.v1_models),
            web.get(f"/v1/models/{name}", gateway.model_ready),
            web.post(f"/v1/models/{name}:predict", gateway.proxy),
            web.get("/v2", constant({"name": "slm-serve", "version": version, "extensions": ["binary_tensor_data"]})),
            web.get("/v2/health/live", constant({"live": True})),
            web.get("/v2/health/ready", gateway.server_ready),
            web.get(f"/v2/models/{name}", gateway.v2_metadata),
            web.get(f"/v2/models/{name}/versions/{ver}", gateway.v2_metadata),
            web.get(f"/v2/models/{name}/ready", gateway.model_ready),
            web.get(f"/v2/models/{name}/versions/{ver}/ready", gateway.model_ready),
            web.post(f"/v2/models/{name}/infer", gateway.proxy),
            web.post(f"/v2/models/{name}/versions/{ver}/infer", gateway.proxy),
            # any path outside /v1 and /v2 is TorchServe's (/predictions, /ping, ...); inside, 404 or 405
            web.route("*", r"/{tail:(?!v[12](?:/|$)).*}", gateway.proxy),
        ]
    )
    return app


def main() -> None:
    host, port = os.environ.get("GATEWAY_ADDRESS", "0.0.0.0:8080").rsplit(":", 1)
    inference = os.environ.get("INFERENCE", "http://127.0.0.1:8085")
    management = os.environ.get("MANAGEMENT", "http://127.0.0.1:8081")
    grpc_address = os.environ.get("GRPC_ADDRESS", "0.0.0.0:8090")
    print(
        f"kserve_gateway: on {host}:{port}"
        + (f", gRPC on {grpc_address}" if grpc_address else "")
        + f", TorchServe's inference at {inference}, management at {management}",
        flush=True,
    )
    # auto_decompress off: a compressed body reaches TorchServe as the client sent it
    web.run_app(
        make_app(inference, management, grpc_address),
        host=host,
        port=int(port),
        shutdown_timeout=5,
        access_log=None,
        print=None,
        auto_decompress=False,
    )


if __name__ == "__main__":
    main()
