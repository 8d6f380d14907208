"""The Open Inference Protocol over gRPC (KServe v2 gRPC: `inference.GRPCInferenceService`), served
by deploy/kserve_gateway.py beside its REST routes, over the same TorchServe.

Each ModelInfer is one REST request to TorchServe's /predictions/NAME[/VERSION], its tensors in
Triton's binary extension (raw_input_contents as they are; typed contents laid out the same way),
so that the handler reads and checks it as any v2 request, and each call gets its own status
whatever it shares a batch with. The answer's v2 JSON becomes the typed contents of its outputs,
its X-Slm-* headers the call's trailing metadata. A call's deadline is the sooner of its gRPC
deadline and its `x-slm-deadline-ms` metadata (REST's X-Slm-Deadline-Ms).
"""

import json
import struct
from typing import Any

import grpc
import numpy as np
from kserve_gateway import named, path, server_version, torchserve_refusal, unregistered
from open_inference import METHODS, SERVICE, pb  # deploy/open_inference.py, beside this file

# HTTP status -> gRPC status code of a call
CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    500: grpc.StatusCode.INTERNAL,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.RESOURCE_EXHAUSTED,  # TorchServe's full queue, or the replica draining
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
    507: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
# a datatype's field of InferTensorContents and its numpy type in Triton's binary layout
CONTENTS = {
    "BOOL": ("bool_contents", np.bool_),
    "INT8": ("int_contents", np.int8),
    "INT16": ("int_contents", np.int16),
    "INT32": ("int_contents", np.int32),
    "INT64": ("int64_contents", np.int64),
    "UINT8": ("uint_contents", np.uint8),
    "UINT16": ("uint_contents", np.uint16),
    "UINT32": ("uint_contents", np.uint32),
    "UINT64": ("uint64_contents", np.uint64),
    "FP32": ("fp32_contents", np.float32),
    "FP64": ("fp64_contents", np.float64),
    "BYTES": ("bytes_contents", None),
}
MAX_DEADLINE_MS = 3_600_000  # the handler's bound on X-Slm-Deadline-Ms


class BadRequest(Exception):
    """A request the gateway refuses itself (INVALID_ARGUMENT)."""


def parameters(params) -> dict:
    return {
        k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in params.items() if v.WhichOneof("parameter_choice")
    }


def binary(tensor, k: int) -> bytes:
    """An input's typed contents in Triton's binary layout (BYTES: each element's 4-byte
    little-endian length, then its bytes)."""
    if tensor.datatype not in CONTENTS:
        raise BadRequest(
            f"inputs[{k}] ({tensor.name!r}): datatype {tensor.datatype!r} has no typed contents: "
            "send raw_input_contents"
        )
    field, dtype = CONTENTS[tensor.datatype]
    values = getattr(tensor.contents, field)
    if dtype is None:
        return b"".join(struct.pack("<I", len(v)) + v for v in values)
    return np.asarray(list(values), dtype=dtype).tobytes()


def infer_body(request) -> tuple[bytes, int]:
    """The v2 body in Triton's binary extension for a ModelInferRequest, and its JSON header's length."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise BadRequest(f"raw_input_contents holds {len(raw)} tensors for {len(request.inputs)} inputs")
    blobs = raw or [binary(t, k) for k, t in enumerate(request.inputs)]
    header: dict[str, Any] = {
        "inputs": [
            {
                "name": t.name,
                "datatype": t.datatype,
                "shape": list(t.shape),
                "parameters": {**parameters(t.parameters), "binary_data_size": len(blob)},
            }
            for t, blob in zip(request.inputs, blobs)
        ]
    }
    if request.id:
        header["id"] = request.id
    if request.outputs:
        header["outputs"] = [{"name": o.name} for o in request.outputs]
    if request.parameters:
        header["parameters"] = parameters(request.parameters)
    text = json.dumps(header).encode()
    return text + b"".join(blobs), len(text)


def infer_response(answer: dict):
    """A v2 JSON answer as a ModelInferResponse, each output's data in its typed contents."""
    out = pb.ModelInferResponse(
        model_name=str(answer.get("model_name", "")),
        model_version=str(answer.get("model_version", "")),
        id=str(answer.get("id", "")),
    )
    for tensor in answer.get("outputs", []):
        o = out.outputs.add(name=tensor["name"], datatype=tensor["datatype"], shape=tensor["shape"])
        field, _ = CONTENTS[tensor["datatype"]]
        data = np.asarray(tensor["data"], dtype=object).ravel().tolist()
        if tensor["datatype"] == "BYTES":
            data = [d.encode() if isinstance(d, str) else bytes(d) for d in data]
        getattr(o.contents, field).extend(data)
    return out


