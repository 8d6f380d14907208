"""Helpers the test tiers share: engines on a loaded checkpoint, transformers references for the
tasks on token ids, classifier checkpoints."""

import json

import torch

from slm_core.api import Engine
from slm_core.compile.eager import eager_engine
from slm_core.spec import RuntimeSpec, TaskSpec

GENERATE = dict(do_sample=False, early_stopping=True, length_penalty=0.0)


@torch.no_grad()
def hf_score(model, ids_per_text: list[list[int]], label_ids: list[int]) -> list[list[float]]:
    """Each text alone (no batching, no padding): softmax over the label logits at its last token."""
    rows = []
    for ids in ids_per_text:
        logits = model(torch.tensor([ids], device=model.device)).logits[0, -1].float()
        rows.append(torch.softmax(logits[label_ids], dim=-1).tolist())
    return rows


@torch.no_grad()
def hf_beam(model, prompt_ids: list[int], width: int, new_tokens: int, stop_ids: list[int], pad_id: int):
    """[(token ids up to the end, score)] from generate(), best first, pad after the end stripped
    using the stop ids (a candidate ends at its first stop token or after new_tokens)."""
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        num_beams=width,
        num_return_sequences=width,
        max_new_tokens=new_tokens,
        eos_token_id=stop_ids or None,
        pad_token_id=pad_id,
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
        **GENERATE,
    )
    sequences = out.sequences[:, len(prompt_ids) :].tolist()
    if width == 1:  # generate() runs greedy search: no sequences_scores, sum the chosen log-probs
        steps = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, sequences[0])]
        scores = [sum(steps[: _end(sequences[0], stop_ids)])]
    else:
        scores = out.sequences_scores.tolist()
    result = []
    for seq, score in zip(sequences, scores):
        end = _end(seq, stop_ids)
        assert all(t == pad_id for t in seq[end:]), seq
        result.append((seq[:end], score))
    return result


def _end(seq: list[int], stop_ids: list[int]) -> int:
    return next((i + 1 for i, t in enumerate(seq) if t in stop_ids), len(seq))


def assert_same_beams(ours: list[dict], ref: list[tuple[list[int], float]], tol: float = 5e-4) -> None:
    """The same candidates in the same order, scores within `tol`: fp32 sums of up to 5 log-probs,
    whose GEMMs oneDNN blocks by shape and CPU (packed [T, H] here, [1, T, H] in transformers): an
    AMD EPYC measured 1.1e-4 on SmolLM2, other machines under 1e-4."""
    assert [c["token_ids"] for c in ours] == [ids for ids, _ in ref]
    for c, (_, score) in zip(ours, ref):
        assert abs(c["score"] - score) <= tol, (c, score)


def engine_for(ckpt, device: "str | RuntimeSpec" = "cpu", **task) -> Engine:
    """An eager engine on an already loaded checkpoint (fp32 unless the task says otherwise)."""
    runtime = device if isinstance(device, RuntimeSpec) else RuntimeSpec(device)
    return eager_engine(ckpt, TaskSpec.from_dict({"precision": "fp32", **task}), runtime, Engine)


def text_ids(engine: Engine, texts: list[str]) -> list[list[int]]:
    tok = engine.tokenizer
    return [tok.tokenizer.encode(tok.apply_template(t)).ids for t in texts]


# --- classifier checkpoints (head: classifier) ----------------------------------------------------
CLASSIFIER_TEXTS = [
    "the quick brown fox",
    "is this query about travel or music?",
    "a",
    "numbers like 12 and 345 appear",
]
CLASSIFIER_NAMES = {2: ["irrelevant", "relevant"], 5: ["news", "music", "travel", "shopping", "other"]}


def classifier_checkpoint(folder, arch: str, labels: int, id2label: bool = True):
    """A random `*ForSequenceClassification` checkpoint (wide init: peaked rows) and its HF model."""
    from conftest import RANDOM_CONFIGS, train_tokenizer
    from transformers import AutoConfig, AutoModelForSequenceClassification

    train_tokenizer(folder / "tokenizer.json")
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    names = {
        "id2label": dict(enumerate(CLASSIFIER_NAMES[labels])),
        "label2id": {n: i for i, n in enumerate(CLASSIFIER_NAMES[labels])},
    }
    cfg = AutoConfig.for_model(
        arch,
        vocab_size=len(vocab),
        initializer_range=0.25,
        rms_norm_eps=1e-6,
        max_position_embeddings=1024,
        num_labels=labels,
        pad_token_id=0,
        **(names if id2label else {}),
        **RANDOM_CONFIGS[arch],
    )
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(folder)
    return model


def hf_rows(model, engine: Engine, texts: list[str]) -> torch.Tensor:
    """HF logits, one text at a time (its pooling takes the last token then: no padding)."""
    tok = engine.tokenizer
    with torch.no_grad():
        return torch.cat([model(torch.tensor([tok.tokenizer.encode(tok.apply_template(t)).ids])).logits for t in texts])


