"""Score tasks that answer embeddings (head: embedding): each text's last-token hidden state after
the final norm, FP32, optionally cut to its first dims and L2-normalised, against transformers'
last_hidden_state on the same weights (fp32, CPU): the real SmolLM2 and random Qwen2/Qwen3."""

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import CLASSIFIER_TEXTS as TEXTS
from helpers import engine_for, hf_embeddings, text_ids

from slm_core import Engine
from slm_core.errors import SpecError
from slm_core.serve.protocol import Request, respond_batch

TASK = {"task": "score", "head": "embedding", "max_texts": 8, "max_text_tokens": 64}


def _check(engine, model, texts, dims: int, normalize: bool) -> torch.Tensor:
    ref = hf_embeddings(model, text_ids(engine, texts))[:, :dims]
    ref = F.normalize(ref, dim=-1) if normalize else ref
    got = torch.tensor(engine.embed(texts))  # all texts packed in one call
    assert got.shape == (len(texts), dims) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    assert torch.cdist(got, got).max() > 0.1 * got.norm(dim=-1).mean()  # unlike rows: the comparison means something
    return got


@pytest.mark.parametrize("dims, normalize", [(None, False), (48, True)])
def test_smollm2_embeddings_are_transformers_last_hidden_state(smollm2, dims, normalize):
    path, ckpt, hf, _ = smollm2
    engine = engine_for(ckpt, **TASK, **({"dims": dims} if dims else {}), normalize=normalize)
    got = _check(engine, hf, TEXTS, dims or ckpt.spec.hidden_size, normalize)
    if normalize:
        torch.testing.assert_close(got.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_random_qwen_embeddings_are_transformers_last_hidden_state(random_checkpoint, arch):
    folder, model = random_checkpoint(arch)
    full = Engine.from_checkpoint(folder, {**TASK, "precision": "fp32"})
    assert full.task.dims == 64 and full.task.answer == ("embeddings",)
    _check(full, model, TEXTS, 64, False)
    cut = Engine.from_checkpoint(folder, {**TASK, "precision": "fp32", "dims": 16, "normalize": True})
    got = _check(cut, model, TEXTS, 16, True)
    # Matryoshka: the cut embedding is the full one's first dims, normalised
    torch.testing.assert_close(got, F.normalize(torch.tensor(full.embed(TEXTS))[:, :16], dim=-1), atol=1e-6, rtol=0)


def test_the_rest_answer_and_its_bounds(random_checkpoint):
    folder, _ = random_checkpoint("qwen3")
    engine = Engine.from_checkpoint(folder, {**TASK, "precision": "fp32", "max_batch": 2, "max_texts": 3})
    replies = respond_batch(
        engine,
        [
            Request({"body": b'{"texts": ["a", "search engines"]}'}),
            Request({"body": b'{"texts": ["x", "y", "z", "w"]}'}),
        ],
    )
    assert [r.status for r in replies] == [200, 400]
    answer = json.loads(replies[0].body)
    assert list(answer) == ["embeddings"] and len(answer["embeddings"]) == 2
    torch.testing.assert_close(
        torch.tensor(answer["embeddings"]), torch.tensor(engine.embed(["a", "search engines"])), atol=1e-6, rtol=0
    )
    assert "max_texts=3" in json.loads(replies[1].body)["error"]
    with pytest.raises(TypeError, match=r"call engine.embed\(...\)"):
        engine.score(["a"])


def test_embedding_spec_errors(random_checkpoint):
    folder, _ = random_checkpoint("qwen3")
    for bad, message in (
        ({"dims": 65}, "'dims' is 65, over the model's hidden size 64"),
        ({"dims": 0}, "'dims' must be a positive integer"),
        ({"normalize": "yes"}, "'normalize' must be true or false"),
        ({"labels": ["yes", "no"]}, "an embedding task has no 'labels'"),
    ):
        with pytest.raises(SpecError, match=message):
            Engine.from_checkpoint(folder, {**TASK, **bad})
    with pytest.raises(SpecError, match="'dims' and 'normalize' are for head: embedding or mlp"):
        Engine.from_checkpoint(folder, {"task": "score", "labels": ["yes", "no"], "dims": 8})
