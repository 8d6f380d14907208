"""KServe's v1 and v2 (Open Inference Protocol) bodies on the protocol path: each answer equals the
native answer to the same request, bounds and bad tensors get named 400s, Triton's binary tensor
extension decodes to the same request, and a request's instances share one graph call."""

import json
import struct

import numpy as np
import pytest
from conftest import BEAM_TASK, SCORE_TASK
from helpers import engine_for, write_catalog

from bench.reliability.fuzz import PYTHON_WORDS
from slm_core.compile.checkpoint import load_checkpoint
from slm_core.serve.kserve import metadata
from slm_core.serve.protocol import Request, respond_batch

MODEL = ("tiny", "2.0")
TEXTS = ["the quick brown fox", "search engines rank documents", "numbers like 12 and 345"]


@pytest.fixture(scope="module")
def engines(random_checkpoint, tmp_path_factory):
    ckpt = load_checkpoint(random_checkpoint("qwen3")[0])
    catalog = tmp_path_factory.mktemp("catalog") / "c.jsonl"
    write_catalog(catalog, [[10, 11], [12], [10, 13], [14, 15]])
    return {
        "score": engine_for(ckpt, **SCORE_TASK),
        "beam": engine_for(ckpt, **BEAM_TASK),
        "embedding": engine_for(ckpt, **{**SCORE_TASK, "head": "embedding", "labels": []}),
        "catalog": engine_for(
            ckpt, **{**BEAM_TASK, "stop": [ckpt.tokenizer.decode([3])], "catalog": str(catalog), "max_exclude": 4}
        ),
    }


def ask(engine, *bodies, headers=None):
    """(status, JSON) of each body, sent in one batch."""
    requests = [Request({"body": b if isinstance(b, bytes) else json.dumps(b).encode()}, headers or {}) for b in bodies]
    replies = respond_batch(engine, requests, model=MODEL)
    return [(r.status, json.loads(r.body)) for r in replies], replies


def native(engine, body):
    [(status, answer)], _ = ask(engine, body)
    assert status == 200, answer
    return answer


def by_name(reply):
    return {o["name"]: o for o in reply["outputs"]}


def test_v1_instances_are_native_requests_in_one_call(engines):
    score = engines["score"]
    bodies = [{"texts": TEXTS[:2]}, {"texts": TEXTS[2:]}]
    [(status, reply)], [r] = ask(score, {"instances": bodies})
    together, _ = ask(score, *bodies)  # the same packed call, so the same numbers
    assert status == 200 and reply == {"predictions": [answer for _, answer in together]}
    assert r.stats.batch == 2 and r.stats.texts == 3  # one call of both instances; the request's texts


def test_a_batch_packs_requests_whole_into_calls_in_order(engines):
    """max_batch 3: a v1 body of 2, a native one, then a v2 one: calls of 3 and 1."""
    score = engines["score"]
    v2 = {"inputs": [{"name": "texts", "datatype": "BYTES", "shape": [1], "data": TEXTS[:1]}]}
    answers, replies = ask(
        score, {"instances": [{"texts": TEXTS[:1]}, {"texts": TEXTS[1:2]}]}, {"texts": TEXTS[2:]}, v2
    )
    assert [s for s, _ in answers] == [200, 200, 200]
    assert replies[0].stats.call == replies[1].stats.call != replies[2].stats.call
    assert [r.stats.batch for r in replies] == [3, 3, 1]


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"instances": []}, 400, "'instances' holds 0; send 1 to 3 (max_batch"),
        ({"instances": [{"texts": ["a"]}] * 4}, 400, "'instances' holds 4; send 1 to 3"),
        ({"instances": {"texts": ["a"]}}, 400, "'instances' must be an array of request bodies, got an object"),
        (
            {"instances": [{"texts": ["a"]}, {"texts": 5}]},
            400,
            "instances[1]: 'texts' must be an array of strings, got a number",
        ),
        ({"instances": [{"texts": ["a"]}], "signature": 1}, 400, 'unknown fields "signature"'),
        ({"instances": [{"texts": ["a" * 2000]}]}, 400, "instances[0]: texts[0] is "),
    ],
)
def test_v1_bad_bodies_are_named(engines, body, status, words):
    [(got, reply)], _ = ask(engines["score"], body)
    assert got == status and words in reply["error"] and not PYTHON_WORDS.search(reply["error"]), reply


