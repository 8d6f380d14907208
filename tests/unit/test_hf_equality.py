"""The engine against HF transformers on the same weights, fp32 on CPU."""

import pytest
from conftest import CHAT
from helpers import assert_same_beams, engine_for, hf_beam, hf_score, text_ids

from slm_core.compile.checkpoint import load_checkpoint

TEXTS = [
    "Is 'cheap flights to Rome' a travel query? Answer Yes or No.",
    "Is 'iphone 15 case' a travel query? Answer Yes or No.",
    "Does the phrase 'hotel near the beach' describe lodging?",
    "y",
    "Is the sky green? Answer with Yes or No only.",
]


# --- SmolLM2 (real weights, GGUF) ----------------------------------------------------------------
def test_smollm2_chat_template_matches_hf(smollm2):
    _, ckpt, _, hf_tok = smollm2
    eng = engine_for(ckpt, task="score", prompt_template=CHAT, labels=["Yes", "No"])
    for text in TEXTS:
        ref = hf_tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        assert eng.tokenizer.apply_template(text) == ref
        assert text_ids(eng, [text])[0] == hf_tok(ref).input_ids


@pytest.mark.parametrize("count", [1, 5])
def test_smollm2_score(smollm2, count):
    _, ckpt, hf, hf_tok = smollm2
    eng = engine_for(ckpt, task="score", prompt_template=CHAT, labels=["Yes", "No"], max_texts=8)
    texts = TEXTS[:count]
    ours = eng.score(texts)
    labels = [hf_tok("Yes").input_ids[0], hf_tok("No").input_ids[0]]
    ref = hf_score(hf, text_ids(eng, texts), labels)
    assert len(ours) == count
    for row, ref_row in zip(ours, ref):
        assert row == pytest.approx(ref_row, abs=1e-4)


SMOL_PROMPTS = [
    "What is the capital of France?",
    "Is the sky blue? Answer Yes or No.",  # the model stops (<|im_end|>) after two or three tokens
]


@pytest.mark.parametrize("width", [1, 4, 16])
@pytest.mark.parametrize("new_tokens", [1, 3, 5])
def test_smollm2_beam(smollm2, width, new_tokens):
    _, ckpt, hf, _ = smollm2
    eng = engine_for(
        ckpt,
        task="beam",
        prompt_template=CHAT.replace("{text}", "{prompt}"),
        beam_width=width,
        new_tokens=new_tokens,
        stop=["<|im_end|>"],
    )
    stop = eng.task.stop_ids
    stopped = 0
    for prompt in SMOL_PROMPTS:
        ours = eng.beam(prompt)
        ref = hf_beam(hf, text_ids(eng, [prompt])[0], width, new_tokens, stop, pad_id=stop[0])
        assert_same_beams(ours, ref)
        stopped += sum(c["token_ids"][-1] in stop for c in ours)
    if new_tokens > 2:
        assert stopped, "no candidate chose the stop token: the finished-pool path was not exercised"


# --- random Qwen2 / Qwen3 / Llama (HF directories) -----------------------------------------------
ARCHS = ["qwen2", "qwen3", "llama"]
RANDOM_TEXTS = [
    "search",
    "a small language model scores texts",
    "is this query about shopping?",
    "the lazy dog " * 12,
    "12, 345 and 6789",
]


