"""README command (a) in CI: the demo builds the real SmolLM2 archives, serves them through
TorchServe and its answers equal the eager engine on the same tasks (REST path against the engine)."""

import json

import pytest

from handlers.demo import PROMPTS, QUERIES, SHOPPING, TASKS, smollm2
from slm_core import Engine
from slm_core.tasks import BeamTask

pytestmark = pytest.mark.slow


def test_demo_answers_equal_the_engine(demo):
    _, answers = demo
    score = Engine.from_checkpoint(smollm2(), task=TASKS / "smollm2-intent.yaml")
    assert answers["scores"]["labels"] == ["Yes", "No"]
    for row, ref in zip(answers["scores"]["scores"], score.score(QUERIES), strict=True):
        assert row == pytest.approx(ref, abs=1e-4)
    beam = Engine.from_checkpoint(smollm2(), task=TASKS / "smollm2-complete.yaml")
    for prompt in PROMPTS:
        ref = beam.beam(prompt)
        assert [c["token_ids"] for c in answers["beams"][prompt]] == [c["token_ids"] for c in ref]
        # compiled against eager in fp32: the archiver's own bound (1.01e-4 measured on an AMD EPYC)
        assert [c["score"] for c in answers["beams"][prompt]] == pytest.approx(
            [c["score"] for c in ref], abs=BeamTask.tolerance["fp32"]
        )
    status, body = answers["bad"]
    assert status == 400 and b"'texts' is empty" in body


def test_demo_retrieves_catalog_items_as_the_engine_does(demo):
    """The third archive, generative retrieval over archiver/tasks/products.jsonl: every candidate
    is an item of the catalog, answered with its id and title; the REST answers are the eager
    engine's; the request excluding the first answer's best item does not get it, and top=3 gives
    at most three."""
    _, answers = demo
    items = [json.loads(line) for line in (TASKS / "products.jsonl").read_text().splitlines()]
    titles = {item["id"]: item["text"] for item in items}
    engine = Engine.from_checkpoint(smollm2(), task=TASKS / "smollm2-retrieve.yaml")
    assert list(answers["retrieve"]) == SHOPPING
    for prompt, answer in answers["retrieve"].items():
        candidates = answer["candidates"]
        # at most beam_width; fewer where the search finishes fewer, as transformers' generate() with
        # prefix_allowed_tokens_fn does (finished backups at -1e9 can fill its pool and end the search)
        assert 0 < len(candidates) <= 10 and "unknown_exclude" not in answer
        assert [c["score"] for c in candidates] == sorted((c["score"] for c in candidates), reverse=True)
        for c in candidates:  # the title's tokens, then the stop token unless the title fills new_tokens
            assert c["id"] in titles and c["text"] == titles[c["id"]], c
            title = engine.tokenizer.tokenizer.encode(titles[c["id"]], add_special_tokens=False).ids
            assert c["token_ids"] == title + engine.task.stop_ids * (len(title) < engine.task.new_tokens)
        ref = engine.run_one(engine.task.request({"prompt": prompt}))["candidates"]
        assert [(c["id"], c["token_ids"]) for c in candidates] == [(c["id"], c["token_ids"]) for c in ref]
        assert [c["score"] for c in candidates] == pytest.approx(
            [c["score"] for c in ref], abs=BeamTask.tolerance["fp32"]
        )
    request, answer = answers["retrieve_exclude"], answers["retrieve_excluded"]
    (sold_out,) = request["exclude"]
    assert sold_out == answers["retrieve"][request["prompt"]]["candidates"][0]["id"] and request["top"] == 3
    assert answer["unknown_exclude"] == 0
    assert 0 < len(answer["candidates"]) <= 3 and sold_out not in {c["id"] for c in answer["candidates"]}
    assert all(c["text"] == titles[c["id"]] for c in answer["candidates"])
    ref = engine.run_one(engine.task.request(request))["candidates"]
    assert [(c["id"], c["token_ids"]) for c in answer["candidates"]] == [(c["id"], c["token_ids"]) for c in ref]
