"""KServe's REST protocols beside the native body, told apart by the body: TorchServe hands
`POST /v1/models/NAME:predict` and `POST /v2/models/NAME/infer` to the worker as it does
`/predictions/NAME`, without the path (deploy/kserve_gateway.py rewrites them there).

- v1: `{"instances": [BODY, ...]}` -> `{"predictions": [ANSWER, ...]}`. Each instance is a native
  request body and one engine request; 1 to max_batch of them, so that a request is at most one
  graph call, as the queue and the deadlines count it. A bad instance refuses the request, named
  (`instances[2]: ...`).
- v2, the Open Inference Protocol: `{"id", "inputs": [{"name", "datatype", "shape", "data"}],
  "outputs"}` -> `{"model_name", "model_version", "id", "outputs": [...]}`. One inference request
  is one engine request; its tensors are the task's fields as the task declares them
  (Task.v2_inputs, Task.v2_outputs). Inputs may come in Triton's binary tensor extension (the
  header Inference-Header-Content-Length: the JSON header's bytes, then each input's
  `binary_data_size` bytes in order); outputs are always JSON, which clients read either way.
"""

import math
from typing import Any

import numpy as np

from slm_core.errors import InputError, bounded, json_type, names
from slm_core.serve.body import parse_body
from slm_core.serve.messages import Decoded
from slm_core.tasks.base import Task, Tensor

V1_FIELDS = {"instances"}
# model_name, model_version: what kserve's client writes into the body too; the path names the model
V2_FIELDS = {"id", "model_name", "model_version", "parameters", "inputs", "outputs"}
INTEGERS = {
    "INT8": "<i1",
    "INT16": "<i2",
    "INT32": "<i4",
    "INT64": "<i8",
    "UINT8": "<u1",
    "UINT16": "<u2",
    "UINT32": "<u4",
    "UINT64": "<u8",
}
MAX_RANK = 4


def v2_binary(task: Task, raw: Any, header: str, model: tuple[str, str]) -> Decoded:
    """A v2 body in Triton's binary tensor extension: `header` bytes of JSON, then the inputs'
    data."""
    if not isinstance(raw, (bytes, bytearray)):
        raise InputError(
            "header Inference-Header-Content-Length needs a binary body (Content-Type: application/octet-stream)"
        )
    raw = bytes(raw)
    digits = header.strip()
    size = int(digits) if digits.isascii() and digits.isdigit() else -1  # "²" is a digit int() refuses
    if not 0 < size <= len(raw):
        raise InputError(
            f"header Inference-Header-Content-Length must be the JSON header's length in bytes, "
            f"1 to the body's {len(raw)}, got {bounded(header, 40)!r}"
        )
    value = parse_body(raw[:size])
    if not isinstance(value, dict) or "inputs" not in value:
        raise InputError('the JSON header of a binary body must be an inference request {"inputs": [...]}')
    return v2(task, value, raw[size:], model)


# --- v1 ---------------------------------------------------------------------------------------------
def v1(task: Task, value: dict) -> Decoded:
    """{"instances": [native body, ...]} -> one engine request per instance, answered as
    {"predictions": [...]}."""
    unknown = set(value) - V1_FIELDS
    if unknown:
        raise InputError(f"unknown fields {names(unknown)}; a KServe v1 request has only 'instances'")
    instances = value["instances"]
    if not isinstance(instances, list):
        raise InputError(f"'instances' must be an array of request bodies, got {json_type(instances)}")
    if not 1 <= len(instances) <= task.max_batch:
        raise InputError(
            f"'instances' holds {len(instances)}; send 1 to {task.max_batch} (max_batch: one graph call)",
            bound="max_batch",
            limit=task.max_batch,
        )
    values = []
    for i, instance in enumerate(instances):
        try:
            values.append(task.request(instance))
        except InputError as e:
            raise InputError(f"instances[{i}]: {e}", e.bound, e.limit, e.status) from None
    return Decoded(
        values, lambda answers: {"predictions": [task.body(a) for a in answers]}, lambda i: f"instances[{i}]: "
    )


# --- v2 ---------------------------------------------------------------------------------------------
def metadata(task: Task) -> dict:
    """The tensors of the v2 model metadata (GET /v2/models/NAME): name, datatype, shape."""

    def described(tensors: list[Tensor]) -> list[dict]:
        return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in tensors]

    return {"inputs": described(task.v2_inputs()), "outputs": described(task.v2_outputs())}


