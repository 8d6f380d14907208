"""Specs: strict parsing, clear errors, architecture import from config.json."""

import pytest

from slm_core import RuntimeSpec, SpecError, TaskSpec
from slm_core.spec import ModelSpec

QWEN3 = {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "attention_bias": False,
}


def test_task_yaml_round_trip(tmp_path):
    path = tmp_path / "task.yaml"
    path.write_text('task: score\nprompt_template: "Q: {text}"\nlabels: ["Yes", "No"]\nmax_texts: 16\n')
    spec = TaskSpec.load(path)
    assert spec.labels == ("Yes", "No") and spec.max_texts == 16 and spec.prompt_template == "Q: {text}"
    assert spec.max_batch is None  # the kind's default for the device, resolved by slm_core.tasks.task_for
    assert TaskSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize(
    "data, message",
    [
        ({"task": "score", "labels": ["a", "b"], "max_text": 3}, "unknown key 'max_text'.*'max_texts'"),
        ({"task": "score", "labels": ["a", "b"], "colour": 1}, "unknown key 'colour'"),
        ({"labels": ["a", "b"]}, "missing the key 'task'"),
        ({"task": "score", "labels": "ab"}, "'labels' must be a list"),
        ({"task": "score", "labels": ["a", ""]}, "'labels' must be a list of non-empty strings"),
        ({"task": "beam", "beam_width": 0}, "'beam_width' must be a positive integer"),
        ({"task": "beam", "new_tokens": 2.5}, "'new_tokens' must be a positive integer"),
        ({"task": "beam", "max_prompt_tokens": True}, "'max_prompt_tokens' must be a positive integer"),
        ({"task": "beam", "precision": "int4"}, "'precision' must be one of"),
        ({"task": "beam", "precision": "fp8-mlp"}, "'precision' must be one of"),
        ({"task": "beam", "max_batch": 0}, "'max_batch' must be a positive integer"),
        ({"task": "beam", "allow_special_tokens": "yes"}, "'allow_special_tokens' must be true or false"),
    ],
)
def test_task_errors_name_the_key(data, message):
    with pytest.raises(SpecError, match=message):
        TaskSpec.from_dict(data)


def test_frozen():
    spec = TaskSpec(task="beam")
    with pytest.raises(AttributeError):
        spec.beam_width = 3


def test_model_spec_from_qwen3_config():
    spec = ModelSpec.from_hf_config(QWEN3)
    assert (spec.head_dim, spec.q_size, spec.kv_size) == (128, 2048, 1024)
    assert spec.qk_norm and not spec.qkv_bias and spec.rope.theta == 1e6
    qwen2 = ModelSpec.from_hf_config({**QWEN3, "model_type": "qwen2", "head_dim": None})
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm and qwen2.head_dim == 64


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ({"num_key_value_heads": 5}, "not a multiple"),
    ],
)
def test_model_spec_refuses_what_it_cannot_run(change, message):
    with pytest.raises(SpecError, match=message):
        ModelSpec.from_hf_config({**QWEN3, **change})


def test_runtime_spec_takes_the_kernels_of_its_device():
    """The archiver, the Python API and the build choose kernels the same way: by device."""
    assert RuntimeSpec("cuda:1").kernels == "triton" and RuntimeSpec("cpu").kernels == "reference"
    assert RuntimeSpec("cpu", kernels="triton").kernels == "triton"  # Triton's interpreter, in tests
    with pytest.raises(SpecError, match="only cpu and cuda"):
        RuntimeSpec(device="meta")
    with pytest.raises(SpecError, match="kernels must be 'reference' or 'triton'"):
        RuntimeSpec(kernels="radix")