# --- embedding and MLP heads (head: embedding, head: mlp) ----------------------------------------
@torch.no_grad()
def hf_embeddings(model, ids_per_text: list[list[int]]) -> torch.Tensor:
    """Each text alone: transformers' last hidden state (after the final norm) at its last token."""
    return torch.stack([model.model(torch.tensor([ids])).last_hidden_state[0, -1].float() for ids in ids_per_text])


def write_mlp(
    path,
    widths: list[int],
    activation: str | None = "gelu",
    labels: list[str] | None = None,
    bias: bool = True,
    seed: int = 0,
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """A random MLP of widths[0] inputs -> ... -> widths[-1] outputs; returns its layers."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    layers, tensors = [], {}
    for i, (n_in, n_out) in enumerate(zip(widths, widths[1:])):
        w = torch.randn(n_out, n_in, generator=g) * (2.0 / n_in) ** 0.5
        b = torch.randn(n_out, generator=g) * 0.1 if bias else None
        tensors[f"layers.{i}.weight"] = w
        if b is not None:
            tensors[f"layers.{i}.bias"] = b
        layers.append((w, b))
    meta = {**({"activation": activation} if activation else {}), **({"labels": json.dumps(labels)} if labels else {})}
    save_file(tensors, str(path), metadata=meta or None)
    return layers


# --- catalog-constrained beams (generative retrieval) ---------------------------------------------
class ItemTrie:
    """A reference trie of item token lists, built here without slm_core.item_trie: what
    transformers' prefix_allowed_tokens_fn allows after a generated prefix."""

    def __init__(self, items: list[list[int]], stop_ids: list[int], new_tokens: int):
        self.items = {tuple(i) for i in items}
        self.stop_ids, self.new_tokens = list(stop_ids), new_tokens

    def allowed(self, prefix: tuple[int, ...]) -> list[int]:
        """Children that still lead to an item of at most new_tokens tokens, and the stop tokens
        where the prefix is an item. After a stop, or off the trie, only the stops (an empty list
        is an error in transformers; those beams score -inf or are finished backups)."""
        if any(t in self.stop_ids for t in prefix):
            return self.stop_ids or [0]
        n = len(prefix)
        out = sorted({i[n] for i in self.items if len(i) > n and i[:n] == prefix and len(i) <= self.new_tokens})
        if prefix in self.items:
            out += self.stop_ids
        return out or self.stop_ids or [0]


@torch.no_grad()
def hf_catalog_beam(
    model,
    prompt_ids: list[int],
    width: int,
    new_tokens: int,
    stop_ids: list[int],
    items: list[list[int]],
    catalog_scores: str = "vocab",
):
    """[(token ids up to the end, score)] of transformers' beam search constrained to `items`,
    best first, the candidates scored above -1e8 only. "vocab" scores as transformers does
    (log_softmax over the vocabulary, then prefix_allowed_tokens_fn's mask); "catalog" normalises
    over the catalog's tokens (the items' and the stops) first, in one logits processor."""
    from transformers import LogitsProcessor, LogitsProcessorList

    trie = ItemTrie(items, stop_ids, new_tokens)
    start = len(prompt_ids)
    vocab = sorted({t for i in items for t in i} | set(stop_ids))

    class Constrain(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if catalog_scores == "catalog":
                scores = scores - torch.logsumexp(scores[:, vocab], dim=-1, keepdim=True)
            mask = torch.full_like(scores, -float("inf"))
            for row, seq in enumerate(input_ids):
                mask[row, trie.allowed(tuple(seq[start:].tolist()))] = 0
            return scores + mask

    pad = stop_ids[0] if stop_ids else 0
    constraint = (
        dict(prefix_allowed_tokens_fn=lambda batch, seq: trie.allowed(tuple(seq[start:].tolist())))
        if catalog_scores == "vocab"
        else dict(logits_processor=LogitsProcessorList([Constrain()]))
    )
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        num_beams=width,
        num_return_sequences=width,
        max_new_tokens=new_tokens,
        eos_token_id=stop_ids or None,
        pad_token_id=pad,
        output_scores=True,
        return_dict_in_generate=True,
        **constraint,
        **GENERATE,
    )
    result = []
    for seq, score in zip(out.sequences[:, start:].tolist(), out.sequences_scores.tolist()):
        if score > -1e8:
            end = _end(seq, stop_ids)
            result.append((seq[:end], score))
    return result


def write_catalog(path, items: list, ids: list | None = None) -> None:
    """A JSONL catalog: token lists as {"id", "tokens"}, strings as {"id", "text"}."""
    ids = ids or [f"item-{i}" for i in range(len(items))]
    path.write_text(
        "".join(
            json.dumps({"id": i, "tokens" if isinstance(x, list) else "text": x}) + "\n" for i, x in zip(ids, items)
        )
    )
