"""Checkpoint import: HF-style directories and GGUF files -> (ModelSpec, HF-named weights, tokenizer).

Weights keep transformers' names (`model.layers.{i}.self_attn.q_proj.weight`, ...) so that one
loader (slm_core.compile.model.Transformer.load_hf_weights) fuses them whatever the source.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from slm_core.byte_table import byte_alphabet
from slm_core.errors import SpecError
from slm_core.pieces import QWEN2_SPLIT
from slm_core.spec import ARCHITECTURES, ModelSpec, RopeSpec


@dataclass(frozen=True)
class Checkpoint:
    spec: ModelSpec
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    config: dict = field(default_factory=dict)  # config.json as read (GGUF: empty)


def load_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path)
    if path.is_dir():
        return _load_hf_dir(path)
    if path.suffix == ".gguf" and path.is_file():
        return _load_gguf(path)
    raise SpecError(f"checkpoint {str(path)!r} is neither an HF-style directory nor a .gguf file")


# --- HF directories -----------------------------------------------------------------------------
def _load_hf_dir(path: Path) -> Checkpoint:
    from safetensors.torch import load_file

    for need in ("config.json", "tokenizer.json"):
        if not (path / need).is_file():
            raise SpecError(f"checkpoint directory {str(path)!r} has no {need}")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SpecError(f"checkpoint directory {str(path)!r} has no *.safetensors")
    config = json.loads((path / "config.json").read_text())
    spec = ModelSpec.from_hf_config(config)
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(f))
    return Checkpoint(spec, weights, Tokenizer.from_file(str(path / "tokenizer.json")), config)


# --- GGUF ---------------------------------------------------------------------------------------
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _load_gguf(path: Path) -> Checkpoint:
    """A GGUF file of the llama, qwen2 or qwen3 architecture: its hyperparameters, weights
    (dequantized to FP32) and tokenizer, as transformers' GGUF loader reads them."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta = {name: f.contents() for name, f in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise SpecError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")

    def key(name: str, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise SpecError(f"GGUF file has no {arch}.{name}")
        return value

    names = {t.name for t in reader.tensors}
    heads, hidden = int(key("attention.head_count")), int(key("embedding_length"))
    # llama.cpp writes a head size that is not hidden / heads as key_length (qwen3), and llama's as
    # the RoPE dimension
    head_dim = key("attention.key_length", meta.get(f"{arch}.rope.dimension_count", hidden // heads))
    spec = ModelSpec(
        arch=arch,
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(head_dim),
        intermediate_size=int(key("feed_forward_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope=RopeSpec(theta=float(key("rope.freq_base", 10000.0))),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        max_position_embeddings=int(key("context_length", 8192)),
    )
    if f"{arch}.rope.scaling.type" in meta:
        raise SpecError("GGUF rope scaling is not supported")
    if (arch == "qwen3") != spec.qk_norm:
        raise SpecError(f"GGUF {arch} file {'without' if arch == 'qwen3' else 'with'} q/k norms")
    weights = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)  # fp32, [rows, cols] as in torch
        w = np.ascontiguousarray(w.reshape([int(n) for n in reversed(t.shape)]))
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            # llama.cpp interleaves the RoPE halves of llama's q/k rows (and only llama's); undo it,
            # as transformers' loader does.
            n = heads if "attn_q" in t.name else spec.num_kv_heads
            w = w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        weights[_gguf_to_hf_name(t.name)] = torch.from_numpy(np.array(w, dtype=np.float32))  # own, writable copy
    return Checkpoint(spec, weights, _gguf_tokenizer(meta))


def classifier_head(
    ckpt: Checkpoint, names: tuple[str, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor | None, tuple[str, ...]]:
    """The sequence-classification head of a transformers `*ForSequenceClassification` checkpoint:
    its `score` weight [num_labels, hidden], bias (None: the Llama/Qwen2/Qwen3 heads have none) and
    label names: `names` when given (one per row), else config.json's id2label in id order."""
    weight = ckpt.weights.get("score.weight")
    if weight is None:
        raise SpecError(
            "head: classifier needs a sequence-classification checkpoint (transformers "
            "*ForSequenceClassification, with a `score` layer); this checkpoint has no score.weight"
        )
    if weight.ndim != 2 or weight.shape[1] != ckpt.spec.hidden_size or weight.shape[0] < 2:
        raise SpecError(
            f"score.weight has shape {tuple(weight.shape)}; a head is [num_labels >= 2, hidden {ckpt.spec.hidden_size}]"
        )
    n = weight.shape[0]
    if not names:
        id2label = ckpt.config.get("id2label") or {}
        try:
            names = tuple(str(id2label[k]) for k in sorted(id2label, key=int))
        except ValueError:
            raise SpecError(f"config.json id2label keys must be label ids, got {sorted(id2label)[:5]}") from None
        if not names:
            names = tuple(f"LABEL_{i}" for i in range(n))  # transformers' own default names
    if len(names) != n:
        raise SpecError(f"the classification head has {n} labels, the names are {len(names)}: {list(names)[:8]}")
    if len(set(names)) != n:
        raise SpecError(f"label names must be distinct, got {list(names)}")
    return weight, ckpt.weights.get("score.bias"), tuple(names)


def _gguf_to_hf_name(name: str) -> str:
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    blk, layer, rest = name.split(".", 2)
    if blk != "blk" or rest not in _GGUF_LAYER_NAMES:
        raise SpecError(f"GGUF tensor {name!r} is not a known llama, qwen2 or qwen3 tensor")
    return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[rest]}"


# The pre-tokenizer splits a GGUF names (tokenizer.ggml.pre) other than GPT-2's: Qwen2's, which
# Qwen2.5 and Qwen3 files name too; one digit per piece, unlike GPT-2's runs.
_GGUF_SPLITS = {"qwen2": QWEN2_SPLIT}


def _gguf_tokenizer(meta: dict) -> Tokenizer:
    """The byte-level BPE a GGUF describes, built the way transformers' GGUF loader builds it."""
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in ("default", "gpt2", "smollm", *_GGUF_SPLITS):
        raise SpecError(
            f"GGUF tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported (supported: gpt2 with "
            f"{', '.join(['default', 'gpt2', 'smollm', *_GGUF_SPLITS])})"
        )
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(tokens)
    }
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    if pre in _GGUF_SPLITS:  # the vocabulary's own split, then bytes
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_GGUF_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:  # GPT-2's split
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or []
    # 3 = CONTROL (special, matched whole), 4 = USER_DEFINED (added, not special).
    tok.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, ty in zip(tokens, types)
            if ty == 3 and set(t) <= alphabet
        ]
    )
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == 4])
    return tok
