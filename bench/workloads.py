"""Workloads W1-W4 (W1c, W1e: W1 with a classifier head, with embeddings; W4c): architectures (random
weights), catalogs and request generators.

Requests are real-looking text: words drawn Zipf-like from the tokenizer's own whole-word tokens,
so that each text's token count under that tokenizer is exactly the length drawn from the
workload's distribution (checked by re-encoding).
"""

import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

QWEN3_06B = dict(
    model_type="qwen3",
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151936,
    tie_word_embeddings=True,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=40960,
)
# W1c: the same model fine-tuned as a classifier (transformers Qwen3ForSequenceClassification: a
# `score` head [2, hidden] on the last token, no LM head) and served with head: classifier
QWEN3_06B_CLS = dict(QWEN3_06B, num_labels=2, id2label={0: "irrelevant", 1: "relevant"})
QWEN25_05B = dict(
    model_type="qwen2",
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    tie_word_embeddings=True,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
)


@dataclass(frozen=True)
class Workload:
    name: str
    model: str  # the archive serving it: slm_<model>.mar, hf_<model>.mar (W2 and W3 share one)
    arch: dict
    task: dict  # the task YAML of the archive that serves it
    texts: int  # texts per request (0: a beam prompt)
    lengths: tuple[int, int]  # token count of each text / the prompt, uniform in [lo, hi]


SCORE_TASK = dict(task="score", labels=["Yes", "No"], max_texts=16, max_text_tokens=160, precision="bf16")
CLASSIFIER_TASK = dict(task="score", head="classifier", max_texts=16, max_text_tokens=160, precision="bf16")
# W1e: W1's texts answered with their embeddings (head: embedding): W1's prefill, no LM head row
EMBEDDING_TASK = dict(task="score", head="embedding", max_texts=16, max_text_tokens=160, precision="bf16")
BEAM_TASK = dict(
    task="beam", beam_width=100, new_tokens=5, max_prompt_tokens=512, stop=["<|im_end|>"], precision="bf16"
)
# W4, generative retrieval: W2's model and prompts, W = 100, N = 4, constrained to a catalog of
# semantic IDs (catalog_items); W4c normalises its scores over the catalog's tokens only. The
# catalog path is filled in where the bench writes it.
RETRIEVE_TASK = dict(
    task="beam",
    beam_width=100,
    new_tokens=4,
    max_prompt_tokens=512,
    precision="bf16",
    max_items=1_048_576,
    max_trie_nodes=4_194_304,
)
SEMANTIC_ID_BASE = 40_000  # level d's token ids: SEMANTIC_ID_BASE + 256 d + [0, 256), inside the bench tokenizer's
WORKLOADS = {
    "W1": Workload("W1", "score_qwen3", QWEN3_06B, SCORE_TASK, texts=15, lengths=(64, 160)),
    "W1c": Workload("W1c", "cls_qwen3", QWEN3_06B_CLS, CLASSIFIER_TASK, texts=15, lengths=(64, 160)),
    "W1e": Workload("W1e", "embed_qwen3", QWEN3_06B, EMBEDDING_TASK, texts=15, lengths=(64, 160)),
    "W2": Workload("W2", "beam_qwen25", QWEN25_05B, BEAM_TASK, texts=0, lengths=(48, 128)),
    "W3": Workload("W3", "beam_qwen25", QWEN25_05B, BEAM_TASK, texts=0, lengths=(384, 512)),
    "W4": Workload("W4", "retrieve_qwen25", QWEN25_05B, RETRIEVE_TASK, texts=0, lengths=(48, 128)),
    "W4c": Workload(
        "W4c", "retrievec_qwen25", QWEN25_05B, dict(RETRIEVE_TASK, catalog_scores="catalog"), texts=0, lengths=(48, 128)
    ),
}


def catalog_items(path: Path, count: int = 1_000_000, seed: int = 0) -> Path:
    """A JSONL catalog of up to `count` items, each a 4-token semantic ID, one token from each of 4
    ranges of 256 ids, drawn uniformly and deduplicated: {"id": "sku-SEED-N", "tokens": [...]}.
    Written once: a path that exists is taken as it is (name it by count and seed)."""
    if path.exists():
        return path
    codes = np.unique(np.random.default_rng(seed).integers(0, 256, (count, 4)), axis=0)
    tokens = codes + SEMANTIC_ID_BASE + 256 * np.arange(4)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(".part")  # a run that stops half way leaves no catalog behind
    with part.open("w") as f:
        for i, row in enumerate(tokens.tolist()):
            f.write(json.dumps({"id": f"sku-{seed}-{i}", "tokens": row}) + "\n")
    part.rename(path)
    return path


class TextMaker:
    """Texts of an exact token count, from the tokenizer's whole-word tokens (" word" -> 1 token)."""

    def __init__(self, tokenizer: Tokenizer, seed: int = 0):
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        # Byte-level BPE spells a leading space as "Ġ"; keep lowercase alphabetic words, ordered by
        # id (merge order ~ frequency), and weight them Zipf-like so common words dominate.
        words = sorted(
            (i, t[1:])
            for t, i in vocab.items()
            if t.startswith("Ġ")
            and t[1:].isalpha()
            and t[1:].islower()
            and len(t) > 3
            and any(v in t for v in "aeiouy")
        )
        self.words = [w for _, w in words if len(self.tokenizer.encode(" " + w).ids) == 1]
        if len(self.words) < 100:
            raise ValueError("the tokenizer has too few whole-word tokens to make text from")
        self.weights = [1.0 / (rank + 10) for rank in range(len(self.words))]
        self.rng = random.Random(seed)

    def text(self, tokens: int) -> str:
        words = self.rng.choices(self.words, self.weights, k=tokens)
        text = words[0].capitalize() + "".join(" " + w for w in words[1:])
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        while len(ids) > tokens:  # the first, space-less word may split: drop words until it fits
            text = text.rsplit(" ", 1)[0]
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        while len(ids) < tokens:
            text += " " + self.rng.choice(self.words[:200])
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        assert len(ids) == tokens, (len(ids), tokens)
        return text

    def requests(self, workload: Workload, count: int) -> list[dict]:
        """`count` request bodies for the workload (JSON-ready dicts)."""
        lo, hi = workload.lengths
        if workload.texts:
            return [
                {"texts": [self.text(self.rng.randint(lo, hi)) for _ in range(workload.texts)]} for _ in range(count)
            ]
        return [{"prompt": self.text(self.rng.randint(lo, hi))} for _ in range(count)]