def test_v2_score_answers_as_tensors(engines):
    score = engines["score"]
    body = {
        "id": "r-1",
        "model_name": "tiny",  # as kserve's client writes it
        "inputs": [{"name": "texts", "datatype": "BYTES", "shape": [3], "data": TEXTS}],
    }
    [(status, reply)], _ = ask(score, body)
    want = native(score, {"texts": TEXTS})
    assert status == 200 and reply["id"] == "r-1" and (reply["model_name"], reply["model_version"]) == MODEL
    out = by_name(reply)
    assert out["labels"] == {"name": "labels", "datatype": "BYTES", "shape": [2], "data": want["labels"]}
    assert out["scores"]["shape"] == [3, 2] and out["scores"]["datatype"] == "FP32"
    assert np.allclose(np.reshape(out["scores"]["data"], (3, 2)), want["scores"], atol=0, rtol=0)
    # nested data, and one output asked for
    body = {
        "inputs": [{"name": "texts", "datatype": "BYTES", "shape": [3], "data": [[TEXTS[0]], [TEXTS[1], [TEXTS[2]]]]}],
        "outputs": [{"name": "scores"}],
    }
    [(status, reply)], _ = ask(score, body)
    assert status == 200 and "id" not in reply and [o["name"] for o in reply["outputs"]] == ["scores"]
    assert metadata(score.task) == {
        "inputs": [{"name": "texts", "datatype": "BYTES", "shape": [-1]}],
        "outputs": [
            {"name": "labels", "datatype": "BYTES", "shape": [2]},
            {"name": "scores", "datatype": "FP32", "shape": [-1, 2]},
        ],
    }


def test_v2_embeddings_are_one_fp32_tensor(engines):
    eng = engines["embedding"]
    [(status, reply)], _ = ask(
        eng, {"inputs": [{"name": "texts", "datatype": "BYTES", "shape": [2], "data": TEXTS[:2]}]}
    )
    want = np.asarray(native(eng, {"texts": TEXTS[:2]})["embeddings"])
    (out,) = reply["outputs"]
    assert status == 200 and out["name"] == "embeddings" and out["shape"] == list(want.shape)
    assert np.array_equal(np.reshape(out["data"], want.shape), want)


def test_v2_beam_with_settings_pads_token_ids(engines):
    beam = engines["beam"]
    inputs = [
        {"name": "prompt", "datatype": "BYTES", "shape": [1], "data": ["search engines rank"]},
        {"name": "beam_width", "datatype": "INT64", "shape": [1], "data": [3]},
        {"name": "new_tokens", "datatype": "INT8", "shape": [1], "data": [2]},
    ]
    [(status, reply)], _ = ask(beam, {"inputs": inputs})
    want = native(beam, {"prompt": "search engines rank", "beam_width": 3, "new_tokens": 2})["candidates"]
    out = by_name(reply)
    assert status == 200 and out["text"]["data"] == [c["text"] for c in want]
    assert out["score"]["data"] == [c["score"] for c in want] and out["score"]["shape"] == [len(want)]
    n = BEAM_TASK["new_tokens"]
    assert out["token_ids"]["shape"] == [len(want), n] and out["token_ids"]["datatype"] == "INT64"
    assert out["token_ids"]["data"] == [t for c in want for t in c["token_ids"] + [-1] * (n - len(c["token_ids"]))]


def test_v2_catalog_names_items_and_unknown_excludes(engines):
    eng = engines["catalog"]
    first = native(eng, {"prompt": "rank"})["candidates"][0]["id"]
    inputs = [
        {"name": "prompt", "datatype": "BYTES", "shape": [1], "data": ["rank"]},
        {"name": "exclude", "datatype": "BYTES", "shape": [2], "data": [first, "nope"]},
    ]
    [(status, reply)], _ = ask(eng, {"inputs": inputs})
    want = native(eng, {"prompt": "rank", "exclude": [first, "nope"]})
    out = by_name(reply)
    assert (
        status == 200 and out["id"]["data"] == [c["id"] for c in want["candidates"]] and first not in out["id"]["data"]
    )
    assert out["unknown_exclude"] == {"name": "unknown_exclude", "datatype": "INT64", "shape": [1], "data": [1]}
    [(status, reply)], _ = ask(eng, {"inputs": inputs[:1]})
    assert status == 200 and "unknown_exclude" not in by_name(reply)


