"""Embedding and MLP heads (head: embedding, head: mlp) archived and served through a real
TorchServe, by the handler every task uses."""

import json
import zipfile

import pytest
import torch
import yaml
from helpers import CLASSIFIER_TEXTS as TEXTS
from helpers import write_mlp

from slm_core import Engine

EMBED = {
    "task": "score",
    "head": "embedding",
    "dims": 32,
    "normalize": True,
    "precision": "fp32",
    "max_texts": 4,
    "max_text_tokens": 32,
    "max_batch": 2,
}


@pytest.mark.slow
def test_embedding_and_mlp_archives_serve_through_torchserve(tmp_path, random_checkpoint):
    """archiver build of a cut, normalised embedding task and of an MLP head over it (its file
    beside the task YAML) on the random Qwen2: each package equals the eager engine, each REST
    answer equals its package; a request over the bounds is a 400."""
    from archiver.__main__ import main
    from handlers.local_server import TorchServe
    from slm_core.serve.loader import load_package

    folder, _ = random_checkpoint("qwen2")
    write_mlp(tmp_path / "intent.safetensors", [32, 16, 3], "silu", ["news", "music", "travel"])
    tasks = {"embed": EMBED, "intent": {**EMBED, "head": "mlp", "mlp": "intent.safetensors"}}
    store, packages = tmp_path / "store", {}
    for name, spec in tasks.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(spec))
        assert (
            main(
                [
                    "build",
                    "--checkpoint",
                    str(folder),
                    "--task",
                    str(tmp_path / f"{name}.yaml"),
                    "--model-name",
                    name,
                    "--export-path",
                    str(store),
                ]
            )
            == 0
        )
        zipfile.ZipFile(store / f"{name}.mar").extractall(tmp_path / name)
        packages[name] = load_package(tmp_path / name, engine=Engine)
    eager = Engine.from_checkpoint(folder, EMBED)
    torch.testing.assert_close(
        torch.tensor(packages["embed"].embed(TEXTS[:3])), torch.tensor(eager.embed(TEXTS[:3])), atol=1e-5, rtol=0
    )
    # the MLP's file travels in the package; its graph holds the weights
    assert (tmp_path / "intent" / "mlp.safetensors").read_bytes() == (tmp_path / "intent.safetensors").read_bytes()
    eager = Engine.from_checkpoint(folder, {**tasks["intent"], "mlp": str(tmp_path / "intent.safetensors")})
    torch.testing.assert_close(
        torch.tensor(packages["intent"].score(TEXTS[:3])), torch.tensor(eager.score(TEXTS[:3])), atol=1e-5, rtol=0
    )
    (tmp_path / "ts").mkdir()
    server = TorchServe(tmp_path / "ts", store).start()
    try:
        server.register("embed.mar")
        server.register("intent.mar")
        status, body = server.predict("embed", json.dumps({"texts": TEXTS[:3]}).encode())
        assert status == 200
        answer = json.loads(body)
        assert list(answer) == ["embeddings"] and [len(row) for row in answer["embeddings"]] == [32] * 3
        torch.testing.assert_close(
            torch.tensor(answer["embeddings"]), torch.tensor(packages["embed"].embed(TEXTS[:3])), atol=1e-6, rtol=0
        )
        status, body = server.predict("intent", json.dumps({"texts": TEXTS[:3]}).encode())
        assert status == 200
        answer = json.loads(body)
        assert answer["labels"] == ["news", "music", "travel"]
        torch.testing.assert_close(
            torch.tensor(answer["scores"]), torch.tensor(packages["intent"].score(TEXTS[:3])), atol=1e-6, rtol=0
        )
        for name in tasks:
            status, body = server.predict(name, json.dumps({"texts": ["x"] * 5}).encode())  # over max_texts
            assert status == 400 and "max_texts=4" in json.loads(body)["error"]
    finally:
        server.stop()