@pytest.mark.parametrize("arch", ARCHS)
def test_random_score_one_and_many_texts(random_checkpoint, arch):
    folder, hf = random_checkpoint(arch)
    ckpt = load_checkpoint(folder)
    eng = engine_for(ckpt, task="score", labels=["yes", "no", "maybe"], max_texts=8, max_text_tokens=64)
    for texts in (RANDOM_TEXTS[:1], RANDOM_TEXTS):
        ids = text_ids(eng, texts)
        ref = hf_score(hf, ids, eng.task.label_ids)
        for row, ref_row in zip(eng.score(texts), ref):
            assert row == pytest.approx(ref_row, abs=1e-4)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_random_score_lengths_one_token_to_bound(random_checkpoint, arch):
    folder, hf = random_checkpoint(arch)
    ckpt = load_checkpoint(folder)
    longest = "the quick brown fox jumps over the lazy dog and " * 8
    bound = len(ckpt.tokenizer.encode(longest).ids)
    eng = engine_for(ckpt, task="score", labels=["yes", "no"], max_texts=4, max_text_tokens=bound)
    texts = ["a", longest, "fox", longest[:40]]
    ids = text_ids(eng, texts)
    assert len(ids[0]) == 1 and len(ids[1]) == bound
    ref = hf_score(hf, ids, eng.task.label_ids)
    for row, ref_row in zip(eng.score(texts), ref):
        assert row == pytest.approx(ref_row, abs=1e-4)


def frequent_token(hf, tokenizer, prompt_ids: list[int], width: int, new_tokens: int) -> int:
    """The token that appears most often in the candidates without any stop token (among tokens a
    stop string can name: those that decode and re-encode to themselves)."""
    counts: dict[int, int] = {}
    for ids, _ in hf_beam(hf, prompt_ids, width, new_tokens, [], pad_id=0):
        for t in ids[:-1]:  # ending earlier than the last position is what exercises the pool
            if tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False).ids == [t]:
                counts[t] = counts.get(t, 0) + 1
    return max(counts, key=counts.get)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("width", [1, 4, 16])
@pytest.mark.parametrize("new_tokens", [1, 3, 5])
def test_random_beam(random_checkpoint, arch, width, new_tokens):
    folder, hf = random_checkpoint(arch)
    ckpt = load_checkpoint(folder)
    prompt = "a small language model"
    plain = engine_for(ckpt, task="beam", beam_width=width, new_tokens=new_tokens)
    prompt_ids = text_ids(plain, [prompt])[0]
    assert_same_beams(plain.beam(prompt), hf_beam(hf, prompt_ids, width, new_tokens, [], pad_id=0))

    if new_tokens > 1:  # a stop token the model picks often: candidates end early and fill the pool
        stop_id = frequent_token(hf, ckpt.tokenizer, prompt_ids, width, new_tokens)
        stop = ckpt.tokenizer.decode([stop_id])
        eng = engine_for(ckpt, task="beam", beam_width=width, new_tokens=new_tokens, stop=[stop])
        assert eng.task.stop_ids == [stop_id]
        ours = eng.beam(prompt)
        assert_same_beams(ours, hf_beam(hf, prompt_ids, width, new_tokens, [stop_id], pad_id=stop_id))
        assert any(len(c["token_ids"]) < new_tokens for c in ours)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_random_beam_at_the_largest_bound(random_checkpoint, arch):
    """W = 400 and 5 new tokens, the largest bound the product serves, against transformers'
    generate(num_beams=400) on the same random weights (fp32): at least 99 % of its candidates
    shared, the shared ones' scores equal, the best one the same."""
    folder, hf = random_checkpoint(arch, vocab_size=1024)  # 2W tokens at least
    ckpt = load_checkpoint(folder)
    prompt = "a small language model"
    eng = engine_for(ckpt, task="beam", beam_width=400, new_tokens=5)
    prompt_ids = text_ids(eng, [prompt])[0]
    ours = eng.beam(prompt)
    ref = hf_beam(hf, prompt_ids, 400, 5, [], pad_id=0)
    scores = {tuple(ids): score for ids, score in ref}
    shared = [c for c in ours if tuple(c["token_ids"]) in scores]
    print(f"\nW=400, 5 new tokens ({arch}): {len(shared)} of {len(ref)} candidates shared with transformers")
    assert len(ours) == len(ref) == 400 and len(shared) >= 0.99 * len(ref)
    assert ours[0]["token_ids"] == list(ref[0][0])
    assert all(abs(c["score"] - scores[tuple(c["token_ids"])]) <= 5e-4 for c in shared)