def binary_body(header: dict, *chunks: bytes) -> bytes:
    """A body as tritonclient's HTTP client sends binary inputs: the JSON header, then the data."""
    return json.dumps(header).encode() + b"".join(chunks)


def strings(values: list[str]) -> bytes:
    return b"".join(struct.pack("<I", len(v.encode())) + v.encode() for v in values)


def test_v2_binary_inputs_equal_json_inputs(engines):
    beam = engines["beam"]
    chunks = [strings(["search engines rank"]), np.array([2], "<i4").tobytes()]
    header = {
        "inputs": [
            {"name": "prompt", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": len(chunks[0])}},
            {"name": "top", "datatype": "INT32", "shape": [1], "parameters": {"binary_data_size": 4}},
        ]
    }
    raw = binary_body(header, *chunks)
    size = str(len(json.dumps(header).encode()))
    [(status, reply)], _ = ask(beam, raw, headers={"inference-header-content-length": size})
    want = native(beam, {"prompt": "search engines rank", "top": 2})["candidates"]
    assert status == 200 and by_name(reply)["text"]["data"] == [c["text"] for c in want]
    # a score request's texts, binary, in the same batch as a JSON one
    score = engines["score"]
    blob = strings(TEXTS)
    header = {
        "inputs": [{"name": "texts", "datatype": "BYTES", "shape": [3], "parameters": {"binary_data_size": len(blob)}}]
    }
    [(status, reply)], _ = ask(
        score, binary_body(header, blob), headers={"inference-header-content-length": str(len(json.dumps(header)))}
    )
    assert status == 200 and by_name(reply)["scores"]["data"] == [
        p for row in native(score, {"texts": TEXTS})["scores"] for p in row
    ]


def texts_input(**change):
    return {"inputs": [{"name": "texts", "datatype": "BYTES", "shape": [1], "data": ["a"], **change}]}


@pytest.mark.parametrize(
    "body, words",
    [
        (texts_input(datatype="FP32"), "inputs[0] ('texts'): 'datatype' must be BYTES, got 'FP32'"),
        (texts_input(shape=[1, 1]), "'shape' must be [-1] (-1: any size), got [1, 1]"),
        (texts_input(shape=[2]), "'data' holds 1 values, shape [2] needs 2"),
        (texts_input(shape=[-1]), "'shape' must be an array of at most 4 sizes"),
        (
            texts_input(shape=[2**70]),
            "'data' holds 1 values, shape [1180591620717411303424] needs 1180591620717411303424",
        ),
        (texts_input(data=[1]), "data[0] must be a string, got a number"),
        (texts_input(name="text"), 'inputs[0]: \'name\' must be one of "texts", got "text"'),
        (texts_input(parameters={"binary_data_size": 5}), "has both 'data' and parameters.binary_data_size"),
        (
            {"inputs": [{"name": "texts", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 5}}]},
            "binary_data_size must be an integer from 0 to the 0 binary bytes",
        ),
        ({"inputs": texts_input()["inputs"] * 2}, "'inputs' must be an array of 1 to 1 tensors"),
        ({"inputs": []}, "'inputs' must be an array of 1 to 1 tensors"),
        ({"inputs": "texts"}, "got a string"),
        ({**texts_input(), "outputs": [{"name": "probs"}]}, "'outputs' names \"probs\"; this model's outputs are"),
        ({**texts_input(), "id": 7}, "'id' must be a string, got a number"),
        ({**texts_input(), "model": "x"}, 'unknown fields "model"'),
        ({"inputs": [{"name": "texts", "datatype": "BYTES", "shape": [1]}]}, "has no 'data'"),
        ({"inputs": [{"name": "texts", "datatype": "BYTES", "shape": [0], "data": []}]}, "'texts' is empty"),
    ],
)
def test_v2_bad_tensors_are_named(engines, body, words):
    [(status, reply)], _ = ask(engines["score"], body)
    assert status == 400 and words in reply["error"] and not PYTHON_WORDS.search(reply["error"]), reply


