"""The Python API of DESIGN.md end to end: checkpoint path + task YAML -> answers; clear errors."""

import json

import pytest

from conftest import CHAT, smollm2_path
from slm_core import Engine, InputError, SpecError
from slm_core.checkpoint import load_checkpoint


def write_yaml(path, text):
    path.write_text(text)
    return path


def test_from_checkpoint_with_yaml_tasks(tmp_path):
    score_yaml = write_yaml(tmp_path / "score.yaml", f"task: score\nprompt_template: {json.dumps(CHAT)}\n"
                            'labels: ["Yes", "No"]\nmax_texts: 4\nmax_text_tokens: 128\nprecision: fp32\n')
    eng = Engine.from_checkpoint(smollm2_path(), task=score_yaml, device="cpu")
    rows = eng.score(["Is Paris in France? Answer Yes or No.", "Is the sun cold? Answer Yes or No."])
    assert len(rows) == 2 and all(len(r) == 2 and abs(sum(r) - 1) < 1e-5 for r in rows)
    assert rows[0][0] > rows[1][0]  # the real model's answers: more "Yes" for the true statement
    with pytest.raises(InputError, match="max_texts=4"):
        eng.score(["a"] * 5)
    with pytest.raises(TypeError, match="'score' task"):
        eng.beam("hello")

    beam_yaml = write_yaml(tmp_path / "beam.yaml", f"task: beam\nprompt_template: {json.dumps(CHAT.replace('{text}', '{prompt}'))}\n"
                           'beam_width: 3\nnew_tokens: 4\nstop: ["<|im_end|>"]\nprecision: fp32\n')
    eng = Engine.from_checkpoint(smollm2_path(), task=beam_yaml)
    out = eng.beam("What is the capital of France?")
    assert len(out) == 3 and [c["score"] for c in out] == sorted((c["score"] for c in out), reverse=True)
    assert out[0]["text"] == "The capital of France"  # the real model's best 4-token answer
    assert all(c["text"] == eng.tokenizer.decode(c["token_ids"]) for c in out)


def test_checkpoint_errors(tmp_path, random_checkpoint):
    with pytest.raises(SpecError, match="neither an HF-style directory nor a .gguf"):
        load_checkpoint(tmp_path / "nothing.bin")
    with pytest.raises(SpecError, match="has no config.json"):
        load_checkpoint(tmp_path)
    folder, _ = random_checkpoint("qwen2")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in folder.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    from safetensors.torch import load_file, save_file

    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(SpecError, match="lacks 1 weights.*up_proj"):
        Engine.from_checkpoint(broken, task={"task": "score", "labels": ["yes", "no"]})


def test_beam_width_must_fit_the_vocabulary(random_checkpoint):
    folder, _ = random_checkpoint("qwen3")
    vocab = load_checkpoint(folder).spec.vocab_size
    with pytest.raises(SpecError, match="needs 2 \\* beam_width <= vocab size"):
        Engine.from_checkpoint(folder, task={"task": "beam", "beam_width": vocab // 2 + 1})
