"""Score tasks with a classification head (head: classifier): transformers
`*ForSequenceClassification` checkpoints through the same packed score graph, against
AutoModelForSequenceClassification on the same weights (fp32, CPU)."""

import pytest
import torch
from helpers import CLASSIFIER_NAMES as NAMES
from helpers import CLASSIFIER_TEXTS as TEXTS
from helpers import classifier_checkpoint, hf_rows

from slm_core import Engine
from slm_core.errors import SpecError


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("labels", [2, 5])
def test_classifier_head_matches_hf_sequence_classification(tmp_path, arch, labels):
    model = classifier_checkpoint(tmp_path, arch, labels)
    task = {"task": "score", "head": "classifier", "precision": "fp32", "max_texts": 8, "max_text_tokens": 64}
    engine = Engine.from_checkpoint(tmp_path, task)
    assert engine.task.labels == NAMES[labels]  # from config.json's id2label
    ref = hf_rows(model, engine, TEXTS)
    probs = torch.tensor(engine.score(TEXTS))  # all texts packed in one call
    torch.testing.assert_close(probs, torch.softmax(ref, -1), atol=1e-4, rtol=0)
    assert (probs.amax(0) - probs.amin(0)).max() > 0.1  # texts get unlike rows: the comparison means something
    logits = Engine.from_checkpoint(tmp_path, {**task, "output": "logits"}).score(TEXTS)
    torch.testing.assert_close(torch.tensor(logits), ref, atol=1e-4, rtol=1e-4)


def test_label_names_override_default_and_errors(tmp_path, random_checkpoint):
    classifier_checkpoint(tmp_path, "qwen3", 2, id2label=False)
    task = {"task": "score", "head": "classifier", "precision": "fp32"}
    assert Engine.from_checkpoint(tmp_path, task).task.labels == ["LABEL_0", "LABEL_1"]  # transformers' defaults
    assert Engine.from_checkpoint(tmp_path, {**task, "labels": ["no", "yes"]}).task.labels == ["no", "yes"]
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
        Engine.from_checkpoint(tmp_path, {"task": "beam", "head": "classifier"})