def test_v2_beam_bad_tensors_are_named(engines):
    beam = engines["beam"]
    prompt = {"name": "prompt", "datatype": "BYTES", "shape": [1], "data": ["x"]}
    cases = [
        ([{"name": "top", "datatype": "INT32", "shape": [1], "data": [2]}], "'inputs' lacks \"prompt\""),
        ([prompt, {"name": "top", "datatype": "FP32", "shape": [1], "data": [2]}], "an integer datatype"),
        (
            [prompt, {"name": "top", "datatype": "INT32", "shape": [1], "data": [99]}],
            "'top' must be an integer from 1 to 4",
        ),
        (
            [prompt, {"name": "top", "datatype": "INT32", "shape": [1], "data": [True]}],
            "must be an integer, got a boolean",
        ),
        ([prompt, prompt], "input 'prompt' is given twice"),
    ]
    for inputs, words in cases:
        [(status, reply)], _ = ask(beam, {"inputs": inputs})
        assert status == 400 and words in reply["error"], (words, reply)


@pytest.mark.parametrize(
    "chunk, header, words",
    [
        (strings(["ab"]), "x", "Inference-Header-Content-Length must be the JSON header's length"),
        (strings(["ab"]), "100000", "Inference-Header-Content-Length must be the JSON header's length"),
        (strings(["ab"]), "\u00b2", "Inference-Header-Content-Length must be the JSON header's length"),  # "²": a digit
        (strings(["ab"]) + b"zz", None, "the binary body holds 2 bytes past the inputs' binary_data_size"),
        (struct.pack("<I", 9) + b"ab", None, "is not 1 length-prefixed elements"),
        (struct.pack("<I", 2) + b"\xff\xfe", None, "element 0 is not valid UTF-8 (byte 0)"),
        (strings(["a", "b"]), None, "is not 1 length-prefixed elements"),
    ],
)
def test_v2_bad_binary_bodies_are_named(engines, chunk, header, words):
    size = 6 if words.endswith("past the inputs' binary_data_size") else len(chunk)
    head = {"inputs": [{"name": "texts", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": size}}]}
    raw = binary_body(head, chunk)
    [(status, reply)], _ = ask(
        engines["score"], raw, headers={"inference-header-content-length": header or str(len(json.dumps(head)))}
    )
    assert status == 400 and words in reply["error"] and not PYTHON_WORDS.search(reply["error"]), reply


def test_a_bad_instance_or_tensor_never_touches_its_batch(engines):
    score = engines["score"]
    answers, _ = ask(score, {"instances": [{"texts": 1}]}, {"texts": TEXTS[:1]}, texts_input(datatype="INT8"))
    assert [s for s, _ in answers] == [400, 200, 400] and answers[1][1] == native(score, {"texts": TEXTS[:1]})


@pytest.mark.parametrize(
    "body, headers, kind, status, shown",
    [
        ({"texts": ["a"]}, {}, "NATIVE", 200, "labels"),
        ({"instances": [{"texts": ["a"]}]}, {}, "KSERVE_V1", 200, "predictions"),
        (
            {"inputs": [{"name": "texts", "datatype": "BYTES", "shape": [1], "data": ["a"]}]},
            {},
            "KSERVE_V2",
            200,
            "outputs",
        ),
        (
            b'{"inputs": []}',
            {"inference-header-content-length": "14"},
            "KSERVE_V2_BINARY",
            400,
            "'inputs' must be an array of 1 to",
        ),
        # a KServe body that is also the task's own: the task's field decides, and the native
        # decoder names what else the body holds
        ({"texts": ["a"], "instances": [{"texts": ["b"]}]}, {}, "NATIVE", 400, "instances"),
        ({"texts": ["a"], "inputs": []}, {}, "NATIVE", 400, "inputs"),
        ({"instances": 3, "inputs": []}, {}, "KSERVE_V1", 400, "a KServe v1 request has only 'instances'"),
        (["a list"], {}, "NATIVE", 400, "JSON object"),
        ({}, {}, "NATIVE", 400, "texts"),
    ],
)
def test_each_body_shape_is_decided_once_and_sent_to_its_decoder(engines, body, headers, kind, status, shown):
    """protocol.body_kind, the one place a body's protocol is decided, per shape; the reply comes
    from that kind's decoder: its answer, or its own 400 naming the problem."""
    from slm_core.serve.messages import BodyKind
    from slm_core.serve.protocol import body_kind

    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    decided, value = body_kind(Request({"body": raw}, headers), "texts")
    assert decided is BodyKind[kind]
    assert value == (raw if decided is BodyKind.KSERVE_V2_BINARY else json.loads(raw))
    [(got, reply)], _ = ask(engines["score"], raw, headers=headers)
    assert got == status and (shown in reply if status == 200 else shown in reply["error"]), reply
