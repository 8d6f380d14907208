"""GGUF checkpoints of Qwen2 and Qwen3 (slm_core.compile.checkpoint), equal to transformers loading
the same file: the hyperparameters, the tokenizer with its special and added tokens, and the
model's answers in fp32. The files are written here with the gguf package from random configs,
laid out as llama.cpp's converter lays them out (no hub is reachable)."""

import json

import numpy as np
import pytest
import torch
from conftest import SPECIALS, train_tokenizer
from helpers import CLASSIFIER_TEXTS as TEXTS
from helpers import engine_for, hf_embeddings, hf_score, text_ids

from slm_core.compile.checkpoint import load_checkpoint

CONFIGS = {
    # QKV bias, tied embeddings
    "qwen2": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    # q/k RMSNorm, untied; a head size other than hidden / heads (transformers' GGUF loader takes
    # Qwen3's default, 128, which llama.cpp writes as key_length)
    "qwen3": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        tie_word_embeddings=False,
    ),
}
LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
ADDED = "<think>"  # an added token that is not special (USER_DEFINED in GGUF)
PROBES = TEXTS + ["prices 12345 and 6.78", "<|im_start|>user\nhi<|im_end|>", f"{ADDED} the fox", "  spaced\n\nlines  "]


def write_gguf(path, model, tokenizer_json, arch: str) -> None:
    """`model`'s weights and `tokenizer_json`'s tokenizer as a GGUF file of `arch`."""
    import gguf
    from tokenizers import Tokenizer

    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if arch == "qwen3":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    tok = Tokenizer.from_file(str(tokenizer_json))
    added = {t.content: t.special for t in tok.get_added_tokens_decoder().values()}
    tokens = [tok.id_to_token(i) for i in range(tok.get_vocab_size(with_added_tokens=True))]
    merges = json.loads(tokenizer_json.read_text())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_token_types([3 if added.get(t) else 4 if t in added else 1 for t in tokens])
    w.add_eos_token_id(tok.token_to_id("<|im_end|>"))
    w.add_add_bos_token(False)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name in TOP:
            gguf_name = TOP[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            gguf_name = f"blk.{layer}.{LAYER[rest]}"
        w.add_tensor(gguf_name, np.ascontiguousarray(tensor.float().numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def gguf_pair(request, tmp_path_factory):
    """(arch, our Checkpoint, transformers' model and tokenizer) from one written GGUF file."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    arch, folder = request.param, tmp_path_factory.mktemp(f"gguf-{request.param}")
    train_tokenizer(folder / "tokenizer.json")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_tokens([AddedToken(ADDED, normalized=False, special=False)])
    tok.save(str(folder / "tokenizer.json"))
    cfg = AutoConfig.for_model(
        arch,
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        initializer_range=0.25,
        rms_norm_eps=1e-6,
        max_position_embeddings=1024,
        **CONFIGS[arch],
    )
    torch.manual_seed(2)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    write_gguf(folder / "model.gguf", model, folder / "tokenizer.json", arch)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(folder, gguf_file="model.gguf")
    return arch, load_checkpoint(folder / "model.gguf"), hf, hf_tok


def test_hyperparameters_are_transformers(gguf_pair):
    arch, ckpt, hf, _ = gguf_pair
    spec, cfg = ckpt.spec, hf.config
    assert (spec.arch, spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        arch,
        cfg.hidden_size,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
    )
    assert (spec.vocab_size, spec.intermediate_size, spec.tie_word_embeddings) == (
        cfg.vocab_size,
        cfg.intermediate_size,
        cfg.tie_word_embeddings,
    )
    assert spec.rope.theta == cfg.rope_parameters["rope_theta"] and spec.rms_norm_eps == pytest.approx(cfg.rms_norm_eps)
    assert (spec.qkv_bias, spec.qk_norm) == ((True, False) if arch == "qwen2" else (False, True))
    if arch == "qwen3":
        assert spec.head_dim == 128 != spec.hidden_size // spec.num_heads  # key_length, not hidden / heads


def test_the_tokenizer_is_transformers_with_special_and_added_tokens(gguf_pair):
    _, ckpt, _, hf_tok = gguf_pair
    for text in PROBES:
        assert ckpt.tokenizer.encode(text).ids == hf_tok(text, add_special_tokens=False)["input_ids"], text
    ids = ckpt.tokenizer.encode(PROBES[-3]).ids
    assert [ckpt.tokenizer.id_to_token(i) for i in ids[:1]] == ["<|im_start|>"]  # special: matched whole
    assert ckpt.tokenizer.token_to_id(ADDED) in ckpt.tokenizer.encode(PROBES[-2]).ids  # added: matched whole
    assert {s: ckpt.tokenizer.token_to_id(s) for s in SPECIALS} == {
        s: hf_tok.convert_tokens_to_ids(s) for s in SPECIALS
    }


def test_answers_are_transformers_on_the_same_file(gguf_pair):
    _, ckpt, hf, _ = gguf_pair
    engine = engine_for(ckpt, task="score", labels=["the", "a"], max_texts=8, max_text_tokens=64)
    ids = text_ids(engine, PROBES[:4])
    torch.testing.assert_close(
        torch.tensor(engine.score(PROBES[:4])),
        torch.tensor(hf_score(hf, ids, engine.task.label_ids)),
        atol=1e-4,
        rtol=0,
    )
    embed = engine_for(ckpt, task="score", head="embedding", max_texts=8, max_text_tokens=64)
    torch.testing.assert_close(torch.tensor(embed.embed(PROBES[:4])), hf_embeddings(hf, ids), atol=1e-4, rtol=0)
