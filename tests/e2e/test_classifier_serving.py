"""A classifier task (head: classifier) archived and served through a real TorchServe."""

import json
import zipfile

import pytest
import torch
import yaml
from helpers import CLASSIFIER_NAMES as NAMES
from helpers import CLASSIFIER_TEXTS as TEXTS
from helpers import classifier_checkpoint, hf_rows

from slm_core import Engine


@pytest.mark.slow
def test_classifier_archive_serves_through_torchserve(tmp_path):
    """archiver build of a classifier task, served by TorchServe: the REST answer names the labels
    from id2label and equals the loaded package, which equals HF."""
    from archiver.__main__ import main
    from handlers.local_server import TorchServe
    from slm_core.serve.loader import load_package

    (tmp_path / "ckpt").mkdir()
    model = classifier_checkpoint(tmp_path / "ckpt", "qwen2", 5)
    task = tmp_path / "task.yaml"
    task.write_text(
        yaml.safe_dump(
            {
                "task": "score",
                "head": "classifier",
                "precision": "fp32",
                "max_texts": 4,
                "max_text_tokens": 32,
                "max_batch": 2,
            }
        )
    )
    store = tmp_path / "store"
    assert (
        main(
            [
                "build",
                "--checkpoint",
                str(tmp_path / "ckpt"),
                "--task",
                str(task),
                "--model-name",
                "intent",
                "--export-path",
                str(store),
            ]
        )
        == 0
    )
    zipfile.ZipFile(store / "intent.mar").extractall(tmp_path / "unpacked")
    engine = load_package(tmp_path / "unpacked", engine=Engine)
    (tmp_path / "ts").mkdir()
    server = TorchServe(tmp_path / "ts", store).start()
    try:
        server.register("intent.mar")
        status, body = server.predict("intent", json.dumps({"texts": TEXTS[:3]}).encode())
        assert status == 200
        answer = json.loads(body)
        assert answer["labels"] == NAMES[5]
        torch.testing.assert_close(
            torch.tensor(answer["scores"]), torch.tensor(engine.score(TEXTS[:3])), atol=1e-6, rtol=0
        )
        torch.testing.assert_close(
            torch.tensor(answer["scores"]), torch.softmax(hf_rows(model, engine, TEXTS[:3]), -1), atol=1e-4, rtol=0
        )
        status, body = server.predict("intent", json.dumps({"texts": ["x"] * 5}).encode())  # over max_texts
        assert status == 400 and "error" in json.loads(body)
    finally:
        server.stop()