def v2(task: Task, value: dict, blob: bytes, model: tuple[str, str]) -> Decoded:
    """An inference request -> the task's request body, checked tensor by tensor, and its answer
    as the response's output tensors."""
    unknown = set(value) - V2_FIELDS
    if unknown:
        raise InputError(
            f"unknown fields {names(unknown)}; an inference request has 'id', 'model_name', "
            "'model_version', 'parameters', 'inputs' and 'outputs'"
        )
    request_id = value.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InputError(f"'id' must be a string, got {json_type(request_id)}")
    declared = {t.name: t for t in task.v2_inputs()}
    inputs = value["inputs"]
    if not isinstance(inputs, list) or not 1 <= len(inputs) <= len(declared):
        raise InputError(
            f"'inputs' must be an array of 1 to {len(declared)} tensors ({names(declared)}), got "
            + (f"{len(inputs)}" if isinstance(inputs, list) else json_type(inputs))
        )
    payload: dict[str, Any] = {}
    offset = 0
    for i, tensor in enumerate(inputs):
        where = f"inputs[{i}]"
        if not isinstance(tensor, dict):
            raise InputError(f"{where} must be an object {{name, datatype, shape, data}}, got {json_type(tensor)}")
        name = tensor.get("name")
        spec = declared.get(name) if isinstance(name, str) else None
        if spec is None:
            raise InputError(
                f"{where}: 'name' must be one of {names(declared)}, got "
                + (names([name]) if isinstance(name, str) else json_type(name))
            )
        if spec.source in payload:
            raise InputError(f"{where}: input {name!r} is given twice")
        data, offset = _input(tensor, spec, f"{where} ({name!r})", blob, offset)
        payload[spec.source] = data[0] if spec.shape == (1,) else data
    if offset != len(blob):
        raise InputError(f"the binary body holds {len(blob) - offset} bytes past the inputs' binary_data_size")
    missing = [t.name for t in declared.values() if not t.optional and t.source not in payload]
    if missing:
        raise InputError(f"'inputs' lacks {names(missing)}")
    wanted = _requested(value.get("outputs"), task)
    request = task.request(payload)

    def answer(answers: list) -> dict:
        reply = {"model_name": model[0], "model_version": model[1], "outputs": outputs(task, answers[0], wanted)}
        return reply if request_id is None else {"id": request_id, **reply}

    return Decoded([request], answer)


def _input(tensor: dict, spec: Tensor, where: str, blob: bytes, offset: int) -> tuple[list, int]:
    """One input tensor's values, flat, checked against its declaration; and the offset in the
    binary data after it."""
    datatype, shape = tensor.get("datatype"), tensor.get("shape")
    integer = spec.datatype in INTEGERS
    if not (datatype == spec.datatype or (integer and datatype in INTEGERS)):
        want = "an integer datatype (INT8 to INT64, UINT8 to UINT64)" if integer else spec.datatype
        raise InputError(
            f"{where}: 'datatype' must be {want}, got "
            + (repr(bounded(datatype, 16)) if isinstance(datatype, str) else json_type(datatype))
        )
    if not (isinstance(shape, list) and len(shape) <= MAX_RANK and all(type(d) is int and d >= 0 for d in shape)):
        raise InputError(f"{where}: 'shape' must be an array of at most {MAX_RANK} sizes (non-negative integers)")
    if len(shape) != len(spec.shape) or any(d != s for d, s in zip(shape, spec.shape) if s >= 0):
        raise InputError(f"{where}: 'shape' must be {list(spec.shape)} (-1: any size), got {shape}")
    count = math.prod(shape)  # exact: a hostile shape may pass any integer width
    parameters = tensor.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InputError(f"{where}: 'parameters' must be an object, got {json_type(parameters)}")
    size = parameters.get("binary_data_size")
    if size is not None:
        if "data" in tensor:
            raise InputError(f"{where} has both 'data' and parameters.binary_data_size")
        if type(size) is not int or not 0 <= size <= len(blob) - offset:
            raise InputError(
                f"{where}: parameters.binary_data_size must be an integer from 0 to the "
                f"{len(blob) - offset} binary bytes left"
            )
        return _binary(blob[offset : offset + size], datatype, count, where), offset + size
    if "data" not in tensor:
        raise InputError(f"{where} has no 'data'")
    data = _flat(tensor["data"])
    if len(data) != count:
        raise InputError(f"{where}: 'data' holds {len(data)} values, shape {shape} needs {count}")
    kind = str if spec.datatype == "BYTES" else int
    for j, x in enumerate(data):
        if type(x) is not kind:
            raise InputError(
                f"{where}: data[{j}] must be {'a string' if kind is str else 'an integer'}, got {json_type(x)}"
            )
    return data, offset


