"""Score tasks with a classification head (head: classifier): transformers
`*ForSequenceClassification` checkpoints through the same packed score graph, against
AutoModelForSequenceClassification on the same weights (fp32, CPU)."""

import json

import pytest
import torch

from conftest import RANDOM_CONFIGS, train_tokenizer
from slm_core.spec import TaskSpec
from slm_core.engine import Engine
from slm_core.errors import SpecError

TEXTS = ["the quick brown fox", "is this query about travel or music?", "a", "numbers like 12 and 345 appear"]
NAMES = {2: ["irrelevant", "relevant"], 5: ["news", "music", "travel", "shopping", "other"]}


def classifier_checkpoint(folder, arch: str, labels: int, id2label: bool = True):
    """A random `*ForSequenceClassification` checkpoint (wide init: peaked rows) and its HF model."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    train_tokenizer(folder / "tokenizer.json")
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    names = {"id2label": dict(enumerate(NAMES[labels])), "label2id": {n: i for i, n in enumerate(NAMES[labels])}}
    cfg = AutoConfig.for_model(arch, vocab_size=len(vocab), initializer_range=0.25, rms_norm_eps=1e-6,
                               max_position_embeddings=1024, num_labels=labels, pad_token_id=0,
                               **(names if id2label else {}), **RANDOM_CONFIGS[arch])
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(folder)
    return model


def hf_rows(model, engine: Engine, texts: list[str]) -> torch.Tensor:
    """HF logits, one text at a time (its pooling takes the last token then: no padding)."""
    tok = engine.tokenizer
    with torch.no_grad():
        return torch.cat([model(torch.tensor([tok.tokenizer.encode(tok.apply_template(t)).ids])).logits
                          for t in texts])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("labels", [2, 5])
def test_classifier_head_matches_hf_sequence_classification(tmp_path, arch, labels):
    model = classifier_checkpoint(tmp_path, arch, labels)
    task = {"task": "score", "head": "classifier", "precision": "fp32", "max_texts": 8, "max_text_tokens": 64}
    engine = Engine.from_checkpoint(tmp_path, task)
    assert engine.task.labels == tuple(NAMES[labels])  # from config.json's id2label
    ref = hf_rows(model, engine, TEXTS)
    probs = torch.tensor(engine.score(TEXTS))  # all texts packed in one call
    torch.testing.assert_close(probs, torch.softmax(ref, -1), atol=1e-4, rtol=0)
    assert (probs.amax(0) - probs.amin(0)).max() > 0.1  # texts get unlike rows: the comparison means something
    logits = Engine.from_checkpoint(tmp_path, {**task, "output": "logits"}).score(TEXTS)
    torch.testing.assert_close(torch.tensor(logits), ref, atol=1e-4, rtol=1e-4)


def test_label_names_override_default_and_errors(tmp_path, random_checkpoint):
    classifier_checkpoint(tmp_path, "qwen3", 2, id2label=False)
    task = {"task": "score", "head": "classifier", "precision": "fp32"}
    assert Engine.from_checkpoint(tmp_path, task).task.labels == ("LABEL_0", "LABEL_1")  # transformers' defaults
    assert Engine.from_checkpoint(tmp_path, {**task, "labels": ["no", "yes"]}).task.labels == ("no", "yes")
    with pytest.raises(SpecError, match="has 2 labels, the names are 3"):
        Engine.from_checkpoint(tmp_path, {**task, "labels": ["a", "b", "c"]})
    with pytest.raises(SpecError, match="head: classifier"):  # a classifier read as a language model
        Engine.from_checkpoint(tmp_path, {"task": "score", "labels": ["yes", "no"], "precision": "fp32"})
    lm_folder, _ = random_checkpoint("qwen3")  # a causal LM has no classification head
    with pytest.raises(SpecError, match="no score.weight"):
        Engine.from_checkpoint(lm_folder, task)
    for bad, message in (({"head": "pooler"}, "'head' must be"), ({"output": "raw"}, "'output' must be")):
        with pytest.raises(SpecError, match=message):
            Engine.from_checkpoint(tmp_path, {**task, **bad})
    with pytest.raises(SpecError, match="for score tasks"):
        TaskSpec.from_dict({"task": "beam", "head": "classifier"})


@pytest.mark.slow
def test_classifier_archive_serves_through_torchserve(tmp_path):
    """archiver build of a classifier task, served by TorchServe: the REST answer names the labels
    from id2label and equals the loaded package, which equals HF."""
    import zipfile

    import yaml

    from archiver.__main__ import main
    from handlers.local_server import TorchServe
    from slm_core.package import load_package

    (tmp_path / "ckpt").mkdir()
    model = classifier_checkpoint(tmp_path / "ckpt", "qwen2", 5)
    task = tmp_path / "task.yaml"
    task.write_text(yaml.safe_dump({"task": "score", "head": "classifier", "precision": "fp32", "max_texts": 4,
                                    "max_text_tokens": 32, "max_batch": 2}))
    store = tmp_path / "store"
    assert main(["build", "--checkpoint", str(tmp_path / "ckpt"), "--task", str(task), "--model-name", "intent",
                 "--export-path", str(store)]) == 0
    zipfile.ZipFile(store / "intent.mar").extractall(tmp_path / "unpacked")
    engine = load_package(tmp_path / "unpacked")
    (tmp_path / "ts").mkdir()
    server = TorchServe(tmp_path / "ts", store).start()
    try:
        server.register("intent.mar")
        status, body = server.predict("intent", json.dumps({"texts": TEXTS[:3]}).encode())
        assert status == 200
        answer = json.loads(body)
        assert answer["labels"] == NAMES[5]
        torch.testing.assert_close(torch.tensor(answer["scores"]), torch.tensor(engine.score(TEXTS[:3])), atol=1e-6, rtol=0)
        torch.testing.assert_close(torch.tensor(answer["scores"]), torch.softmax(hf_rows(model, engine, TEXTS[:3]), -1),
                                   atol=1e-4, rtol=0)
        status, body = server.predict("intent", json.dumps({"texts": ["x"] * 5}).encode())  # over max_texts
        assert status == 400 and "error" in json.loads(body)
    finally:
        server.stop()
