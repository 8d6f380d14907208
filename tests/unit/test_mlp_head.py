"""Score tasks with a user's MLP head (head: mlp): the embedding of head: embedding fed to an MLP
read from a safetensors file, in FP32 inside the graph, against a torch reference of the same MLP
over transformers' last hidden state (random Qwen3, fp32, CPU); the file's errors at build."""

import pytest
import torch
import torch.nn.functional as F
from helpers import CLASSIFIER_TEXTS as TEXTS
from helpers import hf_embeddings, text_ids, write_mlp
from safetensors.torch import save_file

from slm_core import Engine
from slm_core.errors import SpecError

TASK = {"task": "score", "head": "mlp", "precision": "fp32", "max_texts": 8, "max_text_tokens": 64}


def reference(embeddings: torch.Tensor, layers, activation: str, logits: bool) -> torch.Tensor:
    act = {"relu": torch.relu, "gelu": F.gelu, "silu": F.silu}[activation]
    x = embeddings
    for i, (w, b) in enumerate(layers):
        x = F.linear(x, w, b)
        x = act(x) if i < len(layers) - 1 else x
    return x if logits else torch.softmax(x, -1)


@pytest.mark.parametrize("activation", ["relu", "gelu", "silu"])
@pytest.mark.parametrize("output", ["probs", "logits"])
def test_mlp_head_matches_a_torch_reference_of_the_same_mlp(tmp_path, random_checkpoint, activation, output):
    folder, model = random_checkpoint("qwen3")
    layers = write_mlp(tmp_path / "head.safetensors", [64, 32, 16, 3], activation, ["news", "music", "travel"])
    engine = Engine.from_checkpoint(folder, {**TASK, "mlp": str(tmp_path / "head.safetensors"), "output": output})
    assert engine.task.labels == ["news", "music", "travel"]  # from the file's metadata
    want = reference(hf_embeddings(model, text_ids(engine, TEXTS)), layers, activation, output == "logits")
    got = torch.tensor(engine.score(TEXTS))  # all texts packed in one call
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (got.amax(0) - got.amin(0)).max() > 0.05  # texts get unlike rows: the comparison means something


def test_mlp_head_over_a_cut_normalised_embedding_with_the_tasks_labels(tmp_path, random_checkpoint):
    folder, model = random_checkpoint("qwen3")
    layers = write_mlp(tmp_path / "head.safetensors", [16, 8, 2], activation=None, bias=False)  # relu by default
    spec = {**TASK, "mlp": str(tmp_path / "head.safetensors"), "dims": 16, "normalize": True}
    assert Engine.from_checkpoint(folder, spec).task.labels == ["LABEL_0", "LABEL_1"]
    engine = Engine.from_checkpoint(folder, {**spec, "labels": ["no", "yes"]})
    assert engine.task.labels == ["no", "yes"]
    embeddings = F.normalize(hf_embeddings(model, text_ids(engine, TEXTS))[:, :16], dim=-1)
    torch.testing.assert_close(
        torch.tensor(engine.score(TEXTS)), reference(embeddings, layers, "relu", False), atol=1e-5, rtol=0
    )


def test_a_head_that_does_not_fit_is_a_build_error_that_says_what(tmp_path, random_checkpoint):
    folder, _ = random_checkpoint("qwen3")
    path = tmp_path / "head.safetensors"

    def build(**task):
        return Engine.from_checkpoint(folder, {**TASK, "mlp": str(path), **task})

    write_mlp(path, [48, 8, 2])
    with pytest.raises(SpecError, match=r"layers.0.weight is \[8, 48\]: it takes 48 inputs, but the task's dims 64"):
        build()
    build(dims=48)  # a cut embedding fits it
    save_file({"layers.0.weight": torch.zeros(8, 64), "layers.1.weight": torch.zeros(2, 7)}, str(path))
    with pytest.raises(SpecError, match=r"layers.1.weight is \[2, 7\]: it takes 7 inputs, but layers.0's 8 outputs"):
        build()
    save_file({"layers.0.weight": torch.zeros(8, 64), "layers.2.weight": torch.zeros(2, 8)}, str(path))
    with pytest.raises(SpecError, match=r"layers are \[0, 2\]"):
        build()
    save_file({"layers.0.weight": torch.zeros(8, 64), "layers.0.bias": torch.zeros(3)}, str(path))
    with pytest.raises(SpecError, match=r"layers.0.bias is \[3\], expected \[8\]"):
        build()
    save_file({"fc.weight": torch.zeros(2, 64)}, str(path))
    with pytest.raises(SpecError, match="holds 'fc.weight'"):
        build()
    write_mlp(path, [64, 2], activation="tanh")
    with pytest.raises(SpecError, match="activation 'tanh' must be one of"):
        build()
    write_mlp(path, [64, 3], labels=["a", "b"])
    with pytest.raises(SpecError, match="must name the 3 outputs"):
        build()
    save_file({"layers.0.weight": torch.zeros(2, 64)}, str(path), metadata={"labels": '"ab"'})
    with pytest.raises(SpecError, match="'labels' must be a JSON array of names"):
        build()
    write_mlp(path, [64, 3])
    with pytest.raises(SpecError, match="the task names 2 labels, but the MLP has 3 outputs"):
        build(labels=["a", "b"])
    write_mlp(path, [64, 1])
    with pytest.raises(SpecError, match=r"answering probs needs at least 2 output\(s\), got 1"):
        build()
    assert len(build(output="logits").score(["a"])[0]) == 1  # one logit per text: a relevance score
    path.write_bytes(b"not safetensors")
    with pytest.raises(SpecError, match="is not a safetensors file"):
        build()
    with pytest.raises(SpecError, match="does not exist"):
        build(mlp=str(tmp_path / "missing.safetensors"))
    with pytest.raises(SpecError, match="needs the task key 'mlp'"):
        Engine.from_checkpoint(folder, TASK)
    with pytest.raises(SpecError, match="'mlp' is for head: mlp"):
        Engine.from_checkpoint(folder, {"task": "score", "labels": ["a", "b"], "mlp": str(path)})