def _flat(data: Any) -> list:
    """A tensor's data as one row-major list: the protocol allows it flat or nested."""
    if not isinstance(data, list):
        return [data]
    if not any(isinstance(x, list) for x in data):
        return data
    out: list = []
    stack = [iter(data)]
    while stack:  # no recursion: a hostile body nests deeply
        for x in stack[-1]:
            if isinstance(x, list):
                stack.append(iter(x))
                break
            out.append(x)
        else:
            stack.pop()
    return out


def _binary(raw: bytes, datatype: str, count: int, where: str) -> list:
    """Values in Triton's binary layout: BYTES as a 4-byte little-endian length and that many
    bytes per element; numbers little-endian, packed."""
    if datatype != "BYTES":
        dtype = np.dtype(INTEGERS[datatype])
        if len(raw) != count * dtype.itemsize:
            raise InputError(f"{where}: binary data holds {len(raw)} bytes, shape needs {count * dtype.itemsize}")
        return np.frombuffer(raw, dtype).tolist()
    out, pos = [], 0
    while pos < len(raw):
        length = int.from_bytes(raw[pos : pos + 4], "little") if pos + 4 <= len(raw) else -1
        if length < 0 or pos + 4 + length > len(raw) or len(out) == count:
            raise InputError(f"{where}: binary BYTES data is not {count} length-prefixed elements")
        try:
            out.append(raw[pos + 4 : pos + 4 + length].decode("utf-8"))
        except UnicodeDecodeError as e:
            raise InputError(f"{where}: element {len(out)} is not valid UTF-8 (byte {e.start})") from None
        pos += 4 + length
    if len(out) != count:
        raise InputError(f"{where}: binary BYTES data holds {len(out)} elements, shape needs {count}")
    return out


def _requested(requested: Any, task: Task) -> set[str] | None:
    """The output names a request asks for (None: all of them)."""
    if requested is None:
        return None
    known = {t.name for t in task.v2_outputs()}
    if not isinstance(requested, list) or not all(
        isinstance(o, dict) and isinstance(o.get("name"), str) for o in requested
    ):
        raise InputError("'outputs' must be an array of objects {\"name\": ...}")
    wanted = {o["name"] for o in requested}
    if not wanted <= known:
        raise InputError(f"'outputs' names {names(wanted - known)}; this model's outputs are {names(known)}")
    return wanted


def outputs(task: Task, answer: Any, wanted: set[str] | None) -> list[dict]:
    """An answer as output tensors, in the task's order: each field's values flat, row-major."""
    body = task.body(answer)
    out = []
    for t in task.v2_outputs():
        if (wanted is not None and t.name not in wanted) or t.source not in body:
            continue
        values = body[t.source] if t.key is None else [item[t.key] for item in body[t.source]]
        shape, data = _tensor(values, t.shape)
        out.append({"name": t.name, "datatype": t.datatype, "shape": shape, "data": data})
    return out


def _tensor(values: Any, declared: tuple[int, ...]) -> tuple[list[int], Any]:
    """(shape, flat data) of a field's values: one value, a list, a list of rows (ragged rows
    padded with -1 to the declared width, as beam candidates' token ids), or an array."""
    if not isinstance(values, (list, np.ndarray)):
        return [1], [values]
    if isinstance(values, np.ndarray):
        return list(values.shape), values.ravel()
    if len(declared) == 1:
        return [len(values)], list(values)
    width = declared[1] if declared[1] >= 0 else max((len(r) for r in values), default=0)
    return [len(values), width], [x for row in values for x in [*row, *[-1] * (width - len(row))]]