class OpenInference:
    """The service's methods, each an async unary call (METHODS names them)."""

    def __init__(self, gateway):
        self.gateway = gateway

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=not await self.gateway.unready_reasons())

    async def ModelReady(self, request, context):
        status, why = await self.gateway.why_unready(request.name, request.version or None)
        if status == 404:
            await context.abort(grpc.StatusCode.NOT_FOUND, why)
        return pb.ModelReadyResponse(ready=why is None)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="slm-serve", version=server_version(), extensions=[])

    async def ModelMetadata(self, request, context):
        status, body = await self.gateway.model_metadata(request.name, request.version or None)
        if status != 200:
            await context.abort(CODES.get(status, grpc.StatusCode.UNKNOWN), body)
        meta = pb.ModelMetadataResponse(name=body["name"], versions=body["versions"], platform=body["platform"])
        for side in ("inputs", "outputs"):
            for t in body[side]:
                getattr(meta, side).add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
        return meta

    async def ModelInfer(self, request, context):
        version = request.model_version or None
        if not named(request.model_name, version):
            await context.abort(grpc.StatusCode.NOT_FOUND, unregistered(request.model_name, version))
        try:
            body, header = infer_body(request)
        except BadRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(header)}
        remaining = context.time_remaining()
        deadline = deadline_ms(dict(context.invocation_metadata()).get("x-slm-deadline-ms"), remaining)
        if deadline is not None:  # for the handler to refuse at once a call that would miss it
            headers["X-Slm-Deadline-Ms"] = deadline
        status, _, answer, reply_headers = await self.gateway.forward(
            "POST", path("predictions", request.model_name, version), body, headers, timeout=remaining
        )
        context.set_trailing_metadata(
            tuple((k.lower(), v) for k, v in (reply_headers or {}).items() if k.lower().startswith("x-slm-"))
        )
        if status != 200:
            await context.abort(CODES.get(status, grpc.StatusCode.UNKNOWN), message(answer))
        return infer_response(json.loads(answer))


def deadline_ms(given: "str | None", remaining: "float | None") -> "str | None":
    """X-Slm-Deadline-Ms for a call: the x-slm-deadline-ms metadata as REST's header (passed on as
    it is, for the handler to check), and the gRPC deadline's time left, the sooner of the two."""
    left = None if remaining is None else min(max(remaining * 1e3, 1.0), MAX_DEADLINE_MS)
    try:
        given_ms = None if given is None else float(given)
    except ValueError:
        return given  # the handler names what is wrong with it
    if left is None or (given_ms is not None and given_ms <= left):
        return given
    return f"{left:.0f}"


def message(answer: bytes) -> str:
    """An error answer's text: the handler's {"error"}, or TorchServe's own {"message"}."""
    try:
        return json.loads(answer)["error"]
    except (ValueError, KeyError, TypeError):
        return torchserve_refusal(answer) or answer[:500].decode("utf-8", "replace")


def serving(gateway, address: str):
    """A cleanup context of the gateway's app: the gRPC server on `address` for the app's life."""

    async def run(app):
        server = grpc.aio.server()
        service = OpenInference(gateway)
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(
                getattr(service, name),
                request_deserializer=request.FromString,
                response_serializer=response.SerializeToString,
            )
            for name, (request, response) in METHODS.items()
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        if not server.add_insecure_port(address):
            raise OSError(f"gRPC cannot listen on {address}")
        await server.start()
        yield
        await server.stop(grace=5)

    return run
